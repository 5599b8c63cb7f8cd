#!/usr/bin/env python3
"""fairseq-train as it is, plus what its log lacks for a benchmark; and the table of
several such runs.

    python -m benchmarks.fairseq_train_run train DATA ARGS...
    python -m benchmarks.fairseq_train_run model DATA NAME [OPTIONS] [-- ARGS...]
    python -m benchmarks.fairseq_train_run table NAME=LOG [NAME=LOG ...]

``train`` runs ``fairseq_cli.train`` with the arguments given and, when it ends,
prints ``TRAIN_RUN {"peak_gpu_bytes": ...}`` (PyTorch's peak allocation on the GPU:
parameters, optimizer state and activations). ``model`` trains one of the benchmarks'
models (``transformer``, ``tpp``, ``tpp-tags``, ...) with the command line that
``bench_model.py`` builds for it: the same size, layers and dropouts for every model
(the ``--arch`` presets differ in them), ARGS added at the end.

``table`` reads the standard output of such runs (fairseq's log with
``--log-format json``; a run cut off is read as far as it got) and prints one
Markdown row per run: updates, target words/s (the median of the logged intervals
after the first, which holds start-up), the loss of the last logged interval,
fairseq's "done training in" and the peak GPU memory.
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from .harness import COMPILED, MODELS, MULTI_TENSOR_SYNC, SIZES, check_device, command_line

MARK = "TRAIN_RUN "


def train(argv):
    import torch

    from fairseq_cli.train import cli_main

    # fairseq's trainer resets the allocator's peak at every step (for its gb_free
    # metric): keep the largest peak that each reset clears
    peak, reset = [0], torch.cuda.reset_peak_memory_stats

    def recording_reset(*args, **kwargs):
        peak[0] = max(peak[0], torch.cuda.max_memory_allocated())
        reset(*args, **kwargs)

    torch.cuda.reset_peak_memory_stats = recording_reset
    sys.argv = ["fairseq-train", *argv]
    try:
        cli_main()
    finally:
        if torch.cuda.is_available():
            peak[0] = max(peak[0], torch.cuda.max_memory_allocated())
        print(MARK + json.dumps({"peak_gpu_bytes": peak[0] or None}), flush=True)


def model_arguments(argv):
    """fairseq-train's arguments for ``model DATA NAME [OPTIONS] [-- ARGS...]``."""
    argv, extra = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(prog="python -m benchmarks.fairseq_train_run model")
    p.add_argument("data")
    # (the -sync and -compiled models get their speed-up from bench_model's trainer, not from
    # fairseq-train: here TPP_FAIRSEQ_SPEEDUPS=multi-tensor-sync or compiled-layers with the
    # model without the suffix does that)
    speedups = MULTI_TENSOR_SYNC | COMPILED
    p.add_argument("model", choices=[m for m in MODELS if m not in speedups])
    p.add_argument("--size", type=int, default=512, choices=list(SIZES), help="d (default 512)")
    p.add_argument("--layers", type=int, default=6, help="encoder and decoder layers each")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda where there is one")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--updates", type=int, default=150)
    p.add_argument("--log-interval", type=int, default=25)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(p, args)
    args.dtype = "fp32"  # a precision is one of ARGS (--bf16, --fp16, ...), as fairseq takes it
    logging = ["--max-update", args.updates, "--log-format", "json"]
    logging += ["--log-interval", args.log_interval]
    return command_line(args.model, args.size, args) + list(map(str, logging + extra))


def parse(text):
    """What one run's log says: its train_inner records, its seconds and its peak."""
    inner, done, peak = [], None, None
    for line in text.splitlines():
        if "| train_inner | {" in line:
            inner.append(json.loads(line.split("| train_inner | ", 1)[1]))
        elif "done training in" in line:
            done = float(re.search(r"done training in ([\d.]+) seconds", line).group(1))
        elif line.startswith(MARK):
            peak = json.loads(line[len(MARK) :])["peak_gpu_bytes"]
    return inner, done, peak


def row(name, text):
    inner, done, peak = parse(text)
    if not inner:
        return f"| {name} | 0 | – | – | – | – |"
    wps = [float(r["wps"]) for r in inner[1:]] or [float(inner[0]["wps"])]
    cells = [
        name,
        str(inner[-1]["num_updates"]),
        f"{statistics.median(wps):,.0f}",
        f"{float(inner[-1]['loss']):.3f}",
        f"{done:.1f} s" if done is not None else "cut off",
        f"{peak / 2**30:.2f} GiB" if peak else "–",
    ]
    return "| " + " | ".join(cells) + " |"


def table(pairs):
    lines = [
        "| run | updates | words/s | loss, last interval | done training in | peak GPU memory |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for pair in pairs:
        name, _, path = pair.partition("=")
        path = Path(path)
        if not path.exists():
            path = Path(f"{path}.partial")  # a run cut off or failed keeps its output there
        lines.append(
            row(name, path.read_text(errors="replace"))
            if path.exists()
            else f"| {name} | not run | | | | |"
        )
    return "\n".join(lines)


def main():
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if len(sys.argv) < 2 or sys.argv[1] not in ("train", "model", "table"):
        raise SystemExit(__doc__.split("\n\n")[1])
    if sys.argv[1] == "train":
        train(sys.argv[2:])
    elif sys.argv[1] == "model":
        train(model_arguments(sys.argv[2:]))
    else:
        print(table(sys.argv[2:]))


if __name__ == "__main__":
    main()
