"""tpp-plot-attention and tpp-embedding-similarity on a tiny Transformer++
trained here for a few updates (fairseq-train --arch transformer_pp_tiny --task translation).
"""

import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageStat

from support import PLUGIN_DIR, SAMPLE, VENV_BIN as BIN, head
from tpp_tools import analysis_model, embedding_similarity, plot_attention

SENTENCE = "There is a fire in the mountain ."


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint, data-bin folder) of a transformer_pp_tiny trained for 3 updates."""
    work = tmp_path_factory.mktemp("tpp_tiny")
    # 150 sample pairs plus the paper's sentence, so "fire" and "mountain" are known words
    extra = {"en": "There is a fire in the mountain .\n", "de": "Es brennt auf dem Berg .\n"}
    for lang in ("en", "de"):
        train = head(SAMPLE / f"train.{lang}", work / f"train.{lang}", 150)
        train.write_text(train.read_text(encoding="utf-8") + extra[lang], encoding="utf-8")
        head(SAMPLE / f"valid.{lang}", work / f"valid.{lang}", 20)
    subprocess.run(
        [
            str(BIN / "fairseq-preprocess"),
            "--source-lang",
            "en",
            "--target-lang",
            "de",
            "--trainpref",
            str(work / "train"),
            "--validpref",
            str(work / "valid"),
            "--destdir",
            str(work / "bin"),
            "--joined-dictionary",
            "--workers",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            str(BIN / "fairseq-train"),
            str(work / "bin"),
            "--user-dir",
            str(PLUGIN_DIR),
            "--arch",
            "transformer_pp_tiny",
            "--task",
            "translation",
            "--criterion",
            "label_smoothed_cross_entropy",
            "--label-smoothing",
            "0.1",
            "--optimizer",
            "adam",
            "--lr",
            "0.001",
            "--max-tokens",
            "500",
            "--max-update",
            "3",
            "--save-dir",
            str(work / "ckpt"),
            "--no-epoch-checkpoints",
            "--cpu",
            "--seed",
            "1",
            "--num-workers",
            "0",
        ],
        check=True,
        capture_output=True,
    )
    checkpoint = work / "ckpt" / "checkpoint_last.pt"
    assert checkpoint.is_file()
    return checkpoint, work / "bin"


def assert_real_png(path: Path, size) -> None:
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size == size, (path, img.size)
        rgb = img.convert("RGB")
        assert len(rgb.getcolors(maxcolors=1 << 20)) > 20, path  # not a blank canvas
        assert max(ImageStat.Stat(rgb).stddev) > 10, path


# --------------------------------------------------------------------------------------
# tpp-plot-attention
# --------------------------------------------------------------------------------------


def test_plot_attention_writes_one_png_per_layer_and_kind(trained, tmp_path, capsys):
    checkpoint, data = trained
    out = tmp_path / "att"
    rc = plot_attention.main(
        [
            "--path",
            str(checkpoint),
            "--data",
            str(data),
            "--sentence",
            SENTENCE,
            "--out-dir",
            str(out),
            "--beam",
            "2",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "source:      There is a fire in the mountain . </s>" in printed
    assert "translation:" in printed
    expected = {
        f"{kind}_layer{i}.png"
        for kind in ("encoder_self", "decoder_self", "decoder_cross")
        for i in (1, 2)
    }
    assert {p.name for p in out.iterdir()} == expected
    for name in expected:
        # transformer_pp_tiny: 4 heads per attention -> one row of four 400 px cells
        assert_real_png(out / name, (1600, 400))


def test_captured_maps_have_the_right_shapes_and_are_attention(trained):
    checkpoint, data = trained
    loaded = analysis_model.load_model(checkpoint, data)
    src, _ = analysis_model.encode(loaded, SENTENCE)
    tgt_dict = loaded.task.target_dictionary
    target = tgt_dict.encode_line("Es brennt auf dem Berg .", add_if_not_exist=False).long()
    prev = torch.cat([target.new_tensor([tgt_dict.eos()]), target[:-1]]).unsqueeze(0)
    maps = plot_attention.capture_maps(loaded.model, src, prev)
    S, T = src.size(1), prev.size(1)
    assert len(maps) == 6
    for layer in (1, 2):
        enc, dec, cross = (
            maps[k, layer] for k in ("encoder_self", "decoder_self", "decoder_cross")
        )
        assert enc.shape == (4, S, S) and dec.shape == (4, T, T) and cross.shape == (4, T, S)
        for m in (enc, dec, cross):  # every head's row is a distribution over positions
            assert torch.allclose(m.sum(-1), torch.ones(m.shape[:2]), atol=1e-4)
        # decoder self-attention is causal, for dot-product and conv heads alike
        future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        assert dec[:, future].abs().max() < 1e-6
        # encoder conv heads pool one summary of the whole sentence: equal rows
        assert torch.allclose(enc[2:], enc[2:, :1].expand_as(enc[2:]), atol=1e-6)
        # the hooks are removed afterwards: the layers run as before
    assert all(
        not m._forward_hooks and not m._forward_pre_hooks
        for _, _, m in plot_attention.attention_modules(loaded.model)
    )


def test_plot_attention_refuses_to_overwrite_without_force(trained, tmp_path, capsys, monkeypatch):
    checkpoint, data = trained
    out = tmp_path / "att"
    out.mkdir()
    (out / "encoder_self_layer1.png").write_bytes(b"keep me")
    base = [
        "--path",
        str(checkpoint),
        "--data",
        str(data),
        "--sentence",
        SENTENCE,
        "--out-dir",
        str(out),
        "--target",
        "Es brennt auf dem Berg .",
    ]
    (out / "decoder_cross_layer6.png").write_bytes(b"a deeper model's")
    (out / "decoder_cross_layer1_old.png").write_bytes(b"not a map of this tool's")
    assert plot_attention.main(base) == 1
    assert "encoder_self_layer1.png exists; pass --force to overwrite" in capsys.readouterr().err
    assert (out / "encoder_self_layer1.png").read_bytes() == b"keep me"
    assert plot_attention.main(base + ["--force"]) == 0
    assert_real_png(out / "encoder_self_layer1.png", (1600, 400))
    # the maps of layers this model lacks go with --force; other files stay
    assert not (out / "decoder_cross_layer6.png").exists()
    assert (out / "decoder_cross_layer1_old.png").exists()

    # a run stopped part-way leaves the earlier maps whole, and nothing else behind
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    draw_grid = plot_attention.draw_grid

    def stopped_after_one(*args):
        draw_grid(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(plot_attention, "draw_grid", stopped_after_one)
    with pytest.raises(KeyboardInterrupt):
        plot_attention.main(
            [a if a != SENTENCE else "The fire is old ." for a in base] + ["--force"]
        )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "nope.pt: no such file (--path)"),
        ("empty", "empty.pt: empty file (0 bytes), not a checkpoint (--path)"),
        ("garbage", "garbage.pt: a text file, not a checkpoint (first line: 'this is not"),
        ("no-data", "error: data folder not found"),
        ("no-split", "no binarized split (*.idx) in"),
        ("blank-sentence", "error: the sentence is empty"),
        ("codes-not-text", "codes.bin: not UTF-8"),
        ("codes-not-codes", "not BPE codes that subword-nmt can read (--bpe-codes)"),
        ("out-dir-a-file", "att: not a folder (--out-dir)"),
        ("too-long", "subwords long with its end of sentence, and the model reads at most 1024"),
        ("target-too-long", "--target is 1201 subwords long with its end of sentence, and the"),
        ("target-unknown", "no token of --target 'qqqq zzzz' is in the target dictionary"),
    ],
)
def test_plot_attention_errors(trained, tmp_path, case, message):
    checkpoint, data = trained
    sentence = SENTENCE
    if case == "missing":
        checkpoint = tmp_path / "nope.pt"
    elif case == "empty":
        checkpoint = tmp_path / "empty.pt"
        checkpoint.write_bytes(b"")
    elif case == "garbage":
        checkpoint = tmp_path / "garbage.pt"
        checkpoint.write_bytes(b"this is not a checkpoint")
    elif case == "no-data":
        data = tmp_path / "no-such-data-bin"
    elif case == "no-split":
        data = tmp_path / "dictionaries-only"
        data.mkdir()
        for path in trained[1].glob("dict.*.txt"):
            (data / path.name).write_bytes(path.read_bytes())
    elif case == "blank-sentence":
        sentence = "   "
    elif case == "too-long":
        sentence = " ".join([SENTENCE] * 150)
    extra = []
    if case.startswith("codes"):
        codes = tmp_path / ("codes.bin" if case == "codes-not-text" else "codes.txt")
        codes.write_bytes(b"\x80\x81 x\n" if case == "codes-not-text" else b"a b c d\n")
        extra = ["--bpe-codes", str(codes)]
    elif case == "out-dir-a-file":
        (tmp_path / "att").write_text("not a folder")
    elif case == "target-too-long":
        extra = ["--target", " ".join(["Berg"] * 1200)]
    elif case == "target-unknown":
        extra = ["--target", "qqqq zzzz"]
    # through the command line: exit status and message as a user sees them
    run = subprocess.run(
        [
            "tpp-plot-attention",
            "--path",
            str(checkpoint),
            "--data",
            str(data),
            "--sentence",
            sentence,
            "--out-dir",
            str(tmp_path / "att"),
            *extra,
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1, run.stderr
    assert message in run.stderr and "tpp-plot-attention: error: " in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert case == "out-dir-a-file" or not (tmp_path / "att").exists()


def test_plot_attention_draws_the_heads_of_fairseqs_own_attention(trained):
    """Layers without conv heads attend through fairseq's own attention, which answers
    self-attention through PyTorch's, averaged over the heads: every head is drawn, and
    the attention is left as it was."""
    import copy

    checkpoint, data = trained
    loaded = analysis_model.load_model(checkpoint, data)
    cfg = copy.deepcopy(loaded.cfg.model)
    cfg.encoder_conv_heads = cfg.decoder_conv_heads = 0
    model = loaded.task.build_model(cfg).eval()
    modules = plot_attention.attention_modules(model)
    assert {type(m).__name__ for _, _, m in modules} == {"MultiheadAttention"}
    src, _ = analysis_model.encode(loaded, SENTENCE)
    maps = plot_attention.capture_maps(model, src, src[:, :5])
    assert len(maps) == 6 and {m.size(0) for m in maps.values()} == {4}
    for m in maps.values():
        assert torch.allclose(m.sum(-1), torch.ones(m.shape[:2]), atol=1e-4)
    assert not any(m.skip_embed_dim_check for _, _, m in modules)


def test_plot_attention_refuses_a_beam_of_zero(trained, tmp_path):
    checkpoint, data = trained
    run = subprocess.run(
        ["tpp-plot-attention", "--path", checkpoint, "--data", data, "--sentence", SENTENCE]
        + ["--out-dir", tmp_path / "att", "--beam", "0"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "--beam: must be at least 1, not 0" in run.stderr, run.stderr
    assert not (tmp_path / "att").exists()


# --------------------------------------------------------------------------------------
# tpp-embedding-similarity
# --------------------------------------------------------------------------------------


def parse_table(printed: str) -> list:
    rows = []
    for line in printed.splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[0].isdigit():
            rows.append(
                [int(parts[0]), int(parts[1]), int(parts[2])] + [float(p) for p in parts[3:]]
            )
    return rows


def test_embedding_similarity_table(trained, capsys):
    checkpoint, data = trained
    rc = embedding_similarity.main(["--path", str(checkpoint), "--data", str(data)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "'fire' and 'mountain'" in printed
    rows = parse_table(printed)
    # transformer_pp_tiny: two encoder layers, the paper's first two kernel widths
    assert [r[:3] for r in rows] == [[1, 3, 1], [2, 5, 1]]
    for row in rows:
        assert all(-1.0 <= v <= 1.0 for v in row[3:])

    # the numbers agree with what the model computes in an ordinary forward pass
    loaded = analysis_model.load_model(checkpoint, data)
    src, tokens = analysis_model.encode(loaded, SENTENCE)
    fire, mountain = tokens.index("fire"), tokens.index("mountain")
    local_outputs = []
    # LocalConv applied to what each self-attention receives in the forward pass
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs: local_outputs.append(
                m.local_conv(F.linear(kwargs["query"], *m.projection("local")))[:, 0]
            ),
            with_kwargs=True,
        )
        for layer in loaded.model.encoder.layers
    ]
    with torch.no_grad():
        enc = loaded.model.encoder(
            src, src_lengths=torch.tensor([src.size(1)]), return_all_hiddens=True
        )
    for h in hooks:
        h.remove()
    for i, row in enumerate(rows):
        state = enc["encoder_states"][i + 1][:, 0]  # states[0] is the embedding output
        expected_out = F.cosine_similarity(state[fire], state[mountain], dim=0).item()
        expected_local = F.cosine_similarity(
            local_outputs[i][fire], local_outputs[i][mountain], dim=0
        ).item()
        assert row[5] == pytest.approx(expected_out, abs=1e-4)
        assert row[4] == pytest.approx(expected_local, abs=1e-4)


def test_embedding_similarity_errors(trained, tmp_path, capsys):
    checkpoint, data = trained
    assert (
        embedding_similarity.main(
            ["--path", str(checkpoint), "--data", str(data), "--words", "fire", "volcano"]
        )
        == 1
    )
    assert "'volcano' is not in the prepared sentence" in capsys.readouterr().err
    same = ["--path", str(checkpoint), "--data", str(data), "--words", "fire", "Fire"]
    assert embedding_similarity.main(same) == 1
    assert "--words names 'fire' twice" in capsys.readouterr().err
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert embedding_similarity.main(["--path", str(empty), "--data", str(data)]) == 1
    assert "empty.pt: empty file (0 bytes), not a checkpoint" in capsys.readouterr().err
    assert (
        embedding_similarity.main(["--path", str(tmp_path / "nope.pt"), "--data", str(data)]) == 1
    )
    assert "nope.pt: no such file (--path)" in capsys.readouterr().err


def test_word_spans_joins_bpe_pieces():
    tokens = "There is a fi@@ re in the moun@@ ta@@ in . </s>".split()
    spans = dict(analysis_model.word_spans(tokens))
    assert spans["fire"] == [3, 4]
    assert spans["mountain"] == [7, 8, 9]
    assert "</s>" not in spans


def test_prepare_sentence_tokenises_and_applies_bpe(tmp_path):
    codes = tmp_path / "codes"
    # subword-nmt codes: merge "f i" then "fi r" then "fir e</w>"
    codes.write_text("#version: 0.2\nf i\nfi r\nm o\n", encoding="utf-8")
    prepared = analysis_model.prepare_sentence(
        "There is a fire, on a mountain.", "en", bpe_codes=codes
    )
    assert prepared.split()[-1] == "."  # Moses split the final full stop off
    assert "fir@@ e ," in prepared and "mo@@" in prepared
    with pytest.raises(analysis_model.AnalysisError, match="BPE codes not found"):
        analysis_model.prepare_sentence("a b c", "en", bpe_codes=tmp_path / "missing")
