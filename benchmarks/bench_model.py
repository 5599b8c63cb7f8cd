#!/usr/bin/env python3
"""Training and beam-search speed, and training memory, of transformer_pp against
fairseq's transformer of the same size, through the real fairseq CLIs.

Models (same width, heads, FFN, layers, dropouts, shared embeddings, data and batches):

* ``transformer``     fairseq's own ``--arch transformer``;
* ``tpp``             ``--arch transformer_pp`` (half the heads are convolution heads);
* ``tpp-conv0``       ``transformer_pp`` with ``--encoder-conv-heads 0 --decoder-conv-heads 0``
                      (fairseq's MultiheadAttention everywhere: the ablation).

For every repetition each model is trained with ``fairseq-train --max-update N`` and
then decodes the test set with ``fairseq-generate --beam 5``; the models take turns
(the order rotates every repetition), so a change of machine load hits all of them.

* training words/s: the ``wps`` of fairseq's JSON ``train_inner`` records (target tokens
  per second over each log interval), the first record skipped as warm-up, median of
  the rest; then the median over repetitions.
* generation: sentences/s and tokens/s from fairseq-generate's "Translated ..." line.
  The output length is forced (``--max-len-a 0 --max-len-b L --min-len L``) so every
  model generates exactly the same number of tokens; the checkpoint is the one each
  model wrote in the first repetition. A second, long-output decoding of the
  validation sentences (``--long-gen-len``) shows how the speed moves with output
  length: the dot-product heads' key/value cache grows (and is reordered) every step,
  the convolution heads' state does not.
* training memory: peak resident set size (RSS) of the fairseq-train process, and the
  same peak minus the RSS just before the first training step (what the updates add:
  gradients, Adam's moments, activations). CPU tensors come from the system allocator,
  which keeps no statistics of its own, so RSS is the measure here.

Ratios are tpp / transformer (higher is better for speed, lower for memory), both of
the medians and the median of the per-repetition ratios (pairs measured back to back).

    python benchmarks/bench_model.py            # default size, about 8-10 minutes on 2 cores
    python benchmarks/bench_model.py --quick    # about 2 minutes, smaller and noisier

Each fairseq process runs with one thread by default (``--threads``): on a machine
shared with other jobs, two OpenMP threads on two cores stall each other and the
timings swing by an order of magnitude; use ``--threads 0`` on an idle machine.
"""

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "tpp_plugin"

MODELS = {
    "transformer": ["--arch", "transformer"],
    "tpp": ["--arch", "transformer_pp", "--encoder-tag-layers", ""],
    "tpp-conv0": ["--arch", "transformer_pp", "--encoder-tag-layers", "",
                  "--encoder-conv-heads", "0", "--decoder-conv-heads", "0"],
}

# fairseq-train in this process, recording the RSS just before the first update and the
# peak RSS at the end (ru_maxrss is in KiB on Linux).
TRAIN_WRAPPER = r"""
import json, resource, sys
from fairseq_cli.train import cli_main  # first: it configures logging
from fairseq import trainer
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE")
seen = {}
original = trainer.Trainer.train_step
def train_step(self, *args, **kwargs):
    seen.setdefault("before_first_step", rss())
    return original(self, *args, **kwargs)
trainer.Trainer.train_step = train_step
sys.argv = ["fairseq-train"] + sys.argv[1:]
try:
    cli_main()
finally:
    seen["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("BENCH_MEMORY " + json.dumps(seen), flush=True)
"""

GEN_WRAPPER = r"""
import json, resource, sys
from fairseq_cli.generate import cli_main
sys.argv = ["fairseq-generate"] + sys.argv[1:]
try:
    cli_main()
finally:
    print("BENCH_MEMORY " + json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}),
          flush=True)
"""

TRANSLATED = re.compile(
    r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s \(([\d.]+) sentences/s, ([\d.]+) tokens/s\)"
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small, 1-2 minute version (fewer updates, sentences, repetitions)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--models", default="transformer,tpp,tpp-conv0",
                        help=f"comma-separated, from {', '.join(MODELS)}")
    # model size (the same for every model)
    parser.add_argument("--embed-dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn-dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=5, help="encoder and decoder layers each")
    # data
    parser.add_argument("--vocab", type=int, default=4000, help="word types per language")
    parser.add_argument("--min-len", type=int, default=20, help="shortest sentence (tokens)")
    parser.add_argument("--max-len", type=int, default=40, help="longest sentence (tokens)")
    parser.add_argument("--train-sentences", type=int, default=4000)
    parser.add_argument("--test-sentences", type=int, default=60)
    # training
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens per batch")
    parser.add_argument("--updates", type=int, default=12, help="updates per training run")
    parser.add_argument("--log-interval", type=int, default=2, help="updates per wps record")
    # generation
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--gen-batch", type=int, default=20, help="sentences per batch")
    parser.add_argument("--gen-len", type=int, default=25,
                        help="forced output length (tokens before EOS)")
    parser.add_argument("--long-gen-len", type=int, default=100,
                        help="also decode the validation sentences (--valid-sentences) to this forced "
                             "length, where the dot-product heads' growing cache matters (0: skip)")
    parser.add_argument("--valid-sentences", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch/OpenMP threads of each fairseq process (default 1: on a machine "
                             "shared with other jobs, 2 threads on 2 cores stall in OpenMP "
                             "barriers and time swings by an order of magnitude; 0 = torch's default)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the corpus, data-bin and checkpoints here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write all measurements here")
    args = parser.parse_args(argv)
    if args.quick:
        defaults = dict(repetitions=2, train_sentences=1000, test_sentences=20, updates=6,
                        log_interval=2, max_tokens=512, gen_len=20, long_gen_len=40,
                        valid_sentences=10)
        for name, value in defaults.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    return args


# ----------------------------------------------------------------------------- data


def make_corpus(folder: Path, args):
    """Synthetic parallel text: Zipf-distributed source words; the target maps each word
    through a fixed permutation, swaps neighbouring pairs and sometimes drops or adds a
    word, so the lengths of a pair differ a little, as in real data."""
    rng = random.Random(1234)
    weights = [1.0 / (rank + 1) for rank in range(args.vocab)]
    permutation = list(range(args.vocab))
    rng.shuffle(permutation)
    sizes = {"train": args.train_sentences, "valid": args.valid_sentences, "test": args.test_sentences}
    for split, size in sizes.items():
        sources, targets = [], []
        for _ in range(size):
            length = rng.randint(args.min_len, args.max_len)
            words = rng.choices(range(args.vocab), weights=weights, k=length)
            target = [permutation[w] for w in words]
            for i in range(0, len(target) - 1, 2):
                if rng.random() < 0.3:
                    target[i], target[i + 1] = target[i + 1], target[i]
            if rng.random() < 0.3 and len(target) > args.min_len:
                del target[rng.randrange(len(target))]
            elif rng.random() < 0.3 and len(target) < args.max_len:
                target.insert(rng.randrange(len(target)), rng.randrange(args.vocab))
            sources.append(" ".join(f"s{w}" for w in words))
            targets.append(" ".join(f"t{w}" for w in target))
        (folder / f"{split}.src").write_text("\n".join(sources) + "\n")
        (folder / f"{split}.tgt").write_text("\n".join(targets) + "\n")


def binarize(raw: Path, dest: Path):
    command = [
        "fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary",
        "--trainpref", str(raw / "train"), "--validpref", str(raw / "valid"),
        "--testpref", str(raw / "test"), "--destdir", str(dest), "--workers", "1",
    ]
    run(command)


# ----------------------------------------------------------------------------- runs


def env_for(args):
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run(command, env=None):
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"command failed ({result.returncode}): {' '.join(command)}\n"
                         f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def model_args(name, args):
    size = []
    for side in ("encoder", "decoder"):
        size += [f"--{side}-embed-dim", str(args.embed_dim), f"--{side}-ffn-embed-dim", str(args.ffn_dim),
                 f"--{side}-attention-heads", str(args.heads), f"--{side}-layers", str(args.layers)]
    # identical regularisation: transformer_pp's presets set these, fairseq's defaults differ
    size += ["--dropout", "0.1", "--attention-dropout", "0.1", "--activation-dropout", "0.1",
             "--share-all-embeddings"]
    # the plugin is loaded for every model: the same batching (it keeps fairseq's last
    # incomplete batch) and the same checkpoint loading
    return MODELS[name] + size + ["--user-dir", str(PLUGIN)]


def memory_record(output):
    for line in output.splitlines():
        if line.startswith("BENCH_MEMORY "):
            return json.loads(line[len("BENCH_MEMORY "):])
    raise SystemExit("no memory record in the output")


def train(name, data, save_dir: Path, save: bool, args):
    command = [
        sys.executable, "-c", TRAIN_WRAPPER, str(data),
        *model_args(name, args),
        "--task", "translation", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "1e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
        "--max-tokens", str(args.max_tokens), "--max-update", str(args.updates),
        "--log-format", "json", "--log-interval", str(args.log_interval),
        "--disable-validation", "--num-workers", "0", "--seed", "1",
        "--save-dir", str(save_dir),
    ]
    command += ["--no-epoch-checkpoints"] if save else ["--no-save"]
    output = run(command, env=env_for(args))
    records = []
    for line in output.splitlines():
        if "| train_inner |" in line:
            records.append(json.loads(line[line.index("{"):]))
    if len(records) < 2:
        raise SystemExit(f"{name}: fewer than 2 train_inner records; raise --updates")
    wps = [float(r["wps"]) for r in records[1:]]
    memory = memory_record(output)
    return {
        "wps": statistics.median(wps),
        "wps_records": wps,
        "peak_rss": memory["peak"],
        "step_rss": memory["peak"] - memory["before_first_step"],
    }


def generate(name, data, checkpoint: Path, args, subset="test", length=None, prefix=""):
    length = length or args.gen_len
    command = [
        sys.executable, "-c", GEN_WRAPPER, str(data), "--path", str(checkpoint),
        "--gen-subset", subset, "--beam", str(args.beam), "--batch-size", str(args.gen_batch),
        "--max-len-a", "0", "--max-len-b", str(length), "--min-len", str(length),
        "--num-workers", "0", "--quiet", "--user-dir", str(PLUGIN),
    ]
    output = run(command, env=env_for(args))
    match = TRANSLATED.search(output)
    if not match:
        raise SystemExit(f"{name}: no 'Translated ...' line in fairseq-generate's output")
    sentences, tokens = (int(match.group(i).replace(",", "")) for i in (1, 2))
    return {
        prefix + "sentences": sentences,
        prefix + "tokens": tokens,
        prefix + "seconds": float(match.group(3)),
        prefix + "sent_per_s": float(match.group(4)),
        prefix + "tok_per_s": tokens / float(match.group(3)),
        prefix + "gen_peak_rss": memory_record(output)["peak"],
    }


# ----------------------------------------------------------------------------- report


def median_of(results, name, key):
    return statistics.median(r[key] for r in results[name])


def paired_ratio(results, name, key, base="transformer"):
    return statistics.median(a[key] / b[key] for a, b in zip(results[name], results[base]))


def report(results, args, elapsed):
    mib = 1024 * 1024
    long = bool(args.long_gen_len)

    def runs(name, key, fmt):
        return " / ".join(format(r[key], fmt) for r in results[name])

    head = "| model | train words/s | gen sentences/s | gen tokens/s |"
    rule = "|---|---|---|---|"
    if long:
        head += f" gen sentences/s, {args.long_gen_len}-token outputs |"
        rule += "---|"
    head += " train peak RSS | train RSS above setup | generate peak RSS |"
    rule += "---|---|---|"
    lines = [head, rule]
    for name in args.models:
        row = (
            f"| {name} | {median_of(results, name, 'wps'):,.0f} ({runs(name, 'wps', ',.0f')}) "
            f"| {median_of(results, name, 'sent_per_s'):.2f} ({runs(name, 'sent_per_s', '.2f')}) "
            f"| {median_of(results, name, 'tok_per_s'):,.0f} |"
        )
        if long:
            row += (f" {median_of(results, name, 'long_sent_per_s'):.3f} "
                    f"({runs(name, 'long_sent_per_s', '.3f')}) |")
        row += (
            f" {median_of(results, name, 'peak_rss') / mib:,.0f} MiB "
            f"| {median_of(results, name, 'step_rss') / mib:,.0f} MiB "
            f"| {median_of(results, name, 'gen_peak_rss') / mib:,.0f} MiB |"
        )
        lines.append(row)
    if "transformer" in results:
        keys = [("wps", "training"), ("sent_per_s", "generation")]
        if long:
            keys.append(("long_sent_per_s", f"generation, {args.long_gen_len} tokens"))
        keys += [("peak_rss", "train peak RSS"), ("step_rss", "train RSS above setup")]
        lines += ["", "| ratio to transformer | " + " | ".join(label for _, label in keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for name in args.models:
            if name == "transformer":
                continue
            cells = []
            for key, _ in keys:
                of_medians = median_of(results, name, key) / median_of(results, "transformer", key)
                cells.append(f"{of_medians:.2f}× (paired {paired_ratio(results, name, key):.2f}×)")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    tokens = {name: sorted({r["tokens"] for r in results[name]}) for name in args.models}
    lines += [
        "",
        f"{args.repetitions} repetitions, models interleaved; d={args.embed_dim}, {args.heads} heads, "
        f"FFN {args.ffn_dim}, {args.layers}+{args.layers} layers, shared embeddings; "
        f"{args.updates} updates of --max-tokens {args.max_tokens}; beam {args.beam}, batch "
        f"{args.gen_batch}, {args.test_sentences} sentences of exactly {args.gen_len} tokens + EOS"
        + (f" (and {args.valid_sentences} of {args.long_gen_len})" if long else "")
        + f"; generated tokens per run: {tokens}; {args.threads or 'default'} thread(s) per process; "
        f"total {elapsed / 60:.1f} min.",
    ]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_model_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        raw, data = work / "raw", work / "data-bin"
        raw.mkdir(exist_ok=True)
        make_corpus(raw, args)
        if data.exists():
            shutil.rmtree(data)
        binarize(raw, data)
        results = {name: [] for name in args.models}
        for rep in range(args.repetitions):
            order = args.models[rep % len(args.models):] + args.models[: rep % len(args.models)]
            for name in order:
                save_dir = work / "checkpoints" / name
                first = rep == 0
                # an empty folder, or fairseq-train would resume from a checkpoint in it
                train_dir = save_dir if first else work / "scratch"
                shutil.rmtree(train_dir, ignore_errors=True)
                measured = train(name, data, train_dir, save=first, args=args)
                measured.update(generate(name, data, save_dir / "checkpoint_last.pt", args))
                if args.long_gen_len:
                    measured.update(generate(name, data, save_dir / "checkpoint_last.pt", args,
                                             subset="valid", length=args.long_gen_len, prefix="long_"))
                results[name].append(measured)
                print(f"rep {rep + 1}/{args.repetitions} {name:12s} train {measured['wps']:8,.0f} wps  "
                      f"gen {measured['sent_per_s']:6.2f} sent/s {measured['tok_per_s']:8,.0f} tok/s  "
                      f"peak RSS {measured['peak_rss'] / 2**20:6,.0f} MiB "
                      f"(+{measured['step_rss'] / 2**20:,.0f} in training)", flush=True)
        elapsed = time.perf_counter() - start
        print()
        print(report(results, args, elapsed))
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": results}, indent=1))
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
