"""Reading fairseq checkpoint files with a reason a person can act on when they are bad.

``torch.load`` reports a text file as ``KeyError: '101'``, an empty file as an
``EOFError`` with no message and a truncated file as a miniz error. The scripts that
read checkpoints (averaging, evaluation, recovery of a torn ``checkpoint_last.pt``)
use :func:`load_checkpoint`, which looks at the file first and says what it is:

* empty (0 bytes);
* a text file (quoting its first line);
* a zip archive -- the format ``torch.save`` writes -- without the central directory
  that ends it: the file was cut short, typically by a kill or a full disk while it
  was being written or copied (fairseq copies ``checkpoint_last.pt`` and
  ``checkpoint_best.pt`` without a temporary name);
* some other binary file;
* a checkpoint that safe loading refuses (objects outside the allow-list that importing
  :mod:`tpp_plugin` sets up), or one without a ``model`` state dict.

Loading is always ``weights_only=True``.
"""

import logging
import os
import pickle
import sys
import zipfile

# the root logger's level before fairseq is first imported (None: it already was): its
# import turns on DEBUG, which a command would print lines of, unless asked for before
_root_level = None if "fairseq" in sys.modules else logging.getLogger().level

import torch  # noqa: E402

from tpp_pipeline.errors import UserError  # noqa: E402

from tpp_fairseq import allow_fairseq_checkpoints  # noqa: E402  (imports fairseq)
from tpp_fairseq.fixes import undo_debug_logging_of_fairseq_import  # noqa: E402

undo_debug_logging_of_fairseq_import(_root_level)
allow_fairseq_checkpoints()  # what fairseq checkpoints hold, for torch's safe loading

ZIP_MAGIC = b"PK\x03\x04"
# torch.save's format before torch 1.6: a pickled magic number first
LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."


class CheckpointError(UserError):
    """A checkpoint file that cannot be used; ``str()`` is ``"<path>: <reason>"``.
    ``refused``: the file is whole, but safe loading refuses what it holds (not damage)."""

    def __init__(self, path, reason, refused=False):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason
        self.refused = refused


def _as_text(head, truncated):
    """``head`` decoded as UTF-8 text, or None if it does not look like text."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as error:
        # the 512-byte window may end inside a multi-byte character
        if not truncated or error.start < len(head) - 3:
            return None
        text = head[: error.start].decode("utf-8")
    if any(ord(c) < 32 and c not in "\t\n\r\f" for c in text):
        return None
    return text


def _first_line(text):
    lines = [line for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else text
    return line if len(line) <= 60 else line[:57] + "..."


def format_problem(path, verify_zip=False):
    """Why ``path`` cannot be a loadable checkpoint, judged from its bytes; None if it
    may be one. ``verify_zip`` also checks the CRC of every member of the archive
    (reads the whole file)."""
    path = str(path)
    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        return "is a directory, not a checkpoint file"
    size = os.path.getsize(path)
    if size == 0:
        return "empty file (0 bytes), not a checkpoint"
    with open(path, "rb") as handle:
        head = handle.read(512)
    if head.startswith(ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path) as archive:
                if verify_zip:
                    bad = archive.testzip()
                    if bad is not None:
                        return (
                            f"damaged checkpoint: member '{bad}' of the archive fails "
                            "its checksum"
                        )
        except (zipfile.BadZipFile, OSError, EOFError):
            return (
                f"truncated or damaged checkpoint ({size} bytes): the zip archive that "
                "torch.save writes has no intact central directory at its end, so the "
                "file was cut short, e.g. by a kill or a full disk while it was being "
                "written or copied"
            )
        return None
    if head.startswith(LEGACY_MAGIC):
        return None
    text = _as_text(head, truncated=size > len(head))
    if text is None:
        return f"not a PyTorch checkpoint (unknown binary format, starts with {head[:8]!r})"
    return f"a text file, not a checkpoint (first line: {_first_line(text)!r})"


def load_checkpoint(path, mmap=False, verify_zip=False):
    """Load a fairseq checkpoint on the CPU with torch's safe unpickler.

    ``mmap=True`` maps the tensors instead of reading them (cheap: for checking that a
    file loads, or reading its metadata). Raises :class:`CheckpointError` with a
    readable reason; returns the checkpoint dict otherwise.
    """
    path = str(path)
    problem = format_problem(path, verify_zip=verify_zip)
    if problem is not None:
        raise CheckpointError(path, problem)
    with open(path, "rb") as handle:
        is_zip = handle.read(4) == ZIP_MAGIC
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=bool(mmap and is_zip))
    except pickle.UnpicklingError as error:
        lines = [line for line in str(error).splitlines() if line.strip()]
        detail = next(
            (line.strip() for line in lines if "Unsupported global" in line),
            lines[0] if lines else type(error).__name__,
        )
        raise CheckpointError(
            path, f"safe loading (weights_only) refuses its contents: {detail}", refused=True
        ) from None
    except Exception as error:  # anything torch's reader raises on a damaged file
        message = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(
            path, "cannot be loaded: " f"{type(error).__name__}{': ' + message if message else ''}"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        what = (
            f"keys: {', '.join(map(str, list(state)[:6]))}"
            if isinstance(state, dict)
            else f"it holds a {type(state).__name__}"
        )
        raise CheckpointError(path, f"not a fairseq checkpoint (no 'model' state dict; {what})")
    return state


def num_updates(state):
    """The update count a checkpoint was saved at (None when it does not say)."""
    history = state.get("optimizer_history") or []
    if history and isinstance(history[-1], dict) and "num_updates" in history[-1]:
        return int(history[-1]["num_updates"])
    return None
