"""The main job (tpp-demo, what `make demo` runs) end to end on a cut-down
budget: the shipped sample through spaCy tagging, BPE, binarization, training with
tags, averaging, generation, sacreBLEU, plots and attention maps; then a second run
that reuses every finished stage."""

import re
import subprocess

import pytest
from PIL import Image, ImageStat

from support import REPO, tool_env

pytestmark = pytest.mark.slow

QUICK = [
    "--train-lines",
    "300",
    "--heldout-lines",
    "40",
    "--max-update",
    "10",
    "--save-every",
    "1",
    "--average",
    "3",
]


def run_demo(out, *extra):
    env = tool_env()
    env["OMP_NUM_THREADS"] = "2"
    proc = subprocess.run(
        ["tpp-demo", "--out", out, *QUICK, *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
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
        l
        for l in (out / "eval" / "generate-test.txt").read_text().splitlines()
        if l.startswith("H-")
    ]
    assert len(hyps) == 40
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
    before = avg.stat().st_mtime
    log = run_demo(out)
    assert log.count("already done, skipping") >= 6
    assert f"reusing {avg}" in log and "reusing " + str(out / "eval" / "bleu.txt") in log
    assert avg.stat().st_mtime == before
