"""Resumable, checked downloads.

A file is fetched into ``<name>.part``; an interrupted download continues from the
bytes already there (HTTP ``Range``). It is accepted only when its size equals the
size the server announced, its SHA-256 matches a known value (where one is given), and
it opens as a complete archive (gzip/tar checksums are read through). Only then is it
renamed to ``<name>`` and a ``<name>.sha256`` record written, so later runs do not
check it again. A file already at ``<name>`` without its record (copied there by hand)
is checked the same way and kept.

Only failures a later attempt may not meet are retried: the network, time-outs and the
server's own errors (5xx, 408, 429). A refusal (404, 403, ...) is an error at once; an
error of the local disk is raised as it is (``OSError``), for the command to report.
"""

import contextlib
import gzip
import hashlib
import http.client
import logging
import os
import tarfile
import time
import urllib.error
import urllib.request
import zlib

from .errors import DataError
from .textio import atomic_open

log = logging.getLogger("tpp_pipeline")
_BLOCK = 1 << 20
_ARCHIVE_SUFFIXES = (".tgz", ".tar", ".tar.gz")


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


# What reading a damaged archive raises (gzip.BadGzipFile is an OSError without errno).
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)


@contextlib.contextmanager
def open_tar_stream(path):
    """``path`` as a tar archive read front to back (``tarfile`` stream mode, no seeking).

    Leaving the block without an error reads the rest of the file: only at the end of a
    gzip stream are its CRC-32 and length checked, and the tar reader stops before it, at
    the end-of-archive block (or earlier, once the members wanted are read). Damage raises
    one of :data:`ARCHIVE_ERRORS`."""
    with open(path, "rb") as raw:
        compressed = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw
        with tarfile.open(fileobj=stream, mode="r|*") as archive:
            yield archive
        while stream.read(_BLOCK):
            pass


def check_archive(path):
    """Read an archive through to the end, so truncation or corruption is detected."""
    try:
        with open_tar_stream(path) as archive:
            for member in archive:
                if member.isfile():
                    handle = archive.extractfile(member)
                    while handle.read(_BLOCK):
                        pass
    except ARCHIVE_ERRORS as exc:
        raise DataError(
            f"archive is damaged or incomplete ({exc}); delete it and download it again", path
        ) from None


def _remote_size(response, offset):
    if response.status == 206:  # partial content: "bytes start-end/total"
        total = response.headers.get("Content-Range", "").rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = response.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


class _Retry(Exception):
    """A failure of the network or of the server that a later attempt may not meet."""


def _network(call):
    """``call()``, a request or a read of its response: a failure is raised as
    :class:`_Retry`, except an HTTP status that asking again does not change (404, ...)."""
    try:
        return call()
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code >= 500 or exc.code in (408, 429):
            raise _Retry(exc) from exc
        raise
    except (OSError, http.client.HTTPException) as exc:  # URLError, time-out, reset, ...
        raise _Retry(exc) from exc


def _verify(path, name, sha256):
    """SHA-256 of ``path`` (a download of ``name``), checked against ``sha256`` (if given)
    and, for an archive, by reading it through."""
    digest = sha256_of(path)
    if sha256 and digest != sha256:
        raise DataError(f"SHA-256 {digest} does not match the expected {sha256}", path)
    if name.endswith(_ARCHIVE_SUFFIXES):
        check_archive(path)
    return digest


def _write_record(dest, digest):
    with atomic_open(dest + ".sha256") as handle:
        handle.write(f"{digest}  {os.path.basename(dest)}\n")


def _kept(part):
    """What the error of a failed download says about the partial file, if there is one."""
    if not os.path.isfile(part) or not os.path.getsize(part):
        return ""
    size = os.path.getsize(part)
    return f"; the partial file {part} ({size} bytes) is kept and the next run resumes it"


def _write_part(part, offset, read):
    """Append the blocks ``read()`` returns to ``part`` (from its start if ``offset`` is
    0); an error of the disk (a failed write names no file) is raised naming ``part``."""
    try:
        with open(part, "ab" if offset else "wb") as out:
            for block in iter(read, b""):
                out.write(block)
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, part) from None
        raise


def download(url, dest, sha256=None, retries=5, timeout=60, hint=""):
    """Fetch ``url`` to ``dest`` (resuming, verifying); skip if already verified.

    ``hint`` ends the error of a download that failed (what else to do, e.g. offline)."""
    record = dest + ".sha256"
    if os.path.exists(dest):
        if not os.path.exists(record):
            log.info("%s is there without its record %s: checking it", dest, record)
            _write_record(dest, _verify(dest, dest, sha256))
        log.info("%s already downloaded", dest)
        return dest
    hint = f"; {hint}" if hint else ""
    part = dest + ".part"
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    total = None
    last_error = None
    for attempt in range(1, retries + 1):
        offset = os.path.getsize(part) if os.path.exists(part) else 0
        request = urllib.request.Request(
            url, headers={"Range": f"bytes={offset}-"} if offset else {}
        )
        try:
            with _network(lambda: urllib.request.urlopen(request, timeout=timeout)) as response:
                if offset and response.status != 206:
                    offset = 0  # server ignores ranges: start over
                total = _remote_size(response, offset) or total
                log.info("downloading %s (%s bytes, from byte %d)", url, total, offset)
                _write_part(part, offset, lambda: _network(lambda: response.read(_BLOCK)))
            size = os.path.getsize(part)
            if total is None or size == total:
                break
            last_error = f"the connection ended after {size} of {total} bytes"
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and total is None:  # range past the end: file is complete
                break
            raise DataError(f"could not download {url} ({exc}){_kept(part)}{hint}", dest) from None
        except _Retry as exc:
            last_error = exc.__cause__
        log.warning("download of %s failed (%s), attempt %d/%d", url, last_error, attempt, retries)
        if attempt < retries:
            time.sleep(min(60, 2**attempt))
    else:
        raise DataError(
            f"could not download {url} after {retries} attempts (last error: "
            f"{last_error}){_kept(part)}{hint}",
            dest,
        )
    size = os.path.getsize(part)
    if total is not None and size != total:
        raise DataError(f"downloaded {size} bytes, the server announced {total}", part)
    digest = _verify(part, dest, sha256)
    os.replace(part, dest)
    _write_record(dest, digest)
    return dest
