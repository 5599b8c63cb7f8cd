"""Speed-ups of fairseq's training loop on GPUs, each with a name for
``TPP_FAIRSEQ_SPEEDUPS`` (``all``, ``none`` or names separated by commas; default
:data:`DEFAULT`, both). The variable exists so that the GPU benchmarks can measure each
one against fairseq's own behaviour (``benchmarks/gpu_suite.sh``; docs/gpu.md).

- ``cudnn-off``: PyTorch's cuDNN attention backend switched off for the process (it
  builds a plan on the host for every new problem shape, and fairseq's batches and beam
  search meet one almost every step, for any architecture). Default.
- ``flat-bf16``: ``--bf16``'s float32 master copy kept flat on one GPU, as fairseq keeps
  ``--fp16``'s (one tensor for Adam and the gradient norm instead of hundreds). Default.
  Its checkpoints hold the optimizer state one tensor per parameter, as fairseq writes
  ``--bf16``'s, so that they resume on a fairseq without the plugin; a flat state
  (``--fp16``'s, or one an earlier version wrote) resumes in either layout
  (:func:`states_of_either_layout`, a correction :func:`tpp_fairseq.apply` always makes).
- ``multi-tensor-sync``: a flat master copy (``--fp16``'s, ``--bf16``'s) synced with the
  model by multi-tensor copies instead of one copy per parameter tensor, the same values.
  Not a default until a GPU measures it (``transformer-sync``, ``tpp-fused-sync`` in the
  benchmarks).
- ``compiled-layers``: the model's encoder and decoder layers through ``torch.compile``
  (:mod:`tpp_fairseq.compiled`). Opt-in (``transformer-compiled``, ``tpp-compiled`` in the
  benchmarks).
"""

import types

import torch
from fairseq import optim
from fairseq.optim.fp16_optimizer import FP16Optimizer

from ._log import log_once as _log_once
from ._switch import chosen as _chosen
from .compiled import compiled_layers

# --------------------------------------------------------------------------- --bf16's flat master copy

_original_build_optimizer = FP16Optimizer.build_optimizer.__func__
_original_load_state_dict = FP16Optimizer.load_state_dict
#: what a resumed optimizer state cannot be converted without
_RESET_HINT = (
    "resume with --reset-optimizer (a fresh optimizer state), or with --fp16-no-flatten-grads "
    "if the checkpoint kept one state per parameter"
)


#: devices whose --bf16 master copy is kept flat (the tests add "cpu" to run the flat path here)
FLAT_BF16_DEVICE_TYPES = frozenset({"cuda"})


#: what a parameter may carry for fairseq's optimizers (its own group or settings, an
#: expert's gradient left out of the norm): a flat master copy would lose it
PER_PARAMETER_ATTRIBUTES = ("param_group", "optim_overrides", "expert", "base_expert")


def _flat_bf16_wanted(cfg, params) -> bool:
    """--bf16 with the parameters on one GPU, where fairseq's --fp16 would flatten the
    master copy (a TPU's parameters are on an "xla" device: per parameter, as fairseq
    keeps them there), unless the optimizer treats parameters apart (fairseq's
    ``composite`` optimizer, parameters with :data:`PER_PARAMETER_ATTRIBUTES`)."""
    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type not in FLAT_BF16_DEVICE_TYPES:
        return False
    common, distributed = cfg.common, cfg.distributed_training
    return (
        bool(getattr(common, "bf16", False))
        and not getattr(common, "fp16_no_flatten_grads", False)
        and getattr(distributed, "zero_sharding", "none") in (None, "none")
        and not getattr(cfg.optimizer, "pipeline_model_parallel", False)
        and getattr(cfg.optimizer, "_name", None) != "composite"
        and not any(hasattr(p, a) for p in params for a in PER_PARAMETER_ATTRIBUTES)
    )


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
    """``FP16Optimizer.build_optimizer``, with a flat master copy for --bf16 (:func:`flat_bf16_master_copy`)."""
    params = list(params)
    if params and _flat_bf16_wanted(cfg, params):
        fp32_params = _flat_fp32_copy(params)
        fp32_optimizer = optim.build_optimizer(cfg.optimizer, [fp32_params])
        if fp32_optimizer.supports_flat_params:
            _log_once(
                "bf16_flat",
                "--bf16: the float32 master copy of %d parameter tensors kept as one flat "
                "tensor, as --fp16 keeps it (--fp16-no-flatten-grads: one per parameter)",
                len(params),
            )
            optimizer = cls(cfg, params, fp32_optimizer, fp32_params, **kwargs)
            optimizer.state_dict = types.MethodType(per_parameter_state_dict, optimizer)
            return optimizer
        del fp32_optimizer, fp32_params  # e.g. Adafactor: one tensor per parameter, as fairseq does
    return _original_build_optimizer(cls, cfg, params, **kwargs)


def _same_value(values, what: str):
    """The one value that every parameter's state holds under a key (a step count)."""
    first = values[0]
    for v in values[1:]:
        equal = (
            torch.equal(v, first) if torch.is_tensor(v) and torch.is_tensor(first) else v == first
        )
        if not equal:
            raise RuntimeError(
                f"cannot convert the optimizer state {what}: it differs between parameters "
                f"({first!r}, {v!r}); {_RESET_HINT}"
            )
    return first


def _is_per_parameter(value, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def _merge_states(states, numels):
    """One parameter's state per tensor -> the flat tensor's state: tensors of a
    parameter's size concatenated in order, other values (the step) taken once."""
    if not any(states):
        return {}
    if not all(states):
        raise RuntimeError(
            f"cannot convert the optimizer state: {sum(1 for s in states if not s)} of "
            f"{len(states)} parameters have none; {_RESET_HINT}"
        )
    merged = {}
    for key in states[0]:
        values = [s.get(key) for s in states]
        if all(_is_per_parameter(v, n) for v, n in zip(values, numels)):
            merged[key] = torch.cat([v.reshape(-1) for v in values])
        elif not any(torch.is_tensor(v) and v.dim() > 0 for v in values):
            merged[key] = _same_value(values, repr(key))
        else:
            raise RuntimeError(
                f"cannot convert the optimizer state {key!r}: not one tensor of the parameter's "
                f"size per parameter; {_RESET_HINT}"
            )
    return merged


def _split_state(state, params, copy=True):
    """The flat tensor's state -> one state per parameter (reshaped slices of it, copied
    unless ``copy`` is false: views to save)."""
    total = sum(p.numel() for p in params)
    states = [{} for _ in params]
    for key, value in state.items():
        if _is_per_parameter(value, total):
            offset = 0
            for p, st in zip(params, states):
                view = value[offset : offset + p.numel()].view(p.shape)
                st[key] = view.clone() if copy else view
                offset += p.numel()
        elif torch.is_tensor(value) and value.dim() > 0:
            raise RuntimeError(
                f"cannot convert the optimizer state {key!r}: not one tensor of the parameters' "
                f"total size; {_RESET_HINT}"
            )
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
                        f"changed since the checkpoint was written); {_RESET_HINT}"
                    )


def match_state_layout(optimizer, state_dict):
    """``state_dict`` (an ``FP16Optimizer`` state) in the layout of ``optimizer``: a
    per-parameter state for a flat master copy, or a flat one for a per-parameter copy,
    converted; any other state returned as it is (torch reports its own mismatches). A
    state for a flat master copy is checked against its size."""
    converted = _convert_state_layout(optimizer, state_dict)
    if optimizer.has_flat_params:
        _check_flat_state_sizes(optimizer, converted)
    return converted


def _convert_state_layout(optimizer, state_dict, flat=None, saving=False):
    """:func:`match_state_layout`'s conversion, to the layout of ``optimizer`` or to the
    one ``flat`` says (``saving``: to write, the state's tensors sliced, not copied)."""
    flat = optimizer.has_flat_params if flat is None else flat
    groups = optimizer.fp32_optimizer.optimizer.param_groups
    saved_groups = state_dict.get("param_groups") or []
    if len(groups) != 1 or len(saved_groups) != 1:
        return state_dict
    saved_ids = list(saved_groups[0]["params"])
    params = [p for p in optimizer.fp16_params if p.requires_grad]
    numels = [p.numel() for p in params]
    count = len(params) if saving else len(groups[0]["params"])  # tensors of the layout wanted
    if count == len(params) == len(saved_ids) == 1:
        return _reshaped_state(state_dict, params[0], flat)
    if flat and count == 1 and len(saved_ids) == len(params) > 1:
        state = _merge_states([state_dict["state"].get(i, {}) for i in saved_ids], numels)
        new_ids = [0]
        new_state = {0: state} if state else {}
        layout = "one per parameter -> flat"
    elif not flat and count == len(params) > 1 and len(saved_ids) == 1:
        flat_state = state_dict["state"].get(saved_ids[0], {})
        states = _split_state(flat_state, params, copy=not saving) if flat_state else []
        new_ids = list(range(len(params)))
        new_state = dict(enumerate(states))
        layout = "flat -> one per parameter"
    else:
        return state_dict
    if not saving:
        _log_once(
            "bf16_layout",
            "optimizer state of the checkpoint converted (%s, %d parameter tensors)",
            layout,
            len(params),
        )
    converted = dict(state_dict)
    converted["state"] = new_state
    converted["param_groups"] = [dict(saved_groups[0], params=new_ids)]
    return converted


def _reshaped_state(state_dict, param, flat: bool):
    """The state of a model that trains one tensor, whose flat copy is that tensor
    flattened: the two layouts differ in the shapes of the state's tensors only."""
    shape = (-1,) if flat else param.shape
    converted = dict(state_dict)
    converted["state"] = {
        i: {
            k: v.reshape(shape) if _is_per_parameter(v, param.numel()) else v for k, v in st.items()
        }
        for i, st in state_dict["state"].items()
    }
    return converted


_original_sync_grads = FP16Optimizer._sync_fp16_grads_to_fp32
_original_sync_params = FP16Optimizer._sync_fp32_params_to_fp16


def _slices(flat, params):
    """``flat``'s consecutive slices shaped as ``params`` (views)."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def _flat_views(self):
    """Per device of a flat master copy: the half-precision parameters with their slices
    of the copy, and those that train with their slices of its gradient, in fairseq's
    order (views; built again only where fairseq has given the copy a new gradient)."""
    grads = {device: flat.grad for device, flat in self.fp32_params.items()}
    cached = self.__dict__.get("_flat_views_cache")
    if cached is not None and all(cached[1].get(d) is g for d, g in grads.items()):
        return cached[0]
    views = {}
    for device, flat in self.fp32_params.items():
        params = [p for p in self.fp16_params if p.device.index == device]
        trained = [p for p in params if p.requires_grad]
        views[device] = (
            params,
            _slices(flat.data, params),
            trained,
            _slices(flat.grad.data, trained),
        )
    self._flat_views_cache = (views, grads)
    return views


def sync_grads(self):
    """``FP16Optimizer._sync_fp16_grads_to_fp32`` for a flat copy: the gradients in one
    multi-tensor copy (zeros where a parameter has none), not one copy each."""
    if not (self._needs_sync and self.has_flat_params):
        return _original_sync_grads(self)
    for _, _, trained, slices in _flat_views(self).values():
        views, grads, missing = [], [], []
        for view, p in zip(slices, trained):
            if p.grad is None:
                missing.append(view)
            else:
                views.append(view)
                grads.append(p.grad)
        if views:
            torch._foreach_copy_(views, grads)
        if missing:
            torch._foreach_zero_(missing)
    self._needs_sync = False


def sync_params(self):
    """``FP16Optimizer._sync_fp32_params_to_fp16`` for a flat copy: one multi-tensor copy."""
    if not self.has_flat_params:
        return _original_sync_params(self)
    with torch.no_grad():  # in place on the parameters, as torch's optimizers write them
        for params, slices, _, _ in _flat_views(self).values():
            torch._foreach_copy_(params, slices)


def per_parameter_state_dict(self):
    """``FP16Optimizer.state_dict`` of a flat ``--bf16`` master copy in the layout fairseq
    writes for ``--bf16`` (one state per parameter, slices of the flat state)."""
    return _convert_state_layout(self, FP16Optimizer.state_dict(self), flat=False, saving=True)


def load_state_dict(self, state_dict, optimizer_overrides=None):
    return _original_load_state_dict(
        self, match_state_layout(self, state_dict), optimizer_overrides
    )


load_state_dict.__doc__ = _original_load_state_dict.__doc__


def flat_bf16_master_copy() -> None:
    """Install :func:`build_optimizer` on fairseq's ``FP16Optimizer`` (idempotent)."""
    FP16Optimizer.build_optimizer = classmethod(build_optimizer)


def states_of_either_layout() -> None:
    """Install :func:`load_state_dict` on fairseq's ``FP16Optimizer`` (idempotent): a
    correction, made whatever the speed-ups, so that a checkpoint written with a flat
    master copy resumes without one too."""
    FP16Optimizer.load_state_dict = load_state_dict


def multi_tensor_sync(target=FP16Optimizer) -> None:
    """Install :func:`sync_grads` and :func:`sync_params` on fairseq's ``FP16Optimizer``
    (every optimizer; idempotent) or on one optimizer (``target``, an instance)."""
    if isinstance(target, type):
        target._sync_fp16_grads_to_fp32 = sync_grads
        target._sync_fp32_params_to_fp16 = sync_params
    else:
        target._sync_fp16_grads_to_fp32 = types.MethodType(sync_grads, target)
        target._sync_fp32_params_to_fp16 = types.MethodType(sync_params, target)


# --------------------------------------------------------------------------- cuDNN's attention


def cudnn_attention_off() -> None:
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        if torch.cuda.is_available():
            _log_once(
                "cudnn_sdp",
                "cuDNN's attention backend switched off (TPP_FAIRSEQ_SPEEDUPS without "
                "cudnn-off keeps it)",
            )


# --------------------------------------------------------------------------- which


#: name -> installer
SPEEDUPS = {
    "cudnn-off": cudnn_attention_off,
    "flat-bf16": flat_bf16_master_copy,
    "multi-tensor-sync": multi_tensor_sync,
    "compiled-layers": compiled_layers,
}
#: on unless ``TPP_FAIRSEQ_SPEEDUPS`` says otherwise
DEFAULT = ("cudnn-off", "flat-bf16")


def chosen(value=None):
    """The speed-ups ``TPP_FAIRSEQ_SPEEDUPS`` (or ``value``) names; a name it does not
    know is an error naming the variable."""
    return _chosen("TPP_FAIRSEQ_SPEEDUPS", SPEEDUPS, DEFAULT, "the speed-ups", value)


def install(names) -> None:
    for name in names:
        SPEEDUPS[name]()
