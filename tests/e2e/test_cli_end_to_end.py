"""fairseq's real command-line tools with the plugin, on a tiny toy corpus:
fairseq-preprocess -> fairseq-train (with tags, --eval-bleu) -> resume ->
fairseq-generate / fairseq-interactive with --task translation on tag-less data ->
two-process data-parallel training and validation."""

import json
import os
import math
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import tpp_plugin  # noqa: F401  (allow-lists fairseq checkpoint contents for torch.load)

from support import PLUGIN_DIR, REPO, SCRIPTS, binarize_tagged, run, tool_env, toy_tags

pytestmark = pytest.mark.slow

TRAIN_FLAGS = [
    "--user-dir",
    PLUGIN_DIR,
    "--arch",
    "transformer_pp_tiny",
    "--task",
    "translation_with_tags",
    "--criterion",
    "label_smoothed_cross_entropy_with_tags",
    "--label-smoothing",
    "0.1",
    "--optimizer",
    "adam",
    "--adam-betas",
    "(0.9, 0.98)",
    "--lr",
    "0.003",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "50",
    "--max-tokens",
    "1500",
    "--share-all-embeddings",
    "--dropout",
    "0.0",
    "--log-format",
    "json",
    "--log-interval",
    "25",
    "--cpu",
    "--seed",
    "1",
    "--num-workers",
    "0",
    "--no-progress-bar",
    "--no-epoch-checkpoints",
    "--save-interval-updates",
    "100",
    "--keep-interval-updates",
    "3",
    "--validate-interval",
    "1000",
    "--validate-interval-updates",
    "100",
]


def records(log_path: Path, kind: str):
    """The JSON records fairseq wrote to its --log-file: ``train_inner`` (keys without
    prefix), ``train`` or ``valid`` (keys prefixed with the subset)."""
    out = []
    for line in log_path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the configuration dump is a Python repr
            continue
        if kind == "train_inner" and "loss" in record:
            out.append(record)
        elif f"{kind}_loss" in record:
            out.append(record)
    return out


#: the updates of the module's training (validated and saved every 50: at 50, 100 and 150)
TRAINED_UPDATES = 150


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """fairseq-train with tags and --eval-bleu on the toy corpus, 150 updates (the POS head
    is at 100% from update 50 on, the valid BLEU near 40 at 150); nothing writes into it."""
    root = tmp_path_factory.mktemp("e2e")
    data = binarize_tagged(root / "text", root / "data-bin", n_train=400)
    save = root / "checkpoints"
    log = root / "train.log"
    run(
        [
            "fairseq-train",
            data,
            *TRAIN_FLAGS,
            "--save-interval-updates",
            "50",
            "--validate-interval-updates",
            "50",
            "--log-interval",
            "10",
            "--save-dir",
            save,
            "--log-file",
            log,
            "--max-update",
            str(TRAINED_UPDATES),
            "--eval-bleu",
            "--eval-bleu-args",
            '{"beam": 1}',
            "--best-checkpoint-metric",
            "bleu",
            "--maximize-best-checkpoint-metric",
        ],
        timeout=900,
    )
    return {"root": root, "data": data, "save": save, "log": log}


def test_training_lowers_the_loss_and_learns_pos_tags(trained):
    inner = records(trained["log"], "train_inner")
    assert len(inner) >= 10
    first, last = float(inner[0]["loss"]), float(inner[-1]["loss"])
    assert last < 0.6 * first, (first, last)
    for key in ("pos_loss", "ner_loss", "pos_acc", "ner_acc"):
        assert key in inner[-1], key
    # majority-tag baseline of the training labels vs what the POS head reaches
    lines = (trained["root"] / "text" / "train.src").read_text().splitlines()
    counts = Counter(tag for line in lines for tag in toy_tags(line)[0])
    majority = 100.0 * max(counts.values()) / sum(counts.values())
    valid = records(trained["log"], "valid")
    assert valid and "valid_bleu" in valid[-1]
    pos_acc = float(valid[-1]["valid_pos_acc"])
    print(
        f"POS accuracy after {TRAINED_UPDATES} updates: {pos_acc:.1f}% (majority: {majority:.1f}%)"
    )
    assert pos_acc > majority + 30.0


def test_the_log_file_holds_every_line_once(trained):
    """(fairseq gave --log-file one more handler with every progress bar: epoch N's
    lines were in the file N times)"""
    epochs = Counter(record["epoch"] for record in records(trained["log"], "train"))
    assert len(epochs) > 2 and set(epochs.values()) == {1}, epochs


def test_checkpoints_load_with_safe_loading(trained):
    names = sorted(p.name for p in trained["save"].glob("checkpoint*.pt"))
    assert {"checkpoint_last.pt", "checkpoint_best.pt"} <= set(names)
    assert len([n for n in names if re.fullmatch(r"checkpoint_\d+_\d+\.pt", n)]) >= 2, names
    for name in names:
        state = torch.load(trained["save"] / name, map_location="cpu", weights_only=True)
        assert state["cfg"]["model"].arch == "transformer_pp_tiny"
    # --eval-bleu checkpoints carry numpy values (this is what the allow-list is for)
    best = torch.load(trained["save"] / "checkpoint_best.pt", map_location="cpu", weights_only=True)
    assert best["extra_state"]["best"] is not None


@pytest.fixture(scope="module")
def tagless(trained, tmp_path_factory):
    """The trained data without its label streams: what --task translation reads."""
    folder = tmp_path_factory.mktemp("tagless") / "data-bin"
    shutil.copytree(
        trained["data"],
        folder,
        ignore=shutil.ignore_patterns("*.pos.*", "*.ner.*", "dict.pos.txt", "dict.ner.txt"),
    )
    return folder


#: the beam search of the fairseq-generate runs on the tag-less data
BEAM = ("--beam", "5", "--lenpen", "0.5", "--batch-size", "20")


def generate_tagless(trained, tagless, *options):
    """fairseq-generate --task translation of the trained checkpoint on the tag-less
    test split, on the CPU."""
    return generate_test_split(trained, "--task", "translation", *options, data=tagless)


@pytest.fixture(scope="module")
def translated(trained, tagless):
    """fairseq-generate's translation of the tag-less test split (:data:`BEAM`, fairseq's
    default seed, no other option), which the tests of other options compare theirs with;
    nothing changes it."""
    return generate_tagless(trained, tagless, *BEAM)


def test_generate_needs_no_tags(translated):
    """fairseq-generate --task translation translates with the checkpoint trained with
    tags on data without label streams, and well (fairseq-interactive's run on such data:
    test_the_documented_interactive_line_translates_raw_text)."""
    hyps = [line for line in translated.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) == 20
    bleu = float(re.search(r"BLEU4 = ([\d.]+)", translated.stdout).group(1))
    print(f"toy test BLEU after {TRAINED_UPDATES} updates: {bleu}")
    assert bleu > 5.0


def generate_test_split(trained, *options, check=True, data=None):
    """fairseq-generate of the trained checkpoint on the test split of its data (or of
    ``data``), on the CPU."""
    checkpoint = trained["save"] / "checkpoint_best.pt"
    data = data or trained["data"]
    command = ["fairseq-generate", data, "--user-dir", PLUGIN_DIR, "--path", checkpoint]
    return run([*command, "--gen-subset", "test", "--cpu", *options], check=check)


def hypothesis_lines(generated):
    return sorted(line for line in generated.stdout.splitlines() if line.startswith("H-"))


def test_generate_with_retain_dropout_keeps_the_conv_heads_drop_connect_on(
    trained, tagless, translated
):
    """fairseq-generate --retain-dropout (Monte-Carlo dropout) reaches the conv heads:
    with only LocalConv's DropConnect kept (here at 0.5 by --model-overrides), another
    seed translates differently and the same seed the same; without the option neither
    the DropConnect nor another seed changes the translation."""

    def hypotheses(seed, *extra):
        overrides = ("--model-overrides", "{'conv_weight_dropout': 0.5}")
        options = (*BEAM, "--seed", str(seed), *overrides, *extra)
        return hypothesis_lines(generate_tagless(trained, tagless, *options))

    assert hypotheses(2) == hypothesis_lines(translated)  # (seed 1, no DropConnect rate)
    retain = ("--retain-dropout", "--retain-dropout-modules", "LocalConv")
    first = hypotheses(1, *retain)
    assert len(first) == 20
    assert hypotheses(1, *retain) == first
    assert hypotheses(2, *retain) != first


def test_diverse_beam_search_translates_every_batch_as_each_sentence_alone(trained):
    """fairseq's diverse beam search looked its groups' overlap up by dataset id in a
    tensor of one row per sentence of the batch: an IndexError from the second batch on."""

    def hypotheses(batch_size):
        """{sentence id: (score, tokens)}"""
        options = ("--beam", "4", "--diverse-beam-groups", "2", "--batch-size", batch_size)
        lines = hypothesis_lines(generate_test_split(trained, *options))
        return {n: (float(score), words) for n, score, words in (x.split("\t") for x in lines)}

    alone, batched = hypotheses("1"), hypotheses("20")
    assert len(alone) == 20 and alone.keys() == batched.keys()
    for n, (score, words) in alone.items():
        assert batched[n][1] == words and batched[n][0] == pytest.approx(score, abs=1e-5), n


def test_scoring_references_padded_on_the_left_scores_them_as_padded_on_the_right(trained):
    """(fairseq's scorer read left-padded references from the padding)"""

    def scores(*options):
        lines = hypothesis_lines(generate_test_split(trained, "--score-reference", *options))
        return {n: float(score) for n, score, _ in (line.split("\t") for line in lines)}

    right = scores()
    assert len(right) == 20 and scores("--left-pad-target") == pytest.approx(right, abs=1e-4)


def test_generate_prunes_layers_as_fairseq_does_with_layers_to_keep(trained):
    """fairseq-generate's pruning of layers (a LayerDrop-trained model's use):
    --model-overrides with *_layers_to_keep builds the kept layers with their own kernel
    widths and loads them; the POS head reads a pruned layer, so the model must be built
    without its tag heads, which the error says how to do. One side's list alone keeps
    the other side whole."""

    def generate(overrides, check=True):
        options = ("--beam", "2", "--batch-size", "20", "--max-len-a", "0", "--max-len-b", "10")
        options += ("--model-overrides", overrides)
        return generate_test_split(trained, *options, check=check)

    keep = "'encoder_layers_to_keep': '1', 'decoder_layers_to_keep': '1'"
    refused = generate("{" + keep + "}", check=False)
    assert refused.returncode != 0
    assert "prunes the encoder layers that tag heads read (pos:1" in refused.stderr
    pruned = generate("{" + keep + ", 'encoder_tag_layers': ''}")
    assert len(hypothesis_lines(pruned)) == 20
    # one side pruned, the other kept whole (fairseq's pruning dropped all its layers)
    one_side = generate("{'decoder_layers_to_keep': '1'}")
    assert len(hypothesis_lines(one_side)) == 20


def test_the_documented_interactive_line_translates_raw_text(trained, tagless, tmp_path):
    """docs/translating.md's fairseq-interactive line, run as written with
    this test's files in its paths: Moses tokenisation and subword-nmt BPE of raw input
    (without -s/-t it failed on fairseq's 'tokenizer.source_lang is not Optional'), with
    --task translation on data without label streams (the checkpoint was trained with tags)."""
    import shlex

    from subword_nmt.learn_bpe import learn_bpe

    text = (REPO / "docs" / "translating.md").read_text(encoding="utf-8")
    block = re.search(r"(fairseq-interactive data-bin/wmt14_en_de .*?)\n(?!    )", text, re.S)
    documented = shlex.split(block.group(1).replace("\\\n", " "))
    codes = tmp_path / "codes"
    with open(trained["root"] / "text" / "train.src") as corpus, open(codes, "w") as out:
        learn_bpe(corpus, out, 50)
    paths = {
        "data-bin/wmt14_en_de": str(tagless),
        "tpp_plugin": str(PLUGIN_DIR),
        "checkpoints/en-de/checkpoint_avg10.pt": str(trained["save"] / "checkpoint_best.pt"),
        "work/wmt14_en_de/bpe/codes": str(codes),
        "en": "src",
        "de": "tgt",
    }
    command = [paths.get(word, word) for word in documented] + ["--cpu"]
    inter = run(command, input_text="s1 s2 s3.\ns10 s4 s7 s7\n")
    out = [line for line in inter.stdout.splitlines() if line.startswith("H-")]
    assert len(out) == 2 and all(line.split("\t")[2].strip() for line in out), inter.stdout[-2000:]


def test_the_documented_python_lines_translate_raw_text(trained, tmp_path):
    """docs/translating.md's from_pretrained example, run as written with this
    test's files in its paths: fairseq's hub interface loads the plugin's model from a
    checkpoint and translates raw text."""
    from subword_nmt.learn_bpe import learn_bpe

    text = (REPO / "docs" / "translating.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(from tpp_plugin.models import .*?)```", text, re.S).group(1)
    codes = tmp_path / "codes"
    with open(trained["root"] / "text" / "train.src") as corpus, open(codes, "w") as out:
        learn_bpe(corpus, out, 50)
    paths = {
        '"checkpoints/en-de"': repr(str(trained["save"])),
        '"checkpoint_avg10.pt"': '"checkpoint_best.pt"',
        '"data-bin/wmt14_en_de"': repr(str(trained["data"])),
        '"work/wmt14_en_de/bpe/codes"': repr(str(codes)),
        '"en"': '"src"',
        '"de"': '"tgt"',
        '"There is a fire in the mountain."': '"s1 s2 s3."',
    }
    for documented, here in paths.items():
        assert documented in block, documented
        block = block.replace(documented, here)
    proc = subprocess.run(
        [sys.executable, "-c", block],
        cwd=tmp_path,
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    translation = proc.stdout.strip().splitlines()[-1]
    assert translation and re.fullmatch(r"[\w .,]+", translation), proc.stdout[-2000:]


def test_generate_with_bf16_says_it_decodes_in_float32_and_does(trained, tagless, translated):
    """fairseq-generate 0.12 converts the model for --fp16 only: with --bf16 (which the
    plugin unties from --tpu) it decodes in float32, and says so, rather than that it
    trains in bfloat16."""
    bf16 = generate_tagless(trained, tagless, *BEAM, "--bf16")
    assert "fairseq 0.12 decodes in float32 with --bf16" in bf16.stdout + bf16.stderr
    assert "training in bfloat16" not in bf16.stdout + bf16.stderr

    def hypotheses(proc):
        return sorted(line for line in proc.stdout.splitlines() if line.startswith(("H-", "P-")))

    assert hypotheses(bf16) == hypotheses(translated) and len(hypotheses(translated)) == 40


def test_resume_continues_from_the_saved_update(trained, tmp_path):
    """fairseq-train on a save dir holding the training's checkpoints continues from its
    last update (10 more)."""
    save = tmp_path / "checkpoints"
    shutil.copytree(trained["save"], save)
    log = tmp_path / "resume.log"
    proc = run(
        [
            "fairseq-train",
            trained["data"],
            *TRAIN_FLAGS,
            "--save-dir",
            save,
            "--log-file",
            log,
            "--max-update",
            str(TRAINED_UPDATES + 10),
        ],
        timeout=600,
    )
    text = proc.stdout + proc.stderr
    loaded = rf"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ {TRAINED_UPDATES} updates\)"
    assert re.search(loaded, text)
    updates = [int(r["train_num_updates"]) for r in records(log, "train")]
    assert updates and min(updates) > TRAINED_UPDATES and max(updates) == TRAINED_UPDATES + 10
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == TRAINED_UPDATES + 10


def test_fine_tuning_starts_afresh_only_the_tag_heads_it_has_no_weights_for(trained, tmp_path):
    """--finetune-from-model onto data whose POS labels are another dictionary, and from a
    checkpoint trained without tags: those tag heads start as initialised and the rest
    is loaded (both were refused: the labels' dictionary, or fairseq's "architectures
    match"); resuming onto the other labels is still refused."""
    relabelled = shutil.copytree(trained["data"], tmp_path / "relabelled")
    labels = relabelled / "dict.pos.txt"
    labels.write_text("".join(reversed(labels.read_text().splitlines(True))))
    checkpoint = trained["save"] / "checkpoint_last.pt"

    def fine_tune(data, source, name, *extra):
        save = tmp_path / name
        done = run(
            ["fairseq-train", data, *TRAIN_FLAGS, "--save-dir", save, "--max-update", "1"]
            + ["--lr", "1e-12", "--finetune-from-model", source, *extra],  # (weights kept)
        )
        weights = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
        return done.stdout + done.stderr, weights["model"]

    def close(a, b):
        return a.shape == b.shape and torch.allclose(a, b, atol=1e-6)

    trained_weights = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    log, weights = fine_tune(relabelled, checkpoint, "on_relabelled")
    assert "its pos tag head is left out and starts as initialised" in log, log[-3000:]
    assert "ner tag head" not in log
    head = "encoder.tag_heads.heads.{}.weight"
    assert not close(weights[head.format("pos")], trained_weights[head.format("pos")])
    assert close(weights[head.format("ner")], trained_weights[head.format("ner")])
    embeddings = "encoder.embed_tokens.weight"
    assert close(weights[embeddings], trained_weights[embeddings])

    fine_tune(trained["data"], checkpoint, "untagged", "--tags", "")
    untagged = tmp_path / "untagged" / "checkpoint_last.pt"
    log, weights = fine_tune(trained["data"], untagged, "tagged_again")
    for kind in ("pos", "ner"):
        assert f"no weights for the {kind} tag head: it starts as initialised" in log
        assert not close(weights[head.format(kind)], trained_weights[head.format(kind)])
    assert close(weights[embeddings], trained_weights[embeddings])

    resumed = run(  # (the run fine-tuned on the other labels, resumed on the first ones)
        ["fairseq-train", trained["data"], *TRAIN_FLAGS, "--save-dir", tmp_path / "on_relabelled"]
        + ["--max-update", "2"],
        check=False,
    )
    last = resumed.stderr.strip().splitlines()[-1]
    assert resumed.returncode != 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert "pos tag dictionary (dict.pos.txt) differs" in last and "Resume with" in last, last
    assert "every row of the tag head would stand for another label" in last, last

    # other words (and other labels): refused, saying how to fine-tune (not how to resume)
    reordered = shutil.copytree(relabelled, tmp_path / "reordered")
    for side in ("src", "tgt"):
        words = reordered / f"dict.{side}.txt"
        words.write_text("".join(reversed(words.read_text().splitlines(True))))
    refused = run(
        ["fairseq-train", reordered, *TRAIN_FLAGS, "--save-dir", tmp_path / "on_reordered"]
        + ["--max-update", "1", "--finetune-from-model", checkpoint],
        check=False,
    )
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "source and target dictionaries (dict.src.txt, dict.tgt.txt) differ" in last, last
    assert "Train from these weights on data binarized with the checkpoint's" in last, last
    assert "tag head is left out" not in refused.stdout + refused.stderr  # (it did not happen)


HYDRA_MODEL = {  # transformer_pp with options of the plugin's own
    "encoder_embed_dim": 32,
    "decoder_embed_dim": 32,
    "encoder_ffn_embed_dim": 64,
    "decoder_ffn_embed_dim": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_conv_heads": 1,
    "encoder_conv_kernel_sizes": "3,7",
    "decoder_conv_heads": 2,
    "encoder_tag_layers": "pos:1,ner:2",
    "dropout": 0.0,
}


def test_fairseq_hydra_train_trains_what_fairseq_train_does_with_the_same_options(
    trained, tmp_path
):
    """fairseq-hydra-train with a YAML configuration builds transformer_pp with its own
    options, as fairseq-train does (fairseq's TransformerConfig kept only its own fields of
    hydra's configuration: the model was built without them and failed), and its
    checkpoint resumes and translates."""
    common = {"cpu": True, "seed": 1}
    dataset = {"max_tokens": 1500, "num_workers": 0}
    cli = ["fairseq-train", trained["data"], "--user-dir", PLUGIN_DIR, "--arch", "transformer_pp"]
    cli += ["--task", "translation_with_tags", "--criterion"]
    cli += ["label_smoothed_cross_entropy_with_tags", "--label-smoothing", "0.1"]
    cli += ["--optimizer", "adam", "--lr", "0.003", "--max-update", "5"]
    cli += ["--save-dir", tmp_path / "cli", "--no-epoch-checkpoints"]
    for name, value in {**common, **dataset, **HYDRA_MODEL}.items():
        option = "--" + name.replace("_", "-")
        cli += [option] if value is True else [option, value]
    run(cli)

    yaml = f"""\
common: {{user_dir: {PLUGIN_DIR}, cpu: true, seed: 1}}
task: {{_name: translation_with_tags, data: {trained["data"]}}}
criterion: {{_name: label_smoothed_cross_entropy_with_tags, label_smoothing: 0.1}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: fixed}}
optimization: {{lr: [0.003], max_update: 5}}
dataset: {{max_tokens: 1500, num_workers: 0}}
checkpoint: {{save_dir: {tmp_path / "hydra"}, no_epoch_checkpoints: true}}
model:
  _name: transformer_pp
"""
    yaml += "".join(f"  {name}: {json.dumps(value)}\n" for name, value in HYDRA_MODEL.items())
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "tiny.yaml").write_text(yaml)
    hydra = ["fairseq-hydra-train", "--config-dir", tmp_path / "config", "--config-name", "tiny"]
    run(hydra, cwd=tmp_path)

    def weights(name):
        path = tmp_path / name / "checkpoint_last.pt"
        return torch.load(path, map_location="cpu", weights_only=True)["model"]

    by_cli, by_hydra = weights("cli"), weights("hydra")
    assert any(".local_conv." in key for key in by_hydra)  # (the plugin's conv heads)
    assert by_hydra.keys() == by_cli.keys()
    assert all(torch.equal(by_hydra[key], by_cli[key]) for key in by_cli)

    resumed = run([*hydra, "optimization.max_update=8"], cwd=tmp_path)
    assert re.search(
        r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 5 updates\)",
        resumed.stdout + resumed.stderr,
    )
    generated = run(
        ["fairseq-generate", trained["data"], "--user-dir", PLUGIN_DIR, "--task", "translation"]
        + ["--path", tmp_path / "hydra" / "checkpoint_last.pt", "--gen-subset", "test", "--cpu"]
        + ["--max-len-a", "0", "--max-len-b", "5"]  # (8 updates: it would run to 200 tokens)
    )
    assert len(hypothesis_lines(generated)) == 20


def torchrun(port: int, *command):
    """Two CPU ranks of a fairseq command, through the project's rank wrapper."""
    return [
        "torchrun",
        "--no-python",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        "tpp-fairseq-rank",
        *command,
    ]


#: fairseq-train's options of the two-process trainings: every epoch's batches grouped from
#: the seed and the epoch, as the recipe trains (docs/training_and_evaluation.md)
DATA_PARALLEL_FLAGS = [
    *TRAIN_FLAGS,
    "--update-epoch-batch-itr",
    "True",
    "--distributed-backend",
    "gloo",
    "--ddp-backend",
    "legacy_ddp",
    "--save-interval-updates",
    "20",
    "--max-tokens-valid",
    "120",  # several valid batches per rank
]


@pytest.fixture(scope="module")
def data_parallel(trained, tmp_path_factory):
    """Two CPU ranks under torchrun training with tags for 40 updates, uninterrupted
    (saved and validated at 20 and 40): ``{"save", "log", "output"}``; nothing writes
    into it."""
    root = tmp_path_factory.mktemp("data_parallel")
    save, log = root / "ddp", root / "ddp.log"
    command = ["fairseq-train", trained["data"], *DATA_PARALLEL_FLAGS, "--save-dir", save]
    proc = run(torchrun(29517, *command, "--log-file", log, "--max-update", "40"), timeout=900)
    return {"save": save, "log": log, "output": proc.stdout + proc.stderr}


def test_two_process_data_parallel_training_with_tags(trained, data_parallel):
    """Two ranks train with tags together, and the validation that closed their run
    equals one process validating the checkpoint."""
    save, log = data_parallel["save"], data_parallel["log"]
    assert "distributed init (rank 1)" in data_parallel["output"]
    inner = records(log, "train_inner")
    assert inner and {"pos_acc", "ner_acc", "pos_loss", "ner_loss"} <= set(inner[-1])
    # The validation that closed the 2-process run (each rank scores half of the valid
    # set, the figures are summed over ranks) must equal one process scoring it all.
    ddp_valid = records(log, "valid")[-1]
    assert int(ddp_valid["valid_num_updates"]) == 40
    one = run(
        [
            "fairseq-validate",
            trained["data"],
            "--user-dir",
            PLUGIN_DIR,
            "--path",
            save / "checkpoint_last.pt",
            "--task",
            "translation_with_tags",
            "--criterion",
            "label_smoothed_cross_entropy_with_tags",
            "--valid-subset",
            "valid",
            "--max-tokens",
            "1500",
            "--cpu",
            "--num-workers",
            "0",
        ]
    )
    lines = [
        line for line in (one.stdout + one.stderr).splitlines() if "valid on 'valid' subset" in line
    ]
    assert lines, one.stderr[-3000:]
    single = dict(re.findall(r"\| (\w+) ([\d.]+)", lines[-1]))
    for key in ("loss", "nll_loss", "pos_acc", "ner_acc", "pos_loss", "ner_loss"):
        assert float(single[key]) == pytest.approx(float(ddp_valid[f"valid_{key}"]), abs=2e-3), key


def test_two_process_training_stopped_and_resumed_ends_as_if_never_stopped(
    trained, data_parallel, tmp_path
):
    """A data-parallel training started again from its checkpoint (a requeued multi-GPU
    job): rank 0 loads it and sends it to rank 1 (fairseq's default, which unpickles it
    under safe loading), and the run ends with the very parameters and optimizer state
    of one that never stopped (every epoch's batches grouped from the seed and the epoch,
    as the recipe trains: docs/training_and_evaluation.md)."""
    common = [trained["data"], *DATA_PARALLEL_FLAGS]
    whole, parts = data_parallel["save"], tmp_path / "parts"  # (40 updates uninterrupted)
    # stopped mid-epoch (an epoch of this data is 2 updates)
    run(torchrun(29522, "fairseq-train", *common, "--save-dir", parts, "--max-update", "19"))
    # on one process (fewer GPUs after a requeue) it goes on after the batches trained:
    # fairseq resumed its rank's position in a share twice as long (half the epoch again)
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(parts / "checkpoint_last.pt", one / "checkpoint_last.pt")
    alone = run(["fairseq-train", *common, "--save-dir", one, "--max-update", "20"])
    state = torch.load(one / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    position = torch.load(parts / "checkpoint_last.pt", map_location="cpu", weights_only=True)[
        "extra_state"
    ]["train_iterator"]
    assert position["num_shards"] == 2 and position["iterations_in_epoch"] > 0, position
    done = 2 * position["iterations_in_epoch"]
    said = f"resuming epoch {position['epoch']} after {done} of its {position['epoch_batches']} batches"
    assert f"{said}, dealt to 1 ranks (2 when saved)" in alone.stdout + alone.stderr
    # the epoch's last batch trained: the next epoch is due (fairseq's own resume had 1 left)
    assert (done, position["epoch_batches"]) == (2, 3), position
    after = state["extra_state"]["train_iterator"]
    assert (after["epoch"], after["iterations_in_epoch"]) == (position["epoch"] + 1, 0), after
    resumed = run(
        torchrun(29523, "fairseq-train", *common, "--save-dir", parts, "--max-update", "40")
    )
    text = resumed.stdout + resumed.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 19 updates\)", text)
    a = torch.load(whole / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    b = torch.load(parts / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert (
        a["optimizer_history"][-1]["num_updates"] == b["optimizer_history"][-1]["num_updates"] == 40
    )
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), "parameters differ"
    moments = [
        (x, y)
        for s, t in zip(
            a["last_optimizer_state"]["state"].values(), b["last_optimizer_state"]["state"].values()
        )
        for x, y in zip(s.values(), t.values())
        if torch.is_tensor(x)
    ]
    assert moments and all(torch.equal(x, y) for x, y in moments), "Adam's moments differ"


def test_the_recipe_trains_data_parallel_under_torchrun_and_resumes(trained, tmp_path):
    """Issue 49.7: scripts/train.sh run by each rank refused rank 1 (rank 0 held the save
    dir's lock). The lock and the checkpoint's repair are the job's, rank 0's: the two
    ranks train together, resume together, and a finished run trains nothing, even when
    rank 0 finds it finished only after repairing its checkpoint."""
    save = tmp_path / "recipe"

    def recipe(port, max_update):
        return torchrun(
            port,
            SCRIPTS / "train.sh",
            "--preset",
            "tiny",
            "--cpu",
            "--data",
            trained["data"],
            "--save-dir",
            save,
            "--max-update",
            max_update,
            "--max-tokens",
            "1500",
            "--update-freq",
            "1",
            "--warmup-updates",
            "10",
            "--save-interval-updates",
            "10",
            "--",
            "--num-workers",
            "0",
            "--disable-validation",
            "--distributed-backend",
            "gloo",
            "--ddp-backend",
            "legacy_ddp",
        )

    first = run(recipe(29531, 10), timeout=900)
    assert "distributed init (rank 1)" in first.stdout + first.stderr
    assert "another training is using the save dir" not in first.stdout + first.stderr
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 10
    resumed = run(recipe(29532, 20), timeout=900)
    text = resumed.stdout + resumed.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 10 updates\)", text)
    stamp = (save / "checkpoint_last.pt").stat().st_mtime_ns
    again = run(recipe(29533, 20), timeout=300)  # rank 1 would wait for rank 0 for ever
    assert "the run is finished" in again.stdout + again.stderr
    assert (save / "checkpoint_last.pt").stat().st_mtime_ns == stamp
    # A torn checkpoint_last.pt whose good copy is finished: rank 0 repairs it and ends;
    # rank 1, which had seen no finished checkpoint, followed it into training and waited
    # at the rendezvous for ever. It follows rank 0's verdict now.
    last = save / "checkpoint_last.pt"
    whole = last.read_bytes()
    (save / "checkpoint_2_20.pt").write_bytes(whole)  # as an interval checkpoint would be
    last.write_bytes(whole[: len(whole) // 2])
    repaired = run(recipe(29535, 20), timeout=300)
    text = repaired.stdout + repaired.stderr
    assert "the run is finished" in text
    assert "distributed init" not in text, "no rank trained"
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 20


def test_the_rank_wrapper_gives_fairseq_the_rank_and_is_refused_outside_torchrun(tmp_path):
    env = {k: v for k, v in tool_env().items() if k not in ("RANK", "WORLD_SIZE")}
    command = ["tpp-fairseq-rank", "fairseq-train", str(tmp_path)]
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert (
        refused.stderr == "tpp-fairseq-rank: error: run this through torchrun (RANK is not set)\n"
    )
    # under torchrun: the command, with fairseq's options for its rank ("--" before it or not)
    env.update(RANK="1", WORLD_SIZE="2")
    for separator in ([], ["--"]):
        command = ["tpp-fairseq-rank", *separator, "echo", "fairseq-train", "DATA", "--cpu"]
        ran = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert ran.stdout.split() == [
            "fairseq-train", "DATA", "--cpu", "--distributed-init-method", "env://",
            "--distributed-world-size", "2", "--distributed-rank", "1", "--distributed-no-spawn",
        ]  # fmt: skip
    # tpp-train takes fairseq's options after its "--": one is added where it is missing
    # (they were taken for tpp-train's own: "unrecognized arguments")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tpp-train").write_text('#!/bin/sh\necho "$@"\n')
    (tmp_path / "bin" / "tpp-train").chmod(0o755)
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    rank = ["--distributed-init-method", "env://", "--distributed-world-size", "2"]
    for given, expected in (
        (["--cpu"], ["--cpu", "--", *rank]),
        (["--cpu", "--", "--seed", "2"], ["--cpu", "--", "--seed", "2", *rank]),
    ):
        command = ["tpp-fairseq-rank", "tpp-train", *given]
        ran = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert ran.stdout.split()[: len(expected)] == expected, ran.stdout


def test_torchrun_without_the_rank_wrapper_is_refused(trained, tmp_path):
    """Issue 49.7: `torchrun fairseq-train` on CPUs ran two independent trainings into
    one save dir (fairseq joins torchrun's processes only when it counts several CUDA
    devices). With the plugin loaded, it is refused, naming the wrapper."""
    save = tmp_path / "alone"
    command = [
        "torchrun",
        "--no-python",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29534",
        "fairseq-train",
        trained["data"],
        *TRAIN_FLAGS,
        "--save-dir",
        save,
        "--max-update",
        "5",
    ]
    refused = run(command, check=False, timeout=600)
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "fairseq-train: error: torchrun started 2 processes, but fairseq did not join" in text
    assert text.count("did not join them into one job") == 2, "each rank says so"
    assert "torchrun --no-python --nproc_per_node 2 tpp-fairseq-rank fairseq-train" in text
    assert not (save / "checkpoint_last.pt").exists(), "nothing trained"


def test_tpp_train_under_torchrun_without_the_rank_wrapper_is_refused(trained, tmp_path):
    """Issue probe: with fairseq's own task (which has no check of its own) the two ranks
    trained alone into one save dir, each writing every checkpoint."""
    save = tmp_path / "alone"
    command = ["torchrun", "--no-python", "--nproc_per_node", "2", "--master_port", "29536"]
    command += ["tpp-train", "--preset", "tiny", "--cpu", "--data", trained["data"]]
    command += ["--save-dir", save, "--task", "translation", "--criterion"]
    command += ["label_smoothed_cross_entropy", "--max-update", "5", "--", "--num-workers", "0"]
    refused = run(command, check=False, timeout=600)
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert text.count("tpp-train: error: torchrun started 2 processes, and fairseq would") == 2
    assert "torchrun --no-python --nproc_per_node 2 tpp-fairseq-rank tpp-train ... --" in text
    assert not list(save.glob("*.pt")), "nothing trained"


def valid_figures(output: str):
    """The figures of fairseq-validate's last "valid on 'valid' subset" line."""
    lines = [line for line in output.splitlines() if "valid on 'valid' subset" in line]
    assert lines, output[-3000:]
    return {k: float(v) for k, v in re.findall(r"\| (\w+) ([\d.]+)", lines[-1])}


def test_last_logged_validation_equals_validating_the_last_checkpoint(trained):
    """fairseq-train validated three times (updates 50, 100, 150). Its last figures
    must be those of the weights it saved: nothing computed from an earlier
    validation's weights may survive the optimizer's in-place updates."""
    valid = records(trained["log"], "valid")
    assert len(valid) >= 2 and int(valid[-1]["valid_num_updates"]) == TRAINED_UPDATES
    again = run(
        [
            "fairseq-validate",
            trained["data"],
            "--user-dir",
            PLUGIN_DIR,
            "--path",
            trained["save"] / "checkpoint_last.pt",
            "--task",
            "translation_with_tags",
            "--criterion",
            "label_smoothed_cross_entropy_with_tags",
            "--label-smoothing",
            "0.1",
            "--valid-subset",
            "valid",
            "--max-tokens",
            "1500",
            "--cpu",
            "--num-workers",
            "0",
        ]
    )
    figures = valid_figures(again.stdout + again.stderr)
    for key in ("loss", "nll_loss", "pos_loss", "ner_loss", "pos_acc", "ner_acc"):
        assert figures[key] == pytest.approx(float(valid[-1][f"valid_{key}"]), abs=2e-3), key


@pytest.mark.parametrize(
    "command",
    [["fairseq-train"], [sys.executable, "-m", "fairseq_cli.train"]],
    ids=["console-script", "python-m"],
)
def test_bf16_training_runs_on_a_machine_without_xla(command, trained, tmp_path):
    """fairseq 0.12 ties --bf16 to --tpu; the plugin unties them where torch_xla is
    absent, so --bf16 trains here on the CPU (and on GPUs), also when fairseq's training
    module is run as ``__main__`` (``python -m fairseq_cli.train``, as the GPU suite runs it:
    there the untying is what is checked, in fewer updates; the console script learns in
    20)."""
    learns = command == ["fairseq-train"]
    log = tmp_path / "bf16.log"
    proc = run(
        [
            *command,
            trained["data"],
            *TRAIN_FLAGS,
            "--bf16",
            "--save-dir",
            tmp_path / "ck",
            "--log-file",
            log,
            "--max-update",
            "20" if learns else "10",
            "--log-interval",
            "4" if learns else "2",
            "--disable-validation",
        ],
        timeout=600,
    )
    assert "--bf16 without torch_xla: training in bfloat16 on the CPU" in proc.stdout + proc.stderr
    inner = records(log, "train_inner")
    losses = [float(r["loss"]) for r in inner]
    assert len(losses) >= 5 and all(math.isfinite(x) for x in losses)
    if learns:
        assert losses[-1] < 0.8 * losses[0], losses
    state = torch.load(
        tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True
    )
    assert state["cfg"]["common"]["bf16"] and not state["cfg"]["common"]["tpu"]


def _optimizer_tensors(checkpoint: Path):
    """How many tensors the optimizer state of a checkpoint keeps (1: flat)."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return len(state["last_optimizer_state"]["param_groups"][0]["params"])


#: fairseq-train with --bf16's flat master copy taken on the CPU too (on a GPU it is the default)
TRAIN_FLAT_ON_THE_CPU = (
    "import sys; from tpp_fairseq import speed; "
    "speed.FLAT_BF16_DEVICE_TYPES = frozenset({'cuda', 'cpu'}); "
    "from fairseq_cli.train import cli_main; sys.argv[0] = 'fairseq-train'; cli_main()"
)


def test_bf16_flat_master_copy_trains_alike_and_resumes_checkpoints_of_either_layout(
    trained, tmp_path
):
    """--bf16's float32 master copy as one flat tensor (as fairseq's --fp16 keeps it; the
    plugin's default on a GPU) gives the same losses, step for step, as one tensor per
    parameter (fairseq's --bf16, and the default on the CPU); its checkpoints hold the
    state per parameter, as fairseq's --bf16 writes it; a per-parameter checkpoint resumes
    flat (the optimizer state converted) and the flat run's per parameter, each
    continuing as the uninterrupted run does."""
    flags = [
        *TRAIN_FLAGS,
        "--bf16",
        "--max-update",
        "20",
        "--log-interval",
        "5",
        "--disable-validation",
        "--save-interval-updates",
        "10",
        "--keep-interval-updates",
        "-1",
    ]

    def train(name, flat, restore=None):
        save = tmp_path / name
        if restore is not None:  # the checkpoint of update 10 of an earlier run
            (restore,) = restore.glob("checkpoint_*_10.pt")
            save.mkdir()
            shutil.copy(restore, save / "checkpoint_last.pt")
        log = tmp_path / f"{name}.log"
        command = [sys.executable, "-c", TRAIN_FLAT_ON_THE_CPU] if flat else ["fairseq-train"]
        proc = run(
            [*command, trained["data"], *flags, "--save-dir", save, "--log-file", log], timeout=600
        )
        losses = {int(r["num_updates"]): float(r["loss"]) for r in records(log, "train_inner")}
        return proc.stdout + proc.stderr, save, losses

    out, flat, flat_losses = train("flat", flat=True)
    assert "the float32 master copy of" in out and "kept as one flat tensor" in out
    out, split, split_losses = train("split", flat=False)
    assert "kept as one flat tensor" not in out
    n_tensors = _optimizer_tensors(split / "checkpoint_last.pt")
    assert n_tensors > 50
    # the flat copy's checkpoint holds the state as fairseq writes --bf16's
    assert _optimizer_tensors(flat / "checkpoint_last.pt") == n_tensors
    assert sorted(flat_losses) == [5, 10, 15, 20]
    # element-wise the same Adam on the same float32 values (no clipping): equal losses
    assert flat_losses == pytest.approx(split_losses, rel=1e-6, abs=1e-6)

    # per-parameter checkpoint -> flat run (a CPU run resumed on a GPU), and the other way round
    out, save, resumed = train("split_to_flat", flat=True, restore=split)
    assert "converted (one per parameter -> flat" in out
    assert sorted(resumed) == [15, 20] and resumed == pytest.approx(
        {u: split_losses[u] for u in (15, 20)}, abs=2e-3
    )
    assert _optimizer_tensors(save / "checkpoint_last.pt") == n_tensors
    out, save, resumed = train("flat_to_split", flat=False, restore=flat)
    assert "converted" not in out  # nothing to convert
    assert sorted(resumed) == [15, 20] and resumed == pytest.approx(
        {u: flat_losses[u] for u in (15, 20)}, abs=2e-3
    )
    assert _optimizer_tensors(save / "checkpoint_last.pt") == n_tensors


def test_fp16_without_cuda_keeps_fairseqs_own_error(trained, tmp_path):
    proc = subprocess.run(
        [
            str(a)
            for a in [
                "fairseq-train",
                trained["data"],
                *TRAIN_FLAGS,
                "--fp16",
                "--save-dir",
                tmp_path / "ck",
                "--max-update",
                "2",
            ]
        ],
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    # torch's own words: a CPU build's, or a CUDA build's on a machine without a GPU
    assert (
        "Torch not compiled with CUDA enabled" in proc.stderr
        or "Found no NVIDIA driver on your system" in proc.stderr
    ), proc.stderr[-2000:]


OLD = REPO / "tests" / "data" / "checkpoint_v0.1.0"


def test_checkpoint_written_by_version_0_1_generates_the_same(tmp_path):
    """Before version 0.2 each input projection of the hybrid attention was its own
    parameter; such checkpoints load into the fused projection and translate as
    they did (the hypotheses were recorded with version 0.1.0)."""
    gen = run(
        [
            "fairseq-generate",
            OLD,
            "--user-dir",
            PLUGIN_DIR,
            "--path",
            OLD / "checkpoint.pt",
            "--task",
            "translation",
            "--beam",
            "5",
            "--cpu",
            "--num-workers",
            "0",
            "--batch-size",
            "8",
        ]
    )
    got = sorted(
        (line.split("\t") for line in gen.stdout.splitlines() if line.startswith("H-")),
        key=lambda f: int(f[0][2:]),
    )
    expected = [
        line.split("\t") for line in (OLD / "expected_hypotheses.txt").read_text().splitlines()
    ]
    assert len(got) == len(expected) == 20
    for (gid, gscore, ghyp), (eid, escore, ehyp) in zip(got, expected):
        assert (gid, ghyp) == (eid, ehyp)
        assert float(gscore) == pytest.approx(float(escore), abs=1e-4)


def test_triton_conv_heads_train_and_translate_as_the_pytorch_ones(trained, tmp_path):
    """--conv-heads-impl triton through fairseq's own commands (here the kernels run in
    Triton's interpreter, TRITON_INTERPRET=1 from conftest.py; on a GPU compiled): the
    same losses as the PyTorch operations, and the checkpoint translates as the same
    checkpoint with them (the option is no parameter: --model-overrides switches it)."""
    pytest.importorskip("triton")

    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"  # else the CPU runs the PyTorch operations
    data = trained["data"]
    losses = {}
    for impl in ("taps", "triton"):
        log = tmp_path / f"{impl}.log"
        run(
            [
                "fairseq-train",
                data,
                *TRAIN_FLAGS,
                "--conv-heads-impl",
                impl,
                "--save-dir",
                tmp_path / impl,
                "--log-file",
                log,
                "--max-update",
                "2",
                "--log-interval",
                "1",
                "--max-tokens",
                "300",
                "--disable-validation",
            ],
            timeout=600,
        )
        losses[impl] = {
            int(r["num_updates"]): float(r["loss"]) for r in records(log, "train_inner")
        }
    assert sorted(losses["taps"]) == [1, 2]
    assert losses["triton"].keys() == losses["taps"].keys()
    for update, loss in losses["taps"].items():
        assert losses["triton"][update] == pytest.approx(loss, rel=1e-4), update
    state = torch.load(
        tmp_path / "triton" / "checkpoint_last.pt", map_location="cpu", weights_only=True
    )
    assert state["cfg"]["model"].conv_heads_impl == "triton"

    def hypotheses(*extra):
        """{sentence id: (score, tokens)} of fairseq-generate's H- lines."""
        gen = run(
            [
                "fairseq-generate",
                data,
                "--user-dir",
                PLUGIN_DIR,
                "--path",
                tmp_path / "triton" / "checkpoint_last.pt",
                "--gen-subset",
                "test",
                "--beam",
                "2",
                "--batch-size",
                "20",
                "--max-len-a",
                "0",
                "--max-len-b",
                "6",
                "--cpu",
                *extra,
            ]
        )
        lines = [line.split("\t") for line in gen.stdout.splitlines() if line.startswith("H-")]
        return {key: (float(score), tokens) for key, score, tokens in lines}

    fused = hypotheses()
    plain = hypotheses("--model-overrides", "{'conv_heads_impl': 'taps'}")
    assert len(fused) == 20 and fused.keys() == plain.keys()
    for key, (score, tokens) in plain.items():
        assert fused[key][1] == tokens and fused[key][0] == pytest.approx(score, abs=1e-5), key
