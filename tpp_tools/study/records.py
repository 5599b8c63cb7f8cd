"""A finished run's result record: what the report needs of it, without checkpoints.

A run is finished when its folder holds ``record.json.gz``, written after its test set
was translated and scored. The record holds numbers only — the run's identity and
command, the code version, the device, the parameter count, the scores, the validation
curve, and sacreBLEU's per-sentence statistics of BLEU and chrF (what the paired
bootstrap resamples) — so it can be kept and shared where translations cannot; the
translations stay beside it (``eval/hyp.detok``) and travel in archives.

A study on another machine merges records (``--records FOLDER|ARCHIVE|RECORD ...``): each is
copied into the run folder of the same identity, after checking that it was made with
the very settings, data and test reference of this study. Runs with a record are not
trained again, so records from several short allocations accumulate into one study.
"""

import functools
import gzip
import hashlib
import io
import json
import math
import os
import subprocess
import tarfile
import time
import zlib
from pathlib import Path
from typing import Dict, List, Optional

from tpp_pipeline import checkout

from .commands import RunBusy, RunLock, count_lines, json_records, log
from .config import StudyError

RECORD = "record.json.gz"
#: the record's layout; a reader refuses other formats rather than misread them
FORMAT = 1
#: what an archive holds of a finished run (no checkpoints)
PACKED = (RECORD, "eval/hyp.detok")
# the most a record or a run's translations may take unpacked (a record is a few MiB)
LARGEST = 256 * 2**20


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def code_version() -> Dict[str, Optional[str]]:
    """The project's version and git commit: ``$TPP_COMMIT`` where it is set (a copy of
    the code whose history is elsewhere), else the checkout's HEAD, ``+`` marking
    uncommitted changes."""
    from tpp_plugin import __version__ as tpp

    commit = os.environ.get("TPP_COMMIT") or None
    root = checkout()  # (an installed wheel has no history to read)
    if commit is None and root is not None:
        try:
            head = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
            )
            if head.returncode == 0:
                dirty = subprocess.run(
                    ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                    capture_output=True,
                    text=True,
                )
                commit = head.stdout.strip() + ("+" if dirty.stdout.strip() else "")
        except OSError:
            pass
    return {"tpp": tpp, "commit": commit}


def sentence_statistics(hyps: List[str], refs: List[str]) -> Dict[str, list]:
    """sacreBLEU's per-sentence sufficient statistics of BLEU and chrF (default
    settings), which its paired bootstrap sums over resampled sentences."""
    from sacrebleu.metrics import BLEU, CHRF

    return {
        "BLEU": [[int(x) for x in s] for s in BLEU()._extract_corpus_statistics(hyps, [refs])],
        "chrF": [[int(x) for x in s] for s in CHRF()._extract_corpus_statistics(hyps, [refs])],
    }


def validation_curve(records: List[dict]) -> List[dict]:
    """Updates, loss and NLL (bits per target token) of each validation in fairseq's
    JSON log records, in order of updates."""
    curve = {}
    for r in records:
        if "valid_loss" in r and "valid_num_updates" in r:
            curve[int(r["valid_num_updates"])] = {
                "updates": int(r["valid_num_updates"]),
                "loss": float(r["valid_loss"]),
                "nll_loss": float(r["valid_nll_loss"]),
            }
    return [curve[u] for u in sorted(curve)]


def read_scores(path: Path) -> dict:
    scores = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(": ")
        scores[key] = value
    return scores


def parameter_count(run) -> int:
    """The averaged model's parameters, without the tag heads (which translation does not use)."""
    import torch

    from tpp_fairseq import allow_fairseq_checkpoints

    allow_fairseq_checkpoints()

    state = torch.load(run.folder / "checkpoint_avg.pt", map_location="cpu", weights_only=True)
    return sum(
        t.numel()
        for k, t in state["model"].items()
        if hasattr(t, "numel")
        and "tag_heads" not in k
        and "_float_tensor" not in k
        and "version" not in k
    )


def training_environment() -> Dict[str, str]:
    """The plugin's switches of fairseq's loop (``TPP_FAIRSEQ_*``) that runs started from
    here train under: recorded, not part of a run's identity."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TPP_FAIRSEQ_")}


def write_record(
    run, reference: Path, device: str, environment: Optional[Dict[str, str]] = None
) -> dict:
    """The record of ``run``, evaluated in its folder (``eval/``, ``train.log``,
    ``checkpoint_avg.pt``), written atomically; ``environment`` the run trained under
    (by default this process's)."""
    import sacrebleu

    from tpp_tools.evaluate import read_lines

    hyp_path = run.folder / "eval" / "hyp.detok"
    hyps, refs = read_lines(hyp_path), read_lines(reference)  # as tpp-evaluate scored them
    records = json_records(run.folder / "train.log")
    done = run.folder / "train.done"
    done = done.read_text().split() if done.exists() else []
    record = {
        "format": FORMAT,
        "run": run.name,
        "folder": run.folder.name,
        "spec": run.spec,
        "train_command": _portable(run.train_cmd),
        "code": code_version(),
        "environment": training_environment() if environment is None else environment,
        "device": device,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "parameters": parameter_count(run),
        "reference": {"sha256": file_sha256(reference), "lines": len(refs)},
        "translations_sha256": file_sha256(hyp_path),
        "scores": read_scores(run.folder / "eval" / "bleu.txt"),
        "sacrebleu": sacrebleu.__version__,
        "train": {
            "seconds": float(done[2]) if len(done) > 2 else None,
            "wps": [float(r["wps"]) for r in records if "wps" in r and "train_wps" not in r],
        },
        "valid": validation_curve(records),
        "statistics": sentence_statistics(hyps, refs),
    }
    target = run.folder / RECORD
    tmp = target.with_name(f".{RECORD}.{os.getpid()}.tmp")
    # mtime 0 in the gzip header: the same record is the same bytes
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
        handle.write(json.dumps(record, sort_keys=True).encode())
    os.replace(tmp, target)
    return record


def _portable(cmd: List[str]) -> List[str]:
    """The command with paths inside the project's checkout made relative to it (the
    plugin's folder, say): the same on every machine."""
    root = str(Path(__file__).resolve().parents[2]) + os.sep
    return [c[len(root) :] if c.startswith(root) else c for c in cmd]


def read_record(path: Path) -> dict:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise StudyError(f"{path}: not a readable run record ({err.strerror})") from None
    return parse_record(data, path)


def parse_record(data: bytes, where) -> dict:
    """The record in ``data`` (gzipped JSON), refused with ``where`` named unless it has
    every field the study reads, of the type it reads."""
    try:
        with gzip.open(io.BytesIO(data), "rb") as handle:
            text = handle.read(LARGEST + 1)
        if len(text) > LARGEST:
            raise StudyError(f"{where}: not a run record (over {LARGEST >> 20} MiB unpacked)")
        record = json.loads(text)
    except (OSError, EOFError, ValueError, zlib.error) as err:
        raise StudyError(f"{where}: not a readable run record ({err})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else "?"
        raise StudyError(
            f"{where}: a run record of format {found}, this version reads format {FORMAT}"
        )
    problem = _malformed(record)
    if problem:
        raise StudyError(f"{where}: not a whole run record: {problem}")
    return record


def _malformed(record: dict) -> Optional[str]:
    """What is missing, of the wrong type or implausible in ``record`` (None where nothing is)."""
    fields = [
        ("run", str), ("folder", str), ("spec", dict), ("train_command", list),
        ("code", dict), ("code.tpp", str), ("device", str), ("parameters", int),
        ("translations_sha256", str),
        ("reference", dict), ("reference.sha256", str), ("reference.lines", int),
        ("scores", dict), ("scores.sacrebleu_detok", str),
        ("scores.bleu_tok_compound_split", str), ("train", dict), ("train.wps", list),
        ("valid", list), ("statistics", dict), ("statistics.BLEU", list),
        ("statistics.chrF", list),
    ]  # fmt: skip
    for dotted, kind in fields:
        value = _get(record, dotted)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{dotted} is {'missing' if value is None else type(value).__name__}"
    if not isinstance(record["spec"].get("config", {}), dict):
        return "spec.config is not a table of settings"
    if not isinstance(record["code"].get("commit"), (str, type(None))):
        return "code.commit is not a commit"
    if not all(isinstance(word, str) for word in record["train_command"]):
        return "train_command holds something other than words"
    for key in ("sacrebleu_detok", "bleu_tok_compound_split"):
        try:
            score = float(record["scores"][key])
        except ValueError:
            return f"scores.{key} is not a number"
        if not 0 <= score <= 100:  # (NaN too)
            return f"scores.{key} is not a BLEU score (0 to 100)"
    return _implausible(record)


def _implausible(record: dict) -> Optional[str]:
    """What in ``record``, whose fields are all of their types, cannot be what a run
    recorded (None where nothing is): the report would print it as if it were."""
    if record["parameters"] <= 0:
        return "parameters is not a count of parameters"
    if not all(_amount(x) for x in record["train"]["wps"]):
        return "train.wps holds something other than numbers"
    seconds = record["train"].get("seconds")  # (None or NaN: not known, the run found trained)
    unknown = seconds is None or (isinstance(seconds, float) and math.isnan(seconds))
    if not (unknown or _amount(seconds)):
        return "train.seconds is not a number of seconds"
    keys = ("updates", "loss", "nll_loss")
    if not all(
        isinstance(v, dict) and all(_amount(v.get(k), any_sign=k != "updates") for k in keys)
        for v in record["valid"]
    ):
        return "valid holds points without their updates, loss and nll_loss"
    updates = [v["updates"] for v in record["valid"]]
    if updates != sorted(set(updates)) or not all(isinstance(u, int) for u in updates):
        return "valid's points are not in order of updates, once each"
    for dotted in ("run", "folder", "device", "code.tpp", "code.commit", "sacrebleu"):
        value = _get(record, dotted)
        if isinstance(value, str) and not value.isprintable():
            return f"{dotted} holds a line break or another character not printed as text"
    lines = record["reference"]["lines"]
    if lines < 1:
        return "reference.lines is not a number of lines"
    for metric, width in _statistics_width().items():
        rows = record["statistics"][metric]
        if len(rows) != lines or not all(
            isinstance(row, list)
            and len(row) == width
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in row)
            for row in rows
        ):
            return (
                f"statistics.{metric} is not {lines} rows (the reference's lines) of "
                f"{width} counts (whole numbers, none negative)"
            )
    bleu = _bleu_of(record["statistics"]["BLEU"])
    if abs(float(record["scores"]["sacrebleu_detok"]) - bleu) > 0.0051:
        return (
            f"scores.sacrebleu_detok ({record['scores']['sacrebleu_detok']}) is not the BLEU of "
            f"its statistics ({bleu:.2f})"
        )
    return None


def _amount(x, any_sign=False) -> bool:
    """A finite number (not a bool), not negative unless ``any_sign``."""
    return (
        isinstance(x, (int, float))
        and not isinstance(x, bool)
        and math.isfinite(x)
        and (any_sign or x >= 0)
    )


def _bleu_of(statistics: List[list]) -> float:
    """Corpus BLEU (sacreBLEU's default settings) of per-sentence statistics."""
    from sacrebleu.metrics import BLEU

    return BLEU()._aggregate_and_compute(statistics).score


@functools.lru_cache(maxsize=1)
def _statistics_width() -> Dict[str, int]:
    """The length of sacreBLEU's per-sentence statistics of BLEU and chrF."""
    return {metric: len(rows[0]) for metric, rows in sentence_statistics(["a"], ["a"]).items()}


def load_record(run, reference: Path) -> Optional[dict]:
    """``run``'s record if it has one, else None; one scored against another test
    reference is refused (its run folder may hold nothing else to score). A run scored
    but without its record (a study stopped in between, or evaluated before records
    existed) gets its record now, with the device its ``run.json`` names."""
    path = run.folder / RECORD
    if not path.exists():
        if not evaluated(run, reference):
            return None
        try:
            trained = json.loads((run.folder / "run.json").read_text())
            device, environment = trained["device_name"], trained["environment"]
        except (OSError, ValueError, KeyError, TypeError):
            device, environment = "not recorded (evaluated before run records)", None
        return write_record(run, reference, device, environment)
    record = read_record(path)
    ours = file_sha256(reference)
    if record["reference"]["sha256"] != ours:  # (a wrong --test-reference: never trained again)
        raise StudyError(
            f"{path}: {run.name} was scored against another test reference (sha256 "
            f"{record['reference']['sha256'][:12]}…) than {reference} ({ours[:12]}…): give the "
            "reference it was scored against, or move its folder aside to train and score it again"
        )
    return record


def evaluated(run, reference: Path) -> bool:
    """Averaged, and its translations of the whole test set scored."""
    hyp = run.folder / "eval" / "hyp.detok"
    return (
        (run.folder / "eval" / "bleu.txt").exists()
        and hyp.exists()
        and (run.folder / "checkpoint_avg.pt").exists()
        and count_lines(hyp) == count_lines(reference)
    )


def finished(run, reference: Path) -> bool:
    """Trained, translated and scored: the run has its record (or can have it, which
    this does not write)."""
    if not (run.folder / RECORD).exists():
        return evaluated(run, reference)
    return load_record(run, reference) is not None


def spec_differences(record: dict, run) -> str:
    """What differs between the settings and data of ``record`` and of ``run`` (empty
    where the record is of this very run)."""
    theirs, ours = record["spec"], run.spec
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if "config" in differ:
        fields = set(theirs.get("config", {})) | set(ours.get("config", {}))
        differ = [d for d in differ if d != "config"] + sorted(
            f"config.{f}"
            for f in fields
            if theirs.get("config", {}).get(f) != ours.get("config", {}).get(f)
        )
    return ", ".join(
        f"{d} (record {_get(theirs, d)!r}, this study {_get(ours, d)!r})" for d in differ
    )


def check_record(record: dict, where: str, reference_sha256: str, hyp: Optional[bytes]) -> None:
    """Refuse a record of this study's run scored against another test set, or whose
    translations are not the ones it scored."""
    if hyp is not None and hashlib.sha256(hyp).hexdigest() != record["translations_sha256"]:
        raise StudyError(
            f"{where}: the translations beside the record of {record['run']} are not the ones it "
            "scored (their sha256 differs from the record's)"
        )
    if record["reference"]["sha256"] != reference_sha256:
        raise StudyError(
            f"{where}: the record of {record['run']} was scored against another test reference "
            f"(sha256 {record['reference']['sha256'][:12]}…, this study's "
            f"{reference_sha256[:12]}…)"
        )


def _get(spec: dict, dotted: str):
    for part in dotted.split("."):
        spec = spec.get(part) if isinstance(spec, dict) else None
    return spec


def _found(source: Path):
    """(where, record bytes, translations bytes or None) of every record in a folder
    (searched recursively) or a tar archive, or of one record file."""
    if source.is_dir():
        for path in sorted(p for p in source.rglob(RECORD) if p.is_file()):
            yield from _found_beside(path)
        return
    if not source.is_file():
        raise StudyError(f"--records {source}: no such file or folder")
    if source.name == RECORD:  # (one run's record, its translations beside it)
        yield from _found_beside(source)
        return
    if source.stat().st_size == 0:
        raise StudyError(f"--records {source}: is empty, not an archive of run records")
    try:
        with tarfile.open(source) as tar:
            # (by normalised path: an archive made of "./runs/..." names them so)
            members = {}
            for member in tar.getmembers():
                if member.isfile():
                    members.setdefault(os.path.normpath(member.name), []).append(member)
            _check_whole(tar, source)
            for name in sorted(n for n in members if Path(n).name == RECORD):
                hyp = str(Path(name).parent / "eval" / "hyp.detok")
                yield (
                    f"{source}:{name}",
                    _member(tar, members[name], f"{source}:{name}"),
                    _member(tar, members[hyp], f"{source}:{hyp}") if hyp in members else None,
                )
    except (tarfile.TarError, EOFError, zlib.error) as err:
        if str(err).startswith("file could not be opened"):  # (every format was tried)
            err = "not readable as a tar archive, nor as one compressed by gzip, bzip2 or xz"
        raise StudyError(
            f"--records {source}: not a folder or a whole tar archive ({err})"
        ) from None
    except OSError as err:  # (gzip's damaged-data errors among them)
        raise StudyError(f"--records {source}: cannot be read ({err})") from None


def _found_beside(path: Path):
    """(where, bytes, translations' bytes or None) of the record file ``path``."""
    hyp = path.parent / "eval" / "hyp.detok"
    for name in (path, hyp):
        if name.is_file():
            _not_too_large(name.stat().st_size, name)
    yield path, path.read_bytes(), hyp.read_bytes() if hyp.is_file() else None


def _check_whole(tar: tarfile.TarFile, source: Path) -> None:
    """Refuse an archive that ends without tar's end-of-archive block (one cut short
    between two files reads as a smaller archive, its last runs silently missing), or
    holds more after it (archives joined by ``cat``: the later ones went unread)."""
    tar.fileobj.seek(tar.offset)
    if tar.fileobj.read(tarfile.BLOCKSIZE) != tarfile.NUL * tarfile.BLOCKSIZE:
        raise StudyError(
            f"--records {source}: not a whole tar archive (it ends without tar's end-of-archive "
            "block: cut short?)"
        )
    while chunk := tar.fileobj.read(2**20):
        if chunk.strip(tarfile.NUL):
            raise StudyError(
                f"--records {source}: holds more after its end-of-archive block (archives "
                "joined into one?): give each archive to --records"
            )


def _not_too_large(size: int, where) -> None:
    if size > LARGEST:
        raise StudyError(f"{where}: over {LARGEST >> 20} MiB, not a run's record or translations")


def _member(tar, members, where: str) -> bytes:
    """The contents of the archive's file ``members`` (one name, stored once or, appended,
    several times): refused where the copies differ, or one is larger than a record can be."""
    contents = set()
    for member in members:
        _not_too_large(member.size, where)
        contents.add(tar.extractfile(member).read())
    if len(contents) > 1:
        raise StudyError(f"{where}: the archive holds different files of that name; give only one")
    return contents.pop()


def records_found(sources: List[Path], runs, reference: Path) -> Dict[str, tuple]:
    """The records in ``sources`` of ``runs``, checked (:func:`import_records`), by run
    name: (where, record bytes, translations bytes or None, record); nothing is copied."""
    planned = {run.name: run for run in runs}
    reference_sha256 = file_sha256(reference)
    accepted, other = {}, []
    for source in sources:
        found = 0
        for where, data, hyp in _found(Path(source)):
            found += 1
            record = parse_record(data, where)
            run = planned.get(record["run"])
            if run is None:
                other.append(f"{record['run']} ({where})")
                continue
            differ = spec_differences(record, run)
            if differ:
                other.append(f"{record['run']} of other settings or data: {differ} ({where})")
                continue
            check_record(record, where, reference_sha256, hyp)
            before = accepted.get(run.name)
            if before is not None and before[3] != record:
                raise StudyError(
                    f"two different records of {run.name}: {before[0]} and {where} (the run was "
                    "trained twice); give only one"
                )
            if before is None or before[2] is None:  # (the copy with its translations)
                accepted[run.name] = (where, data, hyp, record)
        archives = _archives_in(Path(source))
        if archives:
            log(
                f"--records {source}: the archives in it are not opened (name them to read "
                f"them): {', '.join(map(str, archives))}"
            )
        if not found:
            log(f"--records {source}: no run record in it")
    if other:
        log(f"records of runs this study does not plan, left out ({len(other)}):")
        for line in other:
            log(f"  {line}")
    return accepted


def import_records(sources: List[Path], runs, reference: Path) -> List[str]:
    """Copy the records found in ``sources`` into the folders of ``runs`` with the same
    identity; every record is checked first and nothing is copied if one is refused.
    Records of runs this study does not plan (other variants or seeds, or the same run
    name with other settings or data: another study's) are left out and named, with
    what differs. Returns the names of the runs whose records were copied."""
    planned = {run.name: run for run in runs}
    accepted = records_found(sources, runs, reference)
    for name, (where, data, hyp, record) in accepted.items():
        _check_destination(planned[name], where, record)  # (all, before any copy)
    copied = []
    for name, (where, data, hyp, record) in accepted.items():
        run = planned[name]
        path = run.folder / RECORD
        if path.exists():
            continue
        run.folder.mkdir(parents=True, exist_ok=True)
        try:  # (not into a folder where the run is being trained: a SLURM job's, a study's)
            lock = RunLock(run.folder, name)
        except RunBusy as err:
            raise StudyError(f"{where}: {err}") from None
        try:
            if not _check_destination(run, where, record):  # (again, under the lock)
                continue
            if hyp is not None:
                (run.folder / "eval").mkdir(exist_ok=True)
                write_atomic(run.folder / "eval" / "hyp.detok", hyp)
            write_atomic(path, data)
        finally:
            lock.close()
        copied.append(name)
        log(f"{name}: record taken from {where}")
    return copied


def _archives_in(folder: Path) -> List[Path]:
    """The tar archives (by their names) in ``folder``, searched recursively."""
    if not folder.is_dir():
        return []
    endings = (".tar", ".tgz", ".tar.gz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")
    return sorted(p for p in folder.rglob("*") if p.name.endswith(endings) and p.is_file())


def _check_destination(run, where: str, record: dict) -> bool:
    """Whether ``run``'s folder can take ``record`` (False: it holds it already);
    a :class:`StudyError` where it holds another record, or other translations."""
    path = run.folder / RECORD
    if path.exists():
        if read_record(path) != record:
            raise StudyError(
                f"{where}: {run.folder} already holds another record of {run.name}; move one "
                "of them aside"
            )
        return False
    local = run.folder / "eval" / "hyp.detok"
    if local.exists() and file_sha256(local) != record["translations_sha256"]:
        raise StudyError(
            f"{where}: {local} holds other translations of {run.name} than the record's "
            "(translated here, its record not yet written); move its eval folder aside "
            "to take the record"
        )
    return True


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` into ``path`` by a temporary name; a :class:`StudyError` where it cannot be."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as err:
        raise StudyError(f"{path}: cannot be written ({err.strerror})", status=1) from None
    finally:
        tmp.unlink(missing_ok=True)


def packed_runs(archive: Path) -> List[str]:
    """The run folders (relative to a study folder) whose records ``archive`` holds."""
    try:
        with tarfile.open(archive) as tar:
            names = [os.path.normpath(m.name) for m in tar.getmembers() if m.isfile()]
    except (OSError, EOFError, zlib.error, tarfile.TarError) as err:
        raise StudyError(
            f"--pack {archive}: exists and is not a readable archive ({err}); give another name, "
            "or --force to replace it"
        ) from None
    return sorted(str(Path(n).parent) for n in names if Path(n).name == RECORD)


def nearest_folder(path: Path) -> Path:
    """``path``, or where it does not exist the nearest folder above it that does (where
    the folders still to make would be made)."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def check_pack_path(archive: Path) -> None:
    """Refuse an ``archive`` that cannot be written: a folder, or in none that can be."""
    archive = Path(archive)
    if archive.is_dir():
        raise StudyError(f"--pack {archive}: is a folder; --pack names the archive to write")
    folder = nearest_folder(archive.parent)
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise StudyError(f"--pack {archive}: cannot be written ({folder} is not a writable folder)")


def check_pack(archive: Path, runs, out: Path, force: bool) -> None:
    """Refuse an ``archive`` that cannot be written, or (unless ``force``) one that holds
    the records of runs other than ``runs`` (of the study folder ``out``): they would be
    lost. The same study packing again (a resumed or re-reported study) replaces it."""
    archive = Path(archive)
    check_pack_path(archive)
    if force or not archive.exists():
        return
    folders = {str(run.folder.relative_to(out)) for run in runs}
    lost = [name for name in packed_runs(archive) if name not in folders]
    if lost:
        raise StudyError(
            f"--pack {archive} already holds the records of runs this would not pack again "
            f"({', '.join(lost)}): give another name, or --force to replace it"
        )


def pack_records(runs, archive: Path, out: Path, force: bool = False) -> int:
    """A gzipped tar of the finished runs' records and translations (no checkpoints),
    paths relative to the study folder ``out``; written atomically, never losing the
    records an existing archive holds (:func:`check_pack`). Returns its size."""
    archive = Path(archive)
    check_pack(archive, runs, out, force)
    tmp = archive.with_name(f".{archive.name}.{os.getpid()}.tmp")
    try:
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tmp, "w:gz") as tar:
            for run in runs:
                for name in PACKED:
                    path = run.folder / name
                    if path.exists():
                        tar.add(path, arcname=str(path.relative_to(out)))
        os.replace(tmp, archive)
    except OSError as err:  # (a full disk)
        raise StudyError(f"--pack {archive}: cannot be written ({err})", status=1) from None
    finally:
        tmp.unlink(missing_ok=True)
    return archive.stat().st_size
