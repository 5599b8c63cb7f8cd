"""Downloads of the WMT'14 archives and the checks on them, against a local HTTP server
(127.0.0.1, in a thread of the test) that answers each request as a test scripts it."""

import errno
import http.server
import io
import os
import socket
import subprocess
import sys
import tarfile
import threading

import pytest

from support import tool_env
from tpp_pipeline import download, wmt14
from tpp_pipeline.errors import DataError

CONTENT = {"dev/a.txt": "hello\n" * 5000, "dev/b.txt": "world\n" * 5000}


def _tgz(path, members):
    with tarfile.open(path, "w:gz") as archive:
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _damaged(path, how):
    """``path`` with its gzip trailer (CRC-32, then length) bit-flipped or cut off."""
    data = path.read_bytes()
    if how == "flip":
        data = data[:-8] + bytes([data[-8] ^ 1]) + data[-7:]
    else:
        data = data[:-4]
    path.write_bytes(data)
    return path


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers with the next of ``server.actions`` (then "ok"): "ok" serves the file
    (honouring ``Range``), a number is that HTTP status, "garbage" is no HTTP at all,
    "chunked-cut" a chunked body that breaks off, "cut" half the announced body."""

    def do_GET(self):
        server = self.server
        server.requests.append(self.headers.get("Range"))
        action = server.actions.pop(0) if server.actions else "ok"
        body = server.body
        if isinstance(action, int):
            self.send_error(action)
        elif action == "garbage":
            self.wfile.write(b"this is not HTTP\r\n\r\n")
        elif action == "chunked-cut":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"5\r\nhello\r\n")
        elif action == "cut":
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
        else:
            start = int(self.headers["Range"][6:-1]) if self.headers.get("Range") else 0
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            self.wfile.write(body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    """A local server of one archive at any path; ``.actions``, ``.requests``, ``.url``."""
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    httpd.body = _tgz(tmp_path / "served.tgz", CONTENT).read_bytes()
    httpd.actions, httpd.requests = [], []
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/dev.tgz"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def no_wait(monkeypatch):
    monkeypatch.setattr(download.time, "sleep", lambda seconds: None)


def _closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ----------------------------------------------------------------------- archive checks


@pytest.mark.parametrize("how", ["flip", "cut"])
def test_a_damaged_gzip_trailer_is_detected(tmp_path, how):
    """tarfile stops at the end-of-archive block, before the gzip trailer."""
    good = _tgz(tmp_path / "good.tgz", CONTENT)
    download.check_archive(good)
    bad = _damaged(_tgz(tmp_path / "bad.tgz", CONTENT), how)
    with pytest.raises(DataError, match="damaged or incomplete") as info:
        download.check_archive(bad)
    assert info.value.path == bad


@pytest.mark.parametrize("how", ["flip", "cut"])
def test_archives_given_with_raw_dir_have_their_gzip_trailer_checked(tmp_path, how):
    """--raw-dir archives are not downloaded (so not checked): extraction reads them
    through to the end, after the members it wants."""
    names = ["dev/a.txt", "dev/b.txt"]
    parts = {n: str(tmp_path / os.path.basename(n)) for n in names}
    good = _tgz(tmp_path / "good.tgz", CONTENT)
    assert wmt14._extract_parallel_members(str(good), names, parts, "strict") == {
        "dev/a.txt": 5000,
        "dev/b.txt": 5000,
    }
    assert set(wmt14._read_members(str(good), names)) == set(names)
    bad = str(_damaged(_tgz(tmp_path / "bad.tgz", CONTENT), how))
    with pytest.raises(DataError, match="cannot read archive"):
        wmt14._extract_parallel_members(bad, names, parts, "strict")
    with pytest.raises(DataError, match="cannot read archive"):
        wmt14._read_members(bad, names[:1])


# ---------------------------------------------------------------------------- downloads


def test_transient_failures_are_retried_and_the_download_resumes(server, tmp_path, no_wait):
    server.actions = [503, "garbage", "chunked-cut", "cut"]
    dest = str(tmp_path / "orig" / "dev.tgz")
    assert download.download(server.url, dest, retries=5) == dest
    assert open(dest, "rb").read() == server.body
    assert open(dest + ".sha256").read().split()[0] == download.sha256_of(dest)
    assert not os.path.exists(dest + ".part")
    assert len(server.requests) == 5
    assert server.requests[-1] == f"bytes={len(server.body) // 2}-"  # resumed after "cut"


@pytest.mark.parametrize("status", [404, 403, 410])
def test_a_permanent_http_error_is_not_retried_and_is_named(server, tmp_path, no_wait, status):
    server.actions = [status]
    dest = str(tmp_path / "dev.tgz")
    with pytest.raises(DataError) as info:
        download.download(server.url, dest, retries=5)
    assert len(server.requests) == 1
    assert f"HTTP Error {status}" in str(info.value) and server.url in str(info.value)
    assert "partial" not in str(info.value) and not os.path.exists(dest)


def test_a_local_disk_error_is_raised_at_once_not_retried(server, tmp_path, no_wait):
    """A full disk (writes to the partial file go to /dev/full) is no network failure."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    dest = str(tmp_path / "dev.tgz")
    os.symlink("/dev/full", dest + ".part")
    with pytest.raises(OSError) as info:
        download.download(server.url, dest, retries=5)
    assert info.value.errno == errno.ENOSPC and info.value.filename == dest + ".part"
    assert len(server.requests) == 1 and not os.path.exists(dest)


def test_an_unreachable_server_is_reported_with_the_last_error(tmp_path, no_wait):
    dest = str(tmp_path / "dev.tgz")
    url = f"http://127.0.0.1:{_closed_port()}/dev.tgz"
    with pytest.raises(DataError) as info:
        download.download(url, dest, retries=2, hint="try --raw-dir")
    message = str(info.value)
    assert "after 2 attempts" in message and "Connection refused" in message
    assert message.endswith("; try --raw-dir")
    assert "partial" not in message and not os.path.exists(dest + ".part")


def test_a_kept_partial_file_is_mentioned_when_there_is_one(server, tmp_path, no_wait):
    server.actions = ["cut", 503, 503]
    dest = str(tmp_path / "dev.tgz")
    with pytest.raises(DataError) as info:
        download.download(server.url, dest, retries=3)
    half = len(server.body) // 2
    assert os.path.getsize(dest + ".part") == half
    assert f"the partial file {dest}.part ({half} bytes) is kept" in str(info.value)
    assert "HTTP Error 503" in str(info.value)


def test_an_archive_there_without_its_record_is_checked_and_kept(server, tmp_path, no_wait):
    """Copied by hand, or a kill between the rename and the record: no new download."""
    dest = tmp_path / "dev.tgz"
    _tgz(dest, {"dev/a.txt": "my own copy\n"})
    before = dest.read_bytes()
    assert download.download(server.url, str(dest)) == str(dest)
    assert server.requests == [] and dest.read_bytes() == before
    assert (tmp_path / "dev.tgz.sha256").read_text().split() == [
        download.sha256_of(dest),
        "dev.tgz",
    ]
    assert not (tmp_path / "dev.tgz.sha256.tmp").exists()


def test_a_damaged_archive_there_without_its_record_is_an_error_not_replaced(
    server, tmp_path, no_wait
):
    dest = _damaged(_tgz(tmp_path / "dev.tgz", CONTENT), "flip")
    before = dest.read_bytes()
    with pytest.raises(DataError, match="damaged or incomplete"):
        download.download(server.url, str(dest))
    assert server.requests == [] and dest.read_bytes() == before
    assert not (tmp_path / "dev.tgz.sha256").exists()


# ---------------------------------------------------------------- tpp-prepare-wmt14


def _prepare_wmt14(base_url, *args):
    """tpp-prepare-wmt14 with the archives' URLs under ``base_url`` and no waits between
    attempts; returns the CompletedProcess."""
    script = (
        "import sys\n"
        "from tpp_pipeline import download, wmt14\n"
        f"wmt14.ARCHIVE_URLS = {{n: {base_url!r} + n for n in wmt14.ARCHIVE_URLS}}\n"
        "download.time.sleep = lambda seconds: None\n"
        "sys.exit(wmt14.main(sys.argv[1:]))\n"
    )
    command = [sys.executable, "-c", script, "--pair", "en-de", "--quiet", *map(str, args)]
    return subprocess.run(
        command, capture_output=True, text=True, env=tool_env(), timeout=300, check=False
    )


def test_offline_wmt14_says_what_failed_and_points_to_raw_dir(tmp_path):
    result = _prepare_wmt14(f"http://127.0.0.1:{_closed_port()}/", "--work-dir", tmp_path / "w")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "Connection refused" in result.stderr
    assert "--raw-dir (see --list-files)" in result.stderr
    assert "partial" not in result.stderr


def test_a_download_dir_that_is_a_file_is_a_clear_error(server, tmp_path):
    (tmp_path / "orig").write_text("not a folder")
    result = _prepare_wmt14(
        server.url.rpartition("/")[0] + "/",
        "--work-dir",
        tmp_path / "w",
        "--download-dir",
        tmp_path / "orig",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--download-dir folder" in result.stderr and str(tmp_path / "orig") in result.stderr
    assert server.requests == []


def test_a_tag_shard_before_extraction_is_refused_before_downloading(server, tmp_path):
    """Shards run at once and would race on the same partial and temporary files."""
    work = tmp_path / "w"
    result = _prepare_wmt14(
        server.url.rpartition("/")[0] + "/", "--work-dir", work, "--tag-shard", "0/2"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "step 'extract' is not done yet" in result.stderr
    assert "--stop-after preclean" in result.stderr
    assert server.requests == [] and not (work / "orig").exists() and not (work / "raw").exists()


@pytest.mark.parametrize("errors", ["strict", "replace"])
def test_bad_utf8_in_a_test_set_is_named_or_replaced(tmp_path, errors):
    def sgm(text):
        return f'<srcset setid="x" srclang="any">\n<seg id="1"> {text} </seg>\n</srcset>\n'

    (tmp_path / "raw").mkdir()
    for archive, pattern in wmt14.TEST_SETS.values():
        members = {
            wmt14._sgm_name(pattern, "en-de", side, lang): sgm("ok")
            for side, lang in (("src", "en"), ("ref", "de"))
        }
        _tgz(tmp_path / "raw" / archive, members)
    src = "dev/newstest2013-src.en.sgm"
    with tarfile.open(tmp_path / "raw" / "dev.tgz", "w:gz") as archive:
        for name, data in (
            (src, b'<srcset>\n<seg id="1"> caf\xe9 </seg>\n</srcset>\n'),
            ("dev/newstest2013-ref.de.sgm", sgm("Kaffee").encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    if errors == "strict":
        with pytest.raises(DataError) as info:
            wmt14.extract_test_sets("en-de", str(tmp_path / "raw"), str(out), errors)
        assert str(info.value).startswith(f"{tmp_path / 'raw' / 'dev.tgz'}:{src}:2: invalid UTF-8")
    else:
        wmt14.extract_test_sets("en-de", str(tmp_path / "raw"), str(out), errors)
        assert (out / "valid.en").read_text(encoding="utf-8") == "caf\ufffd\n"
