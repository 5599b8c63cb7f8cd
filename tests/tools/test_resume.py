"""scripts/train.sh: the paper's recipe on the command line, resuming a killed run, and
resuming after a torn checkpoint_last.pt; its log plots as it is."""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import REPO, SCRIPTS, tool_env, train_command

import tpp_plugin  # noqa: F401  (allow-lists fairseq checkpoint contents for torch.load)
from tpp_tools import plot_training, recover

SAVED = re.compile(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates")


def dry_run(*args, env=None):
    result = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh"), "--dry-run", *args],
        env=env or tool_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    words = shlex.split(result.stdout)
    # the checks tpp-train asks of the plugin, where the environment does not choose them
    return words[1:] if words[0].startswith("TPP_FAIRSEQ_CHECKS=") else words


def option(command, name):
    """The value of the last occurrence of ``name`` (fairseq keeps the last one)."""
    index = len(command) - 1 - command[::-1].index(name)
    return command[index + 1]


def test_the_dry_run_prints_the_checks_tpp_train_asks_for():
    """tpp-train runs fairseq-train with TPP_FAIRSEQ_CHECKS=all unless it is set: the
    printed command says so."""

    def printed(env):
        return subprocess.run(
            ["bash", str(SCRIPTS / "train.sh"), "--dry-run"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    env = {k: v for k, v in tool_env().items() if k != "TPP_FAIRSEQ_CHECKS"}
    assert printed(env).startswith("TPP_FAIRSEQ_CHECKS=all ")
    assert not printed(dict(env, TPP_FAIRSEQ_CHECKS="none")).startswith("TPP_FAIRSEQ_CHECKS")


def test_the_documented_command_is_the_one_train_sh_runs():
    """docs/training_and_evaluation.md shows what ``scripts/train.sh --preset en-de`` runs
    on a GPU (where it adds --fp16): word for word, but the programs' and plugin's paths."""
    text = (REPO / "docs" / "training_and_evaluation.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(TPP_FAIRSEQ_CHECKS=all fairseq-train .*?)\n```", text, re.S)
    documented = shlex.split(block.group(1).replace("\\\n", " "))[1:]
    command = dry_run(
        "--preset", "en-de", "--data", "data-bin/wmt14_en_de",
        "--save-dir", "checkpoints/en-de", "--fp16",
    )  # fmt: skip
    assert Path(command[0]).name == documented[0] == "fairseq-train"
    assert option(command, "--user-dir") == str(REPO / "tpp_plugin")
    command[command.index("--user-dir") + 1] = "tpp_plugin"
    assert command[1:] == documented[1:]


def test_paper_recipe_defaults_and_overrides():
    command = dry_run("--preset", "en-de", "--data", "some/data")
    assert command[1] == "some/data"
    expected = {
        "--arch": "transformer_pp_wmt_en_de_big",
        "--task": "translation_with_tags",
        "--criterion": "label_smoothed_cross_entropy_with_tags",
        "--optimizer": "adam",
        "--adam-betas": "(0.9, 0.98)",
        "--lr-scheduler": "inverse_sqrt",
        "--warmup-updates": "4000",
        "--label-smoothing": "0.1",
        "--update-freq": "10",
        "--max-update": "320000",
    }
    for name, value in expected.items():
        assert option(command, name) == value, name
    assert int(option(command, "--keep-interval-updates")) >= 10
    assert int(option(command, "--save-interval-updates")) > 0
    assert "--no-epoch-checkpoints" in command
    assert option(command, "--user-dir").endswith("tpp_plugin")
    assert "--dropout" not in command  # dropouts come from the arch preset
    assert option(dry_run("--preset", "en-fr"), "--arch") == "transformer_pp_wmt_en_fr_big"

    # variables, flags (flag wins) and pass-through after --
    env = dict(tool_env(), UPDATE_FREQ="4", MAX_TOKENS="1234", ARCH="transformer_pp")
    command = dry_run("--update-freq", "2", "--", "--fp16", "--patience", "3", env=env)
    assert option(command, "--update-freq") == "2"
    assert option(command, "--max-tokens") == "1234"
    assert option(command, "--arch") == "transformer_pp"
    assert command[-3:] == ["--fp16", "--patience", "3"]

    bad = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh"), "--no-such-option"],
        env=tool_env(),
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "--no-such-option" in bad.stderr


def test_installed_from_a_wheel_the_default_folders_are_in_the_current_folder(
    tmp_path, monkeypatch, capsys
):
    """Without a checkout around the package (a wheel's install), tpp-train's default data
    and save dir are in the current folder, as tpp-prepare-corpus's outputs are, never in
    site-packages; in a SLURM job, in $TPP_ROOT (the repository it was submitted from)
    whatever checkout the environment was installed from. tpp-demo, which needs the
    checkout's sample, says so (--help still works)."""
    import tpp_pipeline
    from tpp_tools import demo, train

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TPP_ROOT", raising=False)
    monkeypatch.setattr(tpp_pipeline, "checkout", lambda: None)
    args = train.parse_args(["--preset", "tiny", "--dry-run"])
    command = train.fairseq_command(args)
    assert command[1] == str(tmp_path / "runs" / "demo" / "data-bin" / "sample_en_de")
    assert args.save_dir == str(tmp_path / "checkpoints" / "tiny")
    monkeypatch.undo()
    monkeypatch.setenv("TPP_ROOT", str(tmp_path / "submitted"))
    args = train.parse_args(["--preset", "tiny", "--dry-run"])
    assert train.fairseq_command(args)[1] == str(
        tmp_path / "submitted" / "runs" / "demo" / "data-bin" / "sample_en_de"
    )
    monkeypatch.setattr(demo, "checkout", lambda: None)
    with pytest.raises(SystemExit) as shown:
        demo.main(["--help"])
    assert shown.value.code == 0 and "usage: tpp-demo" in capsys.readouterr().out
    assert demo.main([]) == 2 and "runs from a checkout" in capsys.readouterr().err


def test_one_builder_makes_every_fairseq_train_command_line():
    """Issue 48.2: tpp-train, the study (through tpp-train) and the benchmarks build
    fairseq-train's arguments with one function: the recipe's optimiser, schedule and
    epoch batches unless the caller's options replace them, the caller's extra last."""
    from benchmarks import harness
    from tpp_tools import train

    assert train.option_words(
        {"arch": "transformer", "no_save": True, "cpu": False, "fp16": None, "tag": ""}
    ) == ["--arch", "transformer", "--no-save", "--tag", ""]
    words = train.fairseq_arguments("d", {"lr": 1e-3, "adam_eps": "1e-6"}, ["--seed", 3])
    assert words[:5] == ["d", "--lr", "0.001", "--adam-eps", "1e-6"]
    assert option(words, "--optimizer") == "adam" and words.count("--adam-eps") == 1
    assert option(words, "--update-epoch-batch-itr") == "True" and words[-2:] == ["--seed", "3"]
    optimizer = train.option_words(train.OPTIMIZER)
    for command in (
        train.fairseq_command(train.parse_args(["--preset", "tiny", "--data", "d", "--cpu"])),
        harness.command_line(
            "tpp",
            128,
            argparse.Namespace(data="d", layers=2, max_tokens=512, device="cpu", dtype="fp32"),
        ),
    ):
        start = command.index("--optimizer")
        assert command[start : start + len(optimizer)] == optimizer
        assert option(command, "--update-epoch-batch-itr") == "True"


def test_fp16_is_added_on_a_gpu_only_where_no_other_precision_is_asked_for(tmp_path):
    """On a machine with a GPU (here an ``nvidia-smi`` that lists one, for the dry run)
    --fp16 is the default; a precision given after -- replaces it, since fairseq refuses
    --fp16 next to --bf16 (which it ties to --tpu) or --amp; a GPU that
    CUDA_VISIBLE_DEVICES hides does not count."""
    from fairseq import options

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: a GPU'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = dict(tool_env(), PATH=f"{fake}{os.pathsep}{tool_env()['PATH']}")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    assert "--fp16" in dry_run("--preset", "base", env=env)
    for precision in ("--bf16", "--memory-efficient-bf16", "--amp", "--memory-efficient-fp16"):
        command = dry_run("--preset", "base", "--", precision, env=env)
        assert "--fp16" not in command and command[-1] == precision, precision
        if precision != "--amp":  # fairseq's parser takes it (--amp's conflict is the trainer's)
            cfg = options.parse_args_and_arch(options.get_training_parser(), command[1:])
            assert getattr(cfg, precision[2:].replace("-", "_")), precision
    assert "--fp16" not in dry_run("--preset", "base", env=dict(env, CUDA_VISIBLE_DEVICES=""))
    both = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh"), "--dry-run", "--fp16", "--", "--bf16"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert both.returncode != 0 and "two precisions" in both.stderr


def wait_for_saved_checkpoint(log_path, process, timeout):
    """Poll the training log until a checkpoint has been saved; returns its update count."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = SAVED.findall(log_path.read_text())
        if found:
            return int(found[-1])
        assert process.poll() is None, (
            "training ended before writing a checkpoint:\n" + log_path.read_text()
        )
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint after {timeout}s:\n{log_path.read_text()}")


def num_updates(checkpoint):
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return state["optimizer_history"][-1]["num_updates"]


def test_killed_run_resumes_from_last_checkpoint(nmt_corpus, tmp_path):
    data = nmt_corpus["data"]
    save_dir = tmp_path / "ckpt"
    # first run: far more updates than we let it do; checkpoints every 15 updates
    log1 = tmp_path / "train1.log"
    with open(log1, "w") as log:
        process = subprocess.Popen(
            train_command(data, save_dir, max_update=5000, save_interval_updates=15),
            env=tool_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        saved_at = wait_for_saved_checkpoint(log1, process, timeout=180)
        # kill the whole run at once, like a node failure or preemption would
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == -signal.SIGKILL
    # the kill may land while the next checkpoint is written: take what the log says is saved
    saved_at = int(SAVED.findall(log1.read_text())[-1])
    assert saved_at >= 15
    assert num_updates(save_dir / "checkpoint_last.pt") == saved_at

    # second run: the same command (with a reachable end) continues from that update count
    target = saved_at + 10
    log2 = tmp_path / "train2.log"
    with open(log2, "w") as log:
        subprocess.run(
            train_command(data, save_dir, max_update=target, save_interval_updates=15),
            env=tool_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=300,
        )
    text = log2.read_text()
    assert f"@ {saved_at} updates" in re.search(r"[Ll]oaded checkpoint .*", text).group(0), text
    logged = [int(n) for n in re.findall(r"num_updates[ =](\d+)", text)]
    assert logged and min(logged) > saved_at, "the resumed run restarted its update count"
    assert num_updates(save_dir / "checkpoint_last.pt") == target
    # the optimizer's learning-rate schedule continued too (no new warm-up from zero)
    first_lr = float(re.search(r"num_updates=\d+, lr=([0-9.e-]+)", text).group(1))
    assert first_lr > 1e-3


def readme_train_command(data, save_dir, max_update, save_interval_updates):
    """tests' usual train.sh command, run as the README writes it: the script itself
    (it must be executable), not `bash script`."""
    command = train_command(
        data, save_dir, max_update=max_update, save_interval_updates=save_interval_updates
    )
    assert command[0] == "bash"
    return command[1:]


def run_readme_training(data, save_dir, max_update):
    """The README's training command (checkpoints every 5 updates), run to its end."""
    return subprocess.run(
        readme_train_command(data, save_dir, max_update, 5),
        cwd=REPO,
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def trained_run(nmt_corpus, tmp_path_factory):
    """A tiny run of 20 updates (checkpoints every 5) with the README's command."""
    root = tmp_path_factory.mktemp("trained")
    data = nmt_corpus["data"]
    save_dir = root / "ckpt"
    result = run_readme_training(data, save_dir, 20)
    assert result.returncode == 0, result.stderr[-3000:]
    assert num_updates(save_dir / "checkpoint_last.pt") == 20
    return {"data": data, "save_dir": save_dir}


def test_train_sh_log_is_plottable_as_it_is(trained_run, tmp_path):
    """Issue 11.7: the log train.sh writes plots without options or conversion."""
    log = trained_run["save_dir"] / "train.log"
    result = subprocess.run(
        ["tpp-plot-training", "--log", str(log), "--out-dir", str(tmp_path / "plots")],
        cwd=REPO,
        env=tool_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "plots" / "loss.png").stat().st_size > 0
    assert (tmp_path / "plots" / "perplexity.png").stat().st_size > 0
    steps = [step for step, _ in plot_training.read_log(log)["train_inner"]]
    assert steps[0] == 5 and steps[-1] == 20  # --log-interval 5, --max-update 20


def test_a_full_disk_while_training_is_one_line_and_no_partial_checkpoint_stays(
    nmt_corpus, trained_run, tmp_path
):
    """Issue 49.5: a training on a full disk ended in a traceback and left its
    checkpoint's .tmp, filling the disk further. Here no file may grow past 64 KiB
    (RLIMIT_FSIZE: a write past it fails as on a full disk), so the first checkpoint's
    write fails: one line names the checkpoint and the partial file is gone. A partial
    file that a kill left (nobody could remove it) is removed by the same command run
    again with room, which trains."""
    import resource
    import signal

    save_dir = tmp_path / "ckpt"
    command = readme_train_command(nmt_corpus["data"], save_dir, 10, 5)

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    full = subprocess.run(
        command,
        cwd=REPO,
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=small_files,
    )
    assert full.returncode != 0
    checkpoint = save_dir / "checkpoint_1_5.pt"
    assert full.stderr.strip().splitlines()[-1] == (
        f"fairseq-train: error: File too large writing {checkpoint} (its partial "
        "checkpoint_1_5.pt.tmp removed); free space and run the same command again"
    ), full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    assert not list(save_dir.glob("*.tmp")), sorted(save_dir.iterdir())
    # as a kill during the write leaves it: the first 64 KiB of a checkpoint
    # (and tpp-recover-checkpoint's copy to checkpoint_last.pt: a SIGTERM left it)
    partial = checkpoint.with_name(checkpoint.name + ".tmp")
    copy = save_dir / ".checkpoint_last.pt.k2x9q0ab.tmp"
    for part in (partial, copy):
        part.write_bytes((trained_run["save_dir"] / "checkpoint_last.pt").read_bytes()[:65536])
    again = subprocess.run(
        command, cwd=REPO, env=tool_env(), capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    for part in (partial, copy):
        assert f"removed {part} (0.1 MiB), a checkpoint an earlier run did not finish" in (
            again.stderr
        )
    assert not list(save_dir.glob("*.tmp")) and num_updates(save_dir / "checkpoint_last.pt") == 10


@pytest.fixture(scope="module")
def torn_run(trained_run, tmp_path_factory):
    """A copy of the 20-update run whose checkpoint_last.pt is then truncated, as a kill
    during fairseq's copy leaves it, and the README's command run again to 30 updates."""
    save_dir = tmp_path_factory.mktemp("torn") / "ckpt"
    shutil.copytree(trained_run["save_dir"], save_dir)
    last = save_dir / "checkpoint_last.pt"
    intact = last.read_bytes()
    interval = {path.name: num_updates(path) for path in save_dir.glob("checkpoint_*_*.pt")}
    torn = intact[: len(intact) * 2 // 3]
    last.write_bytes(torn)
    result = run_readme_training(trained_run["data"], save_dir, 30)
    return {
        "save_dir": save_dir,
        "torn": torn,
        "intact": intact,
        "interval": interval,
        "result": result,
    }


def test_torn_checkpoint_last_is_kept_aside_and_training_resumes(torn_run):
    """Issue 11.6: re-running the README's training command after checkpoint_last.pt was
    torn resumes from the newest readable checkpoint instead of crashing."""
    result, save_dir = torn_run["result"], torn_run["save_dir"]
    messages = result.stderr + result.stdout  # fairseq logs to stdout
    assert result.returncode == 0, messages[-3000:]
    assert "PytorchStreamReader" not in messages
    newest_name, newest = max(torn_run["interval"].items(), key=lambda item: item[1])
    assert 0 < newest < 20
    assert (
        f"{save_dir / 'checkpoint_last.pt'} cannot be loaded (truncated or damaged "
        "checkpoint" in messages
    ), messages[-3000:]
    assert f"resuming from {save_dir / newest_name} ({newest} updates)" in messages
    loaded = re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)", messages)
    assert loaded and int(loaded.group(1)) == newest, messages[-3000:]
    assert num_updates(save_dir / "checkpoint_last.pt") == 30
    # the damaged file is kept, byte for byte, not deleted
    damaged = list(save_dir.glob("checkpoint_last.pt.damaged-*"))
    assert len(damaged) == 1 and damaged[0].read_bytes() == torn_run["torn"]
    # and the log, appended to by both runs, still plots: the second run from update 15
    steps = [step for step, _ in plot_training.read_log(save_dir / "train.log")["train_inner"]]
    assert steps[-1] == 30


def test_truncation_anywhere_is_detected(torn_run, tmp_path):
    """The check before resuming (zip directory and checksums, then a memory-mapped
    safe load) finds a checkpoint cut at any point."""
    intact = torn_run["intact"]
    whole = tmp_path / "whole.pt"
    whole.write_bytes(intact)
    assert recover.problem_with(whole) is None
    cut = tmp_path / "cut.pt"
    for size in (
        0,
        1,
        100,
        4096,
        len(intact) // 3,
        len(intact) - 4096,
        len(intact) - 22,
        len(intact) - 1,
    ):
        cut.write_bytes(intact[:size])
        assert recover.problem_with(cut) is not None, size


def test_no_readable_checkpoint_is_an_error(torn_run, tmp_path):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / "checkpoint_last.pt").write_bytes(torn_run["torn"])
    (save_dir / "checkpoint_1_5.pt").write_bytes(torn_run["torn"][:1000])
    result = subprocess.run(
        ["tpp-recover-checkpoint", "--save-dir", str(save_dir)],
        cwd=REPO,
        env=tool_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert f"skipping {save_dir / 'checkpoint_1_5.pt'}: truncated" in result.stderr
    assert "no readable checkpoint to resume from" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (save_dir / "checkpoint_last.pt").exists()
    assert len(list(save_dir.glob("checkpoint_last.pt.damaged-*"))) == 1
    # with --restore-file naming another file, fairseq resumes from that file, as fairseq
    # defines it: nothing in the save dir is checked or moved
    (save_dir / "checkpoint_last.pt").write_bytes(torn_run["torn"])
    elsewhere = tmp_path / "elsewhere.pt"

    def restore(*options):
        return subprocess.run(
            ["tpp-recover-checkpoint", "--save-dir", str(save_dir), "--restore-file", *options],
            cwd=REPO,
            env=tool_env(),
            capture_output=True,
            text=True,
        )

    # a file that is not there: fairseq logged "No existing checkpoint found" and trained
    # from the beginning, over the save dir's checkpoints
    result = restore(str(elsewhere))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"--restore-file {elsewhere}: no such file (fairseq would" in result.stderr
    elsewhere.write_bytes(torn_run["intact"])
    result = restore(str(elsewhere))
    assert result.returncode == 0 and result.stderr == ""
    assert (save_dir / "checkpoint_last.pt").read_bytes() == torn_run["torn"]
    # with a --checkpoint-suffix fairseq reads the file with it
    result = restore(str(elsewhere), "--checkpoint-suffix=-shard0")
    assert result.returncode == 2 and f"(fairseq reads {tmp_path / 'elsewhere-shard0.pt'}, " in (
        result.stderr
    ), result.stderr


def test_recovery_waits_for_no_training_that_holds_the_save_dir(torn_run, tmp_path):
    """A training holds the save dir's lock (its checkpoint_last.pt may be mid-copy): the
    repair is refused, as a second training is, and nothing is moved."""
    from tpp_tools.train import take_lock

    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / "checkpoint_last.pt").write_bytes(torn_run["torn"])
    held = take_lock(save_dir, ["fairseq-train", "..."])
    try:
        result = subprocess.run(
            ["tpp-recover-checkpoint", "--save-dir", str(save_dir)],
            env=tool_env(),
            capture_output=True,
            text=True,
        )
    finally:
        os.close(held)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"another training is using the save dir {save_dir}" in result.stderr, result.stderr
    assert sorted(p.name for p in save_dir.iterdir()) == [".lock", "checkpoint_last.pt"]


def test_a_torn_checkpoint_in_a_folder_that_cannot_be_written_is_named(
    torn_run, tmp_path, monkeypatch
):
    import errno

    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / "checkpoint_last.pt").write_bytes(torn_run["torn"])

    def read_only(source, target):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(source))

    monkeypatch.setattr(recover.os, "replace", read_only)
    with pytest.raises(
        recover.RecoveryError, match="cannot be moved aside .*Read-only file system"
    ):
        recover.recover(save_dir)
    monkeypatch.undo()
    assert (save_dir / "checkpoint_last.pt").read_bytes() == torn_run["torn"]


def test_a_whole_checkpoint_that_safe_loading_refuses_is_not_moved(torn_run, tmp_path):
    """Not damage: a checkpoint holding an object safe loading does not allow stays
    where it is, and no restart that would overwrite it is advised."""
    import datetime

    from tpp_tools.checkpoint_files import load_checkpoint

    whole = tmp_path / "whole.pt"
    whole.write_bytes(torn_run["intact"])
    state = load_checkpoint(whole)
    state["extra_state"]["saved_at"] = datetime.datetime(2026, 11, 29)
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    torch.save(state, save_dir / "checkpoint_last.pt")
    refused = (save_dir / "checkpoint_last.pt").read_bytes()

    def recover_checkpoint():
        return subprocess.run(
            ["tpp-recover-checkpoint", "--save-dir", str(save_dir)],
            cwd=REPO,
            env=tool_env(),
            capture_output=True,
            text=True,
        )

    result = recover_checkpoint()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "datetime" in result.stderr and "The file is whole (not torn)" in result.stderr
    assert (save_dir / "checkpoint_last.pt").read_bytes() == refused
    assert not list(save_dir.glob("*.damaged-*"))
    # a torn checkpoint_last.pt beside it: the refused one named, not advised away, and the
    # torn one left in place (the next attempt checks again, rather than starting afresh)
    os.replace(save_dir / "checkpoint_last.pt", save_dir / "checkpoint_1_5.pt")
    (save_dir / "checkpoint_last.pt").write_bytes(torn_run["torn"])
    result = recover_checkpoint()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "checkpoint_1_5.pt: whole, but refused" in result.stderr, result.stderr
    assert "start training from the beginning" not in result.stderr
    assert (save_dir / "checkpoint_1_5.pt").read_bytes() == refused
    assert (save_dir / "checkpoint_last.pt").read_bytes() == torn_run["torn"]
    # nor resumed from an older readable one, over it
    whole.rename(save_dir / "checkpoint_1_2.pt")
    os.utime(save_dir / "checkpoint_1_2.pt", (1, 1))
    result = recover_checkpoint()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "checkpoint_1_5.pt: newer than checkpoint_1_2.pt" in result.stderr, result.stderr
    assert (save_dir / "checkpoint_1_5.pt").read_bytes() == refused
    assert (save_dir / "checkpoint_last.pt").read_bytes() == torn_run["torn"]


def test_a_finished_run_of_a_checkpoint_suffix_is_named_with_it(trained_run, tmp_path):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    shutil.copy(
        trained_run["save_dir"] / "checkpoint_last.pt", save_dir / "checkpoint_last-shard0.pt"
    )
    command = ["tpp-recover-checkpoint", "--save-dir", save_dir, "--checkpoint-suffix=-shard0"]
    result = subprocess.run(
        [str(part) for part in command + ["--max-update", "20"]],
        cwd=REPO,
        env=tool_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3, result.stderr
    assert f"{save_dir / 'checkpoint_last-shard0.pt'} has 20 updates: the run is finished" in (
        result.stderr
    )


def test_a_save_dir_without_checkpoint_last_resumes_from_its_newest(trained_run, tmp_path):
    """A kill between fairseq's first save and its copy to checkpoint_last.pt (or a user's
    rm) left interval checkpoints and no checkpoint_last.pt: fairseq alone trained from
    the beginning and wrote over them. The README's command resumes from the newest."""
    save_dir = tmp_path / "ckpt"
    shutil.copytree(trained_run["save_dir"], save_dir)
    (save_dir / "checkpoint_last.pt").unlink()
    saved = {path.name: path.read_bytes() for path in save_dir.glob("checkpoint*.pt")}
    newest = max(
        (num_updates(save_dir / name), not name.endswith("_best.pt"), name) for name in saved
    )
    assert 5 <= newest[0] < 20 and newest[1], newest  # an interval checkpoint, not the best
    result = run_readme_training(trained_run["data"], save_dir, 20)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"checkpoint_last.pt is missing; resuming from {save_dir / newest[2]} "
        f"({newest[0]} updates)" in result.stderr
    ), result.stderr[-3000:]
    loaded = re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)", result.stdout)
    assert loaded and int(loaded.group(1)) == newest[0], result.stdout[-3000:]
    assert num_updates(save_dir / "checkpoint_last.pt") == 20
    for name, content in saved.items():  # none trained over (the best one may improve)
        assert name.endswith("_best.pt") or (save_dir / name).read_bytes() == content, name
    # under --no-last-checkpoints a copy would never be updated: the way to resume is named
    (save_dir / "checkpoint_last.pt").unlink()
    result = subprocess.run(
        ["tpp-recover-checkpoint", "--save-dir", str(save_dir), "--no-last-checkpoints"],
        cwd=REPO,
        env=tool_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"Resume with --restore-file {save_dir / newest[2]}, " in result.stderr, result.stderr
    assert not (save_dir / "checkpoint_last.pt").exists()


def test_a_copy_to_checkpoint_last_the_disk_refuses_is_one_line(
    trained_run, tmp_path, monkeypatch, capsys
):
    """Run by hand on a save dir it cannot write (checked without the lock), the copy of
    the newest checkpoint to a missing checkpoint_last.pt ended in a traceback."""
    save_dir = tmp_path / "ckpt"
    shutil.copytree(trained_run["save_dir"], save_dir)
    (save_dir / "checkpoint_last.pt").unlink()

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(recover.tempfile, "mkstemp", refused)
    assert recover.main(["--save-dir", str(save_dir)]) == 2
    said = capsys.readouterr().err
    assert "cannot copy " in said and f"to {save_dir / 'checkpoint_last.pt'} to resume" in said
    assert f"Permission denied (make {save_dir} writable)" in said and "Traceback" not in said
    assert not (save_dir / "checkpoint_last.pt").exists()


def test_the_checkpoint_said_to_be_resumed_from_is_the_one_fairseq_reads(tmp_path):
    """It named checkpoint_last.pt whatever --checkpoint-suffix or --restore-file said."""
    from tpp_tools.train import resumed_from

    (tmp_path / "checkpoint_last.pt").write_bytes(b"")
    (tmp_path / "checkpoint_last-y.pt").write_bytes(b"")
    (tmp_path / "checkpoint_1_5-y.pt").write_bytes(b"")
    command = ["fairseq-train", "DATA", "--save-dir", str(tmp_path)]
    assert resumed_from(command) == tmp_path / "checkpoint_last.pt"
    assert resumed_from([*command, "--checkpoint-suffix=-y"]) == tmp_path / "checkpoint_last-y.pt"
    elsewhere = ["--restore-file", str(tmp_path / "checkpoint_1_5.pt")]
    assert resumed_from([*command, *elsewhere]) is None
    assert resumed_from([*command, *elsewhere, "--checkpoint-suffix=-y"]) == (
        tmp_path / "checkpoint_1_5-y.pt"
    )
    assert resumed_from(["fairseq-train", "DATA", "--save-dir", str(tmp_path / "new")]) is None


def test_a_finished_run_is_not_trained_again(trained_run, tmp_path):
    """Re-running the command of a finished run (checkpoint_last.pt at --max-update), or
    with a smaller --max-update, trains nothing and writes no checkpoint (fairseq alone
    would train one update more and overwrite the last ones); a larger one continues."""
    save_dir = tmp_path / "ckpt"
    shutil.copytree(trained_run["save_dir"], save_dir)
    before = {path.name: path.stat().st_mtime_ns for path in save_dir.glob("*.pt")}
    for max_update in (20, 12):
        result = run_readme_training(trained_run["data"], save_dir, max_update)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "has 20 updates: the run is finished" in result.stderr
        assert {path.name: path.stat().st_mtime_ns for path in save_dir.glob("*.pt")} == before
    result = run_readme_training(trained_run["data"], save_dir, 22)
    assert result.returncode == 0, result.stderr[-3000:]
    assert num_updates(save_dir / "checkpoint_last.pt") == 22


def test_one_training_per_save_dir(nmt_corpus, tmp_path):
    """A second training of the same save dir is refused while the first runs, naming
    it (before, both ran and wrote every checkpoint and one log)."""
    save_dir = tmp_path / "ckpt"
    log1 = tmp_path / "train1.log"
    with open(log1, "w") as log:
        first = subprocess.Popen(
            train_command(nmt_corpus["data"], save_dir, max_update=5000, save_interval_updates=15),
            env=tool_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_saved_checkpoint(log1, first, timeout=180)
        second = subprocess.run(
            train_command(nmt_corpus["data"], save_dir, max_update=5000, save_interval_updates=15),
            env=tool_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert (
            f"another training is using the save dir {save_dir} (process {first.pid} on host"
            in second.stderr
        )
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


@pytest.mark.parametrize("value", ["0", "-5", "ten"])
def test_max_update_must_be_a_positive_number(value, tmp_path):
    """fairseq reads --max-update 0 as "no limit": refused before anything runs."""
    bad = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh"), "--dry-run", "--max-update", value],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert f"--max-update must be a positive number of updates, not '{value}'" in bad.stderr


@pytest.mark.parametrize(
    "options, message",
    [
        (["--lr", "-1"], "--lr must be a positive number, not '-1'"),
        (["--label-smoothing", "2"], "--label-smoothing must be in [0, 1), not '2'"),
        (["--update-freq", "0"], "--update-freq must be a positive whole number, not '0'"),
        (["--warmup-updates", "-1"], "--warmup-updates must be a positive whole number"),
        (["--warmup-updates", "0"], "--warmup-updates must be a positive whole number, not '0'"),
        (["--", "--log-interval", "0"], "--log-interval must be a positive whole number"),
        (["--", "--save-interval-updates=0"], "--save-interval-updates must be a positive"),
        (["--max-tokens", "0"], "--max-tokens must be a positive whole number, not '0'"),
        (["--", "--max-update", "0"], "--max-update must be a positive number of updates"),
        (["--", "--lr", "0"], "--lr must be a positive number, not '0'"),
        (["--seed", "-1"], "--seed must be a whole number from 0 to 2**31 - 1, not '-1'"),
        (["--", "--seed", "2147483648"], "--seed must be a whole number from 0 to 2**31 - 1"),
        (["--", "--seed=-5"], "--seed must be a whole number from 0 to 2**31 - 1, not '-5'"),
        (["--", "--lr=0"], "--lr must be a positive number, not '0'"),
        (["--", "--save-dir", "elsewhere"], "--save-dir after --: give it before --"),
        (["--", "--log-file=train.log"], "--log-file after --: give it before --"),
        (["--", "--user-dir", "elsewhere"], "--user-dir after --: give it before --"),
        (["--cpu", "--", "--fp16"], "--fp16 (after --) needs a GPU: drop --cpu or --fp16"),
        (["--cpu", "--", "--amp"], "--amp (after --) needs a GPU: drop --cpu or --amp"),
        (["--cpu", "--", "--cpu", "--fp16"], "--fp16 (after --) needs a GPU: drop --cpu"),
        (["--cpu", "--", "--bf16", "--amp"], "--amp (after --) needs a GPU: drop --cpu"),
        (["--save-dir", ""], "--save-dir is empty: give a value or leave it out"),
        (["--data="], "--data is empty: give a value or leave it out"),
        (["--max-tokens", "²"], "--max-tokens must be a positive whole number, not '²'"),
    ],
)
def test_values_fairseq_would_misread_are_refused_before_training(options, message):
    """Issue probes: gradient ascent (--lr -1), label smoothing above 1, divisions by
    zero and an empty dataset deep inside fairseq; --max-update 0 after -- (no limit); a
    save dir or log file after -- (fairseq's, while the lock guards another folder)."""
    bad = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh"), "--dry-run", *options],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and f"tpp-train: error: {message}" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("PRESET", "bogus", "PRESET='bogus': expected one of base, cpu, en-de, en-fr, tiny"),
        ("CPU", "yes", "CPU='yes': expected one of 0, 1"),
        ("FP16", "on", "FP16='on': expected one of auto, 0, 1"),
    ],
)
def test_a_variable_tpp_train_cannot_read_is_refused(variable, value, message):
    """PRESET=bogus was a KeyError traceback; CPU=yes and FP16=on were read as off."""
    bad = subprocess.run(
        ["bash", str(SCRIPTS / "train.sh"), "--dry-run"],
        env=dict(tool_env(), **{variable: value}),
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and f"tpp-train: error: {message}" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    # (bfloat16 trains on CPUs: left to fairseq)
    command = dry_run("--cpu", "--", "--bf16")
    assert "--cpu" in command and command[-1] == "--bf16"


def test_an_empty_variable_is_unset():
    """As a shell's ``${NAME:-default}``: USER_DIR= passed an empty --user-dir, so that
    fairseq loaded the current folder as the plugin."""
    from tpp_tools.train import VARIABLES

    env = {name: value for name, value in tool_env().items() if name not in VARIABLES}
    assert dry_run(env=dict(env, **{name: "" for name in VARIABLES})) == dry_run(env=env)


@pytest.mark.parametrize(
    "extra, left_out, kept",
    [
        (["--optimizer", "sgd"], ["--adam-betas", "--adam-eps"], ["--warmup-init-lr"]),
        (["--optimizer", "cpu_adam"], [], ["--adam-betas", "--adam-eps"]),
        (["--lr-scheduler=fixed"], ["--warmup-init-lr"], ["--warmup-updates", "--adam-betas"]),
        (["--lr-scheduler", "cosine"], [], ["--warmup-init-lr", "--warmup-updates"]),
        (
            ["--optimizer", "nag", "--lr-scheduler", "tri_stage"],
            ["--adam-betas", "--warmup-init-lr", "--warmup-updates"],
            ["--lr"],
        ),
    ],
)
def test_another_optimizer_or_schedule_after_the_separator_trains(extra, left_out, kept):
    """The recipe's options that another optimizer or schedule after -- does not take are
    left out, those it takes kept (fairseq refused them: "unrecognized arguments:
    --adam-betas (0.9, 0.98) ...")."""
    from tpp_tools import train

    data = REPO / "tests"  # (fairseq's parser reads no data)
    options = train.parse_args(["--preset", "tiny", "--data", str(data), "--", *extra])
    command = train.fairseq_command(options)
    assert not set(left_out) & set(command) and set(kept) <= set(command)
    train.check_fairseq_arguments(command[1:])  # fairseq's own parser takes them
    recipe = train.fairseq_command(train.parse_args(["--preset", "tiny", "--data", str(data)]))
    assert {"--adam-betas", "--adam-eps", "--warmup-init-lr"} <= set(recipe)
    with pytest.raises(train.TrainError, match="unrecognized arguments: --adam-betas"):
        train.check_fairseq_arguments([*recipe[1:], "--optimizer", "sgd"])


def test_a_data_folder_or_log_file_fairseq_cannot_use_is_refused_by_name(tmp_path):
    def refused(*options):
        """train.sh's error output; it must end with status 2 and no traceback."""
        bad = subprocess.run(
            ["bash", str(SCRIPTS / "train.sh"), *options], capture_output=True, text=True
        )
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        return bad.stderr

    data = tmp_path / "train.en-de.en.bin"
    data.write_bytes(b"")
    said = refused("--data", data, "--save-dir", tmp_path / "ckpt")
    assert f"--data '{data}' is a file: give the data folder it is in" in said
    folder = tmp_path / "data"
    folder.mkdir()
    said = refused("--data", folder, "--save-dir", data)
    assert f"--save-dir '{data}' is a file, not a folder" in said
    # a folder without dictionaries; a log file that is a folder (fairseq's tracebacks)
    said = refused("--data", folder, "--save-dir", tmp_path / "c")
    assert f"data folder '{folder}' has no dictionaries (dict.*.txt)" in said
    (folder / "dict.en.txt").write_text("a 1\n")
    said = refused("--data", folder, "--save-dir", tmp_path / "c", "--log-file", tmp_path)
    assert f"--log-file '{tmp_path}' is a folder; it names the log file" in said
    checkpoint = tmp_path / "checkpoint_last.pt"  # (a log appended to it destroys it)
    checkpoint.write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)))
    before = checkpoint.read_bytes()
    said = refused("--data", folder, "--save-dir", tmp_path / "c", "--log-file", checkpoint)
    assert f"--log-file '{checkpoint}' holds binary data, not a log" in said
    assert checkpoint.read_bytes() == before
    # folders nothing can be written in (even by root): fairseq's traceback at its first
    # log line or checkpoint
    said = refused("--data", folder, "--save-dir", "/proc/tpp-checkpoints")
    assert "--save-dir '/proc/tpp-checkpoints' cannot be written: " in said
    said = refused("--data", folder, "--save-dir", tmp_path / "c", "--log-file", "/proc/t.log")
    assert "--log-file's folder '/proc' cannot be written: " in said


def test_a_log_file_that_is_there_is_appended_to_whatever_its_folder(tmp_path):
    """fairseq appends to an existing --log-file (/dev/null to keep none, a log shared in
    a folder the user cannot write): only the file itself must take writes."""
    from tpp_tools import train

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dict.en.txt").write_text("a 1\n")

    def check(log_file):
        options = ["--data", str(tmp_path / "data"), "--save-dir", str(tmp_path / "c")]
        args = train.parse_args([*options, "--log-file", log_file])
        train.fairseq_command(args)
        train.check_paths(args)

    check("/proc/self/fd/2")  # an open file in a folder nothing can create files in
    with pytest.raises(train.TrainError, match="--log-file's folder '/proc' cannot be written"):
        check("/proc/t.log")


def test_tpp_train_finds_fairseq_train_beside_its_python_without_the_environment(tmp_path):
    """Run by its path, its environment not activated (PATH without it)."""
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "tpp-train"), "--dry-run", "--preset", "tiny"],
        env={
            **{k: v for k, v in tool_env().items() if k != "TPP_FAIRSEQ_CHECKS"},
            "PATH": "/usr/bin:/bin",
        },
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    command = shlex.split(shown.stdout)
    assert command[0] == "TPP_FAIRSEQ_CHECKS=all"
    assert command[1] == str(Path(sys.executable).parent / "fairseq-train")


def test_train_sh_takes_the_projects_environment_where_python3_lacks_the_project(tmp_path):
    """The README's ``scripts/train.sh`` in a shell without the environment activated
    ended in "No module named tpp_tools", and from the clone's root (where any python3
    finds tpp_tools) ran a fairseq-train from PATH: it takes the clone's .venv/ (here a
    stand-in beside a copy of the script) or TPP_VENV, or says what to do."""
    (tmp_path / "scripts").mkdir()
    script = shutil.copy(SCRIPTS / "train.sh", tmp_path / "scripts" / "train.sh")
    (tmp_path / "bin").mkdir()
    # a python3 without fairseq (no site-packages), run from the root: tpp_tools is found
    (tmp_path / "bin" / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    (tmp_path / "bin" / "python3").chmod(0o755)
    env = {
        **{k: v for k, v in tool_env().items() if k not in ("TPP_FAIRSEQ_CHECKS", "TPP_VENV")},
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
    }
    env.pop("PYTHON", None)

    def run(**variables):
        return subprocess.run(
            ["bash", script, "--dry-run", "--preset", "tiny"],
            env={**env, **variables},
            cwd=REPO,
            capture_output=True,
            text=True,
        )

    refused = run()
    venv = tmp_path / "scripts" / ".." / ".venv"
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr == (
        f"train.sh: error: neither python3 nor {venv}/bin/python imports fairseq and "
        "tpp_tools: activate the environment they are installed in (make env builds "
        ".venv/), or set PYTHON or TPP_VENV\n"
    )
    assert run(PYTHON=str(tmp_path / "bin" / "python3")).returncode == 2
    elsewhere = tmp_path / "env"
    for folder in (tmp_path / ".venv", elsewhere):
        (folder / "bin").mkdir(parents=True)
        (folder / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (folder / "bin" / "python").chmod(0o755)
    beside = Path(sys.executable).parent / "fairseq-train"
    for shown in (run(), run(TPP_VENV=str(elsewhere))):
        assert shown.returncode == 0, shown.stderr
        assert shlex.split(shown.stdout)[1] == str(beside)


def test_a_lock_left_to_a_dead_trainers_loaders_is_waited_for(tmp_path):
    """Issue probe: scripts/train.sh killed with SIGKILL; fairseq's data loader processes
    inherit the save dir's lock and hold it a few seconds more, and an immediate restart
    was refused, naming the dead trainer. Now the restart waits for them; a lock whose
    process lives is refused at once, as before."""
    import socket
    import sys
    import time

    from tpp_tools.train import LOADER_GRACE, TrainError, take_lock

    lock = tmp_path / ".lock"
    hold = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n"
    )
    gone = subprocess.Popen(["true"])
    gone.wait()
    lock.write_text(f"process {gone.pid} on host {socket.gethostname()}, started now: x\n")
    loader = subprocess.Popen(
        [sys.executable, "-c", hold, str(lock), "2"], stdout=subprocess.PIPE, text=True
    )
    assert loader.stdout.readline() == "held\n"
    started = time.monotonic()
    fd = take_lock(tmp_path, ["tpp-train"])
    assert loader.poll() == 0 and time.monotonic() - started < LOADER_GRACE
    assert f"process {os.getpid()} on host" in lock.read_text()
    os.close(fd)

    alive = subprocess.Popen(
        [sys.executable, "-c", hold, str(lock), "60"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert alive.stdout.readline() == "held\n"
        lock.write_text(f"process {alive.pid} on host {socket.gethostname()}, started now: x\n")
        started = time.monotonic()
        with pytest.raises(TrainError, match=f"process {alive.pid} on host"):
            take_lock(tmp_path, ["tpp-train"])
        assert time.monotonic() - started < 1, "a live holder is not waited for"
    finally:
        alive.kill()
        alive.wait()


def test_torchrun_ranks_given_their_options_by_the_user_are_joined(monkeypatch):
    """fairseq joins ranks given --distributed-world-size in either form; the advice for
    ranks it would not join counts the processes of one node."""
    from tpp_tools.train import TrainError, check_joined

    for name, value in (("TORCHELASTIC_RUN_ID", "r"), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    given = ["--distributed-init-method=env://", "--distributed-rank=0"]
    for form in (["--distributed-world-size=4"], ["--distributed-world-size", "4"]):
        check_joined(["fairseq-train", "data", "--cpu", *given, *form])
    with pytest.raises(TrainError) as refused:
        check_joined(["fairseq-train", "data", "--cpu", *given])
    assert "torchrun started 4 processes" in str(refused.value)
    assert "torchrun --no-python --nproc_per_node 2 tpp-fairseq-rank" in str(refused.value)
