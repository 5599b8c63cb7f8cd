"""Before fairseq-train resumes: make sure ``checkpoint_last.pt`` can be loaded.

fairseq writes each checkpoint under a temporary name and renames it, but then *copies*
it to ``checkpoint_last.pt`` and ``checkpoint_best.pt`` without one: a kill during that
copy leaves a truncated ``checkpoint_last.pt``, on which the next ``fairseq-train`` stops
with a ``PytorchStreamReader`` traceback instead of resuming.

This tool (``tpp-recover-checkpoint``), run by ``scripts/train.sh`` (and
``scripts/slurm/train.sbatch``) before fairseq starts:

1. checks only that a ``--restore-file`` naming another file is there (fairseq resumes
   from it), and nothing where the save dir holds no checkpoint (a fresh run);
   checkpoints without ``checkpoint_last.pt`` are resumed from as in 3;
2. checks that ``checkpoint_last.pt`` loads: a complete zip archive (a truncated copy
   lacks the central directory at its end), every member's checksum right, readable by
   torch's safe unpickler (tensors memory-mapped, not loaded);
3. if not, moves it aside to ``checkpoint_last.pt.damaged-<time>`` (never deleted) and
   copies the readable checkpoint with the most updates to ``checkpoint_last.pt``, saying
   which; with none left it stops: the same command run again starts from the beginning.

Usage (the options of a fairseq-train command line; others are ignored, the last value
of a repeated option counts, as in fairseq)::

    tpp-recover-checkpoint --save-dir checkpoints/en-de
    tpp-recover-checkpoint --save-dir DIR --checkpoint-suffix=-shard0

Exit status: 0 (nothing to do, or recovered), 2 (nothing to resume from as asked: said),
3 (``--max-update N`` given and ``checkpoint_last.pt`` has N updates or more: the run is
finished, fairseq-train would train one update more; ``scripts/train.sh`` trains nothing).
"""

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tpp_pipeline.errors import UserError, report

DEFAULT_RESTORE_FILE = "checkpoint_last.pt"  # fairseq's default for --restore-file


class RecoveryError(UserError):
    """No checkpoint to resume from: reported without a traceback, exit status 2."""


def say(message):
    print(f"tpp-recover-checkpoint: {message}", file=sys.stderr, flush=True)


def _quiet_fairseq():
    import logging

    logging.getLogger("fairseq").setLevel(logging.WARNING)  # import-time notices


def problem_with(path):
    """None if ``path`` is a loadable checkpoint, else its :class:`CheckpointError`."""
    _quiet_fairseq()
    from .checkpoint_files import CheckpointError, load_checkpoint

    try:
        load_checkpoint(path, mmap=True, verify_zip=True)
    except CheckpointError as error:
        return error
    return None


def candidates(save_dir, suffix=""):
    """Checkpoints fairseq writes that a run can resume from: (path, kind rank)."""
    suffix = re.escape(suffix)
    patterns = [
        (re.compile(rf"^checkpoint_\d+_\d+{suffix}\.pt$"), 0),
        (re.compile(rf"^checkpoint\d+{suffix}\.pt$"), 0),
        (re.compile(rf"^checkpoint_best{suffix}\.pt$"), 1),
    ]
    found = []
    for name in sorted(os.listdir(save_dir)):
        for pattern, rank in patterns:
            if pattern.match(name):
                found.append((Path(save_dir) / name, rank))
    return found


def newest_readable(save_dir, suffix=""):
    """(path, update count) of the readable checkpoint with the most updates, or None.
    Unreadable ones are reported and skipped."""
    from .checkpoint_files import CheckpointError, load_checkpoint, num_updates

    best, refused = None, []
    for path, rank in candidates(save_dir, suffix):
        try:
            state = load_checkpoint(path, mmap=True, verify_zip=True)
        except CheckpointError as error:
            say(f"skipping {path}: {error.reason}")
            refused += [path] if error.refused else []
            continue
        updates = num_updates(state)
        del state
        if updates is None:
            say(f"skipping {path}: it does not record its update count")
            continue
        # most updates first; on a tie an interval/epoch checkpoint before checkpoint_best
        key = (updates, -rank, path.stat().st_mtime)
        if best is None or key > best[0]:
            best = (key, path, updates)
    newer = [p for p in refused if best is not None and p.stat().st_mtime > best[1].stat().st_mtime]
    if newer:
        raise RecoveryError(
            f"{', '.join(p.name for p in newer)}: newer than {best[1].name}, the newest "
            "checkpoint safe loading accepts, but refused (above): resuming from "
            f"{best[1].name} would write over it; move it away first if you mean to"
        )
    if best is None and refused:
        raise RecoveryError(
            f"{save_dir}: no checkpoint to resume from that safe loading accepts; "
            f"{', '.join(p.name for p in refused)}: whole, but refused (above), and training "
            "from the beginning would overwrite them: move them away first if you mean to"
        )
    return None if best is None else (best[1], best[2])


def copy_atomically(source, target):
    handle, temporary = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
    )
    try:
        with os.fdopen(handle, "wb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
        shutil.copymode(source, temporary)
        os.replace(temporary, target)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def recover(save_dir, restore_file=DEFAULT_RESTORE_FILE, suffix="", keeps_last=True):
    """Make ``<save_dir>/checkpoint_last<suffix>.pt`` loadable (see the module doc).

    Returns the checkpoint now in place of the damaged (or missing) one, or None when
    nothing had to be done. Raises :class:`RecoveryError` when no readable checkpoint is
    left. ``keeps_last`` is False under fairseq's ``--no-last-checkpoints``.
    """
    if restore_file != DEFAULT_RESTORE_FILE:  # fairseq resumes from that file
        read = restore_path(restore_file, suffix)
        if not os.path.isfile(read):  # (fairseq would say so in a log line, and start afresh)
            raise RecoveryError(
                f"--restore-file {restore_file}: no such file "
                f"{f'(fairseq reads {read}, with the --checkpoint-suffix) ' if suffix else ''}"
                "(fairseq would train from the beginning); a path is read from the current "
                "folder, not the save dir"
            )
        return None
    save_dir = Path(save_dir)
    last = save_dir / f"checkpoint_last{suffix}.pt"
    if not last.exists():
        return _resume_without_last(save_dir, last, suffix, keeps_last)
    problem = problem_with(last)
    if problem is None:
        return None
    if problem.refused:  # whole, not torn: the user's to decide, nothing is moved
        raise RecoveryError(
            f"{last}: {problem.reason}. The file is whole (not torn), so it is left where "
            "it is: resume from another checkpoint with --restore-file FILE, or move it "
            "away to resume from the newest readable one"
        )
    reason = problem.reason
    # (refused checkpoints raise here, the torn one still in place for the next attempt)
    found = newest_readable(save_dir, suffix)
    aside = save_dir / f"{last.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    number = 1
    while aside.exists():
        number += 1
        aside = save_dir / f"{last.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{number}"
    try:
        os.replace(last, aside)
    except OSError as error:
        raise RecoveryError(
            f"{last} cannot be loaded ({reason}), and it cannot be moved aside to resume from "
            f"another checkpoint: {error.strerror} (make {save_dir} writable)"
        ) from None
    say(f"{last} cannot be loaded ({reason}); moved it to {aside}")
    if found is None:
        raise RecoveryError(
            f"{save_dir}: no readable checkpoint to resume from (the damaged "
            f"{last.name} is kept as {aside.name}); run the same command again to start "
            "training from the beginning"
        )
    path, updates = found
    copy_to_last(path, last)
    say(f"resuming from {path} ({updates} updates): copied to {last}")
    return path


def _resume_without_last(save_dir, last, suffix, keeps_last):
    """``last`` is missing: resume from the newest readable checkpoint, if any."""
    found = newest_readable(save_dir, suffix) if save_dir.is_dir() else None
    if found is None:
        return None  # a fresh run (torn checkpoints are written over, refused ones raised)
    path, updates = found
    if not keeps_last:  # a copy would never be updated: the next resume would go back to it
        given = path.with_name(path.name[: -len(f"{suffix}.pt")] + ".pt")  # (fairseq adds it)
        raise RecoveryError(
            f"{save_dir} holds {path.name} ({updates} updates) and, under "
            "--no-last-checkpoints, no checkpoint_last: fairseq would train from the "
            f"beginning and write over it. Resume with --restore-file {given}, or give "
            "another --save-dir to start afresh"
        )
    copy_to_last(path, last)
    say(f"{last.name} is missing; resuming from {path} ({updates} updates): copied to {last}")
    return path


def copy_to_last(path, last):
    """Copy the checkpoint resumed from to ``last``, or say why it cannot be."""
    try:
        copy_atomically(path, last)
    except OSError as error:
        raise RecoveryError(
            f"cannot copy {path} to {last} to resume from it: {error.strerror} (make "
            f"{last.parent} writable)"
        ) from None


def restore_path(restore_file, suffix=""):
    """The file fairseq reads for a ``--restore-file`` other than its default: the
    ``--checkpoint-suffix`` put before every ``.pt``, as fairseq 0.12 does."""
    return restore_file.replace(".pt", f"{suffix}.pt") if suffix else restore_file


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="tpp-recover-checkpoint",
        description="Check that <save-dir>/checkpoint_last.pt loads before fairseq-train "
        "resumes from it; if it does not (a torn copy), keep it aside and resume from the "
        "newest readable checkpoint of the save dir.",
        epilog="Other options (a whole fairseq-train command line) are ignored.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--save-dir", default="checkpoints", help="fairseq's --save-dir [checkpoints]"
    )
    parser.add_argument(
        "--restore-file",
        default=DEFAULT_RESTORE_FILE,
        help="fairseq's --restore-file: anything but the default means "
        "fairseq resumes from that file: only that it is there is checked",
    )
    parser.add_argument("--checkpoint-suffix", default="", help="fairseq's --checkpoint-suffix")
    parser.add_argument(
        "--no-last-checkpoints",
        action="store_true",
        help="fairseq's --no-last-checkpoints: a missing checkpoint_last.pt is not recovered",
    )
    parser.add_argument(
        "--max-update",
        type=int,
        default=0,
        help="fairseq's --max-update: a checkpoint_last.pt with that many updates is a "
        "finished run (exit status 3)",
    )
    args, _ = parser.parse_known_args(argv)
    return args


def finished_updates(save_dir, max_update, restore_file=DEFAULT_RESTORE_FILE, suffix=""):
    """The updates of ``checkpoint_last.pt`` when they reach ``max_update`` (> 0), else None."""
    last = Path(save_dir) / f"checkpoint_last{suffix}.pt"
    if max_update <= 0 or restore_file != DEFAULT_RESTORE_FILE or not last.exists():
        return None
    _quiet_fairseq()
    from .checkpoint_files import CheckpointError, load_checkpoint, num_updates

    try:
        updates = num_updates(load_checkpoint(last, mmap=True)) or 0
    except CheckpointError:
        return None
    return updates if updates >= max_update else None


def main(argv=None):
    """Recover under the save dir's lock (``.lock``), as ``tpp-train`` takes it: never
    beside a training that writes its checkpoints there."""
    argv = list(sys.argv[1:] if argv is None else argv)
    lock = None
    save_dir = Path(parse_args(argv).save_dir)
    if save_dir.is_dir():  # not while a training writes its checkpoints there
        from .train import TrainError, take_lock

        try:
            lock = take_lock(save_dir, ["tpp-recover-checkpoint", *argv])
        except TrainError as error:
            return report("tpp-recover-checkpoint", error)
        except OSError:  # a folder it cannot write: checked without the lock (as before)
            lock = None
    try:
        return recover_held(argv)
    finally:
        if lock is not None:
            os.close(lock)


def recover_held(argv) -> int:
    """:func:`main` for a caller that holds the save dir's lock (``tpp-train``)."""
    args = parse_args(argv)
    try:
        recover(
            args.save_dir, args.restore_file, args.checkpoint_suffix, not args.no_last_checkpoints
        )
    except RecoveryError as error:
        return report("tpp-recover-checkpoint", error)
    updates = finished_updates(
        args.save_dir, args.max_update, args.restore_file, args.checkpoint_suffix
    )
    if updates is not None:
        say(
            f"{Path(args.save_dir) / f'checkpoint_last{args.checkpoint_suffix}.pt'} has {updates} "
            "updates: the run is finished "
            f"(--max-update {args.max_update}); nothing to train (a larger --max-update continues it)"
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
