"""The whole Transformer++ pipeline on the shipped English-German sample, on the CPU.

    prepare (Moses tokenisation) -> tag with spaCy (POS/NER) -> joint BPE -> binarize
    -> train transformer_pp_cpu with the tag losses -> average the last checkpoints
    -> translate the test set (beam 5) -> sacreBLEU -> plots and attention maps

``make demo`` runs ``tpp-demo`` with the defaults. Every stage calls the project's own
tools (the data pipeline, averaging, evaluation, plots: their Python entry points, in
this process) or fairseq's command line (``scripts/train.sh`` runs ``fairseq-train``).

Re-running reuses every finished stage: the data pipeline skips its completed steps,
fairseq-train resumes from checkpoint_last.pt (and is not started when the run is
complete), and averaging, evaluation and plots are skipped when their outputs are newer
than their inputs.

Environment: DEMO_MAX_UPDATE and DEMO_SAVE_EVERY (defaults of --max-update and
--save-every), DEMO_BPE_MERGES [8000], DEMO_MAX_TOKENS [4096], DEMO_SENTENCE [the
paper's "There is a fire in the mountain."], OMP_NUM_THREADS [the number of cores].
"""

import argparse
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


def newer(path, than):
    """True when ``path`` exists and was modified after ``than`` (shell's -nt)."""
    return path.exists() and (not than.exists() or path.stat().st_mtime > than.stat().st_mtime)


def has_content(path):
    return path.is_file() and path.stat().st_size > 0


def cut_down_sample(sample, folder, train_lines, heldout_lines):
    """The first lines of each split of ``sample`` in ``folder`` (written once)."""
    folder.mkdir(parents=True, exist_ok=True)
    for lang in ("en", "de"):
        for split in ("train", "valid", "test"):
            n = train_lines if split == "train" else heldout_lines
            target = folder / f"{split}.{lang}"
            if has_content(target):
                continue
            tmp = target.with_name(target.name + ".tmp")
            with open(sample / f"{split}.{lang}", "rb") as src, open(tmp, "wb") as out:
                for number, line in enumerate(src):
                    if n is not None and number >= n:
                        break
                    out.write(line)
            os.replace(tmp, target)
    return folder


def write_atomically(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def trained_updates(checkpoint):
    """Updates a checkpoint_last.pt has seen (0 if there is none, or it cannot be read:
    scripts/train.sh then recovers the newest readable one)."""
    if not has_content(checkpoint):
        return 0
    from .checkpoint_files import CheckpointError, load_checkpoint, num_updates

    try:
        return num_updates(load_checkpoint(checkpoint, mmap=True)) or 0
    except CheckpointError:
        return 0


def check(status, what):
    if status != 0:
        raise DemoError(f"{what} failed (exit status {status})", status)


def run_demo(args, root):
    from . import average, embedding_similarity, evaluate, plot_attention, plot_training
    from tpp_pipeline import pipeline

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

    def stage(number, title):
        print(
            f"\n=== [{number}/{STAGES}] {title} ({time.monotonic() - started:.0f}s elapsed)",
            flush=True,
        )

    # ------------------------------------------------------------------------ 1. data
    sample = args.sample
    if args.train_lines is not None or args.heldout_lines is not None:
        sample = cut_down_sample(sample, out / "sample", args.train_lines, args.heldout_lines)
    stage(1, f"prepare, tag (spaCy), BPE and binarize {sample}")
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
    done = trained_updates(ckpt / "checkpoint_last.pt")
    if done >= args.max_update:
        print(f"reusing {ckpt} (trained for {done} updates)", flush=True)
    else:
        interval = str(max(args.max_update // 6, 1))
        command = [
            "bash",
            str(root / "scripts" / "train.sh"),
            "--preset",
            "cpu",
            "--data",
            str(data),
            "--save-dir",
            str(ckpt),
            "--cpu",
            "--max-update",
            str(args.max_update),
            "--update-freq",
            "1",
            "--max-tokens",
            os.environ.get("DEMO_MAX_TOKENS", "4096"),
            "--warmup-updates",
            interval,
            "--save-interval-updates",
            str(save_every),
            "--keep-interval-updates",
            str(args.average),
            "--log-interval",
            "25",
            "--",
            "--dropout",
            "0.2",
            "--log-format",
            "json",
            "--log-file",
            str(ckpt / "train.log"),
            "--no-progress-bar",
            "--num-workers",
            "0",
            "--validate-interval-updates",
            interval,
        ]
        sys.stdout.flush()
        check(subprocess.run(command, env=env).returncode, "training")

    # ------------------------------------------------------------------------ 3. average
    stage(3, f"average the last {args.average} checkpoints")
    avg = ckpt / "checkpoint_avg.pt"
    if has_content(avg) and newer(avg, ckpt / "checkpoint_last.pt"):
        print(f"reusing {avg}", flush=True)
    else:
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

    # ------------------------------------------------------------------------ 4. evaluate
    stage(4, "translate the test set (beam 5, length penalty 0.5) and score it")
    eval_dir = out / "eval"
    bleu = eval_dir / "bleu.txt"
    if has_content(bleu) and newer(bleu, avg):
        print(f"reusing {bleu}", flush=True)
    else:
        check(
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
        )

    # ------------------------------------------------------------------------ 5. plots
    stage(5, "training curves")
    plots = out / "plots"
    if not list(plots.glob("*.png")) or newer(ckpt / "train.log", plots):
        check(
            plot_training.main(
                ["--log", str(ckpt / "train.log"), "--out-dir", str(plots), "--force"]
            ),
            "plotting the training curves",
        )

    # ------------------------------------------------------------------------ 6. attention
    stage(6, "attention maps and the paper's fire/mountain similarity")
    sentence = os.environ.get("DEMO_SENTENCE", "There is a fire in the mountain.")
    model = [
        "--path",
        str(avg),
        "--data",
        str(data),
        "--bpe-codes",
        str(out / "work" / "bpe" / "codes"),
    ]
    attention = out / "attention"
    if not list(attention.glob("*.png")) or newer(avg, attention):
        check(
            plot_attention.main(
                [*model, "--sentence", sentence, "--out-dir", str(attention), "--force"]
            ),
            "drawing the attention maps",
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
    try:
        run_demo(args, root)
    except DemoError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return error.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
