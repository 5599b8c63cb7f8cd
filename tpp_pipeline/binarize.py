"""Binarization with fairseq-preprocess into the data-bin layout of the task.

Layout of ``data-bin/<name>/`` (``S``/``T`` = source/target language; the tagged part is
the data contract of :mod:`tpp_pipeline.contract`, which the task reads)::

    dict.S.txt  dict.T.txt                  joint dictionary (identical files)
    {split}.S-T.S.bin/.idx                  source BPE text, split in train/valid/test
    {split}.S-T.T.bin/.idx                  target BPE text
    dict.{kind}.txt                         label dictionary of each tag kind (pos, ner)
    {split}.S-T.{kind}.bin/.idx             one label per source BPE token (+ EOS)
    preprocess_info.json                    settings the data was made with

Each label stream is binarized by fairseq-preprocess itself, as a source-only
"language" with its fixed dictionary; it appends EOS to every label line exactly as to
the text, so label and source lengths are equal sentence by sentence (checked after
writing, with the contract's check).
"""

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys

from .contract import (
    TagAlignmentError,
    check_tag_alignment,
    label_dictionary_lines,
    label_dictionary_path,
    label_stream_prefix,
)
from .errors import FULL_DISK, DataError, full_disk_hint
from .lock import held_locks
from .textio import atomic_open, iter_lines

log = logging.getLogger("tpp_pipeline")
SPLITS = ("train", "valid", "test")


def run_fairseq_preprocess(arguments, log_path, append=False):
    """Run fairseq-preprocess of this Python environment; raise with its log on failure."""
    command = [sys.executable, "-m", "fairseq_cli.preprocess"] + [str(a) for a in arguments]
    log.info("running fairseq-preprocess %s", shlex.join(str(a) for a in arguments))
    with open(log_path, "a" if append else "w", encoding="utf-8") as handle:
        result = subprocess.run(
            command, stdout=handle, stderr=subprocess.STDOUT, pass_fds=held_locks()
        )
    if result.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            tail = "".join(handle.readlines()[-15:])
        full = any(os.strerror(code) in tail for code in FULL_DISK)
        raise DataError(
            f"fairseq-preprocess failed (exit {result.returncode}):\n{tail}"
            + (f"\n{full_disk_hint()}" if full else ""),
            log_path,
        )


def write_tag_dictionary(train_labels_path, label_set, out_path):
    """A fairseq dictionary of labels (:func:`contract.label_dictionary_lines`): counts
    from the training labels, plus every label the tagger can emit (count 0), so
    valid/test never map a label to <unk> and the dictionary does not depend on the
    corpus size."""
    lines = label_dictionary_lines((line for _, line in iter_lines(train_labels_path)), label_set)
    with atomic_open(out_path) as out:
        out.writelines(line + "\n" for line in lines)


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


def check_alignment(dest_dir, src, tgt, kinds, text_dir=None):
    """Each binarized label sentence must be exactly as long as its source sentence
    (:func:`contract.check_tag_alignment`).

    Errors name the plain-text label file and line in ``text_dir`` when it is given,
    otherwise the binarized file."""
    for split in SPLITS:
        src_sizes = _sizes(os.path.join(dest_dir, f"{split}.{src}-{tgt}.{src}"))
        for kind in kinds:
            prefix = label_stream_prefix(dest_dir, split, src, tgt, kind)
            where = os.path.join(text_dir, f"{split}.{kind}") if text_dir else prefix + ".bin"
            try:
                check_tag_alignment(split, kind, where, src_sizes, _sizes(prefix))
            except TagAlignmentError as error:
                line = error.sentence + 1 if text_dir and error.sentence is not None else None
                raise DataError(str(error), where, line) from None


def binarize_labels(text_dir, src, tgt, staging, label_sets, workers=1):
    """Binarize ``text_dir/{split}.{kind}`` for every kind of ``label_sets`` ({kind:
    labels the tagger can emit}) into ``staging`` in the contract's layout."""
    prefixes = []
    for split in SPLITS:
        prefixes += [f"--{split}pref", os.path.join(text_dir, split)]
    tag_dir = os.path.join(staging, "tags.tmp")
    os.makedirs(tag_dir)
    for number, (kind, label_set) in enumerate(label_sets.items()):
        dictionary = label_dictionary_path(tag_dir, kind)
        write_tag_dictionary(os.path.join(text_dir, f"train.{kind}"), label_set, dictionary)
        run_fairseq_preprocess(
            [
                "--only-source",
                "--source-lang",
                kind,
                *prefixes,
                "--destdir",
                tag_dir,
                "--srcdict",
                dictionary,
                "--workers",
                workers,
            ],
            os.path.join(staging, "preprocess_tags.log"),
            append=number > 0,
        )
        os.replace(dictionary, label_dictionary_path(staging, kind))
        for split in SPLITS:
            for ext in ("bin", "idx"):
                os.replace(
                    os.path.join(tag_dir, f"{split}.{kind}-None.{kind}.{ext}"),
                    f"{label_stream_prefix(staging, split, src, tgt, kind)}.{ext}",
                )
    shutil.rmtree(tag_dir)


#: the file that marks ``<dest_dir>.tmp`` as binarize's own staging folder (removed there)
STAGING_MARK = ".tpp-staging"


def binarize(text_dir, src, tgt, dest_dir, dict_size=None, workers=1, label_sets=None, info=None):
    """Binarize ``text_dir/{split}.{lang}`` (and ``{split}.{kind}`` for every tag kind
    of ``label_sets``) into ``dest_dir``.

    Everything is built in ``<dest_dir>.tmp`` and renamed into place at the end; on
    failure that staging folder is removed, and the fairseq-preprocess logs are kept in
    the work folder (the parent of ``text_dir``).
    """
    staging = dest_dir + ".tmp"
    mark = os.path.join(staging, STAGING_MARK)
    if os.path.exists(staging):  # an interrupted run's, or a folder of someone's own
        if not os.path.exists(mark):
            raise DataError(
                "exists without the mark of binarizing's staging folder (a folder of your "
                "own, or one an older version left): move it away",
                staging,
            )
        shutil.rmtree(staging)
    os.makedirs(staging)
    open(mark, "w").close()
    try:
        prefixes = []
        for split in SPLITS:
            prefixes += [f"--{split}pref", os.path.join(text_dir, split)]
        text_args = [
            "--source-lang",
            src,
            "--target-lang",
            tgt,
            *prefixes,
            "--destdir",
            staging,
            "--joined-dictionary",
            "--workers",
            workers,
        ]
        if dict_size:
            text_args += ["--nwordssrc", dict_size, "--nwordstgt", dict_size]
        run_fairseq_preprocess(text_args, os.path.join(staging, "preprocess.log"))

        if label_sets is not None:
            binarize_labels(text_dir, src, tgt, staging, label_sets, workers)
            check_alignment(staging, src, tgt, list(label_sets), text_dir)

        with atomic_open(os.path.join(staging, "preprocess_info.json")) as out:
            json.dump(info or {}, out, indent=1, sort_keys=True)
        if os.path.exists(dest_dir):
            shutil.rmtree(dest_dir)  # only reached with --force; the caller checks
        os.remove(mark)
        os.replace(staging, dest_dir)
    except BaseException as error:
        # A failed (or interrupted) binarization leaves nothing behind in data-bin; the
        # fairseq-preprocess logs move to the work folder, where the error points.
        kept = {}
        work_dir = os.path.dirname(os.path.abspath(text_dir))
        for name in ("preprocess.log", "preprocess_tags.log"):
            if os.path.exists(os.path.join(staging, name)):
                try:  # best effort: on a full disk the staging folder must still go
                    shutil.move(os.path.join(staging, name), os.path.join(work_dir, name))
                    kept[name] = os.path.join(work_dir, name)
                except OSError:
                    pass
        shutil.rmtree(staging, ignore_errors=True)
        if (
            isinstance(error, DataError)
            and error.path is not None
            and os.path.dirname(os.path.abspath(error.path)) == os.path.abspath(staging)
        ):
            raise DataError(
                error.message, kept.get(os.path.basename(error.path), error.path)
            ) from None
        raise
