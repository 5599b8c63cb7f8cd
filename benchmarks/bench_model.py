#!/usr/bin/env python3
"""Training speed, generation speed and training memory of ``transformer_pp`` against
fairseq's ``transformer`` of the same size, with a control, in one process.

Models (same width, heads, FFN, layers, dropouts, shared embeddings, data, batches):

* ``transformer``  fairseq's own ``--arch transformer``: the baseline;
* ``tpp``          ``--arch transformer_pp`` (half the heads are convolution heads,
                   kernels 3,5,7,11,15), no tag heads;
* ``tpp-conv0``    ``tpp`` with 0 conv heads, layer for layer ``transformer``: the control,
                   whose ratio must come out at 1.0× (within the printed spread);
* ``transformer-b`` ``transformer`` again under another name: the harness's own control
                   (a default on GPUs, where ``tpp-conv0``'s attention kernels differ);
* and the variants of ``benchmarks/harness.py``'s ``MODELS``, each described there: the
  conv heads' implementations, the loop's speed-ups, compiled layers (whose compiling
  happens in the untimed steps), ``--bf16``'s master copy per parameter. Ask with
  ``--models``.

Every model is built by fairseq from the same command line but ``--arch`` and its own
options and trained by fairseq's ``Trainer`` on one fixed list of batches, the models
taking turns step by step (in the orders of ``harness.turn_order``), so load changes hit
all alike; figures are medians over rounds. Generation: ``SequenceGenerator`` (beam 5),
outputs forced to ``--gen-len`` tokens. Memory: on a GPU, PyTorch's allocator statistics (what stays
allocated after training plus a step's peak); on the CPU, the peak RSS of a process that
trains only that model, minus its RSS before building it.

    python -m benchmarks.bench_model --data data-bin/mine --sizes 128            # CPU
    python -m benchmarks.bench_model --quick                                      # synthetic data
    python -m benchmarks.bench_model --data DIR --device cuda --dtype bf16 --sizes 512,1024 --mfu
"""

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

#: bf16 dense matrix-multiply peak of the GPUs we report on (datasheet, TFLOP/s), by a
#: part of the device's name: the first that matches (the PCIe and NVL parts are slower
#: than the SXM ones, whose names say neither). The MFU of every dtype is of this peak.
PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200 NVL": 835.0,
    "H200": 989.0,
    "A100": 312.0,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--data", type=Path, help="binarized data folder (default: a synthetic corpus)")
    p.add_argument("--sizes", default="256", help=f"model widths d, from {sorted(harness.SIZES)}")
    p.add_argument("--layers", type=int, default=5, help="encoder and decoder layers each")
    p.add_argument(
        "--models",
        default=None,
        help="default: transformer,tpp,tpp-conv0 (on a GPU also transformer-b)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "fp16", "bf16"],
        help="training precision (fairseq's --fp16 / --bf16); generation runs in it too",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per batch (default: 2048 on CPU, 16384 on GPU)",
    )
    _add_measurement_arguments(p)
    p.add_argument("--mfu", action="store_true", help="model-FLOPs utilisation of training (GPU)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)"
    )
    p.add_argument("--quick", action="store_true", help="synthetic data, d=128, few rounds")
    p.add_argument("--json", type=Path, help="also write every measurement here")
    p.add_argument(
        "--isolate",
        type=int,
        default=0,
        metavar="N",
        help="measure every model in a process of its own, N repetitions with the models "
        "alternating (default 0: one process, models taking turns step by step; separate "
        "processes of the *same* model vary more than turns within one)",
    )
    p.add_argument("--memory-child", nargs=2, metavar=("MODEL", "SIZE"), help=argparse.SUPPRESS)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "SIZE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    harness.check_device(p, args)
    if args.quick:
        args.sizes, args.rounds, args.warmup, args.gen_batches = "128", 6, 2, 2
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s]
    for s in args.sizes:
        if s not in harness.SIZES:
            p.error(f"--sizes: {s} is not one of {sorted(harness.SIZES)}")
    gpu = args.device == "cuda"
    if args.models is None:
        args.models = (
            "transformer,transformer-b,tpp-conv0,tpp" if gpu else "transformer,tpp,tpp-conv0"
        )
    args.models = [m for m in args.models.split(",") if m]
    harness.check_models(p, args)
    args.update_freq = args.update_freq or (2 if gpu else 1)
    args.max_tokens = args.max_tokens or (16384 if gpu else 2048)
    args.gen_batch = args.gen_batch or (128 if gpu else 20)
    return args


def _add_measurement_arguments(p) -> None:
    """What is timed, how often, and in which batches."""
    p.add_argument("--rounds", type=int, default=12, help="timed training steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed training steps per model first")
    p.add_argument("--gen-batches", type=int, default=4, help="timed generation batches per model")
    p.add_argument(
        "--gen-batch", type=int, default=None, help="sentences per batch (default 20 CPU, 128 GPU)"
    )
    p.add_argument(
        "--gen-len", type=int, default=30, help="forced output length (tokens before EOS)"
    )
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--no-generation", action="store_true")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument(
        "--no-training",
        action="store_true",
        help="time generation only (the models train their --warmup steps untimed first)",
    )
    p.add_argument(
        "--partial",
        type=Path,
        help="after every timed training round, write the table of the rounds so far here "
        "(what a run stopped midway still reports)",
    )
    p.add_argument(
        "--update-freq",
        type=int,
        default=None,
        help="batches per timed training step (fairseq's --update-freq: gradients of N "
        "batches accumulated, one optimizer step; default 1 on CPU, 2 on GPU)",
    )
    p.add_argument(
        "--no-tf32",
        action="store_true",
        help="GPU, --dtype fp32: float32 matrix products as fairseq-train computes them "
        "(TF32 is used otherwise)",
    )
    p.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="GPU: let scaled_dot_product_attention use its cuDNN backend (all models; the "
        "plugin switches it off when loaded). Every batch shape runs once before the "
        "timing, so this times the kernel with its plans built, not the plan builds",
    )


# ----------------------------------------------------------------------------- GPU


def peak_tflops(device_name: str):
    """The bf16 dense peak of :data:`PEAK_TFLOPS` for a CUDA device's name, or None."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


def library_workspaces(args):
    """One throw-away matrix product, forward and backward, in the benchmark's dtype:
    cuBLAS takes its workspaces (per handle, so also for autograd's backward thread)
    from PyTorch's caching allocator at the first product and keeps them, so without
    this the first model measured would be charged for them in its memory."""
    import torch

    a = torch.randn(64, 64, device="cuda", dtype=harness.torch_dtype(args), requires_grad=True)
    (a @ a).sum().backward()
    harness.synchronize(args)


@contextlib.contextmanager
def peak_kept_through_fairseq():
    """fairseq's ``Trainer.train_step`` reads and *resets* the allocator's peak itself (for
    its ``gb_free`` metric), so a peak read after the step would miss the activations.
    Inside this context every reset first records the peak it clears; the list yielded
    holds those and, on exit, the peak since the last reset."""
    import torch

    peaks, reset = [], torch.cuda.reset_peak_memory_stats

    def recording_reset(*a, **k):
        peaks.append(torch.cuda.max_memory_allocated())
        reset(*a, **k)

    torch.cuda.reset_peak_memory_stats = recording_reset
    try:
        yield peaks
    finally:
        torch.cuda.reset_peak_memory_stats = reset
        peaks.append(torch.cuda.max_memory_allocated())


# ----------------------------------------------------------------------------- FLOPs


def train_flops(cfg, sample) -> float:
    """Model FLOPs of one training step (forward + backward = 3 × forward) on
    ``sample``, counting matrix products only (2 FLOPs per multiply-add), over real
    (non-pad) tokens, with S_i / T_i the source / target length of sentence i:

    per layer and source token  (encoder):  2·(P_self + 2·d·F) + 2·(2·S_i·w_dot)
    per layer and source token  (decoder K/V of cross-attention):  2·(2·d²)
    per layer and target token  (decoder):  2·(P_self + 2·d² + 2·d·F)
                                            + 2·(T_i·w_dot)      causal self-attention (half of T×T)
                                            + 2·(2·S_i·d)        cross-attention
                                            + conv heads: 2·F_k·C + 2·K·C (taps, prefix block)
    per target token  (output projection):  2·d·V

    where P_self is the weight count of a self-attention's projections (4·d² for
    fairseq's attention; d·(3·H_a·d_h + 2·H_c·d_h + H_c) + d² for the hybrid one),
    w_dot = H_a·d_h the width of the dot-product heads (d for fairseq's attention), C =
    H_c·d_h, F_k the layer's kernel width, K the prefix-softmax block (64; the encoder's
    sentence-wide pooling costs 2·C per token). The encoder's conv heads cost 2·F_k·C + 2·C per token."""
    m = cfg.model
    d, ffn, vocab = m.encoder_embed_dim, m.encoder_ffn_embed_dim, None
    heads = m.encoder_attention_heads
    dh = d // heads
    conv = {
        "encoder": getattr(m, "encoder_conv_heads", 0) or 0,
        "decoder": getattr(m, "decoder_conv_heads", 0) or 0,
    }
    if getattr(m, "_name", "") != "transformer_pp" and not str(getattr(m, "arch", "")).startswith(
        "transformer_pp"
    ):
        conv = {"encoder": 0, "decoder": 0}
    kernels = {
        side: [
            int(k) for k in str(getattr(m, f"{side}_conv_kernel_sizes", "") or "").split(",") if k
        ]
        for side in ("encoder", "decoder")
    }
    src_lengths = sample["net_input"]["src_lengths"].tolist()
    tgt_lengths = sample["target"].ne(1).sum(1).tolist()  # pad index 1
    vocab = sample["_vocab"]

    def self_attn_params(side):
        hc = conv[side]
        if hc == 0:
            return 4 * d * d, d
        ha = heads - hc
        return d * (3 * ha * dh + 2 * hc * dh + hc) + d * d, ha * dh

    total = 0.0
    p_enc, w_enc = self_attn_params("encoder")
    p_dec, w_dec = self_attn_params("decoder")
    for s, t in zip(src_lengths, tgt_lengths):
        for layer in range(m.encoder_layers):
            per = 2 * (p_enc + 2 * d * ffn) + 2 * (2 * s * w_enc)
            if conv["encoder"]:
                c = conv["encoder"] * dh
                per += 2 * kernels["encoder"][layer] * c + 2 * c
            total += s * per
        for layer in range(m.decoder_layers):
            total += s * 2 * (2 * d * d)
            per = 2 * (p_dec + 2 * d * d + 2 * d * ffn) + 2 * (t * w_dec) + 2 * (2 * s * d)
            if conv["decoder"]:
                c = conv["decoder"] * dh
                per += 2 * kernels["decoder"][layer] * c + 2 * 64 * c
            total += t * per
        total += t * 2 * d * vocab
    return 3 * total


# ----------------------------------------------------------------------------- measurements


def measure_training(size, args, results):
    """Builds every model's trainer (one after the other, so that on a GPU what each
    keeps allocated can be read off), then times training steps round by round.
    Returns the trainers (their models are reused for generation)."""
    import torch

    trainers = {}
    batches = None
    if args.device == "cuda":
        library_workspaces(args)
    for name in args.models:
        if args.device == "cuda":
            harness.synchronize(args)
            base = torch.cuda.memory_allocated()
        cfg, task, trainer = harness.build_trainer(name, size, args)
        if batches is None:
            batches = harness.training_steps(task, cfg, args.warmup + args.rounds, args)
            vocab = len(task.target_dictionary)
        start = time.perf_counter()
        for batch in batches[: args.warmup]:  # warm-up (the optimizer's state appears)
            trainer.train_step(batch)
        harness.synchronize(args)
        results.setdefault(name, {})["untimed_seconds"] = time.perf_counter() - start
        trainers[name] = (cfg, task, trainer)
        results.setdefault(name, {})["params"] = sum(p.numel() for p in trainer.model.parameters())
        if args.device == "cuda":
            harness.synchronize(args)
            # parameters, gradients, optimizer state (and fp32 master copy in fp16/bf16)
            results.setdefault(name, {})["persistent"] = torch.cuda.memory_allocated() - base
    if args.no_training:
        return trainers
    if args.device == "cuda":
        # every batch shape once, untimed: the first call with a new shape can cost
        # library set-up (kernel selection, workspaces) that a long run pays only once
        for name in args.models:
            start = time.perf_counter()
            for batch in batches[args.warmup :]:
                trainers[name][2].train_step(batch)
            harness.synchronize(args)
            results[name]["untimed_seconds"] += time.perf_counter() - start
    times = {name: [] for name in args.models}
    memory = {}
    for r in range(args.rounds):
        batch = batches[args.warmup + r]
        for name in harness.turn_order(args.models, r):
            trainer = trainers[name][2]
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                with peak_kept_through_fairseq() as peaks:
                    seconds, _ = harness.timed(lambda: trainer.train_step(batch), args)
                memory[name] = max(memory.get(name, 0), max(peaks) - before)
            else:
                seconds, _ = harness.timed(lambda: trainer.train_step(batch), args)
            times[name].append(seconds)
        training_figures(
            trainers,
            batches[args.warmup : r + args.warmup + 1],
            times,
            memory,
            vocab,
            args,
            results,
        )
        cycle = harness.turn_cycle(len(args.models))
        if args.partial and r >= 1 and (r + 1) % cycle == 0:  # what a run stopped midway
            # still reports, at whole cycles of turns
            write_atomically(
                args.partial,
                report(size, args, results, harness.device_label(args))
                + f"\n\n(partial: {r + 1} of {args.rounds} timed rounds)\n",
            )
    return trainers


def training_figures(trainers, batches, times, memory, vocab, args, results):
    """The training figures of the rounds timed so far (``batches``: theirs)."""
    tokens = [sum(b["ntokens"] for b in step) for step in batches]
    for name in args.models:
        cfg, task, trainer = trainers[name]
        wps = [n / s for n, s in zip(tokens, times[name])]
        entry = results.setdefault(name, {})
        entry["train_wps"] = statistics.median(wps)
        entry["train_wps_all"] = wps
        entry["step_seconds"] = statistics.median(times[name])
        if args.device == "cuda":
            entry["activation_peak"] = memory[name]
            entry["train_memory"] = entry["persistent"] + memory[name]
        if args.mfu:  # each step's FLOPs counted once (the table is redone every round)
            counted = entry.setdefault("step_flops", [])
            for step in batches[len(counted) :]:
                counted.append(sum(train_flops(cfg, dict(b, _vocab=vocab)) for b in step))
            flops = [n / sec for n, sec in zip(counted, times[name])]
            entry["train_tflops"] = statistics.median(flops) / 1e12


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def measure_generation(trainers, args, results):
    runs, samples = {}, None
    for name in args.models:
        cfg, task, trainer = trainers[name]
        model = trainer.model.eval()
        runs[name] = (task, model, harness.beam_search(task, model, args))
        if samples is None:
            samples = harness.test_batches(task, cfg, args)
    times = {name: [] for name in args.models}
    for name, seconds, hyps in harness.generation_turns(runs, samples, args):
        lengths = {len(h[0]["tokens"]) for h in hyps}
        assert lengths == {args.gen_len + 1}, f"{name}: output lengths {lengths}"
        times[name].append(seconds)
    sentences = [s["nsentences"] for s in samples[1:]]
    for name in args.models:
        rates = [n / s for n, s in zip(sentences, times[name])]
        results[name]["gen_sent_per_s"] = statistics.median(rates)
        results[name]["gen_sent_per_s_all"] = rates


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """The process's peak resident set size since the last :func:`reset_peak_rss`."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def memory_child(name, size, args):
    """(In a separate process) peak RSS while building and training one model, minus
    the RSS before building it (imports, data and batches are already in memory)."""
    cfg, task = harness.setup(name, size, args)  # imports, dictionaries
    batches = harness.fixed_batches(task, cfg, "train", args.warmup + 3, max_tokens=args.max_tokens)
    base = rss()
    reset_peak_rss()
    _, _, trainer = harness.build_trainer(name, size, args, cfg, task)
    for batch in batches:
        trainer.train_step([batch])
    print("BENCH_MEMORY " + json.dumps({"peak": peak_rss(), "base": base}), flush=True)


def measure_cpu_memory(size, args, results):
    for name in args.models:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_model",
            "--memory-child",
            name,
            str(size),
            "--data",
            str(args.data),
            "--device",
            "cpu",
            "--dtype",
            args.dtype,
            "--max-tokens",
            str(args.max_tokens),
            "--layers",
            str(args.layers),
            "--models",
            ",".join(args.models),
            "--threads",
            str(args.threads),
            "--warmup",
            str(args.warmup),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = [text for text in out.stdout.splitlines() if text.startswith("BENCH_MEMORY ")]
        if out.returncode != 0 or not line:
            raise SystemExit(f"memory measurement of {name} failed:\n{out.stderr[-3000:]}")
        record = json.loads(line[-1][len("BENCH_MEMORY ") :])
        results[name]["train_memory"] = record["peak"] - record["base"]


# ----------------------------------------------------------------------------- report


def report(size, args, results, device_name):
    mib = 2**20
    lines = [
        f"### d={size}, {harness.SIZES[size][0]} heads, FFN {harness.SIZES[size][1]}, {args.layers}+{args.layers} layers, "
        f"{args.dtype}, {device_name}",
        "",
    ]
    trained = "train_wps" in results[args.models[0]]
    head = "| model | parameters |" + (" train words/s | step ms |" if trained else "")
    rule = "|---|---:|" + ("---:|---:|" if trained else "")
    if "gen_sent_per_s" in results[args.models[0]]:
        head += f" beam-{args.beam} sentences/s ({args.gen_len}-token outputs) |"
        rule += "---:|"
    if "train_memory" in results[args.models[0]]:
        head += " training memory |"
        rule += "---:|"
    peak = None
    if args.mfu and args.device == "cuda":
        peak = peak_tflops(device_name)
    if args.mfu and trained:
        of = f"{peak:g} TFLOP/s" if peak else "unknown"
        head += f" model TFLOP/s | MFU (of the bf16 peak, {of}) |"
        rule += "---:|---:|"
    lines += [head, rule]
    for name in args.models:
        r = results[name]
        row = f"| {name} | {r['params'] / 1e6:.1f}M |"
        if trained:
            row += (
                f" {r['train_wps']:,.0f} ({harness.plus_minus(harness.spread(r['train_wps_all']))}) "
                f"| {1000 * r['step_seconds']:.1f} |"
            )
        if "gen_sent_per_s" in r:
            row += f" {r['gen_sent_per_s']:.2f} ({harness.plus_minus(harness.spread(r['gen_sent_per_s_all']))}) |"
        if "train_memory" in r:
            row += f" {r['train_memory'] / mib:,.0f} MiB |"
        if args.mfu and trained:
            mfu = f"{100 * r['train_tflops'] / peak:.1f}%" if peak else "n/a"
            row += f" {r['train_tflops']:.0f} | {mfu} |"
        lines.append(row)
    compiled = [name for name in args.models if name in harness.COMPILED]
    if compiled and "untimed_seconds" in results[args.models[0]]:
        untimed = ", ".join(f"{n} {results[n]['untimed_seconds']:.0f} s" for n in args.models)
        lines += ["", f"Untimed first steps (the compiling included): {untimed}."]
    if "transformer" in results:
        base = results["transformer"]
        keys = [("train_wps", "training words/s", True)] if trained else []
        if "gen_sent_per_s" in base:
            keys.append(("gen_sent_per_s", "generation sentences/s", True))
        if "train_memory" in base:
            keys.append(("train_memory", "training memory", False))
        lines += [
            "",
            "| ratio to transformer | " + " | ".join(k[1] for k in keys) + " |",
            "|---|" + "---:|" * len(keys),
        ]
        for name in args.models:
            if name == "transformer":
                continue
            cells = []
            for key, _, _ in keys:
                ratio = results[name][key] / base[key]
                if key + "_all" in results[name]:  # paired: per-round ratios
                    paired = harness.paired_text(results[name][key + "_all"], base[key + "_all"])
                    cells.append(f"{ratio:.2f}× ({paired})")
                else:
                    cells.append(f"{ratio:.2f}×")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def child_command(name, size, args):
    """This script, measuring one model of one size in a process of its own."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_model",
        "--child",
        name,
        str(size),
        "--data",
        str(args.data),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-tokens",
        str(args.max_tokens),
        "--layers",
        str(args.layers),
        "--rounds",
        str(args.rounds),
        "--warmup",
        str(args.warmup),
        "--gen-batches",
        str(args.gen_batches),
        "--gen-batch",
        str(args.gen_batch),
        "--gen-len",
        str(args.gen_len),
        "--beam",
        str(args.beam),
        "--threads",
        str(args.threads),
        "--models",
        name,
        "--isolate",
        "0",
    ]
    cmd += ["--update-freq", str(args.update_freq)]
    if args.cudnn_attention:
        cmd.append("--cudnn-attention")
    if args.no_tf32:
        cmd.append("--no-tf32")
    if args.no_generation:
        cmd.append("--no-generation")
    if args.mfu:
        cmd.append("--mfu")
    return cmd


def measure_isolated(size, args):
    """Every model in its own process, ``args.isolate`` repetitions, in turns (as in training);
    each figure is the median over repetitions of the process's own median, and the
    ``_all`` lists hold one value per repetition (so the report's paired ratios pair
    the repetitions)."""
    per_model = {name: [] for name in args.models}
    for rep in range(args.isolate):
        for name in harness.turn_order(args.models, rep):
            out = subprocess.run(child_command(name, size, args), capture_output=True, text=True)
            line = [text for text in out.stdout.splitlines() if text.startswith("BENCH_RESULT ")]
            if out.returncode != 0 or not line:
                raise SystemExit(
                    f"{name} (d={size}) failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
                )
            per_model[name].append(json.loads(line[-1][len("BENCH_RESULT ") :]))
    results = {}
    for name, reps in per_model.items():
        entry = {}
        for key in reps[0]:
            values = [r[key] for r in reps]
            if key.endswith("_all"):
                continue
            if isinstance(values[0], (int, float)):
                entry[key] = statistics.median(values)
                if key in ("train_wps", "gen_sent_per_s"):
                    entry[key + "_all"] = values
        results[name] = entry
    return results


def main(argv=None):
    args = parse_args(argv)
    import logging

    import torch

    logging.disable(logging.WARNING)  # fairseq's INFO lines would bury the tables

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        name, size = args.memory_child
        memory_child(name, int(size), args)
        return
    harness.gpu_settings(args)
    if args.child:
        name, size = args.child
        results = {}
        trainers = measure_training(int(size), args, results)
        if not args.no_generation:
            measure_generation(trainers, args, results)
        print("BENCH_RESULT " + json.dumps(results[name]), flush=True)
        return
    work = None
    if args.data is None:
        work = Path(tempfile.mkdtemp(prefix="bench_model_"))
        args.data = harness.synthetic_data(work)
    device_name = harness.device_label(args)
    started = time.perf_counter()
    everything = {}
    try:
        for size in args.sizes:
            if args.isolate:
                results = measure_isolated(size, args)
            else:
                results = {}
                trainers = measure_training(size, args, results)
                if not args.no_generation:
                    measure_generation(trainers, args, results)
                del trainers
            if not args.no_memory and args.device == "cpu":
                measure_cpu_memory(size, args, results)
            text = report(size, args, results, device_name)
            print(text + "\n", flush=True)
            everything[size] = {"results": results, "report": text}
            if args.device == "cuda":
                torch.cuda.empty_cache()
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    how = (
        f"each model in its own process, {args.isolate} repetitions"
        if args.isolate
        else "one process, models taking turns step by step"
    )
    how += f"; {args.rounds} timed steps per model (after {args.warmup} untimed)"
    if args.update_freq > 1:
        how += f" of {args.update_freq} batches each (--update-freq)"
    if args.cudnn_attention:
        how += "; cuDNN attention allowed"
    if args.dtype == "fp32" and args.device == "cuda":
        how += "; float32 matrix products " + ("without TF32" if args.no_tf32 else "in TF32")
    if not args.no_generation:
        how += f", {args.gen_batches} generation batches of {args.gen_batch} sentences"
    print(
        f"{how}, --max-tokens {args.max_tokens}, data {args.data}; "
        f"total {(time.perf_counter() - started) / 60:.1f} min."
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "sizes": everything},
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
