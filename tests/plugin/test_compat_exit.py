"""fairseq's batch-prefetching threads are stopped before the interpreter exits
(tpp_fairseq.epochs): a daemon thread left inside torch's C++ code as Python finalizes
aborts a command that succeeded ("terminate called without an active exception")."""

import subprocess
import sys
import time

from support import REPO

from tpp_fairseq import epochs

#: a fairseq BufferedIterator whose batches take torch operations to make, one taken
PREFETCHING = r"""
import sys, torch
from fairseq.data import iterators
if sys.argv[1] == "plugin":
    import tpp_plugin  # noqa: F401

class Batches:
    def __len__(self):
        return 10**9

    def __iter__(self):
        while True:
            yield torch.stack([torch.randn(200, 200) for _ in range(20)]).sum()

itr = iterators.BufferedIterator(1000, Batches())
next(iter(itr))
print("taken", flush=True)
"""


def test_a_prefetching_thread_stops_after_the_batch_it_is_making():
    from fairseq.data import iterators

    made = []

    class Batches:
        def __len__(self):
            return 10**9

        def __iter__(self):
            while True:
                time.sleep(0.01)
                made.append(1)
                yield len(made)

    itr = iterators.BufferedIterator(2, Batches())  # a small queue: the thread waits on it
    assert next(iter(itr)) == 1
    consumer = itr._consumer
    assert consumer.is_alive()
    epochs.stop_prefetching()
    assert not consumer.is_alive()
    count = len(made)
    time.sleep(0.05)
    assert len(made) == count  # nothing more made


def test_a_command_that_exits_while_batches_are_made_exits_cleanly():
    """Three exits in the middle of making batches: each with status 0 and no abort."""
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", PREFETCHING, "plugin"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
        )
        assert "taken" in done.stdout
        assert "terminate called" not in done.stderr, done.stderr[-2000:]
        assert done.returncode == 0, done.stderr[-2000:]
