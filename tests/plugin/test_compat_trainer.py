"""fairseq's trainer computes the smoothed values of its meters (a read from the device
per meter) only on the updates that fairseq-train logs (the ``logged-smoothing`` speed-up
of tpp_plugin.compat.speed): a real fairseq-train run logs the same values with and
without it."""

import json
import os
import subprocess
import sys

import pytest

from support import PLUGIN_DIR, REPO, binarize_tagged, tool_env

#: fairseq-train (with or without the speed-up: TPP_FAIRSEQ_SPEEDUPS), counting the calls
#: of MetersDict.get_smoothed_values inside each update (into $TPP_COUNTS)
DRIVER = """
import atexit, json, os, sys
import tpp_plugin
from fairseq.logging.meters import MetersDict
from fairseq.trainer import Trainer
counts, active = {}, []
get_smoothed_values = MetersDict.get_smoothed_values
def counting_get_smoothed_values(self):
    if active:
        active[-1] += 1
    return get_smoothed_values(self)
MetersDict.get_smoothed_values = counting_get_smoothed_values
train_step = Trainer.train_step
def counting_train_step(self, *args, **kwargs):
    active.append(0)
    try:
        return train_step(self, *args, **kwargs)
    finally:
        counts[self.get_num_updates()] = active.pop()
Trainer.train_step = counting_train_step
atexit.register(lambda: open(os.environ["TPP_COUNTS"], "w").write(json.dumps(counts)))
from fairseq_cli.train import cli_main
sys.argv[0] = "fairseq-train"
cli_main()
"""

FLAGS = [
    "--user-dir",
    PLUGIN_DIR,
    "--arch",
    "transformer_pp_tiny",
    "--task",
    "translation_with_tags",
    "--criterion",
    "label_smoothed_cross_entropy_with_tags",
    "--label-smoothing",
    "0.1",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--clip-norm",
    "0.5",
    "--max-tokens",
    "400",
    "--share-all-embeddings",
    "--dropout",
    "0.1",
    "--log-format",
    "json",
    "--log-interval",
    "4",
    "--cpu",
    "--seed",
    "1",
    "--num-workers",
    "0",
    "--no-progress-bar",
    "--no-save",
    "--max-update",
    "14",
    "--validate-interval-updates",
    "6",
]
#: timings, which differ between any two runs
TIMES = ("wps", "ups", "wall")


def records(log_path):
    """fairseq's JSON log lines, without the timings."""
    out = []
    for line in log_path.read_text().splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the configuration dump
                continue
            out.append({k: v for k, v in record.items() if not k.endswith(TIMES)})
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("logged")
    return binarize_tagged(root / "text", root / "data-bin", n_train=60)


def train(data, folder, unpatched):
    folder.mkdir()
    log, counts = folder / "train.log", folder / "counts.json"
    env = dict(
        tool_env(),
        TPP_FAIRSEQ_SPEEDUPS="none" if unpatched else "logged-smoothing",
        TPP_COUNTS=str(counts),
    )
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(data), *map(str, FLAGS), "--log-file", str(log)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return records(log), {int(k): v for k, v in json.loads(counts.read_text()).items()}


def test_smoothed_values_are_computed_only_for_logged_updates_and_log_the_same(data, tmp_path):
    theirs, their_counts = train(data, tmp_path / "fairseq", unpatched=True)
    ours, our_counts = train(data, tmp_path / "plugin", unpatched=False)
    assert sorted(our_counts) == sorted(their_counts) == list(range(1, 15))
    assert all(n == 1 for n in their_counts.values())  # fairseq: at every update
    assert our_counts == {u: int(u % 4 == 0) for u in range(1, 15)}
    # several epochs (end-of-epoch "train" records), validations, logged updates
    unique = [
        r for i, r in enumerate(theirs) if r not in theirs[:i]
    ]  # fairseq repeats lines in --log-file
    kinds = [
        next((k for k in ("train_loss", "valid_loss", "loss") if k in r), None) for r in unique
    ]
    assert (
        kinds.count("loss") == 3
        and kinds.count("valid_loss") >= 2
        and kinds.count("train_loss") >= 2
    )
    assert all(
        key in r for r in theirs if "loss" in r for key in ("pos_loss", "ner_acc", "clip", "gnorm")
    )
    assert ours == theirs


#: a fresh process: the cuDNN flag before and after loading the plugin, and which of the
#: patched fairseq methods are the plugin's
PROBE = """
import torch
before = torch.backends.cuda.cudnn_sdp_enabled()
import tpp_plugin
from tpp_plugin.compat import speed
from fairseq.optim.fp16_optimizer import FP16Optimizer
from fairseq.trainer import Trainer
installed = {"cudnn-off": not torch.backends.cuda.cudnn_sdp_enabled(),
             "flat-bf16": FP16Optimizer.load_state_dict is speed.load_state_dict,
             "foreach-syncs": FP16Optimizer._sync_fp32_params_to_fp16 is speed.sync_fp32_params_to_fp16,
             "logged-smoothing": Trainer.train_step is speed.train_step}
print(before, sorted(k for k, v in installed.items() if v))
"""


@pytest.mark.parametrize(
    "setting, expected",
    [
        (None, ["cudnn-off", "flat-bf16"]),
        ("all", ["cudnn-off", "flat-bf16", "foreach-syncs", "logged-smoothing"]),
        ("none", []),
        ("flat-bf16", ["flat-bf16"]),
        ("foreach-syncs, cudnn-off", ["cudnn-off", "foreach-syncs"]),
    ],
)
def test_speedups_are_those_named_and_by_default_those_measured(setting, expected):
    """TPP_FAIRSEQ_SPEEDUPS chooses the speed-ups; the default is those a GPU figure shows
    to pay (cuDNN's attention off, the flat bf16 master copy), for every architecture:
    PyTorch's cuDNN attention backend is on in a fresh process and off once the plugin is
    loaded."""
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
    assert done.stdout.strip() == f"True {expected}"


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
