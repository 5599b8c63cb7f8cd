"""Skip-if-done bookkeeping for the pipeline's steps.

Each finished step leaves a small JSON marker in ``<work>/.steps/<step>.json`` holding a
fingerprint of its settings and of the step before it. Re-running the pipeline skips a
step whose marker matches; a marker written with *different* settings is an error
(unless ``--force``), because silently mixing, say, BPE codes of one run with tags of
another produces data that trains but is wrong.
"""

import hashlib
import json
import logging
import os

from .errors import DataError
from .textio import atomic_open

log = logging.getLogger("tpp_pipeline")


def file_identity(path):
    """What identifies an input file cheaply: absolute path, size and modification time."""
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def fingerprint(payload):
    """A stable short hash of a JSON-serialisable payload."""
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class StepLedger:
    """Runs named steps once, remembering what was done in ``<work_dir>/.steps``."""

    def __init__(self, work_dir, force=False):
        self.work_dir = work_dir
        self.marker_dir = os.path.join(work_dir, ".steps")
        # With force every step runs again (its marker is rewritten when it finishes).
        self.force = force
        os.makedirs(self.marker_dir, exist_ok=True)

    def marker_path(self, name):
        return os.path.join(self.marker_dir, f"{name}.json")

    def is_done(self, name, stamp):
        """True if ``name`` finished with the same ``stamp``; error if with another one."""
        marker = self.marker_path(name)
        if self.force or not os.path.exists(marker):
            return False
        with open(marker, encoding="utf-8") as handle:
            saved = json.load(handle)
        if saved.get("stamp") != stamp:
            raise DataError(
                f"step '{name}' was already done with different settings or inputs; "
                "re-run with --force to redo the pipeline from scratch", marker)
        missing = [p for p in saved.get("outputs", []) if not os.path.exists(p)]
        if missing:
            log.warning("step %s: outputs missing (%s), redoing it", name, ", ".join(missing))
            return False
        return True

    def run(self, name, settings, outputs, action, upstream=""):
        """Run ``action()`` unless done; return this step's stamp for the next step.

        ``settings`` are the step's own parameters, ``upstream`` the stamp of the step it
        reads from, ``outputs`` the files (or folders) it must have produced.
        """
        stamp = fingerprint({"step": name, "settings": settings, "upstream": upstream})
        if self.is_done(name, stamp):
            log.info("step %s: already done, skipping", name)
            return stamp
        log.info("step %s: running", name)
        action()
        missing = [p for p in outputs if not os.path.exists(p)]
        if missing:
            raise DataError(f"step '{name}' finished without writing {', '.join(missing)}")
        with atomic_open(self.marker_path(name)) as handle:
            json.dump({"stamp": stamp, "settings": settings, "outputs": list(outputs)},
                      handle, indent=1, sort_keys=True, default=str)
        return stamp
