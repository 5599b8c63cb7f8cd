"""Shared helpers of the test-suite: tiny dictionaries, models and corpora."""

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY

import tpp_plugin  # noqa: F401  (registers the model)
from tpp_plugin.models.transformer_pp import TransformerPPModel

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "tpp_plugin"
VENV_BIN = Path(sys.executable).parent


def make_dictionary(num_words: int = 20) -> Dictionary:
    d = Dictionary()
    for i in range(num_words):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=1)
    return d


class FakeTask:
    """The two or three things ``build_model`` asks of a task."""

    def __init__(self, dictionary: Dictionary, tag_dictionaries: Optional[Dict[str, Dictionary]] = None):
        self.source_dictionary = dictionary
        self.target_dictionary = dictionary
        self.tag_dictionaries = tag_dictionaries or {}


def build_model(arch: str = "transformer_pp_tiny", dictionary: Optional[Dictionary] = None,
                tag_dictionaries=None, **overrides) -> TransformerPPModel:
    args = argparse.Namespace(**overrides)
    ARCH_CONFIG_REGISTRY[arch](args)
    task = FakeTask(dictionary or make_dictionary(), tag_dictionaries)
    return TransformerPPModel.build_model(args, task)


def random_tokens(dictionary: Dictionary, bsz: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(dictionary.nspecial, len(dictionary), (bsz, length), generator=g)


def cli_env() -> dict:
    """Environment for fairseq's command-line tools: this interpreter's scripts first,
    one thread (the tests run on small CPUs next to each other)."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    return env


def run_cli(args, cwd=None, input_text=None, timeout=600) -> subprocess.CompletedProcess:
    """Run a command, raising with its output on failure."""
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=cli_env(), input=input_text,
        capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(map(str, args))}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def write_toy_corpus(folder: Path, n_train: int = 400, n_valid: int = 40, n_test: int = 20, seed: int = 1):
    """A toy "translation" task that a tiny model learns in a few hundred updates: the
    target is the source with every word mapped through a fixed lexicon and the order
    reversed. Returns the prefixes (train, valid, test)."""
    rng = random.Random(seed)
    vocab = [f"s{i}" for i in range(24)]
    lexicon = {w: f"t{i}" for i, w in enumerate(vocab)}
    folder.mkdir(parents=True, exist_ok=True)
    prefixes = {}
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        src_lines, tgt_lines = [], []
        for _ in range(n):
            words = [rng.choice(vocab) for _ in range(rng.randint(3, 9))]
            src_lines.append(" ".join(words))
            tgt_lines.append(" ".join(lexicon[w] for w in reversed(words)))
        (folder / f"{split}.src").write_text("\n".join(src_lines) + "\n")
        (folder / f"{split}.tgt").write_text("\n".join(tgt_lines) + "\n")
        prefixes[split] = folder / split
    return prefixes


def toy_tags(line: str):
    """Labels derived from the tokens, so that tests can check alignment: a "POS" tag
    that depends on the word, and an IOB "NER" tag that marks runs of words s0..s3."""
    words = line.split()
    pos = [f"P{int(w[1:]) % 5}" for w in words]
    ner, prev_entity = [], False
    for w in words:
        entity = int(w[1:]) < 4
        ner.append(("I-ENT" if prev_entity else "B-ENT") if entity else "O")
        prev_entity = entity
    return pos, ner


def binarize_tagged(work: Path, dest: Path, n_train: int = 400, seed: int = 1, tags=True) -> Path:
    """Toy corpus -> data-bin with joint dictionary and (optionally) POS/NER label
    streams in the layout of ``translation_with_tags``."""
    prefixes = write_toy_corpus(work, n_train=n_train, seed=seed)
    run_cli([
        "fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", prefixes["train"], "--validpref", prefixes["valid"],
        "--testpref", prefixes["test"], "--destdir", dest, "--joined-dictionary",
        "--workers", "1",
    ])
    if not tags:
        return dest
    for split, prefix in prefixes.items():
        lines = Path(f"{prefix}.src").read_text().splitlines()
        labels = [toy_tags(line) for line in lines]
        for i, name in enumerate(("pos", "ner")):
            Path(f"{prefix}.{name}").write_text("\n".join(" ".join(l[i]) for l in labels) + "\n")
    for name in ("pos", "ner"):
        tmp = work / f"bin-{name}"
        run_cli([
            "fairseq-preprocess", "--only-source", "--source-lang", name,
            "--trainpref", prefixes["train"], "--validpref", prefixes["valid"],
            "--testpref", prefixes["test"], "--destdir", tmp, "--workers", "1",
        ])
        (tmp / f"dict.{name}.txt").rename(dest / f"dict.{name}.txt")
        for split in prefixes:
            for ext in ("bin", "idx"):
                (tmp / f"{split}.{name}-None.{name}.{ext}").rename(dest / f"{split}.src-tgt.{name}.{ext}")
    return dest
