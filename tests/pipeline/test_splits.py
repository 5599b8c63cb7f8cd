"""tpp-carve-splits: held-out sets carved out of a corpus, deduplicated against training."""

import pytest

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


def test_an_out_folder_holding_an_input_is_refused_and_the_input_kept(tmp_path):
    """--out the corpus's own folder: its train.en was read, then written over with the
    training pairs left after carving (the same for a held-out set the study gives)."""
    folder = tmp_path / "c"
    corpus_with_repeats(folder)
    (folder / "train.en").write_text("a\nb\nc\nd\n", encoding="utf-8")
    (folder / "train.de").write_text("w\nx\ny\nz\n", encoding="utf-8")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    shown = run(
        ["tpp-carve-splits", "--corpus", folder / "train", "-s", "en", "-t", "de",
         "--valid", "1", "--test", "1", "--out", folder],
        check=False,
    )  # fmt: skip
    assert shown.returncode == 2, shown.stderr
    assert (
        f"error: {folder / 'train.en'}: is an input of the carving, and --out would "
        "write over it" in shown.stderr
    ), shown.stderr
    import lzma

    from tpp_pipeline import splits
    from tpp_pipeline.errors import DataError

    with pytest.raises(DataError, match="is an input of the carving") as info:
        held = {"test": folder / "train"}  # a test set of its own, in the same folder
        splits.carve_corpus(folder / "all", "en", "de", folder, {"valid": 1}, given=held)
    assert info.value.path == folder / "train.en"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # a corpus read from .xz files: the plain name written beside them would be read next
    packed = tmp_path / "packed"
    packed.mkdir()
    for lang in ("en", "de"):
        (packed / f"train.{lang}.xz").write_bytes(
            lzma.compress((folder / f"train.{lang}").read_bytes())
        )
    shown = run(
        ["tpp-carve-splits", "--corpus", packed / "train", "-s", "en", "-t", "de",
         "--valid", "1", "--test", "1", "--out", packed],
        check=False,
    )  # fmt: skip
    assert shown.returncode == 2 and "is an input of the carving" in shown.stderr, shown.stderr
    assert sorted(p.name for p in packed.iterdir()) == ["train.de.xz", "train.en.xz"]


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


def carve(corpus, out, *options, check=True):
    command = ["tpp-carve-splits", "--corpus", corpus, "-s", "en", "-t", "de", "--out", out]
    return run([*command, *options], check=check)


def test_a_carving_with_other_settings_is_refused_over_an_earlier_one(tmp_path):
    """The same command again keeps the held-out sets; another seed, size or corpus over
    them is refused, naming what changed, until --force carves again."""
    corpus = corpus_with_repeats(tmp_path / "raw")
    out = tmp_path / "carved"
    carve(corpus, out, "--valid", "3", "--test", "4")
    test = read(out / "test.de")
    assert carve(corpus, out, "--valid", "3", "--test", "4").returncode == 0
    other = carve(corpus, out, "--valid", "3", "--test", "4", "--seed", "3", check=False)
    assert other.returncode == 2 and "seed 1 -> 3" in other.stderr, other.stderr
    assert "use --force to carve again" in other.stderr and read(out / "test.de") == test
    with open(f"{corpus}.de", "a", encoding="utf-8") as handle:  # the corpus changed
        handle.write("x\n")
    with open(f"{corpus}.en", "a", encoding="utf-8") as handle:
        handle.write("x\n")
    changed = carve(corpus, out, "--valid", "3", "--test", "4", check=False)
    assert changed.returncode == 2 and "corpus" in changed.stderr
    carve(corpus, out, "--valid", "3", "--test", "5", "--force")
    assert len(read(out / "test.de")) == 5
    moved = tmp_path / "moved"  # the same corpus elsewhere: the same carving
    (tmp_path / "raw").rename(moved)
    assert carve(moved / "all", out, "--valid", "3", "--test", "5").returncode == 0
    (out / ".carve-settings.json").write_text("[]")  # a record that is no record
    damaged = carve(moved / "all", out, "--valid", "3", "--test", "5", check=False)
    assert damaged.returncode == 2 and "Traceback" not in damaged.stderr


def test_an_empty_held_out_set_takes_no_pair_and_a_negative_one_is_refused(tmp_path):
    """Also refused, naming the file where there is one: more pairs than the corpus
    holds, an empty corpus, the same language on both sides."""
    corpus = corpus_with_repeats(tmp_path / "raw")
    shown = carve(corpus, tmp_path / "carved", "--valid", "0", "--test", "0")
    assert "test: 0 pairs" in shown.stdout and "valid: 0 pairs" in shown.stdout
    assert len(read(tmp_path / "carved" / "train.en")) == 40
    negative = carve(corpus, tmp_path / "other", "--valid", "-3", check=False)
    assert negative.returncode == 2 and "--valid must be 0 or more pairs, not -3" in negative.stderr
    too_many = carve(corpus, tmp_path / "other", "--valid", "30", check=False)
    assert too_many.returncode == 2 and f"{corpus}.en: only " in too_many.stderr, too_many.stderr
    (tmp_path / "empty.en").write_text("")
    (tmp_path / "empty.de").write_text("")
    empty = carve(tmp_path / "empty", tmp_path / "other", check=False)
    assert empty.returncode == 2 and "empty.en: holds no pairs" in empty.stderr, empty.stderr
    same = run(
        ["tpp-carve-splits", "--corpus", corpus, "-s", "en", "-t", "en", "--out", tmp_path],
        check=False,
    )
    assert same.returncode == 2 and "both 'en' (-s, -t)" in same.stderr
    assert not (tmp_path / "other").exists()


def test_invalid_utf8_is_named_with_its_line_and_column(tmp_path):
    import lzma

    corpus_with_repeats(tmp_path / "raw")
    lines = (tmp_path / "raw" / "all.de").read_bytes().split(b"\n")
    lines[7] = b"Datei \xff"
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "all.en").write_bytes((tmp_path / "raw" / "all.en").read_bytes())
    with lzma.open(packed / "all.de.xz", "wb") as handle:
        handle.write(b"\n".join(lines))
    shown = carve(packed / "all", tmp_path / "carved", check=False)
    assert shown.returncode == 2
    assert f"{packed / 'all.de.xz'}:8: invalid UTF-8 byte b'\\xff' at column 7" in shown.stderr


def test_invisible_characters_do_not_hide_a_duplicate(tmp_path):
    """A byte-order mark or a zero-width space, which the tokeniser turns into a space,
    does not make a held-out pair differ from a training pair."""
    pairs = []
    for i in range(40):
        mark = ("\ufeff", "", "\u200b")[i // 12 % 3]
        pairs.append((f"{mark}Open file {i % 12}", f"Datei {i % 12} öffnen{mark}"))
    write_corpus(tmp_path / "raw", {"all": pairs}, "en", "de")
    out = tmp_path / "carved"
    run(
        ["tpp-carve-splits", "--corpus", tmp_path / "raw" / "all", "-s", "en", "-t", "de"]
        + ["--valid", "3", "--test", "4", "--out", out]
    )

    def key(line):
        return " ".join(line.replace("\ufeff", " ").replace("\u200b", " ").split()).casefold()

    for lang in ("en", "de"):
        train = {key(line) for line in read(out / f"train.{lang}")}
        held = {key(line) for split in ("valid", "test") for line in read(out / f"{split}.{lang}")}
        assert train and len(held) == 7 and not train & held


def test_an_interrupted_carving_again_is_not_taken_for_a_finished_one(tmp_path, monkeypatch):
    """A carving with --force stopped after its first file left the earlier carving's
    record and files beside the new ones: the next run took the mixture for the earlier
    carving. It is now refused, as a file other than the carving's, until --force."""
    from tpp_pipeline import splits

    corpus = corpus_with_repeats(tmp_path / "raw")
    out, fresh = tmp_path / "carved", tmp_path / "fresh"
    sizes = {"test": 4, "valid": 3}
    splits.carve_corpus(corpus, "en", "de", out, sizes, seed=1)
    splits.carve_corpus(corpus, "en", "de", fresh, sizes, seed=1)
    write_lines = splits.write_lines

    def stopped_after_one(path, lines):
        write_lines(path, lines)
        raise KeyboardInterrupt

    monkeypatch.setattr(splits, "write_lines", stopped_after_one)
    try:
        splits.carve_corpus(corpus, "en", "de", out, sizes, seed=2, force=True)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(splits, "write_lines", write_lines)
    with pytest.raises(splits.DataError, match="is not what this carving writes"):
        splits.carve_corpus(corpus, "en", "de", out, sizes, seed=1)
    splits.carve_corpus(corpus, "en", "de", out, sizes, seed=1, force=True)
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            assert read(out / f"{split}.{lang}") == read(fresh / f"{split}.{lang}")


def test_a_carving_again_that_is_refused_keeps_the_earlier_one(tmp_path):
    """--force carves again only once the new carving works out: one asking for more pairs
    than the corpus has is refused and leaves the earlier carving as it was."""
    from tpp_pipeline import splits
    from tpp_pipeline.errors import DataError

    corpus = corpus_with_repeats(tmp_path / "raw")
    out = tmp_path / "carved"
    splits.carve_corpus(corpus, "en", "de", out, {"test": 4, "valid": 3}, seed=1)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with pytest.raises(DataError, match="distinct pairs left for test"):
        splits.carve_corpus(corpus, "en", "de", out, {"test": 500, "valid": 3}, force=True)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_files_in_out_that_are_not_the_carvings_are_never_replaced_without_force(tmp_path):
    """A user's files in --out (some of the outputs, or all of them) are refused, naming
    the first, and kept; the outputs of a carving made without a record (or stopped
    before it wrote its last file) are what the carving writes: kept and completed."""
    corpus = corpus_with_repeats(tmp_path / "raw")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "test.de").write_text("my own test set\n")
    refused = carve(corpus, mine, "--valid", "3", "--test", "4", check=False)
    assert refused.returncode == 2 and "test.de" in refused.stderr, refused.stderr
    assert "is not what this carving writes" in refused.stderr and "--force" in refused.stderr
    assert read(mine / "test.de") == ["my own test set"] and not (mine / "train.en").exists()
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            (mine / f"{split}.{lang}").write_text(f"{split} {lang}\n")
    refused = carve(corpus, mine, "--valid", "3", "--test", "4", check=False)
    assert refused.returncode == 2 and "is not what this carving writes" in refused.stderr
    assert read(mine / "train.en") == ["train en"]
    # a study's own folder, carved by a version before the record (perhaps otherwise): kept
    from tpp_pipeline import splits

    sizes = {"test": 4, "valid": 3}
    splits.carve_corpus(corpus, "en", "de", mine, sizes, keep_unrecorded=True)
    assert read(mine / "train.en") == ["train en"] and not (mine / ".carve-settings.json").exists()
    carve(corpus, mine, "--valid", "3", "--test", "4", "--force")
    assert len(read(mine / "test.de")) == 4

    out = tmp_path / "carved"
    carve(corpus, out, "--valid", "3", "--test", "4")
    carving = {path.name: path.read_bytes() for path in out.iterdir()}
    (out / ".carve-settings.json").unlink()  # carved before the record existed
    (out / "valid.de").unlink()  # and stopped before its last file
    carve(corpus, out, "--valid", "3", "--test", "4")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == carving
    (out / ".carve-settings.json").unlink()
    carve(corpus, out, "--valid", "3", "--test", "4")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == carving
