"""WMT'14 English-German and English-French, as in fairseq's WMT recipes.

Command line: ``tpp-prepare-wmt14`` (``python -m tpp_pipeline.wmt14``)::

    tpp-prepare-wmt14 --pair en-de --workers 8
    tpp-prepare-wmt14 --pair en-de --raw-dir /data/wmt14-archives --workers 8
    tpp-prepare-wmt14 --pair en-fr --list-files

Training corpora (the WMT'14 releases; 4.5M pairs for En-De, ~36M for En-Fr)::

    En-De  Europarl v7, CommonCrawl, News Commentary v9
    En-Fr  Europarl v7, CommonCrawl, UN (undoc.2000), News Commentary v9, 10^9 (giga-fren)

valid = newstest2013 (``dev.tgz``), test = newstest2014 "full" (``test-full.tgz``),
both read from their SGM files. The raw text is extracted to ``work/<name>/raw/`` and
handed to the generic pipeline (``pipeline.run_pipeline``).

Run with ``--raw-dir DIR`` on machines without internet: DIR must hold the archives
listed by ``--list-files`` under exactly those names (download them elsewhere).
"""

import argparse
import gzip
import logging
import os
import re
import shutil
import sys

from . import download as download_mod
from . import pipeline
from .errors import DataError
from .lock import exit_cleanly_on_sigterm, work_dir_lock
from .steps import StepLedger, file_identity
from .textio import atomic_files, atomic_open, ensure_writable_dir

log = logging.getLogger("tpp_pipeline")

ARCHIVE_URLS = {
    "training-parallel-europarl-v7.tgz": "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
    "training-parallel-commoncrawl.tgz": "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
    "training-parallel-nc-v9.tgz": "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
    "training-parallel-un.tgz": "http://statmt.org/wmt13/training-parallel-un.tgz",
    "training-giga-fren.tar": "http://statmt.org/wmt10/training-giga-fren.tar",
    "dev.tgz": "http://statmt.org/wmt14/dev.tgz",
    "test-full.tgz": "http://statmt.org/wmt14/test-full.tgz",
}

# (archive, member path without the ".<lang>" suffix, members gzipped inside the archive)
TRAIN_CORPORA = {
    "en-de": [
        ("training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en", False),
        ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en", False),
        ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.de-en", False),
    ],
    "en-fr": [
        ("training-parallel-europarl-v7.tgz", "training/europarl-v7.fr-en", False),
        ("training-parallel-commoncrawl.tgz", "commoncrawl.fr-en", False),
        ("training-parallel-un.tgz", "un/undoc.2000.fr-en", False),
        ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.fr-en", False),
        ("training-giga-fren.tar", "giga-fren.release2.fixed", True),
    ],
}
# SGM files: {split: (archive, name pattern with {src}/{tgt}/{pair} and {side}.{lang})}
TEST_SETS = {
    "valid": ("dev.tgz", "dev/newstest2013-{side}.{lang}.sgm"),
    "test": ("test-full.tgz", "test-full/newstest2014-{pair}-{side}.{lang}.sgm"),
}
DEFAULT_DICT_SIZE = {"en-de": 32768, "en-fr": None}

_SEG = re.compile(r"<seg[^>]*>\s*(.*?)\s*</seg>")


def expected_archives(pair):
    names = [archive for archive, _, _ in TRAIN_CORPORA[pair]]
    return names + [archive for archive, _ in TEST_SETS.values()]


def expected_members(pair):
    """``{archive: [member paths]}`` that the extraction reads, for the docs/--list-files."""
    src, tgt = pair.split("-")
    members = {}
    for archive, stem, gz in TRAIN_CORPORA[pair]:
        members.setdefault(archive, []).extend(
            f"{stem}.{lang}" + (".gz" if gz else "") for lang in (tgt, src)
        )
    for archive, pattern in TEST_SETS.values():
        members.setdefault(archive, []).extend(
            _sgm_name(pattern, pair, side, lang) for side, lang in (("src", src), ("ref", tgt))
        )
    return members


def _sgm_name(pattern, pair, side, lang):
    src, tgt = pair.split("-")
    return pattern.format(side=side, lang=lang, pair=f"{tgt}{src}")


def _normalised(name):
    return name[2:] if name.startswith("./") else name


def _read_members(archive_path, wanted):
    """``{member: bytes}`` for small wanted members (test sets) of a tar archive."""
    found = {}
    try:
        with download_mod.open_tar_stream(archive_path) as archive:
            for member in archive:
                name = _normalised(member.name)
                if name in wanted and member.isfile():
                    found[name] = archive.extractfile(member).read()
    except (*download_mod.ARCHIVE_ERRORS, OSError) as exc:
        raise DataError(f"cannot read archive ({exc})", archive_path) from None
    missing = [m for m in wanted if m not in found]
    if missing:
        raise DataError(f"archive lacks {', '.join(missing)}", archive_path)
    return found


def _stream_member_lines(handle, where, utf8_errors):
    """Decoded lines of one archive member, streamed (corpora are gigabytes)."""
    if where.endswith(".gz"):
        handle = gzip.GzipFile(fileobj=handle)
    for number, raw in enumerate(handle, start=1):
        raw = raw.rstrip(b"\n").rstrip(b"\r")
        try:
            yield raw.decode("utf-8", errors=utf8_errors)
        except UnicodeDecodeError:
            raise DataError(
                "invalid UTF-8 (pass --utf8-errors replace to substitute U+FFFD)", where, number
            ) from None


def _extract_parallel_members(archive_path, names, part_paths, utf8_errors):
    """Stream the members ``names`` (one per language) to ``part_paths``; return counts.

    The archive is read to its end even after the members (the gzip checksum is there)."""
    counts = {}
    try:
        with download_mod.open_tar_stream(archive_path) as archive:
            for member in archive:
                name = _normalised(member.name)
                if name not in names or not member.isfile():
                    continue
                where = f"{archive_path}:{name}"
                with atomic_open(part_paths[name]) as out:
                    count = 0
                    for line in _stream_member_lines(
                        archive.extractfile(member), where, utf8_errors
                    ):
                        out.write(line + "\n")
                        count += 1
                counts[name] = count
                if len(counts) == len(names):
                    break
    except (*download_mod.ARCHIVE_ERRORS, OSError) as exc:
        raise DataError(f"cannot read archive ({exc})", archive_path) from None
    missing = [n for n in names if n not in counts]
    if missing:
        raise DataError(f"archive lacks {', '.join(missing)}", archive_path)
    return counts


def _sgm_segments(data, where, utf8_errors="strict"):
    """The text of each ``<seg>`` of an SGM file, in order."""
    segments = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8", errors=utf8_errors)
        except UnicodeDecodeError:
            raise DataError(
                "invalid UTF-8 (pass --utf8-errors replace to substitute U+FFFD)", where, number
            ) from None
        if "<seg" in line:
            found = [match.group(1) for match in _SEG.finditer(line)]
            if len(found) != line.count("<seg"):
                raise DataError("malformed <seg> line", where, number)
            segments.extend(found)
    if not segments:
        raise DataError("no <seg> lines found", where)
    return segments


def extract_train(pair, raw_dir, out_dir, utf8_errors="strict"):
    """Concatenate the training corpora of ``pair`` into ``out_dir/train.{src,tgt}``."""
    src, tgt = pair.split("-")
    parts_dir = os.path.join(out_dir, "parts")
    outputs = [os.path.join(out_dir, f"train.{lang}") for lang in (src, tgt)]
    with atomic_files(outputs) as outs:
        for archive, stem, gz in TRAIN_CORPORA[pair]:
            path = os.path.join(raw_dir, archive)
            names = [f"{stem}.{lang}" + (".gz" if gz else "") for lang in (src, tgt)]
            parts = {n: os.path.join(parts_dir, os.path.basename(n)) for n in names}
            counts = _extract_parallel_members(path, names, parts, utf8_errors)
            if counts[names[0]] != counts[names[1]]:
                raise DataError(
                    f"{counts[names[0]]} lines in {names[0]} but "
                    f"{counts[names[1]]} in {names[1]}",
                    path,
                )
            log.info("%s: %d sentence pairs", path, counts[names[0]])
            for name, out in zip(names, outs):
                with open(parts[name], encoding="utf-8", newline="\n") as part:
                    shutil.copyfileobj(part, out)
                os.remove(parts[name])
    os.rmdir(parts_dir)
    return outputs


def extract_test_sets(pair, raw_dir, out_dir, utf8_errors="strict"):
    """newstest2013 -> ``valid.{src,tgt}``, newstest2014 -> ``test.{src,tgt}``."""
    src, tgt = pair.split("-")
    outputs = []
    for split, (archive, pattern) in TEST_SETS.items():
        path = os.path.join(raw_dir, archive)
        names = {
            lang: _sgm_name(pattern, pair, side, lang)
            for side, lang in (("src", src), ("ref", tgt))
        }
        data = _read_members(path, list(names.values()))
        segments = {
            lang: _sgm_segments(data[names[lang]], f"{path}:{names[lang]}", utf8_errors)
            for lang in (src, tgt)
        }
        if len(segments[src]) != len(segments[tgt]):
            raise DataError(
                f"{len(segments[src])} segments in {names[src]} but "
                f"{len(segments[tgt])} in {names[tgt]}",
                path,
            )
        paths = [os.path.join(out_dir, f"{split}.{lang}") for lang in (src, tgt)]
        with atomic_files(paths) as outs:
            for lang, out in zip((src, tgt), outs):
                out.writelines(seg + "\n" for seg in segments[lang])
        outputs += paths
    return outputs


def obtain_archives(pair, raw_dir=None, download_dir=None):
    """Folder holding all archives: ``raw_dir`` as given (checked), or downloaded ones."""
    names = expected_archives(pair)
    if raw_dir:
        missing = [n for n in names if not os.path.isfile(os.path.join(raw_dir, n))]
        if missing:
            listing = "\n".join(f"  {n}  <- {ARCHIVE_URLS[n]}" for n in missing)
            raise DataError(
                f"missing archives for WMT'14 {pair}; expected these files "
                f"(download them from the URLs shown):\n{listing}",
                raw_dir,
            )
        return raw_dir
    if not all(os.path.exists(os.path.join(download_dir, n + ".sha256")) for n in names):
        ensure_writable_dir(download_dir, "--download-dir folder")  # before any download
    hint = (
        "without internet, download the archives elsewhere and pass their folder with "
        "--raw-dir (see --list-files)"
    )
    for name in names:
        download_mod.download(ARCHIVE_URLS[name], os.path.join(download_dir, name), hint=hint)
    return download_dir


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tpp-prepare-wmt14",
        description="Download (or read) WMT'14 En-De/En-Fr and prepare data-bin/<name>/.",
        epilog="See docs/data_pipeline.md.",
    )
    parser.add_argument("--pair", choices=sorted(TRAIN_CORPORA), required=True)
    parser.add_argument(
        "--name",
        type=pipeline.folder_name,
        help="output name (default: wmt14_en_de / wmt14_en_fr)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--raw-dir",
        help="folder with the archives already downloaded " "(no network access); see --list-files",
    )
    source.add_argument(
        "--download-dir", help="where to download the archives " "(default: <work-dir>/orig)"
    )
    parser.add_argument(
        "--list-files",
        action="store_true",
        help="print the archives (and members) --raw-dir must hold, and exit",
    )
    pipeline.add_pipeline_arguments(parser)
    parser.set_defaults(dict_size=-1)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    pipeline.check_lengths(parser, args)
    pipeline.setup_logging()
    if args.list_files:
        lines = []
        for archive, members in expected_members(args.pair).items():
            lines += [f"{archive}\t{ARCHIVE_URLS[archive]}"] + [f"    {m}" for m in members]
        try:
            print("\n".join(lines), flush=True)
        except BrokenPipeError:  # (| head): the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    src, tgt = args.pair.split("-")
    name = args.name or f"wmt14_{src}_{tgt}"
    if args.dict_size == -1:
        args.dict_size = DEFAULT_DICT_SIZE[args.pair]
    work_dir = args.work_dir or os.path.join(pipeline.REPO_ROOT, "work", name)
    args.work_dir = work_dir
    raw_out = os.path.join(work_dir, "raw")
    exit_cleanly_on_sigterm()
    try:
        pipeline.check_folders_apart(
            work_dir, os.path.join(args.data_bin, name)
        )  # before downloading
        with work_dir_lock(work_dir, shared=bool(args.tag_shard)):
            _prepare(args, name, src, tgt, work_dir, raw_out)
    except (DataError, OSError) as exc:
        return pipeline.report_error(exc)
    return 0


def _prepare(args, name, src, tgt, work_dir, raw_out):
    """Archives -> raw text -> the generic pipeline (under the work folder's lock).

    A ``--tag-shard`` run (one of several at once, sharing the lock) neither downloads nor
    extracts, which would write the same files as the others: it reads the raw text a
    run without ``--tag-shard`` extracted before."""
    ledger = StepLedger(work_dir, force=args.force, names=pipeline.OPTION_NAMES)
    outputs = [os.path.join(raw_out, f"{s}.{lang}") for s in pipeline.SPLITS for lang in (src, tgt)]
    if args.tag_shard:
        done = ledger.saved("extract")
        if done is None or not all(os.path.exists(p) for p in done.get("outputs", [])):
            raise DataError(
                "--tag-shard only tags, and step 'extract' is not done yet: run the same "
                "command without --tag-shard and with --stop-after preclean once, first",
                work_dir,
            )
    else:
        archives = obtain_archives(
            args.pair, args.raw_dir, args.download_dir or os.path.join(work_dir, "orig")
        )
        names = expected_archives(args.pair)
        identities = [file_identity(os.path.join(archives, n)) for n in names]

        def extract():
            extract_train(args.pair, archives, raw_out, args.utf8_errors)
            extract_test_sets(args.pair, archives, raw_out, args.utf8_errors)

        ledger.run("extract", {"archives": identities}, outputs, extract)
    # The pipeline keeps its own markers; --force was applied by the ledger above.
    prefixes = {s: os.path.join(raw_out, s) for s in pipeline.SPLITS}
    pipeline.run_pipeline(args, prefixes, name, src, tgt)


if __name__ == "__main__":
    sys.exit(main())
