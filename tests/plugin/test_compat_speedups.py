"""The speed-ups of tpp_fairseq.speed that loading the plugin installs: those
``TPP_FAIRSEQ_SPEEDUPS`` names, by default the two a GPU has measured, each checked in a
fresh process."""

import os
import subprocess
import sys

import pytest

from support import REPO

#: a fresh process: the cuDNN flag before and after loading the plugin, and which of the
#: patched fairseq methods are the plugin's
PROBE = """
import torch
before = torch.backends.cuda.cudnn_sdp_enabled()
import tpp_plugin
from tpp_fairseq import speed
from fairseq.optim.fp16_optimizer import FP16Optimizer
installed = {"cudnn-off": not torch.backends.cuda.cudnn_sdp_enabled(),
             "flat-bf16": FP16Optimizer.build_optimizer.__func__ is speed.build_optimizer,
             "multi-tensor-sync": FP16Optimizer._sync_fp32_params_to_fp16 is speed.sync_params}
converting = FP16Optimizer.load_state_dict is speed.load_state_dict
print(before, converting, sorted(k for k, v in installed.items() if v))
"""


@pytest.mark.parametrize(
    "setting, expected",
    [
        (None, ["cudnn-off", "flat-bf16"]),
        ("all", ["cudnn-off", "flat-bf16", "multi-tensor-sync"]),
        ("flat-bf16,multi-tensor-sync", ["flat-bf16", "multi-tensor-sync"]),
        ("none", []),
        ("flat-bf16", ["flat-bf16"]),
        (" cudnn-off ,", ["cudnn-off"]),
    ],
)
def test_speedups_are_those_named_and_by_default_those_measured(setting, expected):
    """TPP_FAIRSEQ_SPEEDUPS chooses the speed-ups; the default is those a GPU figure shows
    to pay (cuDNN's attention off, the flat bf16 master copy), for every architecture:
    PyTorch's cuDNN attention backend is on in a fresh process and off once the plugin is
    loaded. Optimizer states of either layout load whatever the speed-ups (a correction)."""
    env = {k: v for k, v in os.environ.items() if k != "TPP_FAIRSEQ_SPEEDUPS"}
    if setting is not None:
        env["TPP_FAIRSEQ_SPEEDUPS"] = setting
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"True True {expected}"


def test_an_unknown_speedup_is_an_error_naming_the_variable():
    env = dict(os.environ, TPP_FAIRSEQ_SPEEDUPS="flat-bf16,warp-drive", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", "import tpp_plugin"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert (
        "TPP_FAIRSEQ_SPEEDUPS='flat-bf16,warp-drive': unknown warp-drive; the speed-ups are"
        in done.stderr
    )
