"""Train and evaluate the paper's ablation with one budget and one data set:

  (a) transformer   plain Transformer attention (conv heads 0), no tag losses
  (b) hybrid        hybrid dot-product/convolution heads, no tag losses
  (c) hybrid+tags   hybrid heads and the POS/NER losses (Transformer++)

and write one Markdown table (parameters, BLEU, training words/s). One seed per
variant and no significance test: ``tpp-study`` answers the same question with a
control, several seeds and paired bootstrap resampling.

On the shipped sample (after ``make demo`` prepared it)::

    python -m tpp_tools.ablation --data runs/demo/data-bin/sample_en_de \\
        --reference data/sample/test.de --out runs/ablation --max-update 2400

At full scale, give the WMT'14 data folder and the paper's preset, and pass training
options after ``--`` (they go to scripts/train.sh, e.g. ``-- --fp16``)::

    python -m tpp_tools.ablation --data data-bin/wmt14_en_de --preset en-de \\
        --reference work/wmt14_en_de/raw/newstest2014.de --out runs/ablation_wmt14 \\
        --max-update 320000 --update-freq 10 --max-tokens 4096 --gpu

Every run has its own folder under --out and is resumed/reused when it exists.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path


def checkout():
    """The repository this package runs from (scripts/train.sh trains the variants)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "scripts" / "train.sh").is_file():
        raise SystemExit("the ablation runs scripts/train.sh of a checkout of the repository; "
                         "this package is installed elsewhere")
    return root


VARIANTS = [
    # name, description, extra train.sh/fairseq options
    ("transformer", "plain Transformer attention (0 conv heads), no tags",
     ["--task", "translation_with_tags"], ["--encoder-conv-heads", "0", "--decoder-conv-heads", "0", "--tags", "", "--encoder-tag-layers", ""]),
    ("hybrid", "hybrid heads, no tags",
     ["--task", "translation_with_tags"], ["--tags", "", "--encoder-tag-layers", ""]),
    ("hybrid+tags", "hybrid heads + POS/NER losses (Transformer++)",
     ["--task", "translation_with_tags"], []),
]

#: the CPU demo's settings besides its model (--preset cpu: --arch transformer_pp_cpu)
DEMO_MODEL = ["--dropout", "0.2"]


def run(cmd, log=None):
    print("+", " ".join(map(str, cmd)), flush=True)
    if log is None:
        subprocess.run([str(c) for c in cmd], check=True)
        return
    with open(log, "a") as fh:
        subprocess.run([str(c) for c in cmd], check=True, stdout=fh, stderr=subprocess.STDOUT)


def train_records(log: Path, key: str = "train_wps"):
    """fairseq's per-epoch ``train`` records (or, with ``key="valid_loss"``, its
    validation records) from its JSON --log-file."""
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if key in record:
                out.append(record)
    return out


def trained_updates(checkpoint: Path) -> int:
    """How many updates a (last) checkpoint has seen; 0 when it does not exist. A
    finished run is not restarted: fairseq would train one more update."""
    if not checkpoint.exists():
        return 0
    import torch

    import tpp_plugin  # noqa: F401  (allow-lists fairseq's checkpoint contents)

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return int(state["optimizer_history"][-1]["num_updates"])


def count_parameters(checkpoint: Path) -> int:
    import torch

    import tpp_plugin  # noqa: F401  (allow-lists fairseq's checkpoint contents)

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return sum(t.numel() for t in state["model"].values() if hasattr(t, "numel"))


def read_bleu(path: Path) -> dict:
    scores = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(": ")
        if key in ("sacrebleu_detok", "bleu_tok_compound_split"):
            scores[key] = float(value)
    return scores


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tpp_tools.ablation",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--data", required=True, type=Path, help="binarized data with POS/NER labels")
    parser.add_argument("--reference", required=True, type=Path, help="raw reference of the test split")
    parser.add_argument("--out", required=True, type=Path, help="one folder per variant, and ablation.md")
    parser.add_argument("--preset", default="cpu", help="scripts/train.sh preset [cpu = the CPU demo model]")
    parser.add_argument("--max-update", type=int, default=2400)
    parser.add_argument("--update-freq", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--lr", default="1e-3")
    parser.add_argument("--average", type=int, default=5, help="average the last N interval checkpoints")
    parser.add_argument("--gpu", action="store_true", help="train on the GPU (default: CPU)")
    parser.add_argument("--variants", default="transformer,hybrid,hybrid+tags")
    parser.add_argument("extra", nargs="*", help="options after -- go to scripts/train.sh")
    args = parser.parse_args(argv)

    if not (args.data / "dict.pos.txt").exists():
        parser.error(f"{args.data} has no POS/NER labels (dict.pos.txt): prepare it with tpp-prepare-corpus")
    if not args.reference.exists():
        parser.error(f"reference {args.reference} does not exist")
    wanted = args.variants.split(",")
    unknown = set(wanted) - {v[0] for v in VARIANTS}
    if unknown:
        parser.error(f"unknown --variants {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    save_every = max(1, args.max_update // 10)
    rows = []
    for name, description, train_opts, model_opts in VARIANTS:
        if name not in wanted:
            continue
        folder = args.out / name.replace("+", "_")
        ckpt = folder / "checkpoints"
        ckpt.mkdir(parents=True, exist_ok=True)
        log = ckpt / "train.log"
        print(f"\n=== {name}: {description}", flush=True)
        cmd = ["bash", checkout() / "scripts" / "train.sh", "--preset", args.preset, "--data", args.data,
               "--save-dir", ckpt, "--max-update", args.max_update, "--update-freq", args.update_freq,
               "--max-tokens", args.max_tokens, "--lr", args.lr, "--warmup-updates", min(4000, max(1, args.max_update // 6)),
               "--save-interval-updates", save_every, "--keep-interval-updates", args.average,
               "--log-interval", 50, *train_opts]
        if not args.gpu:
            cmd.append("--cpu")
        cmd += ["--", *(DEMO_MODEL if args.preset == "cpu" else []), *model_opts,
                "--log-format", "json", "--log-file", log, "--no-progress-bar", "--num-workers", "0",
                *args.extra]
        if trained_updates(ckpt / "checkpoint_last.pt") >= args.max_update:
            print(f"reusing {ckpt} (trained)", flush=True)
        else:
            run(cmd, log=folder / "train.out")
        avg = ckpt / "checkpoint_avg.pt"
        interval = sorted(ckpt.glob("checkpoint_*_*.pt"))
        if not (avg.exists() and avg.stat().st_mtime >= (ckpt / "checkpoint_last.pt").stat().st_mtime):
            run([sys.executable, "-m", "tpp_tools.average", "--inputs", ckpt,
                 "--num-update-checkpoints", min(args.average, len(interval)), "--output", avg, "--force"])
        bleu_file = folder / "eval" / "bleu.txt"
        if not (bleu_file.exists() and bleu_file.stat().st_mtime >= avg.stat().st_mtime):
            run([sys.executable, "-m", "tpp_tools.evaluate", "--data", args.data, "--checkpoint", avg,
                 "--reference", args.reference, "--out", folder / "eval", "--force",
                 *([] if args.gpu else ["--cpu"])])
        records = train_records(log)
        wps = statistics.median(float(r["train_wps"]) for r in records[1:] or records) if records else float("nan")
        valid = train_records(log, "valid_loss")
        ppl = float(valid[-1]["valid_ppl"]) if valid else float("nan")
        rows.append((name, description, count_parameters(avg), read_bleu(bleu_file), ppl, wps))

    table = [
        f"Budget: {args.max_update} updates of up to {args.max_tokens} tokens (x{args.update_freq}), "
        f"preset `{args.preset}`, average of the last {args.average} checkpoints, beam 5, lenpen 0.5.",
        "",
        "| variant | what | parameters | valid ppl (last) | sacreBLEU (detok.) | BLEU (tok., compound split) | train words/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, description, params, bleu, ppl, wps in rows:
        table.append(
            f"| {name} | {description} | {params / 1e6:.2f}M | {ppl:.1f} | {bleu.get('sacrebleu_detok', float('nan')):.2f} "
            f"| {bleu.get('bleu_tok_compound_split', float('nan')):.2f} | {wps:,.0f} |"
        )
    text = "\n".join(table) + "\n"
    target = args.out / "ablation.md"
    tmp = target.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
    print("\n" + text)
    print(f"written to {target}")


if __name__ == "__main__":
    main()
