"""tpp-evaluate (tpp_tools.evaluate) on a tiny model trained by
scripts/train.sh and averaged by tpp-average-checkpoints: the scores match
sacreBLEU computed independently, the reference is checked before translating, and a
failed run never touches the results of an earlier one."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import sacrebleu
from sacremoses import MosesDetokenizer

from support import REPO, tool_env, train_command

from tpp_tools import evaluate as EVALUATE


@pytest.fixture(scope="module")
def evaluated(nmt_corpus, tmp_path_factory):
    """Train 100 updates, average the last 3 checkpoints, evaluate the test split with
    the README's command."""
    root = tmp_path_factory.mktemp("evaluate")
    corpus, data = nmt_corpus["corpus"], nmt_corpus["data"]
    # a checkpoint every update: fairseq skips checkpoint_<epoch>_<update>.pt when the
    # interval falls on an epoch's last batch, so a sparser interval could leave fewer
    # than three to average, depending on how the tiny corpus is batched
    subprocess.run(
        train_command(data, root / "ckpt", max_update=100, save_interval_updates=1),
        check=True,
        env=tool_env(),
        capture_output=True,
    )
    average = root / "ckpt" / "checkpoint_avg3.pt"
    subprocess.run(
        [
            "tpp-average-checkpoints",
            "--inputs",
            str(root / "ckpt"),
            "--num-update-checkpoints",
            "3",
            "--output",
            str(average),
        ],
        check=True,
        env=tool_env(),
        capture_output=True,
    )
    out = root / "eval"
    result = subprocess.run(
        [
            "tpp-evaluate",
            "--data",
            str(data),
            "--checkpoint",
            str(average),
            "--reference",
            str(corpus / "raw" / "test.de"),
            "--out",
            str(out),
            "--cpu",
        ],
        cwd=REPO,
        env=tool_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return {
        "root": root,
        "corpus": corpus,
        "data": data,
        "checkpoint": average,
        "out": out,
        "stdout": result.stdout,
        "stderr": result.stderr,
    }


def read_scores(path):
    fields = dict(line.split(": ", 1) for line in path.read_text().splitlines())
    return fields


def generated_lines(path, prefix):
    """Lines of fairseq-generate output starting with prefix ('H' or 'T'), in corpus order."""
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(rf"^{prefix}-(\d+)\t", line)
        if match:
            found[int(match.group(1))] = line.split("\t")[-1]
    return [found[i] for i in sorted(found)]


def folder_contents(folder):
    """{name: bytes} of everything in ``folder`` (hidden entries included)."""
    return {p.name: (p.read_bytes() if p.is_file() else "<dir>") for p in folder.iterdir()}


def run_evaluate(*args, module=False):
    """The README's command, tpp-evaluate (or, with ``module``, ``python -m
    tpp_tools.evaluate``, which it runs)."""
    command = [sys.executable, "-m", "tpp_tools.evaluate"] if module else ["tpp-evaluate"]
    return subprocess.run(
        [*command, *map(str, args)], cwd=REPO, env=tool_env(), capture_output=True, text=True
    )


def model_and_data(evaluated, out, reference=None):
    """tpp-evaluate's options for the trained model on the test split, into ``out``."""
    reference = reference or evaluated["corpus"] / "raw" / "test.de"
    return [
        "--data",
        evaluated["data"],
        "--checkpoint",
        evaluated["checkpoint"],
        "--reference",
        reference,
        "--out",
        out,
        "--cpu",
    ]


def test_detokenized_sacrebleu_and_chrf_match_direct_sacrebleu(evaluated):
    out, corpus = evaluated["out"], evaluated["corpus"]
    hypotheses = generated_lines(out / "generate-test.txt", "H")
    references = (corpus / "raw" / "test.de").read_text().splitlines()
    assert len(hypotheses) == len(references) == 40
    assert not any("@@" in h for h in hypotheses), "BPE not removed"
    detokenizer = MosesDetokenizer(lang="de")
    detokenized = [detokenizer.detokenize(h.split()) for h in hypotheses]
    # the per-sentence detokenised hypotheses, in corpus order (for significance tests)
    assert (out / "hyp.detok").read_text().splitlines() == detokenized
    metric = sacrebleu.BLEU()
    direct = metric.corpus_score(detokenized, [references])

    scores = read_scores(out / "bleu.txt")
    assert scores["sacrebleu_detok"] == f"{direct.score:.2f}"
    assert direct.score > 1.0, "the tiny model should have learnt something"
    signature = str(metric.get_signature())
    assert scores["sacrebleu_detok_signature"] == signature
    assert "tok:13a" in signature
    assert signature in evaluated["stdout"]  # printed as well as written
    # and the sacrebleu command line on the script's own detokenised file agrees
    cli = subprocess.run(
        [
            "sacrebleu",
            str(corpus / "raw" / "test.de"),
            "-i",
            str(out / "hyp.detok"),
            "-m",
            "bleu",
            "-b",
            "-w",
            "2",
        ],
        env=tool_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert cli.stdout.strip() == scores["sacrebleu_detok"]

    chrf = sacrebleu.CHRF()
    assert scores["chrf"] == f"{chrf.corpus_score(detokenized, [references]).score:.2f}"
    assert scores["chrf_signature"] == str(chrf.get_signature())


def test_tokenized_compound_split_bleu(evaluated):
    out = evaluated["out"]
    generated = out / "generate-test.txt"

    def split(line):
        return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)

    hypotheses = [split(h) for h in generated_lines(generated, "H")]
    references = [split(t) for t in generated_lines(generated, "T")]
    assert any("##AT##-##AT##" in r for r in references), "test data should have compounds"
    direct = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="none", smooth_method="none")
    scores = read_scores(out / "bleu.txt")
    assert scores["bleu_tok_compound_split"] == f"{direct.score:.2f}"
    assert "tok:none" in scores["bleu_tok_compound_split_signature"]


def test_generate_reads_in_its_own_process_and_each_step_is_timed(evaluated):
    """No loader process for fairseq-generate (none to start or shut down), and the log
    says how long translating and scoring took, so a slow evaluation shows which it was."""
    log = evaluated["stderr"]
    assert "'num_workers': 0" in log, log
    assert "'num_workers': 1" not in log, log
    assert re.search(r"tpp-evaluate: fairseq-generate exited after \d+ s", log), log
    assert re.search(r"tpp-evaluate: scored in \d+ s", log), log


def evaluate_in_python(evaluated, out, **options):
    """The Python API's evaluation of the trained model on the test split, into ``out``."""
    reference = evaluated["corpus"] / "raw" / "test.de"
    return EVALUATE.evaluate(
        evaluated["data"], evaluated["checkpoint"], reference, out, cpu=True, **options
    )


def test_python_api_returns_the_scores(evaluated, tmp_path):
    scores = evaluate_in_python(evaluated, tmp_path / "api")
    written = read_scores(evaluated["out"] / "bleu.txt")
    for key in ("sacrebleu_detok", "chrf", "bleu_tok_compound_split"):
        assert f"{scores[key]:.2f}" == written[key]
        assert scores[f"{key}_signature"] == written[f"{key}_signature"]
    assert scores["sentences"] == 40
    assert (tmp_path / "api" / "bleu.txt").read_text() == (
        evaluated["out"] / "bleu.txt"
    ).read_text()


def test_the_report_names_the_options_given_to_fairseq_generate(evaluated, tmp_path):
    # fairseq's default: the same translations
    scores = evaluate_in_python(evaluated, tmp_path / "api", generate_args=["--unkpen", "0"])
    lines = (tmp_path / "api" / "bleu.txt").read_text().splitlines()
    assert lines[2] == "generate options: --unkpen 0", lines
    written = read_scores(evaluated["out"] / "bleu.txt")
    assert f"{scores['sacrebleu_detok']:.2f}" == written["sacrebleu_detok"]
    assert "generate options" not in written, "none given: no line"


def test_refuses_to_overwrite_without_force(evaluated):
    before = folder_contents(evaluated["out"])
    result = run_evaluate(
        "--data",
        evaluated["data"],
        "--checkpoint",
        evaluated["checkpoint"],
        "--reference",
        evaluated["corpus"] / "raw" / "test.de",
        "--out",
        evaluated["out"],
        "--cpu",
    )
    assert result.returncode == 2, result.stderr
    assert f"{evaluated['out'] / 'bleu.txt'}: already exists (use --force" in result.stderr
    assert folder_contents(evaluated["out"]) == before


def test_failed_forced_run_keeps_the_previous_results(evaluated, tmp_path):
    """Issue 11.1: --force with a run that fails must leave the earlier results whole."""
    out = tmp_path / "eval"
    shutil.copytree(evaluated["out"], out)
    before = folder_contents(out)
    base = [
        "--data",
        evaluated["data"],
        "--checkpoint",
        evaluated["checkpoint"],
        "--out",
        out,
        "--cpu",
        "--force",
    ]
    reference = evaluated["corpus"] / "raw" / "test.de"
    short = tmp_path / "short.de"
    short.write_text("\n".join(reference.read_text().splitlines()[:-1]) + "\n")
    # a reference of the wrong length
    result = run_evaluate(*base, "--reference", short)
    assert result.returncode == 2, result.stderr
    assert folder_contents(out) == before
    # fairseq-generate itself failing, after it has started (an option it does not know)
    result = run_evaluate(*base, "--reference", reference, "--", "--no-such-generate-option")
    assert result.returncode == 1, result.stderr
    assert "fairseq-generate failed" in result.stderr
    assert folder_contents(out) == before  # no temporary files left behind either
    # and a forced run that succeeds replaces them, an earlier one's of another split too
    # (other files are the user's)
    bleu = (out / "bleu.txt").read_text()
    (out / "bleu.txt").write_text(bleu.replace(" split test (", " split valid ("))
    (out / "generate-valid.txt").write_text("stale\n")
    result = run_evaluate(*base, "--reference", reference)
    assert result.returncode == 0, result.stderr
    assert folder_contents(out) == before


def test_reference_is_checked_before_translating_and_counted_like_sacrebleu(evaluated, tmp_path):
    """Issue 11.2: the reference's line count is checked before fairseq-generate runs,
    and a last line without a final newline counts."""
    reference = evaluated["corpus"] / "raw" / "test.de"
    base = ["--data", evaluated["data"], "--checkpoint", evaluated["checkpoint"], "--cpu"]
    # no final newline: 40 lines all the same, and the same scores
    unterminated = tmp_path / "unterminated.de"
    unterminated.write_text(reference.read_text().rstrip("\n"))
    result = run_evaluate(*base, "--reference", unterminated, "--out", tmp_path / "a")
    assert result.returncode == 0, result.stderr
    scores = read_scores(tmp_path / "a" / "bleu.txt")
    expected = read_scores(evaluated["out"] / "bleu.txt")
    for key in ("sacrebleu_detok", "chrf", "bleu_tok_compound_split"):
        assert scores[key] == expected[key]

    # a reference one line short, together with a fairseq-generate option that would make
    # generation fail: the reference error (exit 2) proves it was checked first
    short = tmp_path / "short.de"
    short.write_text("\n".join(reference.read_text().splitlines()[:-1]) + "\n")
    result = run_evaluate(
        *base, "--reference", short, "--out", tmp_path / "b", "--", "--no-such-generate-option"
    )
    assert result.returncode == 2, result.stderr
    assert (
        f"{short}: 39 lines, but split 'test' of {evaluated['data']} has 40 sentences"
        in result.stderr
    )
    assert "translating" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "problem",
    [
        "missing",
        "not utf-8",
        "no such split",
        "bad checkpoint",
        "folder checkpoint",
        "unwritable out",
    ],
)
def test_bad_input_is_named_without_a_traceback(evaluated, tmp_path, problem):
    args = {
        "--data": evaluated["data"],
        "--checkpoint": evaluated["checkpoint"],
        "--reference": evaluated["corpus"] / "raw" / "test.de",
        "--out": tmp_path / "out",
    }
    if problem == "missing":
        args["--reference"] = tmp_path / "nowhere.de"
        expected = f"{tmp_path / 'nowhere.de'}: no such file"
    elif problem == "not utf-8":
        bad = tmp_path / "latin1.de"
        lines = args["--reference"].read_bytes().split(b"\n")
        lines[2] = "Café".encode("latin-1")
        bad.write_bytes(b"\n".join(lines))
        args["--reference"] = bad
        expected = f"{bad}:3: invalid UTF-8 byte b'\\xe9'"
    elif problem == "no such split":
        expected = f"{evaluated['data']}: no 'dev' split"
    elif problem == "folder checkpoint":
        args["--checkpoint"] = evaluated["checkpoint"].parent
        expected = f"{evaluated['checkpoint'].parent}: a folder, not a checkpoint file"
    elif problem == "unwritable out":  # a file where the folder would go: found before translating
        (tmp_path / "taken").write_text("a file\n")
        args["--out"] = tmp_path / "taken" / "out"
        expected = "cannot create or write into this --out folder"
    else:
        damaged = tmp_path / "damaged.pt"
        damaged.write_bytes(evaluated["checkpoint"].read_bytes()[:1000])
        args["--checkpoint"] = damaged
        expected = f"{damaged}: truncated or damaged checkpoint"
    extra = ["--split", "dev"] if problem == "no such split" else []
    result = run_evaluate(*[x for pair in args.items() for x in pair], "--cpu", *extra, module=True)
    assert result.returncode == 2
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_reference_that_is_not_the_split_s_target_is_warned_about(evaluated, tmp_path):
    """Issue 49.6: scoring against the source side passed silently. Checked against the
    binarized target before translating: a warning naming the reference; the right
    reference raises none."""
    source = evaluated["corpus"] / "raw" / "test.en"
    result = run_evaluate(*model_and_data(evaluated, tmp_path / "out", reference=source))
    assert result.returncode == 0, result.stderr
    warning = f"warning: {source} does not read like the target side of split 'test'"
    assert warning in result.stderr, result.stderr
    assert result.stderr.index(warning) < result.stderr.index("translating")
    assert "does not read like" not in evaluated["stderr"]


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--beam", "0", "--beam must be a whole number of at least 1, not 0"),
        ("--max-tokens", "0", "--max-tokens must be a whole number of at least 1, not 0"),
        ("--lenpen", "nan", "--lenpen must be a finite number, not nan"),
    ],
)
def test_a_beam_or_batch_of_zero_is_refused_before_translating(
    evaluated, tmp_path, option, value, message
):
    """Issue 49.6: --beam 0 crashed in fairseq; a length penalty of nan scored silently."""
    result = run_evaluate(*model_and_data(evaluated, tmp_path / "out"), option, value)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gen-subset", "valid"], "--gen-subset after --: use --split and --checkpoint"),
        (["--path=other.pt"], "--path after --: use --split and --checkpoint"),
        (["--tokenizer", "moses"], "--tokenizer after --: tpp-evaluate removes the BPE"),
        (["--beam", "1"], "--beam after --: give it before --"),
        (["--lenpen=2"], "--lenpen after --: give it before --"),
    ],
)
def test_generate_options_it_sets_itself_are_refused_after_the_separator(
    evaluated, tmp_path, extra, message
):
    """fairseq-generate keeps the last value of an option: after ``--`` these would
    translate another split or checkpoint, or score differently tokenised text, under
    the names tpp-evaluate's report gives."""
    result = run_evaluate(*model_and_data(evaluated, tmp_path / "out"), "--", *extra)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_a_sentence_over_the_length_limit_is_named_before_translating(evaluated, tmp_path):
    """Issue 49.6: fairseq-generate refused a split with one sentence over the limit
    after loading everything, with a hint about an option that drops it from the score.
    Here the limit is the task's, lowered through fairseq-generate's own option."""
    result = run_evaluate(
        *model_and_data(evaluated, tmp_path / "out"),
        "--",
        "--max-source-positions",
        "3",
    )
    assert result.returncode == 2, result.stderr
    assert f"{evaluated['data']}: sentence 0 of split 'test' (line 1 of its " in result.stderr
    assert "the model takes at most 3 and 1024" in result.stderr, result.stderr
    assert "translating" not in result.stderr and not (tmp_path / "out").exists()


def test_a_damaged_split_is_named_before_translating(evaluated, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(evaluated["data"], data)
    damaged = data / "test.en-de.en.bin"
    damaged.write_bytes(damaged.read_bytes()[:500])
    options = model_and_data(evaluated, tmp_path / "out")
    options[options.index("--data") + 1] = data
    result = run_evaluate(*options)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"tpp-evaluate: error: {damaged}: 500 bytes, but its index" in result.stderr
    assert not (tmp_path / "out").exists()


def test_one_evaluation_at_a_time_in_an_out_folder(evaluated, tmp_path):
    """Two evaluations into one --out: the second is refused, naming the first, rather
    than replacing its results without --force once they are published."""
    import os

    from tpp_pipeline.lock import work_dir_lock

    out = tmp_path / "out"
    with work_dir_lock(out, lock_name=EVALUATE.LOCK_NAME):  # as a running evaluation holds it
        result = run_evaluate(*model_and_data(evaluated, out))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "another evaluation is using this --out folder (process " in result.stderr
    assert f"process {os.getpid()} on host" in result.stderr, result.stderr[-3000:]
    assert not (out / "bleu.txt").exists()


def test_a_batch_smaller_than_a_sentence_is_named_before_translating(evaluated, tmp_path):
    result = run_evaluate(*model_and_data(evaluated, tmp_path / "out"), "--max-tokens", "3")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "--max-tokens 3 is smaller than sentence " in result.stderr, result.stderr[-3000:]
    assert "give at least" in result.stderr and not (tmp_path / "out").exists()


def test_a_reference_that_is_a_folder_is_named_as_a_folder(evaluated, tmp_path):
    """Issue 33.12: --reference DIR said "no such file"."""
    folder = evaluated["corpus"] / "raw"
    result = run_evaluate(
        "--data",
        evaluated["data"],
        "--checkpoint",
        evaluated["checkpoint"],
        "--reference",
        folder,
        "--out",
        tmp_path / "out",
        "--cpu",
    )
    assert result.returncode == 2, result.stderr
    assert (
        f"{folder}: is a folder, not a file (--reference takes the raw reference file "
        "itself, one sentence per line)" in result.stderr
    ), result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_the_tokenised_bleu_raises_no_warning_about_tokenised_input(caplog):
    """The tokenised BLEU is tokenised on purpose: sacreBLEU's "you forgot to detokenize"
    warning (which the demo printed, and a newcomer read as a bug) is not raised for it;
    detokenised output is still scored as before."""
    import logging

    from tpp_tools.evaluate import score_all

    tokenised = ["das ist ein Haus ."] * 120
    with caplog.at_level(logging.WARNING, logger="sacrebleu"):
        scores, _ = score_all(tokenised, tokenised, ["das ist ein Haus."] * 120, "de")
    assert "detokenize" not in caplog.text, caplog.text
    assert float(scores["bleu_tok_compound_split"]) == pytest.approx(100.0)
    assert float(scores["sacrebleu_detok"]) == pytest.approx(100.0)


def _parent(pid):
    """The parent of process ``pid`` (Linux's /proc), or None once it has ended."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def test_ctrl_c_stops_the_evaluation_without_a_traceback(evaluated, tmp_path):
    """Ctrl-C reaches the terminal's whole foreground process group: fairseq-generate
    printed its KeyboardInterrupt traceback (when it won the race with the evaluation's
    own clean-up). It now runs in a process group of its own, which Ctrl-C does not
    reach, and the evaluation stops it, keeping the earlier results."""
    out = tmp_path / "eval"
    shutil.copytree(evaluated["out"], out)
    before = folder_contents(out)
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as handle:
        process = subprocess.Popen(
            ["tpp-evaluate", *map(str, model_and_data(evaluated, out)), "--force"],
            stdout=subprocess.DEVNULL,
            stderr=handle,
            env=tool_env(),
            start_new_session=True,  # its own group, as a terminal's foreground job
        )
    try:
        deadline = time.time() + 120
        while "INFO:fairseq" not in stderr.read_text():  # fairseq-generate's first lines
            assert process.poll() is None and time.time() < deadline, stderr.read_text()
            time.sleep(0.05)
        children = [p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == process.pid]
        assert children and all(os.getpgid(int(p)) != process.pid for p in children), children
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C does
        assert process.wait(timeout=60) == 130
    finally:
        if process.poll() is None:
            process.kill()
    said = stderr.read_text()
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said[-3000:]
    assert folder_contents(out) == before
