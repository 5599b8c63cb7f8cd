"""Everything the plugin changes in the fairseq and torch it runs on, in one place.

Applied by :func:`apply` when the plugin is imported (fairseq's tools import
``--user-dir`` before they parse the rest of the command line, build a model or load a
checkpoint). Each change logs once, at the first moment it actually changes something.

1. **Safe loading of fairseq checkpoints** (torch >= 2.6 loads with
   ``weights_only=True``). fairseq checkpoints hold the training arguments (an
   ``argparse.Namespace``) and, with ``--eval-bleu`` or a numeric best-checkpoint
   metric, numpy scalars and arrays. Exactly those types are allow-listed; everything
   else in a checkpoint is still refused by torch's safe unpickler. Safe loading
   stays on.
2. **The last batch** (``fairseq-fixed`` 0.12.3.1). Its
   ``fairseq.data.data_utils.batch_by_size`` drops the last batch whenever its size is
   not a multiple of ``--required-batch-size-multiple`` (8 by default): in
   ``fairseq-generate`` and validation up to 7 sentences of every test set are never
   translated and BLEU is computed on the rest. Upstream fairseq keeps that batch; so
   do we, with the same compiled routines.
3. **--bf16 on GPUs** (fairseq 0.12). Option parsing turns ``--bf16`` into ``--tpu``
   as well ("use bfloat16; implies --tpu"), so without torch_xla the trainer asks XLA
   for a device and fails (fairseq issue #4696). Where torch_xla is not installed a
   TPU cannot have been meant: the parsed arguments are corrected when fairseq turns
   them into its configuration, before anything uses them.
4. **Debug logging switched on by an import** (fairseq 0.12).
   ``fairseq.models.wav2vec.wav2vec2_classification`` calls
   ``logging.basicConfig(level=logging.DEBUG)`` when ``import fairseq`` loads it. In
   fairseq's own commands that call is too late to matter (they configure logging
   first); in any other program that imports fairseq (ours, a notebook) the root
   logger ends up at DEBUG and every library's debug messages are printed — thousands
   of matplotlib font-cache lines in a plot. The root level is put back where
   fairseq's commands put it: ``$LOGLEVEL``, else INFO. ``LOGLEVEL=DEBUG`` still
   gives everything, and so does a DEBUG level the program set itself before it
   imported the plugin (or fairseq through it); where fairseq was imported first, the
   two cannot be told apart and ``$LOGLEVEL`` decides.
5. **--bf16's float32 master copy, flat, on GPUs** (fairseq 0.12). With ``--fp16``,
   ``FP16Optimizer`` keeps the float32 master copy of the parameters (and their
   gradients) as one flat tensor, so that Adam's update and the gradient norm are a
   few operations on one tensor; with ``--bf16`` it keeps one tensor per parameter
   ("faster on TPUs without flat grads"), and every step runs the optimizer's and the
   norm's operations once per parameter: on a GPU, hundreds of small kernels per step
   (in a profile of the big preset's bf16 step on an H100, 30 ms of Adam and 13 ms of
   the gradient norm in a 161-ms step, for fairseq's ``transformer`` as much as for
   ours). With the parameters on one CUDA device, ``--bf16`` now keeps it flat as
   ``--fp16`` does, where fairseq's ``--fp16`` would: no ``--fp16-no-flatten-grads``
   (which keeps it per parameter, as before), no ``--zero-sharding``, an optimizer that
   supports flat parameters (else per parameter, as before). On the CPU it stays per
   parameter: there the flat step measured 1.8x slower (Adam, norm and copies of a
   d = 512 model, one thread: 272 against 148 ms for ``transformer``), the sums being
   bound by memory rather than by launches. The arithmetic is the same, element by
   element. Checkpoints written with either layout resume with the other (a GPU run
   resumed on the CPU, or with ``--fp16-no-flatten-grads``): the optimizer's state is
   concatenated or split to match, by the parameters' order and sizes (an optimizer
   state that is not one value or one tensor of the parameter's size per parameter
   cannot be, and is an error that names ``--reset-optimizer``). A flat state whose size
   is not the master copy's (the parameters changed since the checkpoint) is the same
   error, at load rather than at the first step.
6. **The flat master copy's syncs** (fairseq 0.12, ``--fp16`` and the flat ``--bf16``).
   ``FP16Optimizer`` copies the gradients into the flat float32 copy and the updated
   values back with one ``copy_`` per parameter each way, at every step: hundreds of
   small kernels and a Python loop over the parameters. With the flat copy they are
   one ``torch._foreach_copy_`` each way, over views of the flat tensor; the values
   are the same, bit for bit (zeros for a parameter without gradient, as fairseq).
7. **Smoothed values at every update** (fairseq 0.12). ``Trainer._reduce_and_log_stats``
   computes the smoothed value of every meter at every training update, which reads
   each one back from the GPU (a synchronisation per update), although
   ``fairseq-train`` uses them only on the updates it logs (``--log-interval``). On the
   other updates they are no longer computed; everything is still logged into the
   meters, so the logged figures, the epoch's and the validation's are unchanged.
8. **cuDNN's attention, off** (PyTorch on Hopper and newer GPUs). In half precision
   PyTorch ranks cuDNN's backend of ``scaled_dot_product_attention`` first, and cuDNN
   builds a plan on the host for every new problem shape. fairseq's batches and beam
   search meet a new shape almost every step, for any architecture (fairseq's own
   ``transformer`` reaches the backend through ``F.multi_head_attention_forward``). The
   plugin switches the backend off for the process when it is loaded; flash and
   memory-efficient attention take any shape without a build. ``TPP_CUDNN_ATTENTION=1``
   in the environment keeps it on.
9. **Checkpoints that know their data** (fairseq 0.12, any architecture). A fairseq
   checkpoint does not record the dictionaries its embeddings index: resuming a run,
   generating or evaluating with a data folder whose dictionary has the same size and
   other words (or another order) goes on without a word, every embedding row standing
   for another word, and one of another size fails with "please ensure that the
   architectures match". Every checkpoint the trainer writes now records its data
   folder and a fingerprint of each of the task's dictionaries
   (:mod:`tpp_plugin.checkpoint_match`), and loading one for training or for
   ``load_model_ensemble_and_task`` (``fairseq-generate``, ``fairseq-interactive``, the
   hub interface) compares them with the task's before the weights are loaded; resuming
   also compares the model options (``cfg.model``, less the implementation choices)
   unless ``--reset-optimizer`` starts a new training from the weights. A mismatch is a
   :class:`~tpp_plugin.checkpoint_match.CheckpointMismatch` naming both data folders
   (or the option and both values); a command that does not catch it prints it as one
   line, without a traceback (the plugin's ``sys.excepthook``). A checkpoint written
   before the record existed is compared by its embedding sizes only.
"""

import argparse
import contextvars
import importlib.util
import logging
import os
import sys

import numpy as np
import torch
from fairseq import checkpoint_utils, optim
from fairseq import tasks as fairseq_tasks
from fairseq.data import data_utils
from fairseq.dataclass import utils as dataclass_utils
from fairseq.logging import metrics
from fairseq.optim.fp16_optimizer import FP16Optimizer
from fairseq.trainer import Trainer
from fairseq.trainer import logger as trainer_logger
from omegaconf import OmegaConf

from . import checkpoint_match

logger = logging.getLogger(__name__)
_logged = set()


def _log_once(key: str, message: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


# --------------------------------------------------------------------------- 1. safe loading


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
    # dtype classes (numpy >= 1.25 pickles dtypes through numpy.dtypes.*DType)
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in dir(dtypes):
            obj = getattr(dtypes, name)
            if isinstance(obj, type) and name.endswith("DType"):
                found.append(obj)
    # scalar types such as numpy.float64 that appear as metric values
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool_"):
        found.append(getattr(np, name))
    return found


def allow_fairseq_checkpoints() -> None:
    """Allow-list what fairseq checkpoints contain for ``weights_only`` loading."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is None:  # torch < 2.4 loads everything anyway
        return
    allowed = [argparse.Namespace] + _numpy_globals()
    add(allowed)
    logger.debug("safe loading: allow-listed argparse.Namespace and %d numpy types", len(allowed) - 1)


# --------------------------------------------------------------------------- 2. the last batch

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
        batches = batch_by_size_fn(indices, num_tokens_fn, max_tokens, max_sentences, required_batch_size_multiple)
    else:
        if not isinstance(num_tokens_vec, np.ndarray):
            num_tokens_vec = np.fromiter(num_tokens_vec, dtype=np.int64, count=-1)
        batches = batch_by_size_vec(indices, num_tokens_vec, max_tokens, max_sentences, required_batch_size_multiple)
    if batches and len(batches[-1]) % required_batch_size_multiple:
        _log_once("last_batch", "kept a last batch of %d sentence(s) that fairseq-fixed 0.12.3.1 drops "
                  "(not a multiple of --required-batch-size-multiple %d)",
                  len(batches[-1]), required_batch_size_multiple)
    return batches


def keep_last_batches() -> None:
    """Install :func:`batch_by_size_keeping_remainder` (idempotent). Callers look the
    function up on the module at call time, so replacing the attribute is enough."""
    data_utils.batch_by_size = batch_by_size_keeping_remainder


# --------------------------------------------------------------------------- 3. --bf16 on GPUs

_original_convert = dataclass_utils.convert_namespace_to_omegaconf


def _xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def convert_namespace_to_omegaconf(args):
    if getattr(args, "bf16", False) and getattr(args, "tpu", False) and not _xla_available():
        args.tpu = False
        if hasattr(args, "beam"):  # fairseq-generate, fairseq-interactive
            _log_once("bf16", "--bf16 without torch_xla: not on a TPU; fairseq 0.12 decodes in float32 with "
                      "--bf16 (it converts the model for --fp16 only)")
        else:
            _log_once("bf16", "--bf16 without torch_xla: training in bfloat16 on %s, not on a TPU",
                      "the CPU" if getattr(args, "cpu", False) else "the GPU")
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
        if name.startswith("fairseq_cli.") and getattr(module, "convert_namespace_to_omegaconf", None) is _original_convert:
            module.convert_namespace_to_omegaconf = convert_namespace_to_omegaconf


# --------------------------------------------------------------------------- 4. logging


def undo_debug_logging_of_fairseq_import(root_level_before_fairseq=None) -> None:
    """The root logger back from DEBUG to ``$LOGLEVEL`` (default INFO) unless DEBUG was
    asked for: by ``$LOGLEVEL``, or by the program before fairseq was imported
    (``root_level_before_fairseq``, None where that is not known)."""
    root = logging.getLogger()
    if root_level_before_fairseq == logging.DEBUG:
        return
    wanted = os.environ.get("LOGLEVEL", "INFO").upper()
    if root.level == logging.DEBUG and isinstance(logging.getLevelName(wanted), int) and wanted != "DEBUG":
        root.setLevel(wanted)


# --------------------------------------------------------------------------- 5. --bf16's flat master copy

_original_build_optimizer = FP16Optimizer.build_optimizer.__func__
_original_load_state_dict = FP16Optimizer.load_state_dict
#: what a resumed optimizer state cannot be converted without
_RESET_HINT = ("resume with --reset-optimizer (a fresh optimizer state), or with --fp16-no-flatten-grads "
               "if the checkpoint kept one state per parameter")


#: devices whose --bf16 master copy is kept flat (the tests add "cpu" to run the flat path here)
FLAT_BF16_DEVICE_TYPES = frozenset({"cuda"})


def _flat_bf16_wanted(cfg, params) -> bool:
    """--bf16 with the parameters on one GPU, where fairseq's --fp16 would flatten the
    master copy (a TPU's parameters are on an "xla" device: per parameter, as fairseq
    keeps them there)."""
    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type not in FLAT_BF16_DEVICE_TYPES:
        return False
    common, distributed = cfg.common, cfg.distributed_training
    return (bool(getattr(common, "bf16", False)) and not getattr(common, "fp16_no_flatten_grads", False)
            and getattr(distributed, "zero_sharding", "none") in (None, "none")
            and not getattr(cfg.optimizer, "pipeline_model_parallel", False))


def _flat_fp32_copy(params):
    """``{device index: flat float32 Parameter}`` with a zero gradient of its size:
    ``FP16Optimizer.build_fp32_params(flatten=True)``'s layout (the parameters one after
    the other, in order), keyed by the parameters' device index rather than by
    ``torch.cuda.current_device()`` (so it also holds on the CPU, whose index is None)."""
    flat = params[0].new_empty(sum(p.numel() for p in params), dtype=torch.float32)
    offset = 0
    for p in params:
        flat[offset : offset + p.numel()].copy_(p.data.reshape(-1))
        offset += p.numel()
    flat = torch.nn.Parameter(flat)
    flat.grad = torch.zeros_like(flat.data)
    return {params[0].device.index: flat}


def build_optimizer(cls, cfg, params, **kwargs):
    """``FP16Optimizer.build_optimizer``, with a flat master copy for --bf16 (see 5.)."""
    params = list(params)
    if params and _flat_bf16_wanted(cfg, params):
        fp32_params = _flat_fp32_copy(params)
        fp32_optimizer = optim.build_optimizer(cfg.optimizer, [fp32_params])
        if fp32_optimizer.supports_flat_params:
            _log_once("bf16_flat", "--bf16: the float32 master copy of %d parameter tensors kept as one flat "
                      "tensor, as --fp16 keeps it (--fp16-no-flatten-grads: one per parameter)", len(params))
            return cls(cfg, params, fp32_optimizer, fp32_params, **kwargs)
        del fp32_optimizer, fp32_params  # e.g. Adafactor: one tensor per parameter, as fairseq does
    return _original_build_optimizer(cls, cfg, params, **kwargs)


def _same_value(values, what: str):
    """The one value that every parameter's state holds under a key (a step count)."""
    first = values[0]
    for v in values[1:]:
        equal = torch.equal(v, first) if torch.is_tensor(v) and torch.is_tensor(first) else v == first
        if not equal:
            raise RuntimeError(f"cannot convert the optimizer state {what}: it differs between parameters "
                               f"({first!r}, {v!r}); {_RESET_HINT}")
    return first


def _is_per_parameter(value, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def _merge_states(states, numels):
    """One parameter's state per tensor -> the flat tensor's state: tensors of a
    parameter's size concatenated in order, other values (the step) taken once."""
    if not any(states):
        return {}
    if not all(states):
        raise RuntimeError(f"cannot convert the optimizer state: {sum(1 for s in states if not s)} of "
                           f"{len(states)} parameters have none; {_RESET_HINT}")
    merged = {}
    for key in states[0]:
        values = [s.get(key) for s in states]
        if all(_is_per_parameter(v, n) for v, n in zip(values, numels)):
            merged[key] = torch.cat([v.reshape(-1) for v in values])
        elif not any(torch.is_tensor(v) and v.dim() > 0 for v in values):
            merged[key] = _same_value(values, repr(key))
        else:
            raise RuntimeError(f"cannot convert the optimizer state {key!r}: not one tensor of the parameter's "
                               f"size per parameter; {_RESET_HINT}")
    return merged


def _split_state(state, params):
    """The flat tensor's state -> one state per parameter (views reshaped to each)."""
    total = sum(p.numel() for p in params)
    states = [{} for _ in params]
    for key, value in state.items():
        if _is_per_parameter(value, total):
            offset = 0
            for p, st in zip(params, states):
                st[key] = value[offset : offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        elif torch.is_tensor(value) and value.dim() > 0:
            raise RuntimeError(f"cannot convert the optimizer state {key!r}: not one tensor of the parameters' "
                               f"total size; {_RESET_HINT}")
        else:
            for st in states:
                st[key] = value.clone() if torch.is_tensor(value) else value
    return states


def _check_flat_state_sizes(optimizer, state_dict) -> None:
    """Refuse a state whose tensors do not have the size of the flat master copy they
    would load into (the model's parameters changed since the checkpoint): torch checks
    only the number of parameters, and Adam would fail at its first step, or with the
    same total size silently apply the moments to the wrong parameters."""
    groups = optimizer.fp32_optimizer.optimizer.param_groups
    saved_groups = state_dict.get("param_groups") or []
    if len(groups) != len(saved_groups):
        return  # torch reports it
    for group, saved in zip(groups, saved_groups):
        if len(group["params"]) != len(saved["params"]):
            return  # torch reports it
        for param, saved_id in zip(group["params"], saved["params"]):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() != param.numel():
                    raise RuntimeError(
                        f"cannot load the optimizer state {key!r}: it holds {value.numel()} values where the "
                        f"flat master copy of the model's parameters has {param.numel()} (the parameters "
                        f"changed since the checkpoint was written); {_RESET_HINT}")


def match_state_layout(optimizer, state_dict):
    """``state_dict`` (an ``FP16Optimizer`` state) in the layout of ``optimizer``: a
    per-parameter state for a flat master copy, or a flat one for a per-parameter copy,
    converted; any other state returned as it is (torch reports its own mismatches). A
    state for a flat master copy is checked against its size."""
    converted = _convert_state_layout(optimizer, state_dict)
    if optimizer.has_flat_params:
        _check_flat_state_sizes(optimizer, converted)
    return converted


def _convert_state_layout(optimizer, state_dict):
    """:func:`match_state_layout`'s conversion."""
    groups = optimizer.fp32_optimizer.optimizer.param_groups
    saved_groups = state_dict.get("param_groups") or []
    if len(groups) != 1 or len(saved_groups) != 1:
        return state_dict
    saved_ids = list(saved_groups[0]["params"])
    count = len(groups[0]["params"])
    params = [p for p in optimizer.fp16_params if p.requires_grad]
    numels = [p.numel() for p in params]
    if optimizer.has_flat_params and count == 1 and len(saved_ids) == len(params) > 1:
        state = _merge_states([state_dict["state"].get(i, {}) for i in saved_ids], numels)
        new_ids = [0]
        new_state = {0: state} if state else {}
        layout = "one per parameter -> flat"
    elif not optimizer.has_flat_params and count == len(params) > 1 and len(saved_ids) == 1:
        flat_state = state_dict["state"].get(saved_ids[0], {})
        new_ids = list(range(len(params)))
        new_state = dict(enumerate(_split_state(flat_state, params))) if flat_state else {}
        layout = "flat -> one per parameter"
    else:
        return state_dict
    _log_once("bf16_layout", "optimizer state of the checkpoint converted (%s, %d parameter tensors)", layout,
              len(params))
    converted = dict(state_dict)
    converted["state"] = new_state
    converted["param_groups"] = [dict(saved_groups[0], params=new_ids)]
    return converted


def load_state_dict(self, state_dict, optimizer_overrides=None):
    return _original_load_state_dict(self, match_state_layout(self, state_dict), optimizer_overrides)


load_state_dict.__doc__ = _original_load_state_dict.__doc__


def flat_bf16_master_copy() -> None:
    """Install :func:`build_optimizer` and :func:`load_state_dict` on fairseq's
    ``FP16Optimizer`` (idempotent)."""
    FP16Optimizer.build_optimizer = classmethod(build_optimizer)
    FP16Optimizer.load_state_dict = load_state_dict


# --------------------------------------------------------------------------- 6. the flat copy's syncs

_original_sync_grads = FP16Optimizer._sync_fp16_grads_to_fp32
_original_sync_params = FP16Optimizer._sync_fp32_params_to_fp16


def _flat_groups(optimizer, trainable_only: bool):
    """``[(flat float32 Parameter, the parameters it holds, in order)]`` of a flat master
    copy, grouped by device index as fairseq groups them; None where the parameters do
    not fill each flat tensor exactly (fairseq's own loop then runs, as before)."""
    if not isinstance(optimizer.fp32_params, dict) or not optimizer.has_flat_params:
        return None
    by_device = {}
    for p in optimizer.fp16_params:
        if p.requires_grad or not trainable_only:
            by_device.setdefault(p.device.index, []).append(p)
    groups = []
    for device, flat in optimizer.fp32_params.items():
        params = by_device.get(device, [])
        if sum(p.numel() for p in params) != flat.numel():
            return None
        groups.append((flat, params))
    return groups


def _views(flat, params):
    """Views of ``flat`` shaped as ``params``, one after the other."""
    return [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in params]), params)]


def sync_fp16_grads_to_fp32(self):
    """``FP16Optimizer._sync_fp16_grads_to_fp32`` with one ``_foreach_copy_`` per flat
    tensor instead of one copy per parameter (zeros for a parameter without gradient)."""
    if not self._needs_sync:
        return
    groups = _flat_groups(self, trainable_only=True)
    if groups is None:
        return _original_sync_grads(self)
    _log_once("foreach_syncs", "the flat float32 master copy synchronised with one _foreach_copy_ each way "
              "(fairseq: one copy per parameter)")
    for flat, params in groups:
        if params:
            grads = [p.grad.data if p.grad is not None else p.data.new_zeros(p.data.shape) for p in params]
            torch._foreach_copy_(_views(flat.grad.data, params), grads)
    self._needs_sync = False


def sync_fp32_params_to_fp16(self):
    """``FP16Optimizer._sync_fp32_params_to_fp16`` with one ``_foreach_copy_`` per flat
    tensor instead of one copy per parameter."""
    groups = _flat_groups(self, trainable_only=False)
    if groups is None:
        return _original_sync_params(self)
    for flat, params in groups:
        if params:
            torch._foreach_copy_([p.data for p in params], _views(flat.data, params))


def foreach_master_copy_syncs() -> None:
    """Install :func:`sync_fp16_grads_to_fp32` and :func:`sync_fp32_params_to_fp16` on
    fairseq's ``FP16Optimizer`` (idempotent)."""
    FP16Optimizer._sync_fp16_grads_to_fp32 = sync_fp16_grads_to_fp32
    FP16Optimizer._sync_fp32_params_to_fp16 = sync_fp32_params_to_fp16


# --------------------------------------------------------------------------- 7. smoothed values when logged

_original_train_step = Trainer.train_step
_original_reduce_and_log_stats = Trainer._reduce_and_log_stats


def train_step(self, samples, raise_oom=False):
    """``Trainer.train_step``, marked as running for :func:`reduce_and_log_stats`."""
    outer = getattr(self, "_tpp_in_train_step", False)
    self._tpp_in_train_step = True
    try:
        return _original_train_step(self, samples, raise_oom)
    finally:
        self._tpp_in_train_step = outer


def reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
    """``Trainer._reduce_and_log_stats``; in a training update that fairseq-train does not
    log (``--log-interval``), everything is logged as fairseq logs it, but the smoothed
    values, which read every meter back from the device, are not computed, and
    ``{"sample_size": sample_size}`` is returned (fairseq-train only tests it for None)."""
    if (self.tpu or not getattr(self, "_tpp_in_train_step", False)
            or self.get_num_updates() % self.cfg.common.log_interval == 0):
        return _original_reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm)
    _log_once("smoothed", "fairseq's smoothed training figures computed on the logged updates only "
              "(--log-interval %d), not read back from the device at every update", self.cfg.common.log_interval)
    # fairseq's body, without agg.get_smoothed_values()
    if grad_norm is not None and (not torch.is_tensor(grad_norm) or torch.isfinite(grad_norm)):
        metrics.log_speed("ups", 1.0, priority=100, round=2)
        metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
        if self.cfg.optimization.clip_norm > 0:
            metrics.log_scalar(
                "clip",
                torch.where(grad_norm > self.cfg.optimization.clip_norm, grad_norm.new_tensor(100),
                            grad_norm.new_tensor(0)),
                priority=500,
                round=1,
            )
    with metrics.aggregate() as agg:
        if logging_outputs is not None:
            self.task.reduce_metrics(logging_outputs, self.get_criterion())
            del logging_outputs
        if "loss" not in agg:
            if "loss" not in self._warn_once:
                self._warn_once.add("loss")
                trainer_logger.warning("Criterion.reduce_metrics did not log a 'loss' value, "
                                       "which may break some functionality")
            metrics.log_scalar("loss", -1)
    return {"sample_size": sample_size}


def smoothed_values_only_when_logged() -> None:
    """Install :func:`train_step` and :func:`reduce_and_log_stats` on fairseq's
    ``Trainer`` (idempotent)."""
    Trainer.train_step = train_step
    Trainer._reduce_and_log_stats = reduce_and_log_stats


# --------------------------------------------------------------------------- 8. cuDNN's attention


def cudnn_attention_off() -> None:
    if os.environ.get("TPP_CUDNN_ATTENTION", "").lower() in ("1", "true", "yes"):
        return
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        if torch.cuda.is_available():
            _log_once("cudnn_sdp", "cuDNN's attention backend switched off (TPP_CUDNN_ATTENTION=1 keeps it)")


# --------------------------------------------------------------------------- 9. checkpoints that know their data

_original_state_dict = Trainer.state_dict
_original_trainer_load_checkpoint = Trainer.load_checkpoint
_original_load_checkpoint_to_cpu = checkpoint_utils.load_checkpoint_to_cpu
_original_load_model_ensemble_and_task = checkpoint_utils.load_model_ensemble_and_task
_original_setup_task = fairseq_tasks.setup_task
_previous_excepthook = None

#: what a checkpoint being loaded is for (an :class:`_Expectation`), while it is loaded
_expectation = contextvars.ContextVar("tpp_checkpoint_expectation", default=None)


class _Expectation:
    """The task (dictionaries) a checkpoint is loaded for and, when a run resumes, the
    run's configuration; ``task`` None: the task that fairseq sets up from the first
    checkpoint, whose loaded states wait in ``pending`` until it is known."""

    def __init__(self, task=None, cfg=None, hint=""):
        self.task, self.cfg, self.hint = task, cfg, hint
        self.pending = []

    def loaded(self, state, path):
        if self.task is None:
            self.pending.append((checkpoint_match.what_checks_read(state), path))
        else:
            self.check(state, path)

    def adopt(self, task):
        if self.task is None:
            self.task = task
            pending, self.pending = self.pending, []
            for state, path in pending:
                self.check(state, path)

    def check(self, state, path):
        current = checkpoint_match.record_of_task(self.task)
        if current is not None and not checkpoint_match.check_dictionaries(state, current, path, self.hint):
            _log_once("no_record", "%s records no dictionaries (written before the plugin recorded them): "
                      "compared with %s by its embedding sizes only", path, current["data"])
        if self.cfg is not None:
            checkpoint_match.check_resumed_options(state, self.cfg, path)


def trainer_state_dict(self):
    """``Trainer.state_dict`` with the record of the task's dictionaries."""
    state = _original_state_dict(self)
    record = checkpoint_match.record_of_task(self.task, getattr(self.cfg.task, "data", None))
    if record is not None:
        state[checkpoint_match.RECORD_KEY] = record
    return state


def trainer_load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False,
                            optimizer_overrides=None, reset_meters=False):
    """``Trainer.load_checkpoint``; the checkpoint is checked against the run's
    dictionaries and (unless ``--reset-optimizer``) model options when it is read."""
    cfg = None
    if not reset_optimizer:  # the configuration as state_dict() saves it
        cfg = (OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
               if OmegaConf.is_config(self.cfg) else self.cfg)
    hint = ("Resume with the data folder the run was trained on, or train on this one in another "
            "--save-dir")
    token = _expectation.set(_Expectation(self.task, cfg, hint))
    try:
        return _original_trainer_load_checkpoint(self, filename, reset_optimizer, reset_lr_scheduler,
                                                 optimizer_overrides, reset_meters)
    finally:
        _expectation.reset(token)


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    state = _original_load_checkpoint_to_cpu(path, arg_overrides, load_on_all_ranks)
    expectation = _expectation.get()
    if expectation is not None:
        expectation.loaded(state, path)
    return state


load_checkpoint_to_cpu.__doc__ = _original_load_checkpoint_to_cpu.__doc__


def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="",
                                 num_shards=1, state=None):
    """``checkpoint_utils.load_model_ensemble_and_task``; each checkpoint is checked
    against the task's dictionaries (the given task, or the one set up from the first
    checkpoint) before its weights are loaded."""
    expectation = _Expectation(task, hint="Use the data folder the model was trained on (or one with "
                               "the same dictionaries)")
    if state is not None:  # given by the caller: not read here
        expectation.loaded(state, filenames[0] if filenames else "the checkpoint")
    token = _expectation.set(expectation)
    try:
        return _original_load_model_ensemble_and_task(filenames, arg_overrides, task, strict, suffix,
                                                      num_shards, state)
    finally:
        _expectation.reset(token)


def setup_task(cfg, **kwargs):
    task = _original_setup_task(cfg, **kwargs)
    expectation = _expectation.get()
    if expectation is not None:
        expectation.adopt(task)
    return task


setup_task.__doc__ = _original_setup_task.__doc__


def _program() -> str:
    """The command's name as a user typed it (``fairseq-train`` for ``python -m fairseq_cli.train``)."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    name = os.path.basename(argv0)
    if name.endswith(".py") and os.path.basename(os.path.dirname(argv0)) == "fairseq_cli":
        return "fairseq-" + name[:-3]
    return name


def excepthook(exc_type, exc, tb):
    """A :class:`~tpp_plugin.checkpoint_match.CheckpointMismatch` that reaches the top of
    a command is its one-line error; anything else goes to the previous hook."""
    if isinstance(exc, checkpoint_match.CheckpointMismatch):
        print(f"{_program()}: error: {exc}", file=sys.stderr, flush=True)
        return
    (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)


def checkpoints_that_know_their_data() -> None:
    """Install the record and the checks of 9. on fairseq's ``Trainer``,
    ``checkpoint_utils`` and ``tasks.setup_task``, and the one-line report (idempotent)."""
    global _previous_excepthook
    Trainer.state_dict = trainer_state_dict
    Trainer.load_checkpoint = trainer_load_checkpoint
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    checkpoint_utils.load_model_ensemble_and_task = load_model_ensemble_and_task
    fairseq_tasks.setup_task = setup_task
    if _previous_excepthook is None:  # once: a hook installed after ours hands on to it
        _previous_excepthook = sys.excepthook
        sys.excepthook = excepthook


def apply(root_level_before_fairseq=None) -> None:
    """All of the above (idempotent); the logging level first, so that the others'
    messages are filtered by it."""
    undo_debug_logging_of_fairseq_import(root_level_before_fairseq)
    allow_fairseq_checkpoints()
    keep_last_batches()
    bf16_without_tpu()
    flat_bf16_master_copy()
    foreach_master_copy_syncs()
    smoothed_values_only_when_logged()
    cudnn_attention_off()
    checkpoints_that_know_their_data()
