"""Label-smoothed cross-entropy on the translation plus weighted tagging losses.

.. math::

    \\mathcal{L} = \\mathcal{L}_{\\text{LS-CE}}(y \\mid x)
        + \\sum_{k} \\lambda_k \\sum_{t} -\\log p(k_t \\mid x)

over the tag kinds ``k`` of the batch (POS and NER from our pipeline; any label stream
of the data folder works), with weights ``λ_k`` from ``--tag-loss-weights`` (default 1;
``--pos-loss-weight`` and ``--ner-loss-weight`` are aliases), and the tag sums over real
source tokens only (no padding, no end-of-sentence slot). With
``--tag-loss-decay-updates N`` every ``λ_k`` is multiplied by ``max(0, 1 - u / N)`` at
update ``u``: the tags shape the encoder early and leave it to the translation later
(the paper's weights are constant: N = 0, the default).
Like fairseq's translation loss, the tag losses are sums; the trainer divides the
total by the sample size (target tokens). On a batch without tags this is exactly
fairseq's ``label_smoothed_cross_entropy``.

Logged besides fairseq's usual figures: ``pos_loss``/``ner_loss`` (per labelled token,
base 2 like ``loss``) and ``pos_acc``/``ner_acc`` (percent). Every logged quantity is a
sum (loss, correct, count), so the figures aggregate exactly over workers and
accumulated batches.
"""

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import torch.nn.functional as F
from fairseq import metrics, utils
from fairseq.logging.meters import MetersDict
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (  # noqa: I001
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from tpp_pipeline.errors import OptionError

from ..options import check_tag_weights, parse_named

logger = logging.getLogger(__name__)


@dataclass
class LabelSmoothedCrossEntropyWithTagsConfig(LabelSmoothedCrossEntropyCriterionConfig):
    tag_loss_weights: str = field(
        default="",
        metadata={
            "help": "weight of each tag kind's loss, e.g. 'pos:1,ner:0.5'; a tag kind "
            "not named here has weight 1 (0 switches its loss off)"
        },
    )
    pos_loss_weight: Optional[float] = field(
        default=None, metadata={"help": "alias of --tag-loss-weights pos:W"}
    )
    ner_loss_weight: Optional[float] = field(
        default=None, metadata={"help": "alias of --tag-loss-weights ner:W"}
    )
    tag_loss_decay_updates: int = field(
        default=0,
        metadata={
            "help": "decay every tag loss weight linearly to 0 at this update "
            "(0: constant weights, the paper)"
        },
    )


@register_criterion(
    "label_smoothed_cross_entropy_with_tags", dataclass=LabelSmoothedCrossEntropyWithTagsConfig
)
class LabelSmoothedCrossEntropyWithTagsCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(
        self,
        task,
        sentence_avg,
        label_smoothing,
        ignore_prefix_size=0,
        report_accuracy=False,
        tag_loss_weights="",
        pos_loss_weight=None,
        ner_loss_weight=None,
        tag_loss_decay_updates=0,
    ):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.tag_weights = parse_named(tag_loss_weights, "tag-loss-weights", cast=float)
        for name, alias in (("pos", pos_loss_weight), ("ner", ner_loss_weight)):
            if alias is not None:
                if not 0 <= alias < math.inf:  # (NaN too)
                    raise OptionError(f"--{name}-loss-weight must be a number >= 0, got {alias}")
                if name in self.tag_weights and self.tag_weights[name] != alias:
                    raise OptionError(
                        f"--{name}-loss-weight {alias} contradicts --tag-loss-weights "
                        f"{name}:{self.tag_weights[name]}"
                    )
                self.tag_weights[name] = alias
        check_tag_weights(self.tag_weights, tag_loss_decay_updates)
        loaded = getattr(task, "tag_names", None)
        unused = [name for name in self.tag_weights if loaded is not None and name not in loaded]
        if unused:  # (a misspelt name leaves its tag's weight at 1: said, not silent)
            logger.warning(
                "--tag-loss-weights names %s, which the task does not load (--tags %s): "
                "its weight is not used",
                ", ".join(map(repr, unused)),
                ",".join(loaded) or "''",
            )
        self.tag_loss_decay_updates = tag_loss_decay_updates
        self.num_updates = 0
        self._warned_no_head = set()

    def set_num_updates(self, num_updates: int) -> None:
        """Called by ``translation_with_tags`` before every training step."""
        self.num_updates = num_updates

    def tag_weight(self, name: str) -> float:
        """The weight of tag kind ``name``'s loss at the current update (1 unless given,
        decayed by ``--tag-loss-decay-updates``)."""
        weight = self.tag_weights.get(name, 1.0)
        if self.tag_loss_decay_updates > 0:
            weight *= max(0.0, 1.0 - self.num_updates / self.tag_loss_decay_updates)
        return weight

    def forward(self, model, sample, reduce=True):
        tags = sample.get("source_tags") or {}
        tag_heads = getattr(getattr(model, "encoder", None), "tag_heads", None)
        # Run the tag heads when there are labels, and also in training when the model
        # has heads but the batch has no labels: their output is then added with weight
        # 0, so that data-parallel training never sees parameters without gradients.
        want_tags = tag_heads is not None and len(tag_heads) > 0 and (bool(tags) or model.training)
        if want_tags:
            net_output = model(**sample["net_input"], return_tag_logits=True)
        else:
            net_output = model(**sample["net_input"])
        loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = n_correct.data
            logging_output["total"] = total.data

        tag_logits = net_output[1].get("tag_logits", {}) if want_tags else {}
        for name, labels in tags.items():
            if name not in tag_logits:
                if name not in self._warned_no_head:
                    logger.warning(
                        f"the model has no '{name}' head (--encoder-tag-layers): its labels are ignored"
                    )
                    self._warned_no_head.add(name)
                continue
            tag_loss, n_correct, count = self.compute_tag_loss(
                tag_logits[name], labels, self.task.tag_dictionaries[name]
            )
            loss = loss + self.tag_weight(name) * tag_loss
            # tensors, not numbers: reading them here would wait for the device
            logging_output[f"{name}_loss"] = tag_loss.data
            logging_output[f"{name}_tag_correct"] = n_correct.data
            logging_output[f"{name}_tag_count"] = count.data
        for name, logits in tag_logits.items():
            if name not in tags:
                # summed in float32: an fp16 sum can overflow to inf, and 0 * inf is NaN
                loss = loss + 0.0 * logits.float().sum()
        return loss, sample_size, logging_output

    @staticmethod
    def compute_tag_loss(logits, labels, dictionary):
        """Cross-entropy of ``logits`` (``B x T x C``) against ``labels`` (``B x T``)
        summed over real tokens (not padding, not the end-of-sentence slot). Returns the
        loss, the number of correct predictions and the number of tokens, all as
        tensors: no boolean indexing, nothing read back from the device. The softmax is
        taken in float32."""
        real = labels.ne(dictionary.pad()) & labels.ne(dictionary.eos())  # B x T
        lprobs = F.log_softmax(logits.float(), dim=-1)  # B x T x C
        token_nll = -lprobs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # B x T
        loss = (token_nll * real).sum()
        n_correct = (lprobs.argmax(-1).eq(labels) & real).sum()
        return loss, n_correct, real.sum()

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        names = sorted(
            {
                key[: -len("_tag_count")]
                for log in logging_outputs
                for key in log
                if key.endswith("_tag_count")
            }
        )
        for name in names:
            # sums left as they come (tensors on the device): fairseq reads its meters when
            # it logs, not at every update (fairseq's trainer calls this after the
            # optimizer's step, and reading a GPU tensor here would wait for that step)
            for key, meter in (
                ("loss", "loss_sum"),
                ("tag_correct", "tag_correct"),
                ("tag_count", "tag_count"),
            ):
                metrics.log_scalar_sum(
                    f"_{name}_{meter}", sum(log.get(f"{name}_{key}", 0) for log in logging_outputs)
                )
            cls._drop_averaged_loss(f"{name}_loss")
            metrics.log_derived(
                f"{name}_loss",  # base 2, as fairseq's loss
                lambda meters, n=name: cls._per_tag(meters, n, "loss_sum", 1 / math.log(2)),
            )
            metrics.log_derived(
                f"{name}_acc", lambda meters, n=name: cls._per_tag(meters, n, "tag_correct", 100.0)
            )

    @staticmethod
    def _drop_averaged_loss(key: str) -> None:
        """Remove the averaging meter ``key`` (the tag loss as plugin 0.2.1 and earlier
        logged it) from the active aggregators: fairseq restores meters from the
        checkpoint it resumes, and would keep an old one, never updated, in place of the
        derived loss."""
        for agg in metrics.get_active_aggregators():
            if key in agg and not isinstance(agg[key], MetersDict._DerivedMeter):
                del agg[key]
                agg.priorities = [entry for entry in agg.priorities if entry[2] != key]

    @staticmethod
    def _per_tag(meters, name: str, meter: str, scale: float) -> float:
        """``scale`` times the sum of ``meter`` per labelled token of tag kind ``name``
        (NaN without any), rounded to 3 decimals."""
        count = utils.item(meters[f"_{name}_tag_count"].sum)
        return (
            round(utils.item(meters[f"_{name}_{meter}"].sum) * scale / count, 3)
            if count > 0
            else float("nan")
        )

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
