"""Train Transformer++ with fairseq-train: the training recipe, written once.

``tpp-train`` (and ``scripts/train.sh``, which runs it) turns a preset and overrides into
a fairseq-train command line and runs it; the study (``tpp-study``) and the demo train
through it, and the benchmarks build their options with :func:`fairseq_arguments`.

The recipe (Thapak & Hore 2020, IV, which follows "Attention Is All You Need"): Adam
with betas (0.9, 0.98) and the Transformer's learning-rate schedule, fairseq's
``inverse_sqrt`` (linear warm-up over 4,000 updates to the peak, then decay with
1/sqrt(update)); the peak 5e-4 is d^-0.5 · warmup^-0.5 for d = 1024 (4.9e-4). Label
smoothing 0.1; dropouts from the ``--arch`` preset. 320K updates of 10 accumulated
batches of 4,096 tokens per GPU (the paper gives no batch size; 4,096 is fairseq's usual
choice for big Transformers). Adam's epsilon: the paper gives none; fairseq's default
1e-8, with which the study's published runs were trained.

Before fairseq starts: ``--max-update`` must be positive (fairseq reads 0 as no
limit); the save dir's lock is taken (one training per save dir, held by fairseq-train
itself, which this process becomes); a torn ``checkpoint_last.pt`` is recovered
(``tpp-recover-checkpoint``); a run whose ``checkpoint_last.pt`` has reached
``--max-update`` is finished and nothing is trained. Under torchrun these are rank 0's
steps; the other ranks do what it decided (:class:`JobVerdict`).
"""

import argparse
import fcntl
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Mapping, Sequence

from tpp_pipeline import project_root
from tpp_pipeline.errors import UserError, report

from .user_dir import PluginNotFound, plugin_dir

PROG = "tpp-train"

#: the optimiser and schedule of every training of the project (the peak, the warm-up
#: and the batch come from the preset or the caller)
OPTIMIZER = {
    "optimizer": "adam",
    "adam_betas": "(0.9, 0.98)",
    "adam_eps": "1e-8",
    "clip_norm": "0.0",
    "weight_decay": "0.0",
    "lr_scheduler": "inverse_sqrt",
    "warmup_init_lr": "1e-07",
}

#: the recipe's options that only some of fairseq's optimizers or schedules take, and
#: which: left out where another one is chosen after ``--``
TAKEN_BY = {
    "adam_betas": ("optimizer", {"adam", "cpu_adam"}),
    "adam_eps": ("optimizer", {"adam", "cpu_adam"}),
    "warmup_init_lr": ("lr_scheduler", {"inverse_sqrt", "cosine", "reduce_lr_on_plateau", "step"}),
    "warmup_updates": (
        "lr_scheduler",
        {"inverse_sqrt", "cosine", "reduce_lr_on_plateau", "step", "fixed", "polynomial_decay"},
    ),
}

#: every epoch's batches grouped anew from the seed and the epoch, so that a run resumed
#: in a later epoch trains on the batches an uninterrupted run would (fairseq otherwise
#: groups them once, with the seed of the epoch the process starts in)
RESUMABLE = {"update_epoch_batch_itr": "True"}

#: preset -> (arch, peak lr, default data folder under the project)
PRESETS = {
    "en-de": ("transformer_pp_wmt_en_de_big", "5e-4", "data-bin/wmt14_en_de"),
    "en-fr": ("transformer_pp_wmt_en_fr_big", "5e-4", "data-bin/wmt14_en_fr"),
    "base": ("transformer_pp", "7e-4", "data-bin/wmt14_en_de"),
    "cpu": ("transformer_pp_cpu", "1e-3", "runs/demo/data-bin/sample_en_de"),  # tpp-demo's
    "tiny": ("transformer_pp_tiny", "7e-4", "runs/demo/data-bin/sample_en_de"),
}

#: option -> (environment variable, default); a flag beats the variable
SETTINGS = {
    "task": ("TASK", "translation_with_tags"),
    "criterion": ("CRITERION", "label_smoothed_cross_entropy_with_tags"),
    "warmup_updates": ("WARMUP_UPDATES", "4000"),
    "label_smoothing": ("LABEL_SMOOTHING", "0.1"),
    "max_tokens": ("MAX_TOKENS", "4096"),
    "update_freq": ("UPDATE_FREQ", "10"),
    "max_update": ("MAX_UPDATE", "320000"),
    "save_interval_updates": ("SAVE_INTERVAL_UPDATES", "1000"),
    "keep_interval_updates": ("KEEP_INTERVAL_UPDATES", "10"),
    "seed": ("SEED", "1"),
    "log_format": ("LOG_FORMAT", "simple"),
    "log_interval": ("LOG_INTERVAL", "100"),
}

#: every environment variable tpp-train reads but torchrun's (a program that runs it with
#: options of its own removes them, so that none of a user's leaks in)
VARIABLES = (
    "FAIRSEQ_TRAIN",
    "PRESET",
    "DATA_BIN",
    "SAVE_DIR",
    "ARCH",
    "USER_DIR",
    "LR",
    "LOG_FILE",
    "CPU",
    "FP16",
    *(variable for variable, _ in SETTINGS.values()),
)
PRECISIONS = (
    "--fp16",
    "--memory-efficient-fp16",
    "--bf16",
    "--memory-efficient-bf16",
    "--amp",
    "--cpu",
)


class TrainError(UserError):
    """Bad input: reported as one line, exit status 2."""


def gpu_visible() -> bool:
    """Whether a GPU is there for fairseq (nvidia-smi lists the node's GPUs whatever
    CUDA_VISIBLE_DEVICES hides)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def _variable(name, default=None):
    """A variable's value; empty is unset, as in a shell's ``${NAME:-default}``."""
    return os.environ.get(name) or default


def parse_args(argv):
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="Every setting is also an environment variable (PRESET, DATA_BIN, "
        "SAVE_DIR, ARCH, LR, MAX_TOKENS, ...: the option's name in capitals); a flag "
        "beats the variable. Options after -- go to fairseq-train as they are "
        "(fairseq keeps the last value of a repeated option).",
        allow_abbrev=False,
    )
    p.add_argument(
        "--preset",
        default=_variable("PRESET", "en-de"),
        choices=sorted(PRESETS),
        help="en-de, en-fr (the paper's big models), base, cpu (the CPU demo's) or tiny",
    )
    p.add_argument("--data", default=_variable("DATA_BIN"), help="data folder [per preset]")
    p.add_argument("--save-dir", default=_variable("SAVE_DIR"), help="[checkpoints/<preset>]")
    p.add_argument("--arch", default=_variable("ARCH"), help="[per preset]")
    p.add_argument("--user-dir", default=_variable("USER_DIR"), help="[the installed tpp_plugin]")
    p.add_argument("--lr", default=_variable("LR"), help="peak learning rate [per preset]")
    for name, (variable, default) in SETTINGS.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            default=_variable(variable, default),
            help=f"[{default}]",
        )
    p.add_argument("--log-file", default=_variable("LOG_FILE"), help="[<save-dir>/train.log]")
    p.add_argument(
        "--cpu", action="store_const", const="1", default=_variable("CPU", "0"), help="[0]"
    )
    fp16 = p.add_mutually_exclusive_group()
    fp16.add_argument(
        "--fp16",
        dest="fp16",
        action="store_const",
        const="1",
        default=_variable("FP16", "auto"),
        help="[on where a GPU is visible and no other precision or --cpu comes after --]",
    )
    fp16.add_argument("--no-fp16", dest="fp16", action="store_const", const="0")
    p.add_argument(
        "--no-recover", action="store_true", help="do not check checkpoint_last.pt first"
    )
    p.add_argument(
        "--recover-only",
        action="store_true",
        help="only check (and if need be recover) checkpoint_last.pt; status 3 when finished",
    )
    p.add_argument(
        "--no-lock",
        action="store_true",
        help="do not take the save dir's lock: the caller holds it for this training (a "
        "study, a job for its tasks)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    args = p.parse_args(argv)
    # (argparse checks what a flag gives, not a default taken from a variable)
    for variable, value, allowed in (
        ("PRESET", args.preset, sorted(PRESETS)),
        ("CPU", args.cpu, ("0", "1")),
        ("FP16", args.fp16, ("auto", "0", "1")),
    ):
        if value not in allowed:
            p.error(f"{variable}={value!r}: expected one of {', '.join(allowed)}")
    args.cpu = args.cpu == "1"
    args.extra = extra
    return args


def _positive_float(text) -> bool:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return False
    return value > 0 and value == value and value != float("inf")


def fairseq_train_program() -> str:
    """fairseq-train beside this Python (its environment need not be activated), else
    the one on PATH."""
    beside = Path(sys.executable).parent / "fairseq-train"
    return str(beside) if beside.exists() else "fairseq-train"


def option_words(options: Mapping[str, object]) -> List[str]:
    """``--name value`` for each of ``options`` (``_`` in a name is ``-``): True stands for
    the flag alone, None or False for no option."""
    words = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words.append(str(value))
    return words


def fairseq_arguments(data, options: Mapping[str, object], extra: Sequence = ()) -> List[str]:
    """fairseq-train's arguments for a training of the project, built here only: the data
    folder, ``options``, the recipe's optimiser, schedule and epoch batches where
    ``options`` do not replace them, and ``extra`` as given (fairseq keeps the last of a
    repeated option)."""
    recipe = {**OPTIMIZER, **RESUMABLE}
    options = {**options, **{name: v for name, v in recipe.items() if name not in options}}
    given = options_given(extra)
    chosen = {
        name: given.get("--" + name.replace("_", "-"), options[name])
        for name in ("optimizer", "lr_scheduler")
    }
    options = {  # (another optimizer or schedule after --: fairseq refuses what it does not take)
        name: value
        for name, value in options.items()
        if name not in TAKEN_BY or chosen[TAKEN_BY[name][0]] in TAKEN_BY[name][1]
    }
    return [str(data), *option_words(options), *map(str, extra)]


def options_given(extra: Sequence) -> dict:
    """The options among ``extra`` (given as OPTION VALUE or OPTION=VALUE) with their last
    value, as fairseq keeps it."""
    given = {}
    words = [str(word) for word in extra]
    for word, following in zip(words, [*words[1:], ""]):
        option, equals, value = word.partition("=")
        if option.startswith("--"):
            given[option] = value if equals else following
    return given


def fairseq_command(args):
    """The fairseq-train command line of ``args`` (checked)."""
    arch, lr, data = PRESETS[args.preset]
    for name in ("data", "save_dir", "arch", "user_dir", "lr", "log_file"):
        if getattr(args, name) == "":  # (a variable's empty value is unset: a flag's is not)
            raise TrainError(f"--{name.replace('_', '-')} is empty: give a value or leave it out")
    root = project_root()
    args.arch = args.arch or arch
    args.lr = args.lr or lr
    args.data = args.data or str(root / data)
    args.save_dir = args.save_dir or str(root / "checkpoints" / args.preset)
    args.log_file = args.log_file or str(Path(args.save_dir) / "train.log")
    if args.user_dir is None:
        try:
            args.user_dir = str(plugin_dir())
        except PluginNotFound as error:
            raise TrainError(str(error)) from None
    for word in args.extra:  # what tpp-train uses itself is given to it, not to fairseq only
        option = word.split("=", 1)[0]
        if option in ("--save-dir", "--log-file"):
            raise TrainError(
                f"{option} after --: give it before -- (tpp-train takes the save dir's lock, "
                "recovers its checkpoint and writes its log where these options point)"
            )
        if option == "--user-dir":
            raise TrainError(
                "--user-dir after --: give it before -- (fairseq would load that folder "
                "instead of the plugin tpp-train passes, whose models it trains)"
            )
    given = options_given(args.extra)
    for option in (
        "--max-update",
        "--max-tokens",
        "--update-freq",
        "--lr",
        "--warmup-updates",
        "--seed",
        "--label-smoothing",
        "--save-interval-updates",
        "--log-interval",
    ):
        if option in given:
            setattr(args, option[2:].replace("-", "_"), given[option])
    check_settings(args)
    device = precision(args)
    options = {
        "user_dir": args.user_dir,
        "task": args.task,
        "arch": args.arch,
        "criterion": args.criterion,
        "label_smoothing": args.label_smoothing,
        **OPTIMIZER,
        "lr": args.lr,
        "warmup_updates": args.warmup_updates,
        "max_tokens": args.max_tokens,
        "update_freq": args.update_freq,
        "max_update": args.max_update,
        "save_dir": args.save_dir,
        "save_interval_updates": args.save_interval_updates,
        "keep_interval_updates": args.keep_interval_updates,
        "no_epoch_checkpoints": True,
        "seed": args.seed,
        "log_format": args.log_format,
        "log_interval": args.log_interval,
        "log_file": args.log_file,
        "cpu": device == "cpu",
        "fp16": device == "fp16",
    }
    program = os.environ.get("FAIRSEQ_TRAIN") or fairseq_train_program()
    return [program, *fairseq_arguments(args.data, options, args.extra)]


def precision(args):
    """What tpp-train adds: "cpu" (``--cpu``), "fp16" (``--fp16``) or None (neither: a
    precision given after ``--`` is fairseq's to take)."""
    asked = [opt for opt in args.extra if opt in PRECISIONS]
    if args.cpu:
        if args.fp16 == "1":
            raise TrainError("--fp16 needs a GPU (drop --cpu or --fp16)")
        for opt in asked:  # (bf16 trains on CPUs)
            if opt in ("--fp16", "--memory-efficient-fp16", "--amp"):
                raise TrainError(f"{opt} (after --) needs a GPU: drop --cpu or {opt}")
        return "cpu"
    if asked:  # fairseq's to take: --fp16 is not added next to it
        other = next((opt for opt in asked if opt != "--fp16"), None)
        if args.fp16 == "1" and other is not None:
            raise TrainError(f"--fp16 and {other} (after --) ask for two precisions: keep one")
        return None
    return "fp16" if args.fp16 == "1" or (args.fp16 == "auto" and gpu_visible()) else None


def check_settings(args) -> None:
    """Refuse a setting fairseq would take and train badly with, or fail on late."""
    if not args.max_update.isdecimal() or int(args.max_update) < 1:
        raise TrainError(
            f"--max-update must be a positive number of updates, not '{args.max_update}' "
            "(fairseq reads 0 as no limit)"
        )
    for name in (
        "max_tokens",
        "update_freq",
        "save_interval_updates",
        "log_interval",
        "warmup_updates",  # (fairseq's inverse_sqrt divides by it)
    ):
        if not str(getattr(args, name)).isdecimal() or int(getattr(args, name)) < 1:
            raise TrainError(
                f"--{name.replace('_', '-')} must be a positive whole number, not "
                f"'{getattr(args, name)}'"
            )
    if not str(args.seed).isdecimal() or int(args.seed) >= 2**31:  # (fairseq adds the epoch)
        raise TrainError(f"--seed must be a whole number from 0 to 2**31 - 1, not '{args.seed}'")
    if not _positive_float(args.lr):
        raise TrainError(f"--lr must be a positive number, not '{args.lr}'")
    try:
        smoothing = float(args.label_smoothing)
    except ValueError:
        smoothing = -1.0
    if not 0 <= smoothing < 1:
        raise TrainError(f"--label-smoothing must be in [0, 1), not '{args.label_smoothing}'")


def check_fairseq_arguments(arguments: Sequence[str]) -> None:
    """Raise :class:`TrainError` with fairseq-train's own message where it would refuse
    ``arguments`` (its command line without the program), parsed here by fairseq's
    parser, and where the plugin's model would refuse its options (``check_args``): for
    a caller about to start many trainings (a study), not after it has made their data."""
    import contextlib
    import io

    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parsed = options.parse_args_and_arch(options.get_training_parser(), arguments)
    except SystemExit:  # argparse's error: its last line, "PROG: error: ..."
        lines = said.getvalue().strip().splitlines() or ["(no message)"]
        raise TrainError(lines[-1].split("error: ", 1)[-1]) from None
    except ValueError as err:  # fairseq's own refusals (--fp16 on a TPU), the plugin's
        raise TrainError(str(err)) from None
    check = getattr(ARCH_MODEL_REGISTRY.get(parsed.arch), "check_args", None)
    if check is not None:
        try:
            check(parsed)
        except ValueError as err:  # the plugin's OptionError
            raise TrainError(str(err)) from None


#: seconds a killed trainer's data loader processes may hold its lock: they inherit it
#: and notice their parent's death within a few seconds
LOADER_GRACE = 20.0


def _holder_gone(holder: str) -> bool:
    """The lock's record names a process of this host that no longer exists."""
    import re

    found = re.match(r"process (\d+) on host (\S+),", holder)
    if not found or found.group(2) != socket.gethostname():
        return False
    try:
        os.kill(int(found.group(1)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _flock_within(fd: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.2)
    return False


def remove_partial_checkpoints(save_dir: Path) -> None:
    """fairseq writes a checkpoint as ``<name>.tmp`` and renames it when complete: one
    left behind (a full disk, a kill) is never read, only takes room. Removed with the
    save dir's lock held, so that no training is writing it."""
    # (fairseq's, and the copies of tpp-recover-checkpoint: .checkpoint_last.pt.XXXX.tmp)
    for partial in sorted([*save_dir.glob("*.pt.tmp"), *save_dir.glob(".checkpoint*.pt.*.tmp")]):
        size = partial.stat().st_size
        partial.unlink()
        print(
            f"{PROG}: removed {partial} ({size / 2**20:.1f} MiB), a checkpoint an earlier "
            "run did not finish writing",
            file=sys.stderr,
        )


def follows_rank_0() -> bool:
    """A rank other than 0 of a data-parallel job started by torchrun (through
    tpp-fairseq-rank): the save dir's lock and the repair of its checkpoint are
    the job's, taken by rank 0, which alone writes checkpoints."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ["RANK"]) > 0
    except (KeyError, ValueError):
        return False


def take_lock(save_dir: Path, argv) -> int:
    """The save dir's lock (``flock`` on ``.lock``), as a descriptor that fairseq-train
    inherits: the kernel releases it when that process ends, however it ends. Held
    still although the process it names is gone (its data loaders inherited it), it is
    waited for, up to ``LOADER_GRACE`` seconds."""
    path = save_dir / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 500, 0).decode("utf-8", "replace").strip()
        if _holder_gone(holder) and _flock_within(fd, LOADER_GRACE):
            pass  # the trainer had died; its data loader processes have let go
        else:
            os.close(fd)
            raise TrainError(
                f"another training is using the save dir {save_dir} "
                f"({holder or 'a process that has not recorded itself'}); wait for it to finish "
                "or stop it"
            ) from None
    record = (
        f"process {os.getpid()} on host {socket.gethostname()}, started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(argv)[:400]}\n"
    ).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    os.set_inheritable(fd, True)
    return fd


class JobVerdict:
    """Under torchrun, what rank 0 decided before training (train, or end with an exit
    status: finished, refused), published in torchrun's own store. The other ranks follow
    it instead of reading checkpoints that rank 0 may be repairing: a rank that trains
    alone waits at fairseq's rendezvous for ever."""

    #: seconds the other ranks wait for rank 0's verdict (its checkpoint repair included)
    TIMEOUT = 1800.0

    def __init__(self, store, rank: int, key: str):
        self.store, self.rank, self.key = store, rank, key

    @classmethod
    def of_this_job(cls):
        """The job's verdict, or None outside a multi-process torchrun job (torchrun's
        agent holds the store its workers join at MASTER_ADDR:MASTER_PORT)."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError):
            return None
        if world <= 1:
            return None
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=cls.TIMEOUT))
        # the n-th tpp-train of each rank in this torchrun attempt reads the n-th verdict
        prefix = f"tpp-train/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        call = store.add(f"{prefix}/calls/{rank}", 1)
        return cls(store, rank, f"{prefix}/{call}/verdict")

    def publish(self, status) -> None:
        """Rank 0's decision: None to train, else the status every rank exits with."""
        self.store.set(self.key, "train" if status is None else str(status))

    def wait(self):
        """Rank 0's decision, as :meth:`publish` was given it."""
        said = self.store.get(self.key).decode()
        return None if said == "train" else int(said)

    def close(self) -> None:
        self.store = None


def prepare(args, argv, cmd):
    """Rank 0's (or a single process's) steps before fairseq-train: the save dir's lock,
    half-written checkpoints removed, ``checkpoint_last.pt`` recovered. None to train,
    else the exit status (3: finished, with ``--recover-only``)."""
    save_dir = Path(args.save_dir)
    if not follows_rank_0():
        if not args.no_lock:  # (with --no-lock, the caller holds it)
            take_lock(save_dir, [PROG, *argv])
        remove_partial_checkpoints(save_dir)
    if args.no_recover:
        return 0 if args.recover_only else None
    from . import recover

    # the fairseq options as fairseq will see them (--save-dir, --restore-file,
    # --checkpoint-suffix and --max-update may also come after --; the last counts)
    fairseq_options = [str(c) for c in cmd[2:]]
    if follows_rank_0():  # no verdict to follow: only see whether it is finished
        seen = recover.parse_args(fairseq_options)
        finished = recover.finished_updates(
            seen.save_dir, seen.max_update, seen.restore_file, seen.checkpoint_suffix
        )
        status = 0 if finished is None else 3
    else:
        status = recover.recover_held(fairseq_options)  # (this process holds the lock)
    if status == 3:  # finished: it said so
        return 3 if args.recover_only else 0
    if status != 0:
        return status
    return 0 if args.recover_only else None


#: what the plugin checks in the fairseq-train it runs (tpp_fairseq): all unless set
CHECKS = "TPP_FAIRSEQ_CHECKS"


def resumed_from(cmd):
    """The checkpoint fairseq-train ``cmd`` resumes from, None where it starts afresh."""
    from . import recover

    seen = recover.parse_args([str(c) for c in cmd[2:]])
    if seen.restore_file == recover.DEFAULT_RESTORE_FILE:
        path = Path(seen.save_dir) / f"checkpoint_last{seen.checkpoint_suffix}.pt"
    else:
        path = Path(recover.restore_path(seen.restore_file, seen.checkpoint_suffix))
    return path if path.is_file() else None


def check_joined(cmd) -> None:
    """Under torchrun on CPUs, fairseq joins the processes only with the rank options
    tpp-fairseq-rank adds: without them each would train alone into the same save dir."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        return
    if "TORCHELASTIC_RUN_ID" not in os.environ or world <= 1 or "--cpu" not in cmd:
        return
    if "--distributed-world-size" not in options_given(cmd):
        raise TrainError(
            f"torchrun started {world} processes, and fairseq would not join them on CPUs: "
            "each would train alone into the same --save-dir. Start tpp-train through "
            f"tpp-fairseq-rank: torchrun --no-python --nproc_per_node {here} "
            "tpp-fairseq-rank tpp-train ... -- ..."
        )


def check_paths(args) -> None:
    """Refuse a folder or file fairseq-train cannot use, naming its option; make the save
    dir and the log file's folder, and see that both can be written (fairseq would fail
    at its first log line or checkpoint, with a traceback)."""
    if Path(args.data).exists() and not Path(args.data).is_dir():
        raise TrainError(f"--data '{args.data}' is a file: give the data folder it is in")
    if not Path(args.data).is_dir():
        raise TrainError(f"data folder '{args.data}' does not exist (set --data or DATA_BIN)")
    if not Path(args.user_dir).is_dir():
        raise TrainError(
            f"plugin folder '{args.user_dir}' does not exist (set --user-dir or USER_DIR)"
        )
    for name, folder in (
        ("--save-dir", args.save_dir),
        ("--log-file's folder", Path(args.log_file).parent),
    ):
        if Path(folder).exists() and not Path(folder).is_dir():
            raise TrainError(f"{name} '{folder}' is a file, not a folder")
    if not any(Path(args.data).glob("dict*.txt")):
        raise TrainError(
            f"data folder '{args.data}' has no dictionaries (dict.*.txt): give the folder "
            "fairseq-preprocess or tpp-prepare-corpus wrote"
        )
    if Path(args.log_file).is_dir():
        raise TrainError(f"--log-file '{args.log_file}' is a folder; it names the log file")
    if Path(args.log_file).is_file():  # fairseq appends to it: a log, not a checkpoint
        with open(args.log_file, "rb") as log:
            if b"\0" in log.read(1 << 16):
                raise TrainError(
                    f"--log-file '{args.log_file}' holds binary data, not a log: fairseq "
                    "would append its log to it; name a log file"
                )
    folders = [("--save-dir", Path(args.save_dir))]
    if not Path(args.log_file).exists():  # (one there is appended to: /dev/null, a shared log)
        folders.append(("--log-file's folder", Path(args.log_file).parent))
    for name, folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as error:
            raise TrainError(f"{name} '{folder}' cannot be written: {error.strerror}") from None
    try:
        open(args.log_file, "ab").close()  # (fairseq appends to it)
    except OSError as error:
        raise TrainError(f"--log-file '{args.log_file}' cannot be written: {error.strerror}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:  # every rank checks its own arguments: they are the same
        cmd = fairseq_command(args)
        if args.dry_run:  # the variable too, where tpp-train would set it
            checks = "" if CHECKS in os.environ else f"{CHECKS}=all "
            print(checks + " ".join(shlex.quote(str(c)) for c in cmd))
            return 0
        check_paths(args)
        check_joined(cmd)
        job = JobVerdict.of_this_job()
    except (TrainError, OSError) as error:
        return report(PROG, error)
    if job is not None and job.rank > 0:
        status = job.wait()
        job.close()
        if status is not None:
            if status not in (0, 3):
                print(
                    f"{PROG}: rank {job.rank}: rank 0 stopped before training (status "
                    f"{status}; its message is above); stopping too",
                    file=sys.stderr,
                )
            return status
    else:
        status = 2
        try:
            status = prepare(args, argv, cmd)
        except (TrainError, OSError) as error:
            report(PROG, error)
        finally:
            if job is not None:
                job.publish(status)
                job.close()
        if status is not None:
            return status
    restore = resumed_from(cmd)
    if restore is not None:
        print(f"{PROG}: resuming from {restore}", file=sys.stderr, flush=True)
    # every checkpoint records its dictionaries, whatever the task (unless the caller chose)
    os.environ.setdefault(CHECKS, "all")
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # this process becomes fairseq-train: signals reach it directly, the lock goes with it
        os.execvp(cmd[0], [str(c) for c in cmd])
    except OSError as error:
        print(f"{PROG}: error: cannot run {cmd[0]}: {error.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
