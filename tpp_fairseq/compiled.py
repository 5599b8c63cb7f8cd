"""Compiled layers (``TPP_FAIRSEQ_SPEEDUPS=compiled-layers``, opt-in): each encoder and
decoder layer of the model a ``Trainer`` trains runs through ``torch.compile``, for any
architecture built of fairseq's ``TransformerEncoderLayerBase`` and
``TransformerDecoderLayerBase`` (``transformer``, ``transformer_pp``). One graph per
layer variant and side serves every batch shape:

- shapes are symbolic from the first batch (``dynamic=True``), none taken equal to
  another by coincidence; sizes 0 and 1 would each be a graph of their own, so a batch
  of fewer than 2 sentences or positions (or source positions), or of
  :data:`MAX_LENGTH` positions and more, and incremental decoding run eagerly;
- the layer's tensors are made contiguous tensors of their own before the compiled
  region (fairseq's first layer gets a transposed view, the decoder a slice of a cached
  mask: their strides and bases would each be a guard, and so a graph), and a padding
  mask fairseq leaves out (a batch without padding) is passed as one without padding;
- Dynamo's recompile limit counts per code object, and every layer shares fairseq's
  ``forward``: it is raised to :data:`RECOMPILE_LIMIT`, above the number of variants
  (the decoder's alignment layer, validation's graphs, the plugin's kernels wider than
  its window), so that no layer silently falls back to eager;
- fairseq's incremental state answers None at once where there is none (its key would
  be a guard on each module's id);
- the plugin's modules trace their shape-agnostic forms (``torch.compiler.is_compiling()``),
  or with ``--conv-heads-impl fused`` call the fused kernels as operators; a module's
  ``compiled_forward()`` context is entered eagerly around each compiled call (the
  plugin's LocalConv builds its kernel there, or what the operator takes of it: its
  width and dilation, traced, would make one graph per layer).
"""

import contextlib
import copy
import inspect
import os

import torch
from fairseq.incremental_decoding_utils import FairseqIncrementalState
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)
from fairseq.trainer import Trainer

from ._log import log_once as _log_once

#: the lengths the compiled forms take: below it, the plugin's padded prefix softmax
#: splits a sequence into at most 63 blocks of 64, whose totals fit its one extra block
MAX_LENGTH = 62 * 64
#: Dynamo's recompile limit while layers are compiled (8 by default)
RECOMPILE_LIMIT = 64

#: the layers' forward arguments after ``x``, in order (fairseq 0.12)
ENCODER_ARGUMENTS = ("encoder_padding_mask", "attn_mask")
DECODER_ARGUMENTS = (
    "encoder_out",
    "encoder_padding_mask",
    "incremental_state",
    "prev_self_attn_state",
    "prev_attn_state",
    "self_attn_mask",
    "self_attn_padding_mask",
    "need_attn",
    "need_head_weights",
)


class CompiledForward:
    """A layer's ``forward``: compiled for whole sequences, eager where :data:`MAX_LENGTH`
    and the sizes 0 and 1 say so, and for incremental decoding."""

    def __init__(self, forward, decoder: bool, backend="inductor"):
        self.eager = forward
        self.backend = backend
        self.compiled = torch.compile(forward, backend=backend, dynamic=True)
        self.names = DECODER_ARGUMENTS if decoder else ENCODER_ARGUMENTS
        self.decoder = decoder
        #: the contexts the layer's modules enter eagerly around each compiled call (found
        #: at the first: a copy's layer is not whole while its forward is copied)
        self.contexts = None

    def __deepcopy__(self, memo):
        """The forward of the layer's copy (fairseq's ``--ema`` copies the model): the
        compiled function would otherwise go on calling the original layer."""
        return CompiledForward(copy.deepcopy(self.eager, memo), self.decoder, self.backend)

    def __reduce__(self):
        """Pickled (``torch.save`` of a whole model) as the layer, compiled again where it
        is loaded: a compiled function cannot be pickled."""
        return (_compile_forward, (self.eager.__self__, self.decoder, self.backend))

    def __call__(self, x, *args, **kwargs):
        kwargs.update(zip(self.names, args))
        length, bsz = x.size(0), x.size(1)
        source = kwargs.get("encoder_out") if self.decoder else x
        if kwargs.get("incremental_state") is not None or not (
            2 <= bsz and 2 <= length < MAX_LENGTH and (source is None or source.size(0) >= 2)
        ):
            return self.eager(x, **kwargs)
        kwargs = {k: _own(v) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        if kwargs.get("encoder_padding_mask") is None and source is not None:
            kwargs["encoder_padding_mask"] = x.new_zeros(bsz, source.size(0), dtype=torch.bool)
        if self.decoder and kwargs.get("self_attn_padding_mask") is None:
            kwargs["self_attn_padding_mask"] = x.new_zeros(bsz, length, dtype=torch.bool)
        if self.contexts is None:
            layer = self.eager.__self__
            self.contexts = [
                m.compiled_forward for m in layer.modules() if hasattr(m, "compiled_forward")
            ]
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context())
            return self.compiled(_own(x), **kwargs)


def _compile_forward(layer, decoder: bool, backend: str) -> CompiledForward:
    """A compiled forward of ``layer``'s class's own, with the settings above."""
    _settings()
    return CompiledForward(type(layer).forward.__get__(layer), decoder, backend)


def _settings() -> None:
    """What compiled layers need of Dynamo and of fairseq's incremental state (process-wide)."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    dynamo.accumulated_recompile_limit = max(
        dynamo.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT
    )
    # a float attribute (a dropout's p) is a constant of the layer: taken as an input, it
    # has Dynamo trace every graph twice
    dynamo.specialize_float = True
    # no size taken equal to another because they were in the first batch
    torch.fx.experimental._config.use_duck_shape = False
    FairseqIncrementalState.get_incremental_state = get_incremental_state


def _own(t):
    """``t`` as a contiguous tensor of its own (a view's base is a guard too: fairseq's
    future mask is a slice of a cached one, contiguous or not as its size goes)."""
    t = t.contiguous()
    return t.clone() if t._base is not None else t


def compile_layers(model, backend="inductor") -> int:
    """Compile every fairseq encoder and decoder layer of ``model`` in place (each once),
    with the settings above (Dynamo's, and fairseq's incremental state); returns how many
    layers are compiled. A layer under fairseq's activation checkpointing
    (``--checkpoint-activations``, whose wrapper runs the forward again in the backward
    pass), or whose forward takes other arguments than fairseq's, stays eager."""
    _settings()
    count, checkpointed, other = 0, 0, set()
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), CompiledForward):
            count += 1
        elif isinstance(module, (TransformerEncoderLayerBase, TransformerDecoderLayerBase)):
            decoder = isinstance(module, TransformerDecoderLayerBase)
            if hasattr(module, "precheckpoint_forward"):  # fairseq's checkpoint_wrapper
                checkpointed += 1
            elif not _takes_fairseqs_arguments(module, decoder):
                other.add(type(module).__name__)
            else:
                module.forward = CompiledForward(module.forward, decoder, backend)
                count += 1
    eager = [f"{checkpointed} with --checkpoint-activations"] if checkpointed else []
    eager += [f"{', '.join(sorted(other))} (another forward's arguments)"] if other else []
    _log_once(
        "compiled_layers",
        "compiled layers: %d encoder and decoder layers run through torch.compile (%s)%s",
        count,
        backend,
        f"; stay eager: {'; '.join(eager)}" if eager else "",
    )
    return count


def _takes_fairseqs_arguments(layer, decoder: bool) -> bool:
    """Whether ``layer``'s forward takes fairseq's arguments, in fairseq's order and no
    others, as :class:`CompiledForward` names them (a subclass with arguments of its own,
    as fairseq's ``AugTransformerDecoderLayerBase``, would have them misnamed or lost)."""
    names = tuple(inspect.signature(type(layer).forward).parameters)[2:]
    return names == (DECODER_ARGUMENTS if decoder else ENCODER_ARGUMENTS)


_original_trainer_init = Trainer.__init__
_original_get_incremental_state = FairseqIncrementalState.get_incremental_state


def chosen_backend() -> str:
    """``TPP_FAIRSEQ_COMPILE_BACKEND``, else Inductor: ``aot_eager`` traces the same
    graphs, forward and backward, and runs them eagerly, which tells whether a failure
    or a difference is Inductor's (PyTorch's own advice for compiler errors)."""
    name = os.environ.get("TPP_FAIRSEQ_COMPILE_BACKEND", "").strip() or "inductor"
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(
            f"TPP_FAIRSEQ_COMPILE_BACKEND={name!r}: not a torch.compile backend; "
            "inductor (the default), or aot_eager to tell whether a problem is Inductor's "
            "(torch._dynamo.list_backends(exclude_tags=()) lists them all)"
        )
    return name


def trainer_init(self, cfg, task, model, criterion, *args, **kwargs):
    backend = chosen_backend()  # an unknown one refused before the trainer is built
    _original_trainer_init(self, cfg, task, model, criterion, *args, **kwargs)
    compile_layers(self._model, backend=backend)


trainer_init.__doc__ = _original_trainer_init.__doc__


def get_incremental_state(self, incremental_state, key):
    """``FairseqIncrementalState.get_incremental_state``, None at once without a state:
    the key it builds first holds the module's own id, which a compiled layer would
    otherwise guard on (one graph per layer)."""
    if incremental_state is None:
        return None
    return _original_get_incremental_state(self, incremental_state, key)


def compiled_layers() -> None:
    """Compile the layers of every model a fairseq ``Trainer`` is built for (idempotent)."""
    Trainer.__init__ = trainer_init
