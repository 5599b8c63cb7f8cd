"""One line, not a traceback, for a write the disk refuses (issue 49.5), whichever error
the writer raised on top of it; other errors keep their traceback."""

import errno
import subprocess
import sys
from pathlib import Path

from tpp_fairseq import errors

ROOT = Path(__file__).resolve().parents[2]


def raised(function, *args):
    try:
        function(*args)
    except BaseException as error:  # noqa: BLE001 - the error is what the test looks at
        return error
    raise AssertionError("nothing was raised")


def torch_persistent_save(obj, filename):
    """Named as fairseq's writer is: a disk error raised inside it names its checkpoint."""
    with open(filename + ".tmp", "wb") as handle:
        handle.write(b"PK")
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")


def test_a_full_disk_under_another_error_names_the_checkpoint_and_removes_its_partial_file(
    tmp_path,
):
    checkpoint = str(tmp_path / "checkpoint_3_300.pt")
    error = raised(torch_persistent_save, {}, checkpoint)
    assert errors.disk_error(error) == (
        f"No space left on device writing {checkpoint} (its partial checkpoint_3_300.pt.tmp "
        "removed); free space and run the same command again"
    )
    assert not Path(checkpoint + ".tmp").exists()


def test_a_partial_file_that_cannot_be_removed_is_named_not_raised(tmp_path):
    """The hook must not fail itself: a partial checkpoint it cannot remove (here a
    folder stands at its name) is said to be left."""

    def torch_persistent_save(obj, filename):
        raise OSError(errno.ENOSPC, "No space left on device")

    checkpoint = str(tmp_path / "checkpoint_last.pt")
    Path(checkpoint + ".tmp").mkdir()
    assert errors.disk_error(raised(torch_persistent_save, {}, checkpoint)) == (
        f"No space left on device writing {checkpoint} (its partial checkpoint_last.pt.tmp "
        "left: Is a directory); free space and run the same command again"
    )


def test_a_read_only_folder_says_so():
    def write():
        raise OSError(errno.EROFS, "Read-only file system", "/results/bleu.txt")

    assert errors.disk_error(raised(write)) == (
        "Read-only file system writing /results/bleu.txt; make the folder writable or write "
        "elsewhere and run the same command again"
    )


def test_other_errors_are_not_disk_errors():
    assert errors.disk_error(raised(open, "/nonexistent/folder/file")) is None
    assert errors.disk_error(raised(int, "x")) is None


def raised_at_the_top(error: str):
    """A process with the plugin's hook installed that raises ``error`` (an expression)."""
    code = (
        "import errno, sys; from tpp_fairseq import errors; errors.install_excepthook(); "
        f"sys.argv[0] = 'probe'; raise {error}"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_hook_prints_one_line_for_a_disk_error_and_a_traceback_for_others():
    full = raised_at_the_top("OSError(errno.EDQUOT, 'Disk quota exceeded')")
    assert full.returncode == 1
    assert full.stderr.splitlines()[-1] == (
        "probe: error: Disk quota exceeded; free space and run the same command again"
    )
    assert "Traceback" not in full.stderr
    other = raised_at_the_top("KeyError('x')")
    assert other.returncode == 1 and "Traceback" in other.stderr and "KeyError" in other.stderr


def test_a_users_error_goes_to_the_log_file_and_a_log_that_cannot_be_written_is_passed_over(
    tmp_path, capsys
):
    """The one line is also in fairseq's --log-file; a log on a full disk prints no
    "--- Logging error ---" traceback after it."""
    import logging

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    logger = logging.getLogger("tpp_test_log_file")
    written = logging.FileHandler(tmp_path / "train.log")
    full = logging.FileHandler(tmp_path / "full.log")
    full.stream.close()
    full.stream = Full()
    for handler in (written, full):
        logger.addHandler(handler)
    try:
        errors.log_to_files("error: data.bin line 3: broken")
    finally:
        for handler in (written, full):
            logger.removeHandler(handler)
        written.close()
    assert "error: data.bin line 3: broken" in (tmp_path / "train.log").read_text()
    assert capsys.readouterr().err == ""
    assert logging.raiseExceptions
