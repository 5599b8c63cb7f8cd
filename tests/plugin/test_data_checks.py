"""A damaged or mismatched data folder is one error naming its file, before training
(issue probes: each of these was a raw traceback at batch time, without the file, or
trained with NaN losses)."""

import shutil

import pytest

from support import PLUGIN_DIR, binarize_tagged, run


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    return binarize_tagged(root / "text", root / "data-bin", n_train=120)


def damage_truncated_bin(folder):
    path = folder / "train.src-tgt.src.bin"
    path.write_bytes(path.read_bytes()[:-10])
    return path, "bytes, but its index"


def damage_empty_bin(folder):
    path = folder / "train.src-tgt.tgt.bin"
    path.write_bytes(b"")
    return path, "0 bytes, but its index"


def damage_truncated_idx(folder):
    path = folder / "valid.src-tgt.src.idx"
    path.write_bytes(path.read_bytes()[:40])
    return path, "truncated or damaged"


def damage_short_tag_dictionary(folder):
    path = folder / "dict.pos.txt"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))
    return folder / "valid.src-tgt.pos.bin", "has 6 entries: the data was binarized with another"


def damage_short_vocabulary(folder):
    for lang in ("src", "tgt"):
        path = folder / f"dict.{lang}.txt"
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:5]))
    return folder / "valid.src-tgt.src.bin", "has 9 entries: the data was binarized with another"


def damage_malformed_dictionary_line(folder):
    path = folder / "dict.src.txt"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:4] + ["count_missing\n"] + lines[5:]))
    return path, "line 5 ('count_missing') is not '<token> <count>'"


def damage_blank_valid_set(folder):
    for lang in ("src", "tgt"):
        for ext in ("bin", "idx"):
            shutil.copyfile(folder / f"blank.{lang}.{ext}", folder / f"valid.src-tgt.{lang}.{ext}")
    return folder / "valid.src-tgt.src.bin", "every sentence of the valid split is empty"


@pytest.mark.parametrize(
    "damage",
    [
        damage_truncated_bin,
        damage_empty_bin,
        damage_truncated_idx,
        damage_short_tag_dictionary,
        damage_short_vocabulary,
        damage_malformed_dictionary_line,
        damage_blank_valid_set,
    ],
)
def test_damaged_data_is_one_error_naming_the_file(data, tmp_path, damage):
    folder = tmp_path / "data"
    shutil.copytree(data, folder)
    if damage is damage_blank_valid_set:  # a valid set of blank lines, binarized
        blank = tmp_path / "blank"
        blank.mkdir()
        for lang in ("src", "tgt"):
            (blank / f"valid.{lang}").write_text("\n" * 20)
        run(
            [
                "fairseq-preprocess",
                "--source-lang",
                "src",
                "--target-lang",
                "tgt",
                "--validpref",
                blank / "valid",
                "--srcdict",
                folder / "dict.src.txt",
                "--tgtdict",
                folder / "dict.tgt.txt",
                "--destdir",
                blank / "bin",
            ]
        )
        for lang in ("src", "tgt"):
            for ext in ("bin", "idx"):
                shutil.copyfile(
                    blank / "bin" / f"valid.src-tgt.{lang}.{ext}", folder / f"blank.{lang}.{ext}"
                )
    path, message = damage(folder)
    trained = run(
        [
            "fairseq-train",
            folder,
            "--user-dir",
            PLUGIN_DIR,
            "--arch",
            "transformer_pp_tiny",
            "--task",
            "translation_with_tags",
            "--criterion",
            "label_smoothed_cross_entropy_with_tags",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--max-tokens",
            "500",
            "--max-update",
            "2",
            "--cpu",
            "--num-workers",
            "0",
            "--save-dir",
            tmp_path / "ckpt",
            "--no-save",
            "--log-file",
            tmp_path / "train.log",
        ],
        check=False,
        timeout=300,
    )
    assert trained.returncode != 0
    assert "Traceback" not in trained.stderr, trained.stderr[-3000:]
    assert f"fairseq-train: error: {path}" in trained.stderr, trained.stderr[-3000:]
    assert message in trained.stderr, trained.stderr[-3000:]
    # and in the log, once, for a run read from its log file (SLURM's, a study's)
    said = (tmp_path / "train.log").read_text()
    assert said.count(f"error: {path}") == 1 and message in said, said[-3000:]


@pytest.mark.parametrize(
    "damage", [damage_truncated_bin, damage_short_vocabulary, damage_malformed_dictionary_line]
)
def test_fairseqs_own_task_and_model_get_the_same_checks(data, tmp_path, damage):
    """Every task loads its files through fairseq's loader, which the plugin checks:
    fairseq's ``translation`` and ``transformer`` too (``TPP_FAIRSEQ_CHECKS``' ``data-files``)."""
    folder = tmp_path / "data"
    shutil.copytree(data, folder)
    path, message = damage(folder)
    train = ["fairseq-train", folder, "--user-dir", PLUGIN_DIR, "--arch", "transformer_iwslt_de_en"]
    train += ["--task", "translation", "--optimizer", "adam", "--lr", "1e-3", "--cpu"]
    train += ["--max-tokens", "500", "--max-update", "2", "--num-workers", "0", "--no-save"]
    trained = run(train, check=False, timeout=300)
    assert trained.returncode != 0
    assert "Traceback" not in trained.stderr, trained.stderr[-3000:]
    assert f"fairseq-train: error: {path}" in trained.stderr, trained.stderr[-3000:]
    assert message in trained.stderr, trained.stderr[-3000:]


@pytest.mark.parametrize("impl, vocab", [("mmap", 70_000), ("mmap", 300), ("cached", 300)])
def test_data_fairseq_reads_is_not_refused(tmp_path, impl, vocab):
    """fairseq writes ids as uint32 from 65,500 types on, and other formats than mmap:
    whole files of either pass; ids beyond the dictionary are refused where checked."""
    import torch
    from fairseq.data import indexed_dataset

    from tpp_fairseq.data_files import DataFileError, check_binarized

    prefix = str(tmp_path / "train.src-tgt.src")
    builder = indexed_dataset.make_builder(prefix + ".bin", impl=impl, vocab_size=vocab)
    for length in (3, 5):
        builder.add_item(torch.full((length,), vocab - 1, dtype=torch.int64))
    builder.finalize(prefix + ".idx")
    check_binarized(prefix, vocab)
    assert len(indexed_dataset.make_dataset(prefix, impl=impl)) == 2
    if impl == "mmap":
        with pytest.raises(DataFileError, match=f"holds id {vocab - 1}, but its dictionary"):
            check_binarized(prefix, vocab - 1)


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_an_id_beyond_the_dictionary_is_named_by_its_sentence(tmp_path, bad):
    """The sentence named is fairseq's sentence id (0-based, as fairseq-generate's S-
    lines number them): the one holding the id, whichever of three it is."""
    import torch
    from fairseq.data import indexed_dataset

    from tpp_fairseq.data_files import DataFileError, check_binarized

    prefix = str(tmp_path / "train.src-tgt.src")
    builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=50)
    for sentence in range(3):
        builder.add_item(torch.tensor([4, 40 if sentence == bad else 5, 2]))
    builder.finalize(prefix + ".idx")
    with pytest.raises(DataFileError, match=rf"sentence {bad} \(0-based\) holds id 40"):
        check_binarized(prefix, 30)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--encoder-conv-heads", "9"], "--encoder-conv-heads (9) must be between 0 and"),
        (
            ["--encoder-conv-dilations", "1,10000"],
            "--encoder-conv-kernel-sizes and --encoder-conv-dilations: layer 2's window",
        ),
        (
            ["--tag-loss-weights", "pos:nan"],
            "--tag-loss-weights: weight of 'pos' must be a number >= 0",
        ),
        (["--tags", "pos,pos"], "--tags: a tag kind is listed twice in 'pos,pos'"),
    ],
)
def test_a_plugin_option_fairseq_cannot_use_is_one_line(data, tmp_path, options, message):
    """(each was a Python traceback ending in that message, or trained: a misspelt tag's
    weight stayed 1, a window 10,000 apart trained, a NaN weight ran to NaN gradients)"""
    train = ["fairseq-train", data, "--user-dir", PLUGIN_DIR, "--arch", "transformer_pp_tiny"]
    train += ["--task", "translation_with_tags", "--optimizer", "adam", "--lr", "1e-3", "--cpu"]
    train += ["--criterion", "label_smoothed_cross_entropy_with_tags", "--max-tokens", "500"]
    train += ["--max-update", "2", "--num-workers", "0", "--no-save", *options]
    trained = run(train, check=False, timeout=300)
    assert trained.returncode != 0
    assert "Traceback" not in trained.stderr, trained.stderr[-3000:]
    assert f"fairseq-train: error: {message}" in trained.stderr, trained.stderr[-3000:]


def test_a_tag_weight_or_head_of_a_tag_not_loaded_is_said(data, tmp_path):
    """(a misspelt name left its tag's weight at 1, or built no head, silently)"""
    train = ["fairseq-train", data, "--user-dir", PLUGIN_DIR, "--arch", "transformer_pp_tiny"]
    train += ["--task", "translation_with_tags", "--optimizer", "adam", "--lr", "1e-3", "--cpu"]
    train += ["--criterion", "label_smoothed_cross_entropy_with_tags", "--max-tokens", "500"]
    train += ["--max-update", "1", "--num-workers", "0", "--no-save", "--tag-loss-weights", "pso:0"]
    train += ["--encoder-tag-layers", "pos:1,nre:2"]
    trained = run(train, check=False, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    said = trained.stdout + trained.stderr
    assert "--tag-loss-weights names 'pso', which the task does not load (--tags pos,ner)" in said
    assert "--encoder-tag-layers: no 'nre' head is built, the task loads no 'nre' labels" in said
    assert "no 'pos' head" not in said


@pytest.mark.parametrize(
    "content, message",
    [
        (b"hello\n", "a text file, not a checkpoint (first line: 'hello')"),
        (b"PK\x03\x04" + b"\0" * 300, "truncated or damaged checkpoint (304 bytes)"),
    ],
)
def test_a_file_that_is_no_checkpoint_is_one_line_naming_it(data, tmp_path, content, message):
    """fairseq's commands (and its hub interface) load checkpoints through the function
    the plugin wraps: torch's ``KeyError: 101`` or miniz error becomes what the file is."""
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(content)
    generate = ["fairseq-generate", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint]
    generate += ["--task", "translation", "--beam", "1", "--cpu", "--gen-subset", "valid"]
    generated = run(generate, check=False, timeout=300)
    assert generated.returncode != 0
    assert "Traceback" not in generated.stderr, generated.stderr[-3000:]
    assert f"fairseq-generate: error: {checkpoint}: {message}" in generated.stderr


def test_the_task_without_a_data_folder_says_where_it_comes_from():
    """fairseq's ``from_pretrained`` sets the data folder to None where
    ``data_name_or_path`` names none that exists; fairseq's task then failed with a
    ``TypeError`` about ``NoneType``."""
    from tpp_pipeline.errors import DataError
    from tpp_plugin.tasks.translation_with_tags import (
        TranslationWithTagsConfig,
        TranslationWithTagsTask,
    )

    with pytest.raises(DataError, match="data_name_or_path names no folder that exists"):
        TranslationWithTagsTask.setup_task(TranslationWithTagsConfig(data=None))
