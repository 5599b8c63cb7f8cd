"""Binarization with fairseq-preprocess into the data-bin layout of the task.

Layout of ``data-bin/<name>/`` (``S``/``T`` = source/target language)::

    dict.S.txt  dict.T.txt                  joint dictionary (identical files)
    {split}.S-T.S.bin/.idx                  source BPE text, split in train/valid/test
    {split}.S-T.T.bin/.idx                  target BPE text
    dict.pos.txt  dict.ner.txt              tag dictionaries (unless --no-tags)
    {split}.S-T.pos.bin/.idx                one POS label per source BPE token (+ EOS)
    {split}.S-T.ner.bin/.idx                one NER label per source BPE token (+ EOS)
    preprocess_info.json                    settings the data was made with

Tags are binarized by fairseq-preprocess itself, treating POS as a "source" and NER as a
"target" language with fixed dictionaries; it appends EOS to every label line exactly
as to the text, so tag and source lengths are equal sentence by sentence (checked
after writing).
"""

import collections
import json
import logging
import os
import shutil
import subprocess
import sys

from .errors import DataError
from .tagging import TAG_KINDS
from .textio import atomic_open, iter_lines

log = logging.getLogger("tpp_pipeline")
SPLITS = ("train", "valid", "test")


def run_fairseq_preprocess(arguments, log_path):
    """Run fairseq-preprocess of this Python environment; raise with its log on failure."""
    command = [sys.executable, "-m", "fairseq_cli.preprocess"] + [str(a) for a in arguments]
    log.info("running fairseq-preprocess %s", " ".join(str(a) for a in arguments))
    with open(log_path, "w", encoding="utf-8") as handle:
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            tail = "".join(handle.readlines()[-15:])
        raise DataError(f"fairseq-preprocess failed (exit {result.returncode}):\n{tail}",
                        log_path)


def write_tag_dictionary(train_labels_path, label_set, out_path):
    """A fairseq dictionary of labels: counts from training data, plus every label the
    tagger can emit (count 0), so valid/test never map a label to <unk> and the
    dictionary does not depend on the corpus size."""
    counts = collections.Counter()
    for _, line in iter_lines(train_labels_path):
        counts.update(line.split())
    for label in label_set:
        counts.setdefault(label, 0)
    with atomic_open(out_path) as out:
        for label, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            out.write(f"{label} {count}\n")


def _sizes(prefix):
    """Sentence lengths of a binarized dataset, as fairseq's reader sees them."""
    import numpy

    logging.getLogger("fairseq").setLevel(logging.WARNING)  # quiet import-time notices
    from fairseq.data import indexed_dataset

    dataset = indexed_dataset.MMapIndexedDataset(prefix)
    # Copy: the array views a memory map that closes with the dataset.
    sizes = numpy.array(dataset.sizes, copy=True)
    del dataset
    return sizes


def check_tag_alignment(dest_dir, src, tgt, text_dir=None):
    """Each binarized tag sentence must be exactly as long as its source sentence.

    Errors name the plain-text tag file (and line) in ``text_dir`` when it is given,
    otherwise the binarized file."""
    for split in SPLITS:
        src_sizes = _sizes(os.path.join(dest_dir, f"{split}.{src}-{tgt}.{src}"))
        for kind in TAG_KINDS:
            prefix = os.path.join(dest_dir, f"{split}.{src}-{tgt}.{kind}")
            where = os.path.join(text_dir, f"{split}.{kind}") if text_dir else prefix + ".bin"
            tag_sizes = _sizes(prefix)
            if len(tag_sizes) != len(src_sizes):
                raise DataError(f"{len(tag_sizes)} {kind} sentences for {len(src_sizes)} "
                                "source sentences", where)
            bad = (tag_sizes != src_sizes).nonzero()[0]
            if len(bad):
                raise DataError(f"{tag_sizes[bad[0]] - 1} {kind} labels for "
                                f"{src_sizes[bad[0]] - 1} source tokens (sentence {bad[0]})",
                                where, bad[0] + 1 if text_dir else None)


def binarize(text_dir, src, tgt, dest_dir, dict_size=None, workers=1, label_sets=None,
             info=None):
    """Binarize ``text_dir/{split}.{lang}`` (and ``.pos``/``.ner``) into ``dest_dir``.

    Everything is built in ``<dest_dir>.tmp`` and renamed into place at the end; on
    failure that staging folder is removed, and the fairseq-preprocess logs are kept in
    the work folder (the parent of ``text_dir``).
    """
    staging = dest_dir + ".tmp"
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    try:
        prefixes = []
        for split in SPLITS:
            prefixes += [f"--{split}pref", os.path.join(text_dir, split)]
        text_args = ["--source-lang", src, "--target-lang", tgt, *prefixes,
                     "--destdir", staging, "--joined-dictionary", "--workers", workers]
        if dict_size:
            text_args += ["--nwordssrc", dict_size, "--nwordstgt", dict_size]
        run_fairseq_preprocess(text_args, os.path.join(staging, "preprocess.log"))

        if label_sets is not None:
            tag_dir = os.path.join(staging, "tags.tmp")
            os.makedirs(tag_dir)
            for kind in TAG_KINDS:
                write_tag_dictionary(os.path.join(text_dir, f"train.{kind}"), label_sets[kind],
                                     os.path.join(tag_dir, f"dict.{kind}.txt"))
            pos, ner = TAG_KINDS
            # POS plays the "source" and NER the "target" language: one call binarizes both.
            run_fairseq_preprocess(
                ["--source-lang", pos, "--target-lang", ner, *prefixes, "--destdir", tag_dir,
                 "--srcdict", os.path.join(tag_dir, f"dict.{pos}.txt"),
                 "--tgtdict", os.path.join(tag_dir, f"dict.{ner}.txt"), "--workers", workers],
                os.path.join(staging, "preprocess_tags.log"))
            for kind in TAG_KINDS:
                os.replace(os.path.join(tag_dir, f"dict.{kind}.txt"),
                           os.path.join(staging, f"dict.{kind}.txt"))
                for split in SPLITS:
                    for ext in ("bin", "idx"):
                        os.replace(os.path.join(tag_dir, f"{split}.{pos}-{ner}.{kind}.{ext}"),
                                   os.path.join(staging, f"{split}.{src}-{tgt}.{kind}.{ext}"))
            shutil.rmtree(tag_dir)
            check_tag_alignment(staging, src, tgt, text_dir)

        with atomic_open(os.path.join(staging, "preprocess_info.json")) as out:
            json.dump(info or {}, out, indent=1, sort_keys=True)
        if os.path.exists(dest_dir):
            shutil.rmtree(dest_dir)  # only reached with --force; the caller checks
        os.replace(staging, dest_dir)
    except BaseException as error:
        # A failed (or interrupted) binarization leaves nothing behind in data-bin; the
        # fairseq-preprocess logs move to the work folder, where the error points.
        kept = {}
        work_dir = os.path.dirname(os.path.abspath(text_dir))
        for name in ("preprocess.log", "preprocess_tags.log"):
            if os.path.exists(os.path.join(staging, name)):
                kept[name] = os.path.join(work_dir, name)
                shutil.move(os.path.join(staging, name), kept[name])
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, DataError) and error.path is not None and \
                os.path.dirname(os.path.abspath(error.path)) == os.path.abspath(staging):
            raise DataError(error.message, kept.get(os.path.basename(error.path))) from None
        raise
