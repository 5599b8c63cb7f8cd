"""Run records read from elsewhere (archives, folders, a run folder of a stopped study):
anything but a whole record is an error naming it, and merging never replaces what a
study folder holds. The records are the GPU study's own, as committed in records/gpu."""

import gzip
import hashlib
import json
import shutil
import tarfile
from types import SimpleNamespace

import pytest

from support import REPO, run
from tpp_tools.evaluate import read_lines
from tpp_tools.study.commands import RunLock, count_lines
from tpp_tools.study.config import StudyError
from tpp_tools.study.records import (
    RECORD,
    check_pack,
    finished,
    import_records,
    load_record,
    pack_records,
    packed_runs,
    parse_record,
    read_record,
)

COMMITTED = sorted((REPO / "records" / "gpu").glob(f"*/{RECORD}"))


def gzipped(record: dict) -> bytes:
    return gzip.compress(json.dumps(record).encode(), mtime=0)


def test_every_committed_record_reads_whole():
    assert len(COMMITTED) >= 4
    for path in COMMITTED:
        record = read_record(path)
        assert record["folder"] == path.parent.name
        assert len(record["statistics"]["BLEU"]) == record["reference"]["lines"] == 2000


def broken(record, dotted, value):
    record = json.loads(json.dumps(record))
    *parents, last = dotted.split(".")
    held = record
    for part in parents:
        held = held[part]
    if value is KeyError:
        del held[last]
    elif isinstance(value, type(lambda: 0)):
        held[last] = value(held[last])
    else:
        held[last] = value
    return record


@pytest.mark.parametrize(
    "dotted, value, problem",
    [
        ("run", KeyError, "run is missing"),
        ("run", ["hybrid"], "run is list"),
        ("spec", None, "spec is missing"),
        ("reference", "x", "reference is str"),
        ("translations_sha256", KeyError, "translations_sha256 is missing"),
        ("scores", {}, "scores.sacrebleu_detok is missing"),
        ("scores.sacrebleu_detok", "high", "scores.sacrebleu_detok is not a number"),
        ("train.wps", ["fast"], "train.wps holds something other than numbers"),
        ("valid", [{"updates": 1}], "valid holds points without their updates"),
        ("statistics.BLEU", [[1, 2, 3]], "statistics.BLEU is not 2000 rows"),
        ("code", KeyError, "code is missing"),
        ("code.commit", 7, "code.commit is not a commit"),
        ("spec.config", "cpu", "spec.config is not a table of settings"),
        ("scores.sacrebleu_detok", "nan", "scores.sacrebleu_detok is not a BLEU score"),
        ("scores.bleu_tok_compound_split", "-3", "bleu_tok_compound_split is not a BLEU score"),
        ("train.wps", [float("inf")], "train.wps holds something other than numbers"),
        ("statistics.BLEU", [[-1] * 10] * 2000, "statistics.BLEU is not 2000 rows"),
        ("train_command", ["fairseq-train", None], "train_command holds something other"),
        ("device", "CPU\n# A heading of its own", "device holds a line break or another character"),
        (
            "run",
            "transformer-s1\n[study 00:00:00] forged",
            "run holds a line break or another character",
        ),
        ("parameters", -5, "parameters is not a count of parameters"),
        ("train.seconds", -1e9, "train.seconds is not a number of seconds"),
        ("train.wps", [True], "train.wps holds something other than numbers"),
        ("valid", lambda v: [{**v[0], "nll_loss": float("nan")}], "valid holds points without"),
        ("valid", lambda v: v[::-1], "valid's points are not in order of updates"),
        ("scores.sacrebleu_detok", "42.00", "sacrebleu_detok (42.00) is not the BLEU of its"),
        ("reference.lines", 0, "reference.lines is not a number of lines"),
    ],
)
def test_a_record_without_what_the_report_reads_is_refused_naming_it(dotted, value, problem):
    """(these passed the import and failed the report afterwards, and every report
    after it, with a KeyError or TypeError)"""
    record = read_record(COMMITTED[0])
    with pytest.raises(StudyError) as info:
        parse_record(gzipped(broken(record, dotted, value)), "somewhere/record.json.gz")
    message = str(info.value)
    assert message.startswith("somewhere/record.json.gz: not a whole run record: "), message
    assert problem in message, message


def test_damaged_records_and_archives_are_errors_naming_them(tmp_path):
    data = COMMITTED[0].read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    local = tmp_path / "run" / RECORD
    local.parent.mkdir()
    local.write_bytes(bytes(flipped))
    with pytest.raises(StudyError, match=f"^{local}: not a readable run record"):
        read_record(local)
    # an archive cut short, or damaged inside, from --records
    archive = tmp_path / "records.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in COMMITTED:
            tar.add(path, arcname=f"runs/{path.parent.name}/{RECORD}")
    whole = archive.read_bytes()
    planned = [SimpleNamespace(name="none", folder=tmp_path / "none", spec={})]
    reference = tmp_path / "ref"
    reference.write_text("a\n")
    for name, damaged in (("cut", whole[: len(whole) // 2]), ("flipped", flip(whole))):
        (tmp_path / name).write_bytes(damaged)
        with pytest.raises(StudyError, match=f"--records {tmp_path / name}: "):
            import_records([tmp_path / name], planned, reference)
    # a folder of records with a folder of the record's name in it is passed over
    odd = tmp_path / "folder" / "runs" / "x" / RECORD
    odd.mkdir(parents=True)
    assert import_records([tmp_path / "folder"], planned, reference) == []


def flip(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0xFF
    return bytes(out)


def a_record_of_this_study(tmp_path, translations: bytes):
    """A committed record made this study's: its test reference a file here, its
    translations ``translations``; with the run it is of."""
    record = read_record(COMMITTED[0])
    reference = tmp_path / "test.de"
    reference.write_text("".join(f"Satz {i}.\n" for i in range(2000)), encoding="utf-8")
    record["reference"]["sha256"] = hashlib.sha256(reference.read_bytes()).hexdigest()
    record["translations_sha256"] = hashlib.sha256(translations).hexdigest()
    study_run = SimpleNamespace(
        name=record["run"],
        folder=tmp_path / "study" / "runs" / record["folder"],
        spec=record["spec"],
    )
    source = tmp_path / "elsewhere" / record["folder"]
    (source / "eval").mkdir(parents=True)
    (source / RECORD).write_bytes(gzipped(record))
    (source / "eval" / "hyp.detok").write_bytes(translations)
    return study_run, reference


def test_merging_never_replaces_translations_the_run_made_here(tmp_path):
    """A run translated here but stopped before its record was written: a record of the
    same run from elsewhere, with other translations, is refused (it replaced them)."""
    theirs = b"".join(b"Sentence %d.\n" % i for i in range(2000))
    study_run, reference = a_record_of_this_study(tmp_path, theirs)
    ours = study_run.folder / "eval" / "hyp.detok"
    ours.parent.mkdir(parents=True)
    ours.write_bytes(b"Ours.\n" * 2000)
    with pytest.raises(StudyError, match="holds other translations of .* than the record's"):
        import_records([tmp_path / "elsewhere"], [study_run], reference)
    # the record alone, without its translations: compared with the record's checksum
    numbers = tmp_path / "numbers" / study_run.folder.name
    numbers.mkdir(parents=True)
    (numbers / RECORD).write_bytes(next((tmp_path / "elsewhere").glob(f"*/{RECORD}")).read_bytes())
    with pytest.raises(StudyError, match="holds other translations of .* than the record's"):
        import_records([numbers.parent], [study_run], reference)
    assert ours.read_bytes() == b"Ours.\n" * 2000 and not (study_run.folder / RECORD).exists()
    ours.write_bytes(theirs)  # the same translations: the record is taken
    assert import_records([tmp_path / "elsewhere"], [study_run], reference) == [study_run.name]
    assert (study_run.folder / RECORD).is_file()


def test_a_record_is_not_copied_into_a_run_folder_being_written(tmp_path):
    """(a SLURM study's report job merged its --records without any lock, beside a run
    being trained in that folder)"""
    study_run, reference = a_record_of_this_study(tmp_path, b"Sentence.\n" * 2000)
    study_run.folder.mkdir(parents=True)
    held = RunLock(study_run.folder, study_run.name)
    try:
        with pytest.raises(StudyError, match="another process is writing in its folder"):
            import_records([tmp_path / "elsewhere"], [study_run], reference)
        assert not (study_run.folder / RECORD).exists()
    finally:
        held.close()
    assert import_records([tmp_path / "elsewhere"], [study_run], reference) == [study_run.name]


def test_an_archive_holding_one_record_twice_differently_is_refused(tmp_path):
    """(a record appended to an archive, or stored as runs/x and ./runs/x: the last one
    was taken, silently)"""
    translations = b"Sentence.\n" * 2000
    study_run, reference = a_record_of_this_study(tmp_path, translations)
    source = tmp_path / "elsewhere" / study_run.folder.name
    record = read_record(source / RECORD)
    other = gzipped(broken(record, "scores.sacrebleu_detok", "99.0"))
    archive = tmp_path / "twice.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source / RECORD, arcname=f"runs/{source.name}/{RECORD}")
        (tmp_path / "other").write_bytes(other)
        tar.add(tmp_path / "other", arcname=f"./runs/{source.name}/{RECORD}")
    with pytest.raises(StudyError, match="the archive holds different files of that name"):
        import_records([archive], [study_run], reference)
    assert not study_run.folder.exists()
    # the same file twice (as appending one again makes it) is one record
    with tarfile.open(archive, "w:gz") as tar:
        for _ in range(2):
            tar.add(source / RECORD, arcname=f"runs/{source.name}/{RECORD}")
    assert import_records([archive], [study_run], reference) == [study_run.name]


def test_a_record_larger_than_a_record_can_be_is_refused_unread(tmp_path, monkeypatch):
    """(a 1 KB archive unpacked to a 400 MB record was read whole into memory)"""
    from tpp_tools.study import records

    translations = b"A sentence translated at length" * 10 + b".\n"
    study_run, reference = a_record_of_this_study(tmp_path, translations * 2000)
    source = tmp_path / "elsewhere" / study_run.folder.name
    archive = tmp_path / "records.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname=f"runs/{source.name}")
    data = (source / RECORD).read_bytes()
    size = len(gzip.decompress(data))
    monkeypatch.setattr(records, "LARGEST", size - 1)
    with pytest.raises(StudyError, match="^here: not a run record \\(over 0 MiB unpacked"):
        parse_record(data, "here")
    monkeypatch.setattr(records, "LARGEST", size)  # (the translations: 600 KiB)
    with pytest.raises(StudyError, match="hyp.detok: over 0 MiB, not a run's record"):
        import_records([archive], [study_run], reference)
    assert not study_run.folder.exists()


def test_a_record_given_twice_keeps_its_translations_in_either_order(tmp_path):
    translations = b"Sentence.\n" * 2000
    study_run, reference = a_record_of_this_study(tmp_path, translations)
    numbers = tmp_path / "numbers" / study_run.folder.name
    numbers.mkdir(parents=True)
    (numbers / RECORD).write_bytes((tmp_path / "elsewhere" / numbers.name / RECORD).read_bytes())
    for order in (
        [tmp_path / "elsewhere", numbers.parent],
        [numbers.parent, tmp_path / "elsewhere"],
    ):
        shutil.rmtree(tmp_path / "study", ignore_errors=True)
        import_records(order, [study_run], reference)
        assert (study_run.folder / "eval" / "hyp.detok").read_bytes() == translations


def test_pack_where_nothing_can_be_written_is_refused_before_packing(tmp_path):
    """(found only after the runs had trained, as a traceback, and no report was written)"""
    study_run = SimpleNamespace(name="r", folder=tmp_path / "study" / "runs" / "r", spec={})
    study_run.folder.mkdir(parents=True)
    (study_run.folder / RECORD).write_bytes(COMMITTED[0].read_bytes())
    (tmp_path / "file").write_text("x")
    for archive in (tmp_path / "file" / "x.tar.gz", tmp_path / "file" / "sub" / "x.tar.gz"):
        with pytest.raises(StudyError, match="cannot be written .* is not a writable folder"):
            check_pack(archive, [study_run], tmp_path / "study", force=True)
    # an archive there already, cut short (copied back in part): an error, not a traceback
    whole = tmp_path / "whole.tar.gz"
    pack_records([study_run], whole, tmp_path / "study")
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(StudyError, match="exists and is not a readable archive"):
        check_pack(cut, [study_run], tmp_path / "study", force=False)
    pack_records([study_run], cut, tmp_path / "study", force=True)
    assert packed_runs(cut) == packed_runs(whole) == ["runs/r"]


def test_pack_is_refused_up_front_by_the_rule_that_packing_applies(tmp_path):
    """An archive holding the records of runs this study neither finished nor runs now
    is refused before anything runs (it was accepted then, and refused after the runs)."""
    from tpp_tools.study.plan import check_pack_now

    study_run, reference = a_record_of_this_study(tmp_path, b"Sentence.\n" * 2000)
    import_records([tmp_path / "elsewhere"], [study_run], reference)
    out = tmp_path / "study"
    other = SimpleNamespace(name="hybrid-s2", folder=out / "runs" / "hybrid-s2-0abc", spec={})
    archive = tmp_path / "records.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for planned in (study_run, other):
            tar.add(COMMITTED[0], arcname=f"runs/{planned.folder.name}/{RECORD}")
    args = SimpleNamespace(pack=archive, out=out, force=False)
    with pytest.raises(StudyError, match="would not pack again \\(runs/hybrid-s2-0abc\\)"):
        check_pack_now(args, [study_run, other], [], reference)
    check_pack_now(args, [study_run, other], [other], reference)  # (to be run: packed)


def test_pack_into_a_folder_is_refused_and_leaves_nothing(tmp_path):
    study_run = SimpleNamespace(name="r", folder=tmp_path / "study" / "runs" / "r", spec={})
    study_run.folder.mkdir(parents=True)
    (study_run.folder / RECORD).write_bytes(COMMITTED[0].read_bytes())
    (tmp_path / "packdir").mkdir()
    for force in (False, True):
        with pytest.raises(StudyError, match="packdir: is a folder"):
            pack_records([study_run], tmp_path / "packdir", tmp_path / "study", force=force)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packdir", "study"]


def test_records_are_not_merged_into_a_folder_a_study_is_running_in(tmp_path):
    from tpp_pipeline.lock import work_dir_lock

    out = tmp_path / "study"
    command = [
        "tpp-study", "--config", "cpu", "--data", tmp_path / "nowhere", "--test-reference",
        tmp_path / "ref", "--out", out, "--report-only", "--records", tmp_path / "records",
    ]  # fmt: skip
    with work_dir_lock(out, user="tpp-study", folder="study folder"):
        refused = run(command, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "another tpp-study is using this study folder" in refused.stderr, refused.stderr


def test_lines_are_ended_by_newlines_only_as_carved_and_scored(tmp_path):
    """A line with U+2028, a form feed or a lone carriage return inside is one line, as
    the carving wrote it and tpp-evaluate scores it (the study counted it as two and
    refused its own test reference); a byte order mark is not text."""
    text = tmp_path / "test.de"
    text.write_bytes("\ufeffeins\nzwei\u2028drei\nvier\x0cf\u00fcnf\rsechs\nsieben".encode())
    assert count_lines(text) == 4
    assert read_lines(text) == ["eins", "zwei\u2028drei", "vier\x0cf\u00fcnf\rsechs", "sieben"]


def committed_archive(tmp_path, mode: str = "w"):
    """The committed records as an archive (uncompressed by default) made as --pack makes it."""
    archive = tmp_path / ("records.tar" if mode == "w" else "records.tar.gz")
    with tarfile.open(archive, mode) as tar:
        for path in COMMITTED:
            tar.add(path, arcname=f"runs/{path.parent.name}/{RECORD}")
    return archive


def test_an_archive_cut_short_between_two_files_is_refused(tmp_path):
    """(a tar cut at a file boundary read as a smaller archive: its last runs were
    reported as not finished, silently)"""
    whole = committed_archive(tmp_path)
    with tarfile.open(whole) as tar:
        boundary = tar.getmembers()[-1].offset
    planned = [SimpleNamespace(name="none", folder=tmp_path / "none", spec={})]
    reference = tmp_path / "ref"
    reference.write_text("a\n")
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole.read_bytes()[:boundary])
    compressed = tmp_path / "cut.tar.gz"
    compressed.write_bytes(gzip.compress(cut.read_bytes()))  # (whole as gzip, cut as tar)
    for damaged in (cut, compressed):
        with pytest.raises(StudyError, match=f"--records {damaged}: .*end-of-archive block"):
            import_records([damaged], planned, reference)
    assert import_records([whole], planned, reference) == []  # (none of them planned)
    joined = tmp_path / "joined.tar"  # (two archives joined by cat: the second went unread)
    joined.write_bytes(whole.read_bytes() * 2)
    with pytest.raises(StudyError, match="holds more after its end-of-archive block"):
        import_records([joined], planned, reference)


def test_an_empty_file_or_other_files_are_refused_in_one_line(tmp_path):
    planned = [SimpleNamespace(name="none", folder=tmp_path / "none", spec={})]
    reference = tmp_path / "ref"
    reference.write_text("a\n")
    (tmp_path / "empty.tar.gz").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("records are elsewhere\n")
    for name, problem in (
        ("empty.tar.gz", "is empty, not an archive of run records"),
        ("notes.txt", "not readable as a tar archive, nor as one compressed by gzip, bzip2 or xz"),
    ):
        with pytest.raises(StudyError) as info:
            import_records([tmp_path / name], planned, reference)
        assert str(info.value) == f"--records {tmp_path / name}: " + (
            problem
            if name == "empty.tar.gz"
            else f"not a folder or a whole tar archive ({problem})"
        )


def test_one_runs_record_file_is_taken_with_its_translations(tmp_path):
    translations = b"Sentence.\n" * 2000
    study_run, reference = a_record_of_this_study(tmp_path, translations)
    record = tmp_path / "elsewhere" / study_run.folder.name / RECORD
    assert import_records([record], [study_run], reference) == [study_run.name]
    assert (study_run.folder / "eval" / "hyp.detok").read_bytes() == translations


def test_the_same_record_compressed_anew_is_the_same_record(tmp_path):
    """(records were compared byte for byte: one gzipped again was "another record of
    the run", and refused)"""
    study_run, reference = a_record_of_this_study(tmp_path, b"Sentence.\n" * 2000)
    source = tmp_path / "elsewhere" / study_run.folder.name / RECORD
    again = tmp_path / "again" / study_run.folder.name / RECORD
    again.parent.mkdir(parents=True)
    again.write_bytes(gzip.compress(gzip.decompress(source.read_bytes()), compresslevel=1))
    assert again.read_bytes() != source.read_bytes()
    assert import_records([source, again], [study_run], reference) == [study_run.name]
    assert import_records([again], [study_run], reference) == []  # (it holds it already)


def test_archives_in_a_folder_of_records_are_named_as_not_opened(tmp_path, capsys):
    """(a folder holding records and archives: the archives' runs went unmentioned)"""
    study_run, reference = a_record_of_this_study(tmp_path, b"Sentence.\n" * 2000)
    archive = committed_archive(tmp_path / "elsewhere", mode="w:gz")
    assert import_records([tmp_path / "elsewhere"], [study_run], reference) == [study_run.name]
    out = capsys.readouterr().out
    assert "the archives in it are not opened (name them to read them): " + str(archive) in out


def test_a_report_that_cannot_be_written_is_an_error_leaving_no_temporary_file(tmp_path):
    from tpp_tools.study.records import write_atomic

    (tmp_path / "report.md").mkdir()
    with pytest.raises(StudyError, match="report.md: cannot be written"):
        write_atomic(tmp_path / "report.md", b"# A report\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_the_report_names_each_runs_code_and_switches_where_they_differ():
    from tpp_tools.study.report import _code, _per_run, _switches

    runs = [SimpleNamespace(name=n) for n in ("transformer-s1", "hybrid-s1", "hybrid-s2")]
    code = {
        "transformer-s1": {"tpp": "0.2.0", "commit": "7a38847" + "+"},
        "hybrid-s1": {"tpp": "0.2.0", "commit": None},
        "hybrid-s2": {"tpp": "0.2.0", "commit": None},
    }
    assert _per_run(runs, lambda r: _code({"code": code[r.name]})) == (
        "7a38847 with changes not committed (transformer-s1); version 0.2.0 (hybrid-s1, hybrid-s2)"
    )
    assert _per_run(runs, lambda r: "same") == "same"
    switches = {
        "transformer-s1": {"environment": {"TPP_FAIRSEQ_SPEEDUPS": "fused"}},
        "hybrid-s1": {"environment": {}},
        "hybrid-s2": {},  # (a record written before records named them)
    }
    assert _per_run(runs, lambda r: _switches(switches[r.name])) == (
        "TPP_FAIRSEQ_SPEEDUPS=fused (transformer-s1); none (hybrid-s1); not recorded (hybrid-s2)"
    )


def test_a_run_scored_against_another_reference_is_refused_not_trained_again(tmp_path):
    """A recorded run (here merged from elsewhere: no checkpoints beside its record) and a
    study given another --test-reference (test.en for test.de): the study stops naming
    the record and both references; it went on to train the run again from scratch, and
    to replace its record. With the right reference the run is finished."""
    translations = b"".join(b"Sentence %d.\n" % i for i in range(2000))
    study_run, reference = a_record_of_this_study(tmp_path, translations)
    import_records([tmp_path / "elsewhere"], [study_run], reference)
    record = (study_run.folder / RECORD).read_bytes()
    assert finished(study_run, reference) and load_record(study_run, reference) is not None
    wrong = tmp_path / "test.en"
    wrong.write_text("".join(f"Sentence {i}.\n" for i in range(2000)), encoding="utf-8")
    for check in (load_record, finished):
        with pytest.raises(StudyError) as err:
            check(study_run, wrong)
        message = str(err.value)
        assert message.startswith(f"{study_run.folder / RECORD}: {study_run.name} was scored")
        assert f"than {wrong} (" in message and "move its folder aside" in message
    assert (study_run.folder / RECORD).read_bytes() == record
