"""Length and ratio filtering of parallel training data.

The criteria are those of Moses' ``clean-corpus-n`` as used by the WMT recipes
(1 to 250 tokens per side, length ratio at most 1.5, no "word" over 1000 characters),
applied to the BPE text. Filtering drops a line from *every* aligned file at once --
source, target and the tag files -- so they can never drift apart.
"""

import logging

from .errors import DataError
from .textio import atomic_files, iter_lines

log = logging.getLogger("tpp_pipeline")


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
    lines early saves tagging them; the minimum length (a word can become several
    subwords), ratio and word-length tests must wait for the BPE text, where the recipe
    applies them.
    """

    def __init__(self, max_len=250):
        super().__init__(1, max_len, ratio=None)

    def keep(self, source, target):
        src, tgt = len(source.split()), len(target.split())
        return 1 <= src <= self.max_len and 1 <= tgt <= self.max_len


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
                raise DataError(
                    f"file ends before its parallel files (which have line {line})", short, line
                )
            texts = [text for _, text in rows]
            if length_filter.keep(texts[0], texts[1]):
                for out, text in zip(outs, texts):
                    out.write(text + "\n")
                kept += 1
            else:
                dropped += 1
    log.info("cleaning %s: kept %d lines, dropped %d", in_paths[0], kept, dropped)
    return kept, dropped


def drop_reasons(source_path, target_path, length_filter, names):
    """Why pairs of two aligned files fail ``length_filter``: ``{(reason, side): count}``,
    where side is the index (0 source, 1 target) into ``names`` or None for the pair."""
    reasons = {}

    def count(reason, side=None):
        reasons[(reason, side)] = reasons.get((reason, side), 0) + 1

    check_ratio = not isinstance(length_filter, SafePreFilter) and length_filter.ratio
    for (_, source), (_, target) in zip(iter_lines(source_path), iter_lines(target_path)):
        if length_filter.keep(source, target):
            continue
        lengths = [len(source.split()), len(target.split())]
        for side, tokens in enumerate(lengths):
            if tokens == 0:
                count(f"empty or whitespace only in {names[side]}", side)
            elif tokens < length_filter.min_len:
                count(f"under --min-len {length_filter.min_len} tokens in {names[side]}", side)
            elif tokens > length_filter.max_len:
                count(f"over --max-len {length_filter.max_len} tokens in {names[side]}", side)
        if all(length_filter.min_len <= n <= length_filter.max_len for n in lengths):
            if check_ratio and (
                lengths[0] > length_filter.ratio * lengths[1]
                or lengths[1] > length_filter.ratio * lengths[0]
            ):
                count(f"length ratio of the two sides over --max-ratio {length_filter.ratio}")
            else:
                count(f"a token over {length_filter.max_word_len} characters")
    return reasons


def require_pairs(kept, dropped, in_paths, length_filter, names, stage):
    """Raise :class:`DataError` when cleaning left no training pair at all (learning BPE
    on nothing fails deep inside subword-nmt): the error names the input file most to
    blame (``names``: the user's source and target files) and why every pair went."""
    if kept:
        return
    total = kept + dropped
    if total == 0:
        raise DataError(
            f"no training pairs: the training files are empty ({names[0]} and " f"{names[1]})",
            names[0],
        )
    reasons = drop_reasons(in_paths[0], in_paths[1], length_filter, names)
    per_side = [sum(n for (_, side), n in reasons.items() if side == i) for i in (0, 1)]
    culprit = names[per_side.index(max(per_side))] if max(per_side) else names[0]
    detail = "; ".join(
        f"{n} {reason}" for (reason, _), n in sorted(reasons.items(), key=lambda kv: -kv[1])
    )
    raise DataError(
        f"no usable training pairs: 0 of {total} left after {stage} " f"(dropped: {detail})",
        culprit,
    )
