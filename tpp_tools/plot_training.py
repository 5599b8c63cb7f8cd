"""Plot training curves from a fairseq-train log.

``scripts/train.sh`` writes its log to ``<save-dir>/train.log``; any fairseq-train run
with ``--log-file train.log`` (or its console output) will do, in ``--log-format json``
or ``simple``, then::

    tpp-plot-training --log train.log --out-dir plots/
    tpp-plot-training --log train.log --out-dir plots/ --force  # overwrite
    tpp-plot-training --log a/train.log b/train.log --label a b --format png pdf

Writes, against the number of updates (``--format``: PNG, PDF and/or SVG):

* ``loss``          training and validation loss (solid) and nll_loss (dashed)
* ``perplexity``    training and validation perplexity (log scale)
* ``tag_accuracy``  POS and NER tagging accuracy (``pos_acc``, ``ner_acc``), when logged
* ``tag_loss``      POS and NER tagging loss (``pos_loss``, ``ner_loss``), when logged

One log: one colour per series (training, its epoch averages, each validation subset).
Several logs (runs to compare): one colour per run, its training and validation curves
(epoch averages left out), labelled with ``--label`` or the log's folder name.

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

from tpp_pipeline.lock import exit_cleanly_on_sigterm
from tpp_pipeline.errors import UserError, report

try:
    import matplotlib
except ImportError:  # (an extra of the package)
    raise SystemExit(
        "tpp-plot-training: error: needs matplotlib, which is not installed: pip install 'tpp-plugin[plots]'"
    ) from None

matplotlib.use("Agg")  # no display on cluster nodes; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

PROG = "tpp-plot-training"
FIGSIZE = (8, 5)  # inches; at DPI below every PNG is exactly 800 x 500 pixels
DPI = 100
TRAIN_INNER = "train_inner"
FORMATS = ("png", "pdf", "svg")

# file stem -> (title, y label, metrics drawn, log scale). A figure none of whose
# metrics is in the logs (the tag plots of a plain translation run) is not written.
PLOTS = {
    "loss": ("Loss", "loss (base 2)", ("loss", "nll_loss"), False),
    "perplexity": ("Perplexity", "perplexity", ("ppl",), True),
    "tag_accuracy": ("Tagging accuracy", "accuracy (%)", ("pos_acc", "ner_acc"), False),
    "tag_loss": ("Tagging loss", "loss (base 2)", ("pos_loss", "ner_loss"), False),
}


class LogError(UserError):
    """The log cannot be plotted; the message says why."""


# console prefix of fairseq's log lines: "2020-01-01 12:00:00 | INFO | train_inner | "
_CONSOLE_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| [A-Z]+ \| \S+ \| ")
# --log-format simple, per interval: "epoch 001:     10 / 50 loss=7.2, ..., num_updates=10"
_SIMPLE_INNER = re.compile(r"^epoch (\d+):\s+(\d+) / (\d+) (\S+=.*)$")
# --log-format simple, epoch summary or validation: "epoch 001 | [valid on 'valid' subset | ]loss 7.1 | ..."
_SIMPLE_SUMMARY = re.compile(r"^epoch (\d+) \| (.*)$")
_SUBSET = re.compile(r"^\S+ on '([^']+)' subset$")
# fairseq-train's line as it starts: "training on 1 devices (GPUs/TPUs)"
_STARTED = re.compile(r"\btraining on \d+ devices\b")


def _simple_record(message: str) -> dict | None:
    """The record of a ``--log-format simple`` line, keyed as the json format keys it."""
    match = _SIMPLE_INNER.match(message)
    if match:
        epoch, position, size = (int(match.group(i)) for i in (1, 2, 3))
        if size == 0:  # not a line fairseq writes
            return None
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


def _not_a_log(path: Path) -> str:
    if path.is_dir():
        return f"{path} is a folder: --log takes fairseq's log file (e.g. train.log in it)"
    return f"log file not found: {path}"


def _last_training(lines) -> tuple[list[tuple], int]:
    """The records ``(series, update, epoch, metrics)`` of the log's last training from
    scratch, and how many trainings from scratch the log holds. The log is cut at each
    fairseq-train start (the line ``training on N devices``); a start whose first
    training record is at the first update logged before it, or earlier, is a training
    from scratch (a resumed one starts after its checkpoint's update; one resumed from a
    checkpoint older than the log's first record cannot be told from it, nor one from
    scratch logging less often). A log without start lines (records only) is cut where
    the training records go back so far."""
    starts = [[]]
    for line in lines:
        if _STARTED.search(line):
            if starts[-1]:
                starts.append([])
            continue
        record = _record_from_line(line)
        parsed = _classify(record) if record is not None else None
        if parsed is not None:
            name, step, values = parsed
            starts[-1].append((name, step, record.get("epoch"), values))
    if len(starts) == 1:  # no start lines: cut where the updates go back
        records, starts, last = starts[0], [[]], None
        for record in records:
            if record[0] == TRAIN_INNER:
                if last is not None and record[1] < last:
                    # what the new training logged before it (validation): behind ``last``
                    moved = []
                    while starts[-1] and starts[-1][-1][0] != TRAIN_INNER:
                        if starts[-1][-1][1] >= last:
                            break
                        moved.insert(0, starts[-1].pop())
                    starts.append(moved)
                last = record[1]
            starts[-1].append(record)
    kept, first, scratch = [], None, 1
    for records in starts:
        steps = [step for name, step, _, _ in records if name == TRAIN_INNER] or [
            step
            for _, step, _, _ in records  # (no training record: an interval over an epoch)
        ]
        if steps and first is not None and steps[0] <= first:  # trained from scratch
            kept, scratch = [], scratch + 1
        if steps:
            first = steps[0] if first is None else min(first, steps[0])
        kept += records
    return kept, scratch


def read_log(path: Path) -> dict[str, list[tuple[float, dict]]]:
    """Series name -> [(update, metrics)] sorted by update, from a fairseq log file.

    fairseq can write the same record twice (e.g. at the last update of a run), and a
    resumed training logs again the updates after its checkpoint, so records are keyed by
    (series, update, epoch) and the last one wins. A training started again from scratch
    in the same log (its updates back to the first one logged) replaces what came before:
    only the last is plotted, and that is said.
    """
    if not path.is_file():
        raise LogError(_not_a_log(path))
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise LogError(f"log file is empty: {path}")
    records, scratch = _last_training(text.splitlines())
    latest: dict[tuple, dict] = {}
    for name, step, epoch, values in records:
        latest[(name, step, epoch)] = values
    if scratch > 1:
        print(
            f"{PROG}: {path} holds {scratch} trainings started from scratch: "
            "plotting the last one",
            file=sys.stderr,
        )
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


def figure(runs: dict, title: str, ylabel: str, metrics: tuple, log_scale: bool):
    """One figure of ``runs`` ({label: series}), or None when no metric has data. Only
    what has data is drawn, so only that is in the legend; a series of one point is
    drawn as a marker."""
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    drawn = 0
    several = len(runs) > 1
    for run_index, (run, series) in enumerate(runs.items()):
        ordered = sorted(series, key=lambda n: (n != TRAIN_INNER, n != "train", n))
        if several:  # runs compared: their training and validation curves, no epoch averages
            ordered = [n for n in ordered if n != "train"]
        for series_index, name in enumerate(ordered):
            for i, metric in enumerate(metrics):
                points = [(step, v[metric]) for step, v in series[name] if metric in v]
                if not points:
                    continue
                colour = run_index if several else series_index  # one colour per run or series
                style = dict(_style(name), color=f"C{colour}")
                label = f"{run} {style['label']}" if several else style["label"]
                style["label"] = f"{label} {metric}" if len(metrics) > 1 else label
                if i == 1:  # the second metric of a figure: same colour family, dashed
                    if style.get("linestyle") != "none":
                        style["linestyle"] = "--"
                    if "marker" in style:
                        style["marker"] = "^"
                if len(points) == 1 and "marker" not in style:
                    style["marker"] = "o"  # a line of one point would not show
                xs, ys = zip(*points)
                ax.plot(xs, ys, **style)
                drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(title)
    ax.set_xlabel("updates")
    ax.set_ylabel(ylabel)
    if log_scale:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def save(fig, outs) -> None:
    """Writes ``fig`` into each path of ``outs`` (format from the suffix) and closes it.
    SVG keeps its text as text."""
    with plt.rc_context({"svg.fonttype": "none"}):
        for out in outs:
            # no bbox_inches="tight": it would change the pixel size from figure to figure
            fig.savefig(out, dpi=DPI, format=out.suffix[1:])
    plt.close(fig)


def plot_logs(logs, out_dir: Path, force: bool = False, labels=None, formats=("png",)):
    """Read ``logs`` and write their figures into ``out_dir`` in each of ``formats``;
    return the files written. ``labels`` name the runs (default: the logs' folders)."""
    logs = [Path(log) for log in logs]
    derived = labels is None
    if derived:
        labels = [log.parent.name or str(log) for log in logs]
        if len(set(labels)) < len(labels):
            labels = [str(log) for log in logs]
    if len(labels) != len(logs):
        raise LogError(f"{len(labels)} --label for {len(logs)} --log: give one per log")
    if len(set(labels)) < len(labels):
        twice = "--log names a log" if derived else "--label names a run"
        raise LogError(f"{twice} twice: {', '.join(labels)}")
    if len(set(formats)) < len(formats) or not set(formats) <= set(FORMATS):
        raise LogError(f"--format: each of {', '.join(FORMATS)} at most once")
    runs = {label: read_log(log) for label, log in zip(labels, logs)}
    targets = [out_dir / f"{stem}.{fmt}" for stem in PLOTS for fmt in FORMATS]
    clash = [p for p in targets if p.exists() and p.suffix[1:] in formats]
    if clash and not force:
        raise LogError(f"{clash[0]} exists; pass --force to overwrite")
    from .evaluate import staged_files, writable_folder  # (once everything else is good)

    writable_folder(out_dir, "--out-dir folder", LogError)
    written, stale = [], []
    with staged_files(out_dir) as staging:  # (a failed run leaves the earlier figures whole)
        for stem, (title, ylabel, metrics, log_scale) in PLOTS.items():
            names = [f"{stem}.{fmt}" for fmt in formats]
            fig = figure(runs, title, ylabel, metrics, log_scale)
            if fig is not None:
                save(fig, [staging / name for name in names])
                written.extend(out_dir / name for name in names)
            else:  # a stale plot from an older run would be misleading
                stale.extend(out_dir / name for name in names)
    for out in stale:
        out.unlink(missing_ok=True)
    return written


def plot_log(log: Path, out_dir: Path, force: bool = False) -> list[Path]:
    """Read ``log`` and write the PNGs into ``out_dir``; return the files written."""
    return plot_logs([log], out_dir, force)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Plot loss, perplexity and POS/NER tagging curves from a "
        "fairseq-train log (--log-file PATH, --log-format json or simple; "
        "scripts/train.sh writes <save-dir>/train.log).",
        epilog="Example: tpp-plot-training --log checkpoints/train.log "
        "--out-dir checkpoints/plots",
    )
    parser.add_argument(
        "--log",
        type=Path,
        nargs="+",
        required=True,
        help="fairseq-train log(s): the --log-file, or its console output; several logs "
        "are drawn on the same figures, one colour per run",
    )
    parser.add_argument(
        "--label",
        nargs="+",
        default=None,
        help="the runs' names in the legend, one per --log (default: each log's folder)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="folder for the figures (default: 'plots' next to the (first) log)",
    )
    parser.add_argument(
        "--format",
        nargs="+",
        choices=FORMATS,
        default=["png"],
        help="file format(s) of the figures (default: png)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing figures")
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()  # Ctrl-C, kill: the figures staged so far removed, no traceback
    out_dir = args.out_dir or args.log[0].parent / "plots"
    try:
        missing = [log for log in args.log if not log.is_file()]
        if missing:  # named before the folder
            raise LogError(_not_a_log(missing[0]))
        written = plot_logs(args.log, out_dir, args.force, args.label, args.format)
    except LogError as err:
        return report("tpp-plot-training", err)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
