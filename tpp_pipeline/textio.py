"""Reading and writing the pipeline's line-oriented text files.

Two rules hold for every file the pipeline touches:

* input is decoded line by line as strict UTF-8, so a bad byte is reported with its
  file and line number instead of surfacing later as a mangled token;
* output is written under a temporary name and renamed into place only when complete,
  so an interrupted run never leaves a truncated file that looks finished.
"""

import contextlib
import os
import tempfile

from .errors import DataError

TMP_SUFFIX = ".tmp"


def iter_lines(path, utf8_errors="strict"):
    """Yield ``(line_number, text)`` for each line of ``path`` (1-based numbers).

    Lines are split on ``\\n`` only (a stray ``\\r`` inside a line is kept for the
    normaliser to remove; a Windows ``\\r\\n`` ending is dropped). ``utf8_errors`` is
    ``"strict"`` (raise :class:`DataError` naming the line) or ``"replace"``.
    """
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.endswith(b"\n"):
                raw = raw[:-1]
            if raw.endswith(b"\r"):
                raw = raw[:-1]
            try:
                yield number, raw.decode("utf-8", errors=utf8_errors)
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"invalid UTF-8 byte {raw[exc.start:exc.start + 1]!r} at column "
                    f"{exc.start + 1} (pass --utf8-errors replace to substitute U+FFFD)",
                    path,
                    number,
                ) from None


def read_lines(path, utf8_errors="strict"):
    """Return all lines of ``path`` as a list of strings (see :func:`iter_lines`)."""
    return [text for _, text in iter_lines(path, utf8_errors)]


def count_lines(path):
    """Number of lines in ``path`` (a last line without newline counts)."""
    count = 0
    last = b"\n"
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (0 if last == b"\n" else 1)


def temp_name(path):
    """The name a file is written under before it is complete."""
    return str(path) + TMP_SUFFIX


def ensure_writable_dir(path, what):
    """Create folder ``path`` if needed and check that a file can be created in it, so
    that an output that cannot be written is an error before the long steps, not after.
    ``what`` names the folder in the error (e.g. "--data-bin folder")."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DataError(f"is a file, not a folder: choose a {what} you can write to", path)
    try:
        os.makedirs(path, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        where = f": {error.filename}" if error.filename and str(error.filename) != str(path) else ""
        raise DataError(
            f"cannot create or write into this {what} ({error.strerror}{where}); "
            f"choose a {what} you can write to",
            path,
        ) from None


def _name_the_file(error, where):
    """Raise ``error`` again naming ``where`` if it is an ``OSError`` that names no file
    (a failed write, e.g. on a full disk, does not), for the error message."""
    if isinstance(error, OSError) and error.filename is None and where is not None:
        raise OSError(error.errno, error.strerror, str(where)) from None


def _discard(handles, paths):
    """Close ``handles`` and remove the temporary files of ``paths``, even where closing
    fails (flushing onto a full disk does), so that no ``.tmp`` file is left behind."""
    for handle in handles:
        with contextlib.suppress(OSError):
            handle.close()
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp_name(path))


@contextlib.contextmanager
def atomic_open(path, mode="w"):
    """Open ``path`` for writing under a temporary name; rename on success.

    On an exception the temporary file is removed and ``path`` is left untouched; an
    ``OSError`` of a failed write (a full disk) is raised naming ``path``.
    """
    tmp = temp_name(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    kwargs = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
    handle = open(tmp, mode, **kwargs)
    try:
        yield handle
        handle.close()
        os.replace(tmp, path)
    except BaseException as error:
        _discard([handle], [path])
        _name_the_file(error, path)
        raise


@contextlib.contextmanager
def atomic_files(paths):
    """Like :func:`atomic_open` for several text files that only make sense together.

    All files are renamed into place only after every one of them is complete.
    """
    paths = list(paths)
    handles = []
    closing = None
    try:
        for path in paths:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            handles.append(open(temp_name(path), "w", encoding="utf-8", newline="\n"))
        yield handles
        for path, handle in zip(paths, handles):
            closing = path
            handle.close()
        for path in paths:
            os.replace(temp_name(path), path)
    except BaseException as error:
        _discard(handles, paths)
        # the file being closed, else (a write to one of them) their folder
        _name_the_file(
            error, closing or (os.path.dirname(os.path.abspath(paths[0])) if paths else None)
        )
        raise


def check_line_breaks(path, window=1 << 16):
    """Raise :class:`DataError` where ``path`` breaks its lines by carriage returns alone
    (old Mac files): read as one line, its pairs would be one sentence pair, aligned with
    the other side's one, and so pass every count."""
    with open(path, "rb") as handle:
        head = handle.read(window)
    if b"\n" not in head and head.count(b"\r") >= 2:
        raise DataError(
            "ends its lines with a carriage return alone (\\r, old Mac line endings), which "
            "is no line break here: convert it first, e.g. with tr '\\r' '\\n'",
            path,
        )


def check_same_line_count(paths):
    """Raise :class:`DataError` unless all ``paths`` have the same number of lines (and
    break them with ``\\n``: :func:`check_line_breaks`)."""
    for path in paths:
        check_line_breaks(path)
    counts = {str(path): count_lines(path) for path in paths}
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{path} has {n}" for path, n in counts.items())
        first = min(counts.values())
        short = [p for p, n in counts.items() if n == first][0]
        raise DataError(
            f"parallel files differ in length ({detail}); "
            f"the shorter one ends after line {first}",
            short,
        )
    return next(iter(counts.values())) if counts else 0
