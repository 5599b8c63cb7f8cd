"""Does Transformer++ translate better than the Transformer? The quality study.

Four variants, trained with the same data, budget, schedule and dimensions, several
seeds each: (a) ``transformer``, fairseq's own; (b) ``control``, ``transformer_pp`` with 0
conv heads and no tag losses (the same network built by the plugin); (c) ``hybrid``, the
hybrid heads; (d) ``hybrid+tags``, the hybrid heads and the POS/NER losses:
Transformer++. Every run is averaged and scored on the test set (sacreBLEU with its
signature, chrF, tokenised compound-split BLEU); every variant is compared with the
first by sacreBLEU's paired bootstrap over all its seeds' translations; curves and
commands go to one Markdown report (docs/study.md).

Data: raw text (``--corpus PREFIX``; valid and test sets carved out of it unless
``--valid``/``--test`` give them), prepared by the project's pipeline; or a prepared
folder (``--data``) with its raw test reference (``--test-reference``).

    tpp-study --config cpu --corpus corpora/en-de/train -s en -t de --out runs/study_cpu
    tpp-study --config gpu-short --data DIR --test-reference DIR/raw/test.de --seeds 1,2 --out runs/study_gpu_short
    tpp-study ... --report-only       # the report of whatever has finished, at any time
    tpp-study ... --only transformer-s1,hybrid-s1 --pack records.tar.gz   # some runs here ...
    tpp-study ... --records records.tar.gz other/ --report-only  # ... merged with others'
    # the paper's scale on a SLURM cluster, every run a job of 4 GPUs (docs/slurm.md):
    tpp-study --config wmt14-big --launcher slurm --partition gpu --data data-bin/wmt14_en_de \\
        --test-reference work/wmt14_en_de/raw/test.de --variants transformer,hybrid,hybrid+tags --out runs/wmt14

Runs live in ``OUT/runs/<variant>-s<seed>-<id>/`` (``hybrid_tags`` for ``hybrid+tags``),
``<id>`` a hash of everything that defines the run: a re-run reuses finished runs and
resumes interrupted ones, and any change of a setting is a new run; a finished run's
record (``record.json.gz``) is all the report reads. Options after ``--`` go to every
fairseq-train command.
"""

import argparse
import importlib.util
import os
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from .commands import CHILDREN, json_records, log
from .config import CONFIGS, PROG, VARIANTS, Config, StudyError, check_config, check_tag_settings
from .data import prepare_data
from .records import (
    RECORD,
    check_pack_path,
    nearest_folder,
    import_records,
    read_record,
    validation_curve,
)
from .plan import check_pack_now, mergeable, plan_or_report, report_finished, select_runs
from .runs import (
    check_commands,
    eta_text,
    execute,
    gpu_slots,
    logged_updates,
    plan_runs,
    run_state,
    saved_updates,
    training_eta,
    visible_gpus,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--config",
        choices=sorted(CONFIGS),
        default="gpu",
        help="model size, budget, schedule and data preparation (default gpu)",
    )
    _add_data_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--variants",
        default="transformer,control,hybrid,hybrid+tags",
        help=f"from {', '.join(VARIANTS)}; the first is the baseline of the tests",
    )
    p.add_argument("--seeds", default="1,2,3")
    _add_override_arguments(p)
    _add_tag_arguments(p)
    _add_run_arguments(p)
    _add_mode_arguments(p)
    p.add_argument("extra", nargs="*", help="options after -- go to every fairseq-train command")
    from . import slurm

    slurm.add_arguments(p)
    args = p.parse_args(argv)
    _check_arguments(p, args)
    return args


def _add_data_arguments(p) -> None:
    src = p.add_argument_group("data (raw text, or a prepared folder)")
    src.add_argument(
        "--corpus", help="PREFIX of the raw parallel training text PREFIX.{src,tgt}[.xz]"
    )
    src.add_argument("-s", "--source-lang")
    src.add_argument("-t", "--target-lang")
    src.add_argument("--valid", help="PREFIX of a raw valid set (default: carved from --corpus)")
    src.add_argument("--test", help="PREFIX of a raw test set (default: carved from --corpus)")
    src.add_argument("--valid-size", type=int, default=1000)
    src.add_argument("--test-size", type=int, default=2000)
    src.add_argument("--split-seed", type=int, default=1)
    src.add_argument("--data", type=Path, help="a prepared data folder (instead of --corpus)")
    src.add_argument("--test-reference", type=Path, help="with --data: the raw test target")
    src.add_argument("--test-source", type=Path, help="with --data: the raw test source (optional)")
    src.add_argument(
        "--bpe-codes", type=Path, help="with --data: its BPE codes (for the fire/mountain analysis)"
    )
    src.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="data preparation processes"
    )


def _add_override_arguments(p) -> None:
    over = p.add_argument_group("overrides of the configuration (each changes the runs' identity)")
    for name, kind in (
        ("max_update", int),
        ("max_tokens", int),
        ("update_freq", int),
        ("lr", float),
        ("warmup_updates", int),
        ("embed_dim", int),
        ("ffn_dim", int),
        ("heads", int),
        ("layers", int),
        ("dropout", float),
        ("average", int),
        ("dtype", str),
        ("bpe_merges", int),
        ("max_len", int),
        ("save_interval_updates", int),
        ("validate_interval_updates", int),
    ):
        over.add_argument("--" + name.replace("_", "-"), type=kind, dest=name)
    over.add_argument(
        "--gpus-per-run",
        type=int,
        dest="gpus",
        help="GPUs per run, data-parallel: an update is GPUs x --update-freq batches (default 1; "
        "wmt14-big: 4)",
    )
    over.add_argument(
        "--conv-head-scaling",
        choices=["none", "inv-sqrt-head-dim"],
        dest="conv_head_scaling",
        help="the hybrid variants' --conv-head-scaling (default: inv-sqrt-head-dim, and "
        "none, the paper's, in wmt14-big; see docs/results_cpu.md)",
    )
    over.add_argument(
        "--layer-norm",
        choices=["post", "pre"],
        dest="layer_norm",
        help="post: after each residual sum (the paper's; the default but for gpu and "
        "gpu-short); pre: before each sublayer",
    )


def _add_tag_arguments(p) -> None:
    tag = p.add_argument_group(
        "the tag losses of hybrid+tags (other variants ignore them; each changes its runs' identity)"
    )
    tag.add_argument(
        "--encoder-tag-layers",
        dest="encoder_tag_layers",
        metavar="TAG:LAYER,...",
        help="after which encoder layer each tag head sits (default pos:1,ner:2: the paper's)",
    )
    tag.add_argument(
        "--tag-loss-weights",
        dest="tag_loss_weights",
        metavar="TAG:W,...",
        help="each tag loss's weight (default pos:1,ner:1: the paper's)",
    )
    tag.add_argument(
        "--tag-loss-decay-updates",
        type=int,
        dest="tag_loss_decay_updates",
        metavar="N",
        help="every tag weight falls linearly to 0 at update N (default 0: constant, the paper's)",
    )


def _add_run_arguments(p) -> None:
    """How and where the runs run."""
    p.add_argument(
        "--launcher",
        choices=["local", "slurm"],
        default="local",
        help="local: the runs as processes on this machine (default); slurm: every run a SLURM job "
        "and the report a job after them (docs/slurm.md)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cuda if available (with --launcher slurm: cuda)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="runs at once (default: 4 on a GPU, cores/threads on the CPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads per run (default: 1 on the CPU; on a GPU, the cores shared among "
        "the runs at once)",
    )
    p.add_argument(
        "--gen-max-tokens",
        type=int,
        default=None,
        help="tokens per generation batch (default: 8192 on a GPU, 4096 on the CPU)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="time limit of a run's averaging and of its translating and scoring, each tried "
        "twice (default: 1800 on a GPU, 7200 on the CPU)",
    )


def _add_mode_arguments(p) -> None:
    """Which runs, what comes from elsewhere or goes there, and what the study does."""
    p.add_argument(
        "--only",
        metavar="RUN,...",
        help="run only these of the planned runs (e.g. transformer-s1,hybrid-s1); the report "
        "covers every finished one",
    )
    p.add_argument(
        "--records",
        nargs="+",
        type=Path,
        metavar="FOLDER|ARCHIVE|RECORD",
        help="merge the records of runs finished elsewhere (folders, searched recursively, "
        "--pack archives, or record.json.gz files): each goes to this study's run of the same identity (settings, data), "
        "checked against its test reference, and is then a finished run, not trained again; "
        "records of other runs or studies are left out and named",
    )
    p.add_argument(
        "--pack",
        type=Path,
        metavar="ARCHIVE",
        help="at the end, write the finished runs' records and translations (no checkpoints) "
        "to this .tar.gz (replacing one that holds records of other runs only with --force)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="let --pack replace an archive that holds records of runs it would not pack again",
    )
    p.add_argument("--bootstrap-samples", type=int, default=1000)
    p.add_argument(
        "--keep-checkpoints", action="store_true", help="keep every run's interval checkpoints"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the runs and their commands, run nothing"
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: the report of the runs that have finished (evaluated), the others "
        "listed as not finished; the baseline variant needs at least one",
    )
    p.add_argument(
        "--status",
        action="store_true",
        help="train nothing: every planned run's state, updates done and last validation loss",
    )


def _check_arguments(p, args) -> None:
    """Refusals argparse cannot make itself (each a usage error naming the option)."""
    if (args.corpus is None) == (args.data is None):
        p.error("give either --corpus (raw text) or --data (a prepared folder)")
    args.variants = [v for v in args.variants.split(",") if v]
    if not args.variants:
        p.error("--variants: name at least one, e.g. transformer,hybrid")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if len(set(args.variants)) != len(args.variants):
        p.error("--variants: a variant is named twice")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error("--seeds: a seed is named twice (one run would be counted as two)")
    outside = [seed for seed in args.seeds if not 0 <= seed < 2**31]
    if outside:  # (tpp-train refuses them: every run would fail after the data is made)
        p.error(f"--seeds: {outside[0]} is not a seed fairseq takes (0 to 2**31 - 1)")
    if len(args.seeds) < 2:
        p.error(
            "--seeds: at least two seeds (a single run cannot tell a difference from seed noise)"
        )
    if args.only is not None:
        args.only = [name for name in args.only.split(",") if name]
        if not args.only:
            p.error("--only: name at least one run, e.g. transformer-s1")
        names = [f"{variant}-s{seed}" for seed in args.seeds for variant in args.variants]
        unknown = [name for name in args.only if name not in names]
        if unknown:  # (now: not after the data is carved and prepared)
            p.error(
                f"--only: {', '.join(unknown)} not among this study's runs ({', '.join(names)})"
            )
    args.variants_need_tags = "hybrid+tags" in args.variants


def main(argv=None) -> int:
    """tpp-study; a :class:`StudyError` (or the data pipeline's error) is one line,
    ``tpp-study: error: ...``, and its exit status."""
    from tpp_pipeline.errors import UserError, report

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except UserError as err:  # the study's (StudyError) and the data pipeline's
        return report(PROG, err)


def _config(args) -> Config:
    """The configuration with the options' overrides, checked (a :class:`StudyError`)."""
    cfg = CONFIGS[args.config]
    cfg = Config(
        **{
            **asdict(cfg),
            # (the options after -- are args.extra, added to the configuration's own extra)
            **{
                k: getattr(args, k)
                for k in asdict(cfg)
                if k != "extra" and getattr(args, k, None) is not None
            },
        }
    )
    if cfg.dtype not in ("fp32", "fp16", "bf16"):
        raise StudyError(f"--dtype must be fp32, fp16 or bf16, not {cfg.dtype!r}")
    problem = check_config(cfg) or check_tag_settings(cfg)
    if args.source_lang and args.source_lang == args.target_lang:
        problem = (
            problem or f"-s and -t are both {args.source_lang!r}: a translation needs two languages"
        )
    for name in ("valid_size", "test_size", "workers", "bootstrap_samples", "gen_max_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            problem = (
                problem
                or f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}"
            )
    if problem:
        raise StudyError(problem)
    return cfg


def _settle_device(args, cfg) -> None:
    """The device, precision, runs at once and threads, the device's name and the
    device's defaults, into ``args`` and ``cfg`` (a :class:`StudyError` where they
    cannot be)."""
    import torch

    if args.device is None:  # a cluster's runs go to its GPU nodes, whatever this machine has
        args.device = "cuda" if args.launcher == "slurm" or torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and cfg.dtype != "fp32" and args.dtype is None:
        cfg.dtype = "fp32"
    if args.device == "cpu" and cfg.dtype == "fp16":
        raise StudyError("--dtype fp16 needs a GPU (here --device cpu)")
    for name in ("parallel", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise StudyError(f"--{name} must be at least 1, not {getattr(args, name)}")
    args.parallel, args.threads = runs_and_threads(
        args.device, args.parallel, args.threads, os.cpu_count() or 1
    )
    from . import slurm

    problem = slurm.check_options(args, cfg)
    if problem:
        raise StudyError(problem)
    if args.launcher == "local":  # (a cluster's jobs: check_options named their device)
        if args.device == "cuda" and not torch.cuda.is_available():
            if not (args.dry_run or args.report_only or args.status):
                raise StudyError(
                    f"--device cuda: torch {torch.__version__} sees no CUDA GPU on this machine "
                    "(--dry-run plans a GPU study anywhere, --report-only and --status report on one)"
                )
            args.device_name = "a CUDA GPU (planned on a machine without one)"
        else:
            args.device_name = (
                torch.cuda.get_device_name()
                if args.device == "cuda"
                else f"CPU ({os.cpu_count()} cores)"
            )
    args.gen_max_tokens = args.gen_max_tokens or (8192 if args.device == "cuda" else 4096)
    if args.step_timeout is None:
        args.step_timeout = 1800.0 if args.device == "cuda" else 7200.0
    elif not args.step_timeout > 0:  # (NaN too: no time limit at all)
        raise StudyError(f"--step-timeout must be positive, not {args.step_timeout:g}")


def check_study_folder(out, to_write: bool) -> None:
    """Refuse a study folder (``--out``) that is a file, or, ``to_write``, one that
    cannot be made or written, without writing anything (``--dry-run``, ``--status``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StudyError(f"{out}: is a file, not a folder: --out names the study's folder")
    folder = nearest_folder(out)
    if to_write and not (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)):
        raise StudyError(f"{out}: cannot be written ({folder} is not a writable folder)")


def _main(argv) -> int:
    args = parse_args(argv)
    cfg = _config(args)
    _settle_device(args, cfg)
    if not (args.report_only or args.status):  # (before the study writes anything)
        check_commands(args, cfg)
    from tpp_pipeline.errors import DataError
    from tpp_pipeline.textio import ensure_writable_dir

    if args.dry_run or args.status:  # they write nothing, not even the folder
        check_study_folder(args.out, args.dry_run)
    else:
        try:
            ensure_writable_dir(args.out, "study folder (--out)")
        except DataError as err:
            raise StudyError(str(err)) from None
    if args.pack:  # (before any data is carved)
        check_pack_path(args.pack)
    command = f"{PROG} " + " ".join(shlex.quote(a) for a in argv)
    from . import slurm

    if args.status:
        return show_status(args, cfg)
    if not args.dry_run and importlib.util.find_spec("matplotlib") is None:
        raise StudyError(  # (found now, not at the report after every run)
            "the report draws its curves with matplotlib, which is not installed: "
            "pip install 'tpp-plugin[plots]'"
        )
    from tpp_pipeline.lock import exit_cleanly_on_sigterm, work_dir_lock

    if args.dry_run or args.report_only:  # no command to stop: leave through the finally blocks
        exit_cleanly_on_sigterm()  # (which remove a half-written --pack)
    if args.dry_run or (args.report_only and not args.records):
        # they write no run: no lock, another study may be running
        status = plan_or_report(args, cfg, command)
        if args.dry_run and args.launcher == "slurm" and status == 0:
            return slurm.dry_run(args, cfg)
        return status
    if args.report_only:  # records copied into the runs' folders: not beside a running study
        with work_dir_lock(args.out, user="tpp-study", folder="study folder"):
            return plan_or_report(args, cfg, command)

    def stop(
        signum, frame
    ):  # SIGTERM (kill, a scheduler's limit), SIGINT, SIGHUP (terminal closed)
        log(
            f"{signal.Signals(signum).name}: stopping the runs' commands; the same command resumes the study"
        )
        CHILDREN.signal_stop()
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # (nohup's SIGHUP stays ignored)
            signal.signal(signum, stop)
    with work_dir_lock(args.out, user="tpp-study", folder="study folder"):
        try:
            return (slurm.submit if args.launcher == "slurm" else study)(args, cfg, command)
        finally:  # told to stop: the lock goes once the commands have ended
            if CHILDREN.stopping.is_set():
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(signum, signal.SIG_IGN)
                CHILDREN.stop()


def runs_and_threads(device: str, parallel, threads, cores: int):
    """(runs at once, CPU threads per run): on the CPU one thread a run and as many runs as
    cores; on a GPU four runs, sharing the cores (as torchrun shares them among its
    processes: eight runs of 16 threads each on 16 cores would oversubscribe them)."""
    if device == "cuda":
        parallel = parallel or 4
        return parallel, threads or max(1, cores // parallel)
    threads = threads or 1
    return parallel or max(1, cores // threads), threads


def show_status(args, cfg: Config) -> int:
    """--status: one line per planned run (writes nothing, takes no lock)."""
    paths = prepare_data(args, cfg, plan_only=True)
    runs = select_runs(args, plan_runs(args, cfg, paths["data"]))
    if not paths["prepared"]:
        print(f"the data folder {paths['data']} is not prepared yet: no run has started")
    print(f"| run | state | updates of {cfg.max_update} | last valid NLL | training ETA | folder |")
    print("|---|---|---:|---:|---:|---|")
    jobs = {}
    if args.launcher == "slurm":
        from .slurm import job_notes

        jobs = job_notes(args.out)
    merged = mergeable(args, runs, paths)
    for run in runs:
        print(status_row(run, cfg.max_update, jobs.get(run.folder.name), run.name in merged))
    return 0


def status_row(run, max_update: int, job: Optional[str] = None, merged=False) -> str:
    """--status' line of one run: its state (with its SLURM ``job``, where one was
    submitted; a run whose record ``--records`` holds is finished elsewhere), updates (a
    stopped run's as logged, and as saved where its last checkpoint, which it resumes
    from, has fewer), last validation loss and training ETA."""
    recorded = run.folder / RECORD
    state, eta = run_state(run), None
    if job and state != "finished":
        state += f" ({job})"
    if merged and state != "finished":
        state = f"finished elsewhere (its record in --records); here {state}"
    if recorded.exists():  # (a run merged from elsewhere has no log here)
        valid = read_record(recorded)["valid"]
        updates = valid[-1]["updates"] if valid else max_update
    else:
        records = json_records(run.folder / "train.log")
        valid = validation_curve(records)
        updates = logged_updates(run)
        if state.startswith("running"):
            eta = training_eta(run, max_update)
        elif updates:
            saved = saved_updates(run)
            if saved is not None and saved < updates:
                updates = f"{updates} ({saved} saved)"
    nll = f"{valid[-1]['nll_loss']:.3f}" if valid else "—"
    return f"| {run.name} | {state} | {updates} | {nll} | {eta_text(eta)} | {run.folder} |"


def study(args, cfg: Config, command: str) -> int:
    """Prepare, train, average, translate and report (the lock of ``args.out`` held)."""
    started = time.time()
    try:
        paths = prepare_data(args, cfg)
    except RuntimeError as err:  # the data pipeline failed: its log's last lines
        raise StudyError(f"preparing the data: {err}", status=1) from None
    runs = plan_runs(args, cfg, paths["data"])
    if args.records:
        import_records(args.records, runs, paths["reference"])
    todo = select_runs(args, runs)
    check_pack_now(args, runs, todo, paths["reference"])  # (not after the runs)
    where = args.device_name
    if args.device == "cuda":
        gpus = visible_gpus()
        args.gpu_slots = gpu_slots(args.parallel, gpus, cfg.gpus)
        where += f" ({len(gpus)} visible: each run on {cfg.gpus} of {', '.join(gpus)})"
    log(
        f"{len(todo)} runs"
        + (
            f" of {len(runs)} (--only)"
            if len(todo) < len(runs)
            else f" ({len(args.variants)} variants x {len(args.seeds)} seeds)"
        )
        + f", {args.parallel} at a time on {where}, {args.threads} CPU thread(s) each"
    )
    failures = []
    pool = ThreadPoolExecutor(max_workers=args.parallel)
    try:
        futures = {pool.submit(execute, run, cfg, paths, args): run for run in todo}
        for future, run in futures.items():
            try:
                future.result()
                log(f"{run.name}: done")
            except Exception as err:  # keep the other runs going; report at the end
                failures.append((run, err))
                log(f"{run.name}: FAILED: {err}")
    finally:  # told to stop: the runs not started are not started
        pool.shutdown(wait=True, cancel_futures=True)
    try:
        report, done = report_finished(args, cfg, paths, runs, command, started)
    except StudyError as err:  # (the pack failed: said before the runs that failed)
        if not failures:
            raise
        log(f"error: {err}")
        report = getattr(err, "report", None)
    if failures:
        raise StudyError(
            f"{len(failures)} run(s) failed; re-run the same command to resume:\n"
            + "\n".join(f"  {run.name}: {str(err).splitlines()[0]}" for run, err in failures),
            status=1,
        )
    if report is None:
        log(f"no report: no run of the baseline {args.variants[0]} has finished yet")
        return 0
    log(f"report: {report}")
    print(report.read_text())
    return 0
