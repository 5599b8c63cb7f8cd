"""The main job (tpp-demo, what `make demo` runs) end to end on a cut-down
budget: the shipped sample through spaCy tagging, BPE, binarization, training with
tags, averaging, generation, sacreBLEU, plots and attention maps; then a second run
that reuses every finished stage, one that redoes the stages whose inputs changed, and
one refused for another cut of the sample."""

import os
import re
import subprocess

import pytest
from PIL import Image, ImageStat

from support import REPO, tool_env

pytestmark = pytest.mark.slow

# a small cut of the sample (the time goes to spaCy's tagging, learning the BPE, training,
# and beam search of the held-out lines), a few updates, a checkpoint after each (three
# of them, at updates that end no epoch, to average)
TRAIN_LINES, HELDOUT_LINES = 100, 10
QUICK = [
    "--train-lines",
    str(TRAIN_LINES),
    "--heldout-lines",
    str(HELDOUT_LINES),
    "--max-update",
    "8",
    "--save-every",
    "1",
    "--average",
    "3",
]
# fewer BPE merges than the demo's 8,000 (DEMO_BPE_MERGES): learnt sooner, a smaller vocabulary
QUICK_ENV = {"DEMO_BPE_MERGES": "500"}
# the demo's own steps in its ledger (--out/.steps), after the data pipeline's
DEMO_STEPS = ("sample", "average", "evaluate", "plots", "attention")


def run_demo(out, *extra, status=0, env=None):
    env = {**tool_env(), **QUICK_ENV, **(env or {})}
    env["OMP_NUM_THREADS"] = "2"
    # the training recipe's variables of a user's shell are not the demo's
    env.update(ARCH="transformer", TASK="translation", LR="0.5", PYTHON="/nowhere/python")
    proc = subprocess.run(
        ["tpp-demo", "--out", out, *QUICK, *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def assert_image(path, min_size=(300, 200)):
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.size[0] >= min_size[0] and img.size[1] >= min_size[1], (path, img.size)
        stat = ImageStat.Stat(img.convert("L"))
        assert stat.stddev[0] > 5, f"{path} looks blank"
    return img.size


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    return out, run_demo(out)


def test_demo_runs_every_stage_and_reports_bleu(demo):
    out, log = demo
    for stage in range(1, 7):
        assert f"=== [{stage}/6]" in log
    bleu = (out / "eval" / "bleu.txt").read_text()
    assert re.search(r"^sacrebleu_detok: [\d.]+$", bleu, re.M)
    assert re.search(r"^bleu_tok_compound_split: [\d.]+$", bleu, re.M)
    assert "sacrebleu_detok:" in log.split("=== done")[-1], "the score is printed at the end"
    hyps = [
        line
        for line in (out / "eval" / "generate-test.txt").read_text().splitlines()
        if line.startswith("H-")
    ]
    assert len(hyps) == HELDOUT_LINES
    assert (out / "checkpoints" / "checkpoint_avg.pt").stat().st_size > 0
    for name in ("dict.pos.txt", "dict.ner.txt", "train.en-de.pos.bin", "test.en-de.ner.idx"):
        assert (out / "data-bin" / "sample_en_de" / name).exists(), name


def test_demo_draws_training_curves_and_attention_maps(demo):
    out, _ = demo
    for name in ("loss.png", "perplexity.png", "tag_accuracy.png"):
        assert_image(out / "plots" / name)
    maps = sorted(p.name for p in (out / "attention").glob("*.png"))
    expected = {
        f"{kind}_layer{i}.png"
        for kind in ("encoder_self", "decoder_self", "decoder_cross")
        for i in (1, 2, 3)
    }
    assert expected <= set(maps), maps
    sizes = {assert_image(out / "attention" / name) for name in expected}
    assert len(sizes) == 1, "every layer's grid has the same 4-head layout"
    assert "fire" in (out / "fire_mountain.txt").read_text()


def test_second_run_reuses_finished_stages(demo):
    out, _ = demo
    avg = out / "checkpoints" / "checkpoint_avg.pt"
    before = avg.stat().st_mtime_ns
    log = run_demo(out)
    assert log.count("already done, skipping") >= 6 + len(DEMO_STEPS), "the pipeline's too"
    for step in DEMO_STEPS:
        assert f"step {step}: already done, skipping" in log, step
    assert not re.search(r"step \w+: (running|settings changed)", log), "nothing is redone"
    assert f"reusing {out / 'checkpoints'} (trained for " in log, "no training"
    assert avg.stat().st_mtime_ns == before


def test_a_stage_whose_input_changed_is_redone_with_the_stages_after_it(demo):
    """A newer checkpoint_last.pt (as if training had gone further; here only touched)
    redoes the averaging, and so the evaluation and attention maps that read its output;
    the training curves, from the same log, are kept. No training runs."""
    out, _ = demo
    last = out / "checkpoints" / "checkpoint_last.pt"
    bleu = out / "eval" / "bleu.txt"
    stat = last.stat()
    os.utime(last, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    before = bleu.stat().st_mtime_ns
    log = run_demo(out)
    for step in ("average", "evaluate", "attention"):
        assert f"step {step}: settings changed" in log, step
    for step in ("sample", "plots"):
        assert f"step {step}: already done, skipping" in log, step
    assert f"reusing {out / 'checkpoints'} (trained for " in log, "no training"
    assert bleu.stat().st_mtime_ns != before
    assert re.search(r"^sacrebleu_detok: [\d.]+$", bleu.read_text(), re.M)


def test_another_cut_of_the_sample_under_the_same_out_is_refused(demo):
    """The data and training of one cut are not mixed with another: the run stops before
    the data pipeline, naming the option, and changes nothing."""
    out, _ = demo
    marker = out / ".steps" / "sample.json"
    before = marker.read_text()
    log = run_demo(out, "--train-lines", "200", status=2)
    assert f"--train-lines was {TRAIN_LINES}, now 200" in log and "--force" in log
    assert "step tokenize" not in log, "stopped before the data pipeline"
    assert marker.read_text() == before


@pytest.mark.parametrize(
    "options, variables, message",
    [
        (["--average", "0"], {}, "argument --average: must be at least 1, not 0"),
        ([], {"DEMO_MAX_UPDATE": "1k"}, "argument --max-update: "),
        (["--sample", "/nowhere"], {}, "/nowhere: no train.en, "),
        (["--out", "{tmp}/file"], {}, "/file: not a folder: --out"),
        (["--out", "{tmp}/thesis", "--force"], {}, "thesis holds files and was not made by"),
        # nor is the demo's marker left in it, which --force would then trust
        (["--out", "{tmp}/thesis"], {}, "thesis holds files and was not made by the demo"),
    ],
)
def test_bad_options_are_refused_before_any_stage(tmp_path, options, variables, message):
    """A bad number, sample or --out is a one-line error before the data pipeline, and
    --force never removes a folder the demo did not make."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "thesis.tex").write_text("years of work")
    options = [o.replace("{tmp}", str(tmp_path)) for o in options]
    out = tmp_path / "run"
    proc = subprocess.run(
        ["tpp-demo", "--out", out, "--train-lines", "300", "--heldout-lines", "40", *options],
        cwd=REPO,
        env={**tool_env(), **variables},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "===" not in proc.stdout
    assert (tmp_path / "thesis" / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in (tmp_path / "thesis").iterdir()) == ["thesis.tex"]
