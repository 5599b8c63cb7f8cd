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

    python -m benchmarks.attention_shapes --data DIR --max-tokens 8192
"""

import argparse
import sys
from pathlib import Path

from benchmarks import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--data", type=Path, required=True, help="binarized translation data folder")
    p.add_argument("-s", "--source-lang", help="default: fairseq infers the pair from the folder")
    p.add_argument("-t", "--target-lang")
    p.add_argument(
        "--max-tokens", type=int, default=8192, help="training batch (fairseq-train --max-tokens)"
    )
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=128, help="sentences per beam-search batch")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--seed", type=int, default=1, help="fairseq's shuffling of the batches")
    args = p.parse_args(argv)
    if not args.data.is_dir():
        p.error(f"--data {args.data}: no such folder")
    return args


def fairseq_batches(args, split, **batching):
    """The sizes of ``split`` and its batches (index arrays) in the order epoch 1 takes
    them, from fairseq's own translation task and batch iterator: ``fairseq-train``'s
    shuffled order for ``train``, ``fairseq-generate``'s sorted one for ``test``. The
    plugin is loaded, as in every run of ours: it keeps the last batch of an epoch that
    fairseq-fixed 0.12.3.1 drops when its size is not a multiple of 8
    (``tpp_fairseq``)."""
    from fairseq import options, tasks

    pair = [
        *(["-s", args.source_lang] if args.source_lang else []),
        *(["-t", args.target_lang] if args.target_lang else []),
    ]
    command = [
        str(args.data),
        "--user-dir",
        str(harness.PLUGIN),
        "--task",
        "translation",
        "--arch",
        "transformer",
        *pair,
        "--max-source-positions",
        str(args.max_positions),
        "--max-target-positions",
        str(args.max_positions),
    ]
    try:
        task = tasks.setup_task(
            options.parse_args_and_arch(options.get_training_parser(), input_args=command)
        )
        task.load_dataset(split)
    except Exception as err:  # fairseq's own messages: no pair found, no such split
        sys.exit(f"attention_shapes.py: --data {args.data}: {err}")
    dataset = task.dataset(split)
    itr = task.get_batch_iterator(
        dataset=dataset,
        max_positions=task.max_positions(),
        ignore_invalid_inputs=True,
        required_batch_size_multiple=8,
        seed=args.seed,
        **batching,
    )
    return dataset, itr.ordered_batches(1, False, shuffle=split == "train")


def training(args):
    dataset, epoch = fairseq_batches(args, "train", max_tokens=args.max_tokens)
    src, tgt = dataset.src_sizes, dataset.tgt_sizes
    seen, new_steps, first_new = set(), 0, []
    encoder, decoder = set(), set()
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
    print(
        "| batches per epoch | sentences | distinct encoder problems | distinct decoder problems "
        "| steps of the first epoch that meet a new problem |"
    )
    print("|---:|---:|---:|---:|---:|")
    print(
        f"| {steps:,} | {len(dataset):,} | {len(encoder):,} | {len(decoder):,} "
        f"| {new_steps:,} ({100 * new_steps / max(steps, 1):.0f}%) |"
    )
    quarters = [int(steps * q / 4) for q in (1, 2, 3, 4)]
    share = [
        sum(1 for s in first_new if lo <= s < hi) / max(hi - lo, 1)
        for lo, hi in zip([0] + quarters[:-1], quarters)
    ]
    print(
        "\nShare of steps meeting a new problem, by quarter of the first epoch: "
        + ", ".join(f"{100 * x:.0f}%" for x in share)
        + " (later epochs: none)\n"
    )


def beam_search(args):
    dataset, batches = fairseq_batches(args, "test", max_sentences=args.batch_size)
    tgt = dataset.tgt_sizes
    seen, steps, new_steps = set(), 0, 0
    for batch in batches:
        lengths = sorted(
            int(tgt[i]) for i in batch
        )  # output length taken as the reference's (with EOS)
        for t in range(lengths[-1]):
            active = sum(1 for n in lengths if n > t)
            problem = (args.beam * active, t + 1)
            steps += 1
            if problem not in seen:
                new_steps += 1
                seen.add(problem)
    print(
        f"### Beam search: test split, {len(dataset):,} sentences, --batch-size {args.batch_size}, "
        f"beam {args.beam}\n"
    )
    print(
        "| decoding steps | distinct problems (rows, key length) | steps that meet a new problem |"
    )
    print("|---:|---:|---:|")
    print(f"| {steps:,} | {len(seen):,} | {new_steps:,} ({100 * new_steps / max(steps, 1):.0f}%) |")
    print(
        "\n(An estimate: each output taken to be as long as its reference; a step of every "
        "decoder layer meets the same problem, so it is built once per step, not per layer.)"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    training(args)
    beam_search(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
