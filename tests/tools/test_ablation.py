"""The ablation runner (python -m tpp_tools.ablation) on a toy tagged corpus: three variants trained with the same
(tiny) budget, averaged, evaluated, and one Markdown table; a second call reuses the runs."""

import subprocess
import sys

import pytest

from support import REPO, binarize_tagged, tool_env

pytestmark = pytest.mark.slow


def run_ablation(data, reference, out):
    proc = subprocess.run(
        [sys.executable, "-m", "tpp_tools.ablation", "--data", data, "--reference", reference,
         "--out", out, "--max-update", "4", "--average", "2", "--max-tokens", "1000"],
        cwd=REPO, env=tool_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_ablation_trains_three_variants_and_writes_one_table(tmp_path):
    data = binarize_tagged(tmp_path / "text", tmp_path / "data-bin", n_train=120)
    reference = tmp_path / "text" / "test.tgt"
    out = tmp_path / "ablation"
    run_ablation(data, reference, out)
    table = (out / "ablation.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(): line for line in table if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"variant", "transformer", "hybrid", "hybrid+tags"}
    for name in ("transformer", "hybrid", "hybrid_tags"):
        assert (out / name / "eval" / "bleu.txt").exists()
    # the variants really differ: conv heads change the parameter count, tags add heads
    params = {n: float(rows[n].split("|")[3].strip().rstrip("M")) for n in ("transformer", "hybrid")}
    assert params["transformer"] != params["hybrid"]
    import torch
    import tpp_plugin  # noqa: F401  (allow-lists fairseq's checkpoint contents)

    def has_tag_heads(name):
        state = torch.load(out / name / "checkpoints" / "checkpoint_avg.pt", map_location="cpu", weights_only=True)
        return any(k.startswith("encoder.tag_heads.") for k in state["model"])

    assert has_tag_heads("hybrid_tags") and not has_tag_heads("hybrid") and not has_tag_heads("transformer")
    log = run_ablation(data, reference, out)
    assert log.count("(trained)") == 3
