"""How much faster a lower precision trains than another, from two ``bench_model --json``
outputs of the same sizes and models (e.g. bf16 and float32): each model's median
training words/s in each, and the median over batches of the ratio on the same batch.
Both runs time the same fixed batches in the same order when they share the data,
batch size, update frequency and warm-up (one may have more rounds: the batches both
timed are paired); otherwise the ratio is of the medians, and the table says so.

    python -m benchmarks.precision_ratio FAST.json SLOW.json
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


#: what fixes the batches a bench_model run times, and their order
SAME_BATCHES = ("data", "max_tokens", "update_freq", "warmup", "isolate")


def ratio(fast: dict, slow: dict, paired: bool, fast_args: dict) -> str:
    """``fast``'s words/s over ``slow``'s: per batch (per repetition of ``--isolate``)
    where ``paired``, else of medians."""
    a, b = fast.get("train_wps_all"), slow.get("train_wps_all")
    if paired and a and b:
        per_batch = [x / y for x, y in zip(a, b)]
        what = "batches" if fast_args.get("isolate", "0") == "0" else "repetitions"
        return f"{statistics.median(per_batch):.2f}× (median of {len(per_batch)} {what})"
    return f"{fast['train_wps'] / slow['train_wps']:.2f}× (of the medians)"


def table(fast: dict, slow: dict) -> str:
    """The Markdown table of the models and sizes both outputs measured."""
    dtypes = fast["args"]["dtype"], slow["args"]["dtype"]
    paired = all(fast["args"].get(k) == slow["args"].get(k) for k in SAME_BATCHES)
    lines = [
        f"| d | model | {dtypes[0]} words/s | {dtypes[1]} words/s | {dtypes[0]} ÷ {dtypes[1]} |",
        "|---:|---|---:|---:|---:|",
    ]
    for size, measured in fast["sizes"].items():
        other = slow["sizes"].get(size, {}).get("results", {})
        for name, result in measured["results"].items():
            if name in other and "train_wps" in result and "train_wps" in other[name]:
                a, b = result["train_wps"], other[name]["train_wps"]
                cell = ratio(result, other[name], paired, fast["args"])
                lines.append(f"| {size} | {name} | {a:,.0f} | {b:,.0f} | {cell} |")
    if len(lines) == 2:
        raise SystemExit("precision_ratio: the two outputs share no model and size")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("fast", type=Path, help="bench_model --json output of the lower precision")
    p.add_argument("slow", type=Path, help="the same of the higher precision")
    args = p.parse_args(argv)
    try:
        fast, slow = (json.loads(path.read_text()) for path in (args.fast, args.slow))
    except (OSError, ValueError) as err:
        sys.exit(f"precision_ratio: {err}")
    print(table(fast, slow))


if __name__ == "__main__":
    main()
