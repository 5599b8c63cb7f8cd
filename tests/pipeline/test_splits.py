"""tpp-carve-splits: held-out sets carved out of a corpus, deduplicated against training."""

from support import run, write_corpus
from tpp_pipeline.splits import normalise


def corpus_with_repeats(folder):
    """40 pairs in which sources and targets repeat with other case and spacing."""
    pairs = []
    for i in range(40):
        pairs.append(
            (
                f"Open file {i % 15}",
                f"Datei {i % 15} öffnen" if i % 3 else f"DATEI  {i % 15} ÖFFNEN",
            )
        )
    write_corpus(folder, {"all": pairs}, "en", "de")
    return folder / "all"


def read(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_held_out_sets_share_no_side_with_training(tmp_path):
    corpus = corpus_with_repeats(tmp_path / "raw")
    out = tmp_path / "carved"
    shown = run(
        [
            "tpp-carve-splits",
            "--corpus",
            corpus,
            "-s",
            "en",
            "-t",
            "de",
            "--valid",
            "3",
            "--test",
            "4",
            "--out",
            out,
        ]
    )
    assert "test: 4 pairs" in shown.stdout and "valid: 3 pairs" in shown.stdout
    sides = {
        (split, lang): {normalise(line) for line in read(out / f"{split}.{lang}")}
        for split in ("train", "valid", "test")
        for lang in ("en", "de")
    }
    for lang in ("en", "de"):
        assert not sides["train", lang] & sides["test", lang]
        assert not sides["train", lang] & sides["valid", lang]
        assert not sides["valid", lang] & sides["test", lang]
    assert len(read(out / "train.en")) == len(read(out / "train.de")) > 0
    # deterministic: the same seed carves the same sets
    again = run(
        [
            "tpp-carve-splits",
            "--corpus",
            corpus,
            "-s",
            "en",
            "-t",
            "de",
            "--valid",
            "3",
            "--test",
            "4",
            "--out",
            tmp_path / "again",
        ]
    )
    assert again.stdout.replace("again", "carved") == shown.stdout
    assert read(tmp_path / "again" / "test.de") == read(out / "test.de")


def test_misaligned_corpus_is_an_error_naming_the_file(tmp_path):
    corpus = corpus_with_repeats(tmp_path / "raw")
    with open(f"{corpus}.de", "a", encoding="utf-8") as handle:
        handle.write("one more\n")
    shown = run(
        [
            "tpp-carve-splits",
            "--corpus",
            corpus,
            "-s",
            "en",
            "-t",
            "de",
            "--out",
            tmp_path / "carved",
        ],
        check=False,
    )
    assert shown.returncode == 2
    assert f"tpp-carve-splits: error: {corpus}.en: 40 lines, but {corpus}.de has 41" in shown.stderr
    assert "Traceback" not in shown.stderr


def test_a_corpus_path_that_is_a_folder_is_an_error_naming_it(tmp_path):
    """Issue 33.10: a folder where a side of the corpus should be was an
    IsADirectoryError."""
    (tmp_path / "c" / "dd.en").mkdir(parents=True)
    (tmp_path / "c" / "dd.de").mkdir()
    shown = run(
        [
            "tpp-carve-splits",
            "--corpus",
            tmp_path / "c" / "dd",
            "-s",
            "en",
            "-t",
            "de",
            "--valid",
            "2",
            "--test",
            "2",
            "--out",
            tmp_path / "carved",
        ],
        check=False,
    )
    assert shown.returncode == 2, shown.stderr
    assert (
        f"tpp-carve-splits: error: {tmp_path / 'c' / 'dd.en'}: is a folder, not a file: "
        "--corpus PREFIX reads the files PREFIX.en (or PREFIX.en.xz)" in shown.stderr
    )
    assert "Traceback" not in shown.stderr
    assert not (tmp_path / "carved").exists()


def test_an_output_folder_that_cannot_be_created_is_an_error(tmp_path):
    corpus = corpus_with_repeats(tmp_path / "raw")
    (tmp_path / "taken").write_text("a file, not a folder\n")
    shown = run(
        [
            "tpp-carve-splits",
            "--corpus",
            corpus,
            "-s",
            "en",
            "-t",
            "de",
            "--valid",
            "3",
            "--test",
            "4",
            "--out",
            tmp_path / "taken" / "carved",
        ],
        check=False,
    )
    assert shown.returncode == 2, shown.stderr
    assert f"tpp-carve-splits: error: {tmp_path / 'taken'}" in shown.stderr
    assert "cannot create the output folder (Not a directory)" in shown.stderr, shown.stderr
    assert "Traceback" not in shown.stderr
