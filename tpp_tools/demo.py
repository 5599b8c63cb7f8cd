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

from tpp_pipeline import checkout
from tpp_pipeline.errors import UserError, from_os_error, report
from tpp_pipeline.pipeline import positive_int

from .train import VARIABLES as TRAIN_VARIABLES
from .train import option_words

PROG = "tpp-demo"
# what the user knows a step setting by, for the ledger's messages about changed settings
OPTION_NAMES = {
    "sample": "--sample",
    "train_lines": "--train-lines",
    "heldout_lines": "--heldout-lines",
    "average": "--average",
    "sentence": "DEMO_SENTENCE",
}


class DemoError(UserError):
    """A stage failed; ``status`` is the exit status to end with."""

    def __init__(self, message, status=1):
        super().__init__(message)
        self.status = status


def build_parser(root):
    # (a default given as text is read by the option's type: a bad variable is an error
    # naming the option)
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
        type=positive_int,
        default=os.environ.get("DEMO_MAX_UPDATE") or "500",
        help="training updates [DEMO_MAX_UPDATE or 500]",
    )
    parser.add_argument(
        "--train-lines",
        type=positive_int,
        default=None,
        help="use only the first N training pairs (quick runs, tests) [all]",
    )
    parser.add_argument(
        "--heldout-lines",
        type=positive_int,
        default=None,
        help="use only the first N valid and test pairs (quick runs, tests) [all]",
    )
    parser.add_argument(
        "--save-every",
        type=positive_int,
        default=os.environ.get("DEMO_SAVE_EVERY") or None,
        help="checkpoint interval in updates [DEMO_SAVE_EVERY or max-update/10]",
    )
    parser.add_argument(
        "--average",
        type=positive_int,
        default=5,
        help="how many of the last checkpoints to average [5]",
    )
    parser.add_argument(
        "--sample",
        type=Path,
        default=root / "data" / "sample",
        help="the parallel corpus: {train,valid,test}.{en,de} [data/sample]",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="start again from scratch (removes --out, if it is a demo's folder)",
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


#: the file that marks a folder as a demo's (``--force`` removes no other)
MARK = ".tpp-demo"


def made_by_a_demo(folder):
    """``folder`` holds the demo's mark, or (made before the mark) its data pipeline's
    work folder and data folder."""
    return (folder / MARK).is_file() or (
        (folder / "work" / ".steps").is_dir() and (folder / "data-bin" / "sample_en_de").exists()
    )


def check_folders(args):
    """Before any stage: the sample is there, and ``--out`` is a folder that is the demo's
    to write: new, empty or made by a demo (the only kind ``--force`` removes)."""
    missing = [name for name in SAMPLE_FILES if not (args.sample / name).is_file()]
    if missing:
        raise DemoError(
            f"{args.sample}: no {', '.join(missing)}: --sample is a folder holding "
            "{train,valid,test}.{en,de}",
            2,
        )
    if args.out.exists() and not args.out.is_dir():
        raise DemoError(f"{args.out}: not a folder: --out is the folder the demo writes", 2)
    if args.out.is_dir() and any(args.out.iterdir()) and not made_by_a_demo(args.out):
        # its files are not the demo's to resume, nor to remove (--force)
        raise DemoError(
            f"{args.out} holds files and was not made by the demo (it has no {MARK}): "
            "--out is a new or empty folder, or one a demo made",
            2,
        )


def check(status, what):
    if status != 0:
        raise DemoError(f"{what} failed (exit status {status})", status)


class Demo:
    """The demo's folders and the step ledger that skips what is done; one method per
    stage (:data:`STAGES`)."""

    def __init__(self, args, root):
        from tpp_pipeline import pipeline
        from tpp_pipeline.steps import StepLedger

        self.args, self.root = args, root
        # the training recipe's own variables (ARCH, LR, SEED...) are the demo's to set;
        # scripts/train.sh runs tpp-train with this Python
        self.env = {k: v for k, v in os.environ.items() if k not in TRAIN_VARIABLES}
        self.env["PYTHON"] = sys.executable
        # this environment's commands first: fairseq-train and tpp-recover-checkpoint
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"
        if shutil.which("fairseq-train", path=self.env["PATH"]) is None:
            raise DemoError(
                "fairseq-train not on PATH: run 'make demo' (it sets up the environment)", 2
            )
        check_folders(args)
        if args.force and args.out.exists():
            shutil.rmtree(args.out)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / MARK).touch()
        self.out = out = args.out.resolve()
        self.started = time.monotonic()
        pipeline.setup_logging()  # the ledger's messages, as the data pipeline's
        # the stages after training read only files the demo made: one done from other
        # files or options is redone (with the stages after it), never refused
        self.ledger = StepLedger(str(out), force=True, names=OPTION_NAMES)
        self.cutting = args.train_lines is not None or args.heldout_lines is not None
        self.sample = out / "sample" if self.cutting else args.sample
        self.data = out / "data-bin" / "sample_en_de"
        self.ckpt = out / "checkpoints"
        self.avg = self.ckpt / "checkpoint_avg.pt"
        self.eval_dir = out / "eval"
        self.plots = out / "plots"
        self.attention = out / "attention"
        self.averaged = ""  # the averaging step's stamp, for the steps that read its output

    def step(self, name, settings, outputs, action, upstream=""):
        """``action`` as the ledger's step ``name``; its stamp, for the steps reading its
        outputs."""
        return self.ledger.run(name, settings, [str(p) for p in outputs], action, upstream)

    def prepare(self):
        from tpp_pipeline import pipeline

        if self.cutting:
            self.cut_sample()
        options = {
            "trainpref": self.sample / "train",
            "validpref": self.sample / "valid",
            "testpref": self.sample / "test",
            "name": "sample_en_de",
            "work_dir": self.out / "work",
            "data_bin": self.out / "data-bin",
            "bpe_merges": os.environ.get("DEMO_BPE_MERGES", "8000"),
            "workers": os.cpu_count() or 1,
        }
        check(pipeline.main(["-s", "en", "-t", "de", *option_words(options)]), "the data pipeline")

    def cut_sample(self):
        """The cut-down sample; another cut under the same --out would mix with the data
        and training of the first: refused (the ledger not forced), as the data pipeline
        refuses new inputs."""
        from tpp_pipeline.errors import DataError
        from tpp_pipeline.steps import StepLedger, file_identity

        args = self.args
        settings = {
            "sample": [file_identity(args.sample / name) for name in SAMPLE_FILES],
            "train_lines": args.train_lines,
            "heldout_lines": args.heldout_lines,
        }
        kept = StepLedger(str(self.out), names=OPTION_NAMES)
        try:
            kept.run(
                "sample",
                settings,
                [str(self.sample / name) for name in SAMPLE_FILES],
                lambda: cut_down_sample(
                    args.sample, self.sample, args.train_lines, args.heldout_lines
                ),
            )
        except DataError:
            if kept.saved("sample") is None:
                raise
            changes = "; ".join(kept.changes(kept.saved("sample"), settings, ""))
            raise DemoError(
                f"{self.out} was made from another sample ({changes}): pass --force to start "
                "again from scratch, or use another --out",
                2,
            ) from None

    def train(self):
        """scripts/train.sh (the training recipe), unless the run is finished."""
        from .recover import finished_updates

        args = self.args
        self.ckpt.mkdir(parents=True, exist_ok=True)
        done = finished_updates(self.ckpt, args.max_update)
        if done is not None:
            print(f"reusing {self.ckpt} (trained for {done} updates)", flush=True)
            return
        interval = max(args.max_update // 6, 1)
        recipe = {
            "preset": "cpu",
            "data": self.data,
            "save_dir": self.ckpt,
            "cpu": True,
            "max_update": args.max_update,
            "update_freq": 1,
            "max_tokens": os.environ.get("DEMO_MAX_TOKENS", "4096"),
            "warmup_updates": interval,
            "save_interval_updates": args.save_every or max(args.max_update // 10, 1),
            "keep_interval_updates": args.average,
            "log_format": "json",
            "log_interval": 25,
            "log_file": self.ckpt / "train.log",
        }
        fairseq = {
            "dropout": 0.2,
            "no_progress_bar": True,
            "num_workers": 0,
            "validate_interval_updates": interval,
        }
        train_sh = str(self.root / "scripts" / "train.sh")
        command = ["bash", train_sh, *option_words(recipe), "--", *option_words(fairseq)]
        sys.stdout.flush()
        check(subprocess.run(command, env=self.env).returncode, "training")

    def average(self):
        from tpp_pipeline.steps import file_identity

        from . import average

        args = self.args

        def average_checkpoints():
            # fairseq writes no checkpoint_<epoch>_<update>.pt when an interval ends an
            # epoch, so there may be fewer than asked for: average those there are
            found = len(list(self.ckpt.glob("checkpoint_*_*.pt")))
            if found == 0:
                raise DemoError(f"no checkpoint_<epoch>_<update>.pt in {self.ckpt} to average")
            options = {
                "inputs": self.ckpt,
                "num_update_checkpoints": min(found, args.average),
                "output": self.avg,
                "force": True,
            }
            check(average.main(option_words(options)), "averaging")

        self.averaged = self.step(
            "average",
            {
                "checkpoint": file_identity(self.ckpt / "checkpoint_last.pt"),
                "average": args.average,
            },
            [self.avg],
            average_checkpoints,
        )

    def evaluate(self):
        from tpp_pipeline.steps import file_identity

        from . import evaluate

        reference = self.sample / "test.de"
        options = {
            "data": self.data,
            "checkpoint": self.avg,
            "reference": reference,
            "out": self.eval_dir,
            "cpu": True,
            "force": True,
        }
        self.step(
            "evaluate",
            {"checkpoint": file_identity(self.avg), "reference": file_identity(reference)},
            [self.eval_dir / "bleu.txt", self.eval_dir / "generate-test.txt"],
            lambda: check(evaluate.main(option_words(options)), "evaluation"),
            self.averaged,
        )

    def plot_training(self):
        from tpp_pipeline.steps import file_identity

        from . import plot_training

        log = self.ckpt / "train.log"
        options = {"log": log, "out_dir": self.plots, "force": True}
        self.step(
            "plots",
            {"log": file_identity(log)},
            [self.plots],
            lambda: check(
                plot_training.main(option_words(options)), "plotting the training curves"
            ),
        )

    def attention_and_similarity(self):
        from tpp_pipeline.steps import file_identity

        from . import embedding_similarity, plot_attention

        sentence = os.environ.get("DEMO_SENTENCE", "There is a fire in the mountain.")
        codes = self.out / "work" / "bpe" / "codes"
        model = {"path": self.avg, "data": self.data, "bpe_codes": codes, "sentence": sentence}
        maps = {**model, "out_dir": self.attention, "force": True}
        self.step(
            "attention",
            {
                "checkpoint": file_identity(self.avg),
                "bpe_codes": file_identity(codes),
                "sentence": sentence,
            },
            [self.attention],
            lambda: check(plot_attention.main(option_words(maps)), "drawing the attention maps"),
            self.averaged,
        )
        printed = io.StringIO()
        with redirect_stdout(printed):
            status = embedding_similarity.main(
                option_words(model) + ["--words", "fire", "mountain"]
            )
        print(printed.getvalue(), end="", flush=True)
        write_atomically(self.out / "fire_mountain.txt", printed.getvalue())
        if status != 0:
            print("(similarity: the words are not single tokens of this model's vocabulary)")

    def summary(self):
        print(f"\n=== done in {time.monotonic() - self.started:.0f}s")
        print(
            f"  data:            {self.data}\n"
            f"  checkpoints:     {self.ckpt}   (averaged: {self.avg})\n"
            f"  translations:    {self.eval_dir / 'generate-test.txt'}\n"
            f"  scores:          {self.eval_dir / 'bleu.txt'}\n"
            f"  training curves: {self.plots}\n"
            f"  attention maps:  {self.attention}\n"
        )
        print((self.eval_dir / "bleu.txt").read_text(encoding="utf-8"), end="", flush=True)


#: the demo's stages in order: what each says it does, and the method that does it
STAGES = (
    (lambda demo: f"prepare, tag (spaCy), BPE and binarize {demo.sample}", Demo.prepare),
    (
        lambda demo: "train transformer_pp_cpu (d=256, 3+3 layers) with POS/NER losses for "
        f"{demo.args.max_update} updates",
        Demo.train,
    ),
    (lambda demo: f"average the last {demo.args.average} checkpoints", Demo.average),
    (
        lambda demo: "translate the test set (beam 5, length penalty 0.5) and score it",
        Demo.evaluate,
    ),
    (lambda demo: "training curves", Demo.plot_training),
    (
        lambda demo: "attention maps and the paper's fire/mountain similarity",
        Demo.attention_and_similarity,
    ),
)


def run_demo(args, root):
    demo = Demo(args, root)
    for number, (title, stage) in enumerate(STAGES, 1):
        elapsed = time.monotonic() - demo.started
        print(f"\n=== [{number}/{len(STAGES)}] {title(demo)} ({elapsed:.0f}s elapsed)", flush=True)
        stage(demo)
    demo.summary()


def main(argv=None):
    root = checkout()
    args = build_parser(root or Path("<checkout>")).parse_args(argv)  # (--help anywhere)
    if root is None:
        print(
            f"{PROG}: error: the demo runs from a checkout of the repository (its sample "
            "corpus and scripts/train.sh); this package is installed elsewhere",
            file=sys.stderr,
        )
        return 2
    # before torch is imported (the plots and analyses run in this process)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from tpp_pipeline.lock import exit_cleanly_on_sigterm

    exit_cleanly_on_sigterm()  # stopped (Ctrl-C, kill): its commands too, no traceback
    try:
        run_demo(args, root)
    except UserError as error:  # (the data pipeline's too: a stage wrote less than it should)
        return report(PROG, error)
    except OSError as error:  # a full or read-only disk under --out
        reported = from_os_error(error, folders="--out")
        if reported is None:
            raise
        return report(PROG, reported)
    return 0


if __name__ == "__main__":
    sys.exit(main())
