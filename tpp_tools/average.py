"""Average the parameters of several fairseq checkpoints into one checkpoint.

The paper's "stochastic weight averaging (SWA) of the last 10 checkpoints" is, as in the
Transformer recipe it follows, the element-wise mean of the parameters of the last N
checkpoints of one run (no SWA learning-rate schedule, running average or batch-norm update).

    # the last 10 written with --save-interval-updates (checkpoint_<epoch>_<update>.pt)
    tpp-average-checkpoints --inputs checkpoints/en-de --num-update-checkpoints 10 \\
        --output checkpoints/en-de/checkpoint_avg10.pt
    # the last 5 epoch checkpoints (checkpoint<epoch>.pt) up to epoch 30
    tpp-average-checkpoints --inputs checkpoints/en-de --num-epoch-checkpoints 5 \\
        --checkpoint-upper-bound 30 --output avg.pt
    # an explicit list of files
    tpp-average-checkpoints --inputs a.pt b.pt c.pt --output avg.pt

Sums are taken in at least float32. The output keeps the last input's metadata, not the
optimizer state, and is written whole or not at all; ``--force`` replaces an existing one.

Every input must be the same model as the first: parameter names and shapes, and the
model configuration (``cfg.model``: the architecture and every model option, e.g.
dilations, which leave the shapes alone); a difference names the option, both values and
both files, and ``--allow-config-mismatch`` averages anyway. Not compared: the rest of the
run's options and ``IGNORED_MODEL_KEYS`` of ``tpp_fairseq.checkpoint_match`` (e.g.
``--conv-heads-impl``). Other dictionaries, or a file given twice in ``--inputs``, are
refused whatever the options.

Exit status: 0 on success; 2 for an unusable input (missing, not a checkpoint, truncated,
another model or other dictionaries, given twice) or an existing output without ``--force``.
"""

import argparse
import hashlib
import os
import re
import sys
import tempfile
from collections import OrderedDict

import torch

from tpp_pipeline.lock import exit_cleanly_on_sigterm
from tpp_pipeline.errors import UserError, report

from tpp_fairseq import checkpoint_match
from tpp_fairseq.checkpoint_match import IGNORED_MODEL_KEYS, config_differences  # noqa: F401

from .checkpoint_files import CheckpointError
from .checkpoint_files import load_checkpoint as read_checkpoint

PROG = "tpp-average-checkpoints"

# fairseq's file names: checkpoint<epoch>.pt and checkpoint_<epoch>_<update>.pt
EPOCH_PATTERN = re.compile(r"^checkpoint(\d+)\.pt$")
UPDATE_PATTERN = re.compile(r"^checkpoint_\d+_(\d+)\.pt$")


class AveragingError(UserError):
    """A problem with the inputs, reported without a traceback."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Average the parameters of fairseq checkpoints (streaming, one "
        "checkpoint in memory at a time besides the running sum).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--inputs",
        nargs="+",
        required=True,
        metavar="PATH",
        help="checkpoint files, or one directory together with "
        "--num-epoch-checkpoints or --num-update-checkpoints",
    )
    parser.add_argument(
        "--output", required=True, metavar="FILE", help="where to write the averaged checkpoint"
    )
    select = parser.add_mutually_exclusive_group()
    select.add_argument(
        "--num-epoch-checkpoints",
        type=int,
        metavar="N",
        help="average the last N checkpoint<epoch>.pt files of the directory",
    )
    select.add_argument(
        "--num-update-checkpoints",
        type=int,
        metavar="N",
        help="average the last N checkpoint_<epoch>_<update>.pt files",
    )
    parser.add_argument(
        "--checkpoint-upper-bound",
        type=int,
        metavar="K",
        help="ignore checkpoints after epoch K (with --num-epoch-checkpoints) "
        "or after update K (with --num-update-checkpoints)",
    )
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")
    parser.add_argument(
        "--allow-config-mismatch",
        action="store_true",
        help="average checkpoints whose model configurations differ "
        "(a warning lists the differences; the output carries the last "
        "input's configuration)",
    )
    args = parser.parse_args(argv)

    count = args.num_epoch_checkpoints or args.num_update_checkpoints
    if args.num_epoch_checkpoints is not None or args.num_update_checkpoints is not None:
        if count is None or count < 1:
            parser.error("the number of checkpoints to average must be at least 1")
        if len(args.inputs) == 1 and not os.path.exists(args.inputs[0]):
            parser.error(f"--inputs {args.inputs[0]}: no such folder")
        if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
            parser.error(
                "--num-epoch-checkpoints/--num-update-checkpoints need exactly one "
                f"directory in --inputs, got: {' '.join(args.inputs)}"
            )
    elif args.checkpoint_upper_bound is not None:
        parser.error(
            "--checkpoint-upper-bound only applies with --num-epoch-checkpoints "
            "or --num-update-checkpoints"
        )
    return args


def last_checkpoints(directory, count, by_update, upper_bound=None):
    """The ``count`` newest checkpoints of ``directory``, oldest first.

    ``by_update`` selects checkpoint_<epoch>_<update>.pt files ordered by update number,
    otherwise checkpoint<epoch>.pt files ordered by epoch.
    """
    pattern = UPDATE_PATTERN if by_update else EPOCH_PATTERN
    numbered = []
    for name in os.listdir(directory):
        match = pattern.match(name)
        if match is None:
            continue
        number = int(match.group(1))
        if upper_bound is None or number <= upper_bound:
            numbered.append((number, os.path.join(directory, name)))
    numbered.sort()
    kind = "update" if by_update else "epoch"
    if len(numbered) < count:
        bound = f" up to {kind} {upper_bound}" if upper_bound is not None else ""
        raise AveragingError(
            f"{directory}: asked for the last {count} {kind} checkpoints{bound}, found "
            f"{len(numbered)} ({', '.join(os.path.basename(p) for _, p in numbered) or 'none'})"
        )
    return [path for _, path in numbered[-count:]]


def load_checkpoint(path):
    """Map one checkpoint on the CPU with torch's safe unpickler: only the model's
    tensors are read, never the optimizer state."""
    try:
        return read_checkpoint(path, mmap=True)
    except CheckpointError as error:
        raise AveragingError(str(error)) from None


def model_options(state, path):
    """{option: value} of a loaded checkpoint's model configuration
    (:func:`tpp_fairseq.checkpoint_match.model_options`)."""
    try:
        return checkpoint_match.model_options(state, path)
    except checkpoint_match.CheckpointMismatch as error:
        raise AveragingError(
            f"{error}: cannot check that it is the same model as the others"
        ) from None


def accumulation_dtype(dtype):
    """At least float32 for the running sum; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def average_checkpoints(paths, allow_config_mismatch=False):
    """Return a checkpoint whose model parameters are the mean of those in ``paths``."""
    if not paths:
        raise AveragingError("no checkpoints to average")
    sums = None  # name -> running sum (floating) or last value (other dtypes)
    reference = None  # name -> (shape, dtype) of the first checkpoint
    first_path = paths[0]
    first_options = None  # model configuration of the first checkpoint
    first_record = None  # (path, record of its dictionaries) of the first checkpoint that has one
    metadata = None
    fingerprints = {}  # fingerprint -> the input that had it
    for index, path in enumerate(paths):
        state = load_checkpoint(path)
        options = model_options(state, path)
        record = checkpoint_match.recorded(state)
        if record is not None:
            if first_record is None:
                first_record = (path, record)
            else:
                check_same_dictionaries(*first_record, path, record)
        model = state.pop("model")
        key = fingerprint(state, model)
        seen = fingerprints.setdefault(key, index)
        if seen != index:
            raise AveragingError(
                f"{path} holds the same checkpoint as {paths[seen]} (saved at update {key[0]}, the "
                "same parameters): a copy. It would weigh twice in the average; give each "
                "checkpoint once"
            )
        if sums is None:
            reference = OrderedDict((name, (tuple(t.shape), t.dtype)) for name, t in model.items())
            sums = OrderedDict()
            first_options = options
        else:
            check_same_configuration(
                first_options, options, path, first_path, allow_config_mismatch
            )
            check_same_parameters(reference, model, path, first_path)
        for name, tensor in model.items():
            if tensor.is_floating_point():
                if name in sums:
                    sums[name].add_(tensor.to(sums[name].dtype))
                else:
                    sums[name] = tensor.to(accumulation_dtype(tensor.dtype), copy=True)
            else:
                sums[name] = tensor.clone()
        if index == len(paths) - 1:
            metadata = state  # keep the newest checkpoint's configuration and counters
        # unmap this checkpoint before the next one is read: peak memory stays ~2 models
        del model, state

    averaged = OrderedDict()
    for name, total in sums.items():
        _, dtype = reference[name]
        averaged[name] = total.div_(len(paths)).to(dtype) if total.is_floating_point() else total
    # The optimizer state of one input does not belong to the average; generation and
    # fine-tuning with --reset-optimizer do not need it.
    metadata.pop("last_optimizer_state", None)
    metadata["model"] = averaged
    if first_record is not None:  # the inputs' dictionaries (the last input may predate the record)
        checkpoint_match.file_record(metadata, first_record[1])
    metadata["averaged_checkpoints"] = [os.path.basename(p) for p in paths]
    return metadata


def fingerprint(state, model):
    """What tells two checkpoints apart cheaply: the update they were saved at and a hash
    of their small floating-point tensors (biases, layer norms: every update changes
    them). Equal for a checkpoint and its copy (``checkpoint_best.pt`` saved at the last
    update is a copy of ``checkpoint_last.pt``)."""
    history = state.get("optimizer_history") or [{}]
    digest = hashlib.sha256()
    for name, tensor in model.items():
        if tensor.is_floating_point() and tensor.numel() <= 4096:
            digest.update(name.encode())
            digest.update(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return history[-1].get("num_updates"), digest.hexdigest()


def check_same_dictionaries(first_path, first_record, path, record):
    """Raise an error naming both files and data folders when two checkpoints were
    trained with different dictionaries (whatever ``--allow-config-mismatch`` says: the
    rows of their embeddings stand for different words)."""
    differences = checkpoint_match.dictionary_differences(first_record, record)
    if not differences:
        return
    what, how = checkpoint_match.describe_dictionaries(differences, first_path, path)
    raise AveragingError(
        f"{path} was trained on {record.get('data')}, whose {what} of {first_path} (trained on "
        f"{first_record.get('data')}): {how}. Checkpoints trained with different dictionaries "
        "cannot be averaged"
    )


def check_same_configuration(first_options, options, path, first_path, allow_mismatch):
    """Raise an error naming the option (and both values and files) that differs."""
    differences = config_differences(first_options, options)
    if not differences:
        return
    described = [
        f"{checkpoint_match.option_name(key)}: {first!r} in {first_path}, {this!r} in {path}"
        for key, first, this in differences
    ]
    if allow_mismatch:
        print(
            f"{PROG}: warning: averaging checkpoints of different model "
            "configurations (--allow-config-mismatch); the output carries the last "
            "input's configuration:",
            file=sys.stderr,
        )
        for line in described:
            print(f"  {line}", file=sys.stderr)
        return
    raise AveragingError(
        f"{path} is not the same model as {first_path}: model option {described[0]}"
        f"{checkpoint_match.more_options(differences)}. "
        "Averaging the parameters of different models gives a meaningless model; pass "
        "--allow-config-mismatch if you really mean it"
    )


def check_same_parameters(reference, model, path, first_path):
    """Raise an error naming ``path`` if its parameters differ from the first checkpoint's."""
    missing = [name for name in reference if name not in model]
    extra = [name for name in model if name not in reference]
    if missing or extra:
        details = []
        if missing:
            details.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if extra:
            details.append(f"unexpected {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
        raise AveragingError(
            f"{path}: parameter names differ from {first_path} ({'; '.join(details)})"
        )
    for name, tensor in model.items():
        shape, _ = reference[name]
        if tuple(tensor.shape) != shape:
            raise AveragingError(
                f"{path}: parameter {name} has shape {tuple(tensor.shape)}, "
                f"but {shape} in {first_path}"
            )


def check_no_duplicates(paths):
    """Raise an error naming the inputs that are one file (by resolved path, or one file
    under two names: a hard link): averaging it twice would weigh it twice."""
    spellings = {}
    for path in paths:
        try:
            info = os.stat(path)
            key = (info.st_dev, info.st_ino)
        except OSError:  # (named by the loading, with its reason)
            key = os.path.realpath(path)
        spellings.setdefault(key, []).append(path)
    repeated = [given for given in spellings.values() if len(given) > 1]
    if repeated:
        named = "; ".join(
            f"{', '.join(given)} ({len(given)} times {os.path.realpath(given[0])})"
            for given in repeated
        )
        raise AveragingError(
            f"checkpoints given more than once in --inputs: {named}. Each would weigh "
            "as many times in the average; give each checkpoint once"
        )


def save_atomically(state, output, force):
    """Write ``state`` to a temporary file next to ``output``, then rename it."""
    output = os.path.abspath(output)
    if os.path.exists(output) and not force:
        raise AveragingError(f"{output}: already exists (use --force to replace it)")
    directory = os.path.dirname(output)
    os.makedirs(directory, exist_ok=True)
    # (not "*.pt.tmp": a training starting in this folder removes those as its own)
    handle, temporary = tempfile.mkstemp(prefix=".averaging-", suffix=".tmp", dir=directory)
    os.close(handle)
    try:
        torch.save(state, temporary)
        # mkstemp creates the file private (0600); give it the usual umask permissions
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, output)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def main(argv=None):
    args = parse_args(argv)
    exit_cleanly_on_sigterm()  # Ctrl-C, kill: the temporary output removed, no traceback
    try:
        if args.num_update_checkpoints or args.num_epoch_checkpoints:
            by_update = args.num_update_checkpoints is not None
            count = args.num_update_checkpoints if by_update else args.num_epoch_checkpoints
            paths = last_checkpoints(args.inputs[0], count, by_update, args.checkpoint_upper_bound)
        else:
            paths = args.inputs
            for path in paths:
                if os.path.isdir(path):
                    raise AveragingError(
                        f"{path}: is a folder: give --num-update-checkpoints N (or "
                        "--num-epoch-checkpoints N) to average its last N checkpoints"
                    )
                if not os.path.isfile(path):
                    raise AveragingError(f"{path}: no such checkpoint file")
            check_no_duplicates(paths)
        output = os.path.abspath(args.output)
        if any(
            os.path.realpath(p) == os.path.realpath(output)
            or (os.path.exists(output) and os.path.samefile(p, output))
            for p in paths
        ):
            raise AveragingError(f"{args.output}: the output is one of the inputs")
        if os.path.isdir(output):
            raise AveragingError(f"{output}: is a folder: --output names the averaged file")
        if os.path.exists(output) and not args.force:  # fail before the long part
            raise AveragingError(f"{output}: already exists (use --force to replace it)")
        from .evaluate import writable_folder

        writable_folder(os.path.dirname(output), "folder for --output", AveragingError)
        print(f"averaging {len(paths)} checkpoints:", file=sys.stderr)
        for path in paths:
            print(f"  {path}", file=sys.stderr)
        state = average_checkpoints(paths, args.allow_config_mismatch)
        save_atomically(state, args.output, args.force)
    except AveragingError as error:
        return report(PROG, error)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
