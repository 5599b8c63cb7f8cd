"""Checks of a binarized split before fairseq reads it, so that a damaged or mismatched
data folder is one error naming its file rather than a traceback at some batch.

A split is ``PREFIX.idx`` (fairseq's mmap index: its sentence lengths and byte offsets)
and ``PREFIX.bin`` (the ids): the index must be whole, the ``.bin`` exactly as long as
the index says, and every id below its dictionary's size. Reading the index costs
nothing; the ids are scanned once, at memory speed.
"""

import os
import struct

import numpy as np

from tpp_pipeline.errors import UserError

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = 9 + 8 + 1 + 8
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


class DataFileError(UserError, ValueError):
    """A binarized file that is damaged or does not fit its dictionary."""


def check_binarized(prefix: str, dictionary_size: int, dictionary_path: str = "") -> None:
    """Raise :class:`DataFileError` if ``prefix.idx``/``prefix.bin`` are not whole or hold
    an id outside a dictionary of ``dictionary_size`` entries; files that do not exist are
    left to fairseq's own message."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if not (os.path.exists(idx) and os.path.exists(bin_)):
        return
    with open(idx, "rb") as handle:  # magic, version, dtype code, sentences; sizes, pointers
        header = handle.read(_HEADER)
    if len(header) < _HEADER or header[:9] != _MAGIC:
        raise DataFileError(f"{idx}: not a whole fairseq index (binarize the split again)")
    code = header[17]
    (count,) = struct.unpack("<Q", header[18:26])
    dtype = _DTYPES.get(code)
    needed = _HEADER + count * (4 + 8)
    if dtype is None or os.path.getsize(idx) < needed:
        raise DataFileError(
            f"{idx}: truncated or damaged ({os.path.getsize(idx)} bytes, its header "
            f"announces {count} sentences in {needed}); binarize the split again"
        )
    if count == 0:
        return
    sizes = np.memmap(idx, dtype=np.int32, mode="r", offset=_HEADER, shape=(count,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=_HEADER + count * 4, shape=(count,))
    expected = int(pointers[-1]) + int(sizes[-1]) * np.dtype(dtype).itemsize
    actual = os.path.getsize(bin_)
    if actual != expected:
        raise DataFileError(
            f"{bin_}: {actual} bytes, but its index {idx} describes {expected}: "
            f"{'truncated' if actual < expected else 'not the file its index was written with'}; "
            "binarize the split again"
        )
    ids = np.memmap(bin_, dtype=dtype, mode="r")
    largest = int(ids.max())
    if largest >= dictionary_size:
        where = int(np.searchsorted(pointers, np.argmax(ids) * np.dtype(dtype).itemsize, "right"))
        raise DataFileError(
            f"{bin_}: sentence {where} holds id {largest}, but its dictionary "
            f"{dictionary_path or ''} has {dictionary_size} entries: the data was binarized with "
            "another dictionary"
        )


def check_not_empty(split: str, prefix: str, sizes) -> None:
    """A split whose every sentence is empty (only its end-of-sentence) trains on
    nothing: its losses are 0 / 0."""
    if len(sizes) and int(np.max(sizes)) <= 1:
        raise DataFileError(
            f"{prefix}.bin: every sentence of the {split} split is empty ({len(sizes)} blank lines)"
        )
