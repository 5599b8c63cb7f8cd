"""The benchmark scripts that count rather than time (their figures are the same on every
machine, so they can be checked): attention_shapes against fairseq's own batches, and
every benchmark's refusal of ``--device cuda`` where there is none. The scripts are run as
the docs run them, ``python -m benchmarks.NAME`` from the project's root."""

import argparse
import collections
import json
import random
import re
import statistics
import subprocess
import sys

import pytest
import torch

from benchmarks import bench_decode_step, bench_model, harness, precision_ratio, profile_model
from support import REPO, binarize, binarize_tagged, run, write_corpus


def run_benchmark(name, *args, check=True):
    """``python -m benchmarks.NAME ARGS...``, run from the project's root."""
    return run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=REPO, check=check)


def sentence(rng, n):
    return " ".join(f"w{rng.randrange(30)}" for _ in range(n))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Pairs of many lengths (so that batches differ in size and length), three test
    sentences whose target lengths the beam-search count is worked out from by hand."""
    rng = random.Random(3)
    root = tmp_path_factory.mktemp("shapes")
    train = [
        (sentence(rng, rng.randint(1, 12)), sentence(rng, rng.randint(1, 12))) for _ in range(300)
    ]
    test = [
        (sentence(rng, 4), sentence(rng, 2)),
        (sentence(rng, 5), sentence(rng, 4)),
        (sentence(rng, 3), sentence(rng, 1)),
    ]
    write_corpus(root / "raw", {"train": train, "valid": train[:5], "test": test})
    return binarize(root / "raw", root / "bin")


def table_row(text, heading):
    """The numbers of the first table row after ``heading`` (thousands separators removed)."""
    section = text.split(heading, 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| ") and line[2].isdigit())
    return [int(x.replace(",", "")) for x in re.findall(r"(?<![\w.])\d[\d,]*(?![\d.%])", row)]


def fairseq_batches(data, split, **batching):
    """The samples fairseq's own batch iterator gives (epoch 1, shuffled as fairseq-train
    shuffles), collated: their tensors' shapes are what the attention sees. With the
    plugin loaded, as in every run of ours (it keeps a last batch that fairseq-fixed
    drops)."""
    from fairseq import options, tasks

    import tpp_plugin  # noqa: F401

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, input_args=[str(data), "--arch", "transformer", "--task", "translation"]
    )
    task = tasks.setup_task(args)
    task.load_dataset(split)
    itr = task.get_batch_iterator(
        dataset=task.dataset(split),
        max_positions=(1024, 1024),
        seed=1,
        ignore_invalid_inputs=True,
        **batching,
    )
    return list(itr.next_epoch_itr(shuffle=split == "train"))


def test_training_problems_are_those_of_fairseqs_batches(data):
    out = run_benchmark("attention_shapes", "--data", data, "--max-tokens", "64").stdout
    batches, sentences, encoder, decoder, new_steps = table_row(out, "### Training")[:5]
    samples = fairseq_batches(data, "train", max_tokens=64, required_batch_size_multiple=8)
    pad = 1
    seen, expected_new = set(), 0
    enc, dec = set(), set()
    for sample in samples:
        tokens = sample["net_input"]["src_tokens"]  # B x S, left-padded
        b, s = tokens.shape
        e = ("encoder", b, s, bool(tokens.eq(pad).any()))
        d = ("decoder", *sample["net_input"]["prev_output_tokens"].shape)
        enc.add(e)
        dec.add(d)
        expected_new += bool({e, d} - seen)
        seen |= {e, d}
    assert batches == len(samples) and sentences == 300
    assert (encoder, decoder) == (len(enc), len(dec))
    assert new_steps == expected_new
    assert 1 < len(enc) < len(samples)  # the data exercise both a repeat and a new problem


def test_beam_search_problems_worked_out_by_hand(data, capsys):
    """Test targets of 2, 4 and 1 words (3, 5 and 2 tokens with EOS), one batch, beam 2:
    steps t = 0..4 have 3, 3, 2, 1, 1 sentences left, so the problems (rows, key length)
    are (6, 1), (6, 2), (4, 3), (2, 4), (2, 5): five steps, five problems, all new.
    (attention_shapes' main in this process: the tests above run it as a module.)"""
    from benchmarks import attention_shapes

    assert attention_shapes.main(["--data", str(data), "--batch-size", "3", "--beam", "2"]) == 0
    out = capsys.readouterr().out
    assert table_row(out, "### Beam search") == [5, 5, 5]
    # two batches (2 + 1 sentences) of the same data: the second repeats no problem of the
    # first except where rows and key length coincide
    assert attention_shapes.main(["--data", str(data), "--batch-size", "2", "--beam", "2"]) == 0
    out = capsys.readouterr().out
    steps, problems, new = table_row(out, "### Beam search")
    samples = fairseq_batches(data, "test", max_sentences=2)
    lengths = [sorted(s["target"].ne(1).sum(1).tolist()) for s in samples]
    expected = {(2 * sum(n > t for n in ls), t + 1) for ls in lengths for t in range(ls[-1])}
    assert steps == sum(ls[-1] for ls in lengths) and problems == new == len(expected)


def test_operator_counts_with_the_triton_kernels_counted_on_the_cpu(data):
    """``count_ops --triton-launches``: the conv heads take their GPU path and each
    kernel launch is counted: three per hybrid layer with ``tpp-triton`` (LocalConv's
    forward and two backward), four with ``tpp-fused`` (the whole conv heads forward,
    three backward), whose layers issue fewer ATen operators. (One layer each side: the
    kernels' launches are counted per layer.)"""
    out = run_benchmark(
        "count_ops", "--data", data, "--size", "128", "--layers", "1",
        "--models", "tpp-triton,tpp-fused", "--triton-launches",
    ).stdout  # fmt: skip
    assert "beam-search" not in out
    rows = count_table(out, "operators per training batch")
    assert rows["Triton"][2:] == ["6.0", "8.0"], out  # 1 + 1 hybrid layers
    assert float(rows["total"][5]) < float(rows["total"][1]), out  # launches: fused < triton
    fused = read_back(out, "tpp-fused")
    assert fused and read_back(out) == fused, "the fused heads read nothing back"


def count_table(out, title):
    """The rows of one of count_ops' tables, by their first word."""
    section = out.split(f"\n{title}", 1)[1].split("\n\n", 1)[0]
    return {line.split()[0]: line.split() for line in section.splitlines()[1:] if line.strip()}


@pytest.fixture(scope="module")
def op_counts(data):
    """count_ops' output for transformer, transformer-sync and tpp (3+3 layers), read by
    the two tests below (one run: its beam search, which they do not read, made short)."""
    return run_benchmark(
        "count_ops", "--data", data, "--size", "128", "--layers", "3",
        "--models", "transformer,transformer-sync,tpp",
        "--gen-batch", "1", "--beam", "1", "--short", "1", "--long", "2",
    ).stdout  # fmt: skip


def test_operators_of_an_update_outside_forward_and_backward(data, op_counts):
    """A whole update's other operators (the optimizer, the master copy, the gradient norm,
    fairseq's meters), counted as on one GPU (``--bf16``'s master copy flat): syncing the
    flat copy by multi-tensor copies (``transformer-sync``) saves one launch per parameter
    tensor each way, less the one multi-tensor copy."""
    out = op_counts
    rows = count_table(out, "operators per update outside the forward and backward passes")
    per_tensor, multi_tensor = float(rows["total"][1]), float(rows["total"][5])
    args = argparse.Namespace(data=data, layers=3, device="cpu", dtype="bf16", max_tokens=2048)
    cfg, task = harness.setup("transformer", 128, args)
    tensors = len([p for p in task.build_model(cfg.model).parameters() if p.requires_grad])
    assert per_tensor - multi_tensor == 2 * (tensors - 1), out
    reads = read_back(out, "transformer")
    assert read_back(out, "transformer-sync") == reads, out
    rest = {line for (part, line) in reads if part == "rest"}
    assert rest and all(line.startswith(("fairseq.trainer:", "fairseq.logging.")) for line in rest)


def read_back(out, model="tpp-triton"):
    """count_ops' reads of one model: ``{(part, line): n}``."""
    section = out.split("values read back to the host", 1)[1].split(f"\n{model}: ", 1)[1]
    found = {}
    for row in section.splitlines()[1:]:
        if not row.startswith("  "):
            break
        n, part, line = row.split()
        found[(part, line)] = int(n)
    return found


def test_values_read_back_in_training_are_counted_by_the_line_that_reads_them(op_counts):
    """Every ``.item()``/``bool(tensor)`` of a training batch's forward and backward is
    listed by its line: fairseq's encoder reads its padding flag once per layer, and
    ``transformer_pp``'s own code reads nothing (the same lines as ``transformer``)."""
    out = op_counts
    reads = {name: read_back(out, name) for name in ("transformer", "tpp")}
    assert reads["tpp"] == reads["transformer"], out
    encoder = [
        n
        for (part, line), n in reads["tpp"].items()
        if line.startswith("fairseq.models.transformer.transformer_encoder:")
    ]
    assert 3 in encoder, out  # `if has_pads`, once per encoder layer
    # the forward pass's, and the rest of the update's (fairseq's trainer and meters)
    assert {part for part, _ in reads["tpp"]} == {"forward", "rest"}, out
    assert not any(line.startswith("tpp_plugin.") for _, line in reads["tpp"]), out


def test_what_training_keeps_for_backward_is_counted_by_part():
    """``kept_for_backward``: the control keeps exactly what ``transformer`` keeps, part by
    part; the hybrid layers' self-attention keeps something else, their other parts not.
    On bench_model's synthetic corpus (no ``--data``), as docs/benchmarks.md counts it."""
    out = run_benchmark(
        "kept_for_backward", "--size", "128", "--layers", "1", "--max-tokens", "512"
    ).stdout
    table = out.split("kept for backward, MiB", 1)[1].splitlines()[2:]
    rows = {" ".join(line.split()[:-3]): line.split()[-3:] for line in table if line[:1] != "r"}
    assert "encoder self-attention" in rows and "decoder feed-forward" in rows, out
    assert all(control == base for base, control, _ in rows.values()), out
    for part, (base, _, hybrid) in rows.items():
        assert (hybrid != base) == part.endswith("self-attention") or part == "total", out
    assert "tpp-conv0 1.000x" in out, out


def test_bad_data_folder_is_named(tmp_path):
    res = run_benchmark("attention_shapes", "--data", tmp_path / "missing", check=False)
    assert res.returncode == 2 and "missing: no such folder" in res.stderr
    res = run_benchmark("attention_shapes", "--data", tmp_path, check=False)
    assert (
        res.returncode == 1
        and "Could not infer language pair" in res.stderr
        and str(tmp_path) in res.stderr
    )


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device"
)
@pytest.mark.parametrize(
    "script", ["bench_model", "count_ops", "profile_model", "kept_for_backward"]
)
def test_benchmarks_refuse_cuda_without_a_cuda_device(script, tmp_path, capsys):
    """fairseq's trainer would quietly run on the CPU, and the figures would be the CPU's.
    (Each script's main in this process: its command-line parsing refuses before anything
    else runs; the scripts run as modules in the other tests.)"""
    import importlib

    main = importlib.import_module(f"benchmarks.{script}").main
    with pytest.raises(SystemExit) as refused:
        main(["--data", str(tmp_path), "--device", "cuda"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--device cuda" in err and "no CUDA device" in err


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the stage would run its benchmark for real"
)
def test_gpu_suite_records_failures_keeps_tables_and_replaces_only_with_force(data, tmp_path):
    """An existing table is skipped without --force (nothing failed: exit 0); with
    --force, the counts stage's benchmark refusing to start without a GPU (exit 2), the
    suite never puts the failed command's output in place of the table and exits 1.
    (A failed command's status, its output under a temporary name and the environment's
    facts: test_gpu_suite_reports_a_stage_cut_off_by_its_limit_and_packs_few_files.)"""
    suite = "benchmarks/gpu_suite.sh"  # as docs/gpu.md writes it, from the project's root
    out = tmp_path / "results"
    out.mkdir()
    (out / "counts.md").write_text("an earlier table\n")
    res = run([suite, data, out, "counts"], cwd=REPO)
    assert "counts.md\tskipped: it exists (--force replaces it)" in res.stdout
    res = run([suite, "--force", data, out, "counts"], cwd=REPO, check=False)
    assert res.returncode == 1 and "\ncounts\tcounts.md\texit 2" in res.stdout
    assert (out / "counts.md").read_text() == "an earlier table\n"
    # ... and not shown as this run's
    assert "(counts.md is an earlier run's: this one ended: exit 2)\nan earlier table" in res.stdout


def test_gpu_suite_takes_folders_relative_to_where_it_is_run(data, tmp_path):
    """DATA and OUT given relative to the caller's folder, the suite run from outside
    the project (which it moves to): the status and the logs land in OUT there."""
    (tmp_path / "data").symlink_to(data)
    res = run(
        [REPO / "benchmarks" / "gpu_suite.sh", "data", "results", "counts"],
        cwd=tmp_path,
        check=False,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    out = tmp_path / "results"
    assert "counts\tcounts.md\texit 2" in (out / "status.txt").read_text()
    assert "no CUDA device" in (out / "counts.md.log").read_text()
    assert str(out) in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the stages would run for real")
def test_gpu_suite_stops_at_its_budget_and_says_what_did_not_run(data, tmp_path):
    """--budget: the mixed stage's first fairseq-train (base size, here on the
    CPU: minutes) is cut off when the budget runs out, its output kept as a partial
    table and no process of it left behind; every command after it is recorded as not
    run, and the suite exits 1. (A command that ends within the budget is recorded as
    before: test_a_stage_asked_for_alone_has_the_whole_budget.)"""
    out = tmp_path / "results"
    res = run(
        ["benchmarks/gpu_suite.sh", "--budget", "20", data, out, "mixed", "counts"],
        cwd=REPO,
        check=False,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    lines = (out / "status.txt").read_text().splitlines()
    first = lines[0].split("\t")
    assert first[:3] == ["mixed", "mixed_transformer_fp32.txt", "exit 124"], lines
    assert first[3].endswith("(stopped: the budget of 20s ran out)")
    assert int(first[3].split("s")[0]) <= 20 + 10, "the budget, and timeout's --kill-after at most"
    assert (out / "mixed_transformer_fp32.txt.partial").exists() and not (
        out / "mixed_transformer_fp32.txt"
    ).exists()
    runs = [
        "transformer_bf16",
        "tpp_fp32",
        "tpp_bf16",
        "tpp_bf16_taps",
        "transformer_fp16",
        "tpp_fp16",
        "tpp_mefp16",
    ]
    assert [line.split("\t")[1:] for line in lines[1:]] == [
        [name, "not run: the budget of 20s is spent"]
        for name in [f"mixed_{r}.txt" for r in runs] + ["counts.md"]
    ]
    # the data folder is this module's own: any process naming it is the suite's
    left = subprocess.run(["pgrep", "-f", "--", re.escape(str(data))], capture_output=True)
    assert left.returncode == 1, "no fairseq-train of the suite is left running"


def test_an_interrupted_gpu_suite_ends_the_command_it_was_running(data, tmp_path):
    """Ctrl-C (SIGINT) or a signal to the suite while the mixed stage's first
    fairseq-train runs (in a process group of its own, which neither reaches): the suite
    ends that command's processes, notes it in status.txt, then exits with the signal's
    status."""
    import signal
    import time

    for signum, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        suite = subprocess.Popen(
            ["benchmarks/gpu_suite.sh", "--force", data, tmp_path / "results", "mixed"],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        command = ["pgrep", "-f", "--", f"fairseq_train_run model {re.escape(str(data))}"]
        while subprocess.run(command, capture_output=True).returncode != 0:
            assert (
                suite.poll() is None and time.monotonic() < deadline
            ), "fairseq-train never started"
        suite.send_signal(signum)
        assert suite.wait(timeout=60) == status
        left = subprocess.run(["pgrep", "-f", "--", re.escape(str(data))], capture_output=True)
        assert left.returncode == 1, f"no process of the suite is left running ({signum!r})"
        status_lines = (tmp_path / "results" / "status.txt").read_text().splitlines()
        assert (
            status_lines[-1]
            == "mixed\tmixed_transformer_fp32.txt\tinterrupted (the suite was stopped)"
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the stages would run for real")
def test_gpu_suite_cudnn_stage_trains_transformer_with_cudnns_attention_kept_on(data, tmp_path):
    """The cudnn stage runs its fairseq-train of transformer (cut off here by the
    stage's limit) before the d = 1024 benchmark, and its table sets that run beside the
    mixed stage's transformer_bf16."""
    out = tmp_path / "results"
    res = run(
        ["benchmarks/gpu_suite.sh", "--limit", "cudnn=5", data, out, "cudnn"],
        cwd=REPO,
        check=False,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    lines = [line.split("\t")[:3] for line in (out / "status.txt").read_text().splitlines()]
    assert lines == [
        ["cudnn", "mixed_transformer_bf16_cudnn.txt", "exit 124"],
        ["cudnn", "cudnn.md", "not run: the stage's limit of 5s is spent"],
    ], lines
    summary = (out / "summary.md").read_text()
    assert "| transformer_bf16 | not run |" in summary
    assert "| transformer_bf16_cudnn | 0 |" in summary


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the stage would run for real")
def test_gpu_suite_decide_stage_stands_in_on_the_cpu(data, tmp_path):
    """--stand-in: the decide stage's seven commands run on the CPU, small, each table
    printed and packed as its command ends: training at two sizes with tpp-fused beside
    tpp and the control, then the fused conv heads' tests (collected), the multi-tensor
    sync of the master copy, the operator counts, float32 and bf16's speed-up over it."""
    out, pack = tmp_path / "results", tmp_path / "pack"
    res = run(
        ["benchmarks/gpu_suite.sh", "--stand-in", "--pack", pack, data, out, "decide"],
        cwd=REPO,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line.split("\t")[:3] for line in (out / "status.txt").read_text().splitlines()]
    files = [
        "decide_base.md",
        "decide_big.md",
        "decide_tests.txt",
        "decide_sync.md",
        "decide_counts.md",
        "decide_fp32.md",
        "decide_precision.md",
    ]
    assert lines == [["decide", f, "exit 0"] for f in files], lines
    summary = (pack / "summary.md").read_text()
    assert summary == (out / "summary.md").read_text()
    assert "test_query_triton.py" in (out / "decide_tests.txt").read_text()
    for table, size in (("decide_base.md", 128), ("decide_big.md", 256)):
        text = (out / table).read_text()
        assert f"d={size}" in text and "2+2 layers" in text and "bf16" in text, text
        assert "| tpp-fused |" in text, text
        assert re.search(r"\| transformer-b \| \d\.\d\d× \(paired", text), "the control's ratio"
    assert "| transformer-sync |" in (out / "decide_sync.md").read_text()
    assert "tpp-fused" in (out / "decide_counts.md").read_text()
    assert "fp32" in (out / "decide_fp32.md").read_text()
    ratios = (out / "decide_precision.md").read_text()
    for model in ("transformer", "tpp", "tpp-fused"):
        row = rf"\| 128 \| {model} \| [\d,]+ \| [\d,]+ \| \d+\.\d\d× \(median of 2 batches\) \|"
        assert re.search(row, ratios), ratios
    # printed as each command ends, before the next one's status line
    assert res.stdout.index("### decide: decide_base.md") < res.stdout.index(
        "decide\tdecide_big.md"
    )
    assert {p.name for p in pack.iterdir()} == {"summary.md", "status.txt", "gpu_results.tar.gz"}
    # the two deciding tables again at the end, where a cut-off output keeps its last lines
    tail = res.stdout[-4000:]
    for table in ("decide_base.md", "decide_big.md"):
        assert f"### decide: {table} (again)" in tail and "| tpp-fused |" in tail, tail
    assert summary.count("### decide: decide_base.md") == 1, "summary.md has each table once"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the stages would run for real")
def test_gpu_suite_reports_a_stage_cut_off_by_its_limit_and_packs_few_files(data, tmp_path):
    """--limit: the mixed stage stops at its own limit (its first run cut off, the
    others not run) and the next stage still runs; every stage's table is printed as it
    ends and gathered in summary.md; --pack leaves three files, the archive holding every
    log, the cut-off run's partial output included. A second call skips what exists.
    Without a GPU the counts stage's benchmark refuses to start (exit 2): the suite
    records that, with the environment's facts, and leaves the output under a temporary
    name, not in place of a table."""
    out, pack = tmp_path / "results", tmp_path / "pack"
    res = run(
        [
            "benchmarks/gpu_suite.sh",
            "--limit",
            "mixed=5",
            "--pack",
            pack,
            data,
            out,
            "mixed",
            "counts",
        ],
        cwd=REPO,
        check=False,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    lines = (out / "status.txt").read_text().splitlines()
    fields = lines[0].split("\t")
    assert fields[2] == "exit 124" and len(fields) == 4, lines
    assert lines[0].endswith("(stopped: the stage's limit of 5s ran out)"), lines
    assert lines[1].split("\t")[1:] == [
        "mixed_transformer_bf16.txt",
        "not run: the stage's limit of 5s is spent",
    ]
    assert lines[-1].split("\t")[:3] == ["counts", "counts.md", "exit 2"], "the next stage runs"
    # without a GPU the counts stage's benchmark refuses to start (exit 2): recorded, its
    # output left under a temporary name, never in place of a table
    facts = (out / "environment.txt").read_text()
    assert f"torch {torch.__version__}" in facts and "no CUDA device" in facts, facts
    assert not (out / "counts.md").exists() and (out / "counts.md.partial").exists()
    assert "no CUDA device" in (out / "counts.md.log").read_text()
    summary = (pack / "summary.md").read_text()
    assert summary == (out / "summary.md").read_text()
    for part in (
        "## mixed",
        "| transformer_fp32 | 0 |",
        "| tpp_bf16 | not run |",
        "## counts",
        "sees no CUDA device",
    ):
        assert part in summary and part in res.stdout, part
    assert res.stdout.index("## mixed") < res.stdout.index(
        "counts\tcounts.md"
    ), "printed as the stage ends"
    assert sorted(p.name for p in pack.iterdir()) == [
        "gpu_results.tar.gz",
        "status.txt",
        "summary.md",
    ]
    import tarfile

    with tarfile.open(pack / "gpu_results.tar.gz") as tar:
        names = {name.lstrip("./") for name in tar.getnames()}
    assert {
        "mixed_transformer_fp32.txt.partial",
        "mixed_transformer_fp32.txt.log",
        "counts.md.log",
        "environment.txt",
        "status.txt",
        "summary.md",
    } <= names

    (out / "mixed_transformer_fp32.txt").write_text("")  # as if it had finished
    res = run(
        ["benchmarks/gpu_suite.sh", "--limit", "mixed=1", data, out, "mixed"], cwd=REPO, check=False
    )
    assert "\nmixed\tmixed_transformer_fp32.txt\tskipped: it exists" in res.stdout, res.stdout


def test_fairseq_train_runs_are_tabled_from_fairseqs_own_log(data, tmp_path):
    """The mixed stage's table is read off fairseq-train's real JSON log: the updates,
    the loss of the last interval, fairseq's "done training in"; a run cut off before
    its first logged interval, and one not run, are said to be so."""
    res = run_benchmark(
        "fairseq_train_run",
        "train",
        data,
        "--user-dir",
        REPO / "tpp_plugin",
        "--arch",
        "transformer",
        "--encoder-layers",
        "1",
        "--decoder-layers",
        "1",
        "--encoder-embed-dim",
        "16",
        "--decoder-embed-dim",
        "16",
        "--encoder-ffn-embed-dim",
        "16",
        "--decoder-ffn-embed-dim",
        "16",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--max-tokens",
        "64",
        "--max-update",
        "4",
        "--cpu",
        "--no-save",
        "--save-dir",  # (fairseq makes it even with --no-save: not in the project)
        tmp_path / "checkpoints",
        "--disable-validation",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--no-progress-bar",
        "--num-workers",
        "0",
    )
    (tmp_path / "done.txt").write_text(res.stdout)
    (tmp_path / "cut.txt.partial").write_text(res.stdout.split("| train_inner |")[0])
    table = run_benchmark(
        "fairseq_train_run",
        "table",
        f"done={tmp_path}/done.txt",
        f"cut={tmp_path}/cut.txt",
        f"none={tmp_path}/none.txt",
    ).stdout.splitlines()
    losses = [
        json.loads(line.split("| train_inner | ")[1])["loss"]
        for line in res.stdout.splitlines()
        if "| train_inner | " in line
    ]
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[:2] == ["done", "4"] and cells[3] == f"{float(losses[-1]):.3f}"
    assert cells[4].endswith(" s") and cells[5] == "–", "no GPU: no peak memory"
    assert table[3] == "| cut | 0 | – | – | – | – |" and table[4] == "| none | not run | | | | |"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it would train")
def test_fairseq_train_run_refuses_cuda_without_a_cuda_device(data):
    res = run_benchmark("fairseq_train_run", "model", data, "tpp", "--device", "cuda", check=False)
    assert res.returncode == 2 and "--device cuda" in res.stderr and "no CUDA device" in res.stderr


def test_fairseq_train_run_trains_each_model_with_bench_models_command_line(data, tmp_path):
    """``model``: every model gets the same command line but its own options (the
    ``--arch`` presets differ in layers and dropouts; a side-by-side must not), and
    fairseq-train trains it as given."""
    from benchmarks import fairseq_train_run

    options = ["--device", "cpu", "--size", "128", "--layers", "2", "--max-tokens", "256"]
    options += ["--updates", "2", "--log-interval", "1"]
    built = {
        name: fairseq_train_run.model_arguments([str(data), name, *options, "--", "--seed", "3"])
        for name in ("transformer", "tpp", "tpp-tags")
    }
    for name, argv in built.items():
        own = harness.MODELS[name]
        start = next(i for i in range(len(argv)) if argv[i : i + len(own)] == own)
        built[name] = argv[:start] + argv[start + len(own) :]
        assert argv[-2:] == ["--seed", "3"], "the words after -- come last"
    assert built["transformer"] == built["tpp"] == built["tpp-tags"]
    words = built["tpp"]
    for option in ("--dropout", "--attention-dropout", "--activation-dropout"):
        assert words[words.index(option) + 1] == "0.1"
    assert words[words.index("--encoder-layers") + 1] == "2"

    tagged = binarize_tagged(tmp_path / "raw", tmp_path / "bin", n_train=100)
    for name, folder, trained in (
        ("tpp", data, "TransformerPPModel"),
        ("tpp-tags", tagged, "LabelSmoothedCrossEntropyWithTagsCriterion"),
    ):
        res = run_benchmark("fairseq_train_run", "model", folder, name, *options)
        inner = [
            json.loads(line.split("| train_inner | ")[1])
            for line in res.stdout.splitlines()
            if "| train_inner | " in line
        ]
        assert [r["num_updates"] for r in inner] == ["1", "2"], res.stdout[-2000:]
        assert "attention_dropout=0.1" in res.stdout and trained in res.stdout, res.stdout[-3000:]
    assert "pos_loss" in inner[-1], inner[-1]  # the tag losses trained


@pytest.mark.parametrize(
    "args, message",
    [
        (["{data}", "{out}", "speed", "bogus"], "unknown stage 'bogus'"),
        (["--limit", "speed=soon", "{data}", "{out}"], "--limit takes STAGE=SECONDS"),
        (["--limit", "bogus=10", "{data}", "{out}"], "--limit takes STAGE=SECONDS"),
        (["--budget", "ten", "{data}", "{out}"], "--budget takes a whole number of seconds"),
        (["--budget", "0", "{data}", "{out}"], "--budget takes a whole number of seconds"),
        (["{out}/missing", "{out}"], "is not a folder"),
        (["--froce", "{data}", "{out}"], "unknown option '--froce'"),
        ([], "Usage:"),
    ],
)
def test_gpu_suite_rejects_bad_arguments_before_running_anything(args, message, data, tmp_path):
    out = tmp_path / "results"
    args = [a.format(data=data, out=out) for a in args]
    res = run(["benchmarks/gpu_suite.sh", *args], cwd=REPO, check=False)
    assert res.returncode == 2 and message in res.stdout + res.stderr
    assert not (out / "status.txt").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "5m", "--results", "r", "--only", "hybrid-s1"], "not '5m'"),
        (["--only", "hybrid-s1", "--results"], "--results needs a value"),
        (["--results", "--only", "hybrid-s1"], "--results needs a value"),
        (["--results", "r"], "Usage"),
    ],
)
def test_gpu_study_refuses_bad_arguments_before_anything(args, message, tmp_path):
    """(a missing value was bash's 'unbound variable'; a bad budget only the usage)"""
    res = run(["bash", REPO / "benchmarks" / "gpu_study.sh", *args], cwd=tmp_path, check=False)
    assert res.returncode == 2 and message in res.stdout + res.stderr, res.stderr
    assert not list(tmp_path.iterdir()), "nothing made"


def test_mfu_takes_the_peak_of_the_gpu_variant_named():
    """The H100's PCIe and NVL variants are slower than the SXM one, whose name says
    neither: each gets its own peak, not the first H100 entry."""
    assert bench_model.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bench_model.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench_model.peak_tflops("NVIDIA H100 NVL") == 835.0
    assert bench_model.peak_tflops("NVIDIA H200") == 989.0
    assert bench_model.peak_tflops("a CPU") is None


def test_decode_step_benchmark_times_every_model_at_every_row_count():
    res = run_benchmark(
        "bench_decode_step",
        "--rows",
        "2,3",
        "--steps",
        "8",
        "--warmup",
        "1",
        "--cached",
        "4",
        "--kernel",
        "3",
        "--dilation",
        "2",
        "--dim",
        "64",
    )
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in res.stdout.splitlines()
        if re.match(r"\| \d", line)
    ]
    assert [(r[0], r[1]) for r in rows] == [
        (n, m) for n in ("2", "3") for m in ("mha", "mha-b", "tpp")
    ]
    assert all(float(r[2].replace(",", "")) > 0 for r in rows)
    assert [r[3] for r in rows if r[1] == "mha"] == ["1.00×", "1.00×"]


@pytest.mark.parametrize("tpp", ["tpp", "tpp-triton"])
def test_decode_step_benchmark_times_a_step_of_fixed_cache_length_and_fairseqs_reordering(
    tpp, monkeypatch
):
    """Every timed unit starts from the prepared state (the caches do not grow from unit
    to unit), and reorders as fairseq's decoder does: the module and each submodule with
    a reorder_incremental_state (the hybrid attention's LocalConv and Query keep their
    own states). ``tpp-triton`` runs its kernel (through Triton's interpreter on a CPU:
    the unit the GPU runs time), the PyTorch step none."""
    args = bench_decode_step.parse_args(
        [
            "--rows",
            "3",
            "--steps",
            "5",
            "--warmup",
            "2",
            "--cached",
            "6",
            "--dim",
            "64",
            "--models",
            f"mha,mha-b,{tpp}",
        ]
    )
    triton_steps = []
    kernels = bench_decode_step.plugin().modules.conv_heads_triton
    step = kernels.conv_step
    monkeypatch.setattr(
        kernels, "conv_step", lambda *a, **k: triton_steps.append(1) or step(*a, **k)
    )
    x, order, units = bench_decode_step.prepare(3, args)
    _, _, reorder = units[tpp]
    assert sorted(type(fn.__self__).__name__ for fn in reorder) == [
        "ContextQuery",
        "HybridMultiheadAttention",
        "LocalConv",
    ]
    times = bench_decode_step.time_units(x, order, units, args)
    assert {name: len(t) for name, t in times.items()} == {"mha": 5, "mha-b": 5, tpp: 5}
    # 6 prepared steps, 2 untimed and 5 timed units, each one step
    assert len(triton_steps) == (13 if tpp == "tpp-triton" else 0)
    for name, (_, base, _) in units.items():
        # fairseq's prev_key (B x H x t x dh) and ours (B x Ha x 2 x t x dh): still 6 positions
        lengths = [v[k].shape[-2] for v in base.values() for k in ("prev_key", "prev_kv") if k in v]
        assert lengths == [6], name


def test_decode_step_benchmark_times_the_general_path_as_tpp_general(monkeypatch):
    """``tpp-general`` decodes its timed units through ``forward``'s general path, ``tpp``
    through the one-token step, from states of the same format."""
    args = bench_decode_step.parse_args(
        ["--rows", "3", "--steps", "4", "--warmup", "1", "--cached", "5", "--dim", "64"]
        + ["--models", "mha,tpp,tpp-general"]
    )
    attention = bench_decode_step.plugin().modules.HybridMultiheadAttention
    step, steps = attention._decode_step, []
    monkeypatch.setattr(
        attention, "_decode_step", lambda self, *a: steps.append(self) or step(self, *a)
    )
    x, order, units = bench_decode_step.prepare(3, args)
    general = units["tpp-general"][0]
    assert not any(p.requires_grad for p in general.parameters())
    steps.clear()  # the prepared states: both by the step
    times = bench_decode_step.time_units(x, order, units, args)
    assert {name: len(t) for name, t in times.items()} == {"mha": 4, "tpp": 4, "tpp-general": 4}
    assert steps.count(units["tpp"][0]) == 5 and general not in steps, "1 untimed + 4 timed"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--models", "tpp"], "must start with mha"),
        (["--models", "mha,lstm"], "unknown lstm"),
        (["--rows", "5,x"], "--rows: comma-separated whole numbers, got '5,x'"),
        (["--dim", "130"], "must split into"),
    ],
)
def test_decode_step_benchmark_rejects_bad_arguments(args, message):
    res = run_benchmark("bench_decode_step", *args, check=False)
    assert res.returncode == 2 and message in res.stderr


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device"
)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "cuda"], "--device cuda: PyTorch "),
        (["--models", "mha,tpp-triton"], "tpp-triton runs its kernels on CUDA tensors"),
    ],
)
def test_decode_step_benchmark_refuses_cuda_work_without_a_cuda_device(args, message, monkeypatch):
    """Without Triton's interpreter: with it, tpp-triton runs on the CPU (tested above)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    res = run_benchmark("bench_decode_step", *args, check=False)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_profile_projections_are_timed_only_in_beam_search_and_only_when_asked(data, capsys):
    """Their hooks slow fairseq's self-attention down (on a GPU with synchronisations):
    a run that times them is asked for, and only for beam search."""
    for flags, clocks in (
        ([], ["all", "decoder"]),
        (["--projections"], ["all", "decoder", "projections"]),
    ):
        args = profile_model.parse_args(
            ["--data", str(data), "--size", "128", "--layers", "1", "--generation", *flags]
        )
        _, _, trainer = harness.build_trainer("transformer", args.size, args)
        assert sorted(profile_model.self_attention_clocks(trainer.model, args)) == clocks
    with pytest.raises(SystemExit):
        profile_model.parse_args(["--data", str(data), "--projections"])
    assert "needs --generation" in capsys.readouterr().err


def test_cudnn_attention_of_the_benchmark_keeps_the_other_default_speedups():
    """bench_model.py --cudnn-attention: the plugin's default speed-ups but the cuDNN switch."""
    from tpp_fairseq import speed

    assert harness.CUDNN_KEPT.split(",") == [n for n in speed.DEFAULT if n != "cudnn-off"]


def test_benchmarks_are_run_as_modules_of_the_package_wherever_a_command_names_one():
    """The docs, the Makefile, the GPU suite and the scripts' own usage lines run a
    benchmark as ``python -m benchmarks.NAME`` (a module of the package), never by path."""
    texts = {
        path.relative_to(REPO): path.read_text(encoding="utf-8")
        for path in [
            REPO / "README.md",
            REPO / "Makefile",
            *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "benchmarks").glob("*.sh")),
            *sorted((REPO / "benchmarks").glob("*.py")),
        ]
    }
    named = {
        name for text in texts.values() for name in re.findall(r"-m benchmarks\.([a-z_]+)", text)
    }
    assert {"bench_model", "fairseq_train_run", "profile_model"} <= named
    assert all((REPO / "benchmarks" / f"{name}.py").is_file() for name in named), named
    by_path = [
        f"{path}: {match}"
        for path, text in texts.items()
        for match in re.findall(r"(?:python3?|\$PY\"?|/python) benchmarks/\w+\.py", text)
    ]
    assert not by_path, by_path


@pytest.mark.parametrize(
    "name",
    sorted(
        p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem not in ("__init__", "harness")
    ),
)
@pytest.mark.filterwarnings("ignore:'benchmarks.*found in sys.modules:RuntimeWarning")
def test_every_benchmark_answers_help(name, monkeypatch, capsys):
    """``python -m benchmarks.NAME --help`` prints how to run it and exits 0."""
    import runpy

    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", "--help"])
    try:
        runpy.run_module(f"benchmarks.{name}", run_name="__main__")
        status = 0  # printed its help and returned
    except SystemExit as stopped:
        status = stopped.code
    assert status in (0, None), status
    assert name in capsys.readouterr().out


@pytest.mark.parametrize("name", ["tpp", "tpp-fused", "tpp-triton"])
def test_on_a_gpu_without_triton_the_kernels_models_are_refused(name, data, monkeypatch):
    """A model timed as the kernels (tpp, tpp-fused, tpp-triton) where Triton cannot be
    imported would fall back to PyTorch's operations, its warning hidden by the
    benchmarks' quiet logging: refused by name, before the model reaches the device.
    tpp-taps, asking for those operations, and fairseq's transformer pass the check."""
    from tpp_plugin.modules import conv_heads_triton

    monkeypatch.setattr(conv_heads_triton, "available", lambda: False)
    args = bench_model.parse_args(["--data", str(data), "--layers", "1"])
    args.device = "cuda"
    for passing in ("tpp-taps", "transformer"):
        cfg, task = harness.setup(
            passing, 128, argparse.Namespace(**{**vars(args), "device": "cpu"})
        )
        harness.check_conv_heads(passing, task.build_model(cfg.model), args)
    cfg, task = harness.setup(name, 128, argparse.Namespace(**{**vars(args), "device": "cpu"}))
    with pytest.raises(SystemExit, match=f"^{name}: Triton cannot be imported here"):
        harness.check_conv_heads(name, task.build_model(cfg.model), args)


def test_on_the_cpu_the_multi_tensor_sync_is_what_transformer_sync_times(data, monkeypatch):
    """The benchmarks on the CPU (bench_model: the decide stage's stand-in; profile_model)
    keep --bf16's master copy flat as on one GPU, so transformer-sync's optimizer syncs it by multi-tensor copies
    (it was fairseq's own loop there, the same model as transformer under another name);
    a model that cannot have the sync is refused on every device."""
    from tpp_fairseq import speed

    monkeypatch.setattr(speed, "FLAT_BF16_DEVICE_TYPES", speed.FLAT_BF16_DEVICE_TYPES)
    args = profile_model.parse_args(["--data", str(data), "--layers", "1", "--dtype", "bf16"])
    _, _, trainer = harness.build_trainer("transformer-sync", 128, args)  # (any benchmark's)
    assert trainer.optimizer.has_flat_params
    assert trainer.optimizer._sync_fp16_grads_to_fp32.__func__ is speed.sync_grads
    _, _, trainer = harness.build_trainer("transformer", 128, args)
    assert trainer.optimizer._sync_fp16_grads_to_fp32.__func__ is not speed.sync_grads
    args.dtype = "fp32"
    with pytest.raises(SystemExit, match="no flat master copy"):
        harness.build_trainer("transformer-sync", 128, args)


def test_a_stage_asked_for_alone_has_the_whole_budget(data, tmp_path):
    """The calls of docs/gpu_commands.md ask for one stage with --budget: it may run
    until the budget is spent, not stop at its own limit with budget left (decide's
    last tables were lost so); among several stages, or with a --limit of its own, a
    stage keeps its limit. Each stage's time is printed as it starts. A command that
    ends by itself within the budget (without a GPU, counts' benchmark refusing --device
    cuda) is recorded as it ended, not as cut off."""
    left = r"up to (8[5-9]\d|900) s \(what is left of the budget\)"
    out = tmp_path / "out"
    res = run(
        ["benchmarks/gpu_suite.sh", "--budget", "900", data, out, "counts"], cwd=REPO, check=False
    )
    lines = [line for line in res.stdout.splitlines() if line.startswith("== ")]
    assert len(lines) == 1 and re.fullmatch(rf"== counts: {left}", lines[0]), res.stdout
    if not torch.cuda.is_available():  # (on a GPU it counts for real)
        assert res.returncode == 1 and "\ncounts\tcounts.md\texit 2" in res.stdout, res.stdout
    assert "stopped" not in res.stdout, "a command that ended by itself is not cut off"
    # the other calls need not run their commands to say their stages' time: with their
    # outputs there, the suite skips the commands (without --force)
    for table in ("counts.md", "step.md"):
        (out / table).write_text("an earlier table\n")
    cases = [
        (
            ["--budget", "900"],
            ["counts", "step"],
            [r"== counts: up to 60 s \(its limit\)", r"== step: up to 60 s \(its limit\)"],
        ),
        (
            ["--budget", "900", "--limit", "counts=5"],
            ["counts"],
            [r"== counts: up to 5 s \(its limit\)"],
        ),
        (
            ["--budget", "30", "--limit", "counts=50"],
            ["counts"],
            [r"== counts: up to \d+ s \(what is left.*"],
        ),
    ]
    for options, stages, expected in cases:
        res = run(["benchmarks/gpu_suite.sh", *options, data, out, *stages], cwd=REPO, check=False)
        lines = [line for line in res.stdout.splitlines() if line.startswith("== ")]
        assert len(lines) == len(expected), res.stdout + res.stderr
        assert res.stdout.count("\tskipped: it exists") == len(stages), res.stdout
        for line, pattern in zip(lines, expected):
            assert re.fullmatch(pattern, line), (options, line)


def test_bf16s_speed_up_pairs_the_batches_both_runs_timed():
    """precision_ratio: the median over the batches both runs timed of the ratio on the
    same batch (here 2.00×; the medians' ratio, 5.00×, mixes a batch into one median
    and not the other); runs of other batches are divided by their medians, said so."""
    same = {"data": "d", "max_tokens": "8192", "update_freq": "1", "warmup": "2", "isolate": "0"}

    def output(dtype, wps, **args):
        result = {"train_wps": statistics.median(wps), "train_wps_all": wps}
        return {
            "args": {**same, **args, "dtype": dtype},
            "sizes": {"512": {"results": {"tpp": result}}},
        }

    fast = output("bf16", [200.0, 400.0, 600.0, 800.0])
    slow = output("fp32", [100.0, 200.0, 50.0])
    row = precision_ratio.table(fast, slow).splitlines()[-1]
    assert row == "| 512 | tpp | 500 | 100 | 2.00× (median of 3 batches) |"
    row = precision_ratio.table(fast, output("fp32", [100.0, 200.0, 50.0], warmup="3"))
    assert row.splitlines()[-1] == "| 512 | tpp | 500 | 100 | 5.00× (of the medians) |"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_the_models_turns_balance_places_and_predecessors(n):
    """Over a cycle of rounds (n, or 2n for an odd n) each model takes every place equally
    often and follows every other model equally often (a Williams design): with the
    order rotating, fairseq's transformer-b followed transformer three rounds in four,
    and a step's leftovers (caches, the allocator) favoured the control's twin."""
    names = [f"m{i}" for i in range(n)]
    cycle = harness.turn_cycle(n)
    assert cycle == (1 if n == 1 else n if n % 2 == 0 else 2 * n)
    rows = [harness.turn_order(names, r) for r in range(cycle)]
    assert all(sorted(row) == names for row in rows)
    assert harness.turn_order(names, cycle + 1) == rows[1 % cycle]
    places = collections.Counter((m, i) for row in rows for i, m in enumerate(row))
    assert set(places.values()) == {cycle // n}
    follows = collections.Counter(pair for row in rows for pair in zip(row, row[1:]))
    assert len(follows) == n * (n - 1) and set(follows.values()) <= {cycle // n}


def test_a_runs_partial_table_holds_whole_cycles_of_turns(data, tmp_path, monkeypatch):
    """--partial (what a run stopped midway still reports) is written at whole cycles of
    the turns' orders only, where each model took every place equally often: two models
    over 3 rounds, after 2 of them."""
    import logging

    # (bench_model's main switches logging's warnings off for its process: not for the tests)
    monkeypatch.setattr(logging.root.manager, "disable", logging.root.manager.disable)
    partial = tmp_path / "table.progress"
    bench_model.main(
        ["--data", str(data), "--sizes", "128", "--layers", "1", "--models", "transformer,tpp"]
        + ["--rounds", "3", "--warmup", "1", "--max-tokens", "256", "--no-generation"]
        + ["--no-memory", "--threads", "1", "--partial", str(partial)]
    )
    assert partial.read_text().endswith("\n(partial: 2 of 3 timed rounds)\n")


def test_the_paired_ratios_median_has_its_distribution_free_interval():
    """The 95% interval of a median of n values: the order statistics of ranks 10 and 23
    for 32 (the decide stage's base rounds), the extremes for 6 to 8, none below 6."""
    values = [float(v) for v in range(1, 33)]
    random.Random(1).shuffle(values)
    assert harness.median_interval(values) == (10.0, 23.0)
    assert harness.median_interval(values[:8]) == (min(values[:8]), max(values[:8]))
    assert harness.median_interval(values[:5]) is None
    text = harness.paired_text([2.0, 2.2, 1.8, 2.0, 2.0, 2.4], [1.0] * 6)
    assert text == "paired 2.00×, ±8%, 95% CI 1.80–2.40"
    assert harness.paired_text([2.0, 2.2], [1.0, 1.0]).endswith(", ±?, 95% CI ?")
