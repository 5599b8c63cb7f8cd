"""The single error type of the data pipeline, and the project's base of errors a user
makes or meets (:class:`UserError`), reported by every command the same way."""

import errno
import sys

# A write failing for one of these reasons means the disk (or a quota, or a limit on the
# size of a file) is full: the fix is more room, not another input.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
FULL_DISK_HINT = (
    "make room (free space, raise the quota or file-size limit) or point "
    "{folders} at another disk, then run again{kept}"
)
PIPELINE_FOLDERS = "--work-dir / --data-bin"
# Errors of the file system that a user fixes (permissions, a read-only or full disk, a
# file where a folder should be); any other OSError is left to show its traceback.
FILE_SYSTEM = FULL_DISK + (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR)


class UserError(Exception):
    """An error whose message says what is wrong and what to do: a command prints it as
    one line, ``<command>: error: <message>`` (:func:`report`), and ends with ``status``."""

    status = 2


class OptionError(UserError, ValueError):
    """An option's value that the model, task or criterion cannot use (the plugin's options
    given to fairseq's commands): one line, as argparse's own errors; a ``ValueError`` too,
    for code that builds the modules itself and catches those."""


def report(prog: str, error: BaseException) -> int:
    """Print ``error`` as a command's one line and return its exit status (2 unless it
    has its own)."""
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    return getattr(error, "status", 2)


class DataError(UserError):
    """Bad input or inconsistent intermediate data.

    The message always says which file (and, where it makes sense, which 1-based line)
    is at fault, so that a failure hours into a WMT run can be traced without a debugger.
    """

    def __init__(self, message, path=None, line=None):
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.message = message
        self.path = path
        self.line = line


def full_disk_hint(folders=PIPELINE_FOLDERS):
    """What to do about a full disk; ``folders`` names the options that choose where
    the command writes."""
    kept = ": the steps already done are kept" if folders == PIPELINE_FOLDERS else ""
    return FULL_DISK_HINT.format(folders=folders, kept=kept)


def from_os_error(error, path=None, folders=PIPELINE_FOLDERS):
    """A :class:`DataError` for an ``OSError`` of :data:`FILE_SYSTEM`, naming its file
    (``path`` where the error names none: a failed write does not), the cause and what to
    do (``folders``: the options that choose where the command writes); None for any
    other error."""
    if not isinstance(error, OSError) or error.errno not in FILE_SYSTEM:
        return None
    where = error.filename if error.filename is not None else path
    cause = f"{error.strerror} [{errno.errorcode.get(error.errno, error.errno)}]"
    if error.errno in FULL_DISK:
        hint = full_disk_hint(folders)
    elif error.errno in (errno.ENOTDIR, errno.EISDIR):
        hint = (
            "a file stands where a folder should be, or the other way round: check the "
            "paths given"
        )
    else:
        hint = f"make it writable or point {folders} elsewhere"
    return DataError(
        f"{'writing failed' if error.errno in FULL_DISK else 'cannot use it'}: " f"{cause}; {hint}",
        where,
    )
