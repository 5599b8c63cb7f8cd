"""``tpp-study --launcher slurm``: every run a SLURM job, and the report a job after them.

The jobs are submitted with submitit (a pickled call of :class:`RunJob` or
:class:`ReportJob` each; the pickles, sbatch files and logs in ``OUT/slurm/``, the job
of every run in ``OUT/slurm/jobs.json``). A run's job does for its run what the local
study does (:func:`tpp_tools.study.runs.execute`: train or resume, average, translate, score,
each step skipped when done) while holding the run's save-dir lock. SLURM puts the job
back in the queue after a preemption or a node failure (``--requeue``), submitit puts it
back shortly before its time limit (SIGUSR2, ``helpers.Checkpointable``), and the job
started again resumes from ``checkpoint_last.pt``. The report job waits for every run's
job to end (``afterany``) and writes the report of what finished; runs that did not
finish make it fail, naming their jobs, logs and the command that resumes them.
Submitting the same command again submits only runs that are neither finished nor
queued, and a new report job. As in a local study, ``--only`` names the runs submitted
(and reported missing), and a run whose record ``--records`` brings is not trained.
"""

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from .commands import CHILDREN, log
from .config import PROG, Config, StudyError
from .data import prepare_data
from .records import finished, import_records
from .plan import check_pack_now, plan_or_report, select_runs
from .runs import Run, execute, plan_runs

#: how often one run's job may be put back in the queue at its time limit (preemptions
#: do not count): a run longer than this many time limits fails
MAX_TIME_LIMITS = 50
#: CPUs per GPU of a run's job, unless --cpus-per-run says otherwise
CPUS_PER_GPU = 4
DEFAULT_TIME = "24:00:00"
#: host memory of a GPU run's job unless --mem says otherwise, per GPU (each rank a
#: process with its data loader); a CPU run's job asks for the cluster's default
MEM_PER_GPU_GB = 12
REPORT_TIME_MIN = 120
#: submitit's SIGUSR2 this many seconds before a run's time limit: put back in the queue
SIGNAL_LEAD_S = 120
SLURM_OPTIONS = ("partition", "time_limit", "cpus_per_run", "mem", "account", "sbatch_option")


def time_minutes(text: str) -> int:
    """A SLURM time limit (``MINUTES``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) in
    whole minutes, rounded up (submitit counts in minutes)."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise ValueError(f"not a SLURM time limit: {text!r} (MINUTES, HH:MM:SS or D-HH:MM:SS)")
    days, *fields = match.groups()
    values = [int(f) for f in fields if f is not None]
    if days is not None:
        seconds = int(days) * 86400 + sum(v * m for v, m in zip(values, (3600, 60, 1)))
    else:
        seconds = sum(
            v * m for v, m in zip(values, {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(values)])
        )
    if seconds <= 0:
        raise ValueError(f"a time limit must be positive, not {text!r}")
    return math.ceil(seconds / 60)


def add_arguments(parser) -> None:
    group = parser.add_argument_group("SLURM (--launcher slurm; docs/slurm.md)")
    group.add_argument(
        "--partition", help="partition of every job (default: the cluster's default)"
    )
    group.add_argument(
        "--time-limit",
        help=f"time limit of a run's job (default {DEFAULT_TIME}); a run that needs "
        "more is put back in the queue at the limit and resumes from its checkpoint",
    )
    group.add_argument(
        "--cpus-per-run",
        type=int,
        help=f"CPUs of a run's job (default: {CPUS_PER_GPU} per GPU; "
        "--threads with --device cpu)",
    )
    group.add_argument(
        "--mem",
        help=f"host memory of a run's job, in sbatch's form, 0 for all of a node's memory "
        f"(default {MEM_PER_GPU_GB}G per GPU; with --device cpu the cluster's default)",
    )
    group.add_argument("--account", help="SLURM account to charge")
    group.add_argument(
        "--sbatch-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sbatch option for every job, e.g. mem=64G, qos=high, constraint=a100 "
        "(repeatable)",
    )


def check_options(args, cfg: Config) -> Optional[str]:
    """The launcher's options checked (an error message, or None), completed, and with
    ``--launcher slurm`` the paths made absolute (the jobs may start elsewhere)."""
    if cfg.gpus < 1:
        return f"--gpus-per-run must be at least 1, not {cfg.gpus}"
    if cfg.gpus > 1 and args.device == "cpu":
        given = (
            f"--gpus-per-run {cfg.gpus}"
            if args.gpus
            else f"--config {args.config} ({cfg.gpus} GPUs per run)"
        )
        return f"{given} trains each run on GPUs: not with --device cpu"
    if args.launcher != "slurm":
        given = [name for name in SLURM_OPTIONS if getattr(args, name)]
        if given:
            return (
                f"--{given[0].replace('_', '-')} is an option of --launcher slurm "
                "(the runs go to SLURM only with it)"
            )
        return None
    try:
        import submitit  # noqa: F401
    except ImportError:
        return (
            "--launcher slurm submits the jobs with submitit, which is not installed here: "
            "pip install 'tpp-plugin[slurm]' (in a checkout: scripts/setup_env.sh)"
        )
    try:
        args.time_minutes = time_minutes(args.time_limit or DEFAULT_TIME)
    except ValueError as err:
        return f"--time-limit: {err}"
    if args.time_minutes * 60 <= SIGNAL_LEAD_S:
        return (
            f"--time-limit {args.time_limit}: a run's job is told {SIGNAL_LEAD_S // 60} minutes "
            "before its limit to put itself back in the queue: give it more than that"
        )
    args.sbatch_options = {}
    for option in args.sbatch_option:
        key, sep, value = option.partition("=")
        if not sep or not key.strip():
            return f"--sbatch-option: expected KEY=VALUE (an sbatch option without its dashes), not {option!r}"
        args.sbatch_options[key.strip().lstrip("-")] = value
    if args.cpus_per_run is None:
        args.cpus_per_run = CPUS_PER_GPU * cfg.gpus if args.device == "cuda" else args.threads
    if args.cpus_per_run < 1:
        return f"--cpus-per-run must be at least 1, not {args.cpus_per_run}"
    if "mem" in args.sbatch_options:  # (an earlier way to ask for it; --mem wins)
        mem = args.sbatch_options.pop("mem")
        args.mem = args.mem or mem
    if args.mem is None and args.device == "cuda":
        args.mem = f"{MEM_PER_GPU_GB * cfg.gpus}G"
    if args.mem is not None and not re.fullmatch(r"0|[1-9][0-9]*[KMGT]?", args.mem):
        return (
            f"--mem: expected a size as sbatch takes it (e.g. 64G, or 0 for all of a node's "
            f"memory), not {args.mem!r}"
        )
    for name in ("out", "data", "test_reference", "test_source", "bpe_codes"):
        if getattr(args, name) is not None:
            setattr(args, name, getattr(args, name).absolute())
    args.device_name = (
        f"SLURM jobs, {cfg.gpus} GPU{'s' if cfg.gpus > 1 else ''} per run"
        if args.device == "cuda"
        else f"SLURM jobs, CPU ({args.cpus_per_run} per run)"
    )
    return None


def resources(args, cfg: Config) -> Dict[str, object]:
    """submitit's parameters of a run's job."""
    params = {
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": args.cpus_per_run,
        "time": args.time_minutes,
        "signal_delay_s": SIGNAL_LEAD_S,
        "stderr_to_stdout": True,
        "additional_parameters": {"requeue": True, **args.sbatch_options},
    }
    if args.device == "cuda":
        params["gpus_per_node"] = cfg.gpus
    if args.mem is not None:
        params["mem"] = args.mem
    if args.partition:
        params["partition"] = args.partition
    if args.account:
        params["account"] = args.account
    return params


def memory(mem: Optional[str]) -> str:
    """--mem in words."""
    if mem is None:
        return "the default memory"
    return f"--mem={mem}" + (" (all of a node's memory)" if mem == "0" else "")


def describe(args, cfg: Config) -> str:
    """The jobs in words (``--dry-run``)."""
    hours, minutes = divmod(args.time_minutes, 60)
    gpus = f"{cfg.gpus} GPU{'s' if cfg.gpus > 1 else ''}, " if args.device == "cuda" else ""
    extra = "".join(f", --{k}={v}" for k, v in args.sbatch_options.items())
    ranks = (
        f" Each run's job is one task on one node, whose fairseq-train starts its {cfg.gpus} "
        "data-parallel ranks itself, one per GPU: a run takes at most the GPUs of one node."
        if cfg.gpus > 1
        else ""
    )
    return (
        f"SLURM: one job per run not finished: partition {args.partition or '(the default)'}, {gpus}"
        f"{args.cpus_per_run} CPUs, {memory(args.mem)}, time limit {hours}:{minutes:02d}:00{extra}, --requeue "
        f"(put back in the queue at the time limit and on preemption, resuming from its checkpoint); then one "
        f"report job (1 CPU) after all of them; job files and logs in {args.out / 'slurm'}.{ranks}"
    )


def sbatch_script(args, cfg: Config, run_name: str) -> str:
    """The sbatch script of a run's job as submitit writes it (``--dry-run``)."""
    from submitit.slurm.slurm import _make_sbatch_string

    venv = os.environ.get("TPP_VENV")
    python = str(Path(venv) / "bin" / "python") if venv else sys.executable
    folder = args.out / "slurm"
    command = " ".join(
        shlex.quote(c) for c in (python, "-u", "-m", "submitit.core._submit", str(folder))
    )
    return _make_sbatch_string(
        command=command, folder=folder, job_name=f"tpp-{run_name}", **resources(args, cfg)
    )


def dry_run(args, cfg: Config) -> int:
    """--dry-run's SLURM part: the first run's sbatch script, the partition checked where
    SLURM's commands are at hand, the jobs in words."""
    runs = select_runs(args, plan_runs(args, cfg, prepare_data(args, cfg, plan_only=True)["data"]))
    print(f"The sbatch script of {runs[0].name}'s job (the others differ in their name):\n")
    print(sbatch_script(args, cfg, runs[0].name))
    listed = (
        subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True)
        if shutil.which("sinfo")
        else None
    )
    if listed is None or listed.returncode != 0:
        print("(the partition is not checked: no SLURM cluster answers here)")
    elif args.partition:
        partitions = [p.rstrip("*") for p in listed.stdout.split()]
        if args.partition not in partitions:
            raise StudyError(
                f"--partition {args.partition}: no such partition on this cluster "
                f"(it has {', '.join(partitions)})"
            )
    print(describe(args, cfg))
    return 0


# ----------------------------------------------------------------------------- the cluster


def cluster_problem(args) -> Optional[str]:
    """Why jobs cannot be submitted from here (or None): SLURM's commands, the partition."""
    missing = [
        c
        for c in ("sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
        if shutil.which(c) is None
    ]
    if missing:
        return (
            f"--launcher slurm: {', '.join(missing)} not found on PATH: submit from a machine of the "
            "SLURM cluster (a login node), or run the study here with --launcher local"
        )
    listed = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True)
    if listed.returncode != 0:
        return f"--launcher slurm: sinfo failed: {listed.stderr.strip() or listed.returncode}"
    partitions = [p.rstrip("*") for p in listed.stdout.split()]
    if args.partition and args.partition not in partitions:
        return f"--partition {args.partition}: no such partition on this cluster (it has {', '.join(partitions)})"
    return None


#: the states of a job that has ended (squeue shows them for a while after the end)
ENDED_STATES = frozenset(
    "BOOT_FAIL CANCELLED COMPLETED DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY PREEMPTED "
    "REVOKED TIMEOUT".split()
)


def queue_states(job_ids: List[str]) -> Dict[str, str]:
    """{job id: state} of those of ``job_ids`` still in the queue (pending, running,
    requeued, completing...); a job that has ended is not there. squeue is asked for
    every state and run without the user's ``SQUEUE_*`` variables that filter what it
    shows (a partition, states); ``SQUEUE_CLUSTERS`` stays."""
    if not job_ids:
        return {}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SQUEUE_") or k == "SQUEUE_CLUSTERS"  # (which cluster: kept)
    }
    shown = subprocess.run(
        ["squeue", "-h", "--states=all", "-o", "%i %T", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
        env=env,
    )
    if shown.returncode != 0:
        if "Invalid job id" in shown.stderr:  # a single id no longer known
            return {}
        raise StudyError(f"squeue failed: {shown.stderr.strip()}")
    states = dict(line.split()[:2] for line in shown.stdout.splitlines() if line.strip())
    return {job: state for job, state in states.items() if state not in ENDED_STATES}


def job_notes(out: Path) -> Dict[str, str]:
    """For ``--status``, per run folder: its latest job and whether SLURM still queues it
    (``job 8 PENDING``, ``job 8 ended``); nothing where the study submitted no job, or
    squeue cannot say."""
    ids = {folder: entry["job"] for folder, entry in load_jobs(out)["runs"].items()}
    if not ids or shutil.which("squeue") is None:
        return {}
    try:
        queued = queue_states(list(ids.values()))
    except StudyError:
        return {}
    return {
        folder: f"job {job} {queued[job]}" if job in queued else f"job {job} ended"
        for folder, job in ids.items()
    }


def job_state(job_id: str) -> str:
    """The state SLURM last knew of a job (COMPLETED, FAILED, ...)."""
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True
    )
    match = re.search(r"\bJobState=(\S+)", shown.stdout)
    return match.group(1) if match else "no longer known to SLURM"


def jobs_file(out: Path) -> Path:
    return out / "slurm" / "jobs.json"


def load_jobs(out: Path) -> dict:
    path = jobs_file(out)
    return json.loads(path.read_text()) if path.exists() else {"runs": {}, "report": None}


def save_jobs(out: Path, record: dict) -> None:
    path = jobs_file(out)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def executor(args, params: Dict[str, object]):
    import submitit

    venv = os.environ.get("TPP_VENV")  # the environment the jobs use (default: this one)
    python = str(Path(venv) / "bin" / "python") if venv else sys.executable
    ex = submitit.SlurmExecutor(  # (python: a word of the job's shell command line)
        folder=args.out / "slurm", max_num_timeout=MAX_TIME_LIMITS, python=shlex.quote(python)
    )
    ex.update_parameters(**params)
    return ex


def with_option(command: str, option: str) -> str:
    """``command`` with ``option`` among tpp-study's own options, before any ``--`` (what
    follows it goes to fairseq-train)."""
    words = shlex.split(command)
    at = words.index("--") if "--" in words else len(words)
    return " ".join(shlex.quote(w) for w in [*words[:at], option, *words[at:]])


def resume_hint(command: str) -> str:
    return (
        f"to resume, submit the study again with the same command:\n  {command}\n"
        "(finished runs are kept; an unfinished run goes on from its last checkpoint)"
    )


# ----------------------------------------------------------------------------- the jobs


def failed(message: str) -> None:
    """End a job as failed: ``message`` logged first, so that a job log says why above
    submitit's traceback (which ends with it again), then raised for submitit."""
    log(f"FAILED: {message}")
    raise RuntimeError(message)


class RunJob:
    """One run's job: :func:`execute` in a thread (the main thread keeps the signals), the
    run's save-dir lock held. SIGTERM (preemption, ``scontrol requeue``, ``scancel``)
    stops the run's commands and ends the job without a result, so that SLURM's requeue
    starts it again; submitit's SIGUSR2 before the time limit does the same and requeues
    it. ``checkpoint``: the same call again (what is done is on disk)."""

    def __init__(self, run: Run, cfg: Config, paths, args, command: str):
        self.run, self.cfg, self.paths, self.args, self.command = run, cfg, paths, args, command

    def checkpoint(self, *args, **kwargs):
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)

    def __call__(self) -> str:
        import submitit

        from ..train import TrainError, take_lock

        run = self.run
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        log(
            f"{run.name}: job {os.environ.get('SLURM_JOB_ID', '?')} on {os.uname().nodename} "
            f"(restart count {restart}), run folder {run.folder}"
        )
        save_dir = run.folder / "checkpoints"
        save_dir.mkdir(parents=True, exist_ok=True)
        try:
            take_lock(
                save_dir,
                [
                    PROG,
                    "--launcher",
                    "slurm",
                    f"job {os.environ.get('SLURM_JOB_ID', '?')}",
                    run.name,
                ],
            )
        except TrainError as err:
            raise RuntimeError(f"{run.name}: {err}") from None
        requeue_signal = getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG)
        submitit_handler = signal.getsignal(requeue_signal)

        def stop(signum, frame):
            then = (
                "the job goes back in the queue and resumes from the last checkpoint"
                if signum == requeue_signal
                else "if SLURM requeues the job (or the study is submitted again), the run "
                "resumes from its last checkpoint"
            )
            log(f"{run.name}: {signal.Signals(signum).name}: stopping its commands; {then}")
            CHILDREN.stop(grace=20)
            if signum == requeue_signal and callable(submitit_handler):
                submitit_handler(signum, frame)  # checkpoint, requeue, exit
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(requeue_signal, stop)
        failure: List[BaseException] = []

        def work():
            try:
                execute(run, self.cfg, self.paths, self.args)
            except BaseException as err:  # noqa: B036  (reported by the main thread)
                failure.append(err)

        worker = threading.Thread(target=work, name=run.name, daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(1.0)
        if failure:
            job_log = submitit.JobEnvironment().paths.stdout
            failed(
                f"{run.name} failed: {failure[0]}\n  run log: {run.folder / 'run.log'}\n"
                f"  job log: {job_log}\n" + resume_hint(self.command)
            )
        log(f"{run.name}: done")
        return run.name


class ReportJob:
    """The report job: the report of the runs that finished (``--report-only``); it
    fails, naming them, when some did not."""

    def __init__(self, cfg: Config, args, command: str):
        self.cfg, self.args, self.command = cfg, args, command

    def __call__(self) -> str:
        import logging

        import fairseq  # noqa: F401  (imported here, it turns the root logger to DEBUG...)

        logging.getLogger().setLevel(logging.WARNING)  # (...: back to a process's own)
        args = self.args
        args.dry_run, args.report_only = False, True
        try:
            status = plan_or_report(args, self.cfg, self.command)
        except StudyError as err:  # (a pack that failed after the report was written)
            log(f"{'' if getattr(err, 'report', None) else 'no report: '}{err}")
            status = err.status
        paths = prepare_data(args, self.cfg, plan_only=True)
        runs = select_runs(args, plan_runs(args, self.cfg, paths["data"]))  # (--only's)
        missing = [
            run for run in runs if not (paths.get("prepared") and finished(run, paths["reference"]))
        ]
        if missing:
            record = load_jobs(args.out)
            said = []
            for run in missing:
                job = record["runs"].get(run.folder.name)
                where = (
                    f"job {job['job']} ({job_state(job['job'])}), job log {job['log']}"
                    if job
                    else "no job recorded"
                )
                said.append(f"  {run.name}: {where}, run log {run.folder / 'run.log'}")
            failed(
                f"{len(missing)} of {len(runs)} runs did not finish"
                f"{'' if status == 0 else ' (no report: see above)'}:\n"
                + "\n".join(said)
                + "\n"
                + resume_hint(self.command)
            )
        if status != 0:
            failed("the report failed (see above)")
        return str(args.out / "report.md")


# ----------------------------------------------------------------------------- submitting


def cancel_superseded_report(record: dict) -> None:
    """The report job of an earlier submission, if still queued, cancelled: it waits for
    the runs' earlier jobs only, and would report (and fail) before the new ones end."""
    earlier = (record.get("report") or {}).get("job")
    state = queue_states([earlier]).get(earlier) if earlier else None
    if state:
        subprocess.run(["scancel", earlier], capture_output=True)
        log(
            f"the earlier report job {earlier} ({state}) is cancelled: a new one waits for every run"
        )


def _submit_report(args, cfg: Config, command: str, params, waiting_on: List[str]):
    """The report job (one CPU, after every job in ``waiting_on`` has ended)."""
    import submitit

    report_params = {k: v for k, v in params.items() if k != "gpus_per_node"}
    report_params.update(job_name="tpp-study-report", cpus_per_task=1, time=REPORT_TIME_MIN)
    if waiting_on:
        report_params["additional_parameters"] = {
            **params["additional_parameters"],
            "dependency": "afterany:" + ":".join(waiting_on),
        }
    try:
        return executor(args, report_params).submit(ReportJob(cfg, args, command))
    except submitit.core.utils.FailedJobError as err:
        raise StudyError(
            f"sbatch refused the report job: {str(err).strip()}\n"
            f"(the runs' jobs are in {jobs_file(args.out)}; {PROG} ... --report-only writes the report at any "
            "time)",
            status=1,
        ) from None


def submit(args, cfg: Config, command: str) -> int:
    """Submit a job for every run neither finished nor queued, and the report job after
    them (the study folder's lock held)."""
    problem = cluster_problem(args)
    if problem:
        raise StudyError(problem)
    paths = prepare_data(args, cfg)
    runs = plan_runs(args, cfg, paths["data"])
    if args.records:  # (a run recorded elsewhere is not trained again)
        import_records(args.records, runs, paths["reference"])
    todo = select_runs(args, runs)
    check_pack_now(args, runs, todo, paths["reference"])
    (args.out / "slurm").mkdir(parents=True, exist_ok=True)
    record = load_jobs(args.out)
    queued = queue_states([job["job"] for job in record["runs"].values()])
    import submitit

    params = resources(args, cfg)
    run_executor = executor(args, params)
    waiting_on = []
    for run in todo:
        if finished(run, paths["reference"]):
            log(f"{run.name}: finished ({run.folder})")
            continue
        earlier = record["runs"].get(run.folder.name)
        if earlier and earlier["job"] in queued:
            log(
                f"{run.name}: its job {earlier['job']} is {queued[earlier['job']]}: not submitted again"
            )
            waiting_on.append(earlier["job"])
            continue
        if earlier:
            log(
                f"{run.name}: its job {earlier['job']} ended before the run finished (log {earlier['log']}): "
                "submitting it again (it resumes from its last checkpoint)"
            )
        run_executor.update_parameters(job_name=f"tpp-{run.name}")
        try:
            job = run_executor.submit(RunJob(run, cfg, paths, args, command))
        except submitit.core.utils.FailedJobError as err:
            raise StudyError(
                f"sbatch refused the job of {run.name}: {str(err).strip()}\n"
                f"The jobs submitted so far are in {jobs_file(args.out)}; " + resume_hint(command),
                status=1,
            ) from None
        record["runs"][run.folder.name] = {
            "run": run.name,
            "job": job.job_id,
            "log": str(job.paths.stdout),
            "submitted": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        save_jobs(args.out, record)
        waiting_on.append(job.job_id)
        log(f"{run.name}: job {job.job_id}, log {job.paths.stdout}")
    cancel_superseded_report(record)
    report = _submit_report(args, cfg, command, params, waiting_on)
    record["report"] = {"job": report.job_id, "log": str(report.paths.stdout), "after": waiting_on}
    save_jobs(args.out, record)
    log(
        f"{len(waiting_on)} run job(s) to wait for{': ' + ', '.join(waiting_on) if waiting_on else ''}; "
        f"the report job {report.job_id} (log {report.paths.stdout}) writes {args.out / 'report.md'} after them"
    )
    print(
        f"Follow the jobs with: squeue -j {','.join(waiting_on + [report.job_id])}\n"
        f"The report of what has finished, at any time: {with_option(command, '--report-only')}"
    )
    return 0
