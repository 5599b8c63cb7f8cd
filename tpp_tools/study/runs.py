"""The runs: their identities and commands, and each run's steps (train or resume,
average, translate, score), each skipped when done."""

import hashlib
import json
import os
import queue
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ..recover import finished_updates
from ..train import VARIABLES as TRAIN_VARIABLES
from ..train import option_words
from ..user_dir import plugin_dir
from .commands import CHILDREN, RunLock, StepTimeout, json_records, log, run_command
from .config import TAG_FIELDS, VARIANTS, Config, StudyError, identity_config
from .data import fingerprint, split_size
from .records import (
    load_record,
    training_environment,
    validation_curve,
    write_atomic,
    write_record,
)

#: part of every run's identity: raised whenever a change of the code changes what a
#: run computes from the same command (initial weights, numerics), so that runs made
#: before it are trained again instead of reused next to runs made after it.
RUN_VERSION = 2


@dataclass
class Run:
    variant: str
    seed: int
    folder: Path
    train_cmd: List[str]
    spec: dict

    @property
    def name(self) -> str:
        return f"{self.variant}-s{self.seed}"


def intervals(cfg: Config):
    save = cfg.save_interval_updates or max(1, cfg.max_update // 10)
    valid = cfg.validate_interval_updates or max(1, cfg.max_update // 10)
    return save, valid


#: the study's runs group their batches once per process, fairseq's default (tpp-train
#: regroups them every epoch): the runs were made so, and a run's identity names what it
#: computes; a configuration may say otherwise in its ``extra`` (``wmt14-big`` does)
GROUPED_ONCE = {"update_epoch_batch_itr": "False"}


def train_command(
    variant: str, seed: int, cfg: Config, data: Path, folder: Path, device: str, extra: List[str]
) -> List[str]:
    """The run's training: ``tpp-train`` (the project's one fairseq-train command line, which
    also resumes, recovers a torn checkpoint and finds a run finished) with the run's
    settings, and after ``--`` the model's and the study's own fairseq options."""
    v = VARIANTS[variant]
    save, valid = intervals(cfg)
    recipe = {
        # the study holds the run folder's lock for each of the run's commands (a SLURM
        # job the save dir's too): tpp-train takes none of its own
        "no_lock": True,
        "data": data,
        "save_dir": folder / "checkpoints",
        "user_dir": plugin_dir(),
        "arch": v["arch"],
        "task": v["task"],
        "criterion": v["criterion"],
        "label_smoothing": cfg.label_smoothing,
        "lr": cfg.lr,
        "warmup_updates": cfg.warmup_updates,
        "max_tokens": cfg.max_tokens,
        "update_freq": cfg.update_freq,
        "max_update": cfg.max_update,
        "seed": seed,
        "save_interval_updates": save,
        "keep_interval_updates": cfg.average,
        "log_format": "json",
        "log_interval": max(1, valid // 4),
        "log_file": folder / "train.log",
        "cpu": device == "cpu",
        "fp16": cfg.dtype == "fp16",
        "no_fp16": cfg.dtype != "fp16",
    }
    sides = ("encoder", "decoder")
    model = {
        **{f"{side}_embed_dim": cfg.embed_dim for side in sides},
        **{f"{side}_ffn_embed_dim": cfg.ffn_dim for side in sides},
        **{f"{side}_attention_heads": cfg.heads for side in sides},
        **{f"{side}_layers": cfg.layers for side in sides},
        "conv_head_scaling": (
            cfg.conv_head_scaling if v["conv"] and cfg.conv_head_scaling != "none" else None
        ),
        **{f"{side}_normalize_before": cfg.layer_norm == "pre" for side in sides},
        "share_all_embeddings": cfg.shared_embeddings == "all",
        "share_decoder_input_output_embed": cfg.shared_embeddings == "decoder",
        "dropout": cfg.dropout,
        "attention_dropout": cfg.attention_dropout,
        "activation_dropout": cfg.activation_dropout,
        **{
            name: getattr(cfg, name)
            for name, default in TAG_FIELDS.items()
            if v.get("tags") and getattr(cfg, name) != default
        },
        "bf16": cfg.dtype == "bf16",
    }
    schedule = {
        "save_interval": 1000000,
        "validate_interval_updates": valid,
        "validate_interval": 1000000,
        "no_progress_bar": True,
        "num_workers": 1 if device == "cuda" else 0,
        # cfg.gpus devices per run (the runs go in parallel, each on its own GPUs where there
        # are several: gpu_slots): fairseq's default is every GPU it sees, data-parallel,
        # which would multiply the batch and make the parallel runs share one rendezvous port
        "distributed_world_size": cfg.gpus,
        "skip_invalid_size_inputs_valid_test": True,
    }
    if "--update-epoch-batch-itr" not in [*cfg.extra, *extra]:
        schedule.update(GROUPED_ONCE)
    words = option_words(recipe) + ["--", *v["model"], *option_words({**model, **schedule})]
    return ["tpp-train", *(str(word) for word in words), *cfg.extra, *extra]


def plan_runs(args, cfg: Config, data: Path) -> List[Run]:
    """The runs; before the data folder is prepared (a dry run) their ids, which depend
    on its dictionaries, are not known yet and read ``<id>``."""
    runs = []
    data_id = fingerprint(data) if data.is_dir() else None
    # seed by seed: the runs that go first (and, stopped midway, finish first) are every
    # variant's first seed, which a report can compare
    for seed in args.seeds:
        for variant in args.variants:
            spec = {
                "variant": variant,
                "seed": seed,
                "config": identity_config(cfg, variant),
                "data": data_id,
                "extra": args.extra,
                "device": args.device,
            }
            if RUN_VERSION > 1:  # version 1: the runs made before the field existed
                spec["run_version"] = RUN_VERSION
            run_id = (
                hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]
                if data_id is not None
                else "<id>"
            )
            folder = args.out / "runs" / f"{variant.replace('+', '_')}-s{seed}-{run_id}"
            cmd = train_command(variant, seed, cfg, data, folder, args.device, args.extra)
            runs.append(Run(variant, seed, folder, cmd, spec))
    return runs


def check_commands(args, cfg: Config) -> None:
    """Refuse, before any data is made, options that would fail every run: each variant's
    training command as ``tpp-train`` and fairseq-train would read it (the options after
    ``--`` included), on a data folder still to be made."""
    from .. import train

    # the runs' trainings do not see tpp-train's variables (_train): nor does this check
    hidden = {name: os.environ.pop(name) for name in TRAIN_VARIABLES if name in os.environ}
    try:
        for variant in args.variants:
            folder = args.out / "runs" / f"{variant}-check"
            data = args.out / "data"
            words = train_command(variant, 1, cfg, data, folder, args.device, args.extra)
            try:
                options = train.parse_args(words[1:])
                train.check_fairseq_arguments(train.fairseq_command(options)[1:])
            except train.TrainError as err:
                raise StudyError(
                    f"the {variant} runs' training would refuse its options: {err}"
                ) from None
    finally:
        os.environ.update(hidden)


def trained_updates(run: Run) -> int:
    done = run.folder / "train.done"
    if done.exists():
        return int(done.read_text().split()[0])
    return 0


def run_state(run: Run) -> str:
    """What a run is doing, read from its folder: finished (its record), a process at
    work in it (the folder's lock held), trained but not scored, stopped, not started."""
    import fcntl

    from .records import RECORD

    if (run.folder / RECORD).exists():
        return "finished"
    lock = run.folder / ".lock"
    if lock.exists():
        with open(lock, "rb") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = handle.read(300).decode("utf-8", "replace").strip()
                # "process P on host H, since DATE TIME: command"
                return f"running ({holder.split(': ', 1)[0]})" if holder else "running"
    if (run.folder / "train.done").exists():
        return "trained, not scored"
    if (run.folder / "train.log").exists():
        return "stopped"
    return "not started"


#: a run's training clock (:func:`start_clock`)
CLOCK = "train.clock"


def start_clock(run: Run) -> dict:
    """The clock of a training about to start (or resume), written to the run's folder:
    when it starts, at which update, and the seconds its earlier trainings took (each
    until its log's last line). fairseq's own ``wall`` cannot tell: it restarts at 0 in
    a resumed training."""
    clock = {"earlier": clock_seconds(run, nan=False), "started": time.time()}
    saved = saved_updates(run)  # (where it resumes: the log may have gone further)
    clock["updates"] = 0 if saved is None else saved
    log_file = run.folder / "train.log"  # (its records from here on are this training's)
    clock["offset"] = log_file.stat().st_size if log_file.exists() else 0
    write_atomic(run.folder / CLOCK, json.dumps(clock).encode())
    return clock


def stop_clock(run: Run) -> None:
    """The clock of a training whose command has returned: when it stopped."""
    clock = read_clock(run)
    if clock is not None:
        clock["stopped"] = time.time()
        write_atomic(run.folder / CLOCK, json.dumps(clock).encode())


def read_clock(run: Run) -> Optional[dict]:
    try:
        clock = json.loads((run.folder / CLOCK).read_text())
        clock.setdefault("offset", 0)
        keys = ("earlier", "started", "updates", "offset") + (
            ("stopped",) if "stopped" in clock else ()
        )
        return {key: float(clock[key]) for key in keys}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clock_seconds(run: Run, nan: bool = True) -> float:
    """The seconds the run's trainings took: each until its command returned, or, one
    that never returned (killed with its machine), until its log's last line (NaN, or 0
    where not ``nan``, without a clock: a run trained before clocks were kept)."""
    clock, log_file = read_clock(run), run.folder / "train.log"
    if clock is None or not ("stopped" in clock or log_file.exists()):
        return float("nan") if nan else 0.0
    stopped = clock["stopped"] if "stopped" in clock else log_file.stat().st_mtime
    return clock["earlier"] + max(0.0, stopped - clock["started"])


def training_eta(run: Run, max_update: int) -> Optional[float]:
    """Seconds the run's training still needs to reach ``max_update``: the time per
    update since it last started (or resumed), times the updates left; None before its
    first update."""
    clock = read_clock(run)
    updates = None if clock is None else latest_updates(run, int(clock["offset"]))
    if updates is None or updates <= clock["updates"]:
        return None
    per_update = (time.time() - clock["started"]) / (updates - clock["updates"])
    return max(0, max_update - updates) * per_update


def eta_text(seconds: Optional[float]) -> str:
    if seconds is None:
        return "—"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def logged_updates(run: Run) -> int:
    """The most updates the run's training log reports (its trainings, resumed or not)."""
    updates = [
        int(r.get("train_num_updates", r.get("num_updates", 0)) or 0)
        for r in json_records(run.folder / "train.log")
    ]
    return max(updates, default=0)


def latest_updates(run: Run, offset: int = 0) -> Optional[int]:
    """The updates of the last record of the run's training log (after byte ``offset``,
    where a training that resumed began to write): a resumed training's may be below
    what the log reached before it stopped."""
    try:
        with open(run.folder / "train.log", "rb") as handle:
            handle.seek(offset)
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line) if line.startswith("{") else {}
        except ValueError:
            continue
        if "num_updates" in record:
            return int(float(record["num_updates"]))
    return None


def saved_updates(run: Run) -> Optional[int]:
    """The updates of the run's ``checkpoint_last.pt`` (what a resumed training starts
    from), None without a readable one."""
    from ..checkpoint_files import CheckpointError, load_checkpoint, num_updates

    last = run.folder / "checkpoints" / "checkpoint_last.pt"
    if not last.exists():
        return None
    try:
        return num_updates(load_checkpoint(last, mmap=True))
    except CheckpointError:
        return None


def visible_gpus() -> List[str]:
    """The GPUs this process may use: as ``CUDA_VISIBLE_DEVICES`` names them where it is
    set, else by index."""
    import torch

    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        return [g.strip() for g in named.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_slots(parallel: int, gpus: List[str], per_run: int = 1) -> "queue.Queue[str]":
    """One slot per run that may go at once, the GPUs dealt out in turn (``per_run`` to a
    run): a run takes a slot (its GPUs) for its training and evaluation and gives it back
    when done."""
    if per_run > len(gpus):
        raise StudyError(
            f"each run trains on {per_run} GPUs (--gpus-per-run) but {len(gpus)} are visible"
        )
    groups = [",".join(gpus[i : i + per_run]) for i in range(0, len(gpus) - per_run + 1, per_run)]
    slots = queue.Queue()
    for i in range(parallel):
        slots.put(groups[i % len(groups)])
    return slots


def execute(run: Run, cfg: Config, paths, args) -> None:
    """Train (or resume), average, evaluate one run; on a GPU, on the one its slot names
    (``args.gpu_slots``)."""
    if CHILDREN.stopping.is_set():  # told to stop: a run not started is not started
        raise RuntimeError("the study is stopping")
    slots = getattr(args, "gpu_slots", None)
    if slots is None:
        return _execute(run, cfg, paths, args, {})
    gpu = slots.get()
    try:
        return _execute(run, cfg, paths, args, {"CUDA_VISIBLE_DEVICES": gpu})
    finally:
        slots.put(gpu)


def _execute(run: Run, cfg: Config, paths, args, env_extra: Dict[str, str]) -> None:
    """:func:`execute`'s steps, each skipped when done, the last writing the run's record;
    ``env_extra`` added to the commands' environment."""
    if load_record(run, paths["reference"]) is not None:
        return  # finished here, or elsewhere and its record merged (--records)
    run.folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run.folder, run.name)
    try:
        if getattr(args, "launcher", None) != "slurm":  # (a SLURM job holds it: slurm.RunJob)
            lock.hold_save_dir(run.folder / "checkpoints")
        _steps(run, cfg, paths, args, env_extra, lock)
    finally:
        lock.close()


def _steps(run: Run, cfg: Config, paths, args, env_extra: Dict[str, str], lock) -> None:
    """The steps of :func:`_execute`, each command holding the run folder's ``lock``."""
    (run.folder / "run.json").write_text(
        json.dumps(
            {
                **run.spec,
                "train_command": " ".join(shlex.quote(c) for c in run.train_cmd),
                "device_name": args.device_name,
                "environment": training_environment(),
            },
            indent=1,
        )
        + "\n"
    )
    env = dict(os.environ, **env_extra)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONWARNINGS"] = "ignore"
    if args.device == "cpu" or args.launcher == "local":  # (a cluster's job: its own CPUs)
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    _train(run, cfg, env, lock)
    if not (run.folder / "checkpoint_avg.pt").exists():
        _average(run, cfg, args, env, lock)
    _translate(run, cfg, paths, args, env, lock)
    write_record(run, paths["reference"], args.device_name)
    if not args.keep_checkpoints:  # the averaged model is what the study keeps
        ckpt = run.folder / "checkpoints"
        for path in list(ckpt.glob("checkpoint_*_*.pt")) + [ckpt / "checkpoint_best.pt"]:
            path.unlink(missing_ok=True)


def _train(run: Run, cfg: Config, env, lock) -> None:
    """Train the run through tpp-train (or resume it) unless it is finished; mark it
    finished (``train.done``)."""
    finished = finished_updates(run.folder / "checkpoints", cfg.max_update)
    if trained_updates(run) < cfg.max_update and finished is not None:
        # trained to the end, stopped before it was marked so: finished means finished
        (run.folder / "train.done").write_text(
            f"{finished} updates, {clock_seconds(run):.0f} s (found finished)\n"
        )
    if trained_updates(run) >= cfg.max_update:
        return
    log(f"{run.name}: training ({cfg.max_update} updates) in {run.folder}")
    start_clock(run)
    # tpp-train of this Python, with the run's options only (none from the environment):
    # an interrupted run resumes, a torn checkpoint_last.pt set aside first
    try:
        run_command(
            [sys.executable, "-m", "tpp_tools.train", *run.train_cmd[1:]],
            run.folder / "run.log",
            env={k: v for k, v in env.items() if k not in TRAIN_VARIABLES},
            lock=lock,
            progress=lambda: training_progress(run, cfg),
        )
    finally:  # (a folder copied elsewhere keeps it: its files' times need not)
        stop_clock(run)
    updates = logged_updates(run)
    if updates < cfg.max_update:
        raise RuntimeError(
            f"{run.name}: fairseq-train stopped at update {updates} of {cfg.max_update}"
        )
    seconds = clock_seconds(run)
    (run.folder / "train.done").write_text(f"{updates} updates, {seconds:.0f} s\n")
    log(f"{run.name}: trained ({updates} updates) in {seconds:.0f} s")


def _average(run: Run, cfg: Config, args, env, lock) -> None:
    """Average the run's last ``cfg.average`` interval checkpoints (fewer if there are)."""
    ckpt = run.folder / "checkpoints"
    n = min(cfg.average, len(list(ckpt.glob("checkpoint_*_*.pt"))))
    log(f"{run.name}: averaging the last {n} checkpoints")
    options = {
        "inputs": ckpt,
        "num_update_checkpoints": n,
        "output": run.folder / "checkpoint_avg.pt",
    }
    cmd = [sys.executable, "-m", "tpp_tools.average", *option_words(options)]
    _step(run, "averaging", cmd, run.folder / "run.log", env, args.step_timeout, lock)


def _translate(run: Run, cfg: Config, paths, args, env, lock) -> None:
    """Translate the test set with the averaged model and score it (tpp-evaluate)."""
    log(f"{run.name}: translating the test set")
    options = {
        "data": paths["data"],
        "checkpoint": run.folder / "checkpoint_avg.pt",
        "reference": paths["reference"],
        "out": run.folder / "eval",
        "force": True,
        "max_tokens": args.gen_max_tokens,
        "cpu": args.device == "cpu",
    }
    cmd = [sys.executable, "-m", "tpp_tools.evaluate", *option_words(options)]
    if args.device != "cpu" and cfg.dtype == "fp16":
        # float16 decoding for a model trained in float16 only: fairseq-generate 0.12 has
        # no bfloat16 inference, and a model trained in float32 or bfloat16 need not keep
        # its activations within float16's range (those decode in float32)
        cmd += ["--", "--fp16"]
    started = time.time()
    sentences = split_size(paths["data"], "test")
    _step(
        run,
        "translating",
        cmd,
        run.folder / "run.log",
        env,
        args.step_timeout,
        lock,
        progress=lambda: translation_progress(run, sentences),
    )
    log(f"{run.name}: translated and scored in {time.time() - started:.0f} s")


def training_progress(run: Run, cfg: Config) -> None:
    """A log line of a training's progress: updates, last validation NLL, ETA."""
    records = json_records(run.folder / "train.log")
    updates = latest_updates(run) or 0
    valid = validation_curve(records)
    nll = f", valid NLL {valid[-1]['nll_loss']:.3f}" if valid else ""
    eta = eta_text(training_eta(run, cfg.max_update))
    log(f"{run.name}: training, update {updates} of {cfg.max_update}{nll}, ETA {eta}")


def translation_progress(run: Run, sentences: Optional[int]) -> None:
    """A log line of a translation's progress: sentences translated so far, and ETA."""
    from ..evaluate import TEMP_PREFIX

    outputs = sorted((run.folder / "eval").glob(f"{TEMP_PREFIX}*/generate-*.txt"))
    if not outputs or not sentences:
        return
    started = outputs[-1].stat().st_ctime
    with open(outputs[-1], errors="replace") as handle:
        done = sum(1 for line in handle if line.startswith("H-"))
    elapsed = time.time() - started
    eta = eta_text((sentences - done) * elapsed / done if done else None)
    log(f"{run.name}: translating, {done} of {sentences} sentences, ETA {eta}")


def _step(run: Run, what: str, cmd, out_log: Path, env, timeout, lock=None, progress=None) -> None:
    """One of a run's steps after training, under its time limit, tried twice (a step
    that hangs, e.g. a process that printed its last line and never exits, costs one
    try, not the run)."""
    for attempt in (1, 2):
        try:
            return run_command(cmd, out_log, env=env, timeout=timeout, lock=lock, progress=progress)
        except StepTimeout:
            if attempt == 2:
                raise StudyError(
                    f"{run.name}: {what} stopped at its time limit of {timeout:.0f} s twice "
                    f"(--step-timeout; log {out_log})"
                ) from None
            log(
                f"{run.name}: {what} stopped at its time limit of {timeout:.0f} s "
                "(--step-timeout); trying once more"
            )
