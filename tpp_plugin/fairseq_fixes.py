"""Corrections to the fairseq we run on (``fairseq-fixed`` 0.12.3.1), applied when the
plugin is loaded.

**The last batch.** That build's ``fairseq.data.data_utils.batch_by_size`` drops the *last* batch whenever
its size is not a multiple of ``--required-batch-size-multiple`` (8 by default). In
training this loses a few sentences an epoch; in ``fairseq-generate`` and validation it
silently skips up to 7 sentences of every test set, so BLEU is computed on part of it.
Upstream fairseq keeps that batch. When the plugin is loaded we restore upstream's
behaviour: the batches are computed by the same compiled routines, and the remainder is
kept. A test translates a test set whose size is not a multiple of 8 and counts.

**--bf16 on GPUs.** See :func:`bf16_without_tpu`.
"""

import logging

import numpy as np
from fairseq.data import data_utils

logger = logging.getLogger(__name__)

_original_batch_by_size = data_utils.batch_by_size


def batch_by_size_keeping_remainder(
    indices,
    num_tokens_fn,
    num_tokens_vec=None,
    max_tokens=None,
    max_sentences=None,
    required_batch_size_multiple=1,
    fixed_shapes=None,
):
    """``data_utils.batch_by_size`` as upstream fairseq has it (same arguments)."""
    if fixed_shapes is not None or required_batch_size_multiple <= 1:
        return _original_batch_by_size(
            indices, num_tokens_fn, num_tokens_vec=num_tokens_vec, max_tokens=max_tokens,
            max_sentences=max_sentences, required_batch_size_multiple=required_batch_size_multiple,
            fixed_shapes=fixed_shapes,
        )
    from fairseq.data.data_utils_fast import batch_by_size_fn, batch_by_size_vec

    max_tokens = int(max_tokens) if max_tokens is not None else -1
    max_sentences = max_sentences if max_sentences is not None else -1
    if not isinstance(indices, np.ndarray):
        indices = np.fromiter(indices, dtype=np.int64, count=-1)
    if num_tokens_vec is None:
        return batch_by_size_fn(indices, num_tokens_fn, max_tokens, max_sentences, required_batch_size_multiple)
    if not isinstance(num_tokens_vec, np.ndarray):
        num_tokens_vec = np.fromiter(num_tokens_vec, dtype=np.int64, count=-1)
    return batch_by_size_vec(indices, num_tokens_vec, max_tokens, max_sentences, required_batch_size_multiple)


def keep_last_batches() -> None:
    """Install :func:`batch_by_size_keeping_remainder` (idempotent). Callers look the
    function up on the module at call time, so replacing the attribute is enough."""
    data_utils.batch_by_size = batch_by_size_keeping_remainder


# --------------------------------------------------------------------------- --bf16 on GPUs

_original_convert = None


def _xla_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


def bf16_without_tpu() -> None:
    """Let ``--bf16`` train on GPUs (and CPUs): fairseq 0.12's option parsing turns
    ``--bf16`` into ``--tpu`` as well (``options.parse_args_and_arch``: "use bfloat16;
    implies --tpu"), so on a machine without torch_xla the trainer asks XLA for a device
    and fails; fairseq's own issue #4696 asks for exactly this decoupling. Where
    torch_xla is not installed, a TPU cannot have been meant: the parsed arguments are
    corrected when they are turned into fairseq's configuration, before anything uses
    them. Installed on the conversion function itself and on the copies that
    ``fairseq_cli`` modules imported before the plugin was loaded (idempotent)."""
    global _original_convert
    import sys

    from fairseq.dataclass import utils as dataclass_utils

    if _original_convert is None:
        _original_convert = dataclass_utils.convert_namespace_to_omegaconf
    original = _original_convert

    def convert_namespace_to_omegaconf(args):
        if getattr(args, "bf16", False) and getattr(args, "tpu", False) and not _xla_available():
            args.tpu = False
            logger.info("--bf16 without torch_xla: training in bfloat16 on %s, not on a TPU",
                        "the CPU" if getattr(args, "cpu", False) else "the GPU")
        return original(args)

    convert_namespace_to_omegaconf.__doc__ = original.__doc__
    dataclass_utils.convert_namespace_to_omegaconf = convert_namespace_to_omegaconf
    for name, module in list(sys.modules.items()):
        if name.startswith("fairseq_cli.") and getattr(module, "convert_namespace_to_omegaconf", None) is original:
            module.convert_namespace_to_omegaconf = convert_namespace_to_omegaconf
