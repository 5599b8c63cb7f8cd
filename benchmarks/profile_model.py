#!/usr/bin/env python3
"""Where a training step's time goes: ``torch.profiler`` over a few of fairseq's
training steps, one model at a time, on the batches that ``bench_model.py`` times.

For each model it prints the wall time of a step (device synchronised), the time the
GPU spent in kernels during it (their sum; one stream, so they do not overlap) and the
ratio of the two — a step whose GPU is busy for a third of its wall time is bound by
the host (Python, kernel launches, synchronisations), not by the GPU — then the
operators that took the most device time (CPU time on the CPU). The profiler adds host
time to every operator call, more to a model that makes more calls: for the busy
fraction of a normal step, divide the kernel time by ``bench_model.py``'s step time.

    python benchmarks/profile_model.py --data DIR --device cuda --dtype bf16 --size 1024
    python benchmarks/profile_model.py --data DIR --size 128 --models tpp --steps 3   # CPU

Same models, command lines and batches as ``bench_model.py`` (``--models`` from
transformer, tpp, tpp-conv0).
"""

import argparse
import importlib.util
import logging
import statistics
import time
from pathlib import Path


def _load_bench_model():
    """``bench_model.py`` beside this script (its models, command lines and batches),
    loaded by path: the benchmarks are scripts, not an installed package."""
    spec = importlib.util.spec_from_file_location("bench_model", Path(__file__).resolve().parent / "bench_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_model = _load_bench_model()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--data", type=Path, required=True, help="binarized data folder")
    p.add_argument("--size", type=int, default=512, choices=sorted(bench_model.SIZES))
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--models", default="transformer,tpp-conv0,tpp")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--max-tokens", type=int, default=None, help="default: 2048 on CPU, 16384 on GPU")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (each batch shape once)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps")
    p.add_argument("--update-freq", type=int, default=None,
                   help="batches per step (fairseq's --update-freq; default 1 on CPU, 2 on GPU)")
    p.add_argument("--no-cudnn-attention", action="store_true", help="GPU: SDPA without its cuDNN backend")
    p.add_argument("--row-limit", type=int, default=25)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    for m in args.models:
        if m not in bench_model.MODELS:
            p.error(f"--models: unknown {m!r}; choose from {list(bench_model.MODELS)}")
    args.max_tokens = args.max_tokens or (16384 if args.device == "cuda" else 2048)
    args.update_freq = args.update_freq or (2 if args.device == "cuda" else 1)
    return args


def device_kernel_us(prof) -> float:
    """Total duration of the device's kernels and copies in the profile (microseconds)."""
    total = 0.0
    for event in prof.events():
        # fairseq's record_function ranges ("forward", "optimizer", ...) appear on the
        # device too, as user annotations spanning kernels: count the kernels only
        if event.device_type.name == "CUDA" and not event.is_user_annotation:
            total += event.time_range.elapsed_us()
    return total


def profile(name, args):
    import torch
    from torch.profiler import ProfilerActivity

    cfg, task, trainer = bench_model.build_trainer(name, args.size, args)
    batches = bench_model.training_steps(task, cfg, args.warmup + args.steps, args)
    # the warm-up steps, then every profiled batch once untimed: a batch shape's first
    # step pays one-off set-up (cuDNN builds an attention graph per new shape)
    for batch in batches:
        trainer.train_step(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    walls = []
    with torch.profiler.profile(activities=activities) as prof:
        for batch in batches[args.warmup:]:
            seconds, _ = bench_model.timed(lambda: trainer.train_step(batch), args)
            walls.append(seconds)
    wall = sum(walls)
    line = f"## {name}: d={args.size}, {args.dtype}, {args.device}; wall per step {1000 * statistics.median(walls):.1f} ms (median of {len(walls)})"
    if args.device == "cuda":
        busy = device_kernel_us(prof) / 1e6
        line += f"; GPU kernels {1000 * busy / len(walls):.1f} ms per step = {100 * busy / wall:.0f}% of the wall time"
    print(line, flush=True)
    sort = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.row_limit), flush=True)
    del trainer
    if args.device == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    logging.disable(logging.WARNING)
    bench_model.gpu_settings(args)
    started = time.perf_counter()
    for name in args.models:
        profile(name, args)
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
