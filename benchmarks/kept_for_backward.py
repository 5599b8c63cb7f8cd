#!/usr/bin/env python3
"""What a training forward keeps for its backward pass: the bytes of the distinct
tensors autograd saves (its activation memory, counted rather than timed, so the same
on every run), for ``transformer_pp`` and fairseq's ``transformer`` of the same size,
by part of the model.

Same models, command lines and batches as ``bench_model.py``; one forward of the
criterion per model, on one fixed batch, through ``torch.autograd.graph``'s
saved-tensor hooks. Each storage counts once, for the module that saved it first (a
slice of the fused input projection kept by the conv heads costs nothing if the
dot-product heads keep the same projection).

On the CPU the figures include what the CPU's attention kernels keep: with attention
dropout, ``scaled_dot_product_attention`` falls back to its unfused path there and keeps
float32 copies of the queries, keys, values and the ``T x T`` weights, in both models;
a GPU's fused kernels keep only their inputs and outputs. Compare models within one
run, and read the self-attention rows with that in mind.

    python -m benchmarks.kept_for_backward --size 512 --dtype bf16    # bench_model's synthetic corpus
    python -m benchmarks.kept_for_backward --data DIR --size 1024 --dtype bf16 --max-tokens 8192
"""

import argparse
import collections
import re
import shutil
import tempfile
from pathlib import Path

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--data", type=Path, help="binarized data folder (default: a synthetic corpus)")
    p.add_argument("--size", type=int, default=512, choices=sorted(harness.SIZES))
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--models", default="transformer,tpp-conv0,tpp")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--max-tokens", type=int, default=4096)
    args = p.parse_args(argv)
    harness.check_device(p, args)
    args.models = [m for m in args.models.split(",") if m]
    args.update_freq = 1
    return args


def part_of(name: str) -> str:
    """``encoder.layers.3.self_attn.local_conv`` -> ``encoder self-attention``."""
    side = name.split(".")[0] if name else "(model)"
    if ".self_attn" in name:
        return f"{side} self-attention"
    if ".encoder_attn" in name and "layer_norm" not in name:
        return f"{side} cross-attention"
    if re.search(r"\.(fc1|fc2|activation_dropout_module)$", name):
        return f"{side} feed-forward"
    return f"{side} other"


def kept(name, args):
    """Bytes saved for backward by one training forward, by part, and the batch's tokens."""
    import torch

    cfg, task, trainer = harness.build_trainer(name, args.size, args)
    model = trainer.model.train()
    sample, _ = trainer._prepare_sample(
        harness.fixed_batches(task, cfg, "train", 1, max_tokens=args.max_tokens)[0]
    )
    names = {module: n for n, module in model.named_modules()}
    stack, hooks = [], []

    def enter(module, inputs):
        stack.append(names[module])

    def leave(module, inputs, output):  # returns None: the output stays the module's
        stack.pop()

    for module in model.modules():
        hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    seen, parts = set(), collections.Counter()

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            parts[part_of(stack[-1] if stack else "")] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.criterion(model, sample)
    for hook in hooks:
        hook.remove()
    return parts, sample["ntokens"]


def main(argv=None):
    args = parse_args(argv)
    work = None
    if args.data is None:
        work = Path(tempfile.mkdtemp(prefix="kept_for_backward_"))
        args.data = harness.synthetic_data(work)
    results = {}
    try:
        for name in args.models:
            results[name], tokens = kept(name, args)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    rows = sorted({part for parts in results.values() for part in parts})
    mib = 2**20
    print(
        f"\nkept for backward, MiB (d={args.size}, {args.layers}+{args.layers} layers, {args.dtype}, "
        f"{args.device}, one batch of {tokens} target tokens)"
    )
    print(f"{'part':<28}" + "".join(f"{name:>16}" for name in args.models))
    for part in rows + ["total"]:
        values = [sum(r.values()) if part == "total" else r.get(part, 0) for r in results.values()]
        print(f"{part:<28}" + "".join(f"{v / mib:>16.1f}" for v in values))
    if "transformer" in results:
        base = sum(results["transformer"].values())
        print(
            "ratio to transformer: "
            + ", ".join(f"{n} {sum(r.values()) / base:.3f}x" for n, r in results.items())
        )


if __name__ == "__main__":
    main()
