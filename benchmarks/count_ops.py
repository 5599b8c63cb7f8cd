#!/usr/bin/env python3
"""How many operators ``transformer_pp`` and fairseq's ``transformer`` run per beam-search
step and per training step: on a GPU each operator that computes is one kernel launch,
and where the kernels are small (beam search's steps; see docs/launch_counts.md) the host's
time per launch, not the arithmetic, sets the speed. A count, not a timing: the same on
every run and every machine, so it can be compared on a CPU for code meant for a GPU.

Same models, command lines and batches as ``bench_model.py``. Every ATen operator that
reaches the backend is counted (through a ``TorchDispatchMode``), in two classes:
*launches*, operators that compute (each a kernel on a GPU), and *free*, views and
allocations (``view``, ``transpose``, ``empty``, ...: host time only, no kernel).

* **Beam search**: fairseq's ``SequenceGenerator`` on one fixed batch, outputs forced to
  ``--short`` and then ``--long`` tokens; the difference divided by the difference in
  length is what one more decoding step costs, by part: the decoder's self-attention,
  the reordering of the incremental states (fairseq's ``reorder_incremental_state``,
  which visits every module), and the rest (embeddings, cross-attention, feed-forward
  layers, output layer and the search itself, the same in both models).
* **Training**: the criterion's forward and the backward pass of one batch; the rest of
  a whole update (fairseq's ``Trainer.train_step``: optimizer, master copy, gradient
  norm, meters), ``--bf16``'s master copy flat as on one GPU; and the values read back
  to the host (``.item()``, ``bool(t)``: on a GPU, a wait for the device) by the line
  that reads them (which of them are GPU tensors: docs/launch_counts.md).

Where the CPU and a GPU dispatch differently the counts differ too
(docs/launch_counts.md): compare models within one run; ``--device cuda`` counts a GPU's.

    python -m benchmarks.count_ops --data DIR --size 1024 --dtype bf16
    python -m benchmarks.count_ops --data DIR --size 1024 --dtype bf16 --models transformer,tpp,tpp-taps --device cuda
    python -m benchmarks.count_ops --size 512 --layers 6 --models transformer,tpp-triton,tpp-fused --triton-launches
"""

import argparse
import collections
import contextlib
import os
import sys
from pathlib import Path

from benchmarks import harness

#: operators that compute nothing: views of their input, allocations, metadata
FREE = {
    "view",
    "_unsafe_view",
    "_reshape_alias",
    "reshape",
    "as_strided",
    "alias",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "select",
    "slice",
    "narrow",
    "split",
    "split_with_sizes",
    "unbind",
    "detach",
    "lift_fresh",
    "empty",
    "empty_like",
    "new_empty",
    "empty_strided",
    "new_empty_strided",
    "_local_scalar_dense",
    "unflatten",
    "flatten",
    "resize_",
    "promote_types",
    "result_type",
    "_record_function_enter_new",  # the profiler's marks (fairseq's train_step sets some)
    "_record_function_exit",
}


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
    p.add_argument("--max-tokens", type=int, default=2048, help="the training batch")
    p.add_argument("--gen-batch", type=int, default=8, help="sentences in the beam-search batch")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--short", type=int, default=10, help="forced output length of the first search")
    p.add_argument("--long", type=int, default=20, help="... and of the second")
    p.add_argument(
        "--triton-launches",
        action="store_true",
        help="CPU: the conv heads' Triton kernels counted, one launch each, instead of run "
        "(their outputs are left unwritten): the training counts a GPU would make, without "
        "one; no beam search",
    )
    args = p.parse_args(argv)
    if args.triton_launches and args.device != "cpu":
        p.error("--triton-launches counts on the CPU (a GPU runs the kernels)")
    harness.check_device(p, args)
    args.models = [m for m in args.models.split(",") if m]
    harness.check_models(p, args)
    if not 0 < args.short < args.long:
        p.error("--short and --long: two output lengths, the first smaller")
    args.update_freq = 1
    return args


def reading_line() -> str:
    """``module:line`` of the code that read a tensor's value: the innermost frame outside
    torch and this script; ``torch:backward`` for a read inside the autograd engine."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "?")
        if module in (__name__, "benchmarks.count_ops"):
            if frame.f_code.co_name not in ("__torch_dispatch__", "reading_line"):
                return "torch:backward"  # called by this script: no Python caller between
        elif not module.split(".")[0] == "torch":
            return f"{module}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class Counter:
    """Counts the operators dispatched inside ``with counter.counting(part):``, and the
    values read back to the host (``reads``: (part, line) -> n)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.counts = collections.Counter()  # (part, "launches" | "free") -> n
        self.reads = collections.Counter()
        self.parts = ["rest"]
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                kind = "free" if name in FREE else "launches"
                counter.counts[(counter.parts[-1], kind)] += 1
                if name == "_local_scalar_dense":
                    counter.reads[(counter.parts[-1], reading_line())] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def enter(self, part):
        self.parts.append(part)

    def leave(self):
        self.parts.pop()


def beam_step_counts(name, args, trainer, task, cfg):
    """Operators of one more decoding step, by part, from two searches of different lengths."""

    model = trainer.model.eval()
    counter = Counter()
    hooks = []
    for layer in model.decoder.layers:
        hooks.append(
            layer.self_attn.register_forward_pre_hook(lambda m, i: counter.enter("self-attention"))
        )
        hooks.append(layer.self_attn.register_forward_hook(lambda m, i, o: counter.leave()))
    reorder = model.decoder.reorder_incremental_state_scripting

    def counted_reorder(*a, **k):
        counter.enter("state reordering")
        try:
            return reorder(*a, **k)
        finally:
            counter.leave()

    model.decoder.reorder_incremental_state_scripting = counted_reorder
    sample = harness.fixed_batches(task, cfg, "test", 1, max_sentences=args.gen_batch)[0]
    if args.device == "cuda":
        from fairseq import utils

        sample = utils.move_to_cuda(sample)
    totals = {}
    for length in (args.short, args.long):
        generator = harness.beam_search(
            task, model, argparse.Namespace(beam=args.beam, gen_len=length)
        )
        task.inference_step(generator, [model], sample)  # once uncounted: one-off set-up
        counter.counts.clear()
        with counter.mode:
            hyps = task.inference_step(generator, [model], sample)
        assert {len(h[0]["tokens"]) for h in hyps} == {
            length + 1
        }, f"{name}: outputs not forced to {length}"
        totals[length] = collections.Counter(counter.counts)
    for hook in hooks:
        hook.remove()
    del model.decoder.reorder_incremental_state_scripting
    steps = args.long - args.short
    return {
        key: (totals[args.long][key] - totals[args.short][key]) / steps
        for key in set(totals[args.long]) | set(totals[args.short])
    }


@contextlib.contextmanager
def triton_counted(counter):
    """The conv heads' Triton kernels replaced by stand-ins that count a launch in
    ``counter``'s current part and compute nothing (CPU tensors take the kernels' path
    under ``TRITON_INTERPRET=1``)."""
    from tpp_plugin.modules import conv_heads_triton, query_triton

    class Launch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                counter.counts[(counter.parts[-1], "Triton")] += 1

            return launch

    saved = os.environ.get("TRITON_INTERPRET"), conv_heads_triton._kernels
    names = ("conv_heads_kernel", "conv_heads_grad_kernel")
    kernels = {name: getattr(query_triton, name) for name in names}
    os.environ["TRITON_INTERPRET"] = "1"
    conv_heads_triton._kernels = lambda interpret: (Launch(), Launch(), Launch())
    for name in names:
        setattr(query_triton, name, Launch())
    try:
        yield
    finally:
        conv_heads_triton._kernels = saved[1]
        for name, kernel in kernels.items():
            setattr(query_triton, name, kernel)
        if saved[0] is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved[0]


def training_counts(args, trainer, task, cfg):
    """Operators of the criterion's forward and of the backward pass, one batch."""
    model = trainer.model.train()
    batch = harness.fixed_batches(task, cfg, "train", 1, max_tokens=args.max_tokens)[0]
    sample, _ = trainer._prepare_sample(batch)
    counter = Counter()
    stand_ins = triton_counted(counter) if args.triton_launches else contextlib.nullcontext()
    with stand_ins, counter.mode:
        counter.enter("forward")
        loss, _, _ = trainer.criterion(model, sample)
        counter.leave()
        counter.enter("backward")
        loss.backward()
        counter.leave()
    model.zero_grad(set_to_none=True)
    return dict(counter.counts), dict(counter.reads)


def update_counts(trainer, task, cfg, args):
    """Operators of one whole update (fairseq's ``Trainer.train_step``) outside the
    criterion's forward and the backward pass: the optimizer's step, the master copy's
    syncs, the gradient norm, fairseq's meters; and the values read back there. After
    one uncounted update, in which the optimizer's state appears."""
    batch = harness.fixed_batches(task, cfg, "train", 1, max_tokens=args.max_tokens)[0]
    trainer.train_step([batch])
    counter = Counter()
    criterion, optimizer = trainer.criterion, trainer.optimizer

    def within(part, fn):
        def counted(*a, **k):
            counter.enter(part)
            try:
                return fn(*a, **k)
            finally:
                counter.leave()

        return counted

    criterion.forward = within("forward", criterion.forward)
    optimizer.backward = within("backward", optimizer.backward)
    try:
        with counter.mode:
            trainer.train_step([batch])
    finally:
        del criterion.forward, optimizer.backward
    rest = {key: n for key, n in counter.counts.items() if key[0] == "rest"}
    return rest, {key: n for key, n in counter.reads.items() if key[0] == "rest"}


def _count(result, kind, part=None):
    """Launches or free operators of one part (all parts: None)."""
    return sum(v for (p, k), v in result.items() if k == kind and part in (None, p))


def _table(title, results, parts, args):
    """One table of counts, a column per model (with their ratios to `transformer`)."""
    print(f"\n{title}")
    print(f"{'part':<22}" + "".join(f"{name:>22}" for name in args.models))
    for part in parts + [None]:
        cells = [
            f"{_count(r, 'launches', part):>10.1f} + {_count(r, 'free', part):>6.1f} free"
            for r in results.values()
        ]
        print(f"{part or 'total':<22}" + "".join(f"{c:>22}" for c in cells))
    if any(_count(r, "Triton") for r in results.values()):
        cells = [f"{_count(r, 'Triton'):>10.1f}" for r in results.values()]
        print(f"{'Triton launches':<22}" + "".join(f"{c:>22}" for c in cells))
    if "transformer" in results:
        base = _count(results["transformer"], "launches")
        ratios = ", ".join(f"{n} {_count(r, 'launches') / base:.2f}x" for n, r in results.items())
        print(f"launches, ratio to transformer: {ratios}")
    if args.device == "cuda" and any(n in ("tpp", "tpp-triton", "tpp-fused") for n in args.models):
        print(
            "(a Triton kernel is no ATen operator: these counts leave out the conv heads' "
            "Triton launches, one per decoder layer and beam step, three per LocalConv "
            "and training batch, with tpp-fused four per hybrid layer)"
        )


def main(argv=None):
    import logging
    import shutil
    import tempfile

    args = parse_args(argv)
    logging.disable(logging.WARNING)
    work = None
    if args.data is None:
        work = Path(tempfile.mkdtemp(prefix="count_ops_"))
        args.data = harness.synthetic_data(work)
    try:
        beam, train, reads, update = {}, {}, {}, {}
        for name in args.models:
            cfg, task, trainer = harness.build_trainer(name, args.size, args)
            train[name], reads[name] = training_counts(args, trainer, task, cfg)
            update[name], update_reads = update_counts(trainer, task, cfg, args)
            for key, n in update_reads.items():
                reads[name][key] = reads[name].get(key, 0) + n
            if not args.triton_launches:
                beam[name] = beam_step_counts(name, args, trainer, task, cfg)
            del trainer
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)

    where = f"d={args.size}, {args.layers}+{args.layers} layers, {args.dtype}, {args.device}"
    if beam:
        _table(
            f"operators per beam-search step ({where}; beam {args.beam}, {args.gen_batch} "
            f"sentences; launches + free)",
            beam,
            ["self-attention", "state reordering", "rest"],
            args,
        )
    _table(
        f"operators per training batch ({where}; --max-tokens {args.max_tokens}; launches + free)",
        train,
        ["forward", "backward"],
        args,
    )
    _table(
        f"operators per update outside the forward and backward passes ({where}; optimizer, "
        f"master copy, gradient norm, meters)",
        update,
        [],
        args,
    )
    print("\nvalues read back to the host per update, by the line that reads them")
    for name, found in reads.items():
        total = sum(found.values())
        print(f"{name}: {total}" + ("" if total else " (none)"))
        for (part, line), n in sorted(found.items()):
            print(f"  {n:>3}  {part:<9} {line}")


if __name__ == "__main__":
    main()
