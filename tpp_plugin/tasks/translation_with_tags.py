"""``translation_with_tags``: fairseq's translation task plus per-token source labels.

Data layout (what ``tpp-prepare-corpus`` produces; the contract is
:mod:`tpp_pipeline.contract`, shared with the pipeline), in each data directory::

    dict.{src}.txt  dict.{tgt}.txt                  # as for --task translation
    {split}.{src}-{tgt}.{src}.bin/.idx  ...{tgt}.bin/.idx
    dict.{tag}.txt                                  # one per tag kind, e.g. pos, ner
    {split}.{src}-{tgt}.{tag}.bin/.idx              # one label per source subword

The labels are training targets only: a model trained with this task translates with
``--task translation`` (and ``fairseq-interactive``) on data without any tag files.
"""

import itertools
import logging
import os

import torch
from dataclasses import dataclass, field
from typing import Dict

from fairseq import utils
from fairseq.data import ConcatDataset, Dictionary, data_utils, indexed_dataset
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from tpp_pipeline.contract import (
    check_tag_alignment,
    label_dictionary_path,
    label_stream_prefix,
    parse_tag_kinds,
)

from tpp_fairseq.checkpoint_match import RECORD_KEY, record_of_task
from tpp_pipeline.errors import DataError, OptionError, UserError
from ..criterions.label_smoothed_cross_entropy_with_tags import (
    LabelSmoothedCrossEntropyWithTagsCriterion,
)
from tpp_fairseq.data_files import check_binarized, check_not_empty
from .tagged_dataset import TaggedLanguagePairDataset

logger = logging.getLogger(__name__)


class MissingTagsError(UserError, FileNotFoundError):
    """The data folder lacks label files that ``--tags`` asks for: a user's error, which a
    command-line tool (fairseq-train) reports in one line, without a traceback. ``what``
    is what is missing, without the advice to train without tags (for a tool that needs
    them)."""

    def __init__(self, what: str, advice: str):
        super().__init__(f"{what} ({advice})")
        self.what = what


class UnjoinedRanksError(UserError):
    """torchrun started several processes that fairseq did not join into one job."""


def check_joined() -> None:
    """Under torchrun (``WORLD_SIZE`` > 1) a training must be one job: fairseq 0.12 joins
    the processes only when it counts several CUDA devices, so on CPUs, or with one
    visible GPU per process, each would train a model of its own into one save dir."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise UnjoinedRanksError(
            f"torchrun started {world} processes, but fairseq did not join them into one "
            "job (its world size is 1): each would train a model of its own into the same "
            "--save-dir. Start the command through tpp-fairseq-rank, which hands fairseq "
            "torchrun's rank and world size: torchrun --no-python --nproc_per_node "
            f"{world} tpp-fairseq-rank fairseq-train ..."
        )


class InputTooLongError(ValueError):
    """A sentence given to translate (the hub interface's ``translate``, or
    fairseq-interactive) is longer than the model accepts."""


@dataclass
class TranslationWithTagsConfig(TranslationConfig):
    tags: str = field(
        default="pos,ner",
        metadata={
            "help": "comma-separated source label streams to load (dict.TAG.txt and "
            "SPLIT.SRC-TGT.TAG.bin/.idx in the data directory); empty to train without tags"
        },
    )


@register_task("translation_with_tags", dataclass=TranslationWithTagsConfig)
class TranslationWithTagsTask(TranslationTask):
    """Translation whose source sentences also carry POS/NER (or any) token labels,
    batched under ``sample["source_tags"]`` for the
    ``label_smoothed_cross_entropy_with_tags`` criterion."""

    cfg: TranslationWithTagsConfig

    @classmethod
    def setup_task(cls, cfg: TranslationWithTagsConfig, **kwargs):
        if not cfg.data:  # fairseq's would fail on None with a TypeError
            raise DataError(
                "translation_with_tags has no data folder: fairseq's from_pretrained gives it "
                "none where data_name_or_path names no folder that exists (as given, or in the "
                "model's folder)"
            )
        return super().setup_task(cfg, **kwargs)

    def __init__(self, cfg: TranslationWithTagsConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self.tag_names = parse_tag_kinds(cfg.tags)
        if self.tag_names and (cfg.truncate_source or getattr(cfg, "prepend_bos", False)):
            raise OptionError(
                "--truncate-source / --prepend-bos change the source tokens and would "
                "misalign the labels; they are not supported with --tags"
            )
        # Missing label dictionaries are reported when labels are loaded, not here, so
        # that a trained model can still be loaded with this task (e.g. by
        # ``load_model_ensemble_and_task``) on a data folder without tags.
        data_dir = utils.split_paths(cfg.data)[0]
        self.tag_dictionaries: Dict[str, Dictionary] = {}
        self.missing_tag_dictionaries: Dict[str, str] = {}
        for name in self.tag_names:
            path = label_dictionary_path(data_dir, name)
            if os.path.exists(path):
                self.tag_dictionaries[name] = Dictionary.load(path)
                logger.info(f"[{name}] dictionary: {len(self.tag_dictionaries[name])} types")
            else:
                self.missing_tag_dictionaries[name] = path
        self._check_shard_dictionaries(utils.split_paths(cfg.data))

    def _check_shard_dictionaries(self, paths):
        """Every folder of ``--data a:b:...`` (one per epoch, in turn) binarized with the
        dictionaries the task has read from the first one: a folder of other ids would
        train on other words and labels, without an error."""
        src, tgt = self.cfg.source_lang, self.cfg.target_lang
        loaded = {f"dict.{src}.txt": (self.src_dict, "--srcdict")}
        loaded[f"dict.{tgt}.txt"] = (self.tgt_dict, "--tgtdict")
        for name, dictionary in self.tag_dictionaries.items():  # (binarized source-only)
            loaded[os.path.basename(label_dictionary_path("", name))] = (dictionary, "--srcdict")
        for shard in paths[1:]:
            for name, (dictionary, option) in loaded.items():
                path = os.path.join(shard, name)
                if os.path.exists(path) and Dictionary.load(path).symbols != dictionary.symbols:
                    first = os.path.join(paths[0], name)
                    raise DataError(
                        f"this dictionary is not {first}: binarize every folder of --data with "
                        f"the first one's dictionaries (fairseq-preprocess {option} {first})",
                        path,
                    )

    def state_dict(self):
        """fairseq's task state (saved with every checkpoint) and the record of this task's
        dictionaries, which loading the checkpoint compares (:mod:`tpp_fairseq.checkpoints`)."""
        return {**super().state_dict(), RECORD_KEY: record_of_task(self)}

    def build_model(self, cfg, from_checkpoint=False):
        """fairseq's model, built for a training only in one job (:func:`check_joined`)."""
        if not from_checkpoint:
            check_joined()
        model = super().build_model(cfg, from_checkpoint)
        self._model_tag_heads = len(getattr(getattr(model, "encoder", None), "tag_heads", ()))
        return model

    def build_criterion(self, cfg, from_checkpoint=False):
        """The criterion; an error if the model has tag heads and the criterion would not
        train them: they would get no gradient, which ``DistributedDataParallel`` (fairseq's
        ``--ddp-backend pytorch_ddp``, its default on GPUs) stops on at the second update."""
        criterion = super().build_criterion(cfg, from_checkpoint)
        heads = getattr(self, "_model_tag_heads", 0)
        if (
            heads
            and self.tag_dictionaries
            and not isinstance(criterion, LabelSmoothedCrossEntropyWithTagsCriterion)
        ):
            raise OptionError(
                f"--task translation_with_tags loads the tags {', '.join(self.tag_dictionaries)} for the model's "
                f"{heads} tag head(s), which --criterion {getattr(cfg, '_name', type(criterion).__name__)} does not "
                "train (their parameters would get no gradient: an error under data-parallel training). Use "
                "--criterion label_smoothed_cross_entropy_with_tags, or train without tags: --tags '' "
                "(or --task translation)"
            )
        return criterion

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        """fairseq's step; the criterion learns the update number first (for
        ``--tag-loss-decay-updates``)."""
        if hasattr(criterion, "set_num_updates"):
            criterion.set_num_updates(update_num)
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    def build_dataset_for_inference(self, src_tokens, src_lengths, constraints=None):
        dataset = super().build_dataset_for_inference(
            src_tokens, src_lengths, constraints=constraints
        )
        dataset.tpp_for_inference = True  # sentences a user gave: see filter_indices_by_size
        return dataset

    def get_batch_iterator(self, dataset, max_tokens=None, *args, **kwargs):
        """fairseq's; the sentences a user gave also learn the batches' ``max_tokens``,
        which :meth:`filter_indices_by_size` checks them against."""
        if getattr(dataset, "tpp_for_inference", False):
            dataset.tpp_max_tokens = max_tokens
        return super().get_batch_iterator(dataset, max_tokens, *args, **kwargs)

    def filter_indices_by_size(
        self, indices, dataset, max_positions=None, ignore_invalid_inputs=False
    ):
        """fairseq's filter, except for the sentences of :meth:`build_dataset_for_inference`
        (what the hub interface's ``translate`` and fairseq-interactive translate): a
        sentence over the limit is an error that says the limit and how to raise it, where
        fairseq names only a command-line flag, --skip-invalid-size-inputs-valid-test,
        which means nothing to ``translate``. So is a sentence longer than a batch holds
        (``max_tokens``), which fairseq's batching meets with an assertion; with
        ``ignore_invalid_inputs`` both are skipped, with a warning."""
        inference = getattr(dataset, "tpp_for_inference", False)
        if ignore_invalid_inputs or not inference:
            indices = super().filter_indices_by_size(
                indices, dataset, max_positions, ignore_invalid_inputs
            )
            return self._within_max_tokens(indices, dataset) if inference else indices
        indices, ignored = dataset.filter_indices_by_size(indices, max_positions)
        if len(ignored) > 0:
            first = int(ignored[0])
            source = dataset.size(first)
            source = source[0] if isinstance(source, tuple) else source
            limit = max_positions[0] if isinstance(max_positions, (tuple, list)) else max_positions
            raise InputTooLongError(
                f"input sentence {first} (0-based; {len(ignored)} sentence(s) in all) is {int(source)} "
                f"tokens long after BPE, end of sentence included; this model takes at most {limit} "
                f"(max_positions={max_positions}). Split it into shorter sentences, or raise the limit "
                "when loading the model: from_pretrained(..., max_source_positions=N, "
                "max_target_positions=N) in Python; for fairseq-interactive, --model-overrides "
                "\"{'max_source_positions': N, 'max_target_positions': N}\" (and --max-source-positions N "
                "--max-target-positions N above 1024), or skip such lines with "
                "--skip-invalid-size-inputs-valid-test"
            )
        return self._within_max_tokens(indices, dataset, refuse=True)

    @staticmethod
    def _within_max_tokens(indices, dataset, refuse=False):
        """``indices`` without the sentences longer than the batches' ``max_tokens``
        (:meth:`get_batch_iterator`); with ``refuse``, an error naming the first."""
        max_tokens = getattr(dataset, "tpp_max_tokens", None)
        over = [int(i) for i in indices if max_tokens and dataset.num_tokens(i) > max_tokens]
        if over and not refuse:
            logger.warning(
                f"{len(over)} input sentence(s) longer than max_tokens={max_tokens} skipped "
                f"(the first: sentence {over[0]}, 0-based)"
            )
            return indices[[dataset.num_tokens(i) <= max_tokens for i in indices]]
        if over:
            raise InputTooLongError(
                f"input sentence {over[0]} (0-based; {len(over)} sentence(s) in all) is "
                f"{dataset.num_tokens(over[0])} tokens long after BPE, end of sentence included, "
                f"and a batch holds at most max_tokens={max_tokens} (the hub interface batches by "
                "the --max-tokens the model was trained with, fairseq-interactive by its own). "
                "Raise it: from_pretrained(..., max_tokens=N) in Python; --max-tokens N for "
                "fairseq-interactive"
            )
        return indices

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        paths = utils.split_paths(self.cfg.data)
        data_path = paths[(epoch - 1) % len(paths)]
        prefix = self._check_text(split, data_path, combine)
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        if prefix is not None:
            check_not_empty(split, prefix, self.datasets[split].src_sizes)
        if not self.tag_names:
            return
        if self.missing_tag_dictionaries and len(self.missing_tag_dictionaries) == len(
            self.tag_names
        ):
            raise MissingTagsError(
                f"the data folder has no label files for --tags {','.join(self.tag_names)}: "
                f"expected {', '.join(self.missing_tag_dictionaries.values())}",
                "a folder prepared with tpp-prepare-corpus --no-tags has none: pass --tags '' "
                "(or --task translation) to train without them, or prepare the data with tags; "
                "where the task is the checkpoint's (fairseq-validate), pass --model-overrides "
                "\"{'tags': ''}\"",
            )
        for name, path in self.missing_tag_dictionaries.items():
            raise MissingTagsError(
                f"label dictionary for tag '{name}' not found: expected {path}",
                "binarize the tags next to the text, or pass --tags '' to train without them",
            )
        if split == self.cfg.train_subset:  # (at the start, not when their epoch comes)
            for folder in paths[1:]:  # --data a:b: one folder per epoch
                for name in self.tag_names:
                    self._label_prefix(folder, split, name, optional=True)
        pair = self.datasets[split]
        tags = {
            name: self._load_tag_stream(split, name, data_path, combine, pair.src_sizes)
            for name in self.tag_names
        }
        self.datasets[split] = TaggedLanguagePairDataset(pair, tags, self.tag_dictionaries)

    def _check_text(self, split, data_path, combine):
        """The text of ``split`` (every shard) whole and within its dictionaries, before
        fairseq reads it (:mod:`tpp_fairseq.data_files`). Returns its source's prefix (None where
        fairseq finds no such split: its own error follows)."""
        src, tgt = self.cfg.source_lang, self.cfg.target_lang
        first = None
        for k in itertools.count():
            base = self._text_base(data_path, split + (str(k) if k > 0 else ""))
            if base is None:
                break
            for lang, dictionary in ((src, self.src_dict), (tgt, self.tgt_dict)):
                check_binarized(
                    base + lang, len(dictionary), os.path.join(data_path, f"dict.{lang}.txt")
                )
            first = first or base + src
            if not combine:
                break
        return first

    def _exists(self, prefix):
        return indexed_dataset.dataset_exists(prefix, impl=self.cfg.dataset_impl)

    def _text_base(self, data_path, split_k):
        """``DATA/{split_k}.{src}-{tgt}.`` or ``DATA/{split_k}.{tgt}-{src}.``, where fairseq
        finds the text of ``split_k`` (None: in neither)."""
        src, tgt = self.cfg.source_lang, self.cfg.target_lang
        bases = [
            os.path.join(data_path, f"{split_k}.{a}-{b}.") for a, b in ((src, tgt), (tgt, src))
        ]
        return next((base for base in bases if self._exists(base + src)), None)

    def _label_prefix(self, data_path, split_k, name, optional=False):
        """``DATA/{split_k}.{src}-{tgt}.{name}``; an error naming it where it is missing
        (with ``optional``, None where ``split_k`` has no text either). Labels are of the
        language a folder was binarized from: ``{split_k}.{tgt}-{src}.{name}`` labels
        ``tgt``, the target here, and is refused."""
        src, tgt = self.cfg.source_lang, self.cfg.target_lang
        prefix = label_stream_prefix(data_path, split_k, src, tgt, name)
        if self._exists(prefix):
            return prefix
        if optional and self._text_base(data_path, split_k) is None:
            return None
        reversed_labels = label_stream_prefix(data_path, split_k, tgt, src, name)
        if self._exists(reversed_labels):
            raise MissingTagsError(
                f"{split_k}: the {name} labels of this folder ({reversed_labels}) are of its "
                f"{tgt} sentences, the target here: there are none for the source, {src}",
                f"translate from {tgt} (-s {tgt} -t {src}), or pass --tags '' to train "
                "without labels",
            )
        raise MissingTagsError(
            f"{split_k}: {name} labels not found: expected {prefix}.bin and {prefix}.idx",
            "or pass --tags '' to train without labels",
        )

    def _load_tag_stream(self, split, name, data_path, combine, src_sizes):
        """Load ``{split}.{src}-{tgt}.{name}`` (and ``split1``, ``split2``... when
        combining shards, as the text is), checked against the source sizes."""
        streams, prefixes = [], []
        for k in itertools.count():
            prefix = self._label_prefix(data_path, split + (str(k) if k > 0 else ""), name, k > 0)
            if prefix is None:
                break
            check_binarized(
                prefix,
                len(self.tag_dictionaries[name]),
                label_dictionary_path(data_path, name),
            )
            prefixes.append(prefix)
            streams.append(
                data_utils.load_indexed_dataset(
                    prefix, self.tag_dictionaries[name], self.cfg.dataset_impl
                )
            )
            if not combine:
                break
        if len(streams) > 1 and self.cfg.upsample_primary != 1:
            raise OptionError("--upsample-primary is not supported with --tags")
        labels = streams[0] if len(streams) == 1 else ConcatDataset(streams)
        check_tag_alignment(split, name, " + ".join(prefixes), src_sizes, labels.sizes)
        return labels
