"""The commands a study runs (stopped with it) and the files they leave."""

import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path


def log(message: str) -> None:
    # one write per line: print() writes the newline apart, and the runs log from threads
    sys.stdout.write(f"[study {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stdout.flush()


def count_lines(path: Path) -> int:
    """Lines as ``str.splitlines()`` counts them (a last line without newline counts)."""
    with open(path, encoding="utf-8", newline="") as handle:
        return len(handle.read().splitlines())


class StepTimeout(RuntimeError):
    """A command stopped at its time limit."""


class Children:
    """The commands the study is running (its worker threads start them). A study told to
    stop (SIGTERM, SIGINT) stops them and waits for them before it exits, so that no
    fairseq-train outlives it and writes into a run folder the next study uses; and it
    starts no new command once told."""

    def __init__(self):
        self._procs = set()
        self._lock = threading.RLock()  # (a signal handler may take it in the same thread)
        self.stopping = threading.Event()

    def run(self, cmd, out, env, timeout=None) -> int:
        """The command's exit status; past ``timeout`` seconds it is stopped (SIGTERM,
        SIGKILL after 30 s) and :class:`StepTimeout` raised."""
        with self._lock:
            if self.stopping.is_set():
                raise RuntimeError("the study is stopping")
            proc = subprocess.Popen(
                [str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env
            )
            self._procs.add(proc)
        try:
            try:
                return proc.wait(timeout=timeout)
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


def run_command(cmd, log_path: Path, env=None, timeout=None) -> None:
    with open(log_path, "a") as out:
        out.write("+ " + " ".join(shlex.quote(str(c)) for c in cmd) + "\n")
        out.flush()
        try:
            returncode = CHILDREN.run(cmd, out, env, timeout)
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
