"""Corrections of the fairseq and torch the plugin runs on, always applied, and its
one-line errors, switchable (:data:`tpp_fairseq.CHECKS`); each described, with the
failure it answers, in docs/fairseq_notes.md; those of fairseq's epoch iterators are
:mod:`.epochs`'.

- **Safe loading of fairseq checkpoints** (torch >= 2.6 loads with ``weights_only=True``):
  exactly the types fairseq checkpoints hold are allow-listed; all else is still refused.
- **The last batch**, which fairseq-fixed 0.12.3.1 drops when its size is not a multiple
  of ``--required-batch-size-multiple``: kept, as upstream fairseq keeps it.
- **--bf16 without XLA** (fairseq issue #4696: ``--bf16`` implies ``--tpu``): untied.
- **Data-parallel ranks that end without leaving their process group**: it is destroyed
  once ``distributed_main`` has finished.
- **``--no-repeat-ngram-size`` without fairseq's CUDA extension** (fairseq issue #4709):
  the fallback is given the generated prefix, not the padded token buffer.
- **``--diverse-beam-groups``**: the groups' overlap looked up by position in the batch,
  not by dataset id (an ``IndexError`` from the second batch on).
- **``--score-reference`` of left-padded targets** (``--left-pad-target``): each
  reference read from its first token, not from the padding.
- **``--log-file``**, to which fairseq added a handler for every progress bar (every
  line written once per epoch so far): one handler per file.
- **Debug logging switched on by ``import fairseq``**: the root level goes back to
  ``$LOGLEVEL`` (default INFO), unless the program asked for DEBUG before.
- **One-line errors**: a :class:`~tpp_fairseq.errors.UserError`, or a write the disk
  refused (full, over quota, read-only), that reaches the top of a command is printed as
  ``<command>: error: <message>``, without a traceback; a checkpoint fairseq left
  half-written is removed.
"""

import argparse
import importlib.util
import inspect
import logging
import os
import sys

import numpy as np
import torch
from fairseq.data import data_utils
from fairseq.distributed import utils as distributed_utils
from fairseq.dataclass import utils as dataclass_utils

from . import errors
from ._log import log_once as _log_once, logger

# --------------------------------------------------------------------------- safe loading


def _numpy_globals():
    """The numpy callables and classes that pickled numpy scalars/arrays refer to."""
    found = [np.ndarray, np.dtype]
    # Array reconstruction lives in numpy.core (numpy 1.x) or numpy._core (numpy 2.x);
    # pickles written by either version name their own module, so allow both spellings.
    for module_name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            module = __import__(module_name, fromlist=["_reconstruct", "scalar"])
        except ImportError:
            continue
        for name in ("_reconstruct", "scalar"):
            obj = getattr(module, name, None)
            if obj is not None:
                found.append((obj, f"{module_name}.{name}"))
    # scalar types such as numpy.float64 that appear as metric values
    names = ("float16", "float32", "float64", "bool_")
    names += tuple(f"{kind}{bits}" for kind in ("int", "uint") for bits in (8, 16, 32, 64))
    scalars = [getattr(np, name) for name in names]
    found += scalars
    # their dtypes' classes (numpy >= 1.25 pickles a dtype as numpy.dtypes.Float64DType...);
    # no other dtype: an object array's would unpickle whatever objects it holds
    if getattr(np, "dtypes", None) is not None:
        found += [type(np.dtype(scalar)) for scalar in scalars]
    return found


def _broadcast_globals():
    """What a checkpoint's state sent between ranks refers to: a data-parallel resume
    sends it from rank 0 to the others through ``torch.save``/``torch.load``
    (``_broadcast_object_slow``), its tensors apart and ``_TensorPlaceholder`` in their
    place, its ``cfg`` an omegaconf ``DictConfig`` (``load_checkpoint_to_cpu`` makes
    one). Configuration containers and their plain value nodes only: no resolver, no
    callable."""
    import collections
    import typing

    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode

    return [
        _TensorPlaceholder,  # where each tensor was, the tensors being sent apart
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        AnyNode,
        typing.Any,
        dict,
        list,
        int,
        collections.defaultdict,
    ]


def allow_fairseq_checkpoints() -> None:
    """Allow-list what fairseq checkpoints contain for ``weights_only`` loading."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is None:  # torch < 2.4 loads everything anyway
        return
    allowed = [argparse.Namespace] + _numpy_globals() + _broadcast_globals()
    add(allowed)
    logger.debug(
        "safe loading: allow-listed argparse.Namespace, numpy and omegaconf types (%d)",
        len(allowed) - 1,
    )


# --------------------------------------------------------------------------- the last batch

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
    """``data_utils.batch_by_size`` as fairseq's 0.12.2 release has it, the last batch
    kept (same arguments)."""
    if fixed_shapes is not None or required_batch_size_multiple <= 1:
        return _original_batch_by_size(
            indices,
            num_tokens_fn,
            num_tokens_vec=num_tokens_vec,
            max_tokens=max_tokens,
            max_sentences=max_sentences,
            required_batch_size_multiple=required_batch_size_multiple,
            fixed_shapes=fixed_shapes,
        )
    from fairseq.data.data_utils_fast import batch_by_size_fn, batch_by_size_vec

    max_tokens = int(max_tokens) if max_tokens is not None else -1
    max_sentences = max_sentences if max_sentences is not None else -1
    if not isinstance(indices, np.ndarray):
        indices = np.fromiter(indices, dtype=np.int64, count=-1)
    if num_tokens_vec is None:
        batches = batch_by_size_fn(
            indices, num_tokens_fn, max_tokens, max_sentences, required_batch_size_multiple
        )
    else:
        if not isinstance(num_tokens_vec, np.ndarray):
            num_tokens_vec = np.fromiter(num_tokens_vec, dtype=np.int64, count=-1)
        batches = batch_by_size_vec(
            indices, num_tokens_vec, max_tokens, max_sentences, required_batch_size_multiple
        )
    if batches and len(batches[-1]) % required_batch_size_multiple:
        _log_once(
            "last_batch",
            "kept a last batch of %d sentence(s) that fairseq-fixed 0.12.3.1 drops "
            "(not a multiple of --required-batch-size-multiple %d)",
            len(batches[-1]),
            required_batch_size_multiple,
        )
    return batches


def keep_last_batches() -> None:
    """Install :func:`batch_by_size_keeping_remainder` (idempotent). Callers look the
    function up on the module at call time, so replacing the attribute is enough."""
    data_utils.batch_by_size = batch_by_size_keeping_remainder


# --------------------------------------------------------------------------- --bf16 on GPUs

_original_convert = dataclass_utils.convert_namespace_to_omegaconf


def _xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def convert_namespace_to_omegaconf(args):
    if getattr(args, "bf16", False) and getattr(args, "tpu", False) and not _xla_available():
        args.tpu = False
        if hasattr(args, "beam"):  # fairseq-generate, fairseq-interactive
            _log_once(
                "bf16",
                "--bf16 without torch_xla: not on a TPU; fairseq 0.12 decodes in float32 with "
                "--bf16 (it converts the model for --fp16 only)",
            )
        else:
            _log_once(
                "bf16",
                "--bf16 without torch_xla: training in bfloat16 on %s, not on a TPU",
                "the CPU" if getattr(args, "cpu", False) else "the GPU",
            )
    return _original_convert(args)


convert_namespace_to_omegaconf.__doc__ = _original_convert.__doc__


def bf16_without_tpu() -> None:
    """Install the corrected conversion on fairseq's module and on the copies that
    ``fairseq_cli`` modules imported before the plugin was loaded (idempotent), the one
    run as ``python -m fairseq_cli.train`` included: it is ``__main__`` there."""
    dataclass_utils.convert_namespace_to_omegaconf = convert_namespace_to_omegaconf
    for name, module in list(sys.modules.items()):
        if name == "__main__":
            name = getattr(getattr(module, "__spec__", None), "name", None) or name
        if (
            name.startswith("fairseq_cli.")
            and getattr(module, "convert_namespace_to_omegaconf", None) is _original_convert
        ):
            module.convert_namespace_to_omegaconf = convert_namespace_to_omegaconf


# --------------------------------------------------------------------------- data-parallel exit

_original_distributed_main = distributed_utils.distributed_main


def distributed_main(i, main, cfg, kwargs):
    """fairseq's ``distributed_main``, then the process group destroyed, as PyTorch asks
    of every process (fairseq ends with a barrier and never destroys it; NCCL warns at
    exit). Not after an error: a rank that failed leaves the group as fairseq does."""
    _original_distributed_main(i, main, cfg, kwargs)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def leave_process_groups() -> None:
    """Install :func:`distributed_main` (idempotent): ``call_main`` looks it up on the
    module when it runs (and pickles it by name to processes it spawns)."""
    distributed_utils.distributed_main = distributed_main


# --------------------------------------------------------------------------- n-gram blocking


def block_ngrams_of_the_prefix() -> None:
    """fairseq's ``NGramRepeatBlock`` without its CUDA extension reads the last
    ``n - 1`` tokens of what it is given as the n-gram to block; beam search gives it
    the whole buffer, whose last columns are padding until the last step. Its fallback
    gets the generated prefix, ``tokens[:, : step + 1]`` (idempotent)."""
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    if getattr(NGramRepeatBlock.forward, "_tpp_prefix", False):
        return
    original = NGramRepeatBlock.forward

    def forward(self, tokens, lprobs, bsz: int, beam_size: int, step: int):
        if not self.use_extension and tokens.size(1) > step + 1:
            _log_once(
                "ngram_block",
                "--no-repeat-ngram-size without fairseq's CUDA extension: its fallback given "
                "the generated prefix, not the padded buffer (fairseq issue #4709)",
            )
            tokens = tokens[:, : step + 1]
        return original(self, tokens, lprobs, bsz, beam_size, step)

    forward._tpp_prefix = True
    NGramRepeatBlock.forward = forward


def diverse_beam_search_by_position() -> None:
    """fairseq's ``DiverseBeamSearch`` makes its groups' overlap a tensor of the first
    step's batch and indexes it, at later steps, with ``sample["id"]`` (dataset ids, cut
    to the sentences still searched). It is given each sentence's position in the first
    step's batch instead (idempotent)."""
    from fairseq.search import DiverseBeamSearch

    if getattr(DiverseBeamSearch.step, "_tpp_positions", False):
        return
    original = DiverseBeamSearch.step

    def step(self, step: int, lprobs, scores, prev_output_tokens=None, original_batch_idxs=None):
        if original_batch_idxs is not None:
            if step == 0:
                self._tpp_first_ids = original_batch_idxs
                positions = torch.arange(len(original_batch_idxs), device=lprobs.device)
            else:  # (dataset ids are unique within a batch)
                first = self._tpp_first_ids.to(original_batch_idxs.device)
                positions = (original_batch_idxs[:, None] == first[None, :]).int().argmax(1)
            original_batch_idxs = positions
        return original(self, step, lprobs, scores, prev_output_tokens, original_batch_idxs)

    step._tpp_positions = True
    DiverseBeamSearch.step = step


def score_left_padded_references() -> None:
    """fairseq's ``SequenceScorer`` (``--score-reference``) reads each reference from
    position 0 of the target, or from ``sample["start_indices"]``: with
    ``--left-pad-target`` it scored the padding. A sample without start indices is
    given the position of each target's first token (0 where right-padded; idempotent)."""
    from fairseq.sequence_scorer import SequenceScorer

    if getattr(SequenceScorer.generate, "_tpp_starts", False):
        return
    original = SequenceScorer.generate

    def generate(self, models, sample, **kwargs):
        target = sample.get("target")
        if target is not None and "start_indices" not in sample:
            starts = (target != self.pad).int().argmax(1)  # (the first token, not padding)
            if starts.any():
                sample = {**sample, "start_indices": starts.tolist()}
        return original(self, models, sample, **kwargs)

    generate._tpp_starts = True
    SequenceScorer.generate = generate


# --------------------------------------------------------------------------- logging


def undo_debug_logging_of_fairseq_import(root_level_before_fairseq=None) -> None:
    """The root logger back from DEBUG to ``$LOGLEVEL`` (default INFO) unless DEBUG was
    asked for: by ``$LOGLEVEL``, or by the program before fairseq was imported
    (``root_level_before_fairseq``, None where that is not known)."""
    root = logging.getLogger()
    if root_level_before_fairseq == logging.DEBUG:
        return
    wanted = os.environ.get("LOGLEVEL", "INFO").upper()
    if (
        root.level == logging.DEBUG
        and isinstance(logging.getLevelName(wanted), int)
        and wanted != "DEBUG"
    ):
        root.setLevel(wanted)


def one_handler_per_log_file() -> None:
    """fairseq's ``progress_bar`` adds a handler for ``--log-file`` to its logger every
    time a bar is made (every epoch, every validation), so every line went to the file
    once per bar made so far. The file is given a handler once (idempotent)."""
    from fairseq.logging import progress_bar as bars

    if getattr(bars.progress_bar, "_tpp_once", False):
        return
    original = bars.progress_bar
    signature = inspect.signature(original)

    def progress_bar(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        log_file = bound.arguments.get("log_file")
        if log_file is not None and any(
            getattr(handler, "baseFilename", None) == os.path.abspath(log_file)
            for handler in bars.logger.handlers
        ):
            bound.arguments["log_file"] = None  # (its handler is there already)
        return original(*bound.args, **bound.kwargs)

    progress_bar._tpp_once = True
    progress_bar.__doc__ = original.__doc__
    bars.progress_bar = progress_bar


# --------------------------------------------------------------------------- one-line errors


def one_line_errors() -> None:
    """Install :func:`tpp_fairseq.errors.excepthook` (idempotent)."""
    errors.install_excepthook()
