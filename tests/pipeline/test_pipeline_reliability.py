"""Bad input gets a clear error naming file and line (exit status 2, no traceback);
outputs are never half-written; one run per work folder at a time."""

import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from support import english_pairs, pipeline_command, run_pipeline, write_corpus

from tpp_pipeline import cleaning, tagging, textio
from tpp_pipeline.errors import DataError


@pytest.fixture
def corpus(tmp_path):
    pairs = english_pairs(30)
    write_corpus(tmp_path, {split: pairs for split in ("train", "valid", "test")}, "en", "de")
    return tmp_path


def _run(corpus, *extra, src="en", tgt="de", timeout=600):
    return run_pipeline(
        "tpp-prepare-corpus",
        "-s",
        src,
        "-t",
        tgt,
        "--trainpref",
        corpus / "train",
        "--validpref",
        corpus / "valid",
        "--testpref",
        corpus / "test",
        "--name",
        "rel",
        "--work-dir",
        corpus / "work",
        "--data-bin",
        corpus / "bin",
        "--quiet",
        *extra,
        check=False,
        timeout=timeout,
    )


def test_the_default_folders_are_in_tpp_root_where_it_is_set(tmp_path):
    """A SLURM job's data stages run in $TPP_ROOT (the repository it was submitted from,
    common.sh exports it): their default work/ and data-bin/ are there, not in the
    checkout the environment happens to be installed from."""
    show = "import tpp_pipeline.pipeline as p; print(p.REPO_ROOT)"
    env = dict(os.environ, TPP_ROOT=str(tmp_path))
    shown = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True)
    assert shown.stdout.strip() == str(tmp_path.resolve()), shown.stderr
    env.pop("TPP_ROOT")
    shown = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True)
    assert shown.stdout.strip() != str(tmp_path.resolve()), "the checkout otherwise"


def test_line_count_mismatch_names_the_files(corpus):
    with open(corpus / "valid.de", "a", encoding="utf-8") as out:
        out.write("one more line\n")
    result = _run(corpus)
    assert result.returncode == 2
    assert "valid.en" in result.stderr and "valid.de has 31" in result.stderr
    assert not (corpus / "work" / "tok").exists()


def test_invalid_utf8_names_file_and_line(corpus):
    data = (corpus / "train.en").read_bytes().split(b"\n")
    data[6] = b"caf\xe9 au lait"
    (corpus / "train.en").write_bytes(b"\n".join(data))
    result = _run(corpus, "--stop-after", "tokenize")
    assert result.returncode == 2
    assert "train.en:7: invalid UTF-8 byte b'\\xe9'" in result.stderr
    assert not (corpus / "work" / "tok" / "train.en").exists()
    assert not (corpus / "work" / "tok" / "train.en.tmp").exists()
    # opting in to replacement makes the same input go through
    assert _run(corpus, "--stop-after", "tokenize", "--utf8-errors", "replace").returncode == 0
    # and is a setting of the text: going back to strict is not "already done"
    strict = _run(corpus, "--stop-after", "tokenize")
    assert strict.returncode == 2, strict.stderr
    assert '--utf8-errors was "replace", now not given' in strict.stderr, strict.stderr


def test_a_held_out_set_that_is_the_training_set_is_said(corpus):
    """The same files for --trainpref and --validpref (or --testpref) are a warning: the
    model would be validated or scored on the text it was trained on."""
    shutil.copy(corpus / "train.en", corpus / "copy.en")  # equal text, other files: silent
    shutil.copy(corpus / "train.de", corpus / "copy.de")
    args = ["--stop-after", "tokenize", "--no-tags", "--testpref", corpus / "copy"]
    same = _run(corpus, *args, "--validpref", corpus / "train")
    assert same.returncode == 0, same.stderr
    said = f"--validpref and --trainpref name the same files ({corpus / 'train'}.en): the valid "
    assert said + "set is the training set" in same.stderr, same.stderr
    assert "--testpref and" not in same.stderr


def test_tags_added_to_a_folder_prepared_without_them_are_refused_before_tagging(corpus):
    """A work folder whose BPE was learned with --no-tags, run again with tags (or the
    other way round), is refused before any step, naming --no-tags: it tagged the whole
    corpus first, then refused BPE for "the steps before it"."""
    done = _run(corpus, "--no-tags", "--stop-after", "bpe_learn", "--bpe-merges", "100")
    assert done.returncode == 0, done.stderr
    tagged = _run(corpus, "--stop-after", "bpe_learn", "--bpe-merges", "100")
    assert tagged.returncode == 2 and "step tag" not in tagged.stderr, tagged.stderr
    assert "prepared without tags (--no-tags), and this run asks for tags" in tagged.stderr
    shard = _run(corpus, "--tag-shard", "0/2", "--bpe-merges", "100")  # a SLURM array task
    assert shard.returncode == 2 and "step tag" not in shard.stderr, shard.stderr
    assert "pass --force (without --tag-shard) to prepare it again" in shard.stderr
    forced = _run(corpus, "--stop-after", "bpe_learn", "--bpe-merges", "100", "--force")
    assert forced.returncode == 0 and "step bpe_learn: running" in forced.stderr, forced.stderr
    untagged = _run(corpus, "--no-tags", "--bpe-merges", "100")
    assert untagged.returncode == 2 and "prepared with tags, and this run asks for --no-tags" in (
        untagged.stderr
    )


def test_non_english_source_needs_no_tags_and_then_skips_tagging(corpus):
    result = _run(corpus, src="de", tgt="en")
    assert result.returncode == 2
    assert "the source language is 'de', but tagging uses an English spaCy model" in result.stderr
    result = _run(
        corpus, "--no-tags", "--bpe-merges", "100", "--stop-after", "clean", src="de", tgt="en"
    )
    assert result.returncode == 0, result.stderr
    assert not (corpus / "work" / "tags").exists()
    assert (corpus / "work" / "final" / "train.de").exists()
    assert not (corpus / "work" / "final" / "train.pos").exists()


def test_force_and_tag_shard_do_not_mix(corpus):
    result = _run(corpus, "--force", "--tag-shard", "0/4")
    assert result.returncode == 2 and "--force would wipe the other shards' work" in result.stderr


def test_a_shard_before_the_steps_it_reads_are_done_is_refused(corpus, tmp_path):
    """The tasks of an array job would tokenise into the same files at once: a shard runs
    only once the steps before tagging are done."""
    work = tmp_path / "work"
    result = _run(corpus, "--work-dir", work, "--tag-shard", "0/2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "step 'tokenize' is not done yet" in result.stderr
    assert "--stop-after preclean" in result.stderr
    assert not (work / "tok").exists()


@pytest.mark.parametrize("name", ["", ".", "..", "a/b"])
def test_a_name_that_is_not_one_folder_is_refused(corpus, tmp_path, name):
    """--name is a folder under --data-bin: '' or '..' with --force replaced --data-bin
    itself or the folder above it."""
    data_bin = tmp_path / "a" / "bin"
    (data_bin / "other").mkdir(parents=True)
    (tmp_path / "a" / "kept").write_text("x")
    result = _run(
        corpus, "--name", name, "--data-bin", data_bin, "--work-dir", tmp_path / "w", "--force"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --name: must be the name of one folder under --data-bin" in result.stderr
    assert (data_bin / "other").is_dir() and (tmp_path / "a" / "kept").exists()


def test_cleaning_drops_lines_from_all_aligned_files_at_once(tmp_path):
    rows = [
        ("a b c", "x y z", "N N N"),
        ("", "x", ""),
        ("a " * 300, "x", "N " * 300),
        ("a", "x y z w", "N"),
        ("   ", "  ", ""),
        ("a b", "x y", "N V"),
    ]
    names = ["s", "t", "pos"]
    for i, name in enumerate(names):
        (tmp_path / name).write_text("".join(r[i].strip() + "\n" for r in rows))
    kept, dropped = cleaning.filter_aligned(
        [tmp_path / n for n in names],
        [tmp_path / f"{n}.out" for n in names],
        cleaning.LengthFilter(),
    )
    assert (kept, dropped) == (2, 4)
    assert (tmp_path / "pos.out").read_text() == "N N N\nN V\n"
    (tmp_path / "short").write_text("a\n")
    with pytest.raises(DataError, match=r"short:2: file ends before"):
        cleaning.filter_aligned(
            [tmp_path / "s", tmp_path / "short"],
            [tmp_path / "o1", tmp_path / "o2"],
            cleaning.LengthFilter(),
        )
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o1.tmp").exists()


def test_the_filter_before_bpe_drops_only_pairs_certain_to_fail():
    """A one-word side can pass --min-len 3 once BPE has cut it into subwords: only empty
    sides and sides over --max-len are certain to fail before BPE."""
    pre, final = cleaning.SafePreFilter(4), cleaning.LengthFilter(3, 4)
    assert pre.keep("Schwarzenegger", "Schwarzenegger")
    assert final.keep("Schwar@@ zen@@ egger", "Schwar@@ zen@@ egger")
    assert not pre.keep("", "x") and not pre.keep("a b c d e", "x")


def test_atomic_open_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with textio.atomic_open(target) as out:
            out.write("new, half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old" and not (tmp_path / "out.txt.tmp").exists()


@pytest.mark.parametrize(
    "case", ["whitespace-only side", "all over --max-len", "all over --max-ratio"]
)
def test_training_data_with_no_usable_pair_is_an_error_naming_the_file(corpus, case):
    """Issue 11.4: no traceback from inside subword-nmt, but an error naming the file and
    what was left."""
    extra = []
    if case == "whitespace-only side":
        (corpus / "train.de").write_text("  \n\t\n \n" * 10, encoding="utf-8")
        expected = (
            f"{corpus / 'train.de'}: no usable training pairs: 0 of 30 left after "
            "tokenisation and cleaning"
        )
        why = f"30 empty or whitespace only in {corpus / 'train.de'}"
    elif case == "all over --max-len":
        extra = ["--max-len", "3"]
        expected = f"{corpus / 'train.en'}: no usable training pairs: 0 of 30 left after"
        why = f"30 over --max-len 3 tokens in {corpus / 'train.de'}"
    else:  # everything goes at the last filter, on the BPE text
        # every target three times its source: the same words, so the same subwords
        lines = (corpus / "train.en").read_text(encoding="utf-8").splitlines()
        (corpus / "train.de").write_text(
            "".join(" ".join([line] * 3) + "\n" for line in lines), encoding="utf-8"
        )
        extra = ["--no-tags", "--bpe-merges", "50", "--max-ratio", "2.5"]
        expected = (
            f"{corpus / 'train.en'}: no usable training pairs: 0 of 30 left after BPE "
            "and the length/ratio filter"
        )
        why = "30 length ratio of the two sides over --max-ratio 2.5"
    result = _run(corpus, *extra)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and why in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (corpus / "bin" / "rel").exists()  # no output folder (only its lock)


def test_a_folder_at_the_staging_name_is_removed_only_if_binarizing_left_it(corpus):
    """data-bin/<name>.tmp/ is where binarizing stages its files: one an interrupted run
    left is removed; one of the user's own was removed too, without --force."""
    own = corpus / "bin" / "rel.tmp"
    own.mkdir(parents=True)
    (own / "precious.txt").write_text("mine\n")
    result = _run(corpus, "--bpe-merges", "100")
    assert result.returncode == 2, result.stderr
    assert f"{own}: exists without the mark of binarizing's staging folder" in result.stderr
    assert (own / "precious.txt").read_text() == "mine\n"
    (own / "precious.txt").unlink()
    (own / ".tpp-staging").write_text("")  # as a killed binarization leaves it
    (own / "train.en-de.en.bin").write_bytes(b"half")
    result = _run(corpus, "--bpe-merges", "100")
    assert result.returncode == 0, result.stderr
    assert not own.exists() and not (corpus / "bin" / "rel" / ".tpp-staging").exists()


def test_failed_binarize_leaves_no_staging_folder(corpus):
    """Issue 11.8: a binarization that fails removes data-bin/<name>.tmp/ at once."""
    assert _run(corpus, "--bpe-merges", "100", "--stop-after", "clean").returncode == 0
    final_pos = corpus / "work" / "final" / "valid.pos"
    lines = final_pos.read_text(encoding="utf-8").splitlines()
    lines[2] += " NOUN"  # one label too many: the alignment check after binarizing fails
    labels = len(lines[2].split())
    final_pos.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = _run(corpus, "--bpe-merges", "100")
    assert not (corpus / "bin" / "rel.tmp").exists(), "staging folder left behind"
    assert not (corpus / "bin" / "rel").exists()
    assert result.returncode == 2, result.stderr
    # the error names the text file that was binarized, and its line
    assert (
        f"{final_pos}:3: valid: sentence 2 (0-based: line 3 of the text) has {labels} pos "
        f"labels for {labels - 1} source tokens"
    ) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert (corpus / "work" / "preprocess.log").exists()  # kept where the work is


def _blocked_run(corpus):
    """A real pipeline run that stops, holding the work folder's lock, at its first step:
    the step marker it reads is a named pipe, so it waits there until the test opens the
    pipe's other end (which tells the test that the run holds the lock) and then until it
    is signalled."""
    process = subprocess.Popen(
        pipeline_command(
            "tpp-prepare-corpus",
            "-s",
            "en",
            "-t",
            "de",
            "--trainpref",
            corpus / "train",
            "--validpref",
            corpus / "valid",
            "--testpref",
            corpus / "test",
            "--name",
            "rel",
            "--work-dir",
            corpus / "work",
            "--data-bin",
            corpus / "bin",
            "--quiet",
            "--stop-after",
            "tokenize",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return process


def _lock_record(lock):
    text = lock.read_text()
    return json.loads(text) if text.strip() else None


def test_one_run_per_work_dir_and_stale_locks_are_taken_over(corpus):
    """Issue 11.5, with real pipeline processes: a second run refuses at once, naming the
    lock and the process holding it; a lock whose process was killed is taken over
    (by exactly one of two runs racing for it), saying so."""
    steps = corpus / "work" / ".steps"
    steps.mkdir(parents=True)
    marker = steps / "tokenize.json"
    os.mkfifo(marker)
    lock = corpus / "work" / ".lock"

    first = _blocked_run(corpus)
    pipe = _wait_for_reader(marker, first)  # the first run is inside its first step
    try:
        assert _lock_record(lock)["pid"] == first.pid
        # (without a lock it would wait on the same step marker: the timeout ends that)
        second = _run(corpus, "--stop-after", "tokenize", timeout=120)
        assert second.returncode == 2, second.stderr
        assert (
            f"{lock}: another run of the pipeline is using this work folder (process "
            f"{first.pid} on host " in second.stderr
        ), second.stderr
        assert "Traceback" not in second.stderr
        first.kill()  # SIGKILL: no chance to clear its record
        first.communicate()
    finally:
        pipe.close()
    assert _lock_record(lock)["pid"] == first.pid  # a stale record stays behind

    # two runs race for the stale lock: exactly one takes it over, the other refuses
    racers = [_blocked_run(corpus) for _ in range(2)]
    pipe = _wait_for_reader(marker, *racers)  # the winner has reached its first step
    try:
        winner_pid = _lock_record(lock)["pid"]
        winner = next(p for p in racers if p.pid == winner_pid)
        loser = next(p for p in racers if p.pid != winner_pid)
        _, loser_err = loser.communicate(timeout=120)
        assert loser.returncode == 2, loser_err
        assert (
            f"{lock}: another run of the pipeline is using this work folder (process "
            f"{winner_pid} on host " in loser_err
        ), loser_err
        winner.send_signal(signal.SIGTERM)  # a clean stop clears the record
        _, winner_err = winner.communicate(timeout=120)
    finally:
        pipe.close()
    assert f"taking over the lock left by process {first.pid} " in winner_err, winner_err
    assert winner.returncode == 128 + signal.SIGTERM, winner_err
    assert _lock_record(lock) is None

    # the folder is free again: a normal run goes through, with nothing to take over
    marker.unlink()
    result = _run(corpus, "--stop-after", "tokenize")
    assert result.returncode == 0, result.stderr
    assert "taking over" not in result.stderr
    assert "does not read like English" not in result.stderr
    assert _lock_record(lock) is None


def test_a_compressed_input_is_named(corpus):
    """The corpora come as .xz: the error says the file is there, compressed."""
    import lzma

    packed = corpus / "train.de.xz"
    packed.write_bytes(lzma.compress((corpus / "train.de").read_bytes()))
    (corpus / "train.de").unlink()
    result = _run(corpus)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        f"error: {corpus / 'train.de'}: input file not found ({packed} is there: decompress "
        "it first)" in result.stderr
    ), result.stderr[-3000:]


def test_a_source_that_does_not_read_like_english_is_warned_about(tmp_path):
    """The source is tagged by an English model: German text in the .en files (the
    languages swapped) is said before anything runs; English text is not."""
    pairs = [(german, english) for english, german in english_pairs(30)]
    # one long English line among them (a document's worth) does not hide the rest
    long = ("The share of the words of this line is English. " * 40).strip()
    train = [(long, long), *pairs]
    write_corpus(tmp_path, {"train": train, "valid": pairs, "test": pairs}, "en", "de")
    # an English model named by --spacy-model too (not warned about, as not the default)
    model = tagging.default_model_name()
    swapped = _run(tmp_path, "--stop-after", "tokenize", "--spacy-model", model)
    assert swapped.returncode == 0, swapped.stderr[-3000:]
    assert (
        f"{tmp_path / 'train.en'} does not read like English: in a typical line 0% of the "
        "words are the commonest English words" in swapped.stderr
    ), swapped.stderr[-3000:]
    assert "Are -s and -t swapped?" in swapped.stderr


def test_a_command_the_pipeline_runs_holds_its_locks(tmp_path):
    """A command the pipeline runs (fairseq-preprocess) inherits its locks: left running
    by a run killed outright, it still holds them, and a run started again is refused,
    naming it, instead of clearing the staging folder it writes into."""
    from tpp_pipeline.lock import held_locks, work_dir_lock

    with work_dir_lock(tmp_path):
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE,
            pass_fds=held_locks(),
        )
    assert held_locks() == ()
    try:
        with pytest.raises(DataError, match=rf"this work folder \(process {child.pid} on host"):
            with work_dir_lock(tmp_path):
                pass
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    with work_dir_lock(tmp_path):  # free once the command has ended
        pass


def test_the_lock_names_its_holders_command_as_it_can_be_run_again(tmp_path, monkeypatch):
    """A run refused by the lock is told the holder's command, quoted as a shell takes it
    (a path with a space is one word)."""
    from tpp_pipeline.lock import LOCK_NAME, work_dir_lock

    argv = ["tpp-prepare-corpus", "--work-dir", str(tmp_path / "work dir")]
    monkeypatch.setattr(sys, "argv", argv)
    with work_dir_lock(tmp_path):
        record = json.loads((tmp_path / LOCK_NAME).read_text())
    assert shlex.split(record["command"]) == argv


def test_sighup_stops_the_pipelines_commands_and_clears_its_lock(tmp_path):
    """A closed terminal (SIGHUP) ends a run as SIGTERM does: the command it runs is
    stopped (subprocess.run kills it on the way out) and its lock's record cleared;
    unless SIGHUP is ignored (nohup). Ctrl-C (SIGINT) too."""
    from tpp_pipeline.lock import work_dir_lock

    script = (
        "import signal, subprocess, sys\n"
        "from tpp_pipeline.lock import exit_cleanly_on_sigterm, held_locks, work_dir_lock\n"
        "if sys.argv[2:] == ['nohup']:\n"
        "    signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "exit_cleanly_on_sigterm()\n"
        "with work_dir_lock(sys.argv[1]):\n"
        "    waits = 'import os, signal; print(os.getpid(), flush=True); signal.pause()'\n"
        "    subprocess.run([sys.executable, '-c', waits], pass_fds=held_locks())\n"
    )
    run = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    command = int(run.stdout.readline())  # the command has started, holding the lock
    run.send_signal(signal.SIGHUP)
    assert run.wait(timeout=60) == 128 + signal.SIGHUP
    assert _lock_record(tmp_path / ".lock") is None
    with work_dir_lock(tmp_path):  # its command, which held the lock too, is gone
        pass
    with pytest.raises(ProcessLookupError):
        os.kill(command, 0)
    # under nohup, SIGHUP stays ignored: SIGTERM ends the run
    run = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path), "nohup"], stdout=subprocess.PIPE, text=True
    )
    int(run.stdout.readline())
    run.send_signal(signal.SIGHUP)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 128 + signal.SIGTERM
    # Ctrl-C the same way, without a traceback
    run = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    command = int(run.stdout.readline())
    run.send_signal(signal.SIGINT)
    assert run.wait(timeout=60) == 128 + signal.SIGINT
    assert "Traceback" not in run.stderr.read() and _lock_record(tmp_path / ".lock") is None
    with pytest.raises(ProcessLookupError):
        os.kill(command, 0)


# ----------------------------------------------------------------- errors before the steps


def _no_step_ran(corpus, work="work"):
    """Nothing but the lock (and the step markers' folder) in the work folder."""
    folder = corpus / work
    return not folder.exists() or {p.name for p in folder.iterdir()} <= {".lock", ".steps"}


@pytest.mark.parametrize(
    "case",
    [
        "same languages",
        "empty test set",
        "blank valid set",
        "old Mac line endings",
        "--bpe-codes missing",
        "--bpe-codes garbage",
        "--bpe-codes a folder",
        "--spacy-model missing",
        "--spacy-model not a model",
        "--spacy-model without ner",
        "--spacy-model blank",
        "input is a folder",
        "output in the work folder",
    ],
)
def test_bad_inputs_and_settings_are_refused_before_any_step(corpus, case):
    """Issue 33.9: each of these ran tokenising (and tagging) first, then ended in a
    traceback (or, for garbage codes, in subword-nmt's own exit status 1)."""
    extra, src, tgt = [], "en", "de"
    if case == "same languages":
        tgt = "en"
        expected = "source and target language are both 'en' (-s, -t): they must differ"
    elif case == "empty test set":
        for lang in ("en", "de"):
            (corpus / f"test.{lang}").write_bytes(b"")
        expected = (
            f"{corpus / 'test.en'}: the test set is empty (0 lines in both files): "
            "every split needs at least one sentence pair"
        )
    elif case == "blank valid set":
        # a byte-order mark, a no-break space and a zero-width space read as space too
        (corpus / "valid.de").write_bytes("\n \n\t\n\ufeff\n\u00a0\n\u200b\n".encode())
        (corpus / "valid.en").write_bytes(b"A sentence.\n\n\n\n\n\n")
        expected = (
            f"{corpus / 'valid.de'}: the valid set has only blank lines here: every split "
            "needs at least one sentence to translate"
        )
    elif case == "old Mac line endings":  # (read as one pair of lines, aligned)
        for lang in ("en", "de"):
            path = corpus / f"valid.{lang}"
            path.write_bytes(path.read_bytes().replace(b"\n", b"\r"))
        expected = f"{corpus / 'valid.en'}: ends its lines with a carriage return alone"
    elif case == "--bpe-codes missing":
        extra = ["--bpe-codes", corpus / "no_codes"]
        expected = f"{corpus / 'no_codes'}: BPE codes not found (--bpe-codes)"
    elif case == "--bpe-codes garbage":
        (corpus / "codes").write_text("garbage codes here\n")
        extra = ["--bpe-codes", corpus / "codes"]
        expected = (
            f"{corpus / 'codes'}: not BPE codes that subword-nmt can read (--bpe-codes): "
            "Error: invalid line 1 in BPE codes file: garbage codes here"
        )
    elif case == "--bpe-codes a folder":
        extra = ["--bpe-codes", corpus]
        expected = f"{corpus}: is a folder, not a file of BPE codes (--bpe-codes)"
    elif case == "--spacy-model missing":
        extra = ["--spacy-model", "no_such_spacy_model"]
        expected = "spaCy model 'no_such_spacy_model' (--spacy-model) is neither an installed"
    elif case == "--spacy-model not a model":  # (spaCy's traceback after two steps)
        (corpus / "model").mkdir()
        extra = ["--spacy-model", corpus / "model"]
        expected = f"{corpus / 'model'}: is a folder without a spaCy model's config.cfg"
    elif case == "--spacy-model without ner":  # (refused when the tagging started)
        import spacy

        spacy.blank("en").to_disk(corpus / "model")
        extra = ["--spacy-model", corpus / "model"]
        expected = f"spaCy model {corpus / 'model'} (--spacy-model) has no 'ner' component"
    elif case == "--spacy-model blank":
        extra = ["--spacy-model", "blank:en"]
        expected = "--spacy-model blank:en: a blank spaCy pipeline has no components"
    elif case == "output in the work folder":  # (--name final was the step folder final/)
        extra = ["--data-bin", corpus / "work", "--name", "final"]
        expected = (
            f"{corpus / 'work' / 'final'}: the output folder and the work folder "
            f"{corpus / 'work'} (--work-dir) overlap"
        )
    else:
        (corpus / "valid.de").unlink()
        (corpus / "valid.de").mkdir()
        expected = f"{corpus / 'valid.de'}: is a folder, not a file: the valid files are"
    result = _run(corpus, *extra, src=src, tgt=tgt)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert _no_step_ran(corpus), sorted(p.name for p in (corpus / "work").iterdir())


@pytest.mark.parametrize(
    "options, message",
    [
        (["--tag-chunk-size", "0"], "argument --tag-chunk-size: must be at least 1, not 0"),
        (["--tag-batch-size", "0"], "argument --tag-batch-size: must be at least 1, not 0"),
        (["--workers", "0"], "argument --workers: must be at least 1, not 0"),
        (["--tag-shard", "3/2"], "argument --tag-shard: the shard's index must be in [0, 2)"),
        (["--tag-shard", "0/0"], "argument --tag-shard: the number of shards must be at least"),
        (["--bpe-merges", "0"], "argument --bpe-merges: must be at least 1, not 0"),
        (["--max-ratio", "0"], "argument --max-ratio: must be at least 1, not 0"),
        (["--max-ratio", "0.5"], "argument --max-ratio: must be at least 1, not 0.5"),
        (["--min-len", "0"], "argument --min-len: must be at least 1, not 0"),
        (["--dict-size", "-1"], "argument --dict-size: must be at least 0, not -1"),
        (["--min-len", "9", "--max-len", "3"], "--min-len 9 is above --max-len 3"),
    ],
)
def test_a_size_or_limit_that_cannot_work_is_a_usage_error(corpus, options, message):
    """Issue 33.9: --tag-chunk-size 0 was a ZeroDivisionError in the tag step; issue 49.6:
    --workers 0 failed after tagging, --bpe-merges 0 in subword-nmt, --max-ratio 0
    switched the ratio filter off."""
    result = _run(corpus, *options)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (corpus / "work").exists()


@pytest.mark.parametrize("which", ["--data-bin", "--work-dir"])
@pytest.mark.parametrize("how", ["a file in the path", "read-only folder"])
def test_an_output_folder_that_cannot_be_written_is_an_error_before_any_step(
    corpus, which, how, request
):
    """Issue 33.9: a read-only --data-bin was found after tokenising, tagging and BPE
    (OSError EROFS), a read-only --work-dir by a traceback from makedirs. A folder that
    cannot be created (a file stands in its path) fails the same way as one that cannot
    be written. Root ignores a folder's permissions, so as root the folder is made
    immutable (``chattr +i``), which binds root too."""
    if how == "a file in the path":
        (corpus / "taken").write_text("a file, not a folder\n")
        folder = corpus / "taken" / "out"
    else:
        folder = corpus / "readonly"
        folder.mkdir()
        folder.chmod(0o555)
        if os.geteuid() == 0:
            made = subprocess.run(["chattr", "+i", folder], capture_output=True, text=True)
            if made.returncode != 0:
                pytest.skip(f"root, on a filesystem without the immutable flag: {made.stderr}")
            request.addfinalizer(lambda: subprocess.run(["chattr", "-i", folder], check=True))
    args = ["--data-bin", folder] if which == "--data-bin" else []
    if which == "--work-dir":  # the helper gives --work-dir corpus/work: point it elsewhere
        result = run_pipeline(
            "tpp-prepare-corpus",
            "-s",
            "en",
            "-t",
            "de",
            "--trainpref",
            corpus / "train",
            "--validpref",
            corpus / "valid",
            "--testpref",
            corpus / "test",
            "--name",
            "rel",
            "--work-dir",
            folder / "w",
            "--data-bin",
            corpus / "bin",
            "--quiet",
            check=False,
        )
        named = folder / "w"
        expected = "cannot create or write into this work folder"
    else:
        result = _run(corpus, *args)
        named = folder
        expected = "cannot create or write into this --data-bin folder"
    assert result.returncode == 2, result.stderr
    assert f"{named}: {expected} (" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert _no_step_ran(corpus)


def test_a_full_disk_is_an_error_naming_the_file_and_leaves_no_temporary_file(corpus):
    """Issue 33.9: a full disk gave a raw OSError (ENOSPC) and left its .tmp files. The
    run here may write no file over 3,000 bytes (RLIMIT_FSIZE: a write past it fails as
    on a full disk, with EFBIG), enough to tokenise but not for the BPE text of 20
    merges. Once there is room again, the re-run keeps the steps already done."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))

    (corpus / "codes").write_text(
        "#version: 0.2\n"
        + "".join(f"{a} {b}\n" for a, b in [("t", "h"), ("e", "r</w>"), ("a", "n")])
    )
    command = pipeline_command(
        "tpp-prepare-corpus",
        "-s",
        "en",
        "-t",
        "de",
        "--trainpref",
        corpus / "train",
        "--validpref",
        corpus / "valid",
        "--testpref",
        corpus / "test",
        "--name",
        "rel",
        "--work-dir",
        corpus / "work",
        "--data-bin",
        corpus / "bin",
        "--quiet",
        "--no-tags",
        "--bpe-codes",
        corpus / "codes",
    )
    full = subprocess.run(command, capture_output=True, text=True, preexec_fn=small_files)
    assert full.returncode == 2, full.stderr
    bpe_dir = corpus / "work" / "bpe"
    assert (
        f"error: {bpe_dir}/train.en: writing failed: File too large [EFBIG]; make room "
        "(free space, raise the quota or file-size limit) or point --work-dir / "
        "--data-bin at another disk, then run again: the steps already done are kept" in full.stderr
    ), full.stderr
    assert "Traceback" not in full.stderr
    assert not list(corpus.rglob("*.tmp")), list(corpus.rglob("*.tmp"))
    assert (corpus / "work" / "tok" / "train.en").exists()  # the steps before were done

    again = _run(corpus, "--no-tags", "--bpe-codes", corpus / "codes")
    assert again.returncode == 0, again.stderr
    assert "step tokenize: already done" in again.stderr
    assert "step bpe_apply: running" in again.stderr
    assert (corpus / "bin" / "rel" / "train.en-de.en.bin").exists()


def test_atomic_writers_remove_their_temporary_files_when_the_disk_is_full(tmp_path):
    """The writers' clean-up when closing a file fails (its last buffer goes onto a full
    disk): writing to /dev/full fails with ENOSPC as a full disk does. The error names the
    file, nothing is left behind, and no file of the set is renamed into place."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    paths = [tmp_path / name for name in ("a.txt", "b.txt", "c.txt")]
    os.symlink("/dev/full", textio.temp_name(paths[1]))  # where b.txt is written first
    with pytest.raises(OSError) as raised:
        with textio.atomic_files(paths) as outs:
            for out in outs:
                out.write("some text\n")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(paths[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    os.symlink("/dev/full", textio.temp_name(paths[0]))
    with pytest.raises(OSError) as raised:
        with textio.atomic_open(paths[0]) as out:
            out.write("some text\n")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(paths[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_full_output_disk_at_binarizing_is_an_error_and_leaves_nothing(corpus):
    """Issue 33.9 (a full --data-bin): a traceback from inside the writer of the output
    folder. The real command runs with writes into the output's staging folder sent to
    /dev/full, which fails as a full disk does (ENOSPC); fairseq-preprocess runs as
    usual."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    staging = str(corpus / "bin" / "rel.tmp")
    script = (
        "import builtins, sys\n"
        "from tpp_pipeline import pipeline, textio\n"
        "def full_disk(path, mode='r', **kwargs):\n"
        f"    if str(path).startswith({staging!r}):\n"
        "        path = '/dev/full'\n"
        "    return builtins.open(path, mode, **kwargs)\n"
        "textio.open = full_disk\n"
        "sys.exit(pipeline.main(sys.argv[1:]))\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "-s",
            "en",
            "-t",
            "de",
            "--trainpref",
            corpus / "train",
            "--validpref",
            corpus / "valid",
            "--testpref",
            corpus / "test",
            "--name",
            "rel",
            "--work-dir",
            corpus / "work",
            "--data-bin",
            corpus / "bin",
            "--quiet",
            "--no-tags",
            "--bpe-merges",
            "50",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    assert (
        f"error: {staging}/preprocess_info.json: writing failed: No space left on device "
        "[ENOSPC]; make room" in result.stderr
    ), result.stderr
    assert "Traceback" not in result.stderr
    assert not (corpus / "bin" / "rel").exists() and not os.path.exists(staging)
    assert not list(corpus.rglob("*.tmp")), list(corpus.rglob("*.tmp"))
    assert (corpus / "work" / "preprocess.log").exists()  # kept where the work is


# ------------------------------------------------------------------ one run per output folder


def _wait_for_reader(fifo, *processes, timeout=120):
    """Open ``fifo`` for writing once one of ``processes`` has opened it for reading (it
    then waits there); fails if they all end first, or at the deadline."""
    deadline = time.time() + timeout
    while True:
        try:
            return os.fdopen(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "w")
        except OSError as error:
            if error.errno != errno.ENXIO:
                raise
        ended = [p for p in processes if p.poll() is not None]
        assert len(ended) < len(processes), [p.communicate()[1] for p in ended]
        assert time.time() < deadline, "no run reached its first step"
        time.sleep(0.05)


def test_one_run_per_output_folder(corpus):
    """Issue 33.9: two runs with the same --name and --data-bin but different work
    folders shared data-bin/<name>.tmp and failed with a traceback. The output folder
    has a lock of its own, taken before any step: the second run is refused at once,
    naming the first; a run that will not binarize (--stop-after) is not held up."""
    steps = corpus / "work1" / ".steps"
    steps.mkdir(parents=True)
    marker = steps / "tokenize.json"
    os.mkfifo(marker)
    first = subprocess.Popen(
        pipeline_command(
            "tpp-prepare-corpus",
            "-s",
            "en",
            "-t",
            "de",
            "--trainpref",
            corpus / "train",
            "--validpref",
            corpus / "valid",
            "--testpref",
            corpus / "test",
            "--name",
            "rel",
            "--work-dir",
            corpus / "work1",
            "--data-bin",
            corpus / "bin",
            "--quiet",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pipe = _wait_for_reader(marker, first)  # the first run waits in its first step
    try:
        second = _run(corpus, timeout=120)  # --work-dir corpus/work
        assert second.returncode == 2, second.stderr
        lock = corpus / "bin" / ".rel.lock"
        assert (
            f"{lock}: another run of the pipeline is using this output folder "
            f"{corpus / 'bin' / 'rel'} (process {first.pid} on host " in second.stderr
        ), second.stderr
        assert "Traceback" not in second.stderr
        assert _no_step_ran(corpus)
        tokenise_only = _run(corpus, "--stop-after", "tokenize", timeout=120)
        assert tokenise_only.returncode == 0, tokenise_only.stderr
        first.kill()
        first.communicate()
    finally:
        pipe.close()
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert not (corpus / "bin" / "rel").exists() and not (corpus / "bin" / "rel.tmp").exists()


# ------------------------------------------------------------------ changed settings


def _binarized(folder):
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if p.suffix in (".bin", ".idx") or p.name.startswith("dict.")
    }


def test_a_run_from_another_folder_finds_its_steps_done(corpus):
    """Relative paths, as typed, from two folders: the second run finds every step done
    (the step records hold their outputs' absolute paths) and leaves the data folder as
    it was; it redid every step and rebuilt the data folder without --force."""
    (corpus / "elsewhere").mkdir()
    options = ["-s", "en", "-t", "de", "--name", "rel", "--quiet"]
    for prefix, split in (
        ("--trainpref", "train"),
        ("--validpref", "valid"),
        ("--testpref", "test"),
    ):
        options += [prefix, split]
    first = run_pipeline(
        "tpp-prepare-corpus", *options, "--work-dir", "work", "--data-bin", "bin", cwd=corpus
    )
    assert first.returncode == 0, first.stderr
    made = (corpus / "bin" / "rel" / "dict.en.txt").stat().st_mtime_ns
    moved = [
        o if o in ("-s", "-t", "en", "de", "rel") or o.startswith("-") else f"../{o}"
        for o in options
    ]
    again = run_pipeline(
        "tpp-prepare-corpus",
        *moved,
        "--work-dir",
        "../work",
        "--data-bin",
        "../bin",
        cwd=corpus / "elsewhere",
    )
    assert again.returncode == 0, again.stderr
    assert "running" not in again.stderr and "redoing" not in again.stderr, again.stderr
    assert (corpus / "bin" / "rel" / "dict.en.txt").stat().st_mtime_ns == made


@pytest.mark.slow  # the whole pipeline, tagging included, four times
def test_a_changed_setting_is_named_and_force_redoes_only_what_depends_on_it(corpus):
    """Issue 33.12: re-running with only --data-bin changed said "different settings or
    inputs" without naming one, and --force then tagged everything again. Another
    --data-bin now just binarizes there; a changed setting is named, with its two values;
    --force redoes its step and those after it, keeping the ones before (tagging)."""
    first = _run(corpus, "--bpe-merges", "100")
    assert first.returncode == 0 and "step bpe_learn: running" in first.stderr
    assert "%|" not in first.stderr, first.stderr  # --quiet: no progress bar, subword-nmt's too
    tags = corpus / "work" / "tags" / "train.pos"
    tagged = tags.stat().st_mtime_ns

    moved = _run(corpus, "--bpe-merges", "100", "--data-bin", corpus / "bin2")
    assert moved.returncode == 0, moved.stderr
    assert "step tag: already done, skipping" in moved.stderr
    assert (
        f'step binarize: done before with the output folder (--data-bin, --name) was '
        f'"{corpus / "bin" / "rel"}", now "{corpus / "bin2" / "rel"}"; running it again'
        in moved.stderr
    ), moved.stderr
    assert _binarized(corpus / "bin2" / "rel") == _binarized(corpus / "bin" / "rel")
    back = _run(corpus, "--bpe-merges", "100")  # the first folder again: said as it is
    assert back.returncode == 2 and "Traceback" not in back.stderr, back.stderr
    assert (
        f"{corpus / 'bin' / 'rel'}: output folder exists, and is not this work folder's (its "
        f"last binarize wrote {corpus / 'bin2' / 'rel'}); pass --force" in back.stderr
    ), back.stderr

    changed = _run(corpus, "--bpe-merges", "100", "--data-bin", corpus / "bin2", "--max-ratio", "2")
    assert changed.returncode == 2, changed.stderr
    assert (
        "step 'clean' was already done with other settings or inputs: --max-ratio was "
        "1.5, now 2.0; re-run with --force to redo this step and the ones after it (the "
        "steps before it are kept)" in changed.stderr
    ), changed.stderr
    assert "Traceback" not in changed.stderr

    forced = _run(
        corpus, "--bpe-merges", "100", "--data-bin", corpus / "bin2", "--max-ratio", "2", "--force"
    )
    assert forced.returncode == 0, forced.stderr
    for step in ("tokenize", "preclean", "tag", "bpe_learn", "bpe_apply"):
        assert f"step {step}: already done, skipping" in forced.stderr, forced.stderr
    assert (
        "step clean: settings changed (--max-ratio was 1.5, now 2.0): redoing it" in forced.stderr
    )
    assert "step binarize: running" in forced.stderr
    assert tags.stat().st_mtime_ns == tagged
    info = json.loads((corpus / "bin2" / "rel" / "preprocess_info.json").read_text())
    assert info["clean"]["ratio"] == 2.0
