"""Punctuation normalisation and tokenisation with sacremoses.

Mirrors the classic Moses preprocessing chain of the WMT recipes -- normalise
punctuation, replace non-printing characters, tokenise with aggressive hyphen
splitting (``well @-@ known``) and XML escaping (``&amp;``, ``&apos;``...) -- so that the
BPE text looks like the data fairseq's published models were trained on.
"""

import unicodedata

from sacremoses import MosesPunctNormalizer, MosesTokenizer

from .textio import atomic_open, iter_lines
from .workers import pool_context

# Lines handed to a worker at a time: large enough to amortise inter-process traffic.
_LINES_PER_TASK = 2000


def replace_non_printing(text):
    """Replace control/format/unassigned characters (Unicode category C*) by a space.

    Besides being noise, a ``\\r`` or similar left inside a line would split it in two
    when fairseq later reads the file in universal-newline mode.
    """
    if text.isprintable():
        return text
    return "".join(" " if unicodedata.category(ch).startswith("C") else ch for ch in text)


class MosesPreprocessor:
    """Turns one raw line of language ``lang`` into space-separated Moses tokens."""

    def __init__(self, lang):
        self.normalizer = MosesPunctNormalizer(lang=lang)
        self.tokenizer = MosesTokenizer(lang=lang)

    def __call__(self, line):
        # before the normaliser, which deletes a \r inside a line (joining two words)
        text = self.normalizer.normalize(replace_non_printing(line))
        text = self.tokenizer.tokenize(
            text, aggressive_dash_splits=True, escape=True, return_str=True
        )
        # One space between tokens and none inside them: fairseq and subword-nmt split
        # on different kinds of whitespace, so only plain spaces may separate tokens.
        return " ".join(text.split())


_worker_preprocessor = None


def _init_worker(lang):
    global _worker_preprocessor
    _worker_preprocessor = MosesPreprocessor(lang)


def _preprocess_block(lines):
    return [_worker_preprocessor(line) for line in lines]


def _blocks(path, utf8_errors):
    block = []
    for _, text in iter_lines(path, utf8_errors):
        block.append(text)
        if len(block) == _LINES_PER_TASK:
            yield block
            block = []
    if block:
        yield block


def tokenize_file(in_path, out_path, lang, workers=1, utf8_errors="strict"):
    """Normalise and tokenise ``in_path`` into ``out_path`` (same number of lines)."""
    with atomic_open(out_path) as out:
        if workers <= 1:
            _init_worker(lang)
            for block in _blocks(in_path, utf8_errors):
                out.writelines(line + "\n" for line in _preprocess_block(block))
            return
        with pool_context().Pool(workers, initializer=_init_worker, initargs=(lang,)) as pool:
            for block in pool.imap(_preprocess_block, _blocks(in_path, utf8_errors)):
                out.writelines(line + "\n" for line in block)
