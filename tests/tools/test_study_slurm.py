"""tpp-study --launcher slurm without a cluster: the paper-scale configuration, the plan
of the jobs, and the errors before anything is submitted. The jobs themselves run on a
real SLURM in tests/e2e/test_slurm.py."""

import argparse
import os
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from support import run_main_here, tool_env
from tpp_tools import study, train
from tpp_tools.study import slurm as study_slurm


def prepared_folder(root: Path, test_size: int = 3) -> Path:
    """A stand-in prepared data folder (dictionaries, .idx headers, tag dictionaries) and
    its raw test reference: what planning reads, no data."""
    data = root / "data"
    data.mkdir(parents=True)
    for name in ("en", "de", "pos", "ner"):
        (data / f"dict.{name}.txt").write_text("a 1\nb 2\n")
    for split, size in (("train", 10), ("valid", 3), ("test", test_size)):
        for lang in (
            "en",
            "de",
        ):  # fairseq's MMapIndexedDataset header: magic, version, dtype, size
            (data / f"{split}.en-de.{lang}.idx").write_bytes(
                b"MMIDIDX\x00\x00" + struct.pack("<QBQ", 1, 4, size)
            )
    (root / "test.de").write_text("".join(f"line {i}\n" for i in range(test_size)))
    return data


def tpp_study(*args, env=None):
    return subprocess.run(
        [str(Path(sys.executable).parent / "tpp-study"), *map(str, args)],
        env=env or tool_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def tpp_study_here(*args):
    """``tpp-study ARGS`` run by its ``main`` in this process (:func:`support.run_main_here`)."""
    return run_main_here(study.main, ["tpp-study", *args])


def test_wmt14_big_is_the_big_preset_trained_by_the_recipe(monkeypatch):
    """The sizes are transformer_pp_wmt_en_de_big's; budget, schedule and batch are
    tpp-train's for that preset, on 4 GPUs."""
    from tpp_plugin.models.transformer_pp.presets import transformer_pp_wmt_en_de_big

    preset = argparse.Namespace()
    transformer_pp_wmt_en_de_big(preset)
    cfg = study.CONFIGS["wmt14-big"]
    assert (cfg.embed_dim, cfg.ffn_dim, cfg.heads, cfg.layers) == (
        preset.encoder_embed_dim,
        preset.encoder_ffn_embed_dim,
        preset.encoder_attention_heads,
        preset.encoder_layers,
    )
    assert (
        preset.decoder_embed_dim,
        preset.decoder_ffn_embed_dim,
        preset.decoder_attention_heads,
        preset.decoder_layers,
    ) == (cfg.embed_dim, cfg.ffn_dim, cfg.heads, cfg.layers)
    assert (cfg.dropout, cfg.attention_dropout, cfg.activation_dropout) == (
        preset.dropout,
        preset.attention_dropout,
        preset.activation_dropout,
    )
    assert preset.share_decoder_input_output_embed and not getattr(
        preset, "share_all_embeddings", False
    )
    assert cfg.shared_embeddings == "decoder" and cfg.gpus == 4

    for variable, _ in train.SETTINGS.values():
        monkeypatch.delenv(variable, raising=False)
    recipe = train.fairseq_command(train.parse_args(["--preset", "en-de", "--no-fp16"]))
    args = argparse.Namespace(
        variants=["hybrid+tags"], seeds=[1, 2], extra=[], device="cuda", out=Path("out")
    )
    ours = study.plan_runs(args, cfg, Path("data"))[0].train_cmd
    assert ours[0] == "tpp-train"
    ours = train.fairseq_command(train.parse_args(ours[1:]))  # the fairseq-train it runs

    def value(cmd, option):
        return cmd[len(cmd) - 1 - cmd[::-1].index(option) + 1]  # fairseq keeps the last

    for option in (
        "--lr",
        "--warmup-updates",
        "--max-tokens",
        "--update-freq",
        "--max-update",
        "--label-smoothing",
        "--save-interval-updates",
        "--keep-interval-updates",
    ):
        assert float(value(ours, option)) == float(value(recipe, option)), option
    optimizer = train.option_words(train.OPTIMIZER)
    start = ours.index(optimizer[0])
    assert ours[start : start + len(optimizer)] == optimizer
    assert value(ours, "--distributed-world-size") == "4" and "--fp16" in ours
    assert "--share-decoder-input-output-embed" in ours and "--share-all-embeddings" not in ours
    assert value(ours, "--update-epoch-batch-itr") == "True"


def test_new_fields_keep_the_identity_of_runs_made_before_them(tmp_path):
    """gpus=1 and shared_embeddings="all" are what every run had before the fields existed."""
    from dataclasses import replace

    args = argparse.Namespace(
        variants=["transformer"], seeds=[1, 2], extra=[], device="cpu", out=tmp_path
    )
    data = prepared_folder(tmp_path)
    cfg = study.CONFIGS["cpu"]
    before = [r.folder.name for r in study.plan_runs(args, cfg, data)]
    spec = study.plan_runs(args, cfg, data)[0].spec
    assert "gpus" not in spec["config"] and "shared_embeddings" not in spec["config"]
    assert [r.folder.name for r in study.plan_runs(args, replace(cfg, gpus=2), data)] != before
    assert [
        r.folder.name
        for r in study.plan_runs(args, replace(cfg, shared_embeddings="decoder"), data)
    ] != before


def test_dry_run_plans_the_paper_scale_jobs_without_a_cluster(tmp_path):
    data = prepared_folder(tmp_path)
    out = tmp_path / "out"
    shown = tpp_study(
        "--config",
        "wmt14-big",
        "--launcher",
        "slurm",
        "--data",
        data,
        "--test-reference",
        tmp_path / "test.de",
        "--out",
        out,
        "--variants",
        "transformer,hybrid,hybrid+tags",
        "--seeds",
        "1,2,3",
        "--partition",
        "gpu",
        "--time-limit",
        "2-00:00:00",
        "--sbatch-option",
        "mem=64G",
        "--dry-run",
        "--",
        "--patience",
        "5",
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    planned = [line.split()[0] for line in lines if " [to train] " in line]
    assert planned == [
        f"{v}-s{s}" for s in (1, 2, 3) for v in ("transformer", "hybrid", "hybrid+tags")
    ]
    commands = [shlex.split(line) for line in lines if line.strip().startswith("tpp-train")]
    assert len(commands) == 9
    for cmd in commands:
        assert cmd[cmd.index("--distributed-world-size") + 1] == "4"
        assert (
            cmd[cmd.index("--update-freq") + 1] == "10"
            and cmd[cmd.index("--max-update") + 1] == "320000"
        )
        assert cmd[cmd.index("--encoder-embed-dim") + 1] == "1024" and "--fp16" in cmd
        # the configuration's extra options and the user's, each once
        assert cmd.count("--update-epoch-batch-itr") == 1, cmd
        assert cmd[cmd.index("--update-epoch-batch-itr") + 1] == "True"
        assert cmd.count("--patience") == 1 and cmd[-2:] == ["--patience", "5"], cmd
    assert lines[-1].startswith(
        "SLURM: one job per run not finished: partition gpu, 4 GPUs, 16 CPUs, --mem=64G, "
        "time limit 48:00:00, --requeue"
    ), lines[-1]
    assert "one task on one node, whose fairseq-train starts its 4 data-parallel ranks" in lines[-1]
    # the sbatch script of the first run's job, as it will be submitted
    script = shown.stdout[shown.stdout.index("#!/bin/bash") :]
    for line in (
        "#SBATCH --job-name=tpp-transformer-s1",
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=16",
        "#SBATCH --mem=64G",
        "#SBATCH --time=2880",
        "#SBATCH --requeue",
    ):
        assert line in script.splitlines(), (line, script)
    assert [line for line in script.splitlines() if line.startswith("#SBATCH --mem")] == [
        "#SBATCH --mem=64G"
    ]

    def planned(*options):  # the wmt14-big study on this cluster, planned only
        return tpp_study_here(
            *("--config", "wmt14-big", "--launcher", "slurm", *options, "--data", data),
            *("--test-reference", tmp_path / "test.de", "--out", out, "--dry-run"),
        )

    # the memory a run's job asks for by default: per GPU
    default = planned()
    assert "#SBATCH --mem=48G" in default.stdout.splitlines(), default.stdout[-2000:]
    assert not (out / "slurm").exists() and not (out / "runs").exists()
    # --mem 0: all of the node's memory, as sbatch reads it; --mem wins over mem=
    whole = planned("--mem", "0", "--sbatch-option", "mem=8G")
    assert [line for line in whole.stdout.splitlines() if line.startswith("#SBATCH --mem")] == [
        "#SBATCH --mem=0"
    ], whole.stdout[-2000:] + whole.stderr[-2000:]
    assert "--mem=0 (all of a node's memory)" in whole.stdout, whole.stdout[-2000:]


def test_the_report_hint_puts_report_only_among_the_studys_options():
    with_option = study_slurm.with_option
    assert with_option("tpp-study --out o -- --patience 5", "--report-only") == (
        "tpp-study --out o --report-only -- --patience 5"
    )
    assert with_option("tpp-study --out 'a b'", "--report-only") == (
        "tpp-study --out 'a b' --report-only"
    )


def test_time_limits_in_slurm_formats():
    assert [
        study_slurm.time_minutes(t)
        for t in ("90", "90:30", "1:00:00", "2-00:00:00", "1-12", "0:0:1")
    ] == [90, 91, 60, 2880, 2160, 1]
    for bad in ("", "1h", "1:xx", "0"):
        with pytest.raises(ValueError):
            study_slurm.time_minutes(bad)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--partition", "gpu"], "--partition is an option of --launcher slurm"),
        (
            ["--launcher", "slurm", "--time-limit", "1h"],
            "--time-limit: not a SLURM time limit: '1h'",
        ),
        (
            ["--launcher", "slurm", "--time-limit", "2"],
            "--time-limit 2: a run's job is told 2 minutes before its limit",
        ),
        (["--launcher", "slurm", "--sbatch-option", "mem"], "--sbatch-option: expected KEY=VALUE"),
        (["--launcher", "slurm", "--mem", "1.5G"], "--mem: expected a size as sbatch takes it"),
        (["--launcher", "slurm", "--mem", "00"], "--mem: expected a size as sbatch takes it"),
        (
            ["--gpus-per-run", "2"],
            "--gpus-per-run 2 trains each run on GPUs: not with --device cpu",
        ),
    ],
)
def test_bad_options_are_errors_naming_them(tmp_path, options, message):
    data = prepared_folder(tmp_path)
    shown = tpp_study_here(
        "--config",
        "cpu",
        "--device",
        "cpu",
        "--data",
        data,
        "--test-reference",
        tmp_path / "test.de",
        "--out",
        tmp_path / "out",
        *options,
    )
    assert shown.returncode == 2 and f"tpp-study: error: {message}" in shown.stderr, shown.stderr
    assert "Traceback" not in shown.stderr


def test_without_slurm_commands_nothing_is_prepared_or_submitted(tmp_path):
    data = prepared_folder(tmp_path)
    out = tmp_path / "out"
    env = dict(tool_env(), PATH=str(Path(sys.executable).parent))  # no sbatch, srun, squeue...
    shown = tpp_study(
        "--config",
        "cpu",
        "--device",
        "cpu",
        "--launcher",
        "slurm",
        "--data",
        data,
        "--test-reference",
        tmp_path / "test.de",
        "--out",
        out,
        env=env,
    )
    assert shown.returncode == 2, shown.stderr
    assert (
        "--launcher slurm: sbatch, srun, squeue, sinfo, scontrol, scancel not found on PATH"
        in shown.stderr
    )
    assert "--launcher local" in shown.stderr
    assert not (out / "slurm").exists() and not (out / "runs").exists()
    assert os.listdir(out) == [".lock"] or os.listdir(out) == []


def test_gpu_slots_give_each_run_its_gpus():
    """Locally, a run of --gpus-per-run N takes N of the visible GPUs."""
    slots = study.gpu_slots(3, [str(i) for i in range(8)], 4)
    assert [slots.get() for _ in range(3)] == ["0,1,2,3", "4,5,6,7", "0,1,2,3"]
    assert study.gpu_slots(1, ["0", "1"]).get() == "0"
    with pytest.raises(study.StudyError, match="each run trains on 4 GPUs .* but 2 are visible"):
        study.gpu_slots(1, ["0", "1"], 4)


def test_the_jobs_python_in_a_folder_with_spaces_is_one_word(tmp_path, monkeypatch):
    """submitit puts ``python`` into each job's shell command line as it is given: an
    environment under a folder with spaces submitted jobs that all failed at start."""
    python = tmp_path / "my env" / "bin" / "python"
    monkeypatch.setenv("TPP_VENV", str(python.parents[1]))
    ex = study_slurm.executor(argparse.Namespace(out=tmp_path / "out"), {})
    assert shlex.split(ex._submitit_command_str)[:2] == [str(python), "-u"]
