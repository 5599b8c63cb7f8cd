"""A language-pair dataset whose source sentences carry per-token label streams.

Each label stream (e.g. POS, NER) is a fairseq indexed dataset with exactly one label
per source token, including the end-of-sentence slot that binarization appends to both.
Batches are built by fairseq's own :class:`~fairseq.data.LanguagePairDataset` (same
sorting, left padding of the source, ``pad_to_multiple``...); the labels are then
collated in the batch's sentence order, padded to the width of ``src_tokens`` on the
same side, and put under ``sample["source_tags"]`` -- outside ``net_input``, whose
every key would otherwise be passed to the encoder at generation time.
"""

from typing import Dict, List

import torch
from fairseq.data import BaseWrapperDataset, Dictionary, LanguagePairDataset, data_utils


class TaggedLanguagePairDataset(BaseWrapperDataset):
    """Wraps a :class:`LanguagePairDataset` and adds ``sample["source_tags"][name]``
    (``B x T_src``, aligned with ``net_input.src_tokens``)."""

    def __init__(
        self,
        dataset: LanguagePairDataset,
        tags: Dict[str, "torch.utils.data.Dataset"],
        tag_dictionaries: Dict[str, Dictionary],
    ):
        super().__init__(dataset)
        self.tags = tags
        self.tag_dictionaries = tag_dictionaries

    def __getitem__(self, index):
        item = self.dataset[index]
        item["tags"] = {name: labels[index] for name, labels in self.tags.items()}
        return item

    def collater(self, samples: List[dict]):
        batch = self.dataset.collater(samples)
        if not batch:
            return batch
        src_tokens = batch["net_input"]["src_tokens"]
        by_id = {s["id"]: s for s in samples}
        order = batch["id"].tolist()
        batch["source_tags"] = {
            name: data_utils.collate_tokens(
                [by_id[i]["tags"][name] for i in order],
                pad_idx=self.tag_dictionaries[name].pad(),
                left_pad=self.dataset.left_pad_source,
                pad_to_length=src_tokens.size(1),
            )
            for name in self.tags
        }
        return batch
