#!/usr/bin/env python3
"""Where a training step's time goes: ``torch.profiler`` over a few of fairseq's
training steps, one model at a time, on the batches that ``bench_model.py`` times; with
``--generation``, where a beam-search step's time goes.

For each model: the wall time of a step (device synchronised), the time the GPU spent in
kernels during it and the ratio of the two (a GPU busy for a third of the wall time means
a step bound by the host: Python, kernel launches, synchronisations), then the operators
that took the most device time (CPU time on the CPU). The profiler adds host time to
every operator call: for the busy fraction of a normal step, divide the kernel time by
``bench_model.py``'s step time.

    python -m benchmarks.profile_model --data DIR --device cuda --dtype bf16 --size 1024
    python -m benchmarks.profile_model --data DIR --size 128 --models tpp --steps 3   # CPU
    python -m benchmarks.profile_model --data DIR --size 512 --generation             # CPU

``--generation`` times beam search (``bench_model.py``'s) and, inside it (hooks, device
synchronised around each call), the encoder's and decoder's self-attention, cache
reordering included: the only part in which ``transformer_pp`` differs from
``transformer``. Its share ``s`` of ``transformer``'s decoding time bounds the gain of a
self-attention costing ``r`` times as much, ``1 / (1 - s·(1 - r))``, printed for ``r = 0``
and ``r = 1/2``. ``--projections`` adds, for fairseq's attention, the share spent in its
four projections; its hooks slow fairseq's self-attention alone, so take the other
columns from a run without it.

Same models, command lines and batches as ``bench_model.py`` (``--models`` from
transformer, tpp, tpp-conv0).
"""

import argparse
import logging
import statistics
import time
from pathlib import Path

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--data", type=Path, required=True, help="binarized data folder")
    p.add_argument("--size", type=int, default=512, choices=sorted(harness.SIZES))
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--models", default="transformer,tpp-conv0,tpp")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument(
        "--max-tokens", type=int, default=None, help="default: 2048 on CPU, 16384 on GPU"
    )
    p.add_argument(
        "--warmup", type=int, default=8, help="untimed steps first (each batch shape once)"
    )
    p.add_argument("--steps", type=int, default=5, help="profiled steps")
    p.add_argument(
        "--update-freq",
        type=int,
        default=None,
        help="batches per step (fairseq's --update-freq; default 1 on CPU, 2 on GPU)",
    )
    p.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="GPU: let SDPA use its cuDNN backend (the plugin switches it off when loaded)",
    )
    p.add_argument("--row-limit", type=int, default=25)
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)"
    )
    p.add_argument(
        "--generation",
        action="store_true",
        help="time beam search and the self-attention in it instead of training",
    )
    p.add_argument(
        "--gen-batches", type=int, default=4, help="--generation: timed batches per model"
    )
    p.add_argument(
        "--gen-batch", type=int, default=None, help="sentences per batch (default 20 CPU, 128 GPU)"
    )
    p.add_argument(
        "--gen-len", type=int, default=30, help="forced output length (tokens before EOS)"
    )
    p.add_argument("--beam", type=int, default=5)
    p.add_argument(
        "--projections",
        action="store_true",
        help="--generation: also time the projections inside fairseq's decoder self-attention "
        "(their hooks slow it down: the other columns are to be taken from a run without)",
    )
    args = p.parse_args(argv)
    if args.projections and not args.generation:
        p.error("--projections times beam search: it needs --generation")
    harness.check_device(p, args)
    args.models = [m for m in args.models.split(",") if m]
    harness.check_models(p, args)
    args.max_tokens = args.max_tokens or (16384 if args.device == "cuda" else 2048)
    args.update_freq = args.update_freq or (2 if args.device == "cuda" else 1)
    args.gen_batch = args.gen_batch or (128 if args.device == "cuda" else 20)
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

    cfg, task, trainer = harness.build_trainer(name, args.size, args)
    batches = harness.training_steps(task, cfg, args.warmup + args.steps, args)
    # the warm-up steps, then every profiled batch once untimed: a batch shape's first
    # step pays one-off set-up (cuDNN builds an attention graph per new shape)
    for batch in batches:
        trainer.train_step(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    walls = []
    with torch.profiler.profile(activities=activities) as prof:
        for batch in batches[args.warmup :]:
            seconds, _ = harness.timed(lambda: trainer.train_step(batch), args)
            walls.append(seconds)
    wall = sum(walls)
    line = f"## {name}: d={args.size}, {args.dtype}, {args.device}; wall per step {1000 * statistics.median(walls):.1f} ms (median of {len(walls)})"
    if args.device == "cuda":
        busy = device_kernel_us(prof) / 1e6
        line += f"; GPU kernels {1000 * busy / len(walls):.1f} ms per step = {100 * busy / wall:.0f}% of the wall time"
    print(line, flush=True)
    sort = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.row_limit), flush=True)
    trainer = None  # freed before the next model is built
    if args.device == "cuda":
        torch.cuda.empty_cache()


class Clock:
    """Seconds spent inside the calls it is attached to (the device synchronised on the
    way in and out)."""

    def __init__(self, args):
        self.seconds, self._started, self._args = 0.0, 0.0, args

    def enter(self, *_):
        harness.synchronize(self._args)
        self._started = time.perf_counter()

    def leave(self, *_):
        harness.synchronize(self._args)
        self.seconds += time.perf_counter() - self._started

    def attach(self, module):
        """Time every forward pass of ``module``."""
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.leave)

    def wrap(self, method):
        """``method``, timed."""

        def timed(*args, **kwargs):
            self.enter()
            result = method(*args, **kwargs)
            self.leave()
            return result

        return timed


def self_attention_clocks(model, args):
    """Clocks on one model: ``all`` its self-attention — forward passes (encoder and
    decoder) and the reordering of the decoder's caches after every beam-search step
    (``reorder_incremental_state`` of the module and of its submodules, which fairseq
    calls one by one); ``decoder``, the decoder's part of it; and, with
    ``--projections``, for fairseq's own ``MultiheadAttention``, ``projections``: the four
    projections inside the decoder's (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``;
    absent for other attention modules, whose decoding step need not call its
    projections as modules)."""
    from fairseq.modules import MultiheadAttention

    clocks = {"all": Clock(args), "decoder": Clock(args)}
    decoder = [layer.self_attn for layer in model.decoder.layers]
    for module in [layer.self_attn for layer in model.encoder.layers] + decoder:
        clocks["all"].attach(module)
    for attention in decoder:
        clocks["decoder"].attach(attention)
        for module in attention.modules():
            if hasattr(module, "reorder_incremental_state"):
                timed = clocks["all"].wrap(clocks["decoder"].wrap(module.reorder_incremental_state))
                module.reorder_incremental_state = timed
    if args.projections and all(type(m) is MultiheadAttention for m in decoder):
        clocks["projections"] = Clock(args)
        for module in decoder:
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                clocks["projections"].attach(getattr(module, name))
    return clocks


def report_generation(args):
    """Beam search of every model, taking turns batch by batch (``bench_model.py``'s
    loop), and the share of it spent in self-attention."""
    runs, clocks, samples = {}, {}, None
    for name in args.models:
        cfg, task, trainer = harness.build_trainer(name, args.size, args)
        model = trainer.model.eval()
        runs[name] = (task, model, harness.beam_search(task, model, args))
        clocks[name] = self_attention_clocks(model, args)
        if samples is None:
            samples = harness.test_batches(task, cfg, args)

    def reset(name):
        for clock in clocks[name].values():
            clock.seconds = 0.0

    totals = {name: [] for name in args.models}
    shares = {name: [] for name in args.models}
    projection_shares = {name: [] for name in args.models}
    for name, seconds, _ in harness.generation_turns(runs, samples, args, before=reset):
        totals[name].append(seconds)
        shares[name].append(clocks[name]["all"].seconds / seconds)
        if "projections" in clocks[name]:
            projection_shares[name].append(
                clocks[name]["projections"].seconds / clocks[name]["decoder"].seconds
            )
    print(
        f"## beam search: d={args.size}, {args.dtype}, {args.device}; beam {args.beam}, "
        f"{args.gen_batch} sentences per batch, {args.gen_len}-token outputs; medians of "
        f"{args.gen_batches} batches, models taking turns",
        flush=True,
    )
    print(
        "| model | seconds per batch | self-attention | rest | self-attention share |"
        " speed-up if it cost nothing / half as much | projections' share of the decoder's |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for name in args.models:
        total, share = statistics.median(totals[name]), statistics.median(shares[name])
        projection = (
            f"{100 * statistics.median(projection_shares[name]):.0f}%"
            if projection_shares[name]
            else "—"
        )
        print(
            f"| {name} | {total:.3f} | {total * share:.3f} | {total * (1 - share):.3f} | {100 * share:.1f}% | "
            f"{1 / (1 - share):.2f}× / {1 / (1 - share / 2):.2f}× | {projection} |",
            flush=True,
        )


def main(argv=None):
    args = parse_args(argv)
    logging.disable(logging.WARNING)
    harness.gpu_settings(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.generation:
        report_generation(args)
    else:
        for name in args.models:
            profile(name, args)
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
