"""Skip-if-done bookkeeping for the pipeline's steps.

Each finished step leaves a small JSON marker in ``<work>/.steps/<step>.json`` holding a
fingerprint of its settings and of the step before it. Re-running the pipeline skips a
step whose marker matches; a marker written with *different* settings is an error
naming the settings that changed, because silently mixing, say, BPE codes of one run
with tags of another produces data that trains but is wrong. With ``--force`` the
changed step is redone, and with it every step after it (their fingerprints include
the one before); the steps before it are kept.
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


def _plain(value):
    """``value`` as it reads back from a marker (tuples become lists, and so on)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _describe_change(label, old, new):
    """One changed setting, in words: ``label`` names it (an option, usually)."""

    def files(value):
        if isinstance(value, dict) and "path" in value:
            return [value]
        if isinstance(value, list) and all(isinstance(v, dict) and "path" in v for v in value):
            return value
        return None

    old_files, new_files = files(old), files(new)
    if old_files is not None and new_files is not None:
        before = {f["path"]: f for f in old_files}
        changed = [f["path"] for f in new_files if before.get(f["path"]) != f]
        gone = [p for p in before if p not in {f["path"] for f in new_files}]
        detail = []
        if changed:
            detail.append("new or changed since: " + ", ".join(changed))
        if gone:
            detail.append("no longer used: " + ", ".join(gone))
        return f"{label} ({'; '.join(detail) or 'reordered'})"
    said = lambda value: "not given" if value is None else json.dumps(value)  # noqa: E731
    return f"{label} was {said(old)}, now {said(new)}"


class StepLedger:
    """Runs named steps once, remembering what was done in ``<work_dir>/.steps``.

    ``names`` maps setting keys to what the user knows them by (options), for the
    message about changed settings. With ``force`` a step done with other settings is
    redone instead of refused."""

    def __init__(self, work_dir, force=False, names=None):
        self.work_dir = work_dir
        self.marker_dir = os.path.join(work_dir, ".steps")
        self.force = force
        self.names = dict(names or {})
        os.makedirs(self.marker_dir, exist_ok=True)

    def marker_path(self, name):
        return os.path.join(self.marker_dir, f"{name}.json")

    def saved(self, name):
        """The marker of step ``name`` (a dict), or None if it was not done."""
        marker = self.marker_path(name)
        if not os.path.exists(marker):
            return None
        with open(marker, encoding="utf-8") as handle:
            return json.load(handle)

    def changes(self, saved, settings, upstream):
        """What differs between a marker and this run: a list of phrases."""
        old, new = saved.get("settings") or {}, _plain(settings or {})
        found = [
            _describe_change(self.names.get(key, key), old.get(key), new.get(key))
            for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)
        ]
        if not found:  # same settings, so the stamp of the step before differs
            found.append("the steps before it were done with other settings or inputs")
        return found

    def is_done(self, name, stamp, settings=None, upstream=None, relocatable=()):
        """True if ``name`` finished with the same ``stamp``. A marker with another stamp
        is an error naming what changed, unless ``force`` (then the step is redone) or
        only settings in ``relocatable`` changed (where the output goes, not what it
        holds: the step is simply run again)."""
        saved = self.saved(name)
        if saved is None:
            return False
        marker = self.marker_path(name)
        if saved.get("stamp") != stamp:
            if settings is None:
                changes = "settings or inputs changed"
            else:
                old, new = saved.get("settings") or {}, _plain(settings)
                moved = {k for k in set(old) | set(new) if old.get(k) != new.get(k)}
                changes = "; ".join(self.changes(saved, settings, upstream))
                if moved and moved <= set(relocatable) and saved.get("upstream") == upstream:
                    log.info(
                        "step %s: done before with %s; running it again for this run", name, changes
                    )
                    return False
            if self.force:
                log.info(
                    "step %s: settings changed (%s): redoing it and the steps after it",
                    name,
                    changes,
                )
                return False
            raise DataError(
                f"step '{name}' was already done with other settings or inputs: {changes}; "
                "re-run with --force to redo this step and the ones after it (the steps "
                "before it are kept), or use another --work-dir",
                marker,
            )
        missing = [p for p in saved.get("outputs", []) if not os.path.exists(p)]
        if missing:
            log.warning("step %s: outputs missing (%s), redoing it", name, ", ".join(missing))
            return False
        return True

    def run(self, name, settings, outputs, action, upstream="", relocatable=(), redo=False):
        """Run ``action()`` unless done; return this step's stamp for the next step.

        ``settings`` are the step's own parameters, ``upstream`` the stamp of the step it
        reads from, ``outputs`` the files (or folders) it must have produced;
        ``relocatable`` and ``redo``: see :meth:`is_done` (``redo`` runs it regardless).
        """
        stamp = fingerprint({"step": name, "settings": settings, "upstream": upstream})
        if not redo and self.is_done(name, stamp, settings, upstream, relocatable):
            log.info("step %s: already done, skipping", name)
            return stamp
        log.info("step %s: running", name)
        action()
        missing = [p for p in outputs if not os.path.exists(p)]
        if missing:
            raise DataError(f"step '{name}' finished without writing {', '.join(missing)}")
        with atomic_open(self.marker_path(name)) as handle:
            json.dump(
                {
                    "stamp": stamp,
                    "settings": settings,
                    "upstream": upstream,
                    # absolute: the step is done whatever folder the command runs from
                    "outputs": [os.path.abspath(p) for p in outputs],
                },
                handle,
                indent=1,
                sort_keys=True,
                default=str,
            )
        return stamp
