"""The commands a study runs (stopped with it) and the files they leave."""

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tpp_pipeline import textio


def log(message: str) -> None:
    # one write per line: print() writes the newline apart, and the runs log from threads
    sys.stdout.write(f"[study {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stdout.flush()


def count_lines(path: Path) -> int:
    """Lines as the carving writes them and ``tpp-evaluate`` reads them: ended by ``\\n``
    only (a last line without one counts; a ``\\r`` or U+2028 inside a line does not end it)."""
    return textio.count_lines(path)


class StepTimeout(RuntimeError):
    """A command stopped at its time limit."""


#: seconds between the progress lines of a long command (a training's updates and ETA)
PROGRESS_EVERY = float(os.environ.get("TPP_STUDY_PROGRESS_EVERY", "300"))


class Children:
    """The commands the study is running (its worker threads start them). A study told to
    stop (SIGTERM, SIGINT) stops them and waits for them before it exits, so that no
    fairseq-train outlives it and writes into a run folder the next study uses; and it
    starts no new command once told."""

    def __init__(self):
        self._procs = set()
        self._lock = threading.RLock()  # (a signal handler may take it in the same thread)
        self.stopping = threading.Event()

    def run(self, cmd, out, env, timeout=None, lock=None, progress=None) -> int:
        """The command's exit status; past ``timeout`` seconds it is stopped (SIGTERM,
        SIGKILL after 30 s) and :class:`StepTimeout` raised. ``lock``: a :class:`RunLock`
        the command inherits and holds while it lives, whatever becomes of the study.
        ``progress``: called every ``PROGRESS_EVERY`` seconds while the command runs."""
        with self._lock:
            if self.stopping.is_set():
                raise RuntimeError("the study is stopping")
            proc = subprocess.Popen(
                [str(c) for c in cmd],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=() if lock is None else lock.fds,
            )
            self._procs.add(proc)
            if lock is not None:
                lock.held_by(proc.pid, cmd)
        try:
            try:
                return self._wait(proc, timeout, progress)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                raise StepTimeout(f"stopped after its time limit of {timeout:.0f} s") from None
        finally:
            if proc.poll() is not None:  # interrupted by a signal: stop() waits for it
                with self._lock:
                    self._procs.discard(proc)
                if lock is not None:  # the locks' records name the study again, not a
                    lock.held_by(os.getpid(), lock.own)  # command that has ended

    @staticmethod
    def _wait(proc, timeout, progress):
        """``proc.wait(timeout)``, calling ``progress`` every ``PROGRESS_EVERY`` seconds."""
        if progress is None:
            return proc.wait(timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            try:
                return proc.wait(
                    timeout=PROGRESS_EVERY if left is None else min(left, PROGRESS_EVERY)
                )
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                progress()

    def signal_stop(self) -> None:
        """Start no new command and send the running ones SIGTERM, without waiting: what
        a signal handler may do (it can interrupt this very thread inside ``wait()`` of
        one of them, and waiting there again would deadlock on that ``Popen``)."""
        with self._lock:
            self.stopping.set()
            procs = list(self._procs)
        for proc in procs:
            proc.terminate()

    def stop(self, grace: float = 60.0) -> None:
        """:meth:`signal_stop`, then wait for the commands (SIGKILL after ``grace``)."""
        with self._lock:
            self.stopping.set()
            procs = list(self._procs)
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with self._lock:
                self._procs.discard(proc)


CHILDREN = Children()


class RunLock:
    """A run folder's lock (``flock`` on ``.lock``), held by the study and inherited by
    every command it runs there, so that a command orphaned by a killed study still holds
    it: a study started again is refused that run, naming the process, instead of
    starting a second writer in its folder. The file says who holds it."""

    def __init__(self, folder: Path, name: str):
        import fcntl

        self.path = folder / ".lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 500, 0).decode("utf-8", "replace").strip()
            os.close(self.fd)
            raise RunBusy(
                f"{name}: another process is writing in its folder {folder} "
                f"({holder or 'it has not recorded itself'}); wait for it to end or stop it, "
                "then run the study again"
            ) from None
        self.fds = (self.fd,)  # the locks its commands inherit
        self.own = [name, "(tpp-study)"]  # the study's own record, between its commands
        try:
            self.held_by(os.getpid(), self.own)
        except OSError:
            os.close(self.fd)
            raise

    def hold_save_dir(self, save_dir: Path) -> None:
        """Hold the run's save dir's lock too, as ``tpp-train`` holds it, for its commands
        to inherit: a tool that takes that lock (``tpp-recover-checkpoint``) is refused
        beside the run's training, which ``tpp-train --no-lock`` runs."""
        from ..train import TrainError, take_lock

        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            fd = take_lock(save_dir, ["tpp-study", str(self.path.parent)])
        except TrainError as err:
            raise RunBusy(str(err)) from None
        self.fds = (self.fd, fd)

    def held_by(self, pid: int, cmd) -> None:
        record = (
            f"process {pid} on host {socket.gethostname()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}: "
            + " ".join(shlex.quote(str(c)) for c in cmd)[:400]
            + "\n"
        ).encode()
        for fd in self.fds:  # (the save dir's too: a tool refused there names the command)
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


class RunBusy(RuntimeError):
    """A run's folder is locked by a live process."""


def run_command(cmd, log_path: Path, env=None, timeout=None, lock=None, progress=None) -> None:
    with open(log_path, "a") as out:
        out.write("+ " + " ".join(shlex.quote(str(c)) for c in cmd) + "\n")
        out.flush()
        try:
            returncode = CHILDREN.run(cmd, out, env, timeout, lock, progress)
        except StepTimeout as err:
            out.write(f"[study] {err}\n")
            raise
    if returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"command failed ({returncode}), log {log_path}:\n" + "\n".join(tail))


def json_records(log_path: Path):
    """fairseq's JSON --log-file records (dicts), each once: fairseq 0.12 adds a handler
    for the log file with every progress bar, so that epoch N writes each line N times."""
    out = []
    if not log_path.exists():
        return out
    previous = None
    for line in log_path.read_text(errors="replace").splitlines():
        if line == previous:
            continue
        previous = line
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
