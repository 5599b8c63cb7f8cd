"""tpp-average-checkpoints: correct mean, checkpoint selection, errors, memory,
and refusing to average checkpoints of different models."""

import argparse
import contextlib
import io
import subprocess
import sys

import numpy as np
import pytest
import torch

from support import binarize, make_corpus, tool_env, train_command

import tpp_plugin  # noqa: F401  (allow-lists fairseq checkpoint contents for torch.load)
from tpp_tools import average as AVERAGE  # most cases run in-process: torch imports take seconds


def fake_checkpoint(path, seed, shapes=None, with_optimizer=True, num_updates=0):
    """A checkpoint laid out as fairseq writes them: model state, args, optimizer state."""
    generator = torch.Generator().manual_seed(seed)
    shapes = shapes or {"encoder.weight": (6, 4), "decoder.bias": (5,)}
    model = {name: torch.randn(*shape, generator=generator) for name, shape in shapes.items()}
    model["decoder.half"] = torch.randn(3, 3, generator=generator).half()
    model["encoder.version"] = torch.tensor([3], dtype=torch.int64) + seed
    state = {
        "model": model,
        "args": argparse.Namespace(arch="transformer_tiny", lr=[0.001]),
        "cfg": None,
        "optimizer_history": [
            {
                "criterion_name": "X",
                "optimizer_name": "Adam",
                "lr_scheduler_state": {"best": None},
                "num_updates": num_updates,
            }
        ],
        "extra_state": {"epoch": 1},
    }
    if with_optimizer:
        state["last_optimizer_state"] = {
            "state": {
                i: {
                    "exp_avg": torch.zeros_like(t, dtype=torch.float32),
                    "exp_avg_sq": torch.zeros_like(t, dtype=torch.float32),
                }
                for i, t in enumerate(model.values())
            }
        }
    torch.save(state, path)
    return path


def run_average(*args):
    """Run the script's main() with ``args``; returns (exit code, stderr text)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = AVERAGE.main([str(a) for a in args])
        except SystemExit as exit_:  # argparse usage errors
            code = exit_.code
    return subprocess.CompletedProcess(args, code, "", stderr.getvalue())


def test_command_line(tmp_path):
    """The console script runs it as a program, too (exit status, message on stderr)."""
    good = fake_checkpoint(tmp_path / "a.pt", seed=1)
    other = fake_checkpoint(tmp_path / "b.pt", seed=2)
    out = tmp_path / "avg.pt"
    command = ["tpp-average-checkpoints", "--inputs", str(good), str(other), "--output", str(out)]
    result = subprocess.run(command, env=tool_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert load(out)["averaged_checkpoints"] == ["a.pt", "b.pt"]
    result = subprocess.run(command, env=tool_env(), capture_output=True, text=True)
    assert result.returncode == 2 and "already exists" in result.stderr


def test_an_output_folder_that_cannot_be_written_is_an_error_before_averaging(tmp_path):
    good = fake_checkpoint(tmp_path / "a.pt", seed=1)
    (tmp_path / "taken").write_text("a file, not a folder\n")
    out = tmp_path / "taken" / "avg.pt"
    command = ["tpp-average-checkpoints", "--inputs", str(good), "--output", str(out)]
    result = subprocess.run(command, env=tool_env(), capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{tmp_path / 'taken'}: is a file, not a folder: choose a folder for --output" in (
        result.stderr
    )
    assert "averaging" not in result.stderr, "refused before the long part"


def test_an_output_that_is_a_folder_is_an_error_before_averaging(tmp_path):
    good = fake_checkpoint(tmp_path / "a.pt", seed=1)
    (tmp_path / "avg").mkdir()
    command = ["tpp-average-checkpoints", "--inputs", str(good), "--output", str(tmp_path / "avg")]
    result = subprocess.run([*command, "--force"], env=tool_env(), capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{tmp_path / 'avg'}: is a folder: --output names the averaged file" in result.stderr
    assert "averaging" not in result.stderr and (tmp_path / "avg").is_dir()


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_output_is_elementwise_mean_of_inputs(tmp_path):
    paths = [fake_checkpoint(tmp_path / f"c{i}.pt", seed=i, num_updates=10 * i) for i in range(3)]
    out = tmp_path / "avg.pt"
    result = run_average("--inputs", *paths, "--output", out)
    assert result.returncode == 0, result.stderr
    averaged = load(out)["model"]
    inputs = [load(p)["model"] for p in paths]
    for name in ("encoder.weight", "decoder.bias", "decoder.half"):
        expected = np.mean([m[name].double().numpy() for m in inputs], axis=0)
        assert averaged[name].dtype == inputs[0][name].dtype, name  # dtype kept
        tolerance = 1e-3 if averaged[name].dtype == torch.float16 else 1e-6
        np.testing.assert_allclose(averaged[name].double().numpy(), expected, atol=tolerance)
    # integer buffers are not averaged: the last input's value is kept
    assert averaged["encoder.version"].tolist() == [5]
    state = load(out)
    assert "last_optimizer_state" not in state
    assert state["optimizer_history"][-1]["num_updates"] == 20  # newest input's metadata
    assert state["averaged_checkpoints"] == ["c0.pt", "c1.pt", "c2.pt"]


def test_a_training_starting_in_the_folder_leaves_the_averages_temporary_alone(
    tmp_path, monkeypatch
):
    """tpp-train removes the ``*.pt.tmp`` files of its save dir as checkpoints nobody
    finished; the average written there meanwhile is not one of them."""
    from tpp_tools.train import remove_partial_checkpoints

    saved = torch.save

    def save_then_a_training_starts(state, path):
        saved(state, path)
        remove_partial_checkpoints(tmp_path)

    monkeypatch.setattr(AVERAGE.torch, "save", save_then_a_training_starts)
    AVERAGE.save_atomically({"model": {"w": torch.ones(2)}}, tmp_path / "avg.pt", force=False)
    monkeypatch.undo()
    assert torch.equal(torch.load(tmp_path / "avg.pt")["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["avg.pt"]


def test_selects_last_n_by_update_and_by_epoch(tmp_path):
    for epoch, update in [(1, 100), (2, 200), (2, 300), (3, 1000)]:
        fake_checkpoint(tmp_path / f"checkpoint_{epoch}_{update}.pt", seed=update)
    for epoch in (1, 2, 3, 10):
        fake_checkpoint(tmp_path / f"checkpoint{epoch}.pt", seed=epoch)
    fake_checkpoint(tmp_path / "checkpoint_last.pt", seed=99)
    fake_checkpoint(tmp_path / "checkpoint_best.pt", seed=98)

    cases = [
        (["--num-update-checkpoints", "2"], ["checkpoint_2_300.pt", "checkpoint_3_1000.pt"]),
        # numeric, not lexical, order: 1000 is the newest, 300 the one before
        (
            ["--num-update-checkpoints", "3", "--checkpoint-upper-bound", "300"],
            ["checkpoint_1_100.pt", "checkpoint_2_200.pt", "checkpoint_2_300.pt"],
        ),
        (["--num-epoch-checkpoints", "2"], ["checkpoint3.pt", "checkpoint10.pt"]),
        (
            ["--num-epoch-checkpoints", "2", "--checkpoint-upper-bound", "2"],
            ["checkpoint1.pt", "checkpoint2.pt"],
        ),
    ]
    for index, (options, expected) in enumerate(cases):
        out = tmp_path / "out" / f"avg{index}.pt"
        result = run_average("--inputs", tmp_path, *options, "--output", out)
        assert result.returncode == 0, result.stderr
        assert load(out)["averaged_checkpoints"] == expected, options

    result = run_average(
        "--inputs",
        tmp_path,
        "--num-update-checkpoints",
        "5",
        "--output",
        tmp_path / "out" / "too_many.pt",
    )
    assert result.returncode == 2
    assert "found 4" in result.stderr and str(tmp_path) in result.stderr
    assert not (tmp_path / "out" / "too_many.pt").exists()


@pytest.mark.parametrize("difference", ["name", "shape"])
def test_mismatched_checkpoints_are_named(tmp_path, difference):
    good = fake_checkpoint(tmp_path / "checkpoint_1_10.pt", seed=1)
    shapes = {"encoder.weight": (6, 4), "decoder.bias": (5,)}
    if difference == "name":
        shapes["decoder.extra"] = (2,)
    else:
        shapes["encoder.weight"] = (6, 5)
    bad = fake_checkpoint(tmp_path / "checkpoint_1_20.pt", seed=2, shapes=shapes)
    out = tmp_path / "avg.pt"
    result = run_average("--inputs", good, bad, "--output", out)
    assert result.returncode == 2
    message = result.stderr
    assert str(bad) in message, message
    if difference == "name":
        assert "decoder.extra" in message and "names differ" in message
    else:
        assert "encoder.weight" in message and "(6, 5)" in message and "(6, 4)" in message
    assert not out.exists()
    assert not list(tmp_path.glob(".averaging-*")), "temporary file left behind"


def test_bad_inputs_and_overwrite_protection(tmp_path):
    good = fake_checkpoint(tmp_path / "a.pt", seed=1)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    out = tmp_path / "avg.pt"

    result = run_average("--inputs", good, corrupt, "--output", out)
    assert result.returncode == 2 and str(corrupt) in result.stderr
    result = run_average("--inputs", good, tmp_path / "missing.pt", "--output", out)
    assert result.returncode == 2 and "missing.pt" in result.stderr
    result = run_average("--inputs", tmp_path, "--output", out)
    assert (
        result.returncode == 2 and "is a folder: give --num-update-checkpoints N" in result.stderr
    )
    result = run_average(
        "--inputs", tmp_path / "no-run", "--num-update-checkpoints", "2", "--output", out
    )
    assert result.returncode == 2 and f"--inputs {tmp_path / 'no-run'}: no such folder" in (
        result.stderr
    )
    assert not out.exists()

    out.write_bytes(b"precious")
    result = run_average("--inputs", good, "--output", out)
    assert result.returncode == 2
    assert f"{out}: already exists (use --force to replace it)" in result.stderr
    assert out.read_bytes() == b"precious"
    result = run_average("--inputs", good, "--output", out, "--force")
    assert result.returncode == 0, result.stderr
    assert torch.equal(load(out)["model"]["encoder.weight"], load(good)["model"]["encoder.weight"])
    # an input as the output, under another name (a link to its folder): refused, kept
    (tmp_path / "alias").symlink_to(tmp_path)
    before = good.read_bytes()
    result = run_average("--inputs", good, out, "--output", tmp_path / "alias" / "a.pt", "--force")
    assert result.returncode == 2 and "the output is one of the inputs" in result.stderr
    assert good.read_bytes() == before


PEAK_RSS_WRAPPER = """
import resource, subprocess, sys
# Run the script as a child and report its peak resident set size (bytes; Linux: KiB).
code = subprocess.call([sys.executable] + sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(code)
"""


def peak_rss(*args):
    result = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_WRAPPER, "-m", "tpp_tools.average", *map(str, args)],
        env=tool_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


def test_ten_checkpoints_with_bounded_memory(tmp_path):
    # 3M float32 parameters (12 MB) plus Adam's two moments: ~36 MB per checkpoint
    shapes = {"encoder.weight": (1000, 1500), "decoder.weight": (1000, 1500), "decoder.bias": (7,)}
    paths = [
        fake_checkpoint(tmp_path / f"checkpoint_1_{(i + 1) * 100}.pt", seed=i, shapes=shapes)
        for i in range(10)
    ]
    size = paths[0].stat().st_size
    baseline = peak_rss("--help")  # interpreter, torch and fairseq imports
    peak = peak_rss(
        "--inputs", tmp_path, "--num-update-checkpoints", "10", "--output", tmp_path / "avg.pt"
    )
    used = peak - baseline
    # loading everything would need 10 checkpoints; streaming needs the running sum plus
    # the model of the checkpoint being read (2/3 of a checkpoint here, the rest is
    # Adam's moments, never read); allow slack for the allocator and the output
    assert (
        used < 2 * size
    ), f"averaging used {used / 2**20:.0f} MiB, checkpoint {size / 2**20:.0f} MiB"
    averaged = load(tmp_path / "avg.pt")["model"]["decoder.bias"]
    expected = torch.stack([load(p)["model"]["decoder.bias"] for p in paths]).mean(0)
    assert torch.allclose(averaged, expected, atol=1e-6)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two real 2-update runs of transformer_pp_tiny that differ only in the encoder's
    dilations: identical parameter names and shapes, different models."""
    root = tmp_path_factory.mktemp("two_runs")
    corpus = make_corpus(root / "corpus", sizes=(120, 20, 20))
    data = binarize(corpus / "bpe", root / "data-bin", "en", "de")
    runs = {}
    for name, dilations in (("a", "1,1"), ("b", "1,2")):
        command = train_command(
            data,
            root / name,
            max_update=2,
            save_interval_updates=1,
            extra=["--encoder-conv-dilations", dilations],
        )
        command[command.index("--arch") + 1] = "transformer_pp_tiny"
        result = subprocess.run(command, env=tool_env(), capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = root / name
    return runs


def test_refuses_checkpoints_of_different_models(two_runs, tmp_path):
    a, b = two_runs["a"], two_runs["b"]
    # two checkpoints of one run: the same model, averaged (no false alarm)
    out = tmp_path / "same.pt"
    result = run_average(
        "--inputs", a / "checkpoint_1_1.pt", a / "checkpoint_1_2.pt", "--output", out
    )
    assert result.returncode == 0, result.stderr
    # same shapes, different dilations: refused, naming the option, both values, both files
    first, second = a / "checkpoint_1_2.pt", b / "checkpoint_1_2.pt"
    assert {k: tuple(v.shape) for k, v in load(first)["model"].items()} == {
        k: tuple(v.shape) for k, v in load(second)["model"].items()
    }
    out = tmp_path / "mixed.pt"
    result = run_average("--inputs", first, second, "--output", out)
    assert result.returncode == 2, result.stderr
    message = result.stderr
    assert "--encoder-conv-dilations: '1,1' in " + str(first) in message, message
    assert "'1,2' in " + str(second) in message, message
    assert "Traceback" not in message
    assert not out.exists()
    # an unrelated architecture (fairseq's transformer_tiny vs transformer_pp_tiny)
    other = tmp_path / "other.pt"
    fake_checkpoint(other, seed=3)
    result = run_average("--inputs", first, other, "--output", out)
    assert (
        result.returncode == 2 and "--arch: 'transformer_pp_tiny' in " in result.stderr
    ), result.stderr


def test_a_checkpoint_given_twice_is_refused(two_runs, tmp_path, monkeypatch):
    """P04: ``--inputs c1 c1 c2`` weighed c1 twice, also spelt differently (``./``, a
    symbolic link): refused, naming the inputs and the file they are."""
    a = two_runs["a"]
    monkeypatch.chdir(a.parent)
    link = tmp_path / "link.pt"
    link.symlink_to(a / "checkpoint_1_1.pt")
    for inputs in (
        ["a/checkpoint_1_1.pt", "a/checkpoint_1_1.pt", "a/checkpoint_1_2.pt"],
        ["a/checkpoint_1_1.pt", "./a/checkpoint_1_2.pt", str(link)],
    ):
        out = tmp_path / "avg.pt"
        result = subprocess.run(
            ["tpp-average-checkpoints", "--inputs", *inputs, "--output", str(out)],
            env=tool_env(),
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2, result.stderr
        message = result.stderr.strip().splitlines()[-1]
        spellings = ", ".join(i for i in inputs if i.endswith("1_1.pt") or i == str(link))
        resolved = (a / "checkpoint_1_1.pt").resolve()
        assert message.startswith(
            "tpp-average-checkpoints: error: checkpoints given more than once in "
            f"--inputs: {spellings} (2 times {resolved})"
        ), message
        assert "Traceback" not in result.stderr and not out.exists()


def test_a_hard_link_or_a_copy_of_an_input_is_refused(tmp_path):
    """Issue 49.6: a hard link (one file, two names) or a copy (checkpoint_best.pt saved at
    the last update is checkpoint_last.pt's copy) weighed one checkpoint twice."""
    import shutil

    first = fake_checkpoint(tmp_path / "checkpoint_1_10.pt", seed=1, num_updates=10)
    other = fake_checkpoint(tmp_path / "checkpoint_1_20.pt", seed=2, num_updates=20)
    linked = tmp_path / "linked.pt"
    linked.hardlink_to(first)
    result = run_average("--inputs", first, other, linked, "--output", tmp_path / "a.pt")
    assert result.returncode == 2
    assert f"checkpoints given more than once in --inputs: {first}, {linked} (2 times" in (
        result.stderr
    ), result.stderr
    copied = shutil.copy(other, tmp_path / "checkpoint_best.pt")
    result = run_average("--inputs", first, other, copied, "--output", tmp_path / "b.pt")
    assert result.returncode == 2
    assert (
        f"{copied} holds the same checkpoint as {other} (saved at update 20, the same "
        "parameters): a copy" in result.stderr
    ), result.stderr
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()
    # the same update of another training is another checkpoint
    seed3 = fake_checkpoint(tmp_path / "other_run.pt", seed=3, num_updates=20)
    assert (
        run_average("--inputs", first, other, seed3, "--output", tmp_path / "c.pt").returncode == 0
    )


def test_allow_config_mismatch_averages_with_a_warning(two_runs, tmp_path):
    first, second = two_runs["a"] / "checkpoint_1_2.pt", two_runs["b"] / "checkpoint_1_2.pt"
    out = tmp_path / "mixed.pt"
    result = run_average("--inputs", first, second, "--output", out, "--allow-config-mismatch")
    assert result.returncode == 0, result.stderr
    assert "warning" in result.stderr and "--encoder-conv-dilations" in result.stderr
    averaged = load(out)
    assert averaged["cfg"]["model"].encoder_conv_dilations == "1,2"  # the last input's
    name = "encoder.embed_tokens.weight"
    expected = (load(first)["model"][name] + load(second)["model"][name]) / 2
    assert torch.allclose(averaged["model"][name], expected, atol=1e-6)


def test_unusable_files_get_a_reason_a_person_can_read(two_runs, tmp_path):
    good = two_runs["a"] / "checkpoint_1_2.pt"
    text = tmp_path / "notes.pt"
    text.write_text("epoch 3 looked fine\n")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    expected = {
        text: "a text file, not a checkpoint (first line: 'epoch 3 looked fine')",
        empty: "empty file (0 bytes)",
        truncated: "truncated or damaged checkpoint",
    }
    for path, reason in expected.items():
        result = run_average("--inputs", good, path, "--output", tmp_path / "avg.pt")
        assert result.returncode == 2
        assert f"{path}: {reason}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_a_run_terminated_while_saving_leaves_no_temporary_file(tmp_path):
    """SIGTERM (kill, a job's time limit) as the average is being written: the command
    ends with 143 and no traceback, and removes its temporary file (it was left behind,
    as SIGTERM ended the process without Python's clean-up)."""
    inputs = [fake_checkpoint(tmp_path / f"checkpoint_1_{u}.pt", seed=u) for u in (10, 20)]
    terminated_as_it_saves = (
        "import os, signal, sys, torch\n"
        "from tpp_tools import average\n"
        "save = torch.save\n"
        "def save_then_terminated(*args, **kwargs):\n"
        "    save(*args, **kwargs)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "torch.save = save_then_terminated\n"
        "sys.exit(average.main(sys.argv[1:]))\n"
    )
    out = tmp_path / "out" / "avg.pt"
    command = [sys.executable, "-c", terminated_as_it_saves, "--inputs", *inputs, "--output", out]
    result = subprocess.run(
        [str(a) for a in command], capture_output=True, text=True, env=tool_env()
    )
    assert result.returncode == 143 and "Traceback" not in result.stderr, result.stderr
    assert list((tmp_path / "out").iterdir()) == []
