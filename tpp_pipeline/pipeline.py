"""Generic entry point: any parallel corpus -> ``data-bin/<name>/`` for Transformer++.

Command line: ``tpp-prepare-corpus`` (``python -m tpp_pipeline.pipeline``)::

    tpp-prepare-corpus -s en -t de --trainpref raw/train --validpref raw/valid \\
        --testpref raw/test --name my_en_de --workers 4

Steps (each skipped when already done with the same settings; see ``steps``)::

    tokenize   normalise + tokenise every split with sacremoses        work/<name>/tok/
    preclean   drop train pairs sure to fail the length filter         work/<name>/clean/
    tag        spaCy POS/NER on the source tokens (unless --no-tags)   work/<name>/tags/
    bpe_learn  joint BPE codes on train source + target                work/<name>/bpe/codes
    bpe_apply  segment all splits, project labels onto subwords        work/<name>/bpe/
    clean      length/ratio filter on the BPE train text (+ its tags)  work/<name>/final/
    binarize   fairseq-preprocess text and tags                        data-bin/<name>/

``work/<name>/final/{split}.{src,tgt,pos,ner}`` are the plain-text files that were
binarized, aligned line by line (and, for tags, token by token).
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable

from . import binarize as binarize_mod
from . import project_root
from . import bpe, cleaning, moses, tagging
from .contract import TAG_KINDS
from .errors import DataError, from_os_error
from .lock import exit_cleanly_on_sigterm, work_dir_lock
from .steps import StepLedger, file_identity, fingerprint
from .textio import atomic_open, check_same_line_count, ensure_writable_dir

log = logging.getLogger("tpp_pipeline")
SPLITS = binarize_mod.SPLITS
#: compressed forms of an input file the pipeline does not read, named where one is found
COMPRESSED = (".xz", ".gz", ".bz2", ".zst")


REPO_ROOT = str(project_root())


def _at_least(text, convert, minimum, kind):
    """``text`` as ``convert`` makes it, refused (argparse's error) below ``minimum``."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind}, not {text!r}") from None
    if not value >= minimum:  # (also NaN)
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {text.strip()}")
    return value


def positive_int(text):
    """argparse type: an integer of at least 1."""
    return _at_least(text, int, 1, "a whole number")


def non_negative_int(text):
    """argparse type: an integer of at least 0."""
    return _at_least(text, int, 0, "a whole number")


def length_ratio(text):
    """argparse type: the longest allowed length ratio of a pair's two sides, at least 1
    (the longer side over the shorter: below 1 no pair of unequal lengths is kept)."""
    return _at_least(text, float, 1, "a number")


def folder_name(text):
    """argparse type: the name of one folder (``--name``, under ``--data-bin``), never a
    path: an empty name, ``.`` or ``..`` would make ``--force`` replace ``--data-bin``
    itself or the folder above it."""
    if text in ("", ".", "..") or "/" in text or (os.altsep and os.altsep in text):
        raise argparse.ArgumentTypeError(
            f"must be the name of one folder under --data-bin (no '/', not '.' or '..'), "
            f"not {text!r}"
        )
    return text


def check_lengths(parser, args):
    """Refuses a --min-len above --max-len (every pair would be dropped)."""
    if args.min_len > args.max_len:
        parser.error(f"--min-len {args.min_len} is above --max-len {args.max_len}")


def add_pipeline_arguments(parser):
    """Options shared by the generic entry point and the WMT'14 script."""
    group = parser.add_argument_group("pipeline")
    group.add_argument("--work-dir", help="intermediate files (default: <repo>/work/<name>)")
    group.add_argument(
        "--data-bin",
        default=os.path.join(REPO_ROOT, "data-bin"),
        help="parent folder of the binarized output (default: <repo>/data-bin)",
    )
    group.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="processes for tokenisation, tagging, BPE and binarization",
    )
    group.add_argument(
        "--bpe-merges",
        type=positive_int,
        default=40000,
        help="number of joint BPE merge operations to learn (default 40000)",
    )
    group.add_argument("--bpe-codes", help="use these BPE codes instead of learning them")
    group.add_argument(
        "--dict-size",
        type=non_negative_int,
        default=None,
        help="cap the joint dictionary at this many types (--nwordssrc/tgt; 0: no cap)",
    )
    _add_tagging_arguments(group)
    _add_cleaning_arguments(group)
    group.add_argument("--stop-after", choices=STEPS, help="stop after this step")
    group.add_argument(
        "--force",
        action="store_true",
        help="redo the steps whose settings changed (and the steps after "
        "them; the others are kept) and rebuild the output folder, "
        "overwriting it",
    )
    group.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _add_tagging_arguments(group):
    """The POS/NER tagging of the source side."""
    group.add_argument(
        "--no-tags",
        action="store_true",
        help="do not tag the source (required when it is not English)",
    )
    group.add_argument(
        "--spacy-model",
        default=None,
        help="spaCy model for tagging (default: installed en_core_web_sm*)",
    )
    group.add_argument(
        "--pos-scheme",
        choices=tagging.POS_SCHEMES,
        default="upos",
        help="upos: token.pos_ (17 universal tags, default); ptb: token.tag_",
    )
    group.add_argument(
        "--tag-batch-size", type=positive_int, default=256, help="sentences per nlp.pipe batch"
    )
    group.add_argument(
        "--tag-chunk-size",
        type=positive_int,
        default=10000,
        help="lines per resumable tagging chunk",
    )
    group.add_argument(
        "--tag-shard",
        type=tagging.parse_shard,
        default=None,
        metavar="I/N",
        help="only tag shard I of N (0-based; for array jobs) and stop",
    )


def _add_cleaning_arguments(group):
    """The training pairs' filters and how invalid text is read."""
    group.add_argument("--min-len", type=positive_int, default=1, help="train: min tokens per side")
    group.add_argument(
        "--max-len", type=positive_int, default=250, help="train: max tokens per side"
    )
    group.add_argument(
        "--max-ratio",
        type=length_ratio,
        default=1.5,
        help="train: max length ratio of the two sides (at least 1)",
    )
    group.add_argument(
        "--utf8-errors",
        choices=("strict", "replace"),
        default="strict",
        help="strict: invalid UTF-8 is an error naming file and line",
    )


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tpp-prepare-corpus",
        description="Tokenise, tag (POS/NER), BPE and binarize a parallel corpus.",
        epilog="See docs/data_pipeline.md for every option and the output layout.",
    )
    parser.add_argument("--source-lang", "-s", required=True)
    parser.add_argument("--target-lang", "-t", required=True)
    parser.add_argument("--trainpref", required=True, help="train files are PREF.{src,tgt}")
    parser.add_argument("--validpref", required=True)
    parser.add_argument("--testpref", required=True)
    parser.add_argument(
        "--name", required=True, type=folder_name, help="output folder name under --data-bin"
    )
    return add_pipeline_arguments(parser)


class Layout:
    """Where each step writes, for one corpus."""

    def __init__(self, work_dir, src, tgt):
        self.work_dir, self.src, self.tgt = work_dir, src, tgt

    def path(self, stage, split, suffix):
        return os.path.join(self.work_dir, stage, f"{split}.{suffix}")

    def texts(self, stage, splits=SPLITS):
        return [self.path(stage, s, lang) for s in splits for lang in (self.src, self.tgt)]

    def tags(self, stage, splits=SPLITS):
        return [self.path(stage, s, kind) for s in splits for kind in TAG_KINDS]


def _copy(src_path, dst_path):
    with open(src_path, "rb") as src, atomic_open(dst_path, "wb") as dst:
        shutil.copyfileobj(src, dst)


# What the user knows each step setting by, for the error about changed settings.
OPTION_NAMES = {
    "inputs": "the input files",
    "utf8_errors": "--utf8-errors",
    "min": "--min-len",
    "max": "--max-len",
    "ratio": "--max-ratio",
    "model": "--spacy-model",
    "pos_scheme": "--pos-scheme",
    "chunk": "--tag-chunk-size",
    "batch": "--tag-batch-size",
    "merges": "--bpe-merges",
    "codes": "--bpe-codes",
    "tags": "tagging (--no-tags)",
    "dict_size": "--dict-size",
    "dest": "the output folder (--data-bin, --name)",
    "archives": "the archives",
}


def _has_text(path):
    """True once a line of ``path`` holds more than the tokeniser reads as space."""
    with open(path, encoding="utf-8", errors="replace", newline="\n") as handle:
        return any(moses.replace_non_printing(line).strip() for line in handle)


def check_before_running(args, prefixes, src, tgt):
    """Every check that needs no step, so that a bad input or setting is an error before
    hours of tokenising and tagging rather than after. Returns {split: {lang: raw file}}."""
    if src == tgt:
        raise DataError(
            f"source and target language are both '{src}' (-s, -t): they must "
            f"differ (each split is read from PREFIX.{src} and PREFIX.{tgt})"
        )
    tags = not args.no_tags
    if args.tag_shard and args.force:
        raise DataError(
            "--force would wipe the other shards' work; do not combine it " "with --tag-shard"
        )
    if args.tag_shard and not tags:
        raise DataError("--tag-shard makes no sense with --no-tags")
    if tags and src != "en" and not args.spacy_model:
        raise DataError(
            f"the source language is '{src}', but tagging uses an English spaCy "
            "model; pass --no-tags, or --spacy-model for a model of that language"
        )
    if tags:
        tagging.check_model(args.spacy_model)
    raw = {s: {lang: f"{prefixes[s]}.{lang}" for lang in (src, tgt)} for s in SPLITS}
    for split in SPLITS:
        for path in raw[split].values():
            if os.path.isdir(path):
                raise DataError(
                    f"is a folder, not a file: the {split} files are "
                    f"PREFIX.{src} and PREFIX.{tgt} (--{split}pref PREFIX)",
                    path,
                )
            if not os.path.isfile(path):
                packed = [f"{path}{ext}" for ext in COMPRESSED if os.path.isfile(path + ext)]
                hint = f" ({packed[0]} is there: decompress it first)" if packed else ""
                raise DataError(f"input file not found{hint}", path)
        if check_same_line_count(list(raw[split].values())) == 0:
            raise DataError(
                f"the {split} set is empty (0 lines in both files): every split "
                "needs at least one sentence pair",
                raw[split][src],
            )
        for path in raw[split].values():
            if split != "train" and not _has_text(path):  # (train: the cleaning says so)
                raise DataError(
                    f"the {split} set has only blank lines here: every split needs at "
                    "least one sentence to translate",
                    path,
                )
    for split, other in (("valid", "train"), ("test", "train"), ("test", "valid")):
        if all(os.path.samefile(raw[split][lang], raw[other][lang]) for lang in (src, tgt)):
            log.warning(
                "--%spref and --%spref name the same files (%s): the %s set is the %s set",
                split,
                other,
                raw[split][src],
                split,
                "training" if other == "train" else other,
            )
    if args.bpe_codes:
        bpe.check_codes(args.bpe_codes)
    if tags and tagging.model_language(args.spacy_model) == "en":
        share = tagging.english_share(raw["train"][src])
        if share is not None and share < tagging.ENGLISH_SHARE:
            log.warning(
                "%s does not read like English: in a typical line %.0f%% of the words are "
                "the commonest English words (English text: about 30%%), and an English "
                "model tags it. Are -s and -t swapped?",
                raw["train"][src],
                100 * share,
            )
    return raw


@dataclasses.dataclass
class Context:
    """What the steps share: the options, the raw files {split: {lang: path}} and where
    each step reads and writes."""

    args: argparse.Namespace
    raw: dict
    src: str
    tgt: str
    work_dir: str
    dest_dir: str

    def __post_init__(self):
        self.tags = not self.args.no_tags
        self.lay = Layout(self.work_dir, self.src, self.tgt)
        self.codes = os.path.join(self.work_dir, "bpe", "codes")
        self.label_sets_path = os.path.join(self.work_dir, "tags", "label_sets.json")

    @functools.cached_property
    def model(self):
        """The spaCy model that tags (only asked for when tagging)."""
        return self.args.spacy_model or tagging.default_model_name()

    @functools.cached_property
    def tag_jobs(self):
        """One tagging job per split (made when first needed: it counts the lines of the
        precleaned source)."""
        return [
            tagging.TagJob(
                self.lay.path("clean", s, self.src),
                os.path.join(self.work_dir, "tags", s),
                self.args.tag_chunk_size,
            )
            for s in SPLITS
        ]

    def train_raw(self):
        return [self.raw["train"][self.src], self.raw["train"][self.tgt]]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of :data:`PIPELINE`: its marker's ``settings`` and ``outputs`` (see
    :meth:`StepLedger.run`) and what it does, each a function of the :class:`Context`."""

    name: str
    settings: Callable[[Context], dict]
    outputs: Callable[[Context], list]
    run: Callable[[Context], None]
    wanted: Callable[[Context], bool] = lambda ctx: True  # False: skipped (tag, --no-tags)
    relocatable: tuple = ()
    redo_on_force: bool = False
    # what is removed once the step is marked done (not before: an interrupted step
    # resumes from it)
    scratch: Callable[[Context], list] = lambda ctx: []


# 1. tokenize: normalise and tokenise every split ---------------------------------------


def _tokenize_settings(ctx):
    settings = {"inputs": [file_identity(p) for s in SPLITS for p in ctx.raw[s].values()]}
    if ctx.args.utf8_errors != "strict":  # (absent by default: earlier work folders stay done)
        settings["utf8_errors"] = ctx.args.utf8_errors
    return settings


def _tokenize(ctx):
    for split in SPLITS:
        for lang, path in ctx.raw[split].items():
            log.info("tokenising %s", path)
            moses.tokenize_file(
                path, ctx.lay.path("tok", split, lang), lang, ctx.args.workers, ctx.args.utf8_errors
            )


# 2. preclean: train only, like the recipe; valid/test are kept whole --------------------


def _preclean_settings(ctx):
    # (--min-len waits for the BPE text; it stays in the record, so that the work
    # folders of earlier versions stay done)
    return {"min": ctx.args.min_len, "max": ctx.args.max_len}


def _preclean(ctx):
    lay = ctx.lay
    pre_filter = cleaning.SafePreFilter(ctx.args.max_len)
    kept, dropped = cleaning.filter_aligned(
        lay.texts("tok", ["train"]), lay.texts("clean", ["train"]), pre_filter
    )
    cleaning.require_pairs(
        kept,
        dropped,
        lay.texts("tok", ["train"]),
        pre_filter,
        ctx.train_raw(),
        "tokenisation and cleaning (empty lines, --max-len)",
    )
    for split in ("valid", "test"):
        for lang in (ctx.src, ctx.tgt):
            _copy(lay.path("tok", split, lang), lay.path("clean", split, lang))


# 3. tag: spaCy POS/NER on the source tokens, unless --no-tags ---------------------------


def _tag_model_settings(ctx):
    """The model and scheme of the tags (None without tags), as the output records them."""
    return {"model": ctx.model, "pos_scheme": ctx.args.pos_scheme} if ctx.tags else None


def _tag_settings(ctx):
    return dict(
        _tag_model_settings(ctx), chunk=ctx.args.tag_chunk_size, batch=ctx.args.tag_batch_size
    )


def _tag_outputs(ctx):
    return [o for j in ctx.tag_jobs for o in j.outputs()] + [ctx.label_sets_path]


def _tag(ctx):
    args = ctx.args
    tagging.tag_files(
        ctx.tag_jobs,
        ctx.model,
        args.pos_scheme,
        args.workers,
        args.tag_batch_size,
        force=args.force,
        progress=not args.quiet,
    )
    for job in ctx.tag_jobs:
        tagging.merge_tags(job, keep_chunks=True)  # removed once the step is marked done
    labeler = tagging.labeler(ctx.model, args.pos_scheme)
    with atomic_open(ctx.label_sets_path) as out:
        json.dump(
            {
                "label_sets": labeler.label_sets(),
                "model": labeler.model_version,
                "pos_scheme": args.pos_scheme,
            },
            out,
            indent=1,
        )


def _done_before_shards(ctx, ledger, step, upstream):
    """The stamp of ``step``, a step before tagging, which the tasks of an array job do
    not run (they would write the same files at once): it must be done already."""
    settings = step.settings(ctx)
    stamp = fingerprint({"step": step.name, "settings": settings, "upstream": upstream})
    if not ledger.is_done(step.name, stamp, settings, upstream):
        raise DataError(
            f"--tag-shard only tags, and step '{step.name}' is not done yet: run the same "
            "command without --tag-shard and with --stop-after preclean once, first",
            ctx.work_dir,
        )
    return stamp


def _tag_shard(ctx, ledger, upstream):
    """``--tag-shard``: tag one shard's chunks (unless the tag step is done) and nothing
    else; the run without it merges them."""
    args = ctx.args
    settings = _tag_settings(ctx)
    stamp = fingerprint({"step": "tag", "settings": settings, "upstream": upstream})
    if ledger.is_done("tag", stamp, settings, upstream):
        log.info("tagging already complete")
        return
    n, words, secs = tagging.tag_files(
        ctx.tag_jobs,
        ctx.model,
        args.pos_scheme,
        args.workers,
        args.tag_batch_size,
        args.tag_shard,
        progress=not args.quiet,
    )
    log.info(
        "shard %d/%d: tagged %d sentences (%d words) in %.0fs", *args.tag_shard, n, words, secs
    )


# 4. bpe_learn: joint codes on the train source and target, or --bpe-codes copied --------


def _bpe_learn_settings(ctx):
    if ctx.args.bpe_codes:
        return {"codes": file_identity(ctx.args.bpe_codes)}
    return {"merges": ctx.args.bpe_merges}


def _bpe_learn(ctx):
    if ctx.args.bpe_codes:
        _copy(ctx.args.bpe_codes, ctx.codes)
    else:
        bpe.learn_joint_bpe(
            ctx.lay.texts("clean", ["train"]),
            ctx.codes,
            ctx.args.bpe_merges,
            progress=not ctx.args.quiet,
        )


# 5. bpe_apply: segment every split, projecting the labels onto the subwords -------------


def _bpe_apply_outputs(ctx):
    return ctx.lay.texts("bpe") + (ctx.lay.tags("bpe") if ctx.tags else [])


def _bpe_apply(ctx):
    lay, workers = ctx.lay, ctx.args.workers
    for split in SPLITS:
        tag_in = [lay.path("tags", split, k) for k in TAG_KINDS] if ctx.tags else []
        tag_out = [lay.path("bpe", split, k) for k in TAG_KINDS] if ctx.tags else []
        bpe.apply_bpe(
            ctx.codes,
            lay.path("clean", split, ctx.src),
            lay.path("bpe", split, ctx.src),
            tag_in,
            tag_out,
            workers,
            TAG_KINDS,
        )
        bpe.apply_bpe(
            ctx.codes,
            lay.path("clean", split, ctx.tgt),
            lay.path("bpe", split, ctx.tgt),
            workers=workers,
        )


# 6. clean: train only, on the BPE text, carrying the tags along -------------------------


def _clean_settings(ctx):
    return {"min": ctx.args.min_len, "max": ctx.args.max_len, "ratio": ctx.args.max_ratio}


def _clean_outputs(ctx):
    return ctx.lay.texts("final") + (ctx.lay.tags("final") if ctx.tags else [])


def _clean(ctx):
    args, lay = ctx.args, ctx.lay
    kinds = list(TAG_KINDS) if ctx.tags else []
    for split in SPLITS:
        ins = [lay.path("bpe", split, x) for x in [ctx.src, ctx.tgt] + kinds]
        outs = [lay.path("final", split, x) for x in [ctx.src, ctx.tgt] + kinds]
        if split == "train":
            length_filter = cleaning.LengthFilter(args.min_len, args.max_len, args.max_ratio)
            kept, dropped = cleaning.filter_aligned(ins, outs, length_filter)
            cleaning.require_pairs(
                kept,
                dropped,
                ins[:2],
                length_filter,
                ctx.train_raw(),
                "BPE and the length/ratio filter (--min-len, --max-len, --max-ratio)",
            )
        else:
            for i, o in zip(ins, outs):
                _copy(i, o)


# 7. binarize: fairseq-preprocess the text and the tags into the output folder -----------


def _binarize_settings(ctx):
    return {"dict_size": ctx.args.dict_size, "dest": os.path.abspath(ctx.dest_dir)}


def _binarize(ctx):
    label_sets = None
    info = {
        "source_lang": ctx.src,
        "target_lang": ctx.tgt,
        "bpe": _bpe_learn_settings(ctx),
        "dict_size": ctx.args.dict_size,
        "clean": _clean_settings(ctx),
        "tags": _tag_model_settings(ctx),
    }
    if ctx.tags:
        with open(ctx.label_sets_path, encoding="utf-8") as f:
            saved = json.load(f)
        label_sets = saved["label_sets"]
        info["tags"] = dict(info["tags"], model_version=saved["model"])
    binarize_mod.binarize(
        os.path.join(ctx.work_dir, "final"),
        ctx.src,
        ctx.tgt,
        ctx.dest_dir,
        ctx.args.dict_size,
        ctx.args.workers,
        label_sets,
        info,
    )


PIPELINE = (
    Step("tokenize", _tokenize_settings, lambda ctx: ctx.lay.texts("tok"), _tokenize),
    Step("preclean", _preclean_settings, lambda ctx: ctx.lay.texts("clean"), _preclean),
    Step(
        "tag",
        _tag_settings,
        _tag_outputs,
        _tag,
        wanted=lambda ctx: ctx.tags,
        scratch=lambda ctx: [os.path.join(ctx.work_dir, "tags", f"{s}.chunks") for s in SPLITS],
    ),
    Step("bpe_learn", _bpe_learn_settings, lambda ctx: [ctx.codes], _bpe_learn),
    Step("bpe_apply", lambda ctx: {"tags": ctx.tags}, _bpe_apply_outputs, _bpe_apply),
    Step("clean", _clean_settings, _clean_outputs, _clean),
    # Where the output goes is not what it holds: another --data-bin just binarizes again
    # (nothing to overwrite, checked before); --force always rebuilds the output.
    Step(
        "binarize",
        _binarize_settings,
        lambda ctx: [ctx.dest_dir],
        _binarize,
        relocatable=("dest",),
        redo_on_force=True,
    ),
)
STEPS = tuple(step.name for step in PIPELINE)


#: the folders the steps write in the work folder (``orig``: the WMT script's downloads)
WORK_FOLDERS = ("raw", "tok", "clean", "bpe", "tags", "final", "orig", ".steps")


def check_folders_apart(work_dir, dest_dir):
    """Refuse an output folder that is or holds the work folder, or is one of the steps'
    folders in it (``final/`` say), which binarizing or ``--force`` would write over."""
    out, work = os.path.realpath(dest_dir), os.path.realpath(work_dir)
    inside = os.path.relpath(out, work).split(os.sep)[0]
    if os.path.commonpath([out, work]) == out or (
        os.path.commonpath([out, work]) == work and inside in WORK_FOLDERS
    ):
        raise DataError(
            f"the output folder and the work folder {work_dir} (--work-dir) overlap: the "
            "binarized data goes to a folder of its own (--data-bin, --name)",
            dest_dir,
        )


def run_pipeline(args, prefixes, name, src, tgt):
    """Run the steps for ``prefixes`` = {split: path prefix of raw text}: first the checks
    that need no step (:func:`check_before_running`, a writable output folder), then the
    steps; a run that will binarize holds the output folder's lock throughout."""
    work_dir = args.work_dir or os.path.join(REPO_ROOT, "work", name)
    dest_dir = os.path.join(args.data_bin, name)
    check_folders_apart(work_dir, dest_dir)
    raw = check_before_running(args, prefixes, src, tgt)
    lock = contextlib.nullcontext()
    if args.stop_after in (None, "binarize") and not args.tag_shard:
        parent = os.path.dirname(dest_dir) or "."
        ensure_writable_dir(parent, "--data-bin folder")
        lock = work_dir_lock(
            parent,
            folder=f"output folder {dest_dir}",
            lock_name=f".{os.path.basename(dest_dir)}.lock",
        )
    with lock:
        ledger = StepLedger(work_dir, force=args.force, names=OPTION_NAMES)
        last = ((ledger.saved("binarize") or {}).get("settings") or {}).get("dest")
        if os.path.exists(dest_dir) and not args.force and last != os.path.abspath(dest_dir):
            made = f"its last binarize wrote {last}" if last else "it has binarized nothing"
            raise DataError(
                f"output folder exists, and is not this work folder's ({made}); pass --force "
                "to overwrite it",
                dest_dir,
            )
        if not args.force:
            _check_tagging_unchanged(ledger, tags=not args.no_tags, shard=bool(args.tag_shard))
        ctx = Context(args, raw, src, tgt, work_dir, dest_dir)
        return _run_steps(ctx, ledger)


def _check_tagging_unchanged(ledger, tags, shard=False):
    """Refuse, before any step, a run that tags a work folder whose BPE was learned
    without tags, or the other way round: the steps are chained, so BPE and what follows
    would be refused only after tagging (hours, on WMT) without naming ``--no-tags``.
    Said only where the folder's markers show it; anything else the steps report."""
    learned = (ledger.saved("bpe_learn") or {}).get("upstream")
    if learned is None:
        return
    if learned == (ledger.saved("tag") or {}).get("stamp"):
        made = "with tags"
    elif learned == (ledger.saved("preclean") or {}).get("stamp"):
        made = "without tags (--no-tags)"
    else:
        return
    if (made == "with tags") != tags:
        how = "pass --force (without --tag-shard) to" if shard else "pass --force to"
        raise DataError(
            f"this work folder was prepared {made}, and this run asks for "
            f"{'tags' if tags else '--no-tags'}: {how} prepare it again (tagging is kept "
            "where done; BPE and the steps after it are redone), or use another --work-dir",
            ledger.marker_path("bpe_learn"),
        )


def _run_steps(ctx, ledger):
    """Run :data:`PIPELINE` in order, each step's stamp chained to the one before it, and
    stop after ``--stop-after``; return the output folder, or None if stopped early."""
    stamp = ""
    for step in PIPELINE:
        if step.wanted(ctx):
            if ctx.args.tag_shard:  # one shard of an array job: tag, and stop
                if step.name == "tag":
                    _tag_shard(ctx, ledger, stamp)
                    return None
                stamp = _done_before_shards(ctx, ledger, step, stamp)
                continue
            stamp = ledger.run(
                step.name,
                step.settings(ctx),
                step.outputs(ctx),
                functools.partial(step.run, ctx),
                stamp,
                relocatable=step.relocatable,
                redo=step.redo_on_force and ctx.args.force,
            )
            for path in step.scratch(ctx):
                shutil.rmtree(path, ignore_errors=True)
        if ctx.args.stop_after == step.name:
            break
    if step is not PIPELINE[-1]:
        return None  # stopped early (--stop-after binarize is a whole run)
    log.info("done: %s", ctx.dest_dir)
    return ctx.dest_dir


def setup_logging():
    """The pipeline's messages on stderr, ``[tpp-pipeline] ...`` (its own logger, so a
    program that runs the pipeline in-process keeps its own logging set-up)."""
    logger = logging.getLogger("tpp_pipeline")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[tpp-pipeline] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_lengths(parser, args)
    setup_logging()
    exit_cleanly_on_sigterm()
    prefixes = {"train": args.trainpref, "valid": args.validpref, "test": args.testpref}
    args.work_dir = args.work_dir or os.path.join(REPO_ROOT, "work", args.name)
    try:
        with work_dir_lock(args.work_dir, shared=bool(args.tag_shard)):
            run_pipeline(args, prefixes, args.name, args.source_lang, args.target_lang)
    except (DataError, OSError) as exc:
        return report_error(exc)
    return 0


def report_error(error):
    """Log ``error`` (a :class:`DataError`, or an ``OSError`` of the file system such as a
    full or read-only disk) as the pipeline's error and return exit status 2; any other
    ``OSError`` is raised again, with its traceback."""
    if isinstance(error, DataError):
        log.error("error: %s", error)
        return 2
    reported = from_os_error(error)
    if reported is None:
        raise error
    log.error("error: %s", reported)
    return 2


if __name__ == "__main__":
    sys.exit(main())
