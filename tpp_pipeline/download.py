"""Resumable, checked downloads.

A file is fetched into ``<name>.part``; an interrupted download continues from the
bytes already there (HTTP ``Range``). It is accepted only when its size equals the
size the server announced, its SHA-256 matches a known value (where one is given), and
it opens as a complete archive (gzip/tar checksums are read through). Only then is it
renamed to ``<name>`` and a ``<name>.sha256`` record written, so later runs do not
check it again.
"""

import hashlib
import logging
import os
import tarfile
import time
import urllib.error
import urllib.request

from .errors import DataError

log = logging.getLogger("tpp_pipeline")
_BLOCK = 1 << 20


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def check_archive(path):
    """Read an archive through to the end, so truncation or corruption is detected."""
    try:
        with tarfile.open(path) as archive:
            for member in archive:
                if member.isfile():
                    handle = archive.extractfile(member)
                    while handle.read(_BLOCK):
                        pass
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(
            f"archive is damaged or incomplete ({exc}); delete it and download " "it again", path
        ) from None


def _remote_size(response, offset):
    if response.status == 206:  # partial content: "bytes start-end/total"
        total = response.headers.get("Content-Range", "").rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = response.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


def download(url, dest, sha256=None, retries=5, timeout=60):
    """Fetch ``url`` to ``dest`` (resuming, verifying); skip if already verified."""
    record = dest + ".sha256"
    if os.path.exists(dest) and os.path.exists(record):
        log.info("%s already downloaded", dest)
        return dest
    part = dest + ".part"
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    total = None
    for attempt in range(1, retries + 1):
        offset = os.path.getsize(part) if os.path.exists(part) else 0
        request = urllib.request.Request(
            url, headers={"Range": f"bytes={offset}-"} if offset else {}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                if offset and response.status != 206:
                    offset = 0  # server ignores ranges: start over
                total = _remote_size(response, offset) or total
                log.info("downloading %s (%s bytes, from byte %d)", url, total, offset)
                with open(part, "ab" if offset else "wb") as out:
                    for block in iter(lambda: response.read(_BLOCK), b""):
                        out.write(block)
            if total is None or os.path.getsize(part) == total:
                break
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and total is None:  # range past the end: file is complete
                break
            log.warning("download of %s failed (%s), attempt %d/%d", url, exc, attempt, retries)
        except (urllib.error.URLError, OSError) as exc:
            log.warning("download of %s failed (%s), attempt %d/%d", url, exc, attempt, retries)
        time.sleep(min(60, 2**attempt))
    else:
        raise DataError(
            f"could not download {url} after {retries} attempts; the partial "
            "file is kept and the next run resumes it",
            part,
        )
    size = os.path.getsize(part)
    if total is not None and size != total:
        raise DataError(f"downloaded {size} bytes, the server announced {total}", part)
    digest = sha256_of(part)
    if sha256 and digest != sha256:
        raise DataError(f"SHA-256 {digest} does not match the expected {sha256}", part)
    if part.endswith((".tgz.part", ".tar.part", ".tar.gz.part")):
        check_archive(part)
    os.replace(part, dest)
    with open(record, "w", encoding="utf-8") as handle:
        handle.write(f"{digest}  {os.path.basename(dest)}\n")
    return dest
