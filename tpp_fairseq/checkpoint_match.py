"""What a checkpoint was trained with, and whether a use of it matches.

fairseq checkpoints hold the model's weights and options but not the vocabulary its
embeddings index: a data folder whose dictionary has the same size and other words (or
another order) loads without a complaint, and every embedding row then stands for
another word. The plugin's task (``translation_with_tags``) therefore records, in the
task state fairseq saves with every checkpoint (``task_state``, under
:data:`RECORD_KEY`): the data folder and, for each of its dictionaries, its file, size and
a SHA-256 of its symbols in order. Loading compares that record with the dictionaries the
checkpoint is used with (:mod:`tpp_fairseq.checkpoints`); version 0.3.0 kept the record at
the checkpoint's top level, where it is still read.

The comparison of model options (``cfg.model``), shared by resuming a run and by
``tpp-average-checkpoints``, lives here too: the options that change what a model
computes, without the run's other settings and :data:`IGNORED_MODEL_KEYS`.
"""

import argparse
import hashlib
import logging
import os
import warnings
from collections.abc import Mapping

from omegaconf import OmegaConf

from .errors import UserError

logger = logging.getLogger(__name__)

#: the key of the record (a plain dict, loadable with ``weights_only``) in the task state
RECORD_KEY = "tpp_dictionaries"
RECORD_VERSION = 1

# Keys of the model configuration that do not make two checkpoints different models:
# the names of the run's other components (their options live in other sections of
# the configuration and are not compared either), where pre-trained embeddings were
# read from (initialisation only), switches that trade speed for memory, the choice
# between implementations of the same function, and regularisation in training
# (dropouts, LayerDrop, quantization noise), which fairseq lets a resumed run change.
IGNORED_MODEL_KEYS = frozenset(
    {
        "dropout",
        "attention_dropout",
        "activation_dropout",
        "relu_dropout",
        "adaptive_softmax_dropout",
        "conv_weight_dropout",
        "encoder_layerdrop",
        "decoder_layerdrop",
        "quant_noise_pq",
        "quant_noise_pq_block_size",
        "quant_noise_scalar",
        "task",
        "criterion",
        "optimizer",
        "lr_scheduler",
        "bpe",
        "tokenizer",
        "scoring",
        "encoder_embed_path",
        "decoder_embed_path",
        "checkpoint_activations",
        "offload_activations",
        "min_params_to_wrap",
        "conv_heads_impl",
    }
)

#: the state-dict keys whose rows are the source and target dictionaries' words
EMBEDDING_KEYS = {"source": "encoder.embed_tokens.weight", "target": "decoder.embed_tokens.weight"}


class CheckpointMismatch(UserError):
    """A checkpoint used with dictionaries or model options other than its own."""


# --------------------------------------------------------------------------- dictionaries


def fingerprint(dictionary) -> dict:
    """``{"size", "sha256"}`` of a fairseq ``Dictionary``: its symbols, in order (the
    counts do not change what an index means)."""
    digest = hashlib.sha256("\n".join(dictionary.symbols).encode("utf-8")).hexdigest()
    return {"size": len(dictionary.symbols), "sha256": digest}


def first_data_folder(data) -> str:
    """The folder fairseq reads the dictionaries from (the first of ``a:b:c``), absolute."""
    if not data:
        return ""
    return os.path.abspath(str(data).split(os.pathsep)[0])


def _task_dictionaries(task):
    """``{role: (file name, Dictionary)}`` of a fairseq task: source, target, and the
    plugin's tag dictionaries (``tag:<kind>``)."""
    cfg = getattr(task, "cfg", None) or getattr(task, "args", None)
    found = {}
    for role in ("source", "target"):
        try:
            dictionary = getattr(task, f"{role}_dictionary")
        except (NotImplementedError, AttributeError):
            dictionary = None
        if dictionary is not None and hasattr(dictionary, "symbols"):
            lang = getattr(cfg, f"{role}_lang", None)
            found[role] = (f"dict.{lang}.txt" if lang else f"the {role} dictionary", dictionary)
    for kind, dictionary in (getattr(task, "tag_dictionaries", None) or {}).items():
        found[f"tag:{kind}"] = (f"dict.{kind}.txt", dictionary)
    return found


def task_data_folder(task) -> str:
    cfg = getattr(task, "cfg", None) or getattr(task, "args", None)
    return first_data_folder(getattr(cfg, "data", None))


def record_of_task(task, data=None):
    """The record of the dictionaries ``task`` holds (None where it holds none)."""
    dictionaries = _task_dictionaries(task)
    if not dictionaries:
        return None
    return {
        "version": RECORD_VERSION,
        "data": first_data_folder(data) if data else task_data_folder(task),
        "dictionaries": {
            role: {"file": name, **fingerprint(dictionary)}
            for role, (name, dictionary) in dictionaries.items()
        },
    }


def record_of_data_folder(data, source_lang, target_lang):
    """The record of a translation data folder's ``dict.<src>.txt`` and ``dict.<tgt>.txt``
    as fairseq's translation task loads them."""
    from fairseq.data import Dictionary

    dictionaries = {}
    for role, lang in (("source", source_lang), ("target", target_lang)):
        name = f"dict.{lang}.txt"
        path = os.path.join(first_data_folder(data), name)
        if not os.path.isfile(path):
            raise CheckpointMismatch(
                f"{path}: no such dictionary (the {role} dictionary of {data})"
            )
        dictionaries[role] = {"file": name, **fingerprint(Dictionary.load(path))}
    return {
        "version": RECORD_VERSION,
        "data": first_data_folder(data),
        "dictionaries": dictionaries,
    }


def recorded(state):
    """The record of a loaded checkpoint: in its task state, or at its top level
    (version 0.3.0); None for a checkpoint whose task recorded none."""
    if not isinstance(state, Mapping):
        return None
    task_state = state.get("task_state")
    for holder in (task_state if isinstance(task_state, Mapping) else {}, state):
        record = holder.get(RECORD_KEY)
        if isinstance(record, Mapping) and isinstance(record.get("dictionaries"), Mapping):
            return record
    return None


def file_record(state, record) -> None:
    """Put ``record`` in the task state of the checkpoint ``state`` (where the task puts it)."""
    state.pop(RECORD_KEY, None)
    task_state = state.get("task_state")
    state["task_state"] = {
        **(task_state if isinstance(task_state, Mapping) else {}),
        RECORD_KEY: record,
    }


def embedding_rows(state):
    """``{role: rows}`` of the checkpoint's token embeddings (fairseq's encoder-decoder
    names; roles whose key is absent are left out)."""
    model = state.get("model") if isinstance(state, Mapping) else None
    rows = {}
    for role, key in EMBEDDING_KEYS.items():
        tensor = model.get(key) if isinstance(model, Mapping) else None
        if tensor is not None and getattr(tensor, "dim", lambda: 0)() == 2:
            rows[role] = int(tensor.shape[0])
    return rows


def what_checks_read(state):
    """The part of a loaded checkpoint that the checks read: its record, configuration
    and token embeddings (to keep it without the other weights)."""
    model = state.get("model") or {}
    return {
        RECORD_KEY: recorded(state),
        "cfg": state.get("cfg"),
        "args": state.get("args"),
        "model": {key: model[key] for key in EMBEDDING_KEYS.values() if key in model},
    }


def trained_data_folder(state) -> str:
    """Where the checkpoint says its data came from: its record, else ``cfg.task.data``."""
    record = recorded(state)
    if record and record.get("data"):
        return str(record["data"])
    cfg = _configuration(state) or {}
    task = _plain(cfg.get("task")) if isinstance(cfg, Mapping) else None
    data = task.get("data") if isinstance(task, dict) else None
    if data is None:
        model = _plain(cfg.get("model")) if isinstance(cfg, Mapping) else None
        data = model.get("data") if isinstance(model, dict) else None
    return first_data_folder(data) if data else "an unknown data folder"


def dictionary_differences(record, current):
    """``[(role, recorded entry, current entry)]`` of the dictionaries both records hold
    and that differ."""
    ours, theirs = record.get("dictionaries") or {}, current.get("dictionaries") or {}
    return [
        (role, ours[role], theirs[role])
        for role in ours
        if role in theirs
        and (ours[role].get("size"), ours[role].get("sha256"))
        != (theirs[role].get("size"), theirs[role].get("sha256"))
    ]


def describe_dictionaries(differences, first_name, second_name):
    """``"source and target dictionaries (dict.en.txt, dict.de.txt) differ from those"``
    and how, for ``differences`` between the first and the second."""
    roles = [f"{r.split(':', 1)[1]} tag" if r.startswith("tag:") else r for r, _, _ in differences]
    files = ", ".join(dict.fromkeys(str(first.get("file")) for _, first, _ in differences))
    if len(roles) == 1:
        what = f"{roles[0]} dictionary ({files}) differs from the one"
    else:
        what = f"{', '.join(roles[:-1])} and {roles[-1]} dictionaries ({files}) differ from those"
    role, first, second = differences[0]
    if first.get("size") == second.get("size"):
        rows = (
            ("labels", "row of the tag head", "label")
            if role.startswith("tag:")
            else ("words", "embedding row", "word")
        )
        how = (
            f"the same size ({first.get('size')} types) but other {rows[0]} or another order, "
            f"so every {rows[1]} would stand for another {rows[2]}"
        )
    else:
        how = f"{first.get('size')} types in {first_name}, {second.get('size')} in {second_name}"
    return what, how


def check_dictionaries(state, current, checkpoint, hint="", new_tag_heads=False):
    """Raise :class:`CheckpointMismatch` when the checkpoint (loaded ``state`` of the file
    ``checkpoint``) was trained with other dictionaries than ``current`` (a record).
    ``new_tag_heads`` (a new training from the checkpoint's weights): a tag head whose
    dictionary differs is dropped from ``state["model"]`` instead, to start as initialised.
    Returns False when the checkpoint has no record and could only be compared by its
    embedding sizes, True otherwise."""
    record = recorded(state)
    hint = f". {hint}" if hint else ""
    if record is not None:
        differences = dictionary_differences(record, current)
        labels = [d for d in differences if d[0].startswith("tag:")] if new_tag_heads else []
        refused = [d for d in differences if d not in labels]
        if refused:
            what, how = describe_dictionaries(refused, "the checkpoint's", "the data folder's")
            raise CheckpointMismatch(
                f"{checkpoint} was trained on {record.get('data')}, whose {what} "
                f"in {current.get('data')}: {how}{hint}"
            )
        for role, _, _ in labels:  # (only once nothing is refused)
            drop_tag_head(state, role.split(":", 1)[1])
        return True
    rows = embedding_rows(state)
    for role, entry in (current.get("dictionaries") or {}).items():
        if role in rows and rows[role] != entry.get("size"):
            raise CheckpointMismatch(
                f"{checkpoint} was trained on {trained_data_folder(state)}, with another {role} "
                f"dictionary than {entry.get('file')} of {current.get('data')}: {rows[role]} types in "
                f"the checkpoint's embeddings, {entry.get('size')} in the data folder's{hint}"
            )
    return False


def drop_tag_head(state, kind) -> None:
    """Remove the weights of the ``kind`` tag head from the checkpoint's ``state``."""
    prefix = f"encoder.tag_heads.heads.{kind}."
    model = state.get("model") or {}
    for key in [k for k in model if k.startswith(prefix)]:
        del model[key]
    logger.warning(
        f"the {kind} tag dictionary differs from the one the checkpoint was trained with: "
        f"its {kind} tag head is left out and starts as initialised"
    )


# --------------------------------------------------------------------------- model options


def _plain(value):
    """Configuration values as plain comparable data (tuples and lists are equal)."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _configuration(state):
    """The checkpoint's configuration as {section: value}, converting the ``args`` of
    checkpoints written before fairseq 0.10 the way fairseq itself does."""
    cfg = state.get("cfg")
    if cfg is not None and not isinstance(cfg, Mapping):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # not an omegaconf object either
            cfg = None
    if cfg is not None and cfg.get("model") is not None:
        return cfg
    args = state.get("args")
    if args is None:
        return None
    try:
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted = convert_namespace_to_omegaconf(args)
        return {key: converted[key] for key in converted}
    except Exception:  # an architecture or task that is not registered here
        return {"model": args}


def model_options(state, path):
    """{option: value} of the model configuration of a loaded checkpoint (or of any
    ``{"cfg": configuration}``).

    A model whose architecture is registered the pre-dataclass way (ours and fairseq's
    ``transformer`` are) has an ``argparse.Namespace`` of every command-line option as
    its model section; options that fairseq also files under another section (common,
    dataset, optimization, checkpoint, task, criterion, ...) are options of the run, not
    of the model, and are left out, as are :data:`IGNORED_MODEL_KEYS`.
    """
    cfg = _configuration(state)
    if cfg is None:
        raise CheckpointMismatch(f"{path}: no model configuration (neither cfg.model nor args)")
    model = cfg["model"]
    options = _plain(model)
    if not isinstance(options, dict):
        raise CheckpointMismatch(f"{path}: unreadable model configuration ({type(model).__name__})")
    if isinstance(model, argparse.Namespace):
        elsewhere = set()
        for section, value in cfg.items():
            if section != "model" and isinstance(_plain(value), dict):
                elsewhere.update(_plain(value))
        options = {k: v for k, v in options.items() if k not in elsewhere}
    return {k: v for k, v in options.items() if k not in IGNORED_MODEL_KEYS}


def config_differences(reference, options):
    """[(option, first value, this value)] for every option that differs, the
    architecture first (when it differs, it says the most)."""
    differences = []
    for key in sorted(set(reference) | set(options), key=lambda k: (k != "arch", k)):
        missing = "<not set>"
        first, this = reference.get(key, missing), options.get(key, missing)
        if first != this:
            differences.append((key, first, this))
    return differences


def option_name(key) -> str:
    return f"--{key.replace('_', '-')}"


def more_options(differences) -> str:
    """`` (and N more: --a, --b ...)`` for the differences after the first."""
    if len(differences) < 2:
        return ""
    others = [option_name(key) for key, _, _ in differences[1:]]
    return f" (and {len(others)} more: {', '.join(others[:5])}{' ...' if len(others) > 5 else ''})"


def check_resumed_options(state, current_cfg, checkpoint):
    """Raise :class:`CheckpointMismatch` when the run being resumed from ``checkpoint``
    now has other model options than the checkpoint was trained with."""
    differences = config_differences(
        model_options(state, checkpoint), model_options({"cfg": current_cfg}, "the command line")
    )
    if not differences:
        return
    key, saved, now = differences[0]
    raise CheckpointMismatch(
        f"{checkpoint} was trained with other model options than this run has: {option_name(key)} "
        f"{saved!r} in the checkpoint, {now!r} now{more_options(differences)}. Resume with the run's "
        "own options, or start a new run in another --save-dir (--reset-optimizer starts a new "
        "training from these weights)"
    )
