"""One pipeline run per work folder at a time.

Two runs in one ``--work-dir`` share every temporary name (``tok/train.en.tmp``, the
BPE text, the staging folder of ``data-bin``) and corrupt each other's output. A run
therefore holds ``<work-dir>/.lock``:

* the lock itself is ``fcntl.flock`` on that file: the kernel releases it when the
  holder exits, however it exits, so a crashed run never blocks the next one and two
  runs racing for a free lock cannot both get it;
* the file records the holder (``pid``, ``host``, ``started``, the command), so that a
  refused run can say who holds the lock, and a run that takes over a lock whose holder
  died says so. A record left by a process on another host is not taken over (flock
  may not reach across hosts on every network filesystem, and whether that process
  still runs cannot be checked from here): the error says to remove the file once that
  run is known to be gone;
* ``--tag-shard`` runs (array jobs tagging disjoint chunks of one work folder) share the
  lock with each other (``LOCK_SH``) and exclude every other run.

The output folder ``<data-bin>/<name>`` has a lock of its own, ``<data-bin>/.<name>.lock``,
held from the start by every run that will binarize into it: two runs with different
work folders and the same output would otherwise share its staging folder.
"""

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import signal
import socket
import sys
import time

from .errors import DataError
from .textio import ensure_writable_dir

log = logging.getLogger("tpp_pipeline")

#: path -> descriptor of the locks this process holds: the commands it runs inherit
#: them (:func:`held_locks`), so that one left running by a killed run still holds them
_HELD = {}
LOCK_NAME = ".lock"


def _read_record(handle):
    handle.seek(0)
    text = handle.read().strip()
    if not text:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return {"unreadable": text[:200]}
    return record if isinstance(record, dict) else {"unreadable": text[:200]}


def _describe(record):
    if "unreadable" in record:
        return f"unreadable record {record['unreadable']!r}"
    return (
        f"process {record.get('pid')} on host {record.get('host')}, started "
        f"{record.get('started')}: {record.get('command', '?')}"
    )


def _flock_holders(path):
    """PIDs holding a flock on ``path``, from /proc/locks (this host only; may be empty)."""
    try:
        inode = os.stat(path).st_ino
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters have "->")
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[2] != "->":
            try:
                if int(fields[5].split(":")[-1]) == inode:
                    pids.append(int(fields[4]))
            except ValueError:
                continue
    return sorted(set(pids))


def _openers(path):
    """PIDs of this host's processes with ``path`` open (a command that inherited the
    lock from a run now gone), from /proc (may be empty)."""
    try:
        target = os.stat(path)
        processes = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    pids = []
    for pid in processes:
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in descriptors:
            try:
                found = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (found.st_dev, found.st_ino) == (target.st_dev, target.st_ino):
                pids.append(pid)
                break
    return pids


def _alive(pid):
    if isinstance(pid, int) and pid <= 0:  # (/proc/locks' 0: an owner outside this namespace)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, TypeError, ValueError):
        return not isinstance(pid, int) or pid > 0
    return True


def _holder(handle, path):
    """Who holds the lock, for the refusal message. The record is believed unless it
    names a dead process of this host: then it is the stale record of a killed run, and
    the holder (which took the lock a moment ago and has not yet written its own record,
    or a --tag-shard run, which writes none) is found in /proc/locks."""
    here = socket.gethostname()
    record = _read_record(handle)
    if (
        record is not None
        and "unreadable" not in record
        and (record.get("host") != here or _alive(record.get("pid")))
    ):
        return _describe(record)
    pids = [pid for pid in _flock_holders(path) if pid != os.getpid() and _alive(pid)]
    # the lock's taker gone: a command it started holds it (inherited)
    pids = pids or [pid for pid in _openers(path) if pid != os.getpid()]
    if pids:
        left = f", left running by {_describe(record)}" if record and "pid" in record else ""
        return ", ".join(f"process {pid} on host {here}" for pid in pids) + left
    return "another process, which has not recorded itself (a --tag-shard run?)"


@contextlib.contextmanager
def work_dir_lock(
    work_dir, shared=False, user="run of the pipeline", folder="work folder", lock_name=LOCK_NAME
):
    """Hold the lock of ``work_dir`` for the duration of the block (see module doc);
    ``user`` and ``folder`` name the two in the refusal ("another run of the pipeline is
    using this work folder"). The lock is the file ``lock_name`` in ``work_dir``, which
    is created if needed and must be writable (an error naming it otherwise)."""
    ensure_writable_dir(work_dir, folder)
    path = os.path.join(work_dir, lock_name)
    handle = open(path, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(
                f"another {user} is using this {folder} "
                f"({_holder(handle, path)}); wait for it to finish or stop it",
                path,
            ) from None
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            log.warning(
                "%s: this filesystem does not support locks (%s); nothing prevents a "
                "second %s in this %s",
                path,
                error.strerror,
                user,
                folder,
            )
            yield path
            return
        # Holding the lock. A record still in the file belongs to a run that ended
        # without clearing it (killed), unless it comes from another host.
        record = _read_record(handle)
        if record is not None:
            here = socket.gethostname()
            if record.get("host") not in (None, here):
                raise DataError(
                    f"the lock was left by {_describe(record)}, which this host cannot "
                    "check; if that run is over, remove this file and start again",
                    path,
                )
            log.warning(
                "%s: taking over the lock left by %s: that run ended without " "releasing it",
                path,
                _describe(record),
            )
            if shared:  # another shard may have cleared it already: harmless
                handle.seek(0)
                handle.truncate()
                handle.flush()
        if not shared:
            handle.seek(0)
            handle.truncate()
            handle.write(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "command": shlex.join(sys.argv)[:500],
                    }
                )
                + "\n"
            )
            handle.flush()
        _HELD[path] = handle.fileno()
        try:
            yield path
        finally:
            _HELD.pop(path, None)
            if not shared:
                handle.seek(0)
                handle.truncate()  # the record goes before the lock does
                handle.flush()
    finally:
        handle.close()  # releases the flock


def held_locks():
    """The descriptors of the locks this process holds, for a command it starts to
    inherit (``subprocess.run(..., pass_fds=held_locks())``): a command left running by
    a run killed outright (SIGKILL) keeps them, and a run started again meanwhile is
    refused, naming it, instead of writing beside it."""
    return tuple(_HELD.values())


def exit_cleanly_on_sigterm():
    """Turn SIGTERM (kill, SLURM's time limit, scancel), SIGHUP (a closed terminal, unless
    nohup ignores it) and SIGINT (Ctrl-C, without a traceback) into SystemExit in this
    process, so that the commands it runs are stopped and the lock record and temporary
    files are cleaned up on the way out. Worker processes forked later exit at once on
    them."""
    main_pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() != main_pid:
            os._exit(128 + signum)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    for signum in (signal.SIGHUP, signal.SIGINT):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # (nohup's SIGHUP stays ignored)
            signal.signal(signum, handler)
