"""A data-parallel rank leaves its process group once fairseq's ``distributed_main`` has
finished (tpp_fairseq.fixes), as PyTorch asks of every process; fairseq never destroys
it. Through fairseq's own ``call_main``, as ``fairseq-train`` under torchrun calls it, on
a gloo group of one."""

import socket
import subprocess
import sys

import pytest
from support import REPO

PROBE = r"""
import sys
import torch.distributed as dist
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
if sys.argv[1] == "plugin":
    import tpp_plugin  # noqa: F401

args = options.parse_args_and_arch(options.get_training_parser(), [
    "unused-data", "--arch", "transformer", "--cpu", "--distributed-backend", "gloo",
    "--distributed-world-size", "1", "--distributed-rank", "0", "--distributed-no-spawn",
    "--distributed-init-method", "tcp://127.0.0.1:" + sys.argv[2]])
cfg = convert_namespace_to_omegaconf(args)
inside = []

def main(cfg):
    inside.append(dist.is_initialized())
    if sys.argv[3] == "fails":
        raise RuntimeError("the training failed")

try:
    distributed_utils.call_main(cfg, main)
except RuntimeError:
    pass
print(inside, dist.is_initialized())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "plugin, outcome, expected",
    [
        ("plugin", "succeeds", "[True] False"),  # left once fairseq is done
        ("plugin", "fails", "[True] True"),  # after an error: as fairseq leaves it
        ("fairseq", "succeeds", "[True] True"),  # fairseq alone never leaves it
    ],
)
def test_a_rank_leaves_its_process_group_when_fairseq_is_done(plugin, outcome, expected):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, plugin, str(free_port()), outcome],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == expected
