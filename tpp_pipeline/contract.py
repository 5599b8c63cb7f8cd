"""The data contract between the preparation pipeline and the ``translation_with_tags``
task: what a tagged data folder holds, and how it is checked.

A tagged data folder is a fairseq translation folder plus, for each tag kind ``k``::

    dict.{k}.txt                          the label dictionary (fairseq's format)
    {split}.{src}-{tgt}.{k}.bin / .idx    one label per source subword, end-of-sentence
                                          slot included, as fairseq binarizes text

The pipeline writes this layout, the task reads it, and both check it with
:func:`check_tag_alignment`. Tag kinds are data: any names work; the pipeline's tagger
produces :data:`TAG_KINDS`. This module imports neither spaCy nor fairseq.
"""

import collections
import os
from typing import Iterable, Mapping, Sequence

from .errors import OptionError, UserError

#: the label streams the pipeline's tagger produces (POS, then NER)
TAG_KINDS = ("pos", "ner")


class TagAlignmentError(UserError, ValueError):
    """A label stream does not line up with the source sentences. ``sentence`` is the
    first misaligned sentence (0-based), None when the numbers of sentences differ. A
    command (fairseq's too, with the plugin) reports it as one line."""

    def __init__(self, message, sentence=None):
        super().__init__(message)
        self.sentence = sentence


def label_dictionary_path(data_dir: str, kind: str) -> str:
    """``DATA/dict.{kind}.txt``."""
    return os.path.join(data_dir, f"dict.{kind}.txt")


def label_stream_prefix(data_dir: str, split: str, src: str, tgt: str, kind: str) -> str:
    """``DATA/{split}.{src}-{tgt}.{kind}`` (fairseq appends ``.bin`` / ``.idx``)."""
    return os.path.join(data_dir, f"{split}.{src}-{tgt}.{kind}")


def parse_tag_kinds(value: str) -> list:
    """``--tags``: ``"pos,ner"`` -> ``["pos", "ner"]``; empty for none; a repeated name is
    an error."""
    names = [t for t in (value or "").replace(" ", "").split(",") if t]
    if len(set(names)) != len(names):
        raise OptionError(f"--tags: a tag kind is listed twice in {value!r}")
    return names


def check_tag_alignment(
    split: str, kind: str, where: str, src_sizes: Sequence[int], tag_sizes: Sequence[int]
) -> None:
    """Raise :class:`TagAlignmentError` unless every sentence has exactly as many labels
    as source tokens. Sizes count the end-of-sentence slot on both sides; the message
    names the split, the first misaligned sentence (0-based) and both lengths without
    that slot, as a user counts tokens in the text files, and ``where`` (a file)."""
    import numpy as np

    if len(src_sizes) != len(tag_sizes):
        raise TagAlignmentError(
            f"{split}: {kind} labels ({where}) have {len(tag_sizes)} sentences, "
            f"the source has {len(src_sizes)}"
        )
    bad = np.flatnonzero(np.asarray(src_sizes) != np.asarray(tag_sizes))
    if len(bad):
        i = int(bad[0])
        raise TagAlignmentError(
            f"{split}: sentence {i} (0-based: line {i + 1} of the text) has "
            f"{int(tag_sizes[i]) - 1} {kind} labels for "
            f"{int(src_sizes[i]) - 1} source tokens ({where}; {len(bad)} misaligned "
            f"sentence(s) in this split)",
            sentence=i,
        )


def label_dictionary_lines(train_label_lines: Iterable[str], label_set: Iterable[str] = ()) -> list:
    """The lines of a label dictionary: each label with its count in the training
    labels, plus every label of ``label_set`` (the labels the tagger can emit) with
    count 0, so that valid and test never map a label to ``<unk>`` and the dictionary
    does not depend on the corpus; most frequent first, ties by name."""
    counts = collections.Counter()
    for line in train_label_lines:
        counts.update(line.split())
    for label in label_set:
        counts.setdefault(label, 0)
    return [
        f"{label} {count}"
        for label, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


def describe_layout(
    src: str, tgt: str, kinds: Sequence[str] = TAG_KINDS, splits: Mapping[str, str] = None
) -> str:
    """The expected files, for error messages and documentation."""
    lines = [f"dict.{kind}.txt" for kind in kinds]
    for split in splits or ("train", "valid", "test"):
        lines += [f"{split}.{src}-{tgt}.{kind}.bin/.idx" for kind in kinds]
    return ", ".join(lines)
