"""Length and ratio filtering of parallel training data.

The criteria are those of Moses' ``clean-corpus-n`` as used by the WMT recipes
(1 to 250 tokens per side, length ratio at most 1.5, no "word" over 1000 characters),
applied to the BPE text. Filtering drops a line from *every* aligned file at once --
source, target and the tag files -- so they can never drift apart.
"""

import logging

from .errors import DataError
from .textio import atomic_files, iter_lines

log = logging.getLogger("tpp_data")


class LengthFilter:
    """Decides whether a (source, target) pair of token lines is kept."""

    def __init__(self, min_len=1, max_len=250, ratio=1.5, max_word_len=1000):
        self.min_len = min_len
        self.max_len = max_len
        self.ratio = ratio
        self.max_word_len = max_word_len

    def keep(self, source, target):
        src, tgt = source.split(), target.split()
        for tokens in (src, tgt):
            if not self.min_len <= len(tokens) <= self.max_len:
                return False
            if self.max_word_len and any(len(t) > self.max_word_len for t in tokens):
                return False
        if self.ratio and (len(src) > self.ratio * len(tgt) or len(tgt) > self.ratio * len(src)):
            return False
        return True


class SafePreFilter(LengthFilter):
    """The part of :class:`LengthFilter` that can be decided before BPE.

    BPE never makes a line shorter, so a side that is empty or already longer than
    ``max_len`` Moses tokens is certain to be dropped by the final filter. Dropping such
    lines early saves tagging them; ratio and word-length tests must wait for the BPE
    text, where the recipe applies them.
    """

    def keep(self, source, target):
        src, tgt = len(source.split()), len(target.split())
        return self.min_len <= src <= self.max_len and self.min_len <= tgt <= self.max_len


def filter_aligned(in_paths, out_paths, length_filter):
    """Copy aligned lines of ``in_paths`` to ``out_paths`` where the filter keeps the pair.

    ``in_paths[0]`` and ``in_paths[1]`` are the source and target text that the filter
    looks at; further files (tags) are carried along line by line. Files of different
    lengths are an error naming the shorter file. Returns ``(kept, dropped)``.
    """
    kept = dropped = 0
    iterators = [iter_lines(path) for path in in_paths]
    with atomic_files(out_paths) as outs:
        while True:
            rows = [next(it, None) for it in iterators]
            if all(row is None for row in rows):
                break
            if any(row is None for row in rows):
                short = in_paths[[row is None for row in rows].index(True)]
                line = max(row[0] for row in rows if row is not None)
                raise DataError(f"file ends before its parallel files (which have line {line})",
                                short, line)
            texts = [text for _, text in rows]
            if length_filter.keep(texts[0], texts[1]):
                for out, text in zip(outs, texts):
                    out.write(text + "\n")
                kept += 1
            else:
                dropped += 1
    log.info("cleaning %s: kept %d lines, dropped %d", in_paths[0], kept, dropped)
    return kept, dropped
