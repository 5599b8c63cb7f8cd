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
    # the paper's scale on a SLURM cluster, every run a job of 4 GPUs (docs/slurm.md):
    tpp-study --config wmt14-big --launcher slurm --partition gpu --data data-bin/wmt14_en_de \\
        --test-reference work/wmt14_en_de/raw/test.de --variants transformer,hybrid,hybrid+tags --out runs/wmt14

Runs live in ``OUT/runs/<variant>-s<seed>-<id>/``, ``<id>`` a hash of everything that
defines the run: a re-run reuses finished runs and resumes interrupted ones, and any
change of a setting is a new run. Options after ``--`` go to every fairseq-train command.
"""

import argparse
import hashlib
import json
import math
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from .evaluate import plugin_dir
from .train import OPTIMIZER, PRESETS, RESUMABLE, SETTINGS

PROG = "tpp-study"

#: part of every run's identity: raised whenever a change of the code changes what a
#: run computes from the same command (initial weights, numerics), so that runs made
#: before it are trained again instead of reused next to runs made after it.
#: 2: transformer_pp builds its layers in fairseq's order again (other initial weights
#: for the hybrid variants; the control starts from the transformer's weights)
RUN_VERSION = 2

VARIANTS = {
    "transformer": dict(
        label="(a) transformer",
        what="fairseq's transformer",
        arch="transformer",
        task="translation",
        criterion="label_smoothed_cross_entropy",
        model=[],
        conv=False,
    ),
    "control": dict(
        label="(b) control",
        what="transformer_pp, 0 conv heads, no tags",
        arch="transformer_pp",
        task="translation",
        criterion="label_smoothed_cross_entropy",
        model=[
            "--encoder-conv-heads",
            "0",
            "--decoder-conv-heads",
            "0",
            "--encoder-tag-layers",
            "",
        ],
        conv=False,
    ),
    "hybrid": dict(
        label="(c) hybrid",
        what="hybrid heads, no tags",
        arch="transformer_pp",
        task="translation",
        criterion="label_smoothed_cross_entropy",
        model=["--encoder-tag-layers", ""],
        conv=True,
    ),
    "hybrid+tags": dict(
        label="(d) hybrid+tags",
        what="hybrid heads + POS/NER losses (Transformer++)",
        arch="transformer_pp",
        task="translation_with_tags",
        criterion="label_smoothed_cross_entropy_with_tags",
        model=[],
        conv=True,
        tags=True,
    ),
}


@dataclass
class Config:
    """Everything that defines the study's runs, besides variant and seed."""

    embed_dim: int
    ffn_dim: int
    heads: int
    layers: int
    max_update: int
    max_tokens: int
    update_freq: int
    lr: float
    warmup_updates: int
    dropout: float
    attention_dropout: float
    activation_dropout: float
    label_smoothing: float = 0.1
    average: int = 5
    save_interval_updates: int = 0  # 0: max_update / 10
    validate_interval_updates: int = 0  # 0: max_update / 10
    dtype: str = "fp32"
    # data preparation (raw corpora only)
    bpe_merges: int = 16000
    max_len: int = 250
    extra: List[str] = field(default_factory=list)
    # the conv heads' output scale (--conv-head-scaling of transformer_pp; "none": the paper)
    conv_head_scaling: str = "none"
    # GPUs per run, data-parallel (--distributed-world-size): an update is gpus x
    # update_freq batches of max_tokens
    gpus: int = 1
    # "all": one embedding table for source, target and output (--share-all-embeddings);
    # "decoder": the target's input and output tied (--share-decoder-input-output-embed)
    shared_embeddings: str = "all"
    # the tag losses of the hybrid+tags variant ("" / 0: the paper's, which are the
    # defaults of transformer_pp and of its criterion: pos:1,ner:2 and weight 1 each)
    encoder_tag_layers: str = ""
    tag_loss_weights: str = ""
    tag_loss_decay_updates: int = 0


#: the fields of Config that only the variants with tag losses read, and their defaults
TAG_FIELDS = {"encoder_tag_layers": "", "tag_loss_weights": "", "tag_loss_decay_updates": 0}


def tag_settings(cfg: Config) -> str:
    """The tag losses of hybrid+tags, for the report."""
    layers = cfg.encoder_tag_layers or "pos:1,ner:2"
    weights = cfg.tag_loss_weights or "pos:1,ner:1"
    decay = (
        f", falling linearly to 0 at update {cfg.tag_loss_decay_updates}"
        if cfg.tag_loss_decay_updates
        else ""
    )
    paper = " (the paper)" if all(getattr(cfg, k) == d for k, d in TAG_FIELDS.items()) else ""
    return f"; tag heads after encoder layers {layers}, loss weights {weights}{decay}{paper}"


def check_tag_settings(cfg: Config) -> Optional[str]:
    """What is wrong with the tag-loss settings, before any run is planned (None: nothing);
    read as the model and the criterion read them."""
    from tpp_plugin.options import parse_named

    try:
        layers = parse_named(cfg.encoder_tag_layers, "encoder-tag-layers")
        weights = parse_named(cfg.tag_loss_weights, "tag-loss-weights", cast=float)
    except ValueError as error:
        return str(error)
    outside = {name: layer for name, layer in layers.items() if not 1 <= layer <= cfg.layers}
    if outside:
        return f"--encoder-tag-layers: {outside} outside the encoder's layers 1..{cfg.layers}"
    negative = {name: weight for name, weight in weights.items() if weight < 0}
    if negative:
        return f"--tag-loss-weights: negative weights {negative}"
    if cfg.tag_loss_decay_updates < 0:
        return f"--tag-loss-decay-updates must be >= 0, not {cfg.tag_loss_decay_updates}"
    return None


def recipe(name: str) -> str:
    """A default of the training recipe (tpp_tools/train.py)."""
    return SETTINGS[name][1]


CONFIGS = {
    # transformer-base size on one GPU, bf16: all variants x 3 seeds in about 25 minutes
    "gpu": Config(
        embed_dim=512,
        ffn_dim=2048,
        heads=8,
        layers=6,
        max_update=2200,
        max_tokens=8192,
        update_freq=1,
        lr=7e-4,
        warmup_updates=400,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        average=5,
        dtype="bf16",
        bpe_merges=16000,
    ),
    # transformer-base size on one GPU, bf16, sized for one short call on an H100 (all
    # variants x 2 seeds, four at a time): a few minutes of training in all
    "gpu-short": Config(
        embed_dim=512,
        ffn_dim=2048,
        heads=8,
        layers=6,
        max_update=600,
        max_tokens=8192,
        update_freq=1,
        lr=7e-4,
        warmup_updates=150,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        average=3,
        save_interval_updates=60,
        validate_interval_updates=60,
        dtype="bf16",
        bpe_merges=8000,
    ),
    # chosen for learning speed on a 2-core CPU (a small model, a small BPE vocabulary,
    # short segments, small batches, a short warm-up): all variants x 2 seeds in 3 hours
    "cpu": Config(
        embed_dim=256,
        ffn_dim=512,
        heads=4,
        layers=3,
        max_update=1400,
        max_tokens=2048,
        update_freq=1,
        lr=2e-3,
        warmup_updates=200,
        dropout=0.1,
        attention_dropout=0.0,
        activation_dropout=0.0,
        average=5,
        dtype="fp32",
        bpe_merges=8000,
        max_len=40,
    ),
    # the paper's scale, on a cluster (--launcher slurm; docs/slurm.md): the sizes of the
    # En-De big preset transformer_pp_wmt_en_de_big (a test holds them to it) and the
    # training recipe of tpp_tools/train.py, each run on 4 GPUs. --update-epoch-batch-itr:
    # every epoch's batches grouped anew from the seed and the epoch, so that a run resumed
    # after a requeue trains on the batches an uninterrupted run would (fairseq otherwise
    # groups the batches once, with the seed of the epoch it starts in: another grouping)
    "wmt14-big": Config(
        embed_dim=1024,
        ffn_dim=4096,
        heads=16,
        layers=5,
        dropout=0.1,
        attention_dropout=0.25,
        activation_dropout=0.25,
        shared_embeddings="decoder",
        gpus=4,
        lr=float(PRESETS["en-de"][1]),
        warmup_updates=int(recipe("warmup_updates")),
        max_update=int(recipe("max_update")),
        max_tokens=int(recipe("max_tokens")),
        update_freq=int(recipe("update_freq")),
        label_smoothing=float(recipe("label_smoothing")),
        save_interval_updates=int(recipe("save_interval_updates")),
        validate_interval_updates=int(recipe("save_interval_updates")),
        average=int(recipe("keep_interval_updates")),
        dtype="fp16",
        bpe_merges=40000,
        extra=list(RESUMABLE),
    ),
}


class StudyError(Exception):
    """Bad input: the message says what and where."""


# ----------------------------------------------------------------------------- helpers


def log(message: str) -> None:
    # one write per line: print() writes the newline apart, and the runs log from threads
    sys.stdout.write(f"[study {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stdout.flush()


def count_lines(path: Path) -> int:
    """Lines as ``str.splitlines()`` counts them (a last line without newline counts)."""
    with open(path, encoding="utf-8", newline="") as handle:
        return len(handle.read().splitlines())


def split_size(data: Path, split: str) -> Optional[int]:
    """Sentences in a binarized split (from the target side's .idx header), or None."""
    import numpy as np

    idx = sorted(data.glob(f"{split}.*-*.*.idx"))
    if not idx:
        return None
    with open(idx[0], "rb") as handle:
        header = handle.read(9 + 8 + 1 + 8)
    return int(np.frombuffer(header[18:26], dtype="<i8")[0])


def language_pair(data: Path):
    for idx in sorted(data.glob("train.*-*.*.idx")):
        pair = idx.name.split(".")[1]
        src, _, tgt = pair.partition("-")
        if src and tgt:
            return src, tgt
    raise StudyError(f"{data}: no train.<src>-<tgt>.*.idx: not a fairseq data folder")


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_identity(
    args, cfg: Config, src: str, tgt: str, given: Dict[str, str], sizes: Dict[str, int]
) -> str:
    """Identity of the data a raw corpus becomes: the inputs' contents (not their names
    or modification times: a corpus copied or unpacked again is the same corpus), the
    carving and the preparation settings. Any change prepares a new folder."""
    from tpp_pipeline.splits import side_path

    identity = {
        "corpus": [file_digest(side_path(args.corpus, lang)) for lang in (src, tgt)],
        "given": {
            n: [file_digest(side_path(p, lang)) for lang in (src, tgt)] for n, p in given.items()
        },
        "sizes": sizes,
        "seed": args.split_seed,
        "bpe": cfg.bpe_merges,
        "max_len": cfg.max_len,
        "tags": args.variants_need_tags,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def fingerprint(data: Path) -> str:
    """Identity of a data folder: its dictionaries and the sizes of its splits."""
    digest = hashlib.sha256()
    for path in sorted(data.glob("dict.*.txt")) + sorted(data.glob("*.idx")):
        digest.update(path.name.encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


class Children:
    """The commands the study is running (its worker threads start them). A study told to
    stop (SIGTERM, SIGINT) stops them and waits for them before it exits, so that no
    fairseq-train outlives it and writes into a run folder the next study uses; and it
    starts no new command once told."""

    def __init__(self):
        self._procs = set()
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    def run(self, cmd, out, env) -> int:
        with self._lock:
            if self.stopping.is_set():
                raise RuntimeError("the study is stopping")
            proc = subprocess.Popen(
                [str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env
            )
            self._procs.add(proc)
        try:
            return proc.wait()
        finally:
            with self._lock:
                self._procs.discard(proc)

    def stop(self, grace: float = 60.0) -> None:
        with self._lock:
            self.stopping.set()
            procs = list(self._procs)
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


CHILDREN = Children()


def run_command(cmd, log_path: Path, env=None) -> None:
    with open(log_path, "a") as out:
        out.write("+ " + " ".join(shlex.quote(str(c)) for c in cmd) + "\n")
        out.flush()
        returncode = CHILDREN.run(cmd, out, env)
    if returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"command failed ({returncode}), log {log_path}:\n" + "\n".join(tail))


def json_records(log_path: Path):
    """fairseq's JSON --log-file records (dicts)."""
    out = []
    if not log_path.exists():
        return out
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


# ----------------------------------------------------------------------------- data


def prepare_data(args, cfg: Config, plan_only: bool = False) -> Dict[str, Path]:
    """Carve (if needed) and prepare raw text; or check a prepared data folder.
    Returns ``data`` (the data-bin), ``reference`` (raw test target), ``source`` (raw
    test source, optional), ``bpe_codes`` (optional). ``plan_only``: carve and prepare
    nothing; ``prepared`` says whether the folder is there already."""
    if args.data is not None:
        data = args.data
        if not data.is_dir():
            raise StudyError(f"--data {data}: no such folder")
        src, tgt = language_pair(data)
        if args.test_reference is None:
            raise StudyError("--data needs --test-reference (the raw, untokenised test target)")
        reference = args.test_reference
        if not reference.is_file():
            raise StudyError(f"--test-reference {reference}: no such file")
        if args.variants_need_tags and not (data / "dict.pos.txt").exists():
            raise StudyError(
                f"{data} has no POS/NER labels (dict.pos.txt) for the hybrid+tags variant: "
                "prepare it with tpp-prepare-corpus, or leave that variant out"
            )
        paths = {
            "data": data,
            "reference": reference,
            "source": args.test_source,
            "bpe_codes": args.bpe_codes,
        }
    else:
        src, tgt = args.source_lang, args.target_lang
        if not (src and tgt):
            raise StudyError("--corpus needs -s/--source-lang and -t/--target-lang")
        from tpp_pipeline.errors import DataError
        from tpp_pipeline.splits import carve_corpus

        given = {name: getattr(args, name) for name in ("test", "valid") if getattr(args, name)}
        sizes = {
            name: size
            for name, size in (("test", args.test_size), ("valid", args.valid_size))
            if name not in given
        }
        try:
            digest = data_identity(args, cfg, src, tgt, given, sizes)
            root = args.out / "data" / f"{src}-{tgt}-{digest}"
            raw = root / "raw"
            name = f"{src}_{tgt}_bpe{cfg.bpe_merges}"
            data = root / "data-bin" / name
            if plan_only and not (data / "preprocess.done").exists():
                return {"data": data, "prepared": False, "src": src, "tgt": tgt}
            carve_corpus(args.corpus, src, tgt, raw, sizes, seed=args.split_seed, given=given)
        except DataError as err:
            raise StudyError(str(err)) from None
        if not (data / "preprocess.done").exists():
            log(f"preparing {raw} -> {data} (tokenise, tag, BPE {cfg.bpe_merges}, binarize)")
            cmd = [
                sys.executable,
                "-m",
                "tpp_pipeline.pipeline",
                "-s",
                src,
                "-t",
                tgt,
                "--trainpref",
                raw / "train",
                "--validpref",
                raw / "valid",
                "--testpref",
                raw / "test",
                "--name",
                name,
                "--work-dir",
                root / "work",
                "--data-bin",
                root / "data-bin",
                "--bpe-merges",
                cfg.bpe_merges,
                "--max-len",
                cfg.max_len,
                "--workers",
                args.workers,
            ]
            if not args.variants_need_tags:
                cmd.append("--no-tags")
            run_command(cmd, root / "prepare.log")
            (data / "preprocess.done").write_text("ok\n")
        paths = {
            "data": data,
            "reference": raw / f"test.{tgt}",
            "source": raw / f"test.{src}",
            "bpe_codes": root / "work" / "bpe" / "codes",
        }
    size = split_size(paths["data"], "test")
    if size is None:
        raise StudyError(f"{paths['data']}: no test split (test.*.idx)")
    ref_lines = count_lines(paths["reference"])
    if ref_lines != size:
        raise StudyError(
            f"test reference {paths['reference']} has {ref_lines} lines but the test split of "
            f"{paths['data']} has {size} sentences"
        )
    paths["src"], paths["tgt"] = language_pair(paths["data"])
    paths["prepared"] = True
    return paths


# ----------------------------------------------------------------------------- runs


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


def train_command(
    variant: str, seed: int, cfg: Config, data: Path, folder: Path, device: str, extra: List[str]
) -> List[str]:
    v = VARIANTS[variant]
    save, valid = intervals(cfg)
    dims = []
    for side in ("encoder", "decoder"):
        dims += [
            f"--{side}-embed-dim",
            cfg.embed_dim,
            f"--{side}-ffn-embed-dim",
            cfg.ffn_dim,
            f"--{side}-attention-heads",
            cfg.heads,
            f"--{side}-layers",
            cfg.layers,
        ]
    precision = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}[cfg.dtype]
    scaling = (
        ["--conv-head-scaling", cfg.conv_head_scaling]
        if v["conv"] and cfg.conv_head_scaling != "none"
        else []
    )
    shared = {"all": "--share-all-embeddings", "decoder": "--share-decoder-input-output-embed"}[
        cfg.shared_embeddings
    ]
    tags = []
    if v.get("tags"):
        for name, default in TAG_FIELDS.items():
            if getattr(cfg, name) != default:
                tags += ["--" + name.replace("_", "-"), getattr(cfg, name)]
    cmd = [
        "fairseq-train",
        data,
        "--user-dir",
        plugin_dir(),
        "--arch",
        v["arch"],
        *v["model"],
        *scaling,
        *dims,
        shared,
        "--dropout",
        cfg.dropout,
        "--attention-dropout",
        cfg.attention_dropout,
        "--activation-dropout",
        cfg.activation_dropout,
        "--task",
        v["task"],
        "--criterion",
        v["criterion"],
        "--label-smoothing",
        cfg.label_smoothing,
        *tags,
        *OPTIMIZER,
        "--lr",
        cfg.lr,
        "--warmup-updates",
        cfg.warmup_updates,
        "--max-tokens",
        cfg.max_tokens,
        "--update-freq",
        cfg.update_freq,
        "--max-update",
        cfg.max_update,
        "--seed",
        seed,
        *precision,
        "--save-dir",
        folder / "checkpoints",
        "--save-interval-updates",
        save,
        "--keep-interval-updates",
        cfg.average,
        "--no-epoch-checkpoints",
        "--save-interval",
        1000000,
        "--validate-interval-updates",
        valid,
        "--validate-interval",
        1000000,
        "--log-format",
        "json",
        "--log-file",
        folder / "train.log",
        "--log-interval",
        max(1, valid // 4),
        "--no-progress-bar",
        "--num-workers",
        1 if device == "cuda" else 0,
        # cfg.gpus devices per run (the runs go in parallel, each on its own GPUs where there
        # are several: gpu_slots): fairseq's default is every GPU it sees, data-parallel,
        # which would multiply the batch and make the parallel runs share one rendezvous port
        "--distributed-world-size",
        cfg.gpus,
        "--skip-invalid-size-inputs-valid-test",
        *(["--cpu"] if device == "cpu" else []),
        *cfg.extra,
        *extra,
    ]
    return [str(c) for c in cmd]


def plan_runs(args, cfg: Config, data: Path) -> List[Run]:
    """The runs; before the data folder is prepared (a dry run) their ids, which depend
    on its dictionaries, are not known yet and read ``<id>``."""
    runs = []
    data_id = fingerprint(data) if data.is_dir() else None
    # seed by seed: the runs that go first (and, stopped midway, finish first) are every
    # variant's first seed, which a report can compare
    for seed in args.seeds:
        for variant in args.variants:
            config = asdict(cfg)
            if config["conv_head_scaling"] == "none" or not VARIANTS[variant]["conv"]:
                # no effect on this run: its identity (and reuse) does not depend on it
                del config["conv_head_scaling"]
            for name, default in TAG_FIELDS.items():
                if config[name] == default or not VARIANTS[variant].get("tags"):
                    del config[name]  # the paper's tag losses, or none: the identity as before
            for name, before in (("gpus", 1), ("shared_embeddings", "all")):
                if config[name] == before:  # as every run was before the field: the same identity
                    del config[name]
            spec = {
                "variant": variant,
                "seed": seed,
                "config": config,
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


def trained_updates(run: Run) -> int:
    done = run.folder / "train.done"
    if done.exists():
        return int(done.read_text().split()[0])
    return 0


def checkpoint_updates(run: Run) -> int:
    """Updates checkpoint_last.pt has seen (0 without a readable one)."""
    from .checkpoint_files import CheckpointError, load_checkpoint, num_updates

    path = run.folder / "checkpoints" / "checkpoint_last.pt"
    if not path.exists():
        return 0
    try:
        return num_updates(load_checkpoint(path, mmap=True)) or 0
    except CheckpointError:
        return 0


def translated(run: Run, reference_lines: int) -> bool:
    """The test set translated and scored: the scores, and one translation per reference
    line (a truncated translation file is done again)."""
    hyp = run.folder / "eval" / "hyp.detok"
    return (
        (run.folder / "eval" / "bleu.txt").exists()
        and hyp.exists()
        and count_lines(hyp) == reference_lines
    )


def last_checkpoint_updates(run: Run) -> int:
    updates = [
        int(r.get("train_num_updates", r.get("num_updates", 0)) or 0)
        for r in json_records(run.folder / "train.log")
    ]
    return max(updates, default=0)


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
    """:func:`execute`'s steps, each skipped when done; ``env_extra`` added to the
    commands' environment."""
    run.folder.mkdir(parents=True, exist_ok=True)
    (run.folder / "run.json").write_text(
        json.dumps(
            {**run.spec, "train_command": " ".join(shlex.quote(c) for c in run.train_cmd)}, indent=1
        )
        + "\n"
    )
    env = dict(os.environ, **env_extra)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONWARNINGS"] = "ignore"
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    out_log = run.folder / "run.log"
    if trained_updates(run) < cfg.max_update and checkpoint_updates(run) >= cfg.max_update:
        # trained to the end, stopped before it was marked so: finished means finished
        # (fairseq-train started again would train one update more and overwrite checkpoints)
        (run.folder / "train.done").write_text(
            f"{checkpoint_updates(run)} updates, nan s (found finished)\n"
        )
    if trained_updates(run) < cfg.max_update:
        log(f"{run.name}: training ({cfg.max_update} updates) in {run.folder}")
        started = time.time()
        if (run.folder / "checkpoints" / "checkpoint_last.pt").exists():
            # an interrupted run resumes; a torn checkpoint_last.pt is set aside first
            run_command(
                [
                    sys.executable,
                    "-m",
                    "tpp_tools.recover",
                    "--save-dir",
                    run.folder / "checkpoints",
                ],
                out_log,
                env=env,
            )
        run_command(run.train_cmd, out_log, env=env)
        updates = last_checkpoint_updates(run)
        if updates < cfg.max_update:
            raise RuntimeError(
                f"{run.name}: fairseq-train stopped at update {updates} of {cfg.max_update}"
            )
        (run.folder / "train.done").write_text(
            f"{updates} updates, {time.time() - started:.0f} s\n"
        )
    ckpt = run.folder / "checkpoints"
    avg = run.folder / "checkpoint_avg.pt"
    if not avg.exists():
        interval = sorted(ckpt.glob("checkpoint_*_*.pt"))
        n = min(cfg.average, len(interval))
        log(f"{run.name}: averaging the last {n} checkpoints")
        run_command(
            [
                sys.executable,
                "-m",
                "tpp_tools.average",
                "--inputs",
                ckpt,
                "--num-update-checkpoints",
                n,
                "--output",
                avg,
            ],
            out_log,
            env=env,
        )
    if not translated(run, count_lines(paths["reference"])):
        log(f"{run.name}: translating the test set")
        cmd = [
            sys.executable,
            "-m",
            "tpp_tools.evaluate",
            "--data",
            paths["data"],
            "--checkpoint",
            avg,
            "--reference",
            paths["reference"],
            "--out",
            run.folder / "eval",
            "--force",
            "--max-tokens",
            args.gen_max_tokens,
        ]
        if args.device == "cpu":
            cmd.append("--cpu")
        elif cfg.dtype == "fp16":
            # float16 decoding for a model trained in float16 only: fairseq-generate 0.12 has
            # no bfloat16 inference, and a model trained in float32 or bfloat16 need not keep
            # its activations within float16's range (those decode in float32)
            cmd += ["--", "--fp16"]
        run_command(cmd, out_log, env=env)
    if not args.keep_checkpoints:  # the averaged model is what the study keeps
        for path in list(ckpt.glob("checkpoint_*_*.pt")) + [ckpt / "checkpoint_best.pt"]:
            path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- report


def read_scores(path: Path) -> dict:
    scores = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(": ")
        scores[key] = value
    return scores


def t_interval(values: List[float]) -> float:
    """Half-width of the 95% confidence interval of the mean over seeds (Student's t)."""
    n = len(values)
    if n < 2:
        return float("nan")
    t95 = {
        2: 12.706,
        3: 4.303,
        4: 3.182,
        5: 2.776,
        6: 2.571,
        7: 2.447,
        8: 2.365,
        9: 2.306,
        10: 2.262,
    }
    return t95.get(n, 1.96) * statistics.stdev(values) / math.sqrt(n)


def significance(runs_by_variant: Dict[str, List[Run]], reference: Path, samples: int):
    """sacreBLEU's paired bootstrap of every variant against the baseline, each
    variant's seeds pooled (its translations of the test set, seed after seed, against
    the reference repeated as often)."""
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    refs = reference.read_text(encoding="utf-8").splitlines()
    names = list(runs_by_variant)
    seeds = min(len(runs_by_variant[n]) for n in names)
    systems = []
    for name in names:
        hyps = []
        for run in sorted(runs_by_variant[name], key=lambda r: r.seed)[:seeds]:
            lines = (run.folder / "eval" / "hyp.detok").read_text(encoding="utf-8").splitlines()
            if len(lines) != len(refs):
                raise StudyError(
                    f"{run.folder / 'eval' / 'hyp.detok'}: {len(lines)} lines, reference {len(refs)}"
                )
            hyps += lines
        systems.append((name, hyps))
    test = PairedTest(
        systems, {"BLEU": BLEU(), "chrF": CHRF()}, [refs * seeds], test_type="bs", n_samples=samples
    )
    signatures, scores = test()
    # sacreBLEU names the metrics by their own names (e.g. "chrF2")
    bleu_key = next(k for k in scores if k.startswith("BLEU"))
    chrf_key = next(k for k in scores if k.startswith("chrF"))
    out = {}
    baseline_hyps = systems[0][1]
    for i, name in enumerate(scores["System"]):
        out[name] = {
            "BLEU": scores[bleu_key][i],
            "chrF": scores[chrf_key][i],
            # sacreBLEU gives a system compared with an identical one its smallest
            # p-value ("a zero difference should not be attributed to chance"):
            # the report says "identical" instead of quoting it
            "identical": i > 0 and dict(systems)[name] == baseline_hyps,
        }
    sigs = {"BLEU": str(signatures[bleu_key]), "chrF": str(signatures[chrf_key])}
    return out, sigs, seeds


def plot_curves(runs: List[Run], target: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "transformer": "tab:blue",
        "control": "tab:green",
        "hybrid": "tab:orange",
        "hybrid+tags": "tab:red",
    }
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for run in runs:
        valid = [r for r in json_records(run.folder / "train.log") if "valid_loss" in r]
        if not valid:
            continue
        xs = [int(r["valid_num_updates"]) for r in valid]
        ys = [float(r["valid_nll_loss"]) for r in valid]
        ax.plot(
            xs,
            ys,
            styles[(run.seed - 1) % len(styles)],
            color=colours.get(run.variant, "k"),
            label=f"{run.variant} seed {run.seed}",
            linewidth=1.2,
        )
        drawn = True
    ax.set_xlabel("updates")
    ax.set_ylabel("validation NLL (base 2, per target token)")
    ax.set_title("Learning curves (every variant, every seed)")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = target.with_suffix(f".{os.getpid()}.tmp.png")  # a --report-only may write beside a study
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, target)
    return drawn


def chrf_of(run: Run, reference: Path) -> float:
    from sacrebleu.metrics import CHRF

    hyps = (run.folder / "eval" / "hyp.detok").read_text(encoding="utf-8").splitlines()
    refs = reference.read_text(encoding="utf-8").splitlines()
    return CHRF().corpus_score(hyps, [refs]).score


def run_facts(run: Run, reference: Path) -> dict:
    records = json_records(run.folder / "train.log")
    inner = [r for r in records if "wps" in r and "train_wps" not in r]
    valid = [r for r in records if "valid_loss" in r]
    done = (
        (run.folder / "train.done").read_text().split()
        if (run.folder / "train.done").exists()
        else []
    )
    return {
        "wps": statistics.median(float(r["wps"]) for r in inner[1:] or inner)
        if inner
        else float("nan"),
        "valid_nll": float(valid[-1]["valid_nll_loss"]) if valid else float("nan"),
        "train_seconds": float(done[2]) if len(done) > 2 else float("nan"),
        "scores": read_scores(run.folder / "eval" / "bleu.txt"),
        "chrf": chrf_of(run, reference),
    }


def analysis_section(by_variant, facts, paths) -> List[str]:
    """The paper's analysis (its Fig. 3 discussion) on the best model of each kind with
    convolution heads: the cosine similarity of "fire" and "mountain" in the dot-product
    heads' output and in LocalConv's representation, per encoder layer."""
    lines = []
    codes = paths.get("bpe_codes")
    for variant in ("hybrid", "hybrid+tags"):
        if variant not in by_variant:
            continue
        best = max(
            by_variant[variant], key=lambda r: float(facts[r.name]["scores"]["sacrebleu_detok"])
        )
        cmd = [
            sys.executable,
            "-m",
            "tpp_tools.embedding_similarity",
            "--path",
            best.folder / "checkpoint_avg.pt",
            "--data",
            paths["data"],
        ]
        if codes and Path(codes).exists():
            cmd += ["--bpe-codes", codes]
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
        if not lines:
            lines += [
                "## Fire and mountain",
                "",
                "The paper's analysis on the best model (by test BLEU) of each kind with convolution "
                "heads: cosine similarity of the two words in the dot-product heads' output and in "
                "LocalConv's representation, per encoder layer (paper: 0.21 vs 0.39).",
                "",
            ]
        body = (
            proc.stdout.strip()
            if proc.returncode == 0
            else f"(failed: {proc.stderr.strip()[-300:]})"
        )
        lines += [f"{VARIANTS[variant]['label']}, seed {best.seed}:", "", "```", body, "```", ""]
    return lines


def parameter_count(run: Run) -> int:
    import torch

    from tpp_plugin.compat import allow_fairseq_checkpoints

    allow_fairseq_checkpoints()

    state = torch.load(run.folder / "checkpoint_avg.pt", map_location="cpu", weights_only=True)
    return sum(
        t.numel()
        for k, t in state["model"].items()
        if hasattr(t, "numel")
        and "tag_heads" not in k
        and "_float_tensor" not in k
        and "version" not in k
    )


def write_report(
    args,
    cfg: Config,
    paths,
    runs: List[Run],
    command: str,
    elapsed: float,
    missing: Optional[List[Run]] = None,
) -> Path:
    """The report of ``runs`` (finished); ``missing``: planned runs not finished, named."""
    by_variant: Dict[str, List[Run]] = {}
    for run in runs:
        by_variant.setdefault(run.variant, []).append(run)
    facts = {run.name: run_facts(run, paths["reference"]) for run in runs}
    boot, signatures, pooled = significance(by_variant, paths["reference"], args.bootstrap_samples)
    plot = args.out / "curves.png"
    plot_curves(runs, plot)

    def fmt(x, digits=2):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    lines = [
        "# Quality study: Transformer++ against the Transformer",
        "",
        f"Data: `{paths['data']}` ({paths['src']}→{paths['tgt']}; test set {count_lines(paths['reference'])} "
        f"sentences, reference `{paths['reference']}`).",
        f"Budget (every run): {cfg.max_update} updates × up to {cfg.max_tokens * cfg.update_freq * cfg.gpus} tokens "
        f"per update (--max-tokens {cfg.max_tokens} × --update-freq {cfg.update_freq}"
        f"{f' × {cfg.gpus} GPUs' if cfg.gpus > 1 else ''}); Adam (0.9, 0.98), inverse-sqrt "
        f"schedule, peak lr {cfg.lr}, {cfg.warmup_updates} warm-up updates; d={cfg.embed_dim}, {cfg.heads} heads, "
        f"FFN {cfg.ffn_dim}, {cfg.layers}+{cfg.layers} layers, "
        f"{'shared embeddings' if cfg.shared_embeddings == 'all' else 'tied decoder embeddings'}, "
        f"dropout {cfg.dropout} / "
        f"attention {cfg.attention_dropout} / activation {cfg.activation_dropout}, label smoothing "
        f"{cfg.label_smoothing}, {cfg.dtype}; average of the last {cfg.average} checkpoints; beam 5, lenpen 0.5; "
        f"conv heads' output scaling (hybrid variants): {cfg.conv_head_scaling}"
        f"{' (the paper)' if cfg.conv_head_scaling == 'none' else ''}"
        f"{tag_settings(cfg) if 'hybrid+tags' in args.variants else ''}.",
        f"Seeds: {', '.join(map(str, sorted({r.seed for r in runs})))}. Device: {args.device_name}. "
        f"Wall time of this invocation: {elapsed / 60:.1f} min; training time per run (median): "
        f"{statistics.median(facts[r.name]['train_seconds'] for r in runs) / 60:.0f} min "
        "(words/s and times are as measured under the machine's load at the time: not a speed comparison, "
        "which is docs/benchmarks.md's).",
        "",
        *(
            [
                f"Not finished, not in the tables: {', '.join(r.name for r in missing)} (re-run the study "
                "to finish them).",
                "",
            ]
            if missing
            else []
        ),
        "| variant | what | parameters | BLEU (mean over seeds ± 95% CI) | per seed | chrF (mean) "
        "| tok. BLEU, compound split (mean) | bootstrap BLEU: mean ± 95% CI | p vs (a) "
        "| bootstrap chrF: mean ± 95% CI | p vs (a) | valid NLL | train words/s |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, vruns in by_variant.items():
        vruns = sorted(vruns, key=lambda r: r.seed)
        bleus = [float(facts[r.name]["scores"]["sacrebleu_detok"]) for r in vruns]
        chrfs = [facts[r.name]["chrf"] for r in vruns]
        toks = [float(facts[r.name]["scores"]["bleu_tok_compound_split"]) for r in vruns]
        b, c = boot[variant]["BLEU"], boot[variant]["chrF"]
        if variant == args.variants[0]:
            p_b = p_c = "—"
        elif boot[variant]["identical"]:
            p_b = p_c = "identical translations"
        else:
            p_b, p_c = fmt(b.p_value, 4), fmt(c.p_value, 4)
        lines.append(
            f"| {VARIANTS[variant]['label']} | {VARIANTS[variant]['what']} | {parameter_count(vruns[0]) / 1e6:.2f}M "
            f"| {statistics.mean(bleus):.2f} ± {fmt(t_interval(bleus))} | {' / '.join(f'{x:.2f}' for x in bleus)} "
            f"| {statistics.mean(chrfs):.2f} | {statistics.mean(toks):.2f} "
            f"| {b.mean:.2f} ± {b.ci:.2f} | {p_b} | {c.mean:.2f} ± {c.ci:.2f} | {p_c} "
            f"| {statistics.mean(facts[r.name]['valid_nll'] for r in vruns):.3f} "
            f"| {statistics.median(facts[r.name]['wps'] for r in vruns):,.0f} |"
        )
    first = runs[0]
    sig = facts[first.name]["scores"]
    lines += [
        "",
        f"Bootstrap: sacreBLEU's paired bootstrap resampling ({args.bootstrap_samples} resamples) of each variant "
        f"against {VARIANTS[args.variants[0]]['label']}, each system being its {pooled} seeds' translations "
        "of the test set one after the other (the reference repeated as often); p is the probability of the "
        "observed difference under the null hypothesis that the two systems are the same. A variant whose "
        "translations are word for word the baseline's is marked \"identical translations\" (sacreBLEU "
        "gives such a pair its smallest p-value by design).",
        f"Signatures: BLEU `{signatures['BLEU']}`; chrF `{signatures['chrF']}`; "
        f"per-run detokenised BLEU `{sig.get('sacrebleu_detok_signature', '')}`; tokenised `"
        f"{sig.get('bleu_tok_compound_split_signature', '')}`.",
        "",
        "![learning curves](curves.png)",
        "",
        "## Commands",
        "",
        "The study:",
        "",
        "```bash",
        command,
        "```",
        "",
        "Each run's fairseq-train command (the first seed of each variant; the others differ in --seed "
        "and folder):",
        "",
    ]
    for variant, vruns in by_variant.items():
        lines += [
            f"- {variant}:",
            "",
            "```bash",
            " ".join(shlex.quote(c) for c in vruns[0].train_cmd),
            "```",
            "",
        ]
    lines += analysis_section(by_variant, facts, paths)
    lines += [
        "Per-run scores and logs: `runs/<variant>-s<seed>-<id>/eval/bleu.txt`, `train.log`, `run.json`."
    ]
    report = args.out / "report.md"
    tmp = report.with_suffix(f".md.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, report)
    summary = {
        "config": asdict(cfg),
        "command": command,
        "runs": {
            r.name: {"folder": str(r.folder), **{k: v for k, v in facts[r.name].items()}}
            for r in runs
        },
        "bootstrap": {
            v: {m: (vars(x) if m != "identical" else x) for m, x in d.items()}
            for v, d in boot.items()
        },
        "signatures": signatures,
    }
    tmp = args.out / f"summary.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    os.replace(tmp, args.out / "summary.json")
    return report


# ----------------------------------------------------------------------------- main


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
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--variants",
        default="transformer,control,hybrid,hybrid+tags",
        help=f"from {', '.join(VARIANTS)}; the first is the baseline of the tests",
    )
    p.add_argument("--seeds", default="1,2,3")
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
        help="the hybrid variants' --conv-head-scaling (default none: the paper's; "
        "see docs/results.md)",
    )
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
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (CPU device)")
    p.add_argument("--gen-max-tokens", type=int, default=None, help="tokens per generation batch")
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
    p.add_argument("extra", nargs="*", help="options after -- go to every fairseq-train command")
    from . import study_slurm

    study_slurm.add_arguments(p)
    args = p.parse_args(argv)
    if (args.corpus is None) == (args.data is None):
        p.error("give either --corpus (raw text) or --data (a prepared folder)")
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if len(set(args.variants)) != len(args.variants):
        p.error("--variants: a variant is named twice")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if len(args.seeds) < 2:
        p.error(
            "--seeds: at least two seeds (a single run cannot tell a difference from seed noise)"
        )
    args.variants_need_tags = "hybrid+tags" in args.variants
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cfg = CONFIGS[args.config]
    cfg = Config(
        **{
            **asdict(cfg),
            **{k: getattr(args, k) for k in asdict(cfg) if getattr(args, k, None) is not None},
        }
    )
    if cfg.dtype not in ("fp32", "fp16", "bf16"):
        print(
            f"{PROG}: error: --dtype must be fp32, fp16 or bf16, not {cfg.dtype!r}", file=sys.stderr
        )
        return 2
    problem = check_tag_settings(cfg)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    import torch

    if args.device is None:  # a cluster's runs go to its GPU nodes, whatever this machine has
        args.device = "cuda" if args.launcher == "slurm" or torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and cfg.dtype != "fp32" and args.dtype is None:
        cfg.dtype = "fp32"
    from . import study_slurm

    problem = study_slurm.check_options(args, cfg)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    if args.launcher == "local":  # (a cluster's jobs: check_options named their device)
        if args.device == "cuda" and not torch.cuda.is_available():
            if not (args.dry_run or args.report_only):
                print(
                    f"{PROG}: error: --device cuda: torch {torch.__version__} sees no CUDA GPU on this machine "
                    "(--dry-run plans a GPU study anywhere, --report-only reports one)",
                    file=sys.stderr,
                )
                return 2
            args.device_name = "a CUDA GPU (planned on a machine without one)"
        else:
            args.device_name = (
                torch.cuda.get_device_name()
                if args.device == "cuda"
                else f"CPU ({os.cpu_count()} cores)"
            )
    args.parallel = args.parallel or (
        4 if args.device == "cuda" else max(1, (os.cpu_count() or 1) // args.threads)
    )
    args.gen_max_tokens = args.gen_max_tokens or (16384 if args.device == "cuda" else 4096)
    args.out.mkdir(parents=True, exist_ok=True)
    command = f"{PROG} " + " ".join(shlex.quote(a) for a in argv)
    if args.dry_run or args.report_only:  # they write no run: no lock, another study may be running
        status = plan_or_report(args, cfg, command)
        if args.dry_run and args.launcher == "slurm" and status == 0:
            print(study_slurm.describe(args, cfg))
        return status
    from tpp_pipeline.errors import DataError
    from tpp_pipeline.lock import work_dir_lock

    def stop(
        signum, frame
    ):  # SIGTERM (kill, a scheduler's limit) or SIGINT: the runs' commands too
        log(
            f"{signal.Signals(signum).name}: stopping the runs' commands; the same command resumes the study"
        )
        CHILDREN.stop()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        with work_dir_lock(args.out, user="tpp-study", folder="study folder"):
            return (study_slurm.submit if args.launcher == "slurm" else study)(args, cfg, command)
    except DataError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


def plan_or_report(args, cfg: Config, command: str) -> int:
    """--dry-run (carves and prepares nothing) and --report-only."""
    started = time.time()
    try:
        paths = prepare_data(args, cfg, plan_only=True)
    except StudyError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    runs = plan_runs(args, cfg, paths["data"])
    if args.dry_run:
        if not paths["prepared"]:
            print(
                f"(the data folder {paths['data']} is not prepared yet: the study will carve and prepare it "
                "first; the runs' ids follow from its dictionaries)"
            )
        for run in runs:
            state = "done" if trained_updates(run) >= cfg.max_update else "to train"
            print(
                f"{run.name} [{state}] {run.folder}\n  "
                + " ".join(shlex.quote(c) for c in run.train_cmd)
            )
        return 0
    if not paths["prepared"]:
        print(
            f"{PROG}: error: --report-only: the data folder {paths['data']} is not prepared: no run has "
            "finished",
            file=sys.stderr,
        )
        return 1
    finished = [run for run in runs if translated(run, count_lines(paths["reference"]))]
    if not any(run.variant == args.variants[0] for run in finished):
        print(
            f"{PROG}: error: --report-only: no run of the baseline {args.variants[0]} has finished in "
            f"{args.out / 'runs'}",
            file=sys.stderr,
        )
        return 1
    missing = [run for run in runs if run not in finished]
    try:
        report = write_report(args, cfg, paths, finished, command, time.time() - started, missing)
    except StudyError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    log(f"report of {len(finished)} finished run(s) of {len(runs)}: {report}")
    print(report.read_text())
    return 0


def study(args, cfg: Config, command: str) -> int:
    """Prepare, train, average, translate and report (the lock of ``args.out`` held)."""
    started = time.time()
    try:
        paths = prepare_data(args, cfg)
    except StudyError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    runs = plan_runs(args, cfg, paths["data"])
    where = args.device_name
    if args.device == "cuda":
        gpus = visible_gpus()
        try:
            args.gpu_slots = gpu_slots(args.parallel, gpus, cfg.gpus)
        except StudyError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        where += f" ({len(gpus)} visible: each run on {cfg.gpus} of {', '.join(gpus)})"
    log(
        f"{len(runs)} runs ({len(args.variants)} variants x {len(args.seeds)} seeds), {args.parallel} at a time "
        f"on {where}"
    )
    failures = []
    pool = ThreadPoolExecutor(max_workers=args.parallel)
    try:
        futures = {pool.submit(execute, run, cfg, paths, args): run for run in runs}
        for future, run in futures.items():
            try:
                future.result()
                log(f"{run.name}: done")
            except Exception as err:  # keep the other runs going; report at the end
                failures.append((run, err))
                log(f"{run.name}: FAILED: {err}")
    finally:  # told to stop: the runs not started are not started
        pool.shutdown(wait=True, cancel_futures=True)
    if failures:
        print(
            f"{PROG}: error: {len(failures)} run(s) failed; re-run the same command to resume:",
            file=sys.stderr,
        )
        for run, err in failures:
            print(f"  {run.name}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    try:
        report = write_report(args, cfg, paths, runs, command, time.time() - started)
    except StudyError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    log(f"report: {report}")
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
