"""fairseq switches the root logger to DEBUG when it is imported (outside its own
commands); the plugin puts it back to $LOGLEVEL, default INFO."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import logging, {module}, matplotlib.pyplot; log = logging.getLogger('probe'); "
    "log.debug('probe-debug'); log.info('probe-info')"
)


def _stderr(module: str, code: str = PROBE, **env) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"}
    environment.update(env, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    done = subprocess.run(
        [sys.executable, "-c", code.format(module=module)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_fairseq_alone_leaves_debug_logging_on():
    """Why the correction exists (fails the day fairseq stops doing it)."""
    assert "probe-debug" in _stderr("fairseq")


@pytest.mark.parametrize(
    "loglevel, shown, hidden",
    [
        (None, ["probe-info"], ["probe-debug", "DEBUG"]),
        ("WARNING", [], ["probe-info", "probe-debug"]),
        ("DEBUG", ["probe-info", "probe-debug"], []),
    ],
)
def test_plugin_import_puts_the_root_level_back_to_loglevel(loglevel, shown, hidden):
    err = _stderr("fairseq, tpp_plugin", **({"LOGLEVEL": loglevel} if loglevel else {}))
    assert all(text in err for text in shown), err
    assert not any(text in err for text in hidden), err


@pytest.mark.parametrize(
    "first, shown",
    [
        ("", True),  # the program chose DEBUG before the plugin loaded fairseq
        ("import fairseq; ", False),  # fairseq first: not distinguishable, $LOGLEVEL (INFO) decides
    ],
)
def test_a_debug_level_the_program_chose_itself_is_kept(first, shown):
    code = (
        "import logging; logging.basicConfig(level=logging.DEBUG); {module}"
        "import tpp_plugin; logging.getLogger('probe').debug('probe-debug')"
    )
    err = _stderr(first, code)
    assert ("probe-debug" in err) is shown, err
