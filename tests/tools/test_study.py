"""tpp-study: what identifies a run, and its plan on a prepared data folder."""

import argparse
import shlex

from support import binarize_tagged, run
from tpp_tools import study

# Run folders of a study planned by scripts/run_study.py before the runner moved into
# tpp_tools, on the data folder of data_folder() below: a study started then is resumed
# (its finished runs reused) only if these stay the same.
RUN_FOLDERS = {
    "cpu": ["transformer-s1-c85b93f2", "transformer-s2-63050a12", "control-s1-83b39d14",
            "control-s2-9500e6e6", "hybrid-s1-3dc1f37d", "hybrid-s2-9787e633",
            "hybrid_tags-s1-8352a9d9", "hybrid_tags-s2-66490b27"],
    "gpu": ["transformer-s1-9c2a95cd", "transformer-s2-d3983fd6", "control-s1-cb148a55",
            "control-s2-e86443aa", "hybrid-s1-bca49e8a", "hybrid-s2-f8968cae",
            "hybrid_tags-s1-b12b34f2", "hybrid_tags-s2-8f3699a1"],
}


def data_folder(folder):
    """A stand-in data folder: the fingerprint reads dictionaries and .idx files only."""
    folder.mkdir()
    (folder / "dict.en.txt").write_text("a 1\nb 2\n")
    (folder / "dict.de.txt").write_text("a 1\nb 2\n")
    (folder / "train.en-de.en.idx").write_bytes(b"x" * 30)
    (folder / "test.en-de.de.idx").write_bytes(b"y" * 30)
    return folder


def test_run_identity_is_that_of_the_former_runner(tmp_path):
    data = data_folder(tmp_path / "data")
    assert study.fingerprint(data) == "9ef634b2722143c4"
    for config, device in (("cpu", "cpu"), ("gpu", "cuda")):
        args = argparse.Namespace(variants=list(study.VARIANTS), seeds=[1, 2], extra=[],
                                  device=device, out=tmp_path / "out")
        runs = study.plan_runs(args, study.CONFIGS[config], data)
        assert [r.folder.name for r in runs] == RUN_FOLDERS[config], config
        assert all(r.folder.parent == tmp_path / "out" / "runs" for r in runs)


def test_dry_run_plans_every_variant_and_seed(tmp_path):
    data = binarize_tagged(tmp_path / "text", tmp_path / "data-bin", n_train=60)
    out = tmp_path / "study"
    shown = run(["tpp-study", "--config", "cpu", "--data", data,
                 "--test-reference", tmp_path / "text" / "test.tgt", "--out", out,
                 "--variants", "transformer,hybrid+tags", "--seeds", "1,2", "--device", "cpu",
                 "--dry-run"], timeout=300)
    lines = shown.stdout.splitlines()
    planned = [line for line in lines if " [to train] " in line]
    assert [line.split()[0] for line in planned] == [
        "transformer-s1", "transformer-s2", "hybrid+tags-s1", "hybrid+tags-s2"], shown.stdout
    commands = [shlex.split(line) for line in lines if line.strip().startswith("fairseq-train")]
    assert len(commands) == 4
    first, last = commands[0], commands[-1]
    assert first[first.index("--arch") + 1] == "transformer"
    assert last[last.index("--arch") + 1] == "transformer_pp"
    assert last[last.index("--task") + 1] == "translation_with_tags"
    assert last[last.index("--user-dir") + 1].endswith("tpp_plugin")
    assert not (out / "runs").exists(), "a dry run trains nothing"


def test_bad_input_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "nowhere"
    shown = run(["tpp-study", "--data", missing, "--test-reference", tmp_path / "ref",
                 "--out", tmp_path / "out", "--device", "cpu"], check=False, timeout=300)
    assert shown.returncode == 2
    assert f"tpp-study: error: --data {missing}: no such folder" in shown.stderr
    assert "Traceback" not in shown.stderr
