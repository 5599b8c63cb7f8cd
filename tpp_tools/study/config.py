"""The study's variants (a)-(d), its configurations (model size, budget, schedule) and
the tag-loss settings a study may change."""

from dataclasses import asdict, dataclass, field
from typing import List, Optional

from tpp_pipeline.errors import UserError

from ..train import PRESETS, RESUMABLE, SETTINGS, option_words

PROG = "tpp-study"

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
    # the conv heads' output scale (--conv-head-scaling of transformer_pp; "none": the
    # paper's, with which the hybrid heads did not learn in the CPU and GPU studies)
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
    # where the layers normalise: "post" (after each residual sum: the paper's and fairseq's
    # default) or "pre" (before each sublayer, --encoder/decoder-normalize-before: a deep
    # model learns from the first few hundred updates with a short warm-up)
    layer_norm: str = "post"


#: the fields of Config that only the variants with tag losses read, and their defaults
TAG_FIELDS = {"encoder_tag_layers": "", "tag_loss_weights": "", "tag_loss_decay_updates": 0}

#: the fields added to Config after runs had been made, each with the value every run had
#: before it: a field at that value is left out of a run's identity, so that those runs
#: keep theirs (a new field goes here, or it changes every run's identity)
LEGACY_DEFAULTS = {
    "conv_head_scaling": "none",
    "gpus": 1,
    "shared_embeddings": "all",
    **TAG_FIELDS,
    "layer_norm": "post",
}


def identity_config(cfg: Config, variant: str) -> dict:
    """The configuration as it is part of a run's identity: without the fields at their
    :data:`LEGACY_DEFAULTS` and those the variant does not read (the conv heads' scale
    without conv heads, the tag losses without tags)."""
    unread = set() if VARIANTS[variant]["conv"] else {"conv_head_scaling"}
    if not VARIANTS[variant].get("tags"):
        unread |= set(TAG_FIELDS)
    return {
        name: value
        for name, value in asdict(cfg).items()
        if name not in unread and not (name in LEGACY_DEFAULTS and value == LEGACY_DEFAULTS[name])
    }


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


def check_config(cfg: Config) -> Optional[str]:
    """What is wrong with the model, budget and schedule, before anything runs (None:
    nothing): each value fairseq or the pipeline would otherwise refuse, or misread,
    only once the runs are under way."""
    for name in (
        "embed_dim",
        "ffn_dim",
        "heads",
        "layers",
        "max_update",
        "max_tokens",
        "update_freq",
        "average",
        "bpe_merges",
        "max_len",
    ):
        if getattr(cfg, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, not {getattr(cfg, name)}"
    if cfg.embed_dim % cfg.heads:
        return f"--embed-dim {cfg.embed_dim} is not divisible by --heads {cfg.heads}"
    for name in ("dropout", "attention_dropout", "activation_dropout"):
        if not 0 <= getattr(cfg, name) < 1:
            return f"--{name.replace('_', '-')} must be in [0, 1), not {getattr(cfg, name)}"
    if cfg.lr <= 0:
        return f"--lr must be positive, not {cfg.lr}"
    if cfg.warmup_updates < 1:  # (fairseq's inverse_sqrt divides by it)
        return f"--warmup-updates must be at least 1, not {cfg.warmup_updates}"
    return None


def check_tag_settings(cfg: Config) -> Optional[str]:
    """What is wrong with the tag-loss settings, before any run is planned (None: nothing):
    the model's and the criterion's own checks."""
    from tpp_plugin.options import check_tag_weights, parse_named, tag_layers

    try:
        tag_layers(cfg.encoder_tag_layers, cfg.layers)
        weights = parse_named(cfg.tag_loss_weights, "tag-loss-weights", cast=float)
        check_tag_weights(weights, cfg.tag_loss_decay_updates)
    except ValueError as error:
        return str(error)
    return None


def recipe(name: str) -> str:
    """A default of the training recipe (tpp_tools/train.py)."""
    return SETTINGS[name][1]


CONFIGS = {
    # transformer-base size on one GPU, bf16, a few runs per short allocation (their
    # records merged: docs/gpu_commands.md); pre-LN and 8k BPE, as gpu-short
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
        bpe_merges=8000,
        layer_norm="pre",
        conv_head_scaling="inv-sqrt-head-dim",
    ),
    # transformer-base size on one GPU, bf16, sized for a short single-GPU allocation
    # (all variants x 2 seeds; docs/gpu_commands.md runs the eight at once); pre-LN: post-LN 6+6
    # layers stayed at the unigram loss for all 600 updates of this schedule (docs/study.md)
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
        layer_norm="pre",
        conv_head_scaling="inv-sqrt-head-dim",
    ),
    # chosen for learning speed on a 2-core CPU (a small model, a small BPE vocabulary,
    # short segments, small batches, a short warm-up); the peak and the conv heads' scale
    # with which the hybrid heads learn (docs/results_cpu.md)
    "cpu": Config(
        embed_dim=256,
        ffn_dim=512,
        heads=4,
        layers=3,
        max_update=1400,
        max_tokens=2048,
        update_freq=1,
        lr=1e-3,
        warmup_updates=200,
        dropout=0.1,
        attention_dropout=0.0,
        activation_dropout=0.0,
        average=5,
        dtype="fp32",
        bpe_merges=8000,
        max_len=40,
        conv_head_scaling="inv-sqrt-head-dim",
    ),
    # the paper's scale, on a cluster (--launcher slurm; docs/slurm.md): the sizes of the
    # En-De big preset transformer_pp_wmt_en_de_big (a test holds them to it) and the
    # training recipe of tpp_tools/train.py, each run on 4 GPUs. --update-epoch-batch-itr:
    # every epoch's batches grouped anew from the seed and the epoch, so that a run resumed
    # after a requeue trains on the batches an uninterrupted run would (fairseq otherwise
    # groups the batches once, with the seed of the epoch it starts in: another grouping).
    # The paper's unscaled conv heads: nothing has been measured at this scale
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
        extra=option_words(RESUMABLE),
    ),
}


class StudyError(UserError):
    """What stops the study, said in one line (what and where); ``status`` is its exit
    status: 2 for bad input (the default), 1 for a study that cannot go on."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status
