"""tpp-plot-training on the log of a real (tiny) fairseq-train run."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from support import SAMPLE, VENV_BIN as BIN, head
from tpp_tools import plot_training as plotter


def train_tiny(work, log_format):
    """Train fairseq's transformer_tiny for 8 updates on ``work/bin``; returns (log file
    written by --log-file, console output) of that run."""
    log = work / f"train.{log_format}.log"
    run = subprocess.run(
        [
            str(BIN / "fairseq-train"),
            str(work / "bin"),
            "--arch",
            "transformer_tiny",
            "--optimizer",
            "adam",
            "--lr",
            "0.001",
            "--max-tokens",
            "500",
            "--max-update",
            "8",
            "--max-epoch",
            "3",
            "--criterion",
            "label_smoothed_cross_entropy",
            "--label-smoothing",
            "0.1",
            "--log-format",
            log_format,
            "--log-interval",
            "2",
            "--log-file",
            str(log),
            "--no-save",
            "--cpu",
            "--seed",
            "1",
            "--num-workers",
            "0",
        ],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    console = work / f"console.{log_format}.txt"
    console.write_text(run.stdout + run.stderr, encoding="utf-8")
    return log, console


@pytest.fixture(scope="module")
def sample_bin(tmp_path_factory):
    """200 sample pairs binarized."""
    work = tmp_path_factory.mktemp("fairseq_run")
    for split, n in (("train", 200), ("valid", 40)):
        for lang in ("en", "de"):
            head(SAMPLE / f"{split}.{lang}", work / f"{split}.{lang}", n)
    subprocess.run(
        [
            str(BIN / "fairseq-preprocess"),
            "--source-lang",
            "en",
            "--target-lang",
            "de",
            "--trainpref",
            str(work / "train"),
            "--validpref",
            str(work / "valid"),
            "--destdir",
            str(work / "bin"),
            "--joined-dictionary",
            "--workers",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    return work


@pytest.fixture(scope="module")
def fairseq_run(sample_bin):
    """(--log-file, console output) of a run with --log-format json."""
    return train_tiny(sample_bin, "json")


def assert_real_png(path: Path) -> None:
    assert path.is_file(), path
    with Image.open(path) as img:
        img.verify()  # a truncated or corrupt file raises here
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.size == (800, 500), img.size
        rgb = img.convert("RGB")
        # a blank canvas has one colour; axes, text and curves give many
        assert len(rgb.getcolors(maxcolors=1 << 20)) > 20
        assert max(ImageStat.Stat(rgb).stddev) > 10


def test_reads_the_real_log_file(fairseq_run):
    log, _ = fairseq_run
    series = plotter.read_log(log)
    inner = series["train_inner"]
    steps = [step for step, _ in inner]
    assert steps == sorted(set(steps)), "duplicate or unsorted training records"
    assert steps[0] == 2 and steps[-1] == 8  # --log-interval 2, --max-update 8
    assert all("loss" in v and "ppl" in v for _, v in inner)
    assert series.get("valid") and all("loss" in v for _, v in series["valid"])
    assert "train" in series  # end-of-epoch averages


def test_a_training_from_scratch_appended_to_a_log_replaces_it(fairseq_run, tmp_path, capsys):
    """A resumed training logs again the updates after its checkpoint (the last record
    wins); one started from scratch in the same log is plotted alone, with what it logged
    before its first training record, and that is said. (Both runs' records were merged
    into one curve.) Also in a log of records only, without fairseq-train's start lines."""
    log, _ = fairseq_run
    text = log.read_text()
    assert text.count("training on 1 devices") == 1
    lines = text.replace('"loss": "', '"loss": "1').splitlines()  # another training's
    resumed = [line for line in lines if '"num_updates": "2"' not in line]
    start = next(i for i, line in enumerate(lines) if "training on 1 devices" in line)
    valid = next(line for line in lines if '"valid_num_updates"' in line)
    early = re.sub(r'"valid_num_updates": "\d+"', '"valid_num_updates": "1"', valid)
    end = next(i for i, line in enumerate(lines) if '"num_updates": "6"' in line)
    again = [*lines[: start + 1], early, *lines[start + 1 : end]]  # to update 4
    for form, keep in (("log", lambda line: True), ("records", lambda line: line[:2] == '{"')):
        logs = {
            "resumed": [*text.splitlines(), *resumed],
            "twice": [*text.splitlines(), *again],
            "again": again,
            "original": text.splitlines(),
        }
        for name, content in logs.items():
            (tmp_path / f"{name}.{form}").write_text("\n".join(filter(keep, content)) + "\n")
        capsys.readouterr()
        merged = plotter.read_log(tmp_path / f"resumed.{form}")["train_inner"]
        assert "from scratch" not in capsys.readouterr().err
        original = dict(plotter.read_log(tmp_path / f"original.{form}")["train_inner"])
        assert [s for s, _ in merged] == sorted(original)
        assert merged[0][1] == original[2] and merged[-1][1] != original[8]  # last one wins
        alone = plotter.read_log(tmp_path / f"again.{form}")
        assert [s for s, _ in alone["train_inner"]] == [2, 4] and alone["valid"][0][0] == 1
        assert plotter.read_log(tmp_path / f"twice.{form}") == alone
        said = capsys.readouterr().err
        assert f"{tmp_path / f'twice.{form}'} holds 2 trainings started from scratch" in said


def test_console_output_gives_the_same_records(fairseq_run):
    log, console = fairseq_run
    assert plotter.read_log(console) == plotter.read_log(log)


def test_simple_format_gives_the_same_records(fairseq_run, sample_bin, tmp_path):
    """--log-format simple (what scripts/train.sh logs) is read as well as json: the same
    run in both formats gives the same series (timings aside)."""
    json_log, _ = fairseq_run
    simple_log, simple_console = train_tiny(sample_bin, "simple")
    assert '{"' not in simple_log.read_text()  # really the other format

    def deterministic(series):
        timing = {"wps", "ups", "wall", "train_wall", "gb_free"}
        return {
            name: [
                (step, {k: v for k, v in values.items() if k not in timing})
                for step, values in points
            ]
            for name, points in series.items()
        }

    expected = deterministic(plotter.read_log(json_log))
    assert set(expected) == {"train_inner", "train", "valid"}
    assert deterministic(plotter.read_log(simple_log)) == expected
    assert deterministic(plotter.read_log(simple_console)) == expected
    out = tmp_path / "plots"
    assert plotter.main(["--log", str(simple_log), "--out-dir", str(out)]) == 0
    assert_real_png(out / "loss.png")
    assert_real_png(out / "perplexity.png")


def test_plots_a_real_log(fairseq_run, tmp_path):
    log, _ = fairseq_run
    out = tmp_path / "plots"
    assert plotter.main(["--log", str(log), "--out-dir", str(out)]) == 0
    assert_real_png(out / "loss.png")
    assert_real_png(out / "perplexity.png")
    # plain translation criterion: no tagging metrics, so no tagging plots
    assert not (out / "tag_accuracy.png").exists()
    assert not (out / "tag_loss.png").exists()


def test_plots_tagging_metrics_when_logged(fairseq_run, tmp_path):
    """The tagging criterion adds pos_/ner_ keys to the same records: plot them."""
    log, _ = fairseq_run
    tagged = tmp_path / "tagged.log"
    lines = []
    for i, line in enumerate(log.read_text(encoding="utf-8").splitlines()):
        if line.startswith('{"'):
            record = json.loads(line)
            prefix = next(
                (
                    k[: -len("loss")]
                    for k in record
                    if k.endswith("loss") and not k.endswith("nll_loss")
                ),
                "",
            )
            record.update(
                {
                    f"{prefix}pos_acc": str(40 + i),
                    f"{prefix}ner_acc": str(60 + i),
                    f"{prefix}pos_loss": str(3 - i / 20),
                    f"{prefix}ner_loss": "1.5",
                }
            )
            line = json.dumps(record)
        lines.append(line)
    tagged.write_text("\n".join(lines) + "\n", encoding="utf-8")
    series = plotter.read_log(tagged)
    assert series["valid"] and all("pos_acc" in v for _, v in series["valid"])
    out = tmp_path / "plots"
    assert plotter.main(["--log", str(tagged), "--out-dir", str(out)]) == 0
    for name in ("loss.png", "perplexity.png", "tag_accuracy.png", "tag_loss.png"):
        assert_real_png(out / name)
    # re-plotting a plain log over it removes the now stale tagging plots
    assert plotter.main(["--log", str(log), "--out-dir", str(out), "--force"]) == 0
    assert not (out / "tag_accuracy.png").exists()


def test_refuses_to_overwrite_without_force(fairseq_run, tmp_path, capsys):
    log, _ = fairseq_run
    out = tmp_path / "plots"
    (out).mkdir()
    (out / "loss.png").write_bytes(b"keep me")
    assert plotter.main(["--log", str(log), "--out-dir", str(out)]) == 2
    assert "exists; pass --force to overwrite" in capsys.readouterr().err
    assert (out / "loss.png").read_bytes() == b"keep me"
    assert plotter.main(["--log", str(log), "--out-dir", str(out), "--force"]) == 0
    assert_real_png(out / "loss.png")


def test_a_forced_run_that_fails_part_way_leaves_the_earlier_figures_whole(
    fairseq_run, tmp_path, monkeypatch
):
    """The figures are written into a staging folder and replace the earlier ones only
    once all are written: a run stopped after its first figure replaced it alone."""
    log, _ = fairseq_run
    out = tmp_path / "plots"
    assert plotter.main(["--log", str(log), "--out-dir", str(out), "--format", "png", "svg"]) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert len(before) >= 4
    save = plotter.save

    def stopped_after_one(fig, outs):
        save(fig, outs)
        raise KeyboardInterrupt

    monkeypatch.setattr(plotter, "save", stopped_after_one)
    with pytest.raises(KeyboardInterrupt):
        plotter.main(["--log", str(log), "--out-dir", str(out), "--format", "svg", "--force"])
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # no staging left


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "not found"),
        ("folder", "train.log is a folder: --log takes fairseq's log file"),
        ("", "empty"),
        ("  \n\n", "empty"),
        (
            "2020-01-01 | INFO | fairseq_cli.train | {'_name': None}\nno json here\n",
            "no training or validation records",
        ),
        ('{"epoch": 1, "update": 0.5, "wps": "100"}\n', "no training or validation records"),
        (
            "epoch 001:     10 / 0 loss=9.2, ppl=600, num_updates=10\n",
            "no training or validation records",
        ),
    ],
)
def test_bad_logs_fail_with_a_clear_message(tmp_path, content, message):
    log = tmp_path / "train.log"
    if content == "folder":
        log.mkdir()
    elif content is not None:
        log.write_text(content, encoding="utf-8")
    # through the command line: the exit status is what shell pipelines see
    run = subprocess.run(
        ["tpp-plot-training", "--log", str(log), "--out-dir", str(tmp_path / "plots")],
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0
    assert message in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "plots").exists(), "no folder made for a log that cannot be read"


def test_an_output_folder_that_cannot_be_written_is_named(fairseq_run, tmp_path):
    log, _ = fairseq_run
    (tmp_path / "taken").write_text("a file, not a folder\n")
    run = subprocess.run(
        ["tpp-plot-training", "--log", str(log), "--out-dir", str(tmp_path / "taken" / "p")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "cannot create or write into this --out-dir folder" in run.stderr


def test_several_runs_on_one_figure_in_every_format(fairseq_run, sample_bin, tmp_path, capsys):
    """Two runs compared: one colour per run, named by --label, their training and
    validation curves (no epoch averages); PNG, PDF and SVG of the same figures."""
    first, _ = fairseq_run
    second = tmp_path / "b" / "train.log"
    second.parent.mkdir()
    second.write_text(first.read_text(encoding="utf-8").replace('"loss": "', '"loss": "1'))
    out = tmp_path / "plots"
    args = ["--log", str(first), str(second), "--label", "base", "tpp", "--out-dir", str(out)]
    assert plotter.main(args + ["--format", "png", "pdf", "svg"]) == 0
    assert_real_png(out / "loss.png")
    assert (out / "loss.pdf").read_bytes().startswith(b"%PDF")
    svg = (out / "loss.svg").read_text(encoding="utf-8")
    for label in ("base train loss", "base valid nll_loss", "tpp train loss", "tpp valid loss"):
        assert label in svg, label
    assert "epoch average" not in svg
    assert not list(out.glob("*.tmp"))

    runs = {name: plotter.read_log(log) for name, log in (("base", first), ("tpp", second))}
    fig = plotter.figure(runs, *plotter.PLOTS["loss"])
    lines = fig.axes[0].get_lines()
    colours = {}
    for line in lines:
        colours.setdefault(line.get_label().split()[0], set()).add(line.get_color())
    assert sorted(colours) == ["base", "tpp"], colours
    assert all(len(c) == 1 for c in colours.values()), "one colour per run"
    assert len(set.union(*colours.values())) == 2, "and another for each run"
    assert len(lines) == 8  # 2 runs x (train, valid) x (loss, nll_loss)
    plotter.plt.close(fig)

    # the existing figures of the chosen formats are not replaced without --force
    assert plotter.main(args + ["--format", "svg"]) == 2
    assert plotter.main(args + ["--format", "svg", "--force"]) == 0
    # one --label per --log, never the same twice; refused before the folder is made
    one = ["--log", str(first), str(second), "--label", "a", "--out-dir", str(tmp_path / "x")]
    assert plotter.main(one) == 2 and not (tmp_path / "x").exists()
    bad = ["--log", str(first), str(second), "--label", "a", "a", "--out-dir", str(tmp_path / "y")]
    assert plotter.main(bad) == 2 and not (tmp_path / "y").exists()
    assert "--label names a run twice" in capsys.readouterr().err
    twice = ["--log", str(first), str(first), "--out-dir", str(tmp_path / "y")]
    assert plotter.main(twice) == 2 and "--log names a log twice" in capsys.readouterr().err


def test_only_series_with_data_are_in_the_legend(tmp_path):
    """A run validated once: its one validation point is drawn (as a marker, which a line
    of one point would not show); metrics no series has are neither drawn nor named."""
    log = tmp_path / "train.log"
    log.write_text(
        '{"epoch": 1, "update": 0.5, "loss": "7.0", "ppl": "128", "num_updates": "10"}\n'
        '{"epoch": 1, "update": 0.9, "loss": "6.0", "ppl": "64", "num_updates": "20"}\n'
        '{"epoch": 1, "valid_loss": "6.5", "valid_ppl": "90", "valid_num_updates": "20"}\n'
        '{"epoch": 1, "update": 1.2, "nll_loss": "5.5", "num_updates": "30"}\n',
        encoding="utf-8",
    )
    series = plotter.read_log(log)
    fig = plotter.figure({"run": series}, *plotter.PLOTS["loss"])
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert sorted(legend) == sorted(lines) == ["train loss", "train nll_loss", "valid loss"]
    assert lines["train nll_loss"].get_marker() == "o", "one point: a marker"
    assert lines["train loss"].get_marker() in ("None", None, "")
    plotter.plt.close(fig)
    assert plotter.figure({"run": series}, *plotter.PLOTS["tag_loss"]) is None
