"""translation_with_tags and label_smoothed_cross_entropy_with_tags: collation, the
loss against hand computations, and the errors on misaligned or missing label files."""

import argparse
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    label_smoothed_nll_loss,
)
from fairseq import options, tasks
from fairseq.data import indexed_dataset
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.logging import metrics
from fairseq.optim.sgd import SGD

from tpp_plugin.criterions import LabelSmoothedCrossEntropyWithTagsCriterion
from tpp_plugin.criterions.label_smoothed_cross_entropy_with_tags import (
    LabelSmoothedCrossEntropyWithTagsConfig,
)
from tpp_plugin.tasks import TranslationWithTagsTask
from tpp_pipeline.contract import TagAlignmentError
from tpp_pipeline.errors import DataError
from tpp_plugin.tasks.translation_with_tags import TranslationWithTagsConfig

from support import REPO, binarize_tagged, build_model, run, toy_tags


@pytest.fixture(scope="module")
def databin(tmp_path_factory):
    root = tmp_path_factory.mktemp("tagged")
    return binarize_tagged(root / "text", root / "data-bin", n_train=200)


def make_task(data, **overrides):
    # the fields that fairseq's CLI fills from other config groups
    overrides.setdefault("dataset_impl", "mmap")
    overrides.setdefault("required_seq_len_multiple", 1)
    overrides.setdefault("train_subset", "train")
    cfg = TranslationWithTagsConfig(
        data=str(data), source_lang="src", target_lang="tgt", **overrides
    )
    return TranslationWithTagsTask.setup_task(cfg)


def train_tiny(data, *extra, check=False):
    """fairseq-train of the tiny preset with the tags task, 1 update on the CPU."""
    command = ["fairseq-train", data, "--user-dir", REPO / "tpp_plugin", "--cpu"]
    command += ["--arch", "transformer_pp_tiny", "--task", "translation_with_tags"]
    command += ["--criterion", "label_smoothed_cross_entropy_with_tags", "--max-update", "1"]
    command += ["--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500"]
    return run([*command, "--num-workers", "0", *extra], check=check)


def first_batch(task, split="train", max_sentences=16):
    task.load_dataset(split)
    dataset = task.dataset(split)
    indices = list(range(max_sentences))
    return dataset.collater([dataset[i] for i in indices])


def test_labels_line_up_with_subwords_after_padding_and_sorting(databin):
    task = make_task(databin)
    batch = first_batch(task, max_sentences=24)
    src = batch["net_input"]["src_tokens"]
    lengths = batch["net_input"]["src_lengths"]
    assert len(set(lengths.tolist())) > 3, "the batch should mix lengths"
    assert lengths.tolist() == sorted(lengths.tolist(), reverse=True)
    src_dict = task.source_dictionary
    for name, tags in batch["source_tags"].items():
        assert tags.shape == src.shape
        tag_dict = task.tag_dictionaries[name]
        for row in range(src.size(0)):
            words = [src_dict[i] for i in src[row].tolist()]
            labels = [tag_dict[i] for i in tags[row].tolist()]
            n_pad = src.size(1) - lengths[row].item()
            assert words[:n_pad] == ["<pad>"] * n_pad and labels[:n_pad] == ["<pad>"] * n_pad
            assert words[-1] == "</s>" and labels[-1] == "</s>"
            expected = toy_tags(" ".join(words[n_pad:-1]))[0 if name == "pos" else 1]
            assert labels[n_pad:-1] == expected
    assert "source_tags" not in batch["net_input"]


def test_criterion_is_fairseq_label_smoothed_ce_without_tags(databin):
    torch.manual_seed(0)
    task = make_task(databin)
    model = build_model(
        dictionary=task.source_dictionary, tag_dictionaries=task.tag_dictionaries
    ).eval()
    batch = first_batch(task)
    del batch["source_tags"]
    ours = LabelSmoothedCrossEntropyWithTagsCriterion(task, False, 0.1)
    theirs = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    with torch.no_grad():
        loss_a, size_a, log_a = ours(model, batch)
        loss_b, size_b, log_b = theirs(model, batch)
        model.train()  # in training the (unused) heads join with weight 0
        torch.manual_seed(1)
        loss_c, _, _ = ours(model, batch)
        torch.manual_seed(1)
        loss_d, _, _ = theirs(model, batch)
    assert size_a == size_b
    assert abs(loss_a.item() - loss_b.item()) <= 1e-6 * max(1.0, abs(loss_b.item()))
    assert abs(loss_c.item() - loss_d.item()) <= 1e-6 * max(1.0, abs(loss_d.item()))
    assert not any(k.endswith("_tag_count") for k in log_a)


def test_unused_tag_heads_add_zero_also_when_their_half_precision_sum_overflows(databin):
    """In training on a batch without tags the heads join with weight 0; with fp16 logits
    whose sum overflows (inf in fp16) that term must still be 0, not 0 * inf = NaN."""
    torch.manual_seed(0)
    task = make_task(databin)
    model = build_model(
        dictionary=task.source_dictionary, tag_dictionaries=task.tag_dictionaries
    ).train()
    batch = first_batch(task)
    del batch["source_tags"]
    forward, overflowing = model.forward, {}

    def forward_with_large_half_logits(*args, **kwargs):
        out = forward(*args, **kwargs)
        for name, logits in out[1].get("tag_logits", {}).items():
            big = torch.full(logits.shape, 60000.0, dtype=torch.float16, requires_grad=True)
            out[1]["tag_logits"][name] = overflowing[name] = big
        return out

    model.forward = forward_with_large_half_logits
    torch.manual_seed(1)
    loss, _, _ = LabelSmoothedCrossEntropyWithTagsCriterion(task, False, 0.1)(model, batch)
    torch.manual_seed(1)
    plain, _, _ = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)(model, batch)
    assert overflowing and all(torch.isinf(logits.sum()) for logits in overflowing.values())
    assert torch.isfinite(loss) and loss.item() == plain.item()
    loss.backward()
    assert all(torch.equal(x.grad, torch.zeros_like(x)) for x in overflowing.values())


@pytest.mark.parametrize(
    "weights",
    [
        dict(tag_loss_weights="pos:0.7,ner:0.3"),
        dict(pos_loss_weight=0.7, ner_loss_weight=0.3),
        dict(tag_loss_weights="ner:0.3", pos_loss_weight=0.7),
    ],
)
def test_criterion_adds_exactly_the_weighted_tag_losses(databin, weights):
    torch.manual_seed(0)
    task = make_task(databin)
    model = build_model(
        dictionary=task.source_dictionary, tag_dictionaries=task.tag_dictionaries
    ).eval()
    batch = first_batch(task)
    crit = LabelSmoothedCrossEntropyWithTagsCriterion(task, False, 0.1, **weights)
    with torch.no_grad():
        loss, _, log = crit(model, batch)
        # by hand: translation loss + 0.7 * POS + 0.3 * NER, over non-pad non-EOS tokens
        net_output = model(**batch["net_input"], return_tag_logits=True)
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        ls, _ = label_smoothed_nll_loss(
            lprobs.view(-1, lprobs.size(-1)),
            batch["target"].view(-1),
            0.1,
            ignore_index=task.target_dictionary.pad(),
        )
        expected = ls
        src = batch["net_input"]["src_tokens"]
        real = src.ne(task.source_dictionary.pad()) & src.ne(task.source_dictionary.eos())
        for name, weight in (("pos", 0.7), ("ner", 0.3)):
            logits = net_output[1]["tag_logits"][name]
            per_token = (
                -F.log_softmax(logits.float(), -1)
                .gather(-1, batch["source_tags"][name].unsqueeze(-1))
                .squeeze(-1)
            )
            tag_loss = per_token[real].sum()
            expected = expected + weight * tag_loss
            assert abs(log[f"{name}_loss"].item() - tag_loss.item()) <= 1e-4
            assert log[f"{name}_tag_count"] == real.sum().item()
            correct = logits.argmax(-1).eq(batch["source_tags"][name])[real].sum().item()
            assert log[f"{name}_tag_correct"] == correct
    assert abs(loss.item() - expected.item()) <= 1e-6 * abs(expected.item())


def test_tag_metrics_aggregate_over_workers_and_batches():
    logs = [
        {
            "loss": 4.0,
            "nll_loss": 3.0,
            "ntokens": 10,
            "nsentences": 2,
            "sample_size": 10,
            "pos_loss": 6.0,
            "pos_tag_correct": 3,
            "pos_tag_count": 4,
        },
        {
            "loss": 2.0,
            "nll_loss": 1.0,
            "ntokens": 6,
            "nsentences": 1,
            "sample_size": 6,
            "pos_loss": 2.0,
            "pos_tag_correct": 5,
            "pos_tag_count": 6,
        },
    ]
    with metrics.aggregate() as agg:
        LabelSmoothedCrossEntropyWithTagsCriterion.reduce_metrics(logs)
        values = agg.get_smoothed_values()
    assert values["pos_acc"] == pytest.approx(80.0)  # 8 correct of 10, not the mean of 75% and 83%
    assert values["pos_loss"] == pytest.approx(8.0 / 10 / 0.6931471805599453, abs=1e-3)
    assert "ner_acc" not in values


def test_tag_metrics_read_nothing_back_until_logged():
    """fairseq's trainer reduces the metrics after every optimizer step: the tag sums stay
    tensors (on a GPU, a read would wait for the step), read when the meters are."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    logs = [
        {
            "loss": torch.tensor(4.0),
            "nll_loss": torch.tensor(3.0),
            "ntokens": 10,
            "nsentences": 2,
            "sample_size": 10,
            "pos_loss": torch.tensor(6.0),
            "pos_tag_correct": torch.tensor(3),
            "pos_tag_count": torch.tensor(4),
        }
    ]
    with metrics.aggregate() as agg:
        with Reads():
            LabelSmoothedCrossEntropyWithTagsCriterion.reduce_metrics(logs)
        assert Reads.count == 0
        values = agg.get_smoothed_values()
    assert values["pos_acc"] == pytest.approx(75.0)
    assert values["pos_loss"] == pytest.approx(6.0 / 4 / 0.6931471805599453, abs=1e-3)


def test_tag_loss_is_logged_after_resuming_the_meters_of_an_older_version():
    """fairseq restores its meters from the checkpoint it resumes; plugin 0.2.1 logged the
    tag loss with an averaging meter, which would stay in place of the derived loss,
    never updated: it is replaced."""
    from fairseq.logging.meters import AverageMeter

    with metrics.aggregate("train_inner", new_root=True) as old:  # the only active aggregator
        metrics.log_scalar("pos_loss", 9.0, 4, round=3)  # as 0.2.1 logged it
        assert isinstance(old["pos_loss"], AverageMeter)
        saved = {"train_inner": metrics.state_dict()["train_inner"]}
    logs = [
        {
            "loss": 4.0,
            "nll_loss": 3.0,
            "ntokens": 10,
            "nsentences": 2,
            "sample_size": 10,
            "pos_loss": 6.0,
            "pos_tag_correct": 3,
            "pos_tag_count": 4,
        }
    ]
    metrics.load_state_dict(saved)
    with metrics.aggregate("train_inner", new_root=True) as agg:
        agg.reset()  # fairseq resets the interval's meters after logging them
        LabelSmoothedCrossEntropyWithTagsCriterion.reduce_metrics(logs)
        values = agg.get_smoothed_values()
    assert values["pos_loss"] == pytest.approx(6.0 / 4 / 0.6931471805599453, abs=1e-3)
    assert values["pos_acc"] == pytest.approx(75.0)


def test_misaligned_labels_name_split_sentence_and_lengths(databin, tmp_path):
    data = tmp_path / "data-bin"
    shutil.copytree(databin, data)
    # rewrite the valid POS stream with one label too many in sentence 3
    task = make_task(data)
    task.load_dataset("valid")
    tag_dict = task.tag_dictionaries["pos"]
    prefix = str(data / "valid.src-tgt.pos")
    original = [t.clone() for t in indexed_dataset.make_dataset(prefix, impl="mmap")]
    builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=len(tag_dict))
    for i, labels in enumerate(original):
        if i == 3:
            labels = torch.cat([labels[:1], labels])
        builder.add_item(labels)
    builder.finalize(prefix + ".idx")
    expected_len = len(original[3]) - 1
    message = (
        f"valid: sentence 3 (0-based: line 4 of the text) has {expected_len + 1} pos labels "
        f"for {expected_len} source tokens"
    )
    with pytest.raises(TagAlignmentError, match=re.escape(message)):
        make_task(data).load_dataset("valid")
    refused = train_tiny(data, "--no-save")  # fairseq-train says it in one line
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"fairseq-train: error: {message}" in refused.stderr, refused.stderr[-3000:]


def test_missing_label_files_name_the_expected_path(databin, tmp_path):
    data = tmp_path / "data-bin"
    shutil.copytree(databin, data)
    for ext in ("bin", "idx"):
        (data / f"valid.src-tgt.ner.{ext}").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"valid: ner labels not found: expected .*valid\.src-tgt\.ner\.bin"
    ):
        make_task(data).load_dataset("valid")
    (data / "dict.ner.txt").unlink()
    task = make_task(data)  # a trained model can still be loaded with this task...
    with pytest.raises(FileNotFoundError, match=r"expected .*dict\.ner\.txt"):
        task.load_dataset("train")  # ...but its labels cannot be read
    # switched off: no label files needed
    task = make_task(data, tags="")
    task.load_dataset("valid")
    assert "source_tags" not in first_batch(task, "valid", 4)


def test_labels_of_the_other_language_or_of_a_missing_sub_split_are_named(databin, tmp_path):
    """A folder's labels are of the language it was binarized from: translating the other
    way they label the target, and are refused, saying so (they were read as the
    source's). A sub-split's labels (``train1``, read with ``train``) missing are named."""
    with pytest.raises(FileNotFoundError) as refused:
        TranslationWithTagsTask.setup_task(
            TranslationWithTagsConfig(
                data=str(databin),
                source_lang="tgt",
                target_lang="src",
                dataset_impl="mmap",
                required_seq_len_multiple=1,
                train_subset="train",
            )
        ).load_dataset("valid")
    assert (
        f"valid: the pos labels of this folder ({databin}/valid.src-tgt.pos) are of its src "
        in (str(refused.value))
    )
    assert "translate from src (-s src -t tgt), or pass --tags ''" in str(refused.value)

    data = tmp_path / "data-bin"
    shutil.copytree(databin, data)
    for name in [p.name for p in data.glob("valid.src-tgt.*")]:  # valid1: a copy of valid
        shutil.copy(data / name, data / name.replace("valid.", "valid1.", 1))
    make_task(data, upsample_primary=1).load_dataset("valid", combine=True)
    for ext in ("bin", "idx"):
        (data / f"valid1.src-tgt.pos.{ext}").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"valid1: pos labels not found: expected .*valid1\.src-tgt\.pos\.bin",
    ):
        make_task(data, upsample_primary=1).load_dataset("valid", combine=True)


def test_every_folder_of_sharded_data_has_the_first_ones_dictionaries(databin, tmp_path):
    """``--data a:b`` (one folder per epoch, its dictionaries read from the first alone):
    a folder binarized with other dictionaries (the same labels in another order here)
    is refused, naming its file, instead of training on the wrong labels; one without
    labels is named as training starts, not when its epoch comes."""
    shard = tmp_path / "shard"
    shutil.copytree(databin, shard)
    make_task(f"{databin}:{shard}")
    labels = shard / "dict.pos.txt"
    labels.write_text("".join(reversed(labels.read_text().splitlines(True))))
    with pytest.raises(
        DataError, match=rf"{labels}: this dictionary is not {databin}/dict\.pos\.txt"
    ):
        make_task(f"{databin}:{shard}")
    make_task(f"{databin}:{shard}", tags="ner")  # (the POS labels unread)
    # a later folder's labels missing: said as the first folder's training split loads
    for ext in ("bin", "idx"):
        (shard / f"train.src-tgt.ner.{ext}").unlink()
    with pytest.raises(FileNotFoundError, match=rf"train: ner labels not found: expected {shard}/"):
        make_task(f"{databin}:{shard}", tags="ner").load_dataset("train", epoch=1)
    make_task(f"{databin}:{shard}", tags="ner").load_dataset("valid")  # (the first folder's)


def test_options_that_would_misalign_labels_are_refused(databin):
    with pytest.raises(ValueError, match="--truncate-source"):
        make_task(databin, truncate_source=True)


def test_tag_loss_weights_are_data(databin):
    task = make_task(databin)
    crit = LabelSmoothedCrossEntropyWithTagsCriterion(
        task, False, 0.1, tag_loss_weights="ner:0.25,chunk:2"
    )
    assert crit.tag_weight("ner") == 0.25 and crit.tag_weight("chunk") == 2.0
    assert crit.tag_weight("pos") == 1.0, "a kind not named keeps weight 1"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tag_loss_weights="pos=1"), "--tag-loss-weights: expected NAME:NUMBER"),
        (dict(tag_loss_weights="pos:1,pos:2"), "given twice"),
        (dict(tag_loss_weights="pos:-1"), "must be a number >= 0"),
        (dict(tag_loss_weights="pos:nan"), "must be a number >= 0"),
        (dict(tag_loss_weights="pos:0.5", pos_loss_weight=0.7), "contradicts --tag-loss-weights"),
        (dict(pos_loss_weight=-1.0), "--pos-loss-weight must be a number >= 0, got -1.0"),
        (dict(ner_loss_weight=float("nan")), "--ner-loss-weight must be a number >= 0"),
        (dict(tag_loss_decay_updates=-1), "--tag-loss-decay-updates must be >= 0"),
    ],
)
def test_bad_tag_loss_weights_name_the_option(databin, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LabelSmoothedCrossEntropyWithTagsCriterion(make_task(databin), False, 0.1, **kwargs)


def test_tag_loss_weights_are_constant_by_default(databin):
    assert LabelSmoothedCrossEntropyWithTagsConfig().tag_loss_decay_updates == 0
    crit = LabelSmoothedCrossEntropyWithTagsCriterion(
        make_task(databin), False, 0.1, tag_loss_weights="pos:0.5"
    )
    for update in (0, 1000, 10**6):
        crit.set_num_updates(update)
        assert (crit.tag_weight("pos"), crit.tag_weight("ner")) == (0.5, 1.0)


def test_tag_loss_weights_decay_with_the_update_of_each_training_step(databin):
    """--tag-loss-decay-updates 4: the weights times 1, 1/2, 0, 0 at updates 0, 2, 4, 6,
    the update number passed on by the task's real train_step."""
    torch.manual_seed(0)
    task = make_task(databin)
    model = build_model(dictionary=task.source_dictionary, tag_dictionaries=task.tag_dictionaries)
    optimizer = SGD(
        argparse.Namespace(lr=[0.1], momentum=0.0, weight_decay=0.0), model.parameters()
    )
    batch = first_batch(task)
    crit = LabelSmoothedCrossEntropyWithTagsCriterion(
        task, False, 0.1, tag_loss_weights="pos:0.8,ner:0.4", tag_loss_decay_updates=4
    )
    for update, factor in ((0, 1.0), (2, 0.5), (4, 0.0), (6, 0.0)):
        torch.manual_seed(1)  # the same dropout at every step
        loss, _, log = task.train_step(batch, model, crit, optimizer, update)
        assert log["pos_loss"] > 0 and log["ner_loss"] > 0
        by_hand = log["loss"] + factor * (0.8 * log["pos_loss"] + 0.4 * log["ner_loss"])
        assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6), update


def test_tag_loss_decay_reaches_the_criterion_from_fairseq_trains_command_line(databin):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        input_args=[
            str(databin),
            "--user-dir",
            str(REPO / "tpp_plugin"),
            "-s",
            "src",
            "-t",
            "tgt",
            "--task",
            "translation_with_tags",
            "--arch",
            "transformer_pp",
            "--criterion",
            "label_smoothed_cross_entropy_with_tags",
            "--tag-loss-decay-updates",
            "300",
        ],
    )
    cfg = convert_namespace_to_omegaconf(args)
    crit = tasks.setup_task(cfg.task).build_criterion(cfg.criterion)
    assert isinstance(crit, LabelSmoothedCrossEntropyWithTagsCriterion)
    crit.set_num_updates(75)
    assert crit.tag_weight("pos") == pytest.approx(0.75)


@pytest.mark.parametrize(
    "flags, refused",
    [
        ([], True),  # tag heads that nothing trains
        (["--tags", ""], False),  # no tags loaded
        (["--encoder-tag-layers", ""], False),  # no tag heads built
    ],
)
def test_a_criterion_that_leaves_the_tag_heads_untrained_is_refused(
    databin, tmp_path, flags, refused
):
    """With the tags loaded for the model's tag heads, fairseq's plain criterion would
    never run them: no gradient for their parameters, which DistributedDataParallel (the
    GPUs' default --ddp-backend) stops on at the second update. fairseq-train refuses it
    before training and says what to use instead."""
    proc = run(
        [
            "fairseq-train",
            databin,
            "--user-dir",
            REPO / "tpp_plugin",
            "--arch",
            "transformer_pp_tiny",
            "--task",
            "translation_with_tags",
            "--criterion",
            "label_smoothed_cross_entropy",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--max-tokens",
            "500",
            "--max-update",
            "1",
            "--cpu",
            "--no-save",
            "--disable-validation",
            "--num-workers",
            "0",
            *flags,
        ],
        check=False,
    )
    if refused:
        assert proc.returncode != 0 and "done training" not in proc.stdout + proc.stderr
        assert "--criterion label_smoothed_cross_entropy does not train" in proc.stderr
        assert (
            "label_smoothed_cross_entropy_with_tags" in proc.stderr and "--tags ''" in proc.stderr
        )
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "done training" in proc.stdout + proc.stderr


@pytest.mark.parametrize("with_tags", [True, False])
def test_every_parameter_takes_part_in_a_training_step_of_the_criterion(databin, with_tags):
    """What DistributedDataParallel without find_unused_parameters (fairseq's default on
    GPUs) needs: every parameter in the graph of every training loss, also on a batch
    without tags, where the heads join with weight 0."""
    torch.manual_seed(0)
    task = make_task(databin)
    model = build_model(
        dictionary=task.source_dictionary, tag_dictionaries=task.tag_dictionaries
    ).train()
    batch = first_batch(task)
    if not with_tags:
        del batch["source_tags"]
    loss, _, _ = LabelSmoothedCrossEntropyWithTagsCriterion(task, False, 0.1)(model, batch)
    loss.backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]


def test_a_folder_without_tags_is_one_error_line_of_fairseq_train(tmp_path):
    """Issue 33.12: the tags task on a folder prepared with --no-tags ended fairseq-train
    in a traceback, its clear message last. Now the message is all there is."""
    data = binarize_tagged(tmp_path / "text", tmp_path / "data-bin", n_train=60, tags=False)
    proc = train_tiny(data, "--no-save")
    assert proc.returncode != 0 and "done training" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        f"fairseq-train: error: the data folder has no label files for --tags pos,ner: expected "
        f"{data / 'dict.pos.txt'}, {data / 'dict.ner.txt'} (a folder prepared with tpp-prepare-corpus "
        "--no-tags has none: pass --tags '' (or --task translation)"
    ) in proc.stderr, proc.stderr[-3000:]


def test_validating_a_tagged_checkpoint_on_a_folder_without_tags_says_the_working_way(
    tmp_path,
):
    """fairseq-validate takes the task from the checkpoint, whatever --task says: on a
    folder without label files the error names the override that works, and it works."""
    tagged = binarize_tagged(tmp_path / "text", tmp_path / "tagged", n_train=60)
    plain = binarize_tagged(tmp_path / "text", tmp_path / "plain", n_train=60, tags=False)
    train_tiny(tagged, "--save-dir", tmp_path / "checkpoints", check=True)
    validate = ["fairseq-validate", plain, "--user-dir", REPO / "tpp_plugin", "--cpu"]
    validate += ["--max-tokens", "500"]
    validate += ["--path", tmp_path / "checkpoints" / "checkpoint_last.pt", "--task", "translation"]
    refused = run(validate, check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    advice = "where the task is the checkpoint's (fairseq-validate), pass --model-overrides"
    assert advice in refused.stderr, refused.stderr[-3000:]
    override = refused.stderr.split(advice, 1)[1].split('"')[1]
    assert override == "{'tags': ''}", refused.stderr[-3000:]
    validated = run(validate + ["--model-overrides", override])
    assert "valid on 'valid' subset" in validated.stdout + validated.stderr


def test_a_checkpoint_with_fewer_tag_heads_loads_under_the_tags_task(
    databin, tmp_path, monkeypatch
):
    """A model trained with --tags pos is rebuilt with its one head under --task
    translation_with_tags reading POS and NER labels (it had a NER head added, and its
    state did not load); POS labels that are not the checkpoint's are refused by naming
    both sizes, also where the check of the checkpoint's data is switched off."""
    train_tiny(databin, "--tags", "pos", "--save-dir", tmp_path / "ck", check=True)
    generate = ["fairseq-generate", "--user-dir", REPO / "tpp_plugin", "--cpu"]
    generate += ["--path", tmp_path / "ck" / "checkpoint_last.pt", "--task"]
    generate += ["translation_with_tags", "--gen-subset", "valid", "--beam", "2"]
    generate += ["--max-tokens", "500", "--num-workers", "0"]
    translated = run([*generate[:1], databin, *generate[1:]])
    assert "Generate valid with beam=2" in translated.stdout + translated.stderr

    other = shutil.copytree(databin, tmp_path / "other")
    with open(other / "dict.pos.txt", "a") as labels:
        labels.write("NEWLABEL 1\n")
    monkeypatch.setenv("TPP_FAIRSEQ_CHECKS", "one-line-errors")
    refused = run([*generate[:1], other, *generate[1:]], check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "the checkpoint's 'pos' head predicts" in refused.stderr, refused.stderr[-3000:]
    assert "--task translation" in refused.stderr


def test_translating_a_sentence_over_the_limit_says_the_limit_and_how_to_raise_it(
    databin, tmp_path
):
    """Issue 33.12: the hub interface's translate() of a too long sentence said to pass
    --skip-invalid-size-inputs-valid-test, a command-line flag. Now the error says the
    limit and how to raise it, and raising it as it says works."""
    from fairseq.models.transformer import TransformerModel

    from tpp_plugin.tasks.translation_with_tags import InputTooLongError

    run(
        [
            "fairseq-train",
            databin,
            "--user-dir",
            REPO / "tpp_plugin",
            "--arch",
            "transformer_pp_tiny",
            "--task",
            "translation_with_tags",
            "--criterion",
            "label_smoothed_cross_entropy_with_tags",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--max-tokens",
            "500",
            "--max-update",
            "1",
            "--cpu",
            "--disable-validation",
            "--num-workers",
            "0",
            "--save-dir",
            tmp_path / "ck",
            "--max-source-positions",
            "64",
            "--max-target-positions",
            "64",
        ]
    )
    load = dict(
        checkpoint_file="checkpoint_last.pt",
        data_name_or_path=str(databin),
        user_dir=str(REPO / "tpp_plugin"),
    )
    long = " ".join(f"s{i % 24}" for i in range(100))  # 100 words + end of sentence
    hub = TransformerModel.from_pretrained(str(tmp_path / "ck"), **load)
    with pytest.raises(InputTooLongError) as raised:
        hub.translate(["s1 s2", long], beam=1)
    message = str(raised.value)
    assert message.startswith(
        "input sentence 1 (0-based; 1 sentence(s) in all) is 101 tokens long "
        "after BPE, end of sentence included; this model takes at most 64 "
        "(max_positions=(64, 64))"
    ), message
    assert "from_pretrained(..., max_source_positions=N, max_target_positions=N)" in message
    raised_limit = TransformerModel.from_pretrained(
        str(tmp_path / "ck"), max_source_positions=256, max_target_positions=256, **load
    )
    translated = raised_limit.translate(["s1 s2", long], beam=1)
    assert len(translated) == 2 and all(isinstance(t, str) and t for t in translated)
    # under the positions' limit, over the batches' (the training's --max-tokens 500)
    longer = " ".join(f"s{i % 24}" for i in range(600))
    positions = dict(max_source_positions=1024, max_target_positions=1024, **load)
    with pytest.raises(InputTooLongError) as raised:
        TransformerModel.from_pretrained(str(tmp_path / "ck"), **positions).translate(
            [longer], beam=1
        )
    assert str(raised.value).startswith(
        "input sentence 0 (0-based; 1 sentence(s) in all) is 601 tokens long after BPE, end "
        "of sentence included, and a batch holds at most max_tokens=500"
    ), raised.value
    assert "from_pretrained(..., max_tokens=N)" in str(raised.value)
    skipping = TransformerModel.from_pretrained(str(tmp_path / "ck"), **positions)
    kept = skipping.translate(["s1 s2", longer], beam=1, skip_invalid_size_inputs=True)
    assert len(kept) == 1  # (fairseq's batching asserted on it)
    wider = TransformerModel.from_pretrained(str(tmp_path / "ck"), max_tokens=1000, **positions)
    assert wider.translate([longer], beam=1, max_len_b=5)[0]
