"""Projection of token labels onto BPE subwords.

Every subword of a token gets that token's label, except that an entity's ``B-X`` is
kept only on the token's first piece and its further pieces get ``I-X``: a subword that
continues a word never starts a new entity, so the IOB sequence over subwords stays
well formed (``B-X`` then ``I-X``...) and reads the same as over words. ``I-X`` and ``O``
are copied unchanged.

Example::

    tokens   Schwarzenegger  visited  Stuttgart
    BPE      Schwar@@ zen@@ egger  visited  Stutt@@ gart
    NER      B-PERSON I-PERSON I-PERSON  O  B-GPE I-GPE
"""

from .errors import DataError

BPE_SEPARATOR = "@@"


def project_labels(labels, pieces_per_token, kind):
    """Labels for subwords, given one label and the number of pieces per token."""
    if len(labels) != len(pieces_per_token):
        raise ValueError(f"{len(labels)} labels for {len(pieces_per_token)} tokens")
    projected = []
    for label, pieces in zip(labels, pieces_per_token):
        projected.append(label)
        if pieces > 1:
            if kind == "ner" and label.startswith("B-"):
                label = "I-" + label[2:]
            projected.extend([label] * (pieces - 1))
    return projected


def pieces_from_bpe_markers(bpe_tokens, separator=BPE_SEPARATOR):
    """Pieces per original token, read off the ``@@`` continuation markers.

    For BPE text produced elsewhere. The pipeline itself counts pieces while it segments
    each token, which stays exact even for a token that itself ends in ``@@``.
    """
    counts, current = [], 0
    for piece in bpe_tokens:
        current += 1
        if not piece.endswith(separator):
            counts.append(current)
            current = 0
    if current:
        counts.append(current)
    return counts


def check_label_count(labels_line, bpe_line, path, line_number):
    """The invariant of every written tag line: one label per BPE token."""
    n_labels, n_tokens = len(labels_line.split()), len(bpe_line.split())
    if n_labels != n_tokens:
        raise DataError(f"{n_labels} labels for {n_tokens} BPE tokens", path, line_number)
