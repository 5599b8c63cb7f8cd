#!/usr/bin/env python3
"""How many different self-attention problems fairseq's batching gives a training run and
a beam search: the number of plans cuDNN's attention would build.

Why count them. On GPUs where PyTorch ranks cuDNN's attention first (Hopper and newer,
half precision), every call runs a plan built for its exact problem; PyTorch caches the
plans per thread under the batch size, both lengths and the strides, and builds one on
the host for every problem it has not seen (docs/gpu.md). How much that costs a run is
the number of distinct problems times the cost of a build; the second needs a GPU, the
first is a property of fairseq's batching of a data folder and is counted here, on any
machine.

* **Training**: fairseq's own batches of the ``train`` split (``--max-tokens``, batch
  sizes a multiple of 8, as ``fairseq-train`` with the plugin makes them). fairseq forms the batches once
  and only shuffles their order between epochs, so a run meets every problem it will
  ever meet in its first epoch. A batch of ``B`` sentences, longest source ``S`` and
  longest target ``T`` gives the encoder's self-attention the problem ``(B, S, S)``,
  with or without a padding mask, and the decoder's ``(B, T, T)`` (causal). The table
  gives the distinct problems, and how many of the first epoch's steps meet at least
  one that no earlier step had (each such step builds plans, forward and backward).
* **Beam search**: fairseq's batches of the ``test`` split (``--batch-size`` sentences,
  sorted by length as ``fairseq-generate`` takes them), beam ``--beam``. Step ``t`` of a
  batch attends over ``t + 1`` cached positions with one query per hypothesis:
  ``(k · n_t, 1, t + 1)``, where ``n_t`` sentences are still being decoded (fairseq
  drops finished sentences from the batch). Which are still decoded depends on the
  model's outputs; here each sentence's output is taken to be as long as its reference
  (an estimate, stated as one in the output), and the count of steps whose problem is
  new is exact for that assumption.

    python benchmarks/attention_shapes.py --data DIR --max-tokens 8192
"""

import argparse
import collections
import sys
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--data", type=Path, required=True, help="binarized translation data folder")
    p.add_argument("-s", "--source-lang", help="default: from the folder's train.*.idx")
    p.add_argument("-t", "--target-lang")
    p.add_argument("--max-tokens", type=int, default=8192, help="training batch (fairseq-train --max-tokens)")
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=128, help="sentences per beam-search batch")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--seed", type=int, default=1, help="fairseq's shuffling of the batches")
    args = p.parse_args(argv)
    if not args.data.is_dir():
        p.error(f"--data {args.data}: no such folder")
    if not (args.source_lang and args.target_lang):
        pairs = {f.name.split(".")[1] for f in args.data.glob("train.*-*.*.idx")}
        if len(pairs) != 1:
            p.error(f"--data {args.data}: cannot tell the language pair from its train.*.idx files "
                    f"({sorted(pairs) or 'none'}); give -s and -t")
        args.source_lang, args.target_lang = pairs.pop().split("-")
    return args


def fairseq_with_the_plugin():
    """Load the plugin, as every ``fairseq-train --user-dir tpp_plugin`` run does: it
    keeps the last batch of an epoch that fairseq-fixed 0.12.3.1 drops when its size is
    not a multiple of 8 (``tpp_plugin/compat.py``), so the batches are the ones our runs
    train on."""
    from fairseq.utils import import_user_module

    import_user_module(argparse.Namespace(user_dir=str(Path(__file__).resolve().parent.parent / "tpp_plugin")))


def load(args, split, shuffle):
    """fairseq's translation dataset of ``split`` (only its sizes are read)."""
    from fairseq.data import Dictionary
    from fairseq.tasks.translation import load_langpair_dataset

    src, tgt = args.source_lang, args.target_lang
    for name in (f"dict.{src}.txt", f"dict.{tgt}.txt", f"{split}.{src}-{tgt}.{src}.idx", f"{split}.{src}-{tgt}.{tgt}.idx"):
        if not (args.data / name).exists():
            sys.exit(f"{args.data}: no {name} (a {split} split for {src}-{tgt} is needed)")
    dicts = [Dictionary.load(str(args.data / f"dict.{lang}.txt")) for lang in (src, tgt)]
    return load_langpair_dataset(
        str(args.data), split, src, dicts[0], tgt, dicts[1], combine=False, dataset_impl=None,
        upsample_primary=1, left_pad_source=True, left_pad_target=False,
        max_source_positions=args.max_positions, max_target_positions=args.max_positions, shuffle=shuffle)


def batches(dataset, max_positions, max_tokens=None, max_sentences=None, seed=None, multiple=1):
    """fairseq's batches of ``dataset`` as lists of indices, as its batch iterator forms
    them: ordered by length, too long pairs dropped, then (``seed``) the order of the
    batches shuffled as in epoch 1."""
    import numpy as np
    from fairseq.data import data_utils

    with data_utils.numpy_seed(seed or 0):
        indices = dataset.ordered_indices()
    indices, _ = dataset.filter_indices_by_size(indices, (max_positions, max_positions))
    out = dataset.batch_by_size(indices, max_tokens=max_tokens, max_sentences=max_sentences,
                                required_batch_size_multiple=multiple)
    if seed is not None:
        with data_utils.numpy_seed(seed + 1):  # fairseq shuffles epoch e with seed + e
            np.random.shuffle(out)
    return out


def training(args):
    dataset = load(args, "train", shuffle=True)
    src, tgt = dataset.src_sizes, dataset.tgt_sizes
    seen, new_steps, first_new = set(), 0, []
    encoder, decoder = set(), set()
    epoch = batches(dataset, args.max_positions, max_tokens=args.max_tokens, seed=args.seed, multiple=8)
    for step, batch in enumerate(epoch):
        s, t = int(src[batch].max()), int(tgt[batch].max())
        padded = bool((src[batch] != s).any())
        problems = {("encoder", len(batch), s, padded), ("decoder", len(batch), t)}
        encoder.add(("encoder", len(batch), s, padded))
        decoder.add(("decoder", len(batch), t))
        if problems - seen:
            new_steps += 1
            first_new.append(step)
        seen |= problems
    steps = len(epoch)
    print(f"### Training: {args.data}, train split, --max-tokens {args.max_tokens}\n")
    print("| batches per epoch | sentences | distinct encoder problems | distinct decoder problems "
          "| steps of the first epoch that meet a new problem |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {steps:,} | {len(dataset):,} | {len(encoder):,} | {len(decoder):,} "
          f"| {new_steps:,} ({100 * new_steps / max(steps, 1):.0f}%) |")
    quarters = [int(steps * q / 4) for q in (1, 2, 3, 4)]
    share = [sum(1 for s in first_new if lo <= s < hi) / max(hi - lo, 1)
             for lo, hi in zip([0] + quarters[:-1], quarters)]
    print("\nShare of steps meeting a new problem, by quarter of the first epoch: "
          + ", ".join(f"{100 * x:.0f}%" for x in share) + " (later epochs: none)\n")


def beam_search(args):
    dataset = load(args, "test", shuffle=False)
    tgt = dataset.tgt_sizes
    seen, steps, new_steps = set(), 0, 0
    # sorted by length, in order, as fairseq-generate takes them
    for batch in batches(dataset, args.max_positions, max_sentences=args.batch_size):
        lengths = sorted(int(tgt[i]) for i in batch)  # output length taken as the reference's (with EOS)
        for t in range(lengths[-1]):
            active = sum(1 for n in lengths if n > t)
            problem = (args.beam * active, t + 1)
            steps += 1
            if problem not in seen:
                new_steps += 1
                seen.add(problem)
    print(f"### Beam search: test split, {len(dataset):,} sentences, --batch-size {args.batch_size}, "
          f"beam {args.beam}\n")
    print("| decoding steps | distinct problems (rows, key length) | steps that meet a new problem |")
    print("|---:|---:|---:|")
    print(f"| {steps:,} | {len(seen):,} | {new_steps:,} ({100 * new_steps / max(steps, 1):.0f}%) |")
    print("\n(An estimate: each output taken to be as long as its reference; a step of every "
          "decoder layer meets the same problem, so it is built once per step, not per layer.)")


def main(argv=None) -> int:
    args = parse_args(argv)
    fairseq_with_the_plugin()
    training(args)
    beam_search(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
