"""The whole Transformer++ pipeline on the shipped English-German sample, on the CPU.

    prepare (Moses tokenisation) -> tag with spaCy (POS/NER) -> joint BPE -> binarize
    -> train transformer_pp_cpu with the tag losses -> average the last checkpoints
    -> translate the test set (beam 5) -> sacreBLEU -> plots and attention maps

``make demo`` runs ``tpp-demo`` with the defaults. Every stage calls the project's own
tools (the data pipeline, averaging, evaluation, plots: their Python entry points, in
this process) or fairseq's command line (``scripts/train.sh`` runs ``fairseq-train``).

Re-running reuses every finished stage: the data pipeline skips its completed steps,
fairseq-train resumes from checkpoint_last.pt (and is not started when the run is
complete), and the cut-down sample, averaging, evaluation, training curves and attention
maps are skipped by the pipeline's step ledger (``--out/.steps``) while the files and
options they were made from are unchanged; a stage whose inputs changed (training went
further, another --average) is redone, and with it the stages that read its output.

Environment: DEMO_MAX_UPDATE and DEMO_SAVE_EVERY (defaults of --max-update and
--save-every), DEMO_BPE_MERGES [8000], DEMO_MAX_TOKENS [4096], DEMO_SENTENCE [the
paper's "There is a fire in the mountain."], OMP_NUM_THREADS [the number of cores].
"""

import argparse
import filecmp
import io
import os
import shutil
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

PROG = "tpp-demo"
STAGES = 6
# what the user knows a step setting by, for the ledger's messages about changed settings
OPTION_NAMES = {
    "sample": "--sample",
    "train_lines": "--train-lines",
    "heldout_lines": "--heldout-lines",
    "average": "--average",
    "sentence": "DEMO_SENTENCE",
}


class DemoError(Exception):
    """A stage failed; ``status`` is the exit status to end with."""

    def __init__(self, message, status=1):
        super().__init__(message)
        self.status = status


def checkout():
    """The repository this package runs from (the demo needs its sample corpus and
    scripts/train.sh), or None."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "scripts" / "train.sh").is_file() else None


def build_parser(root):
    max_update = int(os.environ.get("DEMO_MAX_UPDATE", 500))
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--out", type=Path, default=root / "runs" / "demo", help="where everything goes [runs/demo]"
    )
    parser.add_argument(
        "--max-update",
        type=int,
        default=max_update,
        help="training updates [DEMO_MAX_UPDATE or 500]",
    )
    parser.add_argument(
        "--train-lines",
        type=int,
        default=None,
        help="use only the first N training pairs (quick runs, tests) [all]",
    )
    parser.add_argument(
        "--heldout-lines",
        type=int,
        default=None,
        help="use only the first N valid and test pairs (quick runs, tests) [all]",
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=int(os.environ["DEMO_SAVE_EVERY"]) if os.environ.get("DEMO_SAVE_EVERY") else None,
        help="checkpoint interval in updates [DEMO_SAVE_EVERY or max-update/10]",
    )
    parser.add_argument(
        "--average", type=int, default=5, help="how many of the last checkpoints to average [5]"
    )
    parser.add_argument(
        "--sample",
        type=Path,
        default=root / "data" / "sample",
        help="the parallel corpus: {train,valid,test}.{en,de} [data/sample]",
    )
    parser.add_argument(
        "--force", action="store_true", help="start again from scratch (removes --out)"
    )
    return parser


SAMPLE_FILES = [f"{split}.{lang}" for lang in ("en", "de") for split in ("train", "valid", "test")]


def cut_down_sample(sample, folder, train_lines, heldout_lines):
    """The first lines of each split of ``sample`` in ``folder``; a file that would not
    change is left as it is (the data pipeline knows its inputs by modification time)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in SAMPLE_FILES:
        n = train_lines if name.startswith("train.") else heldout_lines
        target = folder / name
        tmp = target.with_name(target.name + ".tmp")
        with open(sample / name, "rb") as src, open(tmp, "wb") as out:
            for number, line in enumerate(src):
                if n is not None and number >= n:
                    break
                out.write(line)
        if target.is_file() and filecmp.cmp(tmp, target, shallow=False):
            os.remove(tmp)
        else:
            os.replace(tmp, target)


def write_atomically(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def check(status, what):
    if status != 0:
        raise DemoError(f"{what} failed (exit status {status})", status)


def run_demo(args, root):
    from . import average, embedding_similarity, evaluate, plot_attention, plot_training
    from .recover import finished_updates
    from .train import option_words
    from tpp_pipeline import pipeline
    from tpp_pipeline.errors import DataError
    from tpp_pipeline.steps import StepLedger, file_identity

    env = dict(os.environ)
    # this environment's commands first: fairseq-train and tpp-recover-checkpoint
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if shutil.which("fairseq-train", path=env["PATH"]) is None:
        raise DemoError(
            "fairseq-train not on PATH: run 'make demo' (it sets up the " "environment)", 2
        )
    save_every = args.save_every or max(args.max_update // 10, 1)
    if args.force and args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    started = time.monotonic()
    pipeline.setup_logging()  # the ledger's messages, as the data pipeline's
    # the stages after training read only files the demo made: one done from other files
    # or options is redone (with the stages after it), never refused
    ledger = StepLedger(str(out), force=True, names=OPTION_NAMES)

    def run_step(name, settings, outputs, action, upstream=""):
        """``action`` as the ledger's step ``name``; its stamp, for the steps reading its
        outputs."""
        return ledger.run(name, settings, [str(p) for p in outputs], action, upstream)

    def stage(number, title):
        print(
            f"\n=== [{number}/{STAGES}] {title} ({time.monotonic() - started:.0f}s elapsed)",
            flush=True,
        )

    # ------------------------------------------------------------------------ 1. data
    cutting = args.train_lines is not None or args.heldout_lines is not None
    sample = out / "sample" if cutting else args.sample
    stage(1, f"prepare, tag (spaCy), BPE and binarize {sample}")
    if cutting:
        # another cut under the same --out would mix with the data and training of the
        # first: refused (the ledger not forced), as the data pipeline refuses new inputs
        settings = {
            "sample": [file_identity(args.sample / name) for name in SAMPLE_FILES],
            "train_lines": args.train_lines,
            "heldout_lines": args.heldout_lines,
        }
        kept = StepLedger(str(out), names=OPTION_NAMES)
        try:
            kept.run(
                "sample",
                settings,
                [str(sample / name) for name in SAMPLE_FILES],
                lambda: cut_down_sample(args.sample, sample, args.train_lines, args.heldout_lines),
            )
        except DataError:
            if kept.saved("sample") is None:
                raise
            changes = "; ".join(kept.changes(kept.saved("sample"), settings, ""))
            raise DemoError(
                f"{out} was made from another sample ({changes}): pass --force to start "
                "again from scratch, or use another --out",
                2,
            ) from None
    check(
        pipeline.main(
            [
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                str(sample / "train"),
                "--validpref",
                str(sample / "valid"),
                "--testpref",
                str(sample / "test"),
                "--name",
                "sample_en_de",
                "--work-dir",
                str(out / "work"),
                "--data-bin",
                str(out / "data-bin"),
                "--bpe-merges",
                os.environ.get("DEMO_BPE_MERGES", "8000"),
                "--workers",
                str(os.cpu_count() or 1),
            ]
        ),
        "the data pipeline",
    )
    data = out / "data-bin" / "sample_en_de"

    # ------------------------------------------------------------------------ 2. train
    stage(
        2,
        "train transformer_pp_cpu (d=256, 3+3 layers) with POS/NER losses for "
        f"{args.max_update} updates",
    )
    ckpt = out / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    done = finished_updates(ckpt, args.max_update)
    if done is not None:
        print(f"reusing {ckpt} (trained for {done} updates)", flush=True)
    else:
        interval = str(max(args.max_update // 6, 1))
        recipe = {
            "preset": "cpu",
            "data": data,
            "save_dir": ckpt,
            "cpu": True,
            "max_update": args.max_update,
            "update_freq": 1,
            "max_tokens": os.environ.get("DEMO_MAX_TOKENS", "4096"),
            "warmup_updates": interval,
            "save_interval_updates": save_every,
            "keep_interval_updates": args.average,
            "log_format": "json",
            "log_interval": 25,
            "log_file": ckpt / "train.log",
        }
        fairseq = {
            "dropout": 0.2,
            "no_progress_bar": True,
            "num_workers": 0,
            "validate_interval_updates": interval,
        }
        train_sh = str(root / "scripts" / "train.sh")
        command = ["bash", train_sh, *option_words(recipe), "--", *option_words(fairseq)]
        sys.stdout.flush()
        check(subprocess.run(command, env=env).returncode, "training")

    # ------------------------------------------------------------------------ 3. average
    stage(3, f"average the last {args.average} checkpoints")
    avg = ckpt / "checkpoint_avg.pt"

    def average_checkpoints():
        # fairseq writes no checkpoint_<epoch>_<update>.pt when an interval ends an
        # epoch, so there may be fewer than asked for: average those there are
        found = len(list(ckpt.glob("checkpoint_*_*.pt")))
        if found == 0:
            raise DemoError(f"no checkpoint_<epoch>_<update>.pt in {ckpt} to average")
        check(
            average.main(
                [
                    "--inputs",
                    str(ckpt),
                    "--num-update-checkpoints",
                    str(min(found, args.average)),
                    "--output",
                    str(avg),
                    "--force",
                ]
            ),
            "averaging",
        )

    averaged = run_step(
        "average",
        {"checkpoint": file_identity(ckpt / "checkpoint_last.pt"), "average": args.average},
        [avg],
        average_checkpoints,
    )

    # ------------------------------------------------------------------------ 4. evaluate
    stage(4, "translate the test set (beam 5, length penalty 0.5) and score it")
    eval_dir = out / "eval"
    bleu = eval_dir / "bleu.txt"
    run_step(
        "evaluate",
        {"checkpoint": file_identity(avg), "reference": file_identity(sample / "test.de")},
        [bleu, eval_dir / "generate-test.txt"],
        lambda: check(
            evaluate.main(
                [
                    "--data",
                    str(data),
                    "--checkpoint",
                    str(avg),
                    "--reference",
                    str(sample / "test.de"),
                    "--out",
                    str(eval_dir),
                    "--cpu",
                    "--force",
                ]
            ),
            "evaluation",
        ),
        averaged,
    )

    # ------------------------------------------------------------------------ 5. plots
    stage(5, "training curves")
    plots = out / "plots"
    run_step(
        "plots",
        {"log": file_identity(ckpt / "train.log")},
        [plots],
        lambda: check(
            plot_training.main(
                ["--log", str(ckpt / "train.log"), "--out-dir", str(plots), "--force"]
            ),
            "plotting the training curves",
        ),
    )

    # ------------------------------------------------------------------------ 6. attention
    stage(6, "attention maps and the paper's fire/mountain similarity")
    sentence = os.environ.get("DEMO_SENTENCE", "There is a fire in the mountain.")
    codes = out / "work" / "bpe" / "codes"
    model = ["--path", str(avg), "--data", str(data), "--bpe-codes", str(codes)]
    attention = out / "attention"
    run_step(
        "attention",
        {
            "checkpoint": file_identity(avg),
            "bpe_codes": file_identity(codes),
            "sentence": sentence,
        },
        [attention],
        lambda: check(
            plot_attention.main(
                [*model, "--sentence", sentence, "--out-dir", str(attention), "--force"]
            ),
            "drawing the attention maps",
        ),
        averaged,
    )
    printed = io.StringIO()
    with redirect_stdout(printed):
        status = embedding_similarity.main(
            [*model, "--sentence", sentence, "--words", "fire", "mountain"]
        )
    print(printed.getvalue(), end="", flush=True)
    write_atomically(out / "fire_mountain.txt", printed.getvalue())
    if status != 0:
        print("(similarity: the words are not single tokens of this model's vocabulary)")

    print(f"\n=== done in {time.monotonic() - started:.0f}s")
    print(
        f"  data:            {data}\n"
        f"  checkpoints:     {ckpt}   (averaged: {avg})\n"
        f"  translations:    {eval_dir / 'generate-test.txt'}\n"
        f"  scores:          {bleu}\n"
        f"  training curves: {plots}\n"
        f"  attention maps:  {attention}\n"
    )
    print(bleu.read_text(encoding="utf-8"), end="", flush=True)


def main(argv=None):
    root = checkout()
    if root is None:
        print(
            f"{PROG}: error: the demo runs from a checkout of the repository (its sample "
            "corpus and scripts/train.sh); this package is installed elsewhere",
            file=sys.stderr,
        )
        return 2
    args = build_parser(root).parse_args(argv)
    # before torch is imported (the plots and analyses run in this process)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from tpp_pipeline.errors import DataError

    try:
        run_demo(args, root)
    except DemoError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return error.status
    except DataError as error:  # a stage of the ledger wrote less than it should
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
