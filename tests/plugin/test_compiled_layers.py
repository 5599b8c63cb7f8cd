"""Compiled layers (tpp_fairseq.compiled, ``TPP_FAIRSEQ_SPEEDUPS=compiled-layers``): the
plugin's shape-agnostic forms equal its eager ones; every layer compiles without a graph
break; over 50 batches of varied shapes a 6+6 model compiles one graph per side (two in
the decoder, whose last layer also returns its attention for fairseq's alignment) and
all of them in the first batch; Inductor's layers are as close to float64 as eager ones;
and fairseq-train compiles them when asked."""

import argparse
import copy
import json
import pickle
import random

import pytest
import torch
from support import PLUGIN_DIR, FakeTask, build_model, make_dictionary, run

import tpp_fairseq.compiled as compiled
from tpp_plugin.modules.context_query import (
    BLOCK,
    PooledQuery,
    pooled_query_traced,
    prefix_softmax,
    prefix_softmax_padded,
)
from tpp_plugin.modules.local_conv import DilatedDepthwiseConv, LocalConv, shifted_taps

NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


@pytest.fixture(autouse=True)
def compile_settings_restored(monkeypatch):
    """What compile_layers sets process-wide is set back after each test."""
    from fairseq.incremental_decoding_utils import FairseqIncrementalState

    monkeypatch.setattr(
        FairseqIncrementalState,
        "get_incremental_state",
        FairseqIncrementalState.get_incremental_state,
    )
    with torch._dynamo.config.patch(), torch.fx.experimental._config.patch():
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def model(arch, layers=None, **overrides):
    """A model of ``arch`` (fairseq's transformer presets or the plugin's), no dropout
    (but what ``overrides`` asks for)."""
    options = dict(NO_DROPOUT, **overrides)
    if layers:
        options.update(encoder_layers=layers, decoder_layers=layers)
    if arch.startswith("transformer_pp"):
        return build_model(arch, **dict(dict(conv_weight_dropout=0.0), **options))
    from fairseq.models import ARCH_CONFIG_REGISTRY
    from fairseq.models.transformer import TransformerModel

    args = argparse.Namespace(**options)
    ARCH_CONFIG_REGISTRY[arch](args)
    return TransformerModel.build_model(args, FakeTask(make_dictionary()))


def batch(vocab, bsz, src_len, tgt_len, generator, pad=1):
    """Source padded on the left, targets on the right, as fairseq pads them."""
    src = torch.randint(4, vocab, (bsz, src_len), generator=generator)
    prev = torch.randint(4, vocab, (bsz, tgt_len), generator=generator)
    src[0, : src_len // 2] = pad
    prev[-1, tgt_len - tgt_len // 3 :] = pad
    return src, torch.full((bsz,), src_len), prev


# --------------------------------------------------------------------------- the forms


@pytest.mark.parametrize("length", [2, 5, 63, 64, 65, 130, 300])
@pytest.mark.parametrize("width, dilation, centered", [(3, 1, False), (15, 2, False), (7, 2, True)])
def test_the_window_convolution_equals_the_taps(length, width, dilation, centered):
    """LocalConv's kernel spread over the common window, by shifted slices, against the
    taps (float64, values and gradients)."""
    torch.manual_seed(length)
    conv = LocalConv(8, width, dilation, centered=centered).double()
    u = torch.randn(length, 3, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(length, 3, 8, dtype=torch.float64)
    expected = DilatedDepthwiseConv.apply(u, conv.kernel(), dilation, length, conv.lookahead)
    (du,) = torch.autograd.grad(expected, u, grad)
    with conv.compiled_forward():
        got = shifted_taps(u, conv.built_kernel, 1, conv.window[1])
    (dv,) = torch.autograd.grad(got, u, grad)
    assert conv.built_kernel is None
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-13)
    torch.testing.assert_close(dv, du, rtol=0, atol=1e-13)


@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 200, 64 * 62 - 1])
def test_the_padded_prefix_softmax_equals_the_blocked_one(length):
    torch.manual_seed(length)
    scores = torch.randn(2, 3, length, dtype=torch.float64) * 4
    values = torch.randn(2, 3, length, 5, dtype=torch.float64)
    for got, expected in zip(prefix_softmax_padded(scores, values), prefix_softmax(scores, values)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [3, 70])
def test_the_traced_query_equals_pooled_query_and_its_gradients(causal, length):
    torch.manual_seed(length)
    scores = torch.randn(length, 4, 2, dtype=torch.float64, requires_grad=True)
    values = torch.randn(length, 4, 2 * 6, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        scores[:2, 0] = -1e9  # padding at the start of one sentence
    expected = PooledQuery.apply(scores, values, 2, causal, BLOCK)
    got = pooled_query_traced(scores, values, 2, causal)
    grad = torch.randn_like(expected)
    if causal:  # the rows that pool padding only are never used (PooledQuery's contract)
        grad[:2, 0] = 0
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    for a, b in zip(
        torch.autograd.grad(got, (scores, values), grad),
        torch.autograd.grad(expected, (scores, values), grad),
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- graphs


@pytest.mark.parametrize("arch", ["transformer_pp_tiny", "transformer_tiny"])
def test_no_layer_has_a_graph_break(arch):
    m = model(arch, layers=6).train()
    x = torch.randn(12, 4, m.encoder.embed_tokens.embedding_dim)
    padding = torch.zeros(4, 12, dtype=torch.bool)
    padding[0, :3] = True
    for layer in m.encoder.layers:
        explained = torch._dynamo.explain(layer)(x, padding)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    future = torch.triu(torch.full((12, 12), float("-inf")), 1)  # fairseq's future mask
    for layer in m.decoder.layers:
        explained = torch._dynamo.explain(layer)(
            x, x, padding, None, self_attn_mask=future, self_attn_padding_mask=padding
        )
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)


@pytest.mark.parametrize("arch", ["transformer_pp_tiny", "transformer_tiny"])
def test_fifty_batches_of_varied_shapes_compile_three_graphs_in_the_first(arch):
    """6+6 layers (the plugin's five kernel widths): one graph for the encoder, two for
    the decoder; lengths across the prefix softmax's block (64), single sentences and
    positions (eager), batches with and without padding."""
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    m = model(arch, layers=6).train()
    assert compiled.compile_layers(m, backend=counting) == 12
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    vocab = len(m.encoder.dictionary)
    after = []
    for step in range(50):
        bsz = rng.choice([1, 2, 7, 40])
        src, lengths, prev = batch(
            vocab, bsz, rng.randint(1, 90), rng.randint(1, 90), generator, pad=1 if step % 3 else 0
        )
        m.zero_grad(set_to_none=True)  # as fairseq's optimizers leave the gradients
        m(src, lengths, prev)[0].sum().backward()
        after.append(len(graphs))
    assert after[0] == after[-1] == 3, after


def test_the_fused_conv_heads_are_operators_of_the_graphs():
    """``--conv-heads-impl fused``: each hybrid layer's graph calls the fused kernels as an
    operator (no graph break); 2+2 layers of other kernel widths and dilations compile
    three graphs in their first batch and none after (four batches of other shapes, with
    and without padding); outputs and gradients those of the eager model, DropConnect's
    masks drawn from the same seed. On a CUDA GPU
    where there is one, else through Triton's interpreter (tests/conftest.py sets it)."""
    pytest.importorskip("triton", reason="Triton is installed with the test requirements on Linux")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    widths = dict(encoder_conv_kernel_sizes="3,7", encoder_conv_dilations="1,2")
    widths.update(decoder_conv_kernel_sizes="7,3", decoder_conv_dilations="2,1")
    widths.update(conv_weight_dropout=0.3)
    m = model("transformer_pp_tiny", layers=2, conv_heads_impl="fused", **widths)
    m = m.to(device).train()
    eager = copy.deepcopy(m)
    x = torch.randn(12, 4, m.encoder.embed_tokens.embedding_dim, device=device)
    padding = torch.zeros(4, 12, dtype=torch.bool, device=device)
    padding[0, :3] = True
    explained = torch._dynamo.explain(m.encoder.layers[0])(x, padding)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    called = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert "tpp.conv_heads_forward.default" in called, called
    torch._dynamo.reset()
    assert compiled.compile_layers(m, backend=counting) == 4
    generator = torch.Generator().manual_seed(0)
    vocab = len(m.encoder.dictionary)
    after = []
    for step, (bsz, src_len, tgt_len) in enumerate(
        [(4, 9, 11), (2, 30, 7), (3, 5, 40), (2, 70, 66)]
    ):
        inputs = batch(vocab, bsz, src_len, tgt_len, generator, pad=1 if step % 3 else 0)
        inputs = [t.to(device) for t in inputs]
        results = []
        for each in (m, eager):
            each.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = each(*inputs)[0]
            out.pow(2).sum().backward()
            results.append((out, [p.grad for p in each.parameters()]))
        (out, grads), (want, want_grads) = results
        torch.testing.assert_close(out, want)
        for g, want_g in zip(grads, want_grads):
            torch.testing.assert_close(g, want_g)
        after.append(len(graphs))
    assert after[0] == after[-1] == 3, after


def test_a_copy_of_a_compiled_model_computes_with_its_own_parameters():
    """fairseq's --ema copies the model: the copy's compiled layers are its own."""
    m = model("transformer_pp_tiny").train()
    compiled.compile_layers(m, backend="eager")
    twin = copy.deepcopy(m)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    inputs = batch(len(m.encoder.dictionary), 4, 9, 11, torch.Generator().manual_seed(0))
    eager = copy.deepcopy(twin)
    for layer in [*eager.encoder.layers, *eager.decoder.layers]:
        layer.forward = layer.forward.eager
    torch.testing.assert_close(twin(*inputs)[0], eager(*inputs)[0])
    assert not torch.allclose(twin(*inputs)[0], m(*inputs)[0])


def test_a_pickled_compiled_model_compiles_its_layers_again_where_loaded():
    """torch.save of a whole model pickles it: each layer's compiled forward is pickled
    as its layer and compiled again when loaded."""
    m = model("transformer_pp_tiny").eval()
    compiled.compile_layers(m, backend="eager")
    loaded = pickle.loads(pickle.dumps(m))
    layers = [*loaded.encoder.layers, *loaded.decoder.layers]
    assert all(isinstance(layer.__dict__["forward"], compiled.CompiledForward) for layer in layers)
    assert all(layer.forward.eager.__self__ is layer for layer in layers)
    inputs = batch(len(m.encoder.dictionary), 4, 9, 11, torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(*inputs)[0], m(*inputs)[0])


@pytest.mark.parametrize("arch", ["transformer_pp_tiny", "transformer_tiny"])
def test_layers_under_activation_checkpointing_stay_eager(arch):
    """--checkpoint-activations: fairseq's wrapper runs a layer's forward again in the
    backward pass, and its forward is no method of the layer; such layers stay eager, and
    the model computes what it computes without the speed-up."""
    m = model(arch, checkpoint_activations=True).train()
    reference = copy.deepcopy(m)
    assert compiled.compile_layers(m, backend="eager") == 0
    inputs = batch(len(m.encoder.dictionary), 4, 9, 11, torch.Generator().manual_seed(0))
    for each in (m, reference):
        each(*inputs)[0].pow(2).sum().backward()
    torch.testing.assert_close(m(*inputs)[0], reference(*inputs)[0])
    for (name, p), q in zip(m.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_layer_whose_forward_takes_other_arguments_stays_eager(caplog, monkeypatch):
    """fairseq's AugTransformerDecoderLayerBase takes a second encoder output after the
    first: its positional arguments, named as a decoder layer's, handed a tensor to
    ``incremental_state``; a layer with one argument more lost it. Both stay eager, named
    in the log, and compute as before; a decoder layer of fairseq's own arguments beside
    them is compiled."""
    from fairseq.models.transformer import TransformerConfig
    from fairseq.modules.transformer_layer import (
        TransformerDecoderLayerBase,
        TransformerEncoderLayerBase,
    )
    from fairseq.modules.transformer_layer_aug import AugTransformerDecoderLayerBase

    cfg = TransformerConfig()
    cfg.encoder.embed_dim = cfg.decoder.embed_dim = 16
    cfg.decoder.ffn_embed_dim, cfg.decoder.attention_heads = 32, 2
    torch.manual_seed(0)
    aug = AugTransformerDecoderLayerBase(cfg, encoder_attn_merge_type="sequential").eval()
    plain = TransformerDecoderLayerBase(cfg)
    x, enc, enc_aug = torch.randn(5, 3, 16), torch.randn(7, 3, 16), torch.randn(6, 3, 16)

    def call():  # as fairseq's AugTransformerDecoder calls its layers
        return aug(x, enc, None, enc_aug, None, None, self_attn_mask=None)[0]

    before = call()

    class Scaled(TransformerEncoderLayerBase):  # fairseq's arguments, and one more
        def forward(self, x, encoder_padding_mask, attn_mask=None, scale=1.0):
            return scale * super().forward(x, encoder_padding_mask, attn_mask)

    scaled = Scaled(cfg).eval()
    alone = scaled(x, None, None, 2.0)
    monkeypatch.setattr("tpp_fairseq._log._logged", set())
    with caplog.at_level("INFO", logger="tpp_fairseq"):
        layers = torch.nn.ModuleList([aug, plain, scaled])
        assert compiled.compile_layers(layers, backend="eager") == 1
    eager = "stay eager: AugTransformerDecoderLayerBase, Scaled (another forward's arguments)"
    assert eager in caplog.text
    torch.testing.assert_close(scaled(x, None, None, 2.0), alone)
    assert isinstance(plain.__dict__.get("forward"), compiled.CompiledForward)
    assert "forward" not in aug.__dict__
    torch.testing.assert_close(call(), before)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["transformer_pp_tiny", "transformer_tiny"])
def test_inductor_layers_are_as_close_to_float64_as_eager_ones(arch):
    """bf16, three batches of other shapes: outputs and the embeddings' gradients,
    relative errors against a float64 copy, within 1.1 times eager's; Inductor's graphs
    are those of the first batch (its backward compiles specialise no size). The
    plugin's model with one layer a side (two graphs: a one-layer decoder has only its
    last layer's): Inductor takes minutes on a CPU for each of its graphs."""
    torch.manual_seed(0)
    torch._dynamo.utils.counters.clear()
    if arch == "transformer_pp_tiny":
        reference, graph_count = model(arch, 1, encoder_tag_layers="pos:1,ner:1"), 2
    else:
        reference, graph_count = model(arch), 3
    reference.train()
    eager = copy.deepcopy(reference).to(torch.bfloat16)
    graphs = copy.deepcopy(reference).to(torch.bfloat16)
    reference.double()
    compiled.compile_layers(graphs)
    generator = torch.Generator().manual_seed(1)
    errors = {"eager": [0.0, 0.0], "compiled": [0.0, 0.0]}

    def run_model(m, inputs):
        m.zero_grad(set_to_none=True)
        out = m(*inputs)[0]
        out.double().pow(2).sum().backward()
        return out.double(), m.encoder.embed_tokens.weight.grad.double()

    for step in range(3):
        inputs = batch(
            len(reference.encoder.dictionary), 8, 20 + 7 * step, 25 + 9 * step, generator
        )
        out, grad = run_model(reference, inputs)
        for name, m in (("eager", eager), ("compiled", graphs)):
            o, g = run_model(m, inputs)
            e = errors[name]
            e[0] = max(e[0], ((o - out).norm() / out.norm()).item())
            e[1] = max(e[1], ((g - grad).norm() / grad.norm()).item())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graph_count
    assert errors["compiled"][0] <= 1.1 * errors["eager"][0], errors
    assert errors["compiled"][1] <= 1.1 * errors["eager"][1], errors


def test_an_unknown_backend_is_refused_before_the_trainer_is_built(monkeypatch):
    monkeypatch.setenv("TPP_FAIRSEQ_COMPILE_BACKEND", "inductr")
    built = []
    monkeypatch.setattr(compiled, "_original_trainer_init", lambda *args: built.append(args))
    with pytest.raises(ValueError, match="'inductr': not a torch.compile backend; inductor"):
        compiled.trainer_init(None, None, None, None, None)
    assert not built
    monkeypatch.setenv("TPP_FAIRSEQ_COMPILE_BACKEND", " aot_eager ")
    assert compiled.chosen_backend() == "aot_eager"
    monkeypatch.delenv("TPP_FAIRSEQ_COMPILE_BACKEND")
    assert compiled.chosen_backend() == "inductor"


@pytest.mark.slow
def test_fairseq_train_compiles_the_layers_when_asked(tmp_path):
    """TPP_FAIRSEQ_SPEEDUPS=compiled-layers: fairseq-train of transformer_pp_tiny says it
    compiled its 4 layers, and its first updates' losses are eager's (no dropout). With
    the backend that traces the graphs and runs them eagerly (Inductor's own numbers are
    the test above's)."""
    from support import binarize_tagged

    data = binarize_tagged(tmp_path / "work", tmp_path / "bin", n_train=200)
    losses = {}
    for speedups in ("none", "compiled-layers"):
        save = tmp_path / speedups
        result = run(
            [
                "env",
                f"TPP_FAIRSEQ_SPEEDUPS={speedups}",
                "TPP_FAIRSEQ_COMPILE_BACKEND=aot_eager",
                "fairseq-train",
                data,
                "--user-dir",
                PLUGIN_DIR,
                "--arch",
                "transformer_pp_tiny",
                "--task",
                "translation_with_tags",
                "--tags",
                "",
                "--criterion",
                "label_smoothed_cross_entropy",
                "--optimizer",
                "adam",
                "--lr",
                "1e-3",
                "--max-tokens",
                "500",
                "--max-update",
                "3",
                "--log-format",
                "json",
                "--log-interval",
                "1",
                "--dropout",
                "0",
                "--conv-weight-dropout",
                "0",
                "--save-dir",
                save,
                "--no-save",
                "--disable-validation",
                "--cpu",
                "--seed",
                "1",
            ],
            timeout=900,
        )
        text = result.stdout + result.stderr
        compiled_4 = (
            "compiled layers: 4 encoder and decoder layers run through torch.compile (aot_eager)"
        )
        assert (compiled_4 in text) == (speedups == "compiled-layers"), text[-3000:]
        losses[speedups] = [
            float(json.loads(line.split("| train_inner | ", 1)[1])["loss"])
            for line in text.splitlines()
            if "| train_inner | {" in line
        ]
    assert len(losses["none"]) == 3
    assert losses["compiled-layers"] == pytest.approx(losses["none"], rel=1e-3)
