"""tpp-tag-gradients on a transformer_pp_tiny with 3 encoder layers, POS after layer 1 and
NER after layer 2 (the default placement), trained here for 3 updates on toy tags."""

import subprocess

import pytest

from support import PLUGIN_DIR, VENV_BIN as BIN, binarize_tagged, run
from tpp_tools import analysis_model, tag_gradients


def train(data, save_dir, *extra):
    subprocess.run(
        [
            str(BIN / "fairseq-train"),
            str(data),
            "--user-dir",
            str(PLUGIN_DIR),
            "--arch",
            "transformer_pp_tiny",
            "--encoder-layers",
            "3",
            "-s",
            "src",
            "-t",
            "tgt",
            "--optimizer",
            "adam",
            "--lr",
            "0.001",
            "--max-tokens",
            "500",
            "--max-update",
            "3",
            "--save-dir",
            str(save_dir),
            "--no-epoch-checkpoints",
            "--cpu",
            "--seed",
            "1",
            "--num-workers",
            "0",
            *extra,
        ],
        check=True,
        capture_output=True,
    )
    return save_dir / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint with tag heads, checkpoint without, data folder with labels)."""
    root = tmp_path_factory.mktemp("tag_gradients")
    data = binarize_tagged(root / "text", root / "data-bin", n_train=200)
    tagged = train(
        data,
        root / "tagged",
        "--task",
        "translation_with_tags",
        "--criterion",
        "label_smoothed_cross_entropy_with_tags",
        "--tag-loss-weights",
        "pos:1,ner:0.5",
    )
    plain = train(
        data,
        root / "plain",
        "--task",
        "translation",
        "--criterion",
        "label_smoothed_cross_entropy",
        "--encoder-tag-layers",
        "",
    )
    return tagged, plain, data


def table_of(checkpoint, data, pos_weight=None):
    loaded = analysis_model.load_model(checkpoint, data)
    criterion = loaded.task.build_criterion(loaded.cfg.criterion)
    if pos_weight is not None:
        criterion.tag_weights["pos"] = pos_weight
    batches = tag_gradients.first_batches(loaded.task, loaded.model, "valid", 2, 500)
    return tag_gradients.tag_gradients(loaded.model, loaded.task, criterion, batches)


def test_a_tag_loss_reaches_the_layers_below_its_head_and_no_others(trained):
    tagged, _, data = trained
    table = table_of(tagged, data)
    assert list(table) == ["embeddings", "layer 1", "layer 2", "layer 3"]
    assert list(table["layer 1"]) == [
        "norm translation",
        "norm ner",
        "norm pos",
        "cos ner",
        "cos pos",
    ]
    for group, row in table.items():
        assert row["norm translation"] > 0, group
        # POS reads layer 1's output, NER layer 2's: nothing above them
        assert (row["norm pos"] > 0) == (group in ("embeddings", "layer 1")), group
        assert (row["norm ner"] > 0) == (group != "layer 3"), group
        for name in ("pos", "ner"):  # no cosine with a zero gradient
            assert (row[f"cos {name}"] is None) == (row[f"norm {name}"] == 0), group
            assert row[f"cos {name}"] is None or -1 <= row[f"cos {name}"] <= 1


def test_the_tag_gradients_carry_the_criterions_weight(trained):
    """The checkpoint's criterion weighs POS 1; weight 3 triples its gradient and leaves
    its direction and the other losses alone."""
    tagged, _, data = trained
    once, thrice = table_of(tagged, data), table_of(tagged, data, pos_weight=3.0)
    for group in once:
        assert thrice[group]["norm pos"] == pytest.approx(3 * once[group]["norm pos"])
        if once[group]["cos pos"] is None:
            assert thrice[group]["cos pos"] is None
        else:
            assert thrice[group]["cos pos"] == pytest.approx(once[group]["cos pos"], abs=1e-6)
        assert thrice[group]["norm ner"] == once[group]["norm ner"]
        assert thrice[group]["norm translation"] == once[group]["norm translation"]


def test_the_command_prints_the_table(trained):
    tagged, _, data = trained
    shown = run(
        ["tpp-tag-gradients", "--path", tagged, "--data", data, "--batches", "2"], timeout=300
    )
    lines = shown.stdout.splitlines()
    assert lines[0] == "| | norm translation | norm ner | norm pos | cos ner | cos pos |"
    assert [line.split("|")[1].strip() for line in lines[2:]] == [
        "embeddings",
        "layer 1",
        "layer 2",
        "layer 3",
    ]
    assert lines[-1].endswith("| 0.0000 | 0.0000 | n/a | n/a |"), lines[-1]


def test_sentences_longer_than_max_tokens_are_left_out_not_a_traceback(trained):
    tagged, _, data = trained
    shown = run(
        ["tpp-tag-gradients", "--path", tagged, "--data", data, "--max-tokens", "3"],
        check=False,
        timeout=300,
    )
    assert shown.returncode == 1 and "Traceback" not in shown.stderr, shown.stderr[-2000:]
    assert "each of its sentences is longer than --max-tokens" in shown.stderr


def test_a_data_folder_without_the_label_streams_is_named(trained, tmp_path):
    tagged, _, data = trained
    plain = tmp_path / "plain"
    plain.mkdir()
    for path in data.iterdir():
        if not any(kind in path.name for kind in ("pos", "ner")):
            (plain / path.name).symlink_to(path)
    shown = run(["tpp-tag-gradients", "--path", tagged, "--data", plain], check=False, timeout=300)
    assert shown.returncode == 1, shown.stderr[-2000:]
    assert f"{plain} has no label streams for {tagged}'s tag heads" in shown.stderr
    for kind in ("pos", "ner"):  # the label dictionaries, not the streams
        (plain / f"dict.{kind}.txt").symlink_to(data / f"dict.{kind}.txt")
    shown = run(["tpp-tag-gradients", "--path", tagged, "--data", plain], check=False, timeout=300)
    assert shown.returncode == 1, shown.stderr[-2000:]
    assert "labels not found: expected" in shown.stderr, shown.stderr[-2000:]
    assert "the tag losses' gradients need the labels" in shown.stderr
    assert "--tags ''" not in shown.stderr, "(advice to train without tags)"


def test_a_split_the_folder_lacks_is_named_as_such(trained):
    tagged, _, data = trained
    shown = run(
        ["tpp-tag-gradients", "--path", tagged, "--data", data, "--split", "nosuch"],
        check=False,
        timeout=300,
    )
    assert shown.returncode == 1, shown.stderr[-2000:]
    assert f"tpp-tag-gradients: error: {data}: no split 'nosuch'" in shown.stderr
    assert "need the labels" not in shown.stderr  # (the folder has them)


def test_a_model_without_tag_heads_is_named(trained):
    _, plain, data = trained
    shown = run(["tpp-tag-gradients", "--path", plain, "--data", data], check=False, timeout=300)
    assert shown.returncode == 1
    assert shown.stderr.strip().splitlines()[-1] == (
        f"tpp-tag-gradients: error: {plain} has no tag heads "
        "(trained with --encoder-tag-layers ''?)"
    )
