"""Process pools of the pipeline's tokenisation and BPE steps.

Their workers are started by a fork server (or spawned where the platform has none),
never forked from the calling process itself: by the time a step runs, that process
may have imported torch and fairseq, which start threads of their own, and a child
forked from a multi-threaded process can block forever on a lock that one of those
threads held at the moment of the fork (Python 3.12 warns about exactly this). The workers
load what they need in their initializer, so nothing is lost by not inheriting the
parent's memory. (Tagging still forks, on purpose: its workers share the spaCy model
the parent loaded, and its figures in docs/benchmarks.md are measured that way.)

The price is Python's usual one for non-forked workers: each worker imports the
caller's main module again, so a script that calls the pipeline's functions itself
(rather than through ``tpp-prepare-corpus`` or ``python -m``) must do so under
``if __name__ == "__main__":``; without it every worker would re-run the script.
"""

import multiprocessing


def pool_context():
    """The ``multiprocessing`` context for worker pools: ``forkserver``, else ``spawn``."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
