"""Interrupted tagging resumes and gives byte-identical output; finished chunks are kept."""

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from support import english_pairs, pipeline_command, write_corpus

from tpp_pipeline import tagging
from tpp_pipeline.errors import DataError

pytestmark = pytest.mark.slow
CHUNK = 20
LINES = 600


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    pairs = english_pairs(LINES)
    write_corpus(d, {"train": pairs, "valid": pairs[:30], "test": pairs[30:60]}, "en", "de")
    return d


def _pipeline(corpus, work, *extra):
    return [
        *pipeline_command("tpp-prepare-corpus"),
        "-s",
        "en",
        "-t",
        "de",
        "--trainpref",
        str(corpus / "train"),
        "--validpref",
        str(corpus / "valid"),
        "--testpref",
        str(corpus / "test"),
        "--name",
        "resume",
        "--work-dir",
        str(work),
        "--data-bin",
        str(work / "bin"),
        "--tag-chunk-size",
        str(CHUNK),
        "--stop-after",
        "tag",
        "--quiet",
        *extra,
    ]


def _tags(work):
    return {
        f"{split}.{kind}": (work / "tags" / f"{split}.{kind}").read_bytes()
        for split in ("train", "valid", "test")
        for kind in ("pos", "ner")
    }


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    work = tmp_path_factory.mktemp("full")
    subprocess.run(_pipeline(corpus, work), check=True, capture_output=True)
    return _tags(work)


def _started_until_its_first_chunk(command, chunk_dir):
    """``command`` started in a process group of its own, once it has tagged a chunk."""
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 300
    while not (chunk_dir / "000000.ner").exists():
        if process.poll() is not None or time.time() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError("the run ended, or did not start tagging, before it was killed")
        time.sleep(0.02)
    return process


def test_killed_run_resumes_to_identical_output(corpus, uninterrupted, tmp_path):
    work = tmp_path / "killed"
    chunk_dir = work / "tags" / "train.chunks"
    process = _started_until_its_first_chunk(_pipeline(corpus, work), chunk_dir)
    os.killpg(process.pid, signal.SIGKILL)  # the run's own process group only
    process.wait()
    done = sorted(p.name for p in chunk_dir.glob("*.ner"))
    n_chunks = -(-LINES // CHUNK)
    assert 1 <= len(done) < n_chunks, "interrupt came too late to test resuming"
    first_chunk = chunk_dir / "000000.pos"
    stamp = first_chunk.stat().st_mtime_ns

    # resume, but stop after the chunks of the first half: chunk 0 must not be redone
    job = tagging.TagJob(str(work / "clean" / "train.en"), str(work / "tags" / "train"), CHUNK)
    tagging.tag_files([job], shard=(0, 2), progress=False)
    assert first_chunk.stat().st_mtime_ns == stamp
    assert len(tagging.missing_chunks(job)) == n_chunks - n_chunks // 2

    result = subprocess.run(_pipeline(corpus, work), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "already done, resuming" in result.stderr
    assert _tags(work) == uninterrupted


def _children(pid):
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:  # (ended meanwhile)
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.split("/")[2]))
    return found


def _wait_for_their_end(workers):
    """Return once the processes ``workers`` have ended; fail after a minute."""
    deadline = time.time() + 60
    while [p for p in workers if os.path.exists(f"/proc/{p}")]:
        assert time.time() < deadline, "the tagging workers outlived their run"
        time.sleep(0.05)


def test_workers_end_with_a_run_killed_alone_and_it_resumes(corpus, uninterrupted, tmp_path):
    """Only the run's main process killed (SIGKILL, as the OOM killer does): its forked
    tagging workers end too, instead of waiting for chunks forever with the work
    folder's lock, which refused every run after it."""
    work = tmp_path / "orphans"
    chunk_dir = work / "tags" / "train.chunks"
    process = _started_until_its_first_chunk(_pipeline(corpus, work, "--workers", "2"), chunk_dir)
    try:
        workers = _children(process.pid)
        assert len(workers) >= 2, workers
        process.kill()  # the main process alone
        process.wait()
        _wait_for_their_end(workers)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    result = subprocess.run(
        _pipeline(corpus, work, "--workers", "2"), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _tags(work) == uninterrupted


def test_a_run_told_alone_to_stop_ends_its_workers_at_once(corpus, tmp_path):
    """SIGTERM to the run's main process alone (``kill PID``; a container stopped) ends
    it without waiting for the chunks its workers are tagging: here they would never
    end. The workers end with it."""
    work = tmp_path / "told"
    started = tmp_path / "chunk-started"
    script = (
        "import sys, threading\n"
        "from tpp_pipeline import pipeline, tagging\n"
        "def endless(paths, lines, source, first_line):\n"
        f"    open({str(started)!r}, 'a').close()\n"
        "    threading.Event().wait()\n"
        "tagging._tag_chunk = endless\n"
        "sys.exit(pipeline.main(sys.argv[1:]))\n"
    )
    command = _pipeline(corpus, work, "--workers", "2")
    process = subprocess.Popen(
        [sys.executable, "-c", script, *command[1:]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not started.exists():
            assert process.poll() is None and time.time() < deadline, "tagging did not start"
            time.sleep(0.02)
        workers = _children(process.pid)
        assert len(workers) >= 2, workers
        process.send_signal(signal.SIGTERM)  # the main process alone
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
        _wait_for_their_end(workers)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def test_run_stopped_after_merging_resumes_without_tagging_again(corpus, uninterrupted, tmp_path):
    """A run stopped once the chunks are merged but before the step is marked done (here,
    by a SIGTERM's exit as the label sets are read) keeps its chunks: the next run only
    merges them again."""
    work = tmp_path / "merged"
    script = (
        "import sys\n"
        "from tpp_pipeline import pipeline, tagging\n"
        "def stopped(*args, **kwargs):\n"
        "    raise SystemExit(143)\n"
        "tagging.labeler = stopped\n"
        "sys.exit(pipeline.main(sys.argv[1:]))\n"
    )
    command = _pipeline(corpus, work)
    stopped = subprocess.run(
        [sys.executable, "-c", script, *command[1:]], capture_output=True, text=True
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert (work / "tags" / "train.pos").exists() and not (work / ".steps" / "tag.json").exists()
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    total = sum(-(-n // CHUNK) for n in (LINES, 30, 30))
    assert f"{total} of {total} chunks already done" in result.stderr
    assert _tags(work) == uninterrupted
    assert not list((work / "tags").glob("*.chunks"))  # removed once the step is done


def test_partial_temp_file_is_ignored_and_replaced(corpus, uninterrupted, tmp_path):
    work = tmp_path / "partial"
    subprocess.run(_pipeline(corpus, work), check=True, capture_output=True)
    # Re-create the state of a run killed while writing chunk 1: remove the merged
    # output and the step marker, keep chunk 0 finished, leave a half-written chunk 1.
    job = tagging.TagJob(str(work / "clean" / "train.en"), str(work / "tags" / "train"), CHUNK)
    os.makedirs(job.chunk_dir)
    full = {
        k: uninterrupted[f"train.{k}"].decode().splitlines(keepends=True) for k in ("pos", "ner")
    }
    for kind, path in zip(("pos", "ner"), job.chunk_paths(0)):
        with open(path, "w", encoding="utf-8") as out:
            out.writelines(full[kind][:CHUNK])
    with open(job.chunk_paths(1)[0] + ".tmp", "w", encoding="utf-8") as out:
        out.write("NOUN NOUN\nVER")
    import json

    with open(os.path.join(job.chunk_dir, "config.json"), "w") as out:
        json.dump(
            {
                "model": tagging.default_model_name(),
                "pos_scheme": "upos",
                "chunk_size": CHUNK,
                "lines": job.n_lines,
                "input_size": os.path.getsize(job.input_path),
            },
            out,
        )
    for name in ("train.pos", "train.ner"):
        os.remove(work / "tags" / name)
    os.remove(work / ".steps" / "tag.json")
    result = subprocess.run(_pipeline(corpus, work), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    total = sum(-(-n // CHUNK) for n in (LINES, 30, 30))
    assert f"tagging: 1 of {total} chunks already done, resuming" in result.stderr
    assert _tags(work) == uninterrupted
    assert not os.path.exists(job.chunk_dir)  # merged and cleaned up


def test_shards_cover_everything_once(corpus, uninterrupted, tmp_path):
    work = tmp_path / "sharded"
    base = _pipeline(corpus, work)
    subprocess.run(
        base[:-3] + ["--stop-after", "preclean", "--quiet"], check=True, capture_output=True
    )
    for shard in ("1/3", "0/3"):
        subprocess.run(base + ["--tag-shard", shard], check=True, capture_output=True)
    # not all shards are done: merging refuses and names what is missing
    job = tagging.TagJob(str(work / "clean" / "valid.en"), str(work / "tags" / "valid"), CHUNK)
    with pytest.raises(DataError, match="not done yet"):
        tagging.merge_tags(job)
    subprocess.run(base + ["--tag-shard", "2/3"], check=True, capture_output=True)
    # the final run only merges: every chunk was tagged by exactly one shard
    result = subprocess.run(base, check=True, capture_output=True, text=True)
    total = sum(-(-n // CHUNK) for n in (LINES, 30, 30))
    assert f"{total} of {total} chunks already done" in result.stderr
    assert _tags(work) == uninterrupted


def _with_other_shard_mid_write(monkeypatch, chunk_dir, other_config):
    """Make another shard prepare ``chunk_dir`` while this one is writing its record;
    the list returned records that it did."""
    dump = json.dump
    other = types.SimpleNamespace(chunk_dir=str(chunk_dir))
    raced = []

    def dump_after_the_other_shard(*args, **kwargs):
        monkeypatch.setattr(json, "dump", dump)  # once: the other shard writes normally
        tagging._prepare_chunk_dir(other, other_config, force=False)
        raced.append(other_config)
        return dump(*args, **kwargs)

    monkeypatch.setattr(json, "dump", dump_after_the_other_shard)
    return raced


def test_shards_preparing_one_folder_at_once_both_go_on(tmp_path, monkeypatch):
    """Array tasks start together: two shards writing the chunk folder's record at the same
    moment must not take each other's temporary file away (a shard used to die here)."""
    config = {"model": "m", "chunk_size": 4}
    raced = _with_other_shard_mid_write(monkeypatch, tmp_path / "chunks", config)
    tagging._prepare_chunk_dir(
        types.SimpleNamespace(chunk_dir=str(tmp_path / "chunks")), config, force=False
    )
    assert raced == [config], "the other shard wrote its record meanwhile"
    assert json.loads((tmp_path / "chunks" / "config.json").read_text()) == config
    assert os.listdir(tmp_path / "chunks") == ["config.json"]  # no temporary file left


def test_a_shard_losing_the_race_with_other_settings_is_refused(tmp_path, monkeypatch):
    raced = _with_other_shard_mid_write(monkeypatch, tmp_path / "chunks", {"model": "other"})
    with pytest.raises(DataError, match="other settings") as error:
        tagging._prepare_chunk_dir(
            types.SimpleNamespace(chunk_dir=str(tmp_path / "chunks")), {"model": "m"}, force=False
        )
    assert raced == [{"model": "other"}]
    assert "config.json" in str(error.value)
    assert json.loads((tmp_path / "chunks" / "config.json").read_text()) == {"model": "other"}


def test_a_shard_with_other_settings_is_told_what_differs_and_what_works(tmp_path):
    """A shard of an array job run with another --tag-chunk-size than the shard before
    it: the error names the option and both values, and does not advise --force, which
    --tag-shard refuses."""
    text = tmp_path / "train.en"
    text.write_text("".join(f"line {i}\n" for i in range(50)))
    config = {"model": "m", "pos_scheme": "upos", "lines": 50, "input_size": text.stat().st_size}
    first = tagging.TagJob(str(text), str(tmp_path / "train"), 25)
    tagging._prepare_chunk_dir(first, {**config, "chunk_size": 25}, force=False, sharded=True)
    other = tagging.TagJob(str(text), str(tmp_path / "train"), 20)
    with pytest.raises(DataError) as refused:
        tagging._prepare_chunk_dir(other, {**config, "chunk_size": 20}, force=False, sharded=True)
    said = str(refused.value)
    assert "(--tag-chunk-size was 25, now 20): give every shard the settings" in said, said
    assert "pass --force" not in said
    with pytest.raises(DataError, match=r"was 25, now 20\): pass --force to start over"):
        tagging._prepare_chunk_dir(other, {**config, "chunk_size": 20}, force=False)
