"""Checkpoints that know their data (tpp_fairseq.checkpoints; tpp_fairseq.checkpoint_match):
a checkpoint records the dictionaries it was trained with, and resuming
(scripts/train.sh), tpp-evaluate, fairseq-generate through the plugin and
tpp-average-checkpoints refuse a data folder with other dictionaries -- of the same size
(every embedding row would stand for another word) or of another -- naming both
folders; resuming also refuses changed model options, naming the option and both
values. The plugin's task writes the record: a checkpoint of another task loads as in
fairseq. Real commands on tiny data; fairseq's own transformer, trained through the
plugin's task, and transformer_pp."""

import shutil
import subprocess

import pytest
import torch

from support import PLUGIN_DIR, binarize, make_corpus, run, tool_env, train_command

import tpp_plugin  # noqa: F401  (allow-lists fairseq checkpoint contents for torch.load)
from tpp_fairseq.checkpoint_match import RECORD_KEY, recorded

pytestmark = pytest.mark.slow


def command(*args, cwd=None):
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=tool_env(), capture_output=True, text=True, timeout=600
    )


def train(data, save_dir, max_update, arch="transformer_tiny", extra=(), options=()):
    """scripts/train.sh on the CPU; ``options`` go before ``--``, ``extra`` after it."""
    argv = train_command(
        data, save_dir, max_update=max_update, save_interval_updates=1, extra=extra
    )
    argv[argv.index("--arch") + 1] = arch
    cut = argv.index("--")
    return command(*argv[:cut], *options, *argv[cut:])


def one_line_error(result, program):
    """The command failed with one ``<program>: error:`` line at the end and no traceback."""
    assert result.returncode != 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{program}: error: "), result.stderr[-3000:]
    return last


def files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name.endswith(".pt")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Three data folders of en-de: ``a``; ``same_size``, the same corpus binarized with
    ``a``'s dictionary in reverse order (same size, every index another word); and
    ``other_size``, a smaller corpus with a smaller dictionary. ``run_a``: 2 updates of
    fairseq's transformer_tiny on ``a``, through the plugin."""
    root = tmp_path_factory.mktemp("match")
    corpus = make_corpus(root / "corpus", sizes=(120, 20, 20))
    a = binarize(corpus / "bpe", root / "a", "en", "de")
    reversed_dict = root / "reversed.txt"
    reversed_dict.write_text("".join(reversed((a / "dict.en.txt").read_text().splitlines(True))))
    same_size = root / "same_size"
    run(
        [
            "fairseq-preprocess",
            "--source-lang",
            "en",
            "--target-lang",
            "de",
            *[
                arg
                for s in ("train", "valid", "test")
                for arg in (f"--{s}pref", corpus / "bpe" / s)
            ],
            "--destdir",
            same_size,
            "--srcdict",
            reversed_dict,
            "--joined-dictionary",
            "--workers",
            "1",
        ]
    )
    small = make_corpus(root / "small", sizes=(30, 20, 20), seed=3)
    other_size = binarize(small / "bpe", root / "other_size", "en", "de")
    sizes = {
        name: len((folder / "dict.en.txt").read_text().splitlines())
        for name, folder in (("a", a), ("same_size", same_size), ("other_size", other_size))
    }
    assert sizes["a"] == sizes["same_size"] != sizes["other_size"]
    assert (a / "dict.en.txt").read_text() != (same_size / "dict.en.txt").read_text()
    result = train(a, root / "run_a", max_update=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        "root": root,
        "corpus": corpus,
        "small": small,
        "a": a,
        "same_size": same_size,
        "other_size": other_size,
        "run_a": root / "run_a",
    }


def test_a_checkpoint_records_its_dictionaries(folders):
    state = torch.load(
        folders["run_a"] / "checkpoint_last.pt", map_location="cpu", weights_only=True
    )
    record = state["task_state"][RECORD_KEY]  # the task's state, which fairseq saves
    assert RECORD_KEY not in state
    assert record["data"] == str(folders["a"])
    assert record["dictionaries"]["source"]["file"] == "dict.en.txt"
    assert record["dictionaries"]["target"]["file"] == "dict.de.txt"
    assert (
        record["dictionaries"]["source"]["size"]
        == state["model"]["encoder.embed_tokens.weight"].shape[0]
    )


@pytest.mark.parametrize("folder", ["same_size", "other_size"])
def test_resuming_with_another_dictionary_is_refused_naming_both_folders(folders, tmp_path, folder):
    """P30 (same size: fairseq trained on, every row bound to another word) and P29
    (another size: fairseq's "please ensure that the architectures match")."""
    save = tmp_path / "run"
    shutil.copytree(folders["run_a"], save)
    before = files(save)
    result = train(folders[folder], save, max_update=4)
    last = one_line_error(result, "fairseq-train")
    assert (
        f"was trained on {folders['a']}, whose source and target dictionaries (dict.en.txt, dict.de.txt)"
        in last
    )
    assert f"differ from those in {folders[folder]}" in last
    if folder == "same_size":
        assert "the same size" in last and "another word" in last
    else:
        assert "types in the checkpoint's" in last
    assert "architectures match" not in result.stderr
    assert files(save) == before  # nothing trained, nothing written


@pytest.mark.parametrize("folder", ["same_size", "other_size"])
def test_evaluating_on_another_dictionary_is_refused(folders, tmp_path, folder):
    """P36 (same size: scored garbage) and P35 (another size: "fairseq-generate failed")."""
    corpus = folders["corpus"] if folder == "same_size" else folders["small"]
    out = tmp_path / "eval"
    result = command(
        "tpp-evaluate",
        "--data",
        folders[folder],
        "--checkpoint",
        folders["run_a"] / "checkpoint_last.pt",
        "--reference",
        corpus / "raw" / "test.de",
        "--out",
        out,
        "--cpu",
        "--beam",
        "1",
    )
    last = one_line_error(result, "tpp-evaluate")
    assert result.returncode == 2
    assert f"trained on {folders['a']}" in last and f"in {folders[folder]}" in last
    assert "fairseq-generate" not in result.stderr  # refused before translating
    assert not (out / "bleu.txt").exists()


def test_fairseq_generate_through_the_plugin_refuses_another_dictionary(folders):
    def generate(data):
        return command(
            "fairseq-generate",
            data,
            "--user-dir",
            PLUGIN_DIR,
            "--path",
            folders["run_a"] / "checkpoint_last.pt",
            "--gen-subset",
            "test",
            "--beam",
            "1",
            "--max-tokens",
            "400",
            "--cpu",
        )

    good = generate(folders["a"])
    assert good.returncode == 0, good.stderr[-3000:]
    assert sum(line.startswith("H-") for line in good.stdout.splitlines()) == 20
    result = generate(folders["same_size"])
    last = one_line_error(result, "fairseq-generate")
    assert (
        f"trained on {folders['a']}" in last
        and f"differ from those in {folders['same_size']}" in last
    )
    assert not any(line.startswith("H-") for line in result.stdout.splitlines())


def test_loading_in_python_with_the_task_set_up_from_the_checkpoint_is_checked(folders):
    """``load_model_ensemble_and_task`` without a task (the hub interface, the analysis
    tools) sets one up from the checkpoint, here with another data folder."""
    from fairseq import checkpoint_utils

    from tpp_fairseq.checkpoint_match import CheckpointMismatch
    from tpp_tools.analysis_model import AnalysisError, load_model

    checkpoint = folders["run_a"] / "checkpoint_last.pt"
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(folders["a"])}
    )
    assert len(models) == 1 and len(task.source_dictionary) > 100
    with pytest.raises(CheckpointMismatch, match=f"differ from those in {folders['same_size']}"):
        checkpoint_utils.load_model_ensemble_and_task(
            [str(checkpoint)], arg_overrides={"data": str(folders["same_size"])}
        )
    with pytest.raises(AnalysisError, match=f"trained on {folders['a']}, whose source and target"):
        load_model(checkpoint, folders["other_size"])


def test_averaging_checkpoints_of_other_dictionaries_is_refused(folders, tmp_path):
    result = train(folders["same_size"], tmp_path / "run_b", max_update=2)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = folders["run_a"] / "checkpoint_1_2.pt", tmp_path / "run_b" / "checkpoint_1_2.pt"
    out = tmp_path / "avg.pt"
    result = command(
        "tpp-average-checkpoints",
        "--inputs",
        first,
        second,
        "--output",
        out,
        "--allow-config-mismatch",
    )
    last = one_line_error(result, "tpp-average-checkpoints")
    assert f"{second} was trained on {folders['same_size']}" in last
    assert f"differ from those of {first} (trained on {folders['a']})" in last
    assert not out.exists()
    # two checkpoints of one run: averaged, and the average keeps the record
    result = command(
        "tpp-average-checkpoints",
        "--inputs",
        folders["run_a"] / "checkpoint_1_1.pt",
        first,
        "--output",
        out,
    )
    assert result.returncode == 0, result.stderr
    averaged = torch.load(out, map_location="cpu", weights_only=True)
    assert averaged["task_state"][RECORD_KEY]["data"] == str(folders["a"])


def test_a_checkpoint_without_a_record_still_loads(folders, tmp_path):
    """Written by another task, or before the record existed: resumed as fairseq resumes
    it (the resumed run's checkpoints then have a record); tpp-evaluate refuses a
    dictionary of another size (the embeddings say so)."""
    save = tmp_path / "old"
    shutil.copytree(folders["run_a"], save)
    for path in save.glob("*.pt"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        del state["task_state"][RECORD_KEY]
        assert recorded(state) is None
        torch.save(state, path)
    result = command(
        "tpp-evaluate",
        "--data",
        folders["other_size"],
        "--checkpoint",
        save / "checkpoint_last.pt",
        "--reference",
        folders["small"] / "raw" / "test.de",
        "--out",
        tmp_path / "eval",
        "--cpu",
        "--beam",
        "1",
    )
    last = one_line_error(result, "tpp-evaluate")
    assert (
        "with another source dictionary than dict.en.txt of " + str(folders["other_size"]) in last
    )
    result = train(folders["a"], save, max_update=3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Loaded checkpoint" in result.stdout + result.stderr
    resumed = torch.load(save / "checkpoint_1_3.pt", map_location="cpu", weights_only=True)
    assert recorded(resumed)["data"] == str(folders["a"])


def test_a_checkpoint_of_version_0_3_0_is_checked(folders, tmp_path):
    """Version 0.3.0 kept the record at the checkpoint's top level: still read."""
    save = tmp_path / "v030"
    save.mkdir()
    state = torch.load(
        folders["run_a"] / "checkpoint_last.pt", map_location="cpu", weights_only=True
    )
    state[RECORD_KEY] = state["task_state"].pop(RECORD_KEY)
    torch.save(state, save / "checkpoint_last.pt")
    from fairseq import checkpoint_utils

    from tpp_fairseq.checkpoint_match import CheckpointMismatch

    with pytest.raises(CheckpointMismatch, match=f"trained on {folders['a']}, whose source"):
        checkpoint_utils.load_model_ensemble_and_task(
            [str(save / "checkpoint_last.pt")], arg_overrides={"data": str(folders["same_size"])}
        )


def test_fairseqs_own_task_records_nothing_and_loads_as_in_fairseq(folders, tmp_path):
    """The record and its checks belong to the plugin's task: fairseq's transformer
    trained with fairseq's translation task, the plugin loaded, writes none, and
    fairseq-generate through the plugin loads it with any dictionary of its size, as
    fairseq does."""
    save = tmp_path / "fairseq_task"
    result = command(
        "fairseq-train",
        folders["a"],
        "--user-dir",
        PLUGIN_DIR,
        "--task",
        "translation",
        "--arch",
        "transformer_tiny",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--max-tokens",
        "400",
        "--max-update",
        "1",
        "--save-dir",
        save,
        "--no-epoch-checkpoints",
        "--cpu",
        "--seed",
        "1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert recorded(state) is None and RECORD_KEY not in state["task_state"]
    generated = command(
        "fairseq-generate",
        folders["same_size"],
        "--user-dir",
        PLUGIN_DIR,
        "--path",
        save / "checkpoint_last.pt",
        "--gen-subset",
        "test",
        "--beam",
        "1",
        "--max-tokens",
        "400",
        "--cpu",
    )
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert sum(line.startswith("H-") for line in generated.stdout.splitlines()) == 20


@pytest.fixture(scope="module")
def pp_run(folders):
    """2 updates of transformer_pp_tiny on ``a``, without --conv-head-scaling."""
    save = folders["root"] / "run_pp"
    result = train(folders["a"], save, max_update=2, arch="transformer_pp_tiny")
    assert result.returncode == 0, result.stderr[-3000:]
    return save


def test_resuming_with_changed_model_options_is_refused(folders, pp_run, tmp_path):
    """P69: the option and both values named; nothing trained."""
    save = tmp_path / "changed"
    shutil.copytree(pp_run, save)
    before = files(save)
    result = train(
        folders["a"],
        save,
        max_update=4,
        arch="transformer_pp_tiny",
        extra=["--conv-head-scaling", "inv-sqrt-head-dim"],
    )
    last = one_line_error(result, "fairseq-train")
    assert "--conv-head-scaling 'none' in the checkpoint, 'inv-sqrt-head-dim' now" in last
    assert files(save) == before


def test_options_that_do_not_change_the_model_resume(folders, pp_run, tmp_path):
    """Another implementation of the same function (--conv-heads-impl), other
    regularisation (dropouts) and other run options (learning rate, batch size, logging)
    resume; the checkpoints before and after average; --reset-optimizer starts a new
    training from the weights with other model options."""
    save = tmp_path / "same"
    shutil.copytree(pp_run, save)
    result = train(
        folders["a"],
        save,
        max_update=3,
        arch="transformer_pp_tiny",
        options=["--lr", "1e-3", "--max-tokens", "300", "--log-interval", "1"],
        extra=["--conv-heads-impl", "taps", "--dropout", "0.2", "--conv-weight-dropout", "0.1"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Loaded checkpoint" in result.stdout + result.stderr
    result = command(
        "tpp-average-checkpoints",
        "--inputs",
        save / "checkpoint_1_2.pt",
        save / "checkpoint_1_3.pt",
        "--output",
        tmp_path / "avg.pt",
    )
    assert result.returncode == 0, result.stderr
    result = train(
        folders["a"],
        save,
        max_update=4,
        arch="transformer_pp_tiny",
        extra=["--conv-head-scaling", "inv-sqrt-head-dim", "--reset-optimizer"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
