#!/usr/bin/env python3
"""One decoding step of a decoder's self-attention, timed: ``transformer_pp``'s hybrid
attention against fairseq's ``MultiheadAttention``, with a control.

Beam search calls each decoder layer's self-attention once per output token, then
reorders its caches; at small batches that step is bound by the host (Python, dispatch,
kernel launches), not by arithmetic. This script times one step and one reordering, as
fairseq's ``SequenceGenerator`` runs them, for

* ``mha``        fairseq's ``MultiheadAttention`` (``--arch transformer``): the baseline;
* ``mha-b``      the same module built again, measured as another: the control, whose
                 ratio must come out at 1.0× (within the printed spread);
* ``tpp``        ``HybridMultiheadAttention`` (``H/2`` conv heads), ``--conv-heads-impl taps``;
* ``tpp-triton`` the same with the conv heads' step as one Triton kernel (ask for it
                 with ``--models``); on the CPU only through ``TRITON_INTERPRET=1``,
                 which times the interpreter, not the kernel;
* ``tpp-general`` ``tpp`` through ``forward``'s general path, not its one-token step
                 (frozen parameters, autograd on, which the step excludes; ask for it).

Each module first decodes ``--cached`` positions; every timed unit starts from a shallow
copy of that state (the same cache length every time) and, unless ``--no-reorder``, ends
with ``reorder_incremental_state`` (a fixed permutation). The modules take turns unit by
unit, in a new random order every turn. Figures: median microseconds per unit and speed
relative to ``mha`` (its time ÷ the module's: above 1.0× is faster), as a ratio of
medians and as the median of per-turn ratios ("paired", ± half its interquartile range).

    python -m benchmarks.bench_decode_step                      # CPU, one thread: 5 and 100 rows
    python -m benchmarks.bench_decode_step --device cuda --dtype bf16 --dim 1024 --rows 5,640 \\
        --models mha,mha-b,tpp,tpp-triton,tpp-general
"""

import argparse
import random
import statistics
import time

from benchmarks import harness

MODELS = ("mha", "mha-b", "tpp", "tpp-triton", "tpp-general")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--dim", type=int, default=128, help="model width d (default 128)")
    parser.add_argument(
        "--heads",
        type=int,
        help="heads H (default d/64, at least 4: bench_model.py's sizes); tpp's conv heads: H/2",
    )
    parser.add_argument("--kernel", type=int, default=7, help="LocalConv's width F (default 7)")
    parser.add_argument("--dilation", type=int, default=1)
    parser.add_argument(
        "--rows",
        default="5,100",
        help="hypotheses per step, sentences × beam, comma-separated (default 5,100)",
    )
    parser.add_argument(
        "--cached", type=int, default=15, help="positions already decoded (default 15)"
    )
    parser.add_argument(
        "--steps", type=int, default=400, help="timed units per module and row count"
    )
    parser.add_argument("--warmup", type=int, default=20, help="untimed units per module first")
    parser.add_argument("--models", default="mha,mha-b,tpp", help=f"from {', '.join(MODELS)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on the CPU (0: torch's default)"
    )
    parser.add_argument("--no-reorder", action="store_true", help="time the step alone")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(
            f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}"
        )
    if args.models[0] != "mha":
        parser.error("--models must start with mha, the baseline the ratios are taken against")
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows: comma-separated whole numbers, got {args.rows!r}")
    if args.heads is None:
        args.heads = max(4, args.dim // 64)
    for name in ("dim", "heads", "kernel", "dilation", "cached", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if min(args.rows) < 1:
        parser.error("--rows must be >= 1")
    if args.dim % args.heads or args.heads < 2:
        parser.error(f"--dim {args.dim} must split into --heads {args.heads} (at least 2) heads")

    harness.check_device(parser, args)
    interpreted = plugin().modules.conv_heads_triton.interpreting()
    if "tpp-triton" in args.models and args.device != "cuda" and not interpreted:
        parser.error(
            "tpp-triton runs its kernels on CUDA tensors (use --device cuda); on the CPU only through "
            "Triton's interpreter (TRITON_INTERPRET=1), which checks the unit but times the interpreter"
        )
    return args


def plugin():
    """The ``tpp_plugin`` package of this checkout, imported as fairseq's ``--user-dir`` imports it."""
    from fairseq.utils import import_user_module

    import_user_module(argparse.Namespace(user_dir=str(harness.PLUGIN)))
    import tpp_plugin

    return tpp_plugin


def build(name, args):
    """The module ``name``, in evaluation mode, on the device, in the dtype."""
    from fairseq.modules import MultiheadAttention

    if name.startswith("mha"):
        module = MultiheadAttention(args.dim, args.heads, self_attention=True)
    else:
        module = plugin().modules.HybridMultiheadAttention(
            args.dim,
            args.heads,
            args.heads // 2,
            kernel_size=args.kernel,
            dilation=args.dilation,
            causal=True,
            conv_heads_impl="triton" if name == "tpp-triton" else "taps",
        )
    if name == "tpp-general":
        module.requires_grad_(False)  # autograd on, nothing to record
    return module.to(device=args.device, dtype=harness.torch_dtype(args)).eval()


def reorderers(module):
    """The ``reorder_incremental_state`` of the module and of each submodule that has one,
    as fairseq's ``FairseqIncrementalDecoder`` collects them."""
    return [
        m.reorder_incremental_state
        for m in module.modules()
        if hasattr(m, "reorder_incremental_state")
    ]


def prepared_state(module, x, cached):
    """The incremental state after ``cached`` decoding steps of ``x``."""
    state = {}
    for _ in range(cached):
        module(x, x, x, incremental_state=state, need_weights=False)
    return state


def prepare(rows, args):
    """The input of a step for ``rows`` hypotheses, a beam permutation, and for each model
    ``(module, prepared state, reorder functions)``."""
    import torch

    torch.manual_seed(args.seed)
    x = torch.randn(1, rows, args.dim, device=args.device, dtype=harness.torch_dtype(args))
    order = torch.randperm(rows, device=args.device)
    units = {}
    with torch.no_grad():
        for name in args.models:
            module = build(name, args)
            units[name] = (
                module,
                prepared_state(module, x, args.cached),
                [] if args.no_reorder else reorderers(module),
            )
    return x, order, units


def time_units(x, order, units, args):
    """``{name: [seconds per unit]}``, the modules taking turns unit by unit."""
    import torch

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def unit(name):
        module, base, reorder = units[name]
        state = {key: dict(value) for key, value in base.items()}
        sync()
        start = time.perf_counter()
        with torch.set_grad_enabled(name == "tpp-general"):
            module(x, x, x, incremental_state=state, need_weights=False)
        for fn in reorder:
            fn(state, order)
        sync()
        return time.perf_counter() - start

    names = list(units)
    times = {name: [] for name in names}
    with torch.no_grad():
        for name in names:
            for _ in range(args.warmup):
                unit(name)
        # a new random order every turn: a unit of a few microseconds runs faster after one
        # of the same code (warm caches and branch predictors): a fixed rotation would
        # favour the module that mostly follows its twin (the control)
        rng = random.Random(args.seed)
        for _ in range(args.steps):
            for name in rng.sample(names, len(names)):
                times[name].append(unit(name))
    return times


def report(times_by_rows, args, device_name):
    what = "step + reordering" if not args.no_reorder else "step"
    lines = [
        f"### decoder self-attention, one {what}: d={args.dim}, {args.heads} heads (tpp: {args.heads // 2} "
        f"convolution heads, F={args.kernel}, dilation {args.dilation}), {args.cached} cached positions, "
        f"{args.dtype}, {device_name}",
        "",
        "| rows | model | µs per unit | speed vs mha | paired |",
        "|---:|---|---:|---:|---:|",
    ]
    for rows, times in times_by_rows.items():
        base = times["mha"]
        for name in args.models:
            mine = times[name]
            ratio = statistics.median(base) / statistics.median(mine)
            paired, noise = harness.paired_ratio(base, mine)
            lines.append(
                f"| {rows} | {name} | {statistics.median(mine) * 1e6:,.1f} | {ratio:.2f}× | "
                f"{paired:.2f}× {harness.plus_minus(noise)} |"
            )
    lines += [
        "",
        f"medians of {args.steps} units per module (after {args.warmup} untimed), the modules taking "
        f"turns; `mha-b` is the control (must be 1.0×).",
    ]
    if "tpp-triton" in args.models and args.device != "cuda":
        lines.append(
            "tpp-triton ran through Triton's interpreter: its time is the interpreter's, not a speed."
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    device_name = harness.device_label(args)
    times = {rows: time_units(*prepare(rows, args), args) for rows in args.rows}
    print(report(times, args, device_name))


if __name__ == "__main__":
    main()
