"""What a study plans and reports without training: the runs ``--only`` selects, the
report of the finished runs, and ``--dry-run`` and ``--report-only`` (also the SLURM
report job's)."""

import shlex
import time

from .commands import log
from .config import Config, StudyError
from .data import prepare_data
from .records import (
    check_pack,
    finished,
    import_records,
    load_record,
    pack_records,
    records_found,
)
from .report import write_report
from .runs import plan_runs, trained_updates


def select_runs(args, runs):
    """The runs to run: all, or those ``--only`` names."""
    if args.only is None:
        return runs
    names = {run.name for run in runs}
    unknown = [name for name in args.only if name not in names]
    if unknown:
        raise StudyError(
            f"--only: {', '.join(unknown)} not among this study's runs ({', '.join(sorted(names))})"
        )
    return [run for run in runs if run.name in args.only]


def report_finished(args, cfg: Config, paths, runs, command: str, started: float):
    """The report of the finished runs among ``runs`` (the rest listed as missing) and
    the archive of their records (``--pack``). Returns (report path or None, finished)."""
    records = {}
    for run in runs:
        record = load_record(run, paths["reference"])
        if record is not None:
            records[run.name] = record
    done = [run for run in runs if run.name in records]
    missing = [run for run in runs if run.name not in records]
    if missing:
        log(f"not finished ({len(missing)} of {len(runs)}): {', '.join(r.name for r in missing)}")
    unpacked = None
    if args.pack:  # first: a report that fails or runs out of time loses no record
        try:
            size = pack_records(done, args.pack, args.out, force=args.force)
            log(
                f"records of {len(done)} finished run(s) packed into {args.pack} ({size / 2**20:.1f} MiB)"
            )
        except StudyError as err:  # (said once the report is written)
            unpacked = err
    report = None
    if any(run.variant == args.variants[0] for run in done):
        elapsed = time.time() - started
        report = write_report(args, cfg, paths, done, records, command, elapsed, missing)
    if unpacked is not None:
        if report is not None:
            unpacked = StudyError(f"{unpacked} (the report is written: {report})", unpacked.status)
            unpacked.report = report
        raise unpacked
    return report, done


def check_pack_now(args, runs, todo, reference) -> None:
    """--pack refused before anything is trained or copied where the archive holds records
    that the pack would not write again: of runs neither finished here nor to be run."""
    if args.pack:
        packed = [run for run in runs if run in todo or finished(run, reference)]
        check_pack(args.pack, packed, args.out, args.force)


def mergeable(args, runs, paths) -> set:
    """The names of the runs whose records ``--records`` holds (checked, not copied: for
    --dry-run and --status, which write nothing)."""
    if not args.records or not paths["reference"].is_file():
        return set()
    return set(records_found(args.records, runs, paths["reference"]))


def plan_or_report(args, cfg: Config, command: str) -> int:
    """--dry-run (carves and prepares nothing) and --report-only."""
    started = time.time()
    paths = prepare_data(args, cfg, plan_only=True)
    runs = plan_runs(args, cfg, paths["data"])
    select_runs(args, runs)
    if args.dry_run:
        if not paths["prepared"]:
            print(
                f"(the data folder {paths['data']} is not prepared yet: the study will carve and prepare it "
                "first; the runs' ids follow from its dictionaries)"
            )
        merged = mergeable(args, runs, paths)
        for run in select_runs(args, runs):
            if paths["prepared"] and finished(run, paths["reference"]):
                state = "done"
            elif run.name in merged:
                state = "done: its record in --records"
            else:
                state = "trained" if trained_updates(run) >= cfg.max_update else "to train"
            print(
                f"{run.name} [{state}] {run.folder}\n  "
                + " ".join(shlex.quote(c) for c in run.train_cmd)
            )
        return 0
    if not paths["prepared"]:
        raise StudyError(
            f"--report-only: the data folder {paths['data']} is not prepared: no run has finished",
            status=1,
        )
    if args.records:
        import_records(args.records, runs, paths["reference"])
    check_pack_now(args, runs, [], paths["reference"])
    report, done = report_finished(args, cfg, paths, runs, command, started)
    if report is None:
        raise StudyError(
            f"--report-only: no run of the baseline {args.variants[0]} has finished in "
            f"{args.out / 'runs'}",
            status=1,
        )
    log(f"report of {len(done)} finished run(s) of {len(runs)}: {report}")
    print(report.read_text())
    return 0
