"""tpp-study: what identifies a run, and its plan on a prepared data folder."""

import argparse
import gzip
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support import binarize_tagged, run, run_main_here
from tpp_tools import study
from tpp_tools.train import take_lock

# Run folders of a study planned by scripts/run_study.py before the runner moved into
# tpp_tools, on the data folder of data_folder() below (run version 1): a study started
# then is resumed (its finished runs reused) only if these stay the same.
RUN_FOLDERS_V1 = {
    "cpu": [
        "transformer-s1-c85b93f2",
        "transformer-s2-63050a12",
        "control-s1-83b39d14",
        "control-s2-9500e6e6",
        "hybrid-s1-3dc1f37d",
        "hybrid-s2-9787e633",
        "hybrid_tags-s1-8352a9d9",
        "hybrid_tags-s2-66490b27",
    ],
    # (gpu: as the configuration has been since it became pre-LN with 8k BPE)
    "gpu": [
        "transformer-s1-d8edae1e",
        "transformer-s2-85c04628",
        "control-s1-e0457659",
        "control-s2-c58bcc6a",
        "hybrid-s1-e736b1b3",
        "hybrid-s2-654cba86",
        "hybrid_tags-s1-5bf0ba10",
        "hybrid_tags-s2-8ea97e4f",
    ],
}
# The same at run version 2 (transformer_pp's layers built in fairseq's order again).
RUN_FOLDERS = {
    "cpu": [
        "transformer-s1-f3eb4a60",
        "transformer-s2-0682d0fb",
        "control-s1-29bcae9d",
        "control-s2-d58e7218",
        "hybrid-s1-6982a150",
        "hybrid-s2-072d545d",
        "hybrid_tags-s1-60e4f29c",
        "hybrid_tags-s2-3b463723",
    ],
    "gpu": [
        "transformer-s1-403107f1",
        "transformer-s2-393ac0df",
        "control-s1-20623def",
        "control-s2-f1df6459",
        "hybrid-s1-f79f357c",
        "hybrid-s2-6593f16a",
        "hybrid_tags-s1-dcaf0b6b",
        "hybrid_tags-s2-43400510",
    ],
}


def data_folder(folder):
    """A stand-in data folder: the fingerprint reads dictionaries and .idx files only."""
    folder.mkdir()
    (folder / "dict.en.txt").write_text("a 1\nb 2\n")
    (folder / "dict.de.txt").write_text("a 1\nb 2\n")
    (folder / "train.en-de.en.idx").write_bytes(b"x" * 30)
    (folder / "test.en-de.de.idx").write_bytes(b"y" * 30)
    return folder


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    """The toy tagged corpus (``text``, its raw test target ``reference``) and its data
    folder (``data``), made once for this module's tests, which only read them."""
    root = tmp_path_factory.mktemp("tagged")
    data = binarize_tagged(root / "text", root / "data-bin", n_train=120)
    return SimpleNamespace(text=root / "text", data=data, reference=root / "text" / "test.tgt")


def in_process(command, check=True):
    """``command`` (``tpp-study ...``) run by tpp-study's ``main`` in this process
    (:func:`support.run_main_here`); with ``check``, raise with its output when it fails."""
    assert str(command[0]) == "tpp-study", command
    shown = run_main_here(study.main, command)
    if check and shown.returncode != 0:
        raise AssertionError(
            f"tpp-study failed ({shown.returncode}): {' '.join(map(str, command[1:]))}\n"
            f"--- stdout\n{shown.stdout[-4000:]}\n--- stderr\n{shown.stderr[-6000:]}"
        )
    return shown


@pytest.mark.parametrize("version, folders", [(1, RUN_FOLDERS_V1), (2, RUN_FOLDERS)])
def test_run_identity_changes_with_the_run_version_only(tmp_path, monkeypatch, version, folders):
    from dataclasses import replace

    assert study.RUN_VERSION == 2
    monkeypatch.setattr(study.runs, "RUN_VERSION", version)
    data = data_folder(tmp_path / "data")
    assert study.fingerprint(data) == "9ef634b2722143c4"
    for config, device in (("cpu", "cpu"), ("gpu", "cuda")):
        args = argparse.Namespace(
            variants=list(study.VARIANTS),
            seeds=[1, 2],
            extra=[],
            device=device,
            out=tmp_path / "out",
        )
        # the configurations' defaults when these runs were made (cpu: peak 2e-3, and the
        # paper's unscaled heads in both)
        made = dict(conv_head_scaling="none", **({"lr": 2e-3} if config == "cpu" else {}))
        runs = study.plan_runs(args, replace(study.CONFIGS[config], **made), data)
        assert sorted(r.folder.name for r in runs) == sorted(folders[config]), config
        assert all(r.folder.parent == tmp_path / "out" / "runs" for r in runs)


#: the configuration's fields when the runs of RUN_FOLDERS_V1 were made
FIRST_FIELDS = {
    *("embed_dim", "ffn_dim", "heads", "layers", "max_update", "max_tokens", "update_freq"),
    *("lr", "warmup_updates", "dropout", "attention_dropout", "activation_dropout"),
    *("label_smoothing", "average", "save_interval_updates", "validate_interval_updates"),
    *("dtype", "bpe_merges", "max_len", "extra"),
}


def test_every_field_added_since_the_first_runs_has_its_legacy_default():
    """Issue 48.4: a field added to the configuration keeps the identity of the runs made
    before it only through LEGACY_DEFAULTS, the value they all had; the table holds every
    such field, and a field at its legacy value is not part of any run's identity."""
    from dataclasses import fields, replace

    from tpp_tools.study.config import LEGACY_DEFAULTS, identity_config

    names = {f.name for f in fields(study.Config)}
    assert names == FIRST_FIELDS | set(LEGACY_DEFAULTS) and not FIRST_FIELDS & set(LEGACY_DEFAULTS)
    at_legacy = replace(study.CONFIGS["gpu"], **LEGACY_DEFAULTS)
    for variant in study.VARIANTS:
        assert set(identity_config(at_legacy, variant)) == FIRST_FIELDS, variant


def dry_run(tmp_path, tagged, variants, *options, check=True):
    """``tpp-study --dry-run`` of ``variants`` (seeds 1 and 2, the CPU) on the tiny tagged
    data folder, with ``options``; its output and the study folder."""
    out = tmp_path / "study"
    shown = in_process(
        [
            "tpp-study",
            "--config",
            "cpu",
            "--data",
            tagged.data,
            "--test-reference",
            tagged.reference,
            "--out",
            out,
            "--variants",
            variants,
            "--seeds",
            "1,2",
            "--device",
            "cpu",
            *options,
            "--dry-run",
        ],
        check=check,
    )
    return shown, out


def test_a_resumed_trainings_eta_and_time_count_from_the_studys_own_clock(tmp_path):
    """The ETA is the time per update since the training last started, times the updates
    left, and a run's training time adds up its trainings, each until its command
    returned (until its log's last line where it never did). fairseq's ``wall`` restarts at 0 in a resumed training: read from it, a resumed
    run's ETA was 0 and its record kept the last training's seconds only."""
    import time

    from tpp_tools.study.runs import (
        CLOCK,
        clock_seconds,
        eta_text,
        start_clock,
        stop_clock,
        training_eta,
    )

    run = SimpleNamespace(name="hybrid-s1", folder=tmp_path)
    log_file = tmp_path / "train.log"

    def logged(*records):  # fairseq's JSON records: numbers as strings
        with log_file.open("a") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)

    def started_ago(seconds):
        clock = json.loads((tmp_path / CLOCK).read_text())
        clock["started"] = time.time() - seconds
        (tmp_path / CLOCK).write_text(json.dumps(clock))
        return clock["started"]

    assert training_eta(run, 2200) is None and eta_text(None) == "—"
    clock = start_clock(run)
    assert clock["earlier"] == 0 and clock["updates"] == 0
    logged({"num_updates": "100", "wall": "50"}, {"valid_loss": "6.9", "valid_num_updates": "100"})
    logged({"num_updates": "200", "wall": "120"})
    first = started_ago(120)
    assert training_eta(run, 2200) == pytest.approx(2000 * 120 / 200, rel=0.02)
    assert eta_text(training_eta(run, 2200)) == "20 min"
    assert training_eta(run, 150) == 0, "past the end: nothing left"
    os.utime(log_file, (first + 100, first + 100))  # stopped: its log's last line 100 s in
    assert clock_seconds(run) == pytest.approx(100)

    # resumed from its checkpoint of update 150 (the log went on to 200 before it stopped)
    (tmp_path / "checkpoints").mkdir()
    torch.save(
        {"model": {}, "optimizer_history": [{"num_updates": 150}]},
        tmp_path / "checkpoints" / "checkpoint_last.pt",
    )
    clock = start_clock(run)
    assert clock["earlier"] == pytest.approx(100) and clock["updates"] == 150
    assert training_eta(run, 2200) is None, "no update yet since it resumed"
    logged({"num_updates": "160", "wall": "0"})  # (below the 200 the log had reached)
    second = started_ago(50)
    assert training_eta(run, 2200) == pytest.approx(2040 * 50 / 10, rel=0.02)
    logged({"num_updates": "250", "wall": "0"})
    assert training_eta(run, 2200) == pytest.approx(1950 * 50 / 100, rel=0.02)
    os.utime(log_file, (second + 60, second + 60))
    assert clock_seconds(run) == pytest.approx(160)

    # its command returned, 70 s in: the clock keeps when, and a copy of the folder made
    # later (the log's time that of the copy) still took 170 s
    stop_clock(run)
    clock = json.loads((tmp_path / CLOCK).read_text())
    clock["stopped"] = second + 70
    (tmp_path / CLOCK).write_text(json.dumps(clock))
    os.utime(log_file, (second + 3600, second + 3600))
    assert clock_seconds(run) == pytest.approx(170)
    assert start_clock(run)["earlier"] == pytest.approx(170), "resumed once more"
    (tmp_path / CLOCK).unlink()
    assert math.isnan(clock_seconds(run)), "a run trained before clocks were kept"


def test_a_running_runs_state_names_its_process_and_whole_start_time(tmp_path):
    import os
    import re
    import types

    from tpp_tools.study.commands import RunLock
    from tpp_tools.study.runs import run_state

    run = types.SimpleNamespace(folder=tmp_path)
    assert run_state(run) == "not started"
    lock = RunLock(tmp_path, "transformer-s1")
    try:
        state = run_state(run)
    finally:
        lock.close()
    assert re.fullmatch(
        rf"running \(process {os.getpid()} on host \S+, since " r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\)",
        state,
    ), state
    assert run_state(run) == "not started", "a lock no process holds"


def test_dry_run_plans_every_variant_and_seed(tmp_path, tagged):
    shown, out = dry_run(tmp_path, tagged, "transformer,hybrid+tags")
    lines = shown.stdout.splitlines()
    planned = [line for line in lines if " [to train] " in line]
    assert [line.split()[0] for line in planned] == [
        "transformer-s1",
        "hybrid+tags-s1",
        "transformer-s2",
        "hybrid+tags-s2",
    ], shown.stdout
    commands = [shlex.split(line) for line in lines if line.strip().startswith("tpp-train")]
    assert len(commands) == 4
    first, last = commands[0], commands[-1]
    assert first[first.index("--arch") + 1] == "transformer"
    assert last[last.index("--arch") + 1] == "transformer_pp"
    assert last[last.index("--task") + 1] == "translation_with_tags"
    assert last[last.index("--user-dir") + 1].endswith("tpp_plugin")
    assert not (out / "runs").exists(), "a dry run trains nothing"


@pytest.mark.parametrize(
    "extra, said",
    [
        ([], "cannot create or write into this study folder (--out)"),
        (["--dry-run"], "cannot be written"),  # (said without making the folder)
    ],
)
def test_a_study_folder_that_cannot_be_written_is_an_error(tmp_path, extra, said):
    (tmp_path / "taken").write_text("a file, not a folder\n")
    shown = in_process(
        [
            "tpp-study",
            "--data",
            tmp_path,
            "--test-reference",
            tmp_path / "taken",
            "--out",
            tmp_path / "taken" / "study",
            "--device",
            "cpu",
            *extra,
        ],
        check=False,
    )
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stderr
    assert said in shown.stderr
    assert shown.stderr.count(f"{tmp_path / 'taken' / 'study'}: ") == 1, "named once"


def test_a_test_sentence_longer_than_the_model_takes_is_refused_before_training(tmp_path):
    """Issue 49.6: a 10,000-word test sentence failed every run's translation after all
    the training. The study checks the valid and test splits against fairseq's limit
    (1,024 tokens) once the data is there, naming the sentence."""
    from support import binarize, lexicon_pairs, write_corpus

    pairs = lexicon_pairs((60, 10, 10), 1)
    long_line = " ".join([pairs["test"][3][0]] * 300)  # over 1,024 tokens
    pairs["test"][3] = (long_line, pairs["test"][3][1])
    write_corpus(tmp_path / "text", pairs)
    data = binarize(tmp_path / "text", tmp_path / "bin")
    shown = in_process(
        [
            "tpp-study",
            "--data",
            data,
            "--test-reference",
            tmp_path / "text" / "test.tgt",
            "--out",
            tmp_path / "study",
            "--device",
            "cpu",
            "--variants",
            "transformer",
        ],
        check=False,
    )
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stderr
    assert f"{data}: sentence 3 of split 'test' (line 4 of its src and tgt files) is " in (
        shown.stderr
    )
    assert "the model takes at most 1024 and 1024" in shown.stderr
    assert not list((tmp_path / "study").glob("runs/*/checkpoint*.pt")), "nothing trained"


def test_only_runs_the_runs_it_names(tmp_path, tagged):
    shown, _ = dry_run(
        tmp_path, tagged, "transformer,hybrid+tags", "--only", "hybrid+tags-s2,transformer-s1"
    )
    planned = [line.split()[0] for line in shown.stdout.splitlines() if " [to train] " in line]
    assert planned == ["transformer-s1", "hybrid+tags-s2"], shown.stdout
    refused, _ = dry_run(
        tmp_path / "again", tagged, "transformer,hybrid+tags", "--only", "hybrid-s1", check=False
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "tpp-study: error: --only: hybrid-s1 not among this study's runs" in refused.stderr


def test_a_step_past_its_time_limit_is_stopped_and_tried_once_more(tmp_path, capsys):
    """A translation that never exits (fairseq-generate once printed its last line and
    hung) costs one try: stopped at the limit with a log line, then run again."""
    from tpp_tools.study.commands import StepTimeout
    from tpp_tools.study.runs import _step

    marker = tmp_path / "tried"
    # hangs on its first call, succeeds on its second
    once = (
        "import pathlib, sys, time\n"
        f"m = pathlib.Path({str(marker)!r})\n"
        "if not m.exists():\n"
        "    m.write_text('1')\n"
        "    time.sleep(120)\n"
        "print('done')\n"
    )
    run_ = study.Run("hybrid", 1, tmp_path, [], {})
    log_path = tmp_path / "run.log"
    _step(run_, "translating", [sys.executable, "-c", once], log_path, None, 3)
    said = capsys.readouterr().out
    assert (
        "hybrid-s1: translating stopped at its time limit of 3 s (--step-timeout); trying once more"
        in said
    )
    assert log_path.read_text().splitlines()[-1] == "done"
    assert "stopped after its time limit of 3 s" in log_path.read_text()
    # a step that hangs every time fails the run, naming the limit, after two tries
    hang = [sys.executable, "-c", "import time; time.sleep(120)"]
    with pytest.raises(
        study.StudyError, match="translating stopped at its time limit of 1 s twice"
    ):
        _step(run_, "translating", hang, log_path, None, 1)
    with pytest.raises(StepTimeout):
        from tpp_tools.study.commands import run_command

        run_command(hang, log_path, timeout=1)


def test_long_steps_log_their_progress_and_keep_their_time_limit(tmp_path, capsys, monkeypatch):
    """A study's log said "training" and then nothing until "done": a training logs its
    update, last validation loss and ETA, a translation its sentences and ETA, every
    PROGRESS_EVERY seconds; the step's time limit holds all the same."""
    from tpp_tools.study import commands
    from tpp_tools.study.runs import CLOCK, _step, training_progress, translation_progress

    monkeypatch.setattr(commands, "PROGRESS_EVERY", 0.3)
    run_ = study.Run("hybrid", 1, tmp_path, [], {})
    (tmp_path / "train.log").write_text(
        '{"epoch": 1, "num_updates": "100", "wall": "60", "loss": "7.1"}\n'
        '{"epoch": 1, "valid_loss": "6.9", "valid_nll_loss": "6.512", "valid_num_updates": "100"}\n'
    )
    clock = {"earlier": 0, "started": time.time() - 60, "updates": 0}  # (started 60 s ago)
    (tmp_path / CLOCK).write_text(json.dumps(clock))
    output = tmp_path / "eval" / ".evaluate-host-1-abc" / "generate-test.txt"
    output.parent.mkdir(parents=True)
    output.write_text("S-0\ta\nH-0\t-0.1\tb\nS-1\tc\nH-1\t-0.2\td\n")
    calls = []
    step = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    _step(
        run_, "translating", step, tmp_path / "run.log", None, 30, progress=lambda: calls.append(1)
    )
    assert 3 <= len(calls) <= 6, calls
    with pytest.raises(study.StudyError, match="time limit of 1 s twice"):
        _step(run_, "translating", step, tmp_path / "run.log", None, 1, progress=lambda: None)

    class Cfg:
        max_update = 400

    training_progress(run_, Cfg())
    translation_progress(run_, 10)
    said = capsys.readouterr().out
    assert "hybrid-s1: training, update 100 of 400, valid NLL 6.512, ETA 3 min" in said, said
    assert "hybrid-s1: translating, 2 of 10 sentences, ETA " in said, said


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--data {missing}: no such folder"),
        (["--parallel", "0"], "--parallel must be at least 1, not 0"),
        (["--threads", "0"], "--threads must be at least 1, not 0"),
        (["--step-timeout", "0"], "--step-timeout must be positive, not 0"),
        (["--step-timeout", "nan"], "--step-timeout must be positive, not nan"),
        (["--seeds", "1,2147483648"], "--seeds: 2147483648 is not a seed fairseq takes"),
        (["--seeds", "1,1"], "--seeds: a seed is named twice (one run would be counted as two)"),
        (["--variants", ","], "--variants: name at least one"),
        (["--max-update", "0"], "--max-update must be at least 1, not 0"),
        (["--average", "0"], "--average must be at least 1, not 0"),
        (["--warmup-updates", "0"], "--warmup-updates must be at least 1, not 0"),
        (["--lr", "0"], "--lr must be positive, not 0.0"),
        (["--layers", "0"], "--layers must be at least 1, not 0"),
        (["--embed-dim", "32", "--heads", "3"], "--embed-dim 32 is not divisible by --heads 3"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1), not 1.5"),
        (["--valid-size", "0"], "--valid-size must be at least 1, not 0"),
        (["--workers", "0"], "--workers must be at least 1, not 0"),
        (["--bootstrap-samples", "0"], "--bootstrap-samples must be at least 1, not 0"),
        (["--gen-max-tokens", "-1"], "--gen-max-tokens must be at least 1, not -1"),
        (["-s", "en", "-t", "en"], "-s and -t are both 'en'"),
        (["--only", "transfomer-s1"], "--only: transfomer-s1 not among this study's runs"),
        (
            ["--pack", "/dev/null/r.tar.gz"],
            "--pack /dev/null/r.tar.gz: cannot be written (/dev/null",
        ),
    ],
)
def test_bad_input_is_an_error_naming_it(tmp_path, extra, message):
    missing = tmp_path / "nowhere"
    shown = in_process(
        [
            "tpp-study",
            "--data",
            missing,
            "--test-reference",
            tmp_path / "ref",
            "--out",
            tmp_path / "out",
            "--device",
            "cpu",
            *extra,
        ],
        check=False,
    )
    assert shown.returncode == 2
    assert "tpp-study: error: " + message.format(missing=missing) in shown.stderr
    assert "Traceback" not in shown.stderr


def _record(folder):
    return _record_of((folder / "record.json.gz").read_bytes())


def _record_of(data):
    return json.loads(gzip.decompress(data))


def _tables(out):
    """The report's table rows and the bootstrap figures of its summary."""
    rows = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("| (")]
    summary = json.loads((out / "summary.json").read_text())
    return rows, summary["bootstrap"], summary["signatures"]


@pytest.mark.slow
def test_study_end_to_end_report_significance_reuse_and_a_new_budget(tmp_path, tagged):
    """Two variants x two seeds of a few updates on a toy corpus: the report and its
    columns, bootstrap figures equal to sacreBLEU's own paired test on the runs'
    translations, a re-run that trains nothing, and a changed budget that is new runs."""

    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    data, reference = tagged.data, tagged.reference
    out = tmp_path / "study"
    command = [
        "tpp-study",
        "--config",
        "cpu",
        "--data",
        data,
        "--test-reference",
        reference,
        "--out",
        out,
        "--variants",
        "transformer,hybrid+tags",
        "--seeds",
        "1,2",
        "--device",
        "cpu",
        "--parallel",
        "2",
        "--embed-dim",
        "32",
        "--ffn-dim",
        "64",
        "--heads",
        "4",
        "--layers",
        "2",
        "--max-tokens",
        "256",
        "--warmup-updates",
        "2",
        "--bootstrap-samples",
        "50",
    ]
    run(command + ["--max-update", "4"], timeout=900)

    report = (out / "report.md").read_text()
    for column in (
        "BLEU (mean over seeds ± 95% CI)",
        "chrF (mean)",
        "tok. BLEU, compound split (mean)",
        "bootstrap BLEU: mean ± 95% CI",
        "p vs (a)",
        "valid NLL",
        "train words/s",
    ):
        assert column in report, column
    assert "| (a) transformer |" in report and "| (d) hybrid+tags |" in report
    assert "![learning curves](curves.png)" in report and (out / "curves.png").stat().st_size > 0
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert [name.rsplit("-", 1)[0] for name in runs] == [
        "hybrid_tags-s1",
        "hybrid_tags-s2",
        "transformer-s1",
        "transformer-s2",
    ]

    # the significance figures are sacreBLEU's paired bootstrap on the seeds' translations
    summary = json.loads((out / "summary.json").read_text())
    refs = reference.read_text(encoding="utf-8").splitlines()
    systems = []
    for variant in ("transformer", "hybrid+tags"):
        hyps = []
        for seed in (1, 2):
            folder = summary["runs"][f"{variant}-s{seed}"]["folder"]
            hyps += (Path(folder) / "eval" / "hyp.detok").read_text(encoding="utf-8").splitlines()
        systems.append((variant, hyps))
    signatures, scores = PairedTest(
        systems, {"BLEU": BLEU(), "chrF": CHRF()}, [refs * 2], test_type="bs", n_samples=50
    )()
    assert (
        summary["signatures"]["BLEU"] == str(signatures["BLEU"])
        and "bs:50" in summary["signatures"]["BLEU"]
    )
    ours = summary["bootstrap"]["hybrid+tags"]["BLEU"]
    theirs = scores["BLEU"][1]
    assert (ours["mean"], ours["ci"], ours["p_value"]) == (theirs.mean, theirs.ci, theirs.p_value)
    assert f"{theirs.p_value:.4f}" in report

    # --status: every run's state, updates and last validation loss
    shown = in_process(command + ["--max-update", "4", "--status"]).stdout
    assert shown.count(" | finished | 4 | ") == 4, shown
    assert "| training ETA |" in shown and shown.count(" | — | ") >= 4, "finished: no ETA"

    # a re-run reuses every finished run: nothing trained, averaged or translated again
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/eval/bleu.txt")}
    stamps.update({p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/checkpoint_avg.pt")})
    again = in_process(command + ["--max-update", "4"])
    assert ": training (" not in again.stdout and ": translating" not in again.stdout, again.stdout
    assert again.stdout.count(": done") == 4
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps

    # finished means finished: a run trained to the end but not marked so (a study killed
    # in between) is not trained again; a truncated translation (a study killed before
    # the run's record was written) is done again
    first = next((out / "runs").glob("transformer-s1-*"))
    last = first / "checkpoints" / "checkpoint_last.pt"
    averaged = first / "checkpoint_avg.pt"
    averaged_at = averaged.stat().st_mtime_ns
    record = (first / "record.json.gz").read_bytes()
    (first / "record.json.gz").unlink()
    (first / "train.done").unlink()
    before = last.stat().st_mtime_ns
    hyp = first / "eval" / "hyp.detok"
    translations = hyp.read_text(encoding="utf-8")
    hyp.write_text("".join(translations.splitlines(keepends=True)[:5]), encoding="utf-8")
    again = run(command + ["--max-update", "4"], timeout=900)
    assert ": training (" not in again.stdout, again.stdout
    assert (
        last.stat().st_mtime_ns == before and "found finished" in (first / "train.done").read_text()
    )
    assert (
        again.stdout.count(": translating") == 1 and hyp.read_text(encoding="utf-8") == translations
    )
    assert ": averaging" not in again.stdout and averaged.stat().st_mtime_ns == averaged_at
    # the same run, the same record, byte for byte (but the time it was written)
    assert _record(first)["statistics"] == _record_of(record)["statistics"]

    # --report-only: the report of what has finished, the rest named; nothing trained
    partial = in_process(command + ["--max-update", "4", "--seeds", "1,2,3", "--report-only"])
    assert (
        ": training (" not in partial.stdout and ": translating" not in partial.stdout
    ), partial.stdout
    report = (out / "report.md").read_text()
    assert "Not finished, not in the tables: transformer-s3, hybrid+tags-s3" in report
    assert f"{theirs.p_value:.4f}" in report, "the finished runs' figures, as before"
    assert not [p for p in (out / "runs").iterdir() if "-s3-" in p.name]
    # the significance columns name the baseline: the first variant
    in_process(
        command + ["--max-update", "4", "--variants", "hybrid+tags,transformer", "--report-only"],
    )
    report = (out / "report.md").read_text()
    assert report.count("| p vs (d) |") == 2 and "p vs (a)" not in report
    # ... also when the baseline's first seed has not finished: the others are compared with it
    hidden = first / "hidden"
    hidden.mkdir()
    for name in ("eval", "record.json.gz"):
        (first / name).rename(hidden / name)
    in_process(command + ["--max-update", "4", "--report-only"])
    for name in ("eval", "record.json.gz"):
        (hidden / name).rename(first / name)
    hidden.rmdir()
    rows = {
        line.split(" |")[0]: line.split(" | ")
        for line in (out / "report.md").read_text().splitlines()
        if line.startswith("| (")
    }
    assert rows["| (a) transformer"][8] == "—" and " / " not in rows["| (a) transformer"][4], rows
    assert float(rows["| (d) hybrid+tags"][8]) <= 1, rows
    none = in_process(command + ["--max-update", "5", "--report-only"], check=False)
    assert none.returncode == 1 and "no run of the baseline transformer has finished" in none.stderr

    # a run scored but stopped before its record was written: --dry-run writes nothing,
    # the report writes the record, naming the device the run trained on
    record = (first / "record.json.gz").read_bytes()
    (first / "record.json.gz").unlink()
    planned = in_process(command + ["--max-update", "4", "--dry-run"]).stdout
    assert "transformer-s1 [done]" in planned and not (first / "record.json.gz").exists()
    in_process(command + ["--max-update", "4", "--report-only"])
    trained = json.loads((first / "run.json").read_text())
    assert _record(first)["device"] == trained["device_name"] and trained["device_name"].startswith(
        "CPU ("
    )
    assert _record(first)["environment"] == trained["environment"]
    assert _record(first)["statistics"] == _record_of(record)["statistics"]

    # records: packed without checkpoints, merged into another study folder (as on another
    # machine) into the same tables and bootstrap; from the records alone (numbers, no
    # translations) too; refused when made with other settings or data
    archive = tmp_path / "records.tar.gz"
    in_process(command + ["--max-update", "4", "--report-only", "--pack", archive])
    with tarfile.open(archive) as tar:
        packed = sorted(tar.getnames())
    assert len([n for n in packed if n.endswith("/record.json.gz")]) == 4, packed
    assert len([n for n in packed if n.endswith("/eval/hyp.detok")]) == 4, packed
    assert not [n for n in packed if n.endswith(".pt")], packed
    in_place = _tables(out)
    # packed before the report is written: a report that fails (here, report.md is a
    # folder) or is cut short by the allocation's end loses no record
    (out / "report.md").rename(tmp_path / "report.md")
    (out / "report.md").mkdir()
    second = tmp_path / "records-2.tar.gz"
    failed = in_process(
        command + ["--max-update", "4", "--report-only", "--pack", second],
        check=False,
    )
    assert failed.returncode != 0 and second.exists(), failed.stderr[-2000:]
    with tarfile.open(second) as tar:
        assert sorted(tar.getnames()) == packed
    (out / "report.md").rmdir()
    (tmp_path / "report.md").rename(out / "report.md")
    elsewhere = tmp_path / "elsewhere"
    merge = [
        *command[: command.index("--out") + 1],
        elsewhere,
        *command[command.index("--out") + 2 :],
    ]
    in_process(merge + ["--max-update", "4", "--records", archive, "--report-only"])
    assert _tables(elsewhere) == in_place
    numbers = tmp_path / "numbers"
    for path in (out / "runs").glob("*/record.json.gz"):
        (numbers / path.parent.name).mkdir(parents=True)
        (numbers / path.parent.name / path.name).write_bytes(path.read_bytes())
    third = tmp_path / "third"
    merge = [*command[: command.index("--out") + 1], third, *command[command.index("--out") + 2 :]]
    # --dry-run and --status, which write nothing, name the runs the records finish
    planned = in_process(merge + ["--max-update", "4", "--records", numbers, "--dry-run"])
    assert planned.stdout.count(" [done: its record in --records] ") == 4, planned.stdout
    assert " [to train] " not in planned.stdout, planned.stdout
    shown = in_process(merge + ["--max-update", "4", "--records", numbers, "--status"])
    elsewhere_row = " | finished elsewhere (its record in --records); here not started | "
    assert shown.stdout.count(elsewhere_row) == 4, shown.stdout
    assert not list(third.glob("runs/*/record.json.gz"))
    merged = in_process(merge + ["--max-update", "4", "--records", numbers, "--report-only"])
    assert _tables(third) == in_place, merged.stdout
    # a study that finds every run's record trains nothing
    again = in_process(merge + ["--max-update", "4"])
    assert ": training (" not in again.stdout and ": translating" not in again.stdout, again.stdout
    assert _tables(third) == in_place
    # records of the same runs' names made with other settings or data (another study's,
    # in the same folder of records) are left out, named with what differs
    other_budget = tmp_path / "other-budget"
    merge = [*command[: command.index("--out") + 1], other_budget]
    merge += command[command.index("--out") + 2 :]
    refused = in_process(
        merge + ["--max-update", "5", "--records", archive, "--report-only"],
        check=False,
    )
    assert refused.returncode == 1, refused.stderr
    assert "no run of the baseline transformer has finished" in refused.stderr
    assert (
        "transformer-s1 of other settings or data: config.max_update (record 4, "
        "this study 5)" in refused.stdout
    ), refused.stdout
    other_data = tmp_path / "other-data"
    shutil.copytree(data, other_data)
    with open(other_data / "dict.de.txt", "a", encoding="utf-8") as handle:
        handle.write("zzz 1\n")
    elsewhere_cmd = [str(c) for c in merge]
    elsewhere_cmd[elsewhere_cmd.index("--data") + 1] = str(other_data)
    refused = in_process(
        elsewhere_cmd + ["--max-update", "4", "--records", archive, "--report-only"],
        check=False,
    )
    assert refused.returncode == 1 and "data (record '" in refused.stdout, refused.stdout
    assert "records.tar.gz:runs/hybrid_tags-s1-" in refused.stdout, refused.stdout
    # translations that are not the ones a record scored are refused, nothing merged
    forged = tmp_path / "forged"
    shutil.copytree(numbers, forged)
    victim = next(forged.glob("hybrid_tags-s2-*"))
    (victim / "eval").mkdir()
    (victim / "eval" / "hyp.detok").write_text("not the translation\n" * 3)
    fourth = tmp_path / "fourth"
    merge = [*command[: command.index("--out") + 1], fourth, *command[command.index("--out") + 2 :]]
    refused = in_process(
        merge + ["--max-update", "4", "--records", forged, "--report-only"],
        check=False,
    )
    assert refused.returncode == 2, refused.stderr
    assert "are not the ones it scored" in refused.stderr and not (fourth / "runs").exists()
    # an archive of "./"-named members (tar -C DIR .) merges the same
    dotted = tmp_path / "dotted.tar.gz"
    with tarfile.open(dotted, "w:gz") as tar:
        tar.add(out / "runs", arcname="./runs")
    fifth = tmp_path / "fifth"
    merge = [*command[: command.index("--out") + 1], fifth, *command[command.index("--out") + 2 :]]
    in_process(merge + ["--max-update", "4", "--records", dotted, "--report-only"])
    assert _tables(fifth) == in_place and len(list(fifth.glob("runs/*/eval/hyp.detok"))) == 4
    # the same study packs again over its archive; another study's is refused before
    # anything runs (its records would be lost), and replaced only with --force
    in_process(command + ["--max-update", "4", "--report-only", "--pack", archive])
    refused = in_process([*merge, "--max-update", "5", "--pack", archive], check=False)
    assert refused.returncode == 2, refused.stderr
    assert "holds the records of runs this would not pack again" in refused.stderr
    assert ": training (" not in refused.stdout and not list(fifth.glob("runs/*/train.log"))
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == packed
    forced = [*merge, "--max-update", "5", "--report-only", "--pack", archive, "--force"]
    assert in_process(forced, check=False).returncode == 1  # (nothing of it finished)
    with tarfile.open(archive) as tar:
        assert tar.getnames() == []

    # a changed budget is a new run, never a silent reuse (the plan the real run follows)
    planned = in_process(command + ["--max-update", "6", "--dry-run"]).stdout
    states = [
        line.split()[:2]
        for line in planned.splitlines()
        if line.startswith(("transformer", "hybrid"))
    ]
    assert states == [
        ["transformer-s1", "[to"],
        ["hybrid+tags-s1", "[to"],
        ["transformer-s2", "[to"],
        ["hybrid+tags-s2", "[to"],
    ], planned
    assert not any(name in planned for name in runs)


@pytest.mark.slow
def test_a_run_trains_through_tpp_train_which_repairs_and_resumes_it(tmp_path, tagged):
    """Issue 48.2: the study trains through tpp-train, the project's one training command,
    which the record quotes. A run stopped with a torn checkpoint_last.pt and a checkpoint
    half-written (as a kill leaves them) goes on from its newest whole checkpoint, the
    partial file removed, and no tpp-train variable of the user's environment reaches it."""
    import subprocess

    from support import tool_env
    from tpp_tools.checkpoint_files import load_checkpoint, num_updates
    from tpp_tools.study.commands import json_records

    command = [
        "tpp-study",
        *("--config", "cpu", "--data", tagged.data, "--out", tmp_path / "study"),
        *("--test-reference", tagged.reference, "--device", "cpu"),
        *("--variants", "transformer", "--seeds", "1,2", "--only", "transformer-s1"),
        "--max-update",
        "6",
        *("--embed-dim", "32", "--ffn-dim", "64", "--heads", "4", "--layers", "2"),
        *("--max-tokens", "256", "--warmup-updates", "2", "--keep-checkpoints"),
    ]
    run(command, timeout=600)
    folder = next((tmp_path / "study" / "runs").glob("transformer-s1-*"))
    record = _record(folder)
    assert record["train_command"][0] == "tpp-train" and "--no-lock" in record["train_command"]
    ckpt = folder / "checkpoints"
    assert num_updates(load_checkpoint(ckpt / "checkpoint_last.pt")) == 6
    # stopped after update 6 was being saved: the run is not finished, its last checkpoint torn
    for name in ("record.json.gz", "train.done", "checkpoint_avg.pt"):
        (folder / name).unlink()
    shutil.rmtree(folder / "eval")
    sixth, fifth = (next(ckpt.glob(f"checkpoint_*_{n}.pt")) for n in (6, 5))
    for path in (sixth, ckpt / "checkpoint_best.pt"):  # fairseq copies the new one to both
        path.unlink()
    whole = fifth.read_bytes()
    (ckpt / "checkpoint_last.pt").write_bytes(whole[: len(whole) // 2])
    partial = sixth.with_name(sixth.name + ".tmp")
    partial.write_bytes(whole[: 64 * 1024])
    env = dict(tool_env(), PRESET="nonsense", LR="-1", MAX_TOKENS="0", SAVE_DIR=str(tmp_path))
    again = subprocess.run(
        [str(c) for c in command], env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    log = (folder / "run.log").read_text()
    assert f"removed {partial} (0.1 MiB), a checkpoint an earlier run did not finish" in log
    assert fifth.name in log and not partial.exists()
    # update 6 trained once more (from the fifth), and no further
    updates = [
        int(r["num_updates"]) for r in json_records(folder / "train.log") if "num_updates" in r
    ]
    assert updates.count(6) == 2 and max(updates) == 6, updates
    assert num_updates(load_checkpoint(ckpt / "checkpoint_last.pt")) == 6
    assert (folder / "record.json.gz").exists() and not list(tmp_path.glob("*.pt"))
    # its training time: both trainings (fairseq's wall restarted in the second)
    first = json.loads((folder / "train.clock").read_text())["earlier"]
    assert 0 < first < _record(folder)["train"]["seconds"], (first, _record(folder)["train"])


def test_prepared_data_is_identified_by_content_not_by_file_dates(tmp_path):
    """A corpus unpacked or copied again (new modification times, other folder) is the
    same data, so its prepared folder and the runs on it are reused; other content is not."""
    import os

    def identity(prefix):
        args = argparse.Namespace(corpus=str(prefix), split_seed=1, variants_need_tags=True)
        return study.data_identity(
            args, study.CONFIGS["cpu"], "en", "de", {}, {"test": 10, "valid": 10}
        )

    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        (folder / "train.en").write_text("a house\n")
        (folder / "train.de").write_text("ein Haus\n")
    os.utime(second / "train.en", (1, 1))
    assert identity(first / "train") == identity(second / "train")
    (second / "train.de").write_text("ein Hund\n")
    assert identity(first / "train") != identity(second / "train")


def test_conv_head_scaling_makes_new_runs_of_the_hybrid_variants_only(tmp_path):
    """The option changes the hybrid variants' command and identity; the transformer and
    the control, which it cannot affect, keep theirs (and are reused)."""
    from dataclasses import replace

    data = data_folder(tmp_path / "data")
    args = argparse.Namespace(
        variants=list(study.VARIANTS), seeds=[1, 2], extra=[], device="cpu", out=tmp_path / "out"
    )
    paper = study.plan_runs(args, replace(study.CONFIGS["cpu"], conv_head_scaling="none"), data)
    scaled = study.plan_runs(args, study.CONFIGS["cpu"], data)  # the configuration's default
    for before, after in zip(paper, scaled):
        unaffected = before.variant in ("transformer", "control")
        assert (before.folder == after.folder) == unaffected, before.variant
        assert "--conv-head-scaling" not in before.train_cmd
        if not unaffected:
            flag = after.train_cmd.index("--conv-head-scaling")
            assert after.train_cmd[flag + 1] == "inv-sqrt-head-dim"


def test_the_configurations_default_to_the_settings_of_their_published_results():
    """Issue 48.4: `--config cpu` alone trains with the settings of results_cpu.md's
    tables 2 and 3 (the ones the hybrid heads learn with), and the GPU configurations
    with the scale of results_base.md's runs; the published commands, which name them,
    keep their runs' identities."""
    import re

    docs = Path(__file__).resolve().parents[2] / "docs"
    for page, config in (("results_cpu.md", "cpu"), ("results_base.md", "gpu")):
        commands = re.findall(
            r"tpp-study --config (\S+)(.*?)\n```", (docs / page).read_text(), re.S
        )
        # (but table 1's, which names the settings the hybrid heads did not learn with)
        published = [f for name, f in commands if name == config and "scaling none" not in f]
        assert published, page
        cfg = study.CONFIGS[config]
        for flags in published:
            given = dict(re.findall(r"--(lr|conv-head-scaling) (\S+)", flags))
            assert given.get("conv-head-scaling", cfg.conv_head_scaling) == cfg.conv_head_scaling
            assert float(given.get("lr", cfg.lr)) == cfg.lr, (page, flags)
    assert study.CONFIGS["gpu-short"].conv_head_scaling == "inv-sqrt-head-dim"


def test_gpu_short_trains_pre_ln_layers_and_layer_norm_post_is_the_default(tmp_path):
    """gpu-short's and gpu's runs normalise before each sublayer (every variant, the same
    flags); the other configurations keep fairseq's post-LN, with the identity they always
    had; --layer-norm pre makes new runs of every variant."""
    from dataclasses import replace

    data = data_folder(tmp_path / "data")
    args = argparse.Namespace(
        variants=list(study.VARIANTS), seeds=[1], extra=[], device="cuda", out=tmp_path / "out"
    )
    pre = ["--encoder-normalize-before", "--decoder-normalize-before"]
    short = study.plan_runs(args, study.CONFIGS["gpu-short"], data)
    assert all(r.train_cmd.count(pre[0]) == r.train_cmd.count(pre[1]) == 1 for r in short)
    post = study.plan_runs(args, replace(study.CONFIGS["gpu-short"], layer_norm="post"), data)
    assert not any(flag in r.train_cmd for r in post for flag in pre)
    assert all(a.folder != b.folder for a, b in zip(short, post))
    assert (
        "layer_norm" not in post[0].spec["config"]
        and short[0].spec["config"]["layer_norm"] == "pre"
    )
    for name in ("cpu", "wmt14-big"):
        assert study.CONFIGS[name].layer_norm == "post", name
    assert study.CONFIGS["gpu"].layer_norm == "pre"
    shown = run([sys.executable, "-m", "tpp_tools.study", "--help"]).stdout
    assert "--layer-norm {post,pre}" in shown


def test_tag_loss_options_make_new_runs_of_the_tags_variant_only(tmp_path):
    """--encoder-tag-layers, --tag-loss-weights and --tag-loss-decay-updates reach the
    hybrid+tags command and its identity; the other variants, which have no tag losses,
    keep theirs; at the paper's values nothing changes (RUN_FOLDERS above pins it)."""
    from dataclasses import replace

    data = data_folder(tmp_path / "data")
    args = argparse.Namespace(
        variants=list(study.VARIANTS), seeds=[1], extra=[], device="cpu", out=tmp_path / "out"
    )
    paper = study.plan_runs(args, study.CONFIGS["cpu"], data)
    settings = dict(
        encoder_tag_layers="pos:1,ner:1",
        tag_loss_weights="pos:0.1,ner:0.3",
        tag_loss_decay_updates=700,
    )
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        changed = study.plan_runs(args, replace(study.CONFIGS["cpu"], **{name: value}), data)
        for before, after in zip(paper, changed):
            tags = before.variant == "hybrid+tags"
            assert (before.folder != after.folder) == tags, (name, before.variant)
            if tags:
                assert flag not in before.train_cmd
                assert after.train_cmd[after.train_cmd.index(flag) + 1] == str(value)
            else:
                assert after.train_cmd == before.train_cmd, (name, before.variant)


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--tag-loss-weights", "pos=0.1", "--tag-loss-weights: expected NAME:NUMBER"),
        ("--tag-loss-weights", "pos:-1", "weight of 'pos' must be a number >= 0"),
        ("--encoder-tag-layers", "pos:1,ner:4", "is outside the encoder's layers 1..3"),
        ("--tag-loss-decay-updates", "-5", "--tag-loss-decay-updates must be >= 0"),
    ],
)
def test_bad_tag_loss_options_are_refused_before_anything_runs(
    tmp_path, capsys, option, value, message
):
    data = data_folder(tmp_path / "data")
    argv = ["--config", "cpu", "--data", str(data), "--test-reference", str(tmp_path / "ref")]
    argv += ["--out", str(tmp_path / "out"), "--variants", "hybrid,hybrid+tags", option, value]
    assert study.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--", "--bogus", "1"],
            "the transformer runs' training would refuse its options: "
            "unrecognized arguments: --bogus 1",
        ),
        (
            ["--layers", "1"],
            "the hybrid+tags runs' training would refuse its options: "
            "--encoder-tag-layers: layer 2 for tag 'ner' is outside the encoder's layers 1..1",
        ),
        (["--", "--save-dir", "elsewhere"], "--save-dir after --: give it before --"),
        (
            ["--", "--fp16", "--bf16"],  # (tpp-train's check of --cpu's precision)
            "the transformer runs' training would refuse its options: "
            "--fp16 (after --) needs a GPU: drop --cpu or --fp16",
        ),
    ],
)
def test_options_every_runs_training_would_refuse_are_refused_first(
    tmp_path, capsys, options, message
):
    """(fairseq-train refused them in every run, after the data had been made)"""
    data = data_folder(tmp_path / "data")
    argv = ["--config", "cpu", "--data", str(data), "--test-reference", str(tmp_path / "ref")]
    argv += ["--out", str(tmp_path / "out"), "--variants", "transformer,hybrid+tags", *options]
    assert study.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_tag_loss_options_from_the_command_line(tmp_path, tagged):
    shown, _ = dry_run(
        tmp_path,
        tagged,
        "hybrid,hybrid+tags",
        "--encoder-tag-layers",
        "pos:1,ner:1",
        "--tag-loss-weights",
        "pos:0.3,ner:0.3",
        "--tag-loss-decay-updates",
        "700",
    )
    commands = [
        shlex.split(line)
        for line in shown.stdout.splitlines()
        if line.strip().startswith("tpp-train")
    ]
    assert len(commands) == 4, shown.stdout
    for cmd in commands:
        value = lambda flag: cmd[cmd.index(flag) + 1] if flag in cmd else None  # noqa: E731
        if value("--task") == "translation_with_tags":
            assert value("--encoder-tag-layers") == "pos:1,ner:1"
            assert value("--tag-loss-weights") == "pos:0.3,ner:0.3"
            assert value("--tag-loss-decay-updates") == "700"
        else:
            assert value("--encoder-tag-layers") == ""  # no heads, as without the options
            assert value("--tag-loss-weights") is None and value("--tag-loss-decay-updates") is None


def test_a_new_run_version_makes_new_runs_of_every_variant(tmp_path, monkeypatch):
    """Runs made by code that computed differently are never reused."""
    data = data_folder(tmp_path / "data")
    args = argparse.Namespace(
        variants=list(study.VARIANTS), seeds=[1], extra=[], device="cpu", out=tmp_path / "out"
    )
    now = study.plan_runs(args, study.CONFIGS["cpu"], data)
    monkeypatch.setattr(study.runs, "RUN_VERSION", study.RUN_VERSION + 1)
    later = study.plan_runs(args, study.CONFIGS["cpu"], data)
    assert len(now) == 4 and all(a.folder != b.folder for a, b in zip(now, later))
    assert all(a.variant == b.variant and a.seed == b.seed for a, b in zip(now, later))


def _bootstrap_inputs(tmp_path, outputs):
    """Runs and records of translations given as ``{variant: {seed: text}}``, scored
    against a three-sentence reference."""
    from tpp_tools.study.records import file_sha256, sentence_statistics

    refs = ["a small house .", "the red cat runs .", "it is cold ."]
    runs, records = {}, {}
    for variant, texts in outputs.items():
        for seed, text in texts.items():
            folder = tmp_path / f"{variant}-{seed}"
            (folder / "eval").mkdir(parents=True)
            (folder / "eval" / "hyp.detok").write_text(text)
            run_ = study.Run(variant, seed, folder, [], {})
            runs.setdefault(variant, []).append(run_)
            records[run_.name] = {
                "statistics": sentence_statistics(text.splitlines(), refs),
                "translations_sha256": file_sha256(folder / "eval" / "hyp.detok"),
                "reference": {"lines": len(refs)},
            }
    return runs, records


def test_a_variant_translating_word_for_word_as_the_baseline_is_marked_identical(tmp_path):
    """sacreBLEU gives a system compared with an identical one its smallest p-value; the
    study marks the pair instead of quoting that figure as a significant difference."""
    same = "a small house .\nthe cat runs .\nit is warm .\n"
    other = "a house .\nthe red cat .\nit is cold .\n"
    runs, records = _bootstrap_inputs(
        tmp_path,
        {
            "transformer": {1: same, 2: same},
            "control": {1: same, 2: same},
            "hybrid": {1: other, 2: other},
        },
    )
    boot, _ = study.significance(runs, records, 50)
    assert boot["control"]["identical"] is True and boot["hybrid"]["identical"] is False
    assert boot["transformer"]["identical"] is False
    assert all(boot[v]["seeds"] == [1, 2] for v in boot)


def test_the_bootstrap_pairs_each_variant_with_the_baseline_seed_by_seed(tmp_path):
    """A partial study (runs of several allocations): every variant is compared with the
    baseline on the seeds both have finished, seed with seed, whatever the others have;
    a variant with no seed in common is compared with nothing."""
    texts = {
        1: "a house .\nthe cat .\nit is warm .\n",
        2: "a small house .\nthe cat runs .\nit is warm .\n",
        3: "a small house .\nthe red cat .\nit is cold .\n",
        4: "the house .\nred cat runs .\ncold .\n",
    }
    runs, records = _bootstrap_inputs(
        tmp_path,
        {
            "transformer": {1: texts[1], 2: texts[2], 3: texts[3]},
            # the baseline's own translations of seeds 2 and 3: identical only if paired
            # by seed (the first two seeds of each would pair 1 with 2 and 2 with 3)
            "control": {2: texts[2], 3: texts[3]},
            "hybrid": {1: texts[4]},  # one seed: the others keep theirs
            "hybrid+tags": {4: texts[4]},
        },
    )
    boot, _ = study.significance(runs, records, 50)
    assert boot["transformer"]["seeds"] == [1, 2, 3]
    assert boot["control"]["seeds"] == [2, 3] and boot["control"]["identical"] is True
    assert boot["hybrid"]["seeds"] == [1] and boot["hybrid"]["compared"] is True
    assert boot["hybrid+tags"]["compared"] is False and boot["hybrid+tags"]["seeds"] == [4]


def test_the_confidence_interval_takes_students_t_for_any_number_of_seeds():
    from tpp_tools.study.report import t_interval

    # Student's t 0.975 quantiles (published tables) for 1, 2, 10, 30, 31, 44, 199 df
    quantiles = {2: 12.706, 3: 4.303, 11: 2.228, 31: 2.042, 32: 2.040, 45: 2.015, 200: 1.972}
    for n, t95 in quantiles.items():
        values = [float(i % 3) for i in range(n)]
        expected = t95 * statistics.stdev(values) / math.sqrt(n)
        assert abs(t_interval(values) - expected) <= 6e-4 * expected, n


def test_without_matplotlib_the_study_is_refused_before_it_trains(
    tmp_path, tagged, monkeypatch, capsys
):
    """The report draws its curves with matplotlib (an extra of the package): without
    it, a study stops at once, not after every run has trained; --dry-run still plans."""
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else found(name, *a),
    )
    argv = [
        *("--config", "cpu", "--data", str(tagged.data), "--out", str(tmp_path / "out")),
        *("--test-reference", str(tagged.reference), "--device", "cpu"),
        *("--variants", "transformer,hybrid", "--seeds", "1,2"),
    ]
    assert study.main(argv) == 2
    assert "pip install 'tpp-plugin[plots]'" in capsys.readouterr().err
    assert not (tmp_path / "out" / "runs").exists()
    assert study.main([*argv, "--dry-run"]) == 0


def test_a_wrong_reference_or_variant_is_refused_before_any_training(tmp_path, tagged):
    data = tagged.data
    lines = tagged.reference.read_text().splitlines()
    short = tmp_path / "short.tgt"
    short.write_text("\n".join(lines[:-1]) + "\n")
    out = tmp_path / "out"
    shown = in_process(
        [
            "tpp-study",
            "--config",
            "cpu",
            "--data",
            data,
            "--test-reference",
            short,
            "--out",
            out,
            "--variants",
            "transformer,hybrid",
            "--seeds",
            "1,2",
            "--device",
            "cpu",
        ],
        check=False,
    )
    assert shown.returncode != 0 and "Traceback" not in shown.stderr
    assert (
        f"test reference {short} has {len(lines) - 1} lines but the test split of {data} has "
        f"{len(lines)} sentences" in shown.stderr
    )
    assert not (out / "runs").exists()
    shown = in_process(
        [
            "tpp-study",
            "--data",
            data,
            "--test-reference",
            tagged.reference,
            "--out",
            out,
            "--variants",
            "transformer,hybrd",
            "--device",
            "cpu",
        ],
        check=False,
    )
    assert shown.returncode == 2 and "--variants: unknown ['hybrd']" in shown.stderr
    assert not (out / "runs").exists()


def test_device_cuda_without_a_gpu_is_an_error_and_a_dry_run_still_plans(tmp_path, tagged):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: --device cuda is valid here")
    command = [
        "tpp-study",
        "--data",
        tagged.data,
        "--test-reference",
        tagged.reference,
        "--out",
        tmp_path / "out",
        "--variants",
        "transformer,hybrid",
        "--seeds",
        "1,2",
        "--device",
        "cuda",
    ]
    shown = in_process(command, check=False)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr
    assert (
        "tpp-study: error: --device cuda: torch" in shown.stderr
        and "sees no CUDA GPU" in shown.stderr
    )
    planned = in_process(command + ["--dry-run"]).stdout
    assert planned.count(" [to train] ") == 4 and "--bf16" in planned
    # one device per run: fairseq's default would be data-parallel over every GPU it sees
    assert planned.count("--distributed-world-size 1") == 4


def test_runs_going_at_once_on_gpus_take_one_gpu_each(monkeypatch):
    """On GPUs every run trains and decodes on the one GPU of its slot, the GPUs dealt
    out in turn (two runs at once on two GPUs: one each); on the CPU nothing is set."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert study.visible_gpus() == ["3", "5"]
    assert list(study.gpu_slots(3, ["3", "5"]).queue) == ["3", "5", "3"]
    held, both_running = [], threading.Barrier(2, timeout=60)

    def steps(run, cfg, paths, args, env_extra):
        held.append(env_extra.get("CUDA_VISIBLE_DEVICES"))
        if run != "cpu":
            both_running.wait()  # the two runs hold their slots at the same time

    monkeypatch.setattr(study.runs, "_execute", steps)
    args = argparse.Namespace(gpu_slots=study.gpu_slots(2, study.visible_gpus()))
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda name: study.execute(name, None, None, args), ["a", "b"]))
    assert sorted(held) == ["3", "5"]
    assert sorted(args.gpu_slots.queue) == ["3", "5"]  # given back
    study.execute("cpu", None, None, argparse.Namespace())
    assert held[-1] is None


def test_between_its_commands_a_runs_locks_name_the_study(tmp_path):
    """While a command runs, the run folder's and the save dir's locks name it; once it has
    ended, the study again (a tool refused there named a process that no longer was, and
    waited for its data loaders first)."""
    from tpp_tools.study.commands import CHILDREN, RunLock
    from tpp_tools.train import TrainError

    lock = RunLock(tmp_path, "hybrid-s1")
    try:
        lock.hold_save_dir(tmp_path / "checkpoints")
        # the record meanwhile, once the study has written it (it can only after the
        # command has started: a loop that gives up after 30 s)
        record = tmp_path / "checkpoints" / ".lock"
        wait = f"for i in $(seq 3000); do grep -q 'sh -c' {record} && break; sleep 0.01; done"
        show = ["sh", "-c", f"{wait}; cat {record}"]
        with open(tmp_path / "run.log", "w") as out:
            assert CHILDREN.run(show, out, None, lock=lock) == 0
        shown = (tmp_path / "run.log").read_text()
        assert shown.startswith("process ") and ": sh -c 'for i in " in shown, shown
        assert f"process {os.getpid()} " not in shown
        for path in (tmp_path / ".lock", tmp_path / "checkpoints" / ".lock"):
            record = path.read_text()
            assert record.startswith(f"process {os.getpid()} on host ") and "(tpp-study)" in record
        with pytest.raises(TrainError, match=rf"\(process {os.getpid()} on host .*tpp-study"):
            take_lock(tmp_path / "checkpoints", ["tpp-recover-checkpoint"])
    finally:
        lock.close()


def test_runs_at_once_on_a_gpu_share_the_cores(tmp_path, monkeypatch):
    """On a GPU the runs at once divide the cores among them (eight runs of a core count's
    threads each would oversubscribe the CPU eightfold); the CPU keeps one thread a run;
    a cluster's job keeps the CPUs SLURM gave it."""
    from tpp_tools.study.cli import runs_and_threads

    assert runs_and_threads("cuda", 8, None, 16) == (8, 2)
    assert runs_and_threads("cuda", None, None, 16) == (4, 4)
    assert runs_and_threads("cuda", 8, None, 4) == (8, 1)
    assert runs_and_threads("cuda", 8, 3, 16) == (8, 3)
    assert runs_and_threads("cpu", None, None, 2) == (2, 1)
    assert runs_and_threads("cpu", None, 2, 8) == (4, 2)

    folder = tmp_path / "run"
    folder.mkdir()
    cfg = study.CONFIGS["gpu-short"]
    (folder / "train.done").write_text(f"{cfg.max_update} updates, 1 s\n")
    (folder / "checkpoint_avg.pt").write_bytes(b"")
    (tmp_path / "ref").write_text("a reference\n")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    envs = []
    monkeypatch.setattr(
        study.runs,
        "run_command",
        lambda cmd, log, env=None, timeout=None, lock=None, progress=None: envs.append(env)
        or fds.append(len(lock.fds)),
    )
    monkeypatch.setattr(study.runs, "write_record", lambda *a: None)
    fds = []
    (folder / "checkpoints").mkdir(exist_ok=True)
    held = None
    for launcher in ("local", "slurm"):
        if launcher == "slurm":  # its job holds the save dir's lock, as slurm.RunJob does
            held = take_lock(folder / "checkpoints", ["a SLURM job"])
        args = argparse.Namespace(
            device="cuda",
            launcher=launcher,
            threads=2,
            gen_max_tokens=8192,
            keep_checkpoints=True,
            step_timeout=60,
            device_name="a GPU",
        )
        run = study.Run("hybrid", 1, folder, ["fairseq-train"], {})
        study.execute(run, cfg, {"data": tmp_path / "data", "reference": tmp_path / "ref"}, args)
    os.close(held)
    # the local study's commands hold the run folder's and the save dir's locks; a SLURM
    # job's the run folder's (it holds the save dir's itself: taken twice, it was refused)
    assert set(fds[: len(fds) // 2]) == {2} and set(fds[len(fds) // 2 :]) == {1}
    local, cluster = envs
    assert local["OMP_NUM_THREADS"] == local["MKL_NUM_THREADS"] == "2"
    assert "OMP_NUM_THREADS" not in cluster


def test_the_curves_show_runs_that_trained_but_were_not_scored(tmp_path, monkeypatch):
    """A study stopped while decoding: its report's tables hold the scored runs only, its
    curves every run that validated, the unscored ones named so."""
    import json

    import matplotlib.axes

    labels = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda ax, *a, **kw: labels.append(kw["label"]) or plot(ax, *a, **kw),
    )
    runs = []
    for variant in ("transformer", "hybrid"):
        folder = tmp_path / variant
        folder.mkdir()
        records = [
            {"valid_loss": 9.0, "valid_nll_loss": 8.0 - u / 100, "valid_num_updates": u}
            for u in (60, 120)
        ]
        (folder / "train.log").write_text("".join(json.dumps(r) + "\n" for r in records))
        runs.append(study.Run(variant, 1, folder, [], {}))
    # a finished run's curve is its record's; an unfinished one's its train.log so far
    finished = {"transformer-s1": {"valid": study.records.validation_curve(records)}}
    (tmp_path / "transformer" / "train.log").unlink()
    assert study.report.plot_curves(
        runs[:1], finished, tmp_path / "curves.png", unfinished=runs[1:]
    )
    assert labels == ["transformer seed 1", "hybrid seed 1 (not scored)"]
    assert (tmp_path / "curves.png").stat().st_size > 0


@pytest.mark.parametrize(
    "dtype, decoding", [("fp16", ["--", "--fp16"]), ("bf16", []), ("fp32", [])]
)
def test_a_gpu_run_decodes_in_float16_only_if_it_trained_in_it(
    dtype, decoding, tmp_path, monkeypatch
):
    """fairseq-generate 0.12 has no bfloat16 inference; a model trained in bfloat16 or
    float32 need not keep within float16's range, so it decodes in float32."""
    from dataclasses import replace

    cfg = replace(study.CONFIGS["gpu"], dtype=dtype)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "train.done").write_text(f"{cfg.max_update} updates, 1 s\n")
    (folder / "checkpoint_avg.pt").write_bytes(b"")
    (tmp_path / "ref").write_text("a reference\n")
    commands = []
    monkeypatch.setattr(
        study.runs,
        "run_command",
        lambda cmd, log, env=None, timeout=None, lock=None, progress=None: commands.append(
            [str(c) for c in cmd]
        ),
    )
    monkeypatch.setattr(study.runs, "write_record", lambda *a: None)
    args = argparse.Namespace(
        device="cuda",
        launcher="local",
        threads=4,
        gen_max_tokens=16384,
        keep_checkpoints=True,
        step_timeout=60,
        device_name="a GPU",
    )
    run = study.Run("hybrid", 1, folder, ["fairseq-train"], {})
    study.execute(run, cfg, {"data": tmp_path / "data", "reference": tmp_path / "ref"}, args)
    (evaluate,) = commands  # trained and averaged already: only the evaluation runs
    assert evaluate[1:3] == ["-m", "tpp_tools.evaluate"] and "--cpu" not in evaluate
    tail = evaluate[evaluate.index("--max-tokens") + 2 :]
    assert tail == decoding


def _study_in_training(command, out, timeout=600):
    """Start ``command`` (a study of ``out``) and return its process once a run trains,
    and a queue of its later output lines (None at the end), read by a thread so that a
    study printing nothing cannot outlast the deadline."""
    import queue
    import subprocess
    import threading
    import time

    from support import tool_env

    proc = subprocess.Popen(
        [str(c) for c in command],
        env=tool_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            raise AssertionError("the study did not start training") from None
        if line is None:
            raise AssertionError(f"the study ended before training (exit {proc.wait()})")
        if ": training (" in line:
            break
    # fairseq-train is starting: wait until it is there
    while not _trainers(out):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    return proc, lines


def _rest(lines, timeout=120):
    """The output lines still to come from :func:`_study_in_training`, to its end."""
    rest = []
    while (line := lines.get(timeout=timeout)) is not None:
        rest.append(line)
    return "".join(rest)


def _trainers(out):
    import subprocess

    found = subprocess.run(
        ["pgrep", "-f", f"fairseq-train .*{out}/runs/"], capture_output=True, text=True
    )
    return found.stdout.split()


def test_one_study_per_folder_and_sigterm_stops_its_trainers(tmp_path, tagged):
    """Issue probes: a second study on the same --out is refused, naming the first
    (before, both ran and failed each other's runs); SIGTERM to the study stops its
    fairseq-train too (before, it ran on, orphaned, and the next study started a second
    trainer on the same run folder). The stopped study resumes when run again."""
    import signal

    data = tagged.data
    out = tmp_path / "study"
    command = [
        "tpp-study",
        "--config",
        "cpu",
        "--data",
        data,
        "--test-reference",
        tagged.reference,
        "--out",
        out,
        "--variants",
        "transformer,hybrid",
        "--seeds",
        "1,2",
        "--device",
        "cpu",
        "--parallel",
        "1",
        "--embed-dim",
        "32",
        "--ffn-dim",
        "64",
        "--heads",
        "2",
        "--layers",
        "1",
        "--max-tokens",
        "256",
        "--warmup-updates",
        "2",
        "--max-update",
        "100000",
    ]
    first, output = _study_in_training(command, out)
    try:
        second = in_process(command, check=False)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert (
            f"another tpp-study is using this study folder (process {first.pid} on host"
            in second.stderr
        )
        assert len(_trainers(out)) == 1, "the refused study started nothing"
        # a run's save dir is locked as tpp-train locks it (its tpp-train runs with --no-lock)
        save_dir = next((out / "runs").glob("transformer-s1-*")) / "checkpoints"
        recover = run(["tpp-recover-checkpoint", "--save-dir", save_dir], check=False)
        assert recover.returncode == 2, recover.stderr
        assert f"another training is using the save dir {save_dir}" in recover.stderr
        assert "-m tpp_tools.train --no-lock" in recover.stderr, "(the command training there)"
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 128 + signal.SIGTERM
        rest = _rest(output)
        assert "SIGTERM: stopping the runs' commands" in rest and ": training (" not in rest, rest
    except BaseException:
        for pid in _trainers(out):  # (a check above failed: none left training for ever)
            os.kill(int(pid), signal.SIGKILL)
        raise
    finally:
        if first.poll() is None:
            first.kill()
    assert _trainers(out) == [], "no fairseq-train outlives its study"
    planned = in_process(command + ["--dry-run"]).stdout
    assert planned.count("[to train]") == 4


def test_dry_run_prepares_nothing(tmp_path):
    """--dry-run on a raw corpus plans the runs without carving or preparing the data
    (which takes minutes on a real corpus) or writing anything, not even the study's
    folder; the runs' ids wait for the dictionaries."""
    from support import lexicon_pairs, write_corpus

    write_corpus(
        tmp_path / "corpus", {"train": lexicon_pairs((200, 1, 1), 1)["train"]}, src="en", tgt="de"
    )
    out = tmp_path / "study"
    shown = in_process(
        [
            "tpp-study",
            "--config",
            "cpu",
            "--corpus",
            tmp_path / "corpus" / "train",
            "-s",
            "en",
            "-t",
            "de",
            "--out",
            out,
            "--variants",
            "transformer,hybrid",
            "--seeds",
            "1,2",
            "--valid-size",
            "20",
            "--test-size",
            "20",
            "--dry-run",
        ],
    )
    assert "is not prepared yet" in shown.stdout and shown.stdout.count("[to train]") == 4
    assert "transformer-s1-<id>" in shown.stdout
    assert not out.exists(), "nothing carved, prepared or written"


@pytest.mark.parametrize(
    "how", ["SIGTERM to the study", "SIGINT to its process group", "SIGKILL to the study"]
)
def test_a_study_stopped_while_preparing_exits_and_frees_its_folder(tmp_path, how):
    """Issue probe: stopped while its data pipeline ran, the study logged that it stopped
    and then hung for good holding its lock (its signal handler waited on the child that
    the interrupted main thread was waiting on). Now it stops the pipeline, exits with
    the signal's status and frees the folder at once. Killed outright, it leaves the
    pipeline running, which holds its work folder: a re-run then says so, without a
    traceback, and prepares nothing beside it."""
    import os
    import queue
    import signal
    import subprocess
    import threading
    import time

    from support import make_corpus, tool_env
    from tpp_pipeline.lock import work_dir_lock

    make_corpus(tmp_path / "corpus", sizes=(400, 20, 20))
    out = tmp_path / "study"
    proc = subprocess.Popen(
        [
            "tpp-study",
            "--config",
            "cpu",
            "--corpus",
            tmp_path / "corpus" / "raw" / "train",
            "-s",
            "en",
            "-t",
            "de",
            "--valid-size",
            "20",
            "--test-size",
            "20",
            "--out",
            out,
            "--device",
            "cpu",
        ],
        env=tool_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in proc.stdout] and None or lines.put(None),
        daemon=True,
    ).start()
    seen = []
    try:
        while "preparing " not in (line := lines.get(timeout=300) or "<end>"):
            assert line != "<end>", "".join(seen)
            seen.append(line)
        pipeline = [tmp_path / "corpus", "tpp_pipeline.pipeline"]
        deadline = time.monotonic() + 60
        while not _processes(str(pipeline[1]) + ".*" + str(out)):  # the pipeline has started
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        if how.startswith("SIGTERM"):
            proc.send_signal(signal.SIGTERM)
            status = 128 + signal.SIGTERM
        elif how.startswith("SIGINT"):
            os.killpg(proc.pid, signal.SIGINT)
            status = 128 + signal.SIGINT
        else:
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
            orphans = _processes("tpp_pipeline.pipeline.*" + str(out))
            assert orphans, "the pipeline runs on, orphaned"
            again = in_process(proc.args, check=False)
            assert again.returncode == 1 and "Traceback" not in again.stderr, again.stderr
            assert "tpp-study: error: preparing the data: " in again.stderr, again.stderr
            assert "another run of the pipeline is using this work folder" in again.stderr
            return
        assert proc.wait(timeout=60) == status
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _processes("tpp_pipeline.pipeline.*" + str(out)) if "KILL" in how else ():
            os.kill(int(pid), signal.SIGKILL)
    rest = []
    while (line := lines.get(timeout=30)) is not None:
        rest.append(line)
    assert "stopping the runs' commands" in "".join(rest), "".join(rest)
    assert not _processes("tpp_pipeline.pipeline.*" + str(out)), "the pipeline outlived the study"
    with work_dir_lock(out, user="tpp-study", folder="study folder"):
        pass  # free: a re-run may start at once


def _processes(pattern):
    import subprocess

    return subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()


@pytest.mark.parametrize("signame", ["SIGKILL", "SIGHUP"])
def test_a_killed_studys_trainer_is_never_joined_by_a_second_one(tmp_path, tagged, signame):
    """Issue probes: a study killed with SIGKILL left its fairseq-train running, and the
    re-run started a second trainer in the same run folder (every checkpoint written
    twice); SIGHUP (the terminal closed) had no handler at all. Now the orphan holds its
    run folder's lock and the re-run is refused that run, naming the process; SIGHUP
    stops the study's commands as SIGTERM does."""
    import os
    import signal
    import subprocess
    import time

    from support import tool_env

    data = tagged.data
    out = tmp_path / "study"
    command = [
        "tpp-study",
        "--config",
        "cpu",
        "--data",
        data,
        "--test-reference",
        tagged.reference,
        "--out",
        out,
        "--variants",
        "transformer",
        "--seeds",
        "1,2",
        "--device",
        "cpu",
        "--parallel",
        "1",
        "--embed-dim",
        "32",
        "--ffn-dim",
        "64",
        "--heads",
        "2",
        "--layers",
        "1",
        "--max-tokens",
        "256",
        "--warmup-updates",
        "2",
        "--max-update",
        "100000",
        "--only",
        "transformer-s1",
    ]
    first, output = _study_in_training(command, out)
    trainers, again = _trainers(out), None
    try:
        assert len(trainers) == 1
        first.send_signal(getattr(signal, signame))
        first.wait(timeout=120)
        if signame == "SIGHUP":
            assert first.returncode == 128 + signal.SIGHUP
            assert "SIGHUP: stopping the runs' commands" in _rest(output)
            assert _trainers(out) == [], "no fairseq-train outlives its study"
            return
        assert _trainers(out) == trainers, "SIGKILL leaves the trainer running"
        shown = in_process(command + ["--status"]).stdout
        assert f"| transformer-s1 | running (process {trainers[0]} on host" in shown, shown
        again = subprocess.Popen(
            [str(c) for c in command],
            env=tool_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 300
        while again.poll() is None:  # never two writers in one folder, sampled throughout
            assert len(_trainers(out)) == 1, "a second fairseq-train in the run folder"
            assert time.monotonic() < deadline, "the re-run did not end"
            time.sleep(0.2)
        said = again.stdout.read()
        assert again.returncode == 1, said
        assert _trainers(out) == trainers, said
        assert "transformer-s1: another process is writing in its folder" in said, said
        assert f"process {trainers[0]} on host" in said, said
    finally:
        if first.poll() is None:
            first.kill()
        if again is not None and again.poll() is None:
            again.kill()
        for pid in _trainers(out):
            os.kill(int(pid), signal.SIGKILL)


def test_the_status_of_a_stopped_run_says_what_its_last_checkpoint_saved(tmp_path):
    """A run stopped between checkpoints has logged updates (and validations) that its
    resumed training repeats: --status showed the logged ones only, as if they were kept."""
    import types

    import torch

    from tpp_tools.study.cli import status_row

    folder = tmp_path / "transformer-s1"
    (folder / "checkpoints").mkdir(parents=True)
    log = [
        {"train_num_updates": 20},
        {"valid_loss": 6.0, "valid_nll_loss": 5.5, "valid_num_updates": 20},
        {"train_num_updates": 30},
        {"valid_loss": 5.5, "valid_nll_loss": 5.078, "valid_num_updates": 30},
    ]
    (folder / "train.log").write_text("".join(json.dumps(r) + "\n" for r in log))
    run_ = types.SimpleNamespace(name="transformer-s1", folder=folder)
    assert status_row(run_, 100).startswith("| transformer-s1 | stopped | 30 | 5.078 |")
    checkpoint = {"model": {}, "optimizer_history": [{"num_updates": 20}]}
    torch.save(checkpoint, folder / "checkpoints" / "checkpoint_last.pt")
    assert status_row(run_, 100).startswith("| transformer-s1 | stopped | 30 (20 saved) | 5.078 |")
    checkpoint["optimizer_history"][0]["num_updates"] = 30
    torch.save(checkpoint, folder / "checkpoints" / "checkpoint_last.pt")
    assert status_row(run_, 100).startswith("| transformer-s1 | stopped | 30 | 5.078 |")
