#!/usr/bin/env python3
"""Peak memory and time of tpp-average-checkpoints against the size of one checkpoint.

Writes N synthetic checkpoints laid out as fairseq writes them (model state dict, the
training args, Adam's two moment buffers per parameter, optimizer history) into a
temporary folder, then runs the averaging tool as a child process for each requested
N and reports its wall time and peak resident memory (getrusage of the child), minus
the peak of the same tool started with --help (interpreter + torch + fairseq imports).

    python -m benchmarks.bench_average                       # 25M parameters, N = 2 and 10
    python -m benchmarks.bench_average --params 50e6 --counts 2 5 10 --dtype float16

The checkpoints need N x (size of one) of disk space under --tmp-dir (default: the
system's temporary folder).
"""

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tpp_fairseq import allow_fairseq_checkpoints

allow_fairseq_checkpoints()

# the averaging tool, run as a module of this interpreter (what tpp-average-checkpoints runs)
COMMAND = ["-m", "tpp_tools.average"]
MATRIX = 1024  # parameters come as 1024-wide matrices, like a big Transformer's projections

CHILD_PEAK = """
import resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.call([sys.executable] + sys.argv[1:], stdout=subprocess.DEVNULL)
elapsed = time.perf_counter() - start
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, elapsed)
sys.exit(code)
"""


def write_checkpoints(folder, count, params, dtype):
    rows = max(1, math.ceil(params / MATRIX / 8))
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        model = {
            f"encoder.layers.{i}.weight": torch.randn(rows, MATRIX, generator=generator).to(dtype)
            for i in range(8)
        }
        state = {
            "model": model,
            "args": argparse.Namespace(arch="transformer_pp_wmt_en_de_big"),
            "optimizer_history": [
                {
                    "criterion_name": "LabelSmoothedCrossEntropyCriterion",
                    "optimizer_name": "FairseqAdam",
                    "lr_scheduler_state": {},
                    "num_updates": (index + 1) * 1000,
                }
            ],
            "extra_state": {"epoch": 1},
            "last_optimizer_state": {
                "state": {
                    i: {"exp_avg": torch.zeros(t.shape), "exp_avg_sq": torch.zeros(t.shape)}
                    for i, t in enumerate(model.values())
                }
            },
        }
        torch.save(state, folder / f"checkpoint_1_{(index + 1) * 1000}.pt")
        del model, state
    return sum(p.stat().st_size for p in folder.glob("checkpoint_1_*.pt")) / count


def measure(*args):
    result = subprocess.run(
        [sys.executable, "-c", CHILD_PEAK, *COMMAND, *map(str, args)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"averaging failed:\n{result.stderr}")
    peak, seconds = result.stdout.split()
    return int(peak), float(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25e6, help="parameters per model")
    parser.add_argument(
        "--counts", type=int, nargs="+", default=[2, 10], help="numbers of checkpoints to average"
    )
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    parser.add_argument("--tmp-dir", default=None, help="where the checkpoints are written")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="bench-average-", dir=args.tmp_dir))
    try:
        size = write_checkpoints(
            folder, max(args.counts), int(args.params), getattr(torch, args.dtype)
        )
        baseline, _ = measure("--help")
        mib = 2**20
        print(
            f"one checkpoint: {size / mib:.0f} MiB ({args.params / 1e6:.0f}M {args.dtype} "
            f"parameters + Adam state); imports alone: {baseline / mib:.0f} MiB peak RSS"
        )
        print(
            f"{'N':>3} {'N x checkpoint':>15} {'peak RSS':>9} {'minus imports':>14} "
            f"{'/ checkpoint':>13} {'time':>7}"
        )
        for count in args.counts:
            output = folder / f"avg{count}.pt"
            peak, seconds = measure(
                "--inputs", folder, "--num-update-checkpoints", count, "--output", output
            )
            used = peak - baseline
            print(
                f"{count:>3} {count * size / mib:>11.0f} MiB {peak / mib:>5.0f} MiB "
                f"{used / mib:>10.0f} MiB {used / size:>12.2f}x {seconds:>6.1f}s"
            )
            output.unlink()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
