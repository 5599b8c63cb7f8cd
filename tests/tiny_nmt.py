"""A tiny synthetic translation task for the training, averaging and evaluation tests.

The "language pair" maps each English word to a made-up target word (word for word,
same order), with capitalised sentence starts, punctuation, quotes and hyphenated
compounds, so that Moses tokenisation/detokenisation, BPE removal and compound splitting
all have something to do. A model with a few thousand parameters learns enough of it in
a few dozen CPU updates to produce non-trivial output.
"""

import os
import random
import subprocess
import sys
from pathlib import Path

from sacremoses import MosesTokenizer

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"

WORDS = [
    "the", "house", "cat", "dog", "is", "red", "big", "small", "runs", "sees", "a",
    "garden", "tree", "ice-cream", "state-of-the-art", "water", "drinks", "eats",
    "mountain", "fire", "there", "in", "on", "very", "cold", "warm", "book", "reads",
    "child", "woman", "man", "car", "blue", "green", "beautiful", "yesterday",
]


def target_word(word):
    """The made-up translation of ``word``: reversed, with a suffix; hyphens stay."""
    return "-".join(part[::-1] + "en" for part in word.split("-"))


def make_sentence_pair(rng):
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
    source = list(words)
    target = [target_word(w) for w in words]
    if rng.random() < 0.3:  # a comma after the second word
        source[1] += ","
        target[1] += ","
    end = rng.choice([".", ".", "?", "!"])
    src = " ".join(source) + end
    tgt = " ".join(target) + end
    if rng.random() < 0.2:  # quoted sentence
        src, tgt = f'"{src}"', f'"{tgt}"'
    return capitalise(src), capitalise(tgt)


def capitalise(text):
    """Upper-case the first letter (after an opening quote, if any)."""
    start = 1 if text.startswith('"') else 0
    return text[:start] + text[start].upper() + text[start + 1:]


def fake_bpe(tokens):
    """Split long tokens in two with the '@@ ' continuation marker, as subword-nmt does."""
    out = []
    for token in tokens.split():
        if len(token) > 7:
            out.append(token[:4] + "@@ " + token[4:])
        else:
            out.append(token)
    return " ".join(out)


def make_corpus(root, sizes=(300, 40, 40), seed=7):
    """Write raw/, tok/ and bpe/ folders with train/valid/test .en/.de under ``root``."""
    root = Path(root)
    rng = random.Random(seed)
    tokenizers = {"en": MosesTokenizer(lang="en"), "de": MosesTokenizer(lang="de")}
    for split, size in zip(("train", "valid", "test"), sizes):
        pairs = [make_sentence_pair(rng) for _ in range(size)]
        for index, lang in enumerate(("en", "de")):
            raw = [pair[index] for pair in pairs]
            tok = [tokenizers[lang].tokenize(line, return_str=True, escape=True) for line in raw]
            bpe = [fake_bpe(line) for line in tok]
            for folder, lines in (("raw", raw), ("tok", tok), ("bpe", bpe)):
                (root / folder).mkdir(parents=True, exist_ok=True)
                (root / folder / f"{split}.{lang}").write_text("\n".join(lines) + "\n")
    return root


def tool_env():
    """Environment for subprocesses: this interpreter's bin folder (fairseq CLIs) first."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHON"] = sys.executable
    env.setdefault("OMP_NUM_THREADS", "1")  # shared CPUs: no thread oversubscription
    env["PYTHONWARNINGS"] = "ignore"
    return env


def binarize(corpus, dest):
    """fairseq-preprocess the BPE text of ``corpus`` into ``dest`` (joint dictionary)."""
    bpe = Path(corpus) / "bpe"
    subprocess.run(
        ["fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
         "--trainpref", str(bpe / "train"), "--validpref", str(bpe / "valid"),
         "--testpref", str(bpe / "test"), "--destdir", str(dest), "--joined-dictionary",
         "--workers", "1"],
        check=True, env=tool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    return Path(dest)


def train_command(data, save_dir, max_update, save_interval_updates, extra=()):
    """scripts/train.sh on the CPU with a tiny plain Transformer on plain translation data."""
    return [
        "bash", str(SCRIPTS / "train.sh"), "--cpu", "--preset", "tiny",
        "--data", str(data), "--save-dir", str(save_dir),
        "--arch", "transformer_tiny", "--task", "translation",
        "--criterion", "label_smoothed_cross_entropy",
        "--lr", "5e-3", "--warmup-updates", "20", "--max-tokens", "400", "--update-freq", "1",
        "--max-update", str(max_update), "--save-interval-updates", str(save_interval_updates),
        "--keep-interval-updates", "10", "--log-interval", "5",
        "--", "--num-workers", "0", "--disable-validation", "--save-interval", "1000",
        *extra,
    ]
