"""Errors a user makes (a wrong data folder, a missing file) or meets (a full disk): a
command-line tool reports them as one line, ``<command>: error: <message>``, without a
traceback."""

import errno
import logging
import os
import sys

from tpp_pipeline.errors import UserError  # noqa: F401  (the project's one base of them)


def program() -> str:
    """The command's name as a user typed it (``fairseq-train`` for ``python -m fairseq_cli.train``)."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    name = os.path.basename(argv0)
    if name.endswith(".py") and os.path.basename(os.path.dirname(argv0)) == "fairseq_cli":
        return "fairseq-" + name[:-3]
    return name


#: a write refused by the disk, not by the program: what to do about it
DISK_ERRORS = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space",
    errno.EFBIG: "free space",
    errno.EROFS: "make the folder writable or write elsewhere",
}


def _chain(value):
    """``value`` and the exceptions it was raised from or while handling."""
    seen = []
    while value is not None and value not in seen:
        seen.append(value)
        value = value.__cause__ or value.__context__
    return seen


def _checkpoint_being_saved(value):
    """The checkpoint fairseq was writing when ``value`` was raised (its ``.tmp``), if any."""
    for exception in _chain(value):
        tb = exception.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_name == "torch_persistent_save" and "filename" in frame.f_locals:
                return str(frame.f_locals["filename"])
            tb = tb.tb_next
    return None


def disk_error(value):
    """One line for a write the disk refused (full, over quota, read-only) anywhere in
    ``value``'s chain, or None. A checkpoint fairseq left half-written is removed."""
    refused = next(
        (e for e in _chain(value) if isinstance(e, OSError) and e.errno in DISK_ERRORS), None
    )
    if refused is None:
        return None
    target = refused.filename
    checkpoint = _checkpoint_being_saved(value)
    removed = ""
    if checkpoint is not None:
        target = target or checkpoint
        partial = checkpoint + ".tmp"
        try:
            os.remove(partial)
            removed = f" (its partial {os.path.basename(partial)} removed)"
        except FileNotFoundError:
            pass
        except OSError as error:  # (a read-only folder, say): said, not raised in the hook
            removed = f" (its partial {os.path.basename(partial)} left: {error.strerror})"
    where = f" writing {target}" if target else ""
    return (
        f"{os.strerror(refused.errno)}{where}{removed}; {DISK_ERRORS[refused.errno]} and run "
        "the same command again"
    )


def log_to_files(message) -> None:
    """``message`` as an error in the files fairseq logs to (``--log-file``), and only
    there: a run read from its log says why it stopped."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {
        handler
        for logger in loggers
        for handler in getattr(logger, "handlers", ())  # (placeholders have none)
        if isinstance(handler, logging.FileHandler)
    }
    record = logging.LogRecord(program(), logging.ERROR, __file__, 0, message, None, None)
    raising, logging.raiseExceptions = logging.raiseExceptions, False
    try:  # (a log that cannot be written prints no "--- Logging error ---" traceback)
        for handler in handlers:
            handler.handle(record)
    finally:
        logging.raiseExceptions = raising


def excepthook(kind, value, traceback):
    """A :class:`UserError`, or a write the disk refused, that reaches the top of a program
    is its one-line error (a user's also in its log file); anything else goes to the hook
    that was there before."""
    if isinstance(value, UserError):
        print(f"{program()}: error: {value}", file=sys.stderr, flush=True)
        log_to_files(f"error: {value}")
        return
    message = disk_error(value)  # (not logged: the disk may be the log's)
    if message is not None:
        print(f"{program()}: error: {message}", file=sys.stderr, flush=True)
        return
    excepthook.previous(kind, value, traceback)


excepthook.previous = sys.__excepthook__


def install_excepthook() -> None:
    """Make :func:`excepthook` ``sys.excepthook`` (once: a hook installed after it hands on to it)."""
    if sys.excepthook is not excepthook:
        excepthook.previous = sys.excepthook
        sys.excepthook = excepthook
