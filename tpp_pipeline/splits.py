"""Carve held-out valid and test sets out of a parallel corpus that ships none.

Corpora such as software-translation catalogues repeat themselves: the same message
appears in many packages, with small variations of case or spacing. A test pair whose
source or target also occurs in training measures memory, not translation. So:

1. pairs are drawn in a seeded random order (the same order for the same seed and
   corpus); a pair is taken for test (then valid) unless its source or its target,
   *normalised* (control and format characters as spaces, as the tokeniser reads them;
   Unicode NFKC, case-folded, whitespace collapsed), was already taken;
2. training keeps every remaining pair whose normalised source *and* target occur in
   neither held-out set — a pair sharing one side with a held-out pair is dropped
   from training, not kept.

The result: no held-out source equals a training source, no held-out target equals a
training target, and the held-out sets are disjoint from each other, all under the
normalisation. Inputs may be xz-compressed (``.xz``).

Command line: ``tpp-carve-splits`` (``python -m tpp_pipeline.splits``)::

    tpp-carve-splits --corpus ../corpora/en-de/train -s en -t de \\
        --valid 1000 --test 2000 --out work/study/raw

writes ``work/study/raw/{train,valid,test}.{en,de}``.
"""

import argparse
import json
import lzma
import os
import random
import re
import sys
import unicodedata
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from .download import sha256_of
from .errors import DataError, from_os_error, report
from .moses import replace_non_printing
from .textio import atomic_open, count_lines

_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """The key two segments are duplicates under: control and format characters (a BOM,
    a zero-width space) as spaces, as the pipeline's tokeniser reads them; NFKC,
    case-folded, single spaces."""
    text = unicodedata.normalize("NFKC", replace_non_printing(text))
    return _SPACE.sub(" ", text.casefold()).strip()


def open_bytes(path: Path):
    """A file's bytes, xz-decompressed when its name ends in ``.xz``."""
    if str(path).endswith(".xz"):
        return lzma.open(path, "rb")
    return open(path, "rb")


def read_side(path: Path) -> List[str]:
    """The lines of ``path`` split on ``\n`` only (the segments may contain other
    Unicode line separators); a last line without newline counts."""
    try:
        with open_bytes(path) as handle:
            data = handle.read()
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        bad = data[exc.start : exc.start + 1]
        raise DataError(f"invalid UTF-8 byte {bad!r} at column {column}", path, line) from None
    except (lzma.LZMAError, EOFError) as exc:
        raise DataError(f"not a valid xz file ({exc})", path) from None
    except OSError as exc:
        raise DataError(f"cannot read it ({exc.strerror})", path) from None
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def side_path(prefix: str, lang: str) -> Path:
    """``PREFIX.lang``, or ``PREFIX.lang.xz`` if only that exists."""
    plain = Path(f"{prefix}.{lang}")
    packed = Path(f"{prefix}.{lang}.xz")
    for path in (plain, packed):
        if path.is_dir():
            raise DataError(
                f"is a folder, not a file: --corpus PREFIX reads the files "
                f"PREFIX.{lang} (or PREFIX.{lang}.xz), one sentence per line",
                path,
            )
    if plain.exists():
        return plain
    if packed.exists():
        return packed
    raise DataError(f"missing (looked for {plain} and {packed})", plain)


def carve(
    sources: Sequence[str],
    targets: Sequence[str],
    sizes: Dict[str, int],
    seed: int = 1,
    reserved: Sequence[Tuple[str, str]] = (),
) -> Dict[str, List[int]]:
    """Indices of the pairs of each held-out set (in ``sizes``' order of names) and
    of ``"train"``. Pairs with an empty side are never held out. ``reserved`` pairs
    (held-out sets given from elsewhere) are treated as already taken: nothing carved
    and nothing kept for training shares a side with them."""
    order = list(range(len(sources)))
    random.Random(seed).shuffle(order)
    taken_src = {normalise(src) for src, _ in reserved}
    taken_tgt = {normalise(tgt) for _, tgt in reserved}
    splits: Dict[str, List[int]] = {name: [] for name in sizes}
    names = iter(sizes)
    current = next(names, None)
    while current is not None and sizes[current] <= 0:  # nothing to hold out for it
        current = next(names, None)
    for index in order:
        if current is None:
            break
        src, tgt = normalise(sources[index]), normalise(targets[index])
        if not src or not tgt or src in taken_src or tgt in taken_tgt:
            continue
        taken_src.add(src)
        taken_tgt.add(tgt)
        splits[current].append(index)
        while current is not None and len(splits[current]) >= sizes[current]:
            current = next(names, None)
    for name, wanted in sizes.items():
        if len(splits[name]) < wanted:
            raise DataError(
                f"only {len(splits[name])} distinct pairs left for {name} ({wanted} asked)"
            )
    splits["train"] = [
        i
        for i in range(len(sources))
        if normalise(sources[i]) not in taken_src and normalise(targets[i]) not in taken_tgt
    ]
    for name in sizes:
        splits[name].sort()
    return splits


def write_lines(path: Path, lines: Sequence[str]) -> None:
    """Write ``lines`` under a temporary name, then rename."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"cannot create the output folder ({exc.strerror}): choose an --out "
            "you can write to",
            exc.filename or path.parent,
        ) from None
    with atomic_open(path) as handle:
        for line in lines:
            handle.write(line + "\n")


def read_pairs(prefix: str, src_lang: str, tgt_lang: str) -> Tuple[List[str], List[str]]:
    """Both sides of ``PREFIX.{src,tgt}[.xz]``, checked to be line-aligned."""
    src_path, tgt_path = side_path(prefix, src_lang), side_path(prefix, tgt_lang)
    sources, targets = read_side(src_path), read_side(tgt_path)
    if len(sources) != len(targets):
        raise DataError(f"{len(sources)} lines, but {tgt_path} has {len(targets)}", src_path)
    return sources, targets


def carve_corpus(
    prefix: str,
    src_lang: str,
    tgt_lang: str,
    out_dir: Path,
    sizes: Dict[str, int],
    seed: int = 1,
    force: bool = False,
    given: Dict[str, str] = None,
    keep_unrecorded: bool = False,
) -> Dict[str, Tuple[Path, Path]]:
    """Read ``PREFIX.{src,tgt}[.xz]``, carve the held-out sets, write
    ``out_dir/{train,<held-out names>}.{src,tgt}``. ``given`` held-out sets (name ->
    prefix, e.g. your own test set) are copied as they are and reserved: training
    keeps no pair sharing a side with them. Returns the written files per split.
    Existing outputs are kept (the carving is deterministic) unless ``force``; made
    from another corpus or with other settings (:data:`SETTINGS` records them), or
    other than this carving makes them, they are an error without ``force``.
    ``keep_unrecorded``: a complete set without a record is kept as it is (a folder the
    caller made itself, carved by a version before the record, perhaps differently)."""
    out_dir = Path(out_dir)
    given = dict(given or {})
    outputs = _outputs(prefix, src_lang, tgt_lang, out_dir, sizes, given)
    record = out_dir / SETTINGS
    every = [p for pair in outputs.values() for p in pair]
    existing = [p for p in every if p.exists()]
    if not force and keep_unrecorded and len(existing) == len(every) and not record.exists():
        return outputs
    settings = None
    if not force and record.exists() and existing:
        complete = len(existing) == len(every)
        settings = _check_record(record, prefix, src_lang, tgt_lang, sizes, seed, given, complete)
        if complete:
            return outputs
    if settings is None:  # (the corpus's checksums, once)
        settings = carving_settings(prefix, src_lang, tgt_lang, sizes, seed, given)
    carved = _carved_files(prefix, src_lang, tgt_lang, sizes, seed, given, outputs)
    if not force and existing:
        # no record, or an interrupted carving: outputs are kept only where they are
        # exactly what this carving writes (an earlier one's, or its first files)
        for path in existing:
            if path.read_bytes() != "".join(line + "\n" for line in carved[path]).encode():
                raise DataError(
                    "exists and is not what this carving writes (not carved here, or with "
                    "other settings or an older version): use --force to replace it, or "
                    "another --out",
                    path,
                )
        if len(existing) == len(every):
            _write_record(record, settings)
            return outputs
    # an interrupted carving must not leave old and new splits that look like one carving
    # (removed once the new one is known to work out, so that a refused one keeps them)
    if out_dir.is_dir():
        for path in [record, *(p for pair in outputs.values() for p in pair)]:
            path.unlink(missing_ok=True)
    for path, lines in carved.items():
        write_lines(path, lines)
    _write_record(record, settings)
    return outputs


def _outputs(prefix, src_lang, tgt_lang, out_dir, sizes, given) -> Dict[str, Tuple[Path, Path]]:
    """The files a carving writes, per split; an error where the request is wrong (a
    negative size, one language twice, an output that is one of the inputs)."""
    for name, size in sizes.items():
        if size < 0:
            raise DataError(f"--{name} must be 0 or more pairs, not {size}")
    if src_lang == tgt_lang:
        raise DataError(
            f"source and target language are both '{src_lang}' (-s, -t): they must differ, "
            "as they name the files"
        )
    names = ["train", *sizes, *given]
    outputs = {
        name: (out_dir / f"{name}.{src_lang}", out_dir / f"{name}.{tgt_lang}") for name in names
    }
    inputs = [
        Path(f"{read_from}.{lang}{xz}")
        for read_from in (prefix, *given.values())
        for lang in (src_lang, tgt_lang)
        for xz in ("", ".xz")
    ]
    for path in (p for pair in outputs.values() for p in pair):
        # (by name: a corpus read from PREFIX.en.xz would be read from PREFIX.en once written)
        if any(
            os.path.realpath(path) == os.path.realpath(i)
            or (path.is_file() and i.is_file() and os.path.samefile(path, i))
            for i in inputs
        ):
            raise DataError(
                "is an input of the carving, and --out would write over it: choose another --out",
                path,
            )
    return outputs


def _write_record(record: Path, settings: dict) -> None:
    with atomic_open(record) as handle:
        json.dump(settings, handle, indent=1, sort_keys=True)


def _check_record(record, prefix, src_lang, tgt_lang, sizes, seed, given, complete):
    """This carving's :func:`carving_settings`; an error naming what changed where
    :data:`SETTINGS` records another. A corpus that is gone leaves nothing to compare a
    ``complete`` carving with: it is kept (None)."""
    try:
        settings = carving_settings(prefix, src_lang, tgt_lang, sizes, seed, given)
    except DataError:
        if complete:
            return None
        raise
    made = recorded_settings(record)
    if made != settings:
        changed = ", ".join(
            f"{key} {made.get(key)} -> {value}"
            for key, value in settings.items()
            if made.get(key) != value
        )
        raise DataError(
            f"carved before with other settings ({changed}): use --force to carve again, "
            "or another --out",
            record,
        )
    return settings


def _carved_files(prefix, src_lang, tgt_lang, sizes, seed, given, outputs):
    """Output path -> its lines: the given held-out sets as they are, the others carved."""
    sources, targets = read_pairs(prefix, src_lang, tgt_lang)
    if not sources:
        raise DataError("holds no pairs: nothing to carve", side_path(prefix, src_lang))
    held = {
        name: read_pairs(held_prefix, src_lang, tgt_lang) for name, held_prefix in given.items()
    }
    reserved = [pair for held_src, held_tgt in held.values() for pair in zip(held_src, held_tgt)]
    try:
        splits = carve(sources, targets, sizes, seed=seed, reserved=reserved)
    except DataError as err:  # (too few distinct pairs: in this corpus)
        raise DataError(err.message, side_path(prefix, src_lang)) from None
    carved = {}
    for name, (held_src, held_tgt) in held.items():
        carved[outputs[name][0]], carved[outputs[name][1]] = held_src, held_tgt
    for name in ["train", *sizes]:
        carved[outputs[name][0]] = [sources[i] for i in splits[name]]
        carved[outputs[name][1]] = [targets[i] for i in splits[name]]
    return carved


#: the file in ``--out`` that records what a carving was made from and with
SETTINGS = ".carve-settings.json"


def carving_settings(prefix, src_lang, tgt_lang, sizes, seed, given) -> Dict[str, object]:
    """What a carving depends on: the corpus's content (each side's SHA-256, wherever it
    lies: a corpus moved or copied is the same corpus), the held-out sizes, the seed and
    the content of the held-out sets given."""

    def content(held_prefix) -> Dict[str, str]:
        return {lang: sha256_of(side_path(held_prefix, lang)) for lang in (src_lang, tgt_lang)}

    held = {name: content(held_prefix) for name, held_prefix in given.items()}
    return {"corpus": content(prefix), "sizes": dict(sizes), "seed": seed, "given": held}


def recorded_settings(record: Path) -> Dict[str, object]:
    """:func:`carving_settings` as :data:`SETTINGS` recorded them (empty if unreadable)."""
    try:
        made = json.loads(record.read_text(encoding="utf-8"))
    except ValueError:
        return {}
    return made if isinstance(made, dict) else {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpp-carve-splits",
        description="Carve valid and test sets out of a parallel corpus that ships none, "
        "deduplicated against training on both sides.",
        epilog="Example: tpp-carve-splits --corpus corpora/en-de/train -s en -t de "
        "--valid 1000 --test 2000 --out work/study/raw (inputs may be .xz); writes "
        "OUT/{train,valid,test}.{src,tgt}.",
    )
    parser.add_argument("--corpus", required=True, help="PREFIX of PREFIX.{src,tgt}[.xz]")
    parser.add_argument("-s", "--source-lang", required=True)
    parser.add_argument("-t", "--target-lang", required=True)
    parser.add_argument("--valid", type=int, default=1000, help="valid pairs (default 1000)")
    parser.add_argument("--test", type=int, default=2000, help="test pairs (default 2000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--force", action="store_true", help="carve again over existing outputs")
    args = parser.parse_args(argv)
    try:
        outputs = carve_corpus(
            args.corpus,
            args.source_lang,
            args.target_lang,
            args.out,
            {"test": args.test, "valid": args.valid},
            seed=args.seed,
            force=args.force,
        )
    except (DataError, OSError) as err:
        reported = err if isinstance(err, DataError) else from_os_error(err, folders="--out")
        if reported is None:
            raise
        return report("tpp-carve-splits", reported)
    for name, (src, _) in outputs.items():
        count = count_lines(src)
        print(
            f"{name}: {count} pairs -> {src.with_suffix('')}.{{{args.source_lang},{args.target_lang}}}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
