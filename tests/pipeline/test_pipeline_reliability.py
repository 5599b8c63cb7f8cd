"""Bad input gets a clear error naming file and line (exit status 2, no traceback);
outputs are never half-written; one run per work folder at a time."""

import json
import os
import signal
import subprocess

import pytest

from support import english_pairs, pipeline_command, run_pipeline, write_corpus

from tpp_pipeline import cleaning, textio
from tpp_pipeline.errors import DataError


@pytest.fixture
def corpus(tmp_path):
    pairs = english_pairs(30)
    write_corpus(tmp_path, {split: pairs for split in ("train", "valid", "test")}, "en", "de")
    return tmp_path


def _run(corpus, *extra, src="en", tgt="de", timeout=600):
    return run_pipeline("tpp-prepare-corpus", "-s", src, "-t", tgt,
                      "--trainpref", corpus / "train", "--validpref", corpus / "valid",
                      "--testpref", corpus / "test", "--name", "rel", "--work-dir",
                      corpus / "work", "--data-bin", corpus / "bin", "--quiet", *extra,
                      check=False, timeout=timeout)


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


def test_non_english_source_needs_no_tags_and_then_skips_tagging(corpus):
    result = _run(corpus, src="de", tgt="en")
    assert result.returncode == 2 and "--no-tags" in result.stderr
    result = _run(corpus, "--no-tags", "--bpe-merges", "100", "--stop-after", "clean",
                  src="de", tgt="en")
    assert result.returncode == 0, result.stderr
    assert not (corpus / "work" / "tags").exists()
    assert (corpus / "work" / "final" / "train.de").exists()
    assert not (corpus / "work" / "final" / "train.pos").exists()


def test_force_and_tag_shard_do_not_mix(corpus):
    result = _run(corpus, "--force", "--tag-shard", "0/4")
    assert result.returncode == 2 and "--tag-shard" in result.stderr


def test_cleaning_drops_lines_from_all_aligned_files_at_once(tmp_path):
    rows = [("a b c", "x y z", "N N N"), ("", "x", ""), ("a " * 300, "x", "N " * 300),
            ("a", "x y z w", "N"), ("   ", "  ", ""), ("a b", "x y", "N V")]
    names = ["s", "t", "pos"]
    for i, name in enumerate(names):
        (tmp_path / name).write_text("".join(r[i].strip() + "\n" for r in rows))
    kept, dropped = cleaning.filter_aligned([tmp_path / n for n in names],
                                            [tmp_path / f"{n}.out" for n in names],
                                            cleaning.LengthFilter())
    assert (kept, dropped) == (2, 4)
    assert (tmp_path / "pos.out").read_text() == "N N N\nN V\n"
    (tmp_path / "short").write_text("a\n")
    with pytest.raises(DataError, match=r"short:2: file ends before"):
        cleaning.filter_aligned([tmp_path / "s", tmp_path / "short"],
                                [tmp_path / "o1", tmp_path / "o2"], cleaning.LengthFilter())
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o1.tmp").exists()


def test_atomic_open_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with textio.atomic_open(target) as out:
            out.write("new, half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old" and not (tmp_path / "out.txt.tmp").exists()


@pytest.mark.parametrize("case", ["whitespace-only side", "all over --max-len", "all over --max-ratio"])
def test_training_data_with_no_usable_pair_is_an_error_naming_the_file(corpus, case):
    """Issue 11.4: no traceback from inside subword-nmt, but an error naming the file and
    what was left."""
    extra = []
    if case == "whitespace-only side":
        (corpus / "train.de").write_text("  \n\t\n \n" * 10, encoding="utf-8")
        expected = (f"{corpus / 'train.de'}: no usable training pairs: 0 of 30 left after "
                    "tokenisation and cleaning")
        why = f"30 empty or whitespace only in {corpus / 'train.de'}"
    elif case == "all over --max-len":
        extra = ["--max-len", "3"]
        expected = f"{corpus / 'train.en'}: no usable training pairs: 0 of 30 left after"
        why = f"30 over --max-len 3 tokens in {corpus / 'train.de'}"
    else:  # everything goes at the last filter, on the BPE text
        extra = ["--no-tags", "--bpe-merges", "50", "--max-ratio", "0.5"]
        expected = (f"{corpus / 'train.en'}: no usable training pairs: 0 of 30 left after BPE "
                    "and the length/ratio filter")
        why = "30 length ratio of the two sides over --max-ratio 0.5"
    result = _run(corpus, *extra)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and why in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (corpus / "bin").exists()


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
    assert (f"{final_pos}:3: valid: sentence 2 has {labels} pos labels for {labels - 1} source "
            "tokens") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert (corpus / "work" / "preprocess.log").exists()  # kept where the work is


def _blocked_run(corpus):
    """A real pipeline run that stops, holding the work folder's lock, at its first step:
    the step marker it reads is a named pipe, so it waits there until the test opens the
    pipe's other end (which tells the test that the run holds the lock) and then until it
    is signalled."""
    process = subprocess.Popen(
        pipeline_command("tpp-prepare-corpus", "-s", "en", "-t", "de",
                         "--trainpref", corpus / "train", "--validpref", corpus / "valid",
                         "--testpref", corpus / "test", "--name", "rel", "--work-dir", corpus / "work",
                         "--data-bin", corpus / "bin", "--quiet", "--stop-after", "tokenize"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    pipe = open(marker, "w")  # returns once the first run is inside its first step
    try:
        assert _lock_record(lock)["pid"] == first.pid
        # (without a lock it would wait on the same step marker: the timeout ends that)
        second = _run(corpus, "--stop-after", "tokenize", timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"{lock}: another run of the pipeline is using this work folder (process " \
               f"{first.pid} on host " in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        first.kill()  # SIGKILL: no chance to clear its record
        first.communicate()
    finally:
        pipe.close()
    assert _lock_record(lock)["pid"] == first.pid  # a stale record stays behind

    # two runs race for the stale lock: exactly one takes it over, the other refuses
    racers = [_blocked_run(corpus) for _ in range(2)]
    pipe = open(marker, "w")  # the winner has reached its first step
    try:
        winner_pid = _lock_record(lock)["pid"]
        winner = next(p for p in racers if p.pid == winner_pid)
        loser = next(p for p in racers if p.pid != winner_pid)
        _, loser_err = loser.communicate(timeout=120)
        assert loser.returncode == 2, loser_err
        assert f"{lock}: another run of the pipeline is using this work folder (process " \
               f"{winner_pid} on host " in loser_err, loser_err
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
    assert _lock_record(lock) is None
