"""Plot training curves from a fairseq-train log.

``scripts/train.sh`` writes its log to ``<save-dir>/train.log``; any fairseq-train run
with ``--log-file train.log`` (or its console output) will do, in ``--log-format json``
or ``simple``, then::

    tpp-plot-training --log train.log --out-dir plots/
    tpp-plot-training --log train.log --out-dir plots/ --force  # overwrite

Writes, against the number of updates:

* ``loss.png``          training and validation loss (solid) and nll_loss (dashed)
* ``perplexity.png``    training and validation perplexity (log scale)
* ``tag_accuracy.png``  POS and NER tagging accuracy (``pos_acc``, ``ner_acc``), when logged
* ``tag_loss.png``      POS and NER tagging loss (``pos_loss``, ``ner_loss``), when logged

Both places fairseq writes to are understood: the bare lines of ``--log-file`` and the
console lines ``2020-01-01 12:00:00 | INFO | train_inner | ...``; and both formats:
``json`` (``{"epoch": 1, "loss": "7.2", ...}``) and ``simple`` (``epoch 001:  10 / 50
loss=7.2, ...`` per interval, ``epoch 001 | valid on 'valid' subset | loss 7.1 | ...``
for epoch summaries and validation). fairseq logs three kinds of records: per-interval
training records (``train_inner``: ``loss``, ``num_updates``, ...), end-of-epoch
training averages (``train``) and validation results (the subset name, e.g. ``valid``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

FIGSIZE = (8, 5)  # inches; at DPI below every PNG is exactly 800 x 500 pixels
DPI = 100
TRAIN_INNER = "train_inner"

# file name -> (title, y label, metrics drawn, log scale). A figure none of whose
# metrics is in the log (the tag plots of a plain translation run) is not written.
PLOTS = {
    "loss.png": ("Loss", "loss (base 2)", ("loss", "nll_loss"), False),
    "perplexity.png": ("Perplexity", "perplexity", ("ppl",), True),
    "tag_accuracy.png": ("Tagging accuracy", "accuracy (%)", ("pos_acc", "ner_acc"), False),
    "tag_loss.png": ("Tagging loss", "loss (base 2)", ("pos_loss", "ner_loss"), False),
}


class LogError(Exception):
    """The log cannot be plotted; the message says why."""


# console prefix of fairseq's log lines: "2020-01-01 12:00:00 | INFO | train_inner | "
_CONSOLE_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| [A-Z]+ \| \S+ \| ")
# --log-format simple, per interval: "epoch 001:     10 / 50 loss=7.2, ..., num_updates=10"
_SIMPLE_INNER = re.compile(r"^epoch (\d+):\s+(\d+) / (\d+) (\S+=.*)$")
# --log-format simple, epoch summary or validation: "epoch 001 | [valid on 'valid' subset | ]loss 7.1 | ..."
_SIMPLE_SUMMARY = re.compile(r"^epoch (\d+) \| (.*)$")
_SUBSET = re.compile(r"^\S+ on '([^']+)' subset$")


def _simple_record(message: str) -> dict | None:
    """The record of a ``--log-format simple`` line, keyed as the json format keys it."""
    match = _SIMPLE_INNER.match(message)
    if match:
        epoch, position, size = (int(match.group(i)) for i in (1, 2, 3))
        # the json format's "update": the fractional epoch
        record = {"epoch": epoch, "update": round(epoch - 1 + position / size, 3)}
        for pair in match.group(4).split(", "):
            key, sep, value = pair.partition("=")
            if not sep:
                return None
            record[key.strip()] = value.strip()
        return record if "num_updates" in record else None
    match = _SIMPLE_SUMMARY.match(message)
    if not match:
        return None
    parts = match.group(2).split(" | ")
    subset = _SUBSET.match(parts[0])
    if subset:
        name, parts = subset.group(1), parts[1:]
    else:
        name = "train"  # the end-of-epoch training summary has no subset part
    record = {"epoch": int(match.group(1))}
    for part in parts:
        key, sep, value = part.partition(" ")
        if not sep:
            return None
        record[f"{name}_{key}"] = value.strip()
    return record if f"{name}_num_updates" in record else None


def _record_from_line(line: str) -> dict | None:
    """The record on a log line (json or simple format), or None for any other line.

    A json record is parsed from the first '{"': fairseq's config dump also starts with
    '{' but is a Python repr (single quotes), which this skips.
    """
    start = line.find('{"')
    if start >= 0:
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            return None
        return record if isinstance(record, dict) and "epoch" in record else None
    return _simple_record(_CONSOLE_PREFIX.sub("", line.rstrip()))


def _number(value) -> float | None:
    """fairseq logs numbers as strings ("7.2"); None for anything not a finite number."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _classify(record: dict) -> tuple[str, float, dict] | None:
    """(series name, update number, {metric: value}) of one record, or None.

    A per-interval training record has unprefixed keys and ``num_updates``; an epoch
    summary or a validation record prefixes every key with its subset ("train_",
    "valid_", ...), which ``<subset>_num_updates`` reveals.
    """
    if "num_updates" in record:
        name, prefix = TRAIN_INNER, ""
    else:
        subsets = [k[: -len("_num_updates")] for k in record if k.endswith("_num_updates")]
        if len(subsets) != 1:
            return None
        name = subsets[0]
        prefix = name + "_"
    step = _number(record.get(prefix + "num_updates"))
    if step is None:
        return None
    values = {}
    for key, value in record.items():
        if key.startswith(prefix):
            x = _number(value)
            if x is not None:
                values[key[len(prefix) :]] = x
    return name, step, values


def read_log(path: Path) -> dict[str, list[tuple[float, dict]]]:
    """Series name -> [(update, metrics)] sorted by update, from a fairseq log file.

    fairseq can write the same record twice (e.g. at the last update of a run), so
    records are keyed by (series, update, epoch) and the last one wins.
    """
    if not path.is_file():
        raise LogError(f"log file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise LogError(f"log file is empty: {path}")
    latest: dict[tuple, dict] = {}
    for line in text.splitlines():
        record = _record_from_line(line)
        parsed = _classify(record) if record is not None else None
        if parsed is None:
            continue
        name, step, values = parsed
        latest[(name, step, record.get("epoch"))] = values
    series: dict[str, list[tuple[float, dict]]] = defaultdict(list)
    for (name, step, _epoch), values in latest.items():
        series[name].append((step, values))
    for points in series.values():
        points.sort(key=lambda p: p[0])
    if not any(
        values.get(m) is not None
        for points in series.values()
        for _, values in points
        for m in ("loss", "ppl")
    ):
        raise LogError(
            f"no training or validation records in {path}: is it a fairseq-train "
            "log in --log-format json or simple?"
        )
    return dict(series)


def _style(series_name: str) -> dict:
    if series_name == TRAIN_INNER:
        return {"label": "train", "linewidth": 1.2, "alpha": 0.8}
    if series_name == "train":
        return {"label": "train (epoch average)", "marker": "o", "linestyle": "none"}
    return {"label": series_name, "marker": "s", "markersize": 4, "linewidth": 1.5}


def draw(series: dict, title: str, ylabel: str, metrics: tuple, log_scale: bool, out: Path) -> bool:
    """Draw one figure; return False (and write nothing) when no metric has data."""
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    drawn = 0
    ordered = sorted(series, key=lambda n: (n != TRAIN_INNER, n != "train", n))
    for colour, name in enumerate(ordered):
        for i, metric in enumerate(metrics):
            points = [(step, v[metric]) for step, v in series[name] if metric in v]
            if not points:
                continue
            style = dict(_style(name), color=f"C{colour}")  # one colour per series
            if len(metrics) > 1:
                style["label"] = f"{style['label']} {metric}"
            if i == 1:  # the second metric of a figure: same colour family, dashed
                if style.get("linestyle") != "none":
                    style["linestyle"] = "--"
                if "marker" in style:
                    style["marker"] = "^"
            xs, ys = zip(*points)
            ax.plot(xs, ys, **style)
            drawn += 1
    if not drawn:
        plt.close(fig)
        return False
    ax.set_title(title)
    ax.set_xlabel("updates")
    ax.set_ylabel(ylabel)
    if log_scale:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    # no bbox_inches="tight": it would change the pixel size from figure to figure
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return True


def plot_log(log: Path, out_dir: Path, force: bool = False) -> list[Path]:
    """Read ``log`` and write the PNGs into ``out_dir``; return the files written."""
    series = read_log(log)
    targets = [out_dir / name for name in PLOTS]
    clash = [p for p in targets if p.exists()]
    if clash and not force:
        raise LogError(f"{clash[0]} exists; pass --force to overwrite")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, metrics, log_scale) in PLOTS.items():
        out = out_dir / name
        if draw(series, title, ylabel, metrics, log_scale, out):
            written.append(out)
        elif out.exists():
            out.unlink()  # a stale plot from an older run would be misleading
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpp-plot-training",
        description="Plot loss, perplexity and POS/NER tagging curves from a "
        "fairseq-train log (--log-file PATH, --log-format json or simple; "
        "scripts/train.sh writes <save-dir>/train.log).",
        epilog="Example: tpp-plot-training --log checkpoints/train.log "
        "--out-dir checkpoints/plots",
    )
    parser.add_argument(
        "--log",
        type=Path,
        required=True,
        help="fairseq-train log: the --log-file, or its console output",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="folder for the PNGs (default: 'plots' next to the log)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing PNGs")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or args.log.parent / "plots"
    try:
        from .evaluate import writable_folder

        if args.log.is_file():  # (a missing log is named first)
            writable_folder(out_dir, "--out-dir folder", LogError)
        written = plot_log(args.log, out_dir, args.force)
    except LogError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
