"""Errors a user makes (a wrong data folder, a missing file): a command-line tool
reports them as one line, ``<command>: error: <message>``, without a traceback."""

import os
import sys


class UserError(Exception):
    """An error whose message says what is wrong and what to do; no traceback helps."""


def program() -> str:
    """The command's name as a user typed it (``fairseq-train`` for ``python -m fairseq_cli.train``)."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    name = os.path.basename(argv0)
    if name.endswith(".py") and os.path.basename(os.path.dirname(argv0)) == "fairseq_cli":
        return "fairseq-" + name[:-3]
    return name


def excepthook(kind, value, traceback):
    """A :class:`UserError` that reaches the top of a program is its one-line error;
    anything else goes to the hook that was there before."""
    if isinstance(value, UserError):
        print(f"{program()}: error: {value}", file=sys.stderr, flush=True)
        return
    excepthook.previous(kind, value, traceback)


excepthook.previous = sys.__excepthook__


def install_excepthook() -> None:
    """Make :func:`excepthook` ``sys.excepthook`` (once: a hook installed after it hands on to it)."""
    if sys.excepthook is not excepthook:
        excepthook.previous = sys.excepthook
        sys.excepthook = excepthook
