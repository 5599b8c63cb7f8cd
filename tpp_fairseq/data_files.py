"""Checks of a binarized split before fairseq reads it, so that a damaged or mismatched
data folder is one error naming its file rather than a traceback at some batch.

A split is ``PREFIX.idx`` (fairseq's mmap index: its sentence lengths and byte offsets)
and ``PREFIX.bin`` (the ids): the index must be whole, the ``.bin`` exactly as long as
the index says, and every id below its dictionary's size. Reading the index costs
nothing; the ids are scanned once, at memory speed. :func:`check_every_data_file` has
every fairseq task check what it loads with a dictionary (the ``data-files`` check).
"""

import functools
import itertools
import os
import struct

import numpy as np

from tpp_pipeline.errors import UserError

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = 9 + 8 + 1 + 8
#: fairseq's dtype codes (``indexed_dataset._code_to_dtype``; uint32 from 65,500 types)
_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.double,
    8: np.uint16,
    9: np.uint32,
    10: np.uint64,
}
#: the indexes of fairseq's other formats ("lazy", "cached", "huffman"), not checked here
_OTHER_MAGICS = (b"TNTIDX\x00\x00", b"HUFFIDX\x00")


class DataFileError(UserError, ValueError):
    """A binarized file that is damaged or does not fit its dictionary."""


def check_binarized(prefix: str, dictionary_size: int, dictionary_path: str = "") -> None:
    """Raise :class:`DataFileError` if ``prefix.idx``/``prefix.bin`` are not whole or hold
    an id outside a dictionary of ``dictionary_size`` entries; files that do not exist are
    left to fairseq's own message. Files found whole are not read again unless changed."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    try:
        files = tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in map(os.stat, (idx, bin_)))
    except OSError:
        return
    _check_files(idx, bin_, files, dictionary_size, dictionary_path)


@functools.lru_cache(maxsize=256)
def _check_files(idx, bin_, files, dictionary_size, dictionary_path) -> None:
    """:func:`check_binarized` of files whose (inode, size, mtime) are ``files``."""
    with open(idx, "rb") as handle:  # magic, version, dtype code, sentences; sizes, pointers
        header = handle.read(_HEADER)
    if header.startswith(_OTHER_MAGICS):
        return
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
    if not np.issubdtype(dtype, np.integer):  # (not ids)
        return
    largest = int(ids.max())
    if largest >= dictionary_size:
        byte = np.argmax(ids) * np.dtype(dtype).itemsize
        where = (
            int(np.searchsorted(pointers, byte, "right")) - 1
        )  # the sentence starting at or before it
        raise DataFileError(
            f"{bin_}: sentence {where} (0-based) holds id {largest}, but its dictionary "
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


def _bad_dictionary_line(path):
    """(number, text) of the first line of a fairseq dictionary that is not ``<token>
    <count> [#fairseq:overwrite]``, or None."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            fields = line.rstrip().rsplit(" ", 1)
            if len(fields) == 2 and fields[1] == "#fairseq:overwrite":
                fields = fields[0].rsplit(" ", 1)
            try:
                int(fields[1])
            except (IndexError, ValueError):
                return number, line.rstrip("\n")
    return None


def check_every_data_file() -> None:
    """Check each binarized file a fairseq task loads with its dictionary (every shard),
    before fairseq reads it, and name the file and line of a dictionary fairseq cannot
    read (idempotent)."""
    from fairseq.data import data_utils
    from fairseq.data.dictionary import Dictionary

    if getattr(data_utils.load_indexed_dataset, "checks_data_files", False):
        return
    add_from_file = Dictionary.add_from_file

    @functools.wraps(add_from_file)
    def add_from_named_file(self, f):
        try:
            return add_from_file(self, f)
        except (ValueError, RuntimeError) as error:  # a malformed or a duplicate line
            if not isinstance(f, str):
                raise
            bad = _bad_dictionary_line(f)
            where = f"line {bad[0]} ({bad[1]!r}) is not '<token> <count>'" if bad else error
            raise DataFileError(f"{f}: {where}: not a fairseq dictionary") from None
        except Exception as error:  # fairseq's for a file that is not UTF-8
            if isinstance(f, str) and "Incorrect encoding" in str(error):
                raise DataFileError(f"{f}: not UTF-8 text: not a fairseq dictionary") from None
            raise

    Dictionary.add_from_file = add_from_named_file
    original = data_utils.load_indexed_dataset

    @functools.wraps(original)
    def load_indexed_dataset(
        path, dictionary=None, dataset_impl=None, combine=False, default="cached"
    ):
        if dictionary is not None and dataset_impl in (None, "mmap"):
            for k in itertools.count():  # the shards fairseq combines: PATH, PATH1, PATH2...
                prefix = path + (str(k) if k > 0 else "")
                if (k > 0 and not combine) or not os.path.exists(prefix + ".idx"):
                    break
                name = os.path.basename(path)  # SPLIT.SRC-TGT.LANG: dict.LANG.txt
                where = f"dict.{name.rsplit('.', 1)[-1]}.txt" if "." in name else "dict.txt"
                check_binarized(prefix, len(dictionary), os.path.join(os.path.dirname(path), where))
        return original(path, dictionary, dataset_impl, combine, default)

    load_indexed_dataset.checks_data_files = True
    data_utils.load_indexed_dataset = load_indexed_dataset
