"""tpp-tag-gradients: what each tag loss does to the encoder's gradients.

For a checkpoint with POS/NER heads and a data folder with the label streams, the
gradients of the translation loss and of each tag loss are summed over the first N
batches of a split and compared per encoder layer (and for the token embeddings):

- ``‖∇ translation‖`` and ``‖λ_k ∇ k‖``, per target token as the trainer divides them,
  with ``λ_k`` the criterion's weight at update 0 (``--tag-loss-weights``);
- ``cos(∇ translation, ∇ k)``: near 0, the tag loss moves the layer in directions the
  translation does not care about; negative, against it.

With shared embeddings (the presets share them) the embeddings' translation gradient
also holds the decoder's input and output projection; the tag losses reach them from
the encoder only. The model is in eval mode (no dropout): the figures are the same at
every run.
Example::

    tpp-tag-gradients --path runs/x/checkpoints/checkpoint_best.pt --data data-bin/ende
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tpp_pipeline.lock import exit_cleanly_on_sigterm
from tpp_pipeline.errors import report

from .analysis_model import AnalysisError, load_model

PROG = "tpp-tag-gradients"


def parameter_groups(model) -> dict:
    """{row name: [parameters]}: the token embeddings, then every encoder layer."""
    encoder = model.encoder
    groups = {"embeddings": [encoder.embed_tokens.weight]}
    for index, layer in enumerate(encoder.layers, 1):
        groups[f"layer {index}"] = [p for p in layer.parameters() if p.requires_grad]
    return groups


def tag_gradients(model, task, criterion, batches) -> dict:
    """Sum the gradients of each loss over ``batches``; return, per group, the norm of
    each loss's gradient per target token and each tag loss's cosine with the
    translation's. Losses: ``translation`` and one per tag kind the model predicts."""
    import torch

    groups = parameter_groups(model)
    params = [p for group in groups.values() for p in group]
    sums: dict = {}  # loss name -> [summed gradient of each parameter]
    ntokens = 0
    for sample in batches:
        net_output = model(**sample["net_input"], return_tag_logits=True)
        translation, _ = criterion.compute_loss(model, net_output, sample, reduce=True)
        losses = {"translation": translation}
        tag_logits = net_output[1].get("tag_logits", {})
        for name, labels in sorted(sample.get("source_tags", {}).items()):
            if name in tag_logits:
                loss, _, _ = criterion.compute_tag_loss(
                    tag_logits[name], labels, task.tag_dictionaries[name]
                )
                losses[name] = criterion.tag_weight(name) * loss
        for position, (name, loss) in enumerate(losses.items()):
            grads = torch.autograd.grad(
                loss, params, retain_graph=position < len(losses) - 1, allow_unused=True
            )
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            if name in sums:
                for total, grad in zip(sums[name], grads):
                    total.add_(grad)
            else:
                sums[name] = [g.detach().clone() for g in grads]
        ntokens += int(sample["ntokens"])
    if not sums:
        raise AnalysisError(
            "no batches: the split is empty, or each of its sentences is longer than "
            "--max-tokens"
        )
    if len(sums) == 1:
        raise AnalysisError(
            "no tag loss: the batches carry no labels for the model's tag heads "
            "(a data folder prepared without tags?)"
        )

    table = {}
    start = 0
    for group, members in groups.items():
        stop = start + len(members)
        flat = {
            name: torch.cat([g.reshape(-1) for g in grads[start:stop]]).double() / ntokens
            for name, grads in sums.items()
        }
        row = {f"norm {name}": flat[name].norm().item() for name in flat}
        for name in flat:
            if name != "translation":  # no cosine with a zero gradient (layers above a head)
                zero = not row[f"norm {name}"] or not row["norm translation"]
                row[f"cos {name}"] = (
                    None
                    if zero
                    else torch.nn.functional.cosine_similarity(
                        flat["translation"], flat[name], dim=0
                    ).item()
                )
        table[group] = row
        start = stop
    return table


def first_batches(task, model, split: str, count: int, max_tokens: int):
    """The first ``count`` batches of ``split`` in fairseq's order (seed 1, no shuffle),
    leaving out sentences longer than ``max_tokens`` or than the model takes."""
    from fairseq import utils

    task.load_dataset(split)
    dataset = task.dataset(split)
    longest = utils.resolve_max_positions(
        task.max_positions(), model.max_positions(), (max_tokens, max_tokens)
    )
    iterator = task.get_batch_iterator(
        dataset, max_tokens=max_tokens, max_positions=longest, seed=1, ignore_invalid_inputs=True
    ).next_epoch_itr(shuffle=False)
    for index, sample in enumerate(iterator):
        if index >= count:
            break
        yield sample


def format_table(table: dict) -> str:
    columns = list(next(iter(table.values())))
    lines = [
        "| | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for group, row in table.items():
        cells = [
            "n/a"
            if row[c] is None
            else f"{row[c]:.4f}"
            if c.startswith("norm")
            else f"{row[c]:+.3f}"
            for c in columns
        ]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Per encoder layer: the norm of the translation loss's gradient and of "
        "each tag loss's, and their cosine.",
    )
    parser.add_argument("--path", type=Path, required=True, help="model checkpoint (.pt)")
    parser.add_argument(
        "--data", type=Path, required=True, help="data-bin folder with the label streams"
    )
    parser.add_argument("--split", default="valid", help="split to take batches from")
    parser.add_argument("--batches", type=int, default=20, help="batches summed (default 20)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()  # Ctrl-C, kill: no traceback
    if args.batches < 1 or args.max_tokens < 1:
        parser.error("--batches and --max-tokens must be positive")

    try:
        loaded = load_model(args.path, args.data)
        from tpp_plugin.tasks.translation_with_tags import MissingTagsError

        model, task = loaded.model, loaded.task
        if not len(getattr(model.encoder, "tag_heads", None) or ()):
            raise AnalysisError(
                f"{args.path} has no tag heads (trained with --encoder-tag-layers ''?)"
            )
        missing = getattr(task, "missing_tag_dictionaries", None)
        if missing and not getattr(task, "tag_dictionaries", None):
            raise AnalysisError(
                f"{args.data} has no label streams for {args.path}'s tag heads (no "
                f"{', '.join(missing.values())}): pass the folder prepared with tags"
            )
        if not getattr(task, "tag_dictionaries", None):
            raise AnalysisError(
                f"{args.path} was not trained with --task translation_with_tags: "
                "no label streams to read"
            )
        criterion = task.build_criterion(loaded.cfg.criterion)
        if not hasattr(criterion, "compute_tag_loss"):
            raise AnalysisError(
                f"{args.path} was trained with --criterion {loaded.cfg.criterion._name}, "
                "which has no tag losses"
            )
        try:
            batches = first_batches(task, model, args.split, args.batches, args.max_tokens)
            table = tag_gradients(model, task, criterion, batches)
        except MissingTagsError as err:  # (the task's advice is to train without tags)
            raise AnalysisError(
                f"{args.data}: {err.what} (the tag losses' gradients need the labels: pass a "
                "folder prepared with tags)"
            ) from None
        except FileNotFoundError as err:  # fairseq's "Dataset not found: SPLIT (...)"
            raise AnalysisError(f"{args.data}: no split {args.split!r} ({err})") from None
    except AnalysisError as err:
        return report(PROG, err)
    if args.json:
        print(json.dumps(table, indent=1))
    else:
        print(format_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
