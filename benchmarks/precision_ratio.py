"""How much faster a lower precision trains than another, from two ``bench_model --json``
outputs of the same sizes and models (e.g. bf16 and float32): each model's median
training words/s in each and their ratio. The two ran in separate processes, so the
ratio is of medians, not paired step by step.

    python -m benchmarks.precision_ratio FAST.json SLOW.json
"""

import argparse
import json
import sys
from pathlib import Path


def table(fast: dict, slow: dict) -> str:
    """The Markdown table of the models and sizes both outputs measured."""
    dtypes = fast["args"]["dtype"], slow["args"]["dtype"]
    lines = [
        f"| d | model | {dtypes[0]} words/s | {dtypes[1]} words/s | {dtypes[0]} ÷ {dtypes[1]} |",
        "|---:|---|---:|---:|---:|",
    ]
    for size, measured in fast["sizes"].items():
        other = slow["sizes"].get(size, {}).get("results", {})
        for name, result in measured["results"].items():
            if name in other and "train_wps" in result and "train_wps" in other[name]:
                a, b = result["train_wps"], other[name]["train_wps"]
                lines.append(f"| {size} | {name} | {a:,.0f} | {b:,.0f} | {a / b:.2f}× |")
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
