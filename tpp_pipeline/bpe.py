"""Joint BPE with subword-nmt, applied together with the projection of tag labels.

One set of merges is learned on the concatenated source and target training text (as
the WMT recipes do), so a single joint dictionary covers both sides and
``--share-all-embeddings`` works. When the source has tags, the BPE of each token and
the projection of its labels happen in one pass, so the number of pieces per token is
known exactly rather than re-derived from ``@@`` markers.
"""

import collections
import contextlib
import io
import logging
import os

from .errors import DataError
from .projection import check_label_count, project_labels
from .contract import TAG_KINDS
from .textio import atomic_files, atomic_open, iter_lines
from .workers import pool_context

log = logging.getLogger("tpp_pipeline")
_LINES_PER_TASK = 2000


def learn_joint_bpe(text_paths, codes_path, merges, progress=True):
    """Learn ``merges`` BPE merge operations on the concatenation of ``text_paths``.

    The words are counted here, in this process, and handed to subword-nmt as its
    vocabulary: the codes are those of ``subword-nmt learn-bpe`` on the concatenated text
    (the same counts; it breaks ties by the pair itself) of files that end with a newline
    (a file without one does not join its last word to the next file's first), without
    a copy of the text on disk and without subword-nmt's own worker pool, which forks the
    calling process (see ``workers.py``). Without ``progress``, subword-nmt's progress
    bar is not shown.
    """
    from subword_nmt import learn_bpe as subword_nmt_learn

    counts = collections.Counter()
    for path in text_paths:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                counts.update(word for word in line.strip("\r\n ").split(" ") if word)
    vocabulary = (f"{word} {count}\n" for word, count in counts.items())
    shown = subword_nmt_learn.tqdm
    if not progress:
        subword_nmt_learn.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        with atomic_open(codes_path) as outfile:
            subword_nmt_learn.learn_bpe(vocabulary, outfile, merges, min_frequency=2, is_dict=True)
    finally:
        subword_nmt_learn.tqdm = shown


def check_codes(path):
    """Raise :class:`DataError` unless subword-nmt reads ``path`` as BPE codes (its own
    reader decides; its complaint, which it prints before exiting, becomes the message),
    so that bad ``--bpe-codes`` are an error before any step rather than after tagging."""
    from subword_nmt.apply_bpe import BPE

    if os.path.isdir(path):
        raise DataError("is a folder, not a file of BPE codes (--bpe-codes)", path)
    complaint = io.StringIO()
    try:
        with open(path, encoding="utf-8") as codes, contextlib.redirect_stderr(complaint):
            BPE(codes)
    except FileNotFoundError:
        raise DataError("BPE codes not found (--bpe-codes)", path) from None
    except OSError as error:
        raise DataError(
            f"cannot read the BPE codes (--bpe-codes): {error.strerror}", path
        ) from None
    except UnicodeDecodeError as error:
        raise DataError(
            f"not UTF-8 ({error.reason} at byte {error.start}): not a file of "
            "BPE codes (--bpe-codes)",
            path,
        ) from None
    except (SystemExit, ValueError) as error:
        said = " ".join(complaint.getvalue().split()) or str(error)
        raise DataError(
            f"not BPE codes that subword-nmt can read (--bpe-codes): {said}; "
            "give the codes file written by subword-nmt learn-bpe (or by "
            "this pipeline, work/<name>/bpe/codes)",
            path,
        ) from None


_worker_bpe = None


def _init_worker(codes_path):
    global _worker_bpe
    from subword_nmt.apply_bpe import BPE

    with open(codes_path, encoding="utf-8") as codes:
        _worker_bpe = BPE(codes)


def segment_with_labels(bpe, tokens_line, label_lines, kinds=TAG_KINDS):
    """BPE one line and project its label lines (one per tag kind of ``kinds``, in
    that order); returns (bpe_line, [projected lines])."""
    tokens = tokens_line.split()
    pieces = [bpe.segment_tokens([token]) for token in tokens]
    counts = [len(p) for p in pieces]
    projected = []
    for kind, labels in zip(kinds, label_lines):
        projected.append(" ".join(project_labels(labels.split(), counts, kind)))
    return " ".join(piece for group in pieces for piece in group), projected


def _process_block(task):
    block, kinds = task
    return [segment_with_labels(_worker_bpe, line, labels, kinds) for line, labels in block]


def _blocks(text_path, tag_paths):
    readers = [iter_lines(text_path)] + [iter_lines(p) for p in tag_paths]
    block = []
    while True:
        rows = [next(r, None) for r in readers]
        if all(row is None for row in rows):
            break
        if any(row is None for row in rows):
            short = ([text_path] + list(tag_paths))[[r is None for r in rows].index(True)]
            raise DataError(
                "has fewer lines than the files aligned with it "
                f"({text_path} and its tag files)",
                short,
            )
        number, text = rows[0]
        for path, (_, labels) in zip(tag_paths, rows[1:]):
            if len(labels.split()) != len(text.split()):
                raise DataError(
                    f"{len(labels.split())} labels for {len(text.split())} tokens "
                    f"of {text_path}",
                    path,
                    number,
                )
        block.append((text, [labels for _, labels in rows[1:]]))
        if len(block) == _LINES_PER_TASK:
            yield block
            block = []
    if block:
        yield block


def apply_bpe(
    codes_path, text_path, out_path, tag_paths=(), tag_out_paths=(), workers=1, tag_kinds=TAG_KINDS
):
    """Segment ``text_path`` into ``out_path``; project the aligned tag files if given
    (``tag_paths[i]`` holds the labels of kind ``tag_kinds[i]``).

    Every written tag line is checked to hold exactly one label per BPE token.
    """
    if len(tag_kinds) < len(tag_paths):
        raise ValueError(f"{len(tag_paths)} tag files but only the kinds {list(tag_kinds)}")
    outputs = [out_path] + list(tag_out_paths)
    kinds = tuple(tag_kinds[: len(tag_paths)])
    tasks = ((block, kinds) for block in _blocks(text_path, tag_paths))
    with atomic_files(outputs) as outs:
        if workers <= 1:
            _init_worker(codes_path)
            _write(map(_process_block, tasks), outs, tag_out_paths)
        else:
            with pool_context().Pool(
                workers, initializer=_init_worker, initargs=(codes_path,)
            ) as pool:
                _write(pool.imap(_process_block, tasks), outs, tag_out_paths)


def _write(results, outs, tag_out_paths):
    number = 0
    for block in results:
        for bpe_line, projected in block:
            number += 1
            outs[0].write(bpe_line + "\n")
            for out, path, labels in zip(outs[1:], tag_out_paths, projected):
                check_label_count(labels, bpe_line, path, number)
                out.write(labels + "\n")
