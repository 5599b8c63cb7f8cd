"""transformer_pp as a fairseq model: decoding step by step equals the parallel
forward (with beam reordering), causality, padding invariance, the plain-Transformer
ablation, gradients, option validation and the presets' sizes."""

import argparse
import copy

import pytest
import torch
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.modules import LayerDropModuleList, MultiheadAttention

from tpp_plugin.modules import HybridMultiheadAttention

from support import FakeTask, build_model, make_dictionary, random_tokens


def decoder_logits(model, encoder_out, tokens, incremental_state=None):
    logits, _ = model.decoder(tokens, encoder_out=encoder_out, incremental_state=incremental_state)
    return logits


def test_incremental_decoding_with_beam_reorder_equals_full_forward():
    torch.manual_seed(0)
    d = make_dictionary(30)
    model = build_model(
        dictionary=d, encoder_conv_dilations="1,2", decoder_conv_dilations="2,3"
    ).eval()
    beam, steps, reorder_step = 4, 24, 11
    src = random_tokens(d, 1, 9).repeat(beam, 1)  # the beams of one source sentence
    lengths = torch.full((beam,), 9)
    enc = model.encoder(src, src_lengths=lengths)
    hist = torch.cat(
        [torch.full((beam, 1), d.eos()), random_tokens(d, beam, steps - 1, seed=3)], dim=1
    )
    new_order = torch.tensor([1, 1, 3, 0])

    state = {}
    step_logits = []
    with torch.no_grad():
        for t in range(steps):
            if t == reorder_step:  # as SequenceGenerator: reorder the state and the history
                model.decoder.reorder_incremental_state_scripting(state, new_order)
                enc = model.encoder.reorder_encoder_out(enc, new_order)
                hist = torch.cat([hist[new_order, :t], hist[:, t:]], dim=1)
            out = decoder_logits(model, enc, hist[:, : t + 1], incremental_state=state)
            assert out.size(1) == 1
            step_logits.append(out[:, 0])
        full = decoder_logits(model, enc, hist)
    for t in range(steps):
        expected = full[:, t]
        got = step_logits[t][new_order] if t < reorder_step else step_logits[t]
        assert (got - expected).abs().max() <= 1e-5, f"step {t}"


def test_decoder_is_causal():
    torch.manual_seed(0)
    d = make_dictionary()
    model = build_model(dictionary=d).eval()
    src = random_tokens(d, 2, 6)
    enc = model.encoder(src, src_lengths=torch.tensor([6, 6]))
    prev = random_tokens(d, 2, 10, seed=1)
    changed = prev.clone()
    changed[:, 6:] = random_tokens(d, 2, 4, seed=2)
    with torch.no_grad():
        a = decoder_logits(model, enc, prev)
        b = decoder_logits(model, enc, changed)
    assert torch.equal(a[:, :6], b[:, :6]) or (a[:, :6] - b[:, :6]).abs().max() < 1e-6
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3, "later positions must see the change"


def test_full_context_alignment_is_refused_where_the_conv_heads_stay_causal():
    """fairseq's decoders drop the future mask when asked (``transformer_align``'s
    alignment pass); the conv heads cannot: refused, unless the decoder has none."""
    from tpp_pipeline.errors import OptionError

    d = make_dictionary()
    src, prev = random_tokens(d, 2, 6), random_tokens(d, 2, 5, seed=1)
    for conv_heads in (2, 0):
        model = build_model(dictionary=d, decoder_conv_heads=conv_heads).eval()
        enc = model.encoder(src, src_lengths=torch.tensor([6, 6]))
        if conv_heads:
            with pytest.raises(
                OptionError, match="full-context alignment .*--decoder-conv-heads 0"
            ):
                model.decoder(prev, encoder_out=enc, full_context_alignment=True)
            continue
        causal, _ = model.decoder(prev, encoder_out=enc)
        changed = prev.clone()
        changed[:, -1] = random_tokens(d, 2, 1, seed=2)[:, 0]
        full, _ = model.decoder(changed, encoder_out=enc, full_context_alignment=True)
        assert (full[:, 0] - causal[:, 0]).abs().max() > 1e-4  # the first position saw the last


def test_encoder_output_is_independent_of_left_padding():
    torch.manual_seed(0)
    d = make_dictionary()
    model = build_model(dictionary=d).eval()
    short = random_tokens(d, 1, 5)
    longer = random_tokens(d, 2, 9, seed=4)
    batch = torch.full((3, 9), d.pad())
    batch[0, 4:] = short[0]  # fairseq left-pads the source
    batch[1:] = longer
    with torch.no_grad():
        alone = model.encoder(short, src_lengths=torch.tensor([5]))["encoder_out"][0][:, 0]
        padded = model.encoder(batch, src_lengths=torch.tensor([5, 9, 9]))["encoder_out"][0][4:, 0]
    assert (alone - padded).abs().max() <= 1e-5


def test_zero_conv_heads_is_a_plain_transformer_and_trains():
    torch.manual_seed(0)
    d = make_dictionary()
    model = build_model(dictionary=d, encoder_conv_heads=0, decoder_conv_heads=0, dropout=0.0)
    attn = [
        m for m in model.modules() if isinstance(m, (MultiheadAttention, HybridMultiheadAttention))
    ]
    assert attn and all(type(m) is MultiheadAttention for m in attn)
    losses = train_a_few_steps(model, d)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("shared", [True, False])
def test_zero_conv_heads_is_initialised_weight_for_weight_as_fairseqs_transformer(shared):
    """Same seed, same draws in the same order: the quality study's control (b) starts
    from the very weights of its baseline (a), and (dropout drawing alike) trains to the
    same translations. Would fail if a stack built its layers anywhere but where
    fairseq's __init__ builds them (before the output projection, which draws too)."""
    from fairseq.models.transformer import TransformerModel

    d = make_dictionary(40)
    dims = dict(
        encoder_embed_dim=32,
        encoder_ffn_embed_dim=64,
        encoder_layers=3,
        encoder_attention_heads=4,
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=64,
        decoder_layers=3,
        decoder_attention_heads=4,
        share_all_embeddings=shared,
    )
    torch.manual_seed(1)
    ours = build_model(
        "transformer_pp",
        dictionary=d,
        encoder_conv_heads=0,
        decoder_conv_heads=0,
        encoder_tag_layers="",
        **dims,
    )
    args = argparse.Namespace(**dims)
    ARCH_CONFIG_REGISTRY["transformer"](args)
    torch.manual_seed(1)
    theirs = TransformerModel.build_model(args, FakeTask(d))
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    # and the hybrid model still gives each layer its own kernel width
    hybrid = build_model("transformer_pp", dictionary=d, encoder_tag_layers="", **dims)
    for stack in (hybrid.encoder, hybrid.decoder):
        assert [layer.self_attn.local_conv.kernel_size for layer in stack.layers] == [3, 5, 7]


def test_hybrid_model_uses_conv_heads_in_every_self_attention():
    model = build_model()
    for layer in list(model.encoder.layers) + list(model.decoder.layers):
        assert isinstance(layer.self_attn, HybridMultiheadAttention)
        assert layer.self_attn.conv_heads == 2
    widths = [layer.self_attn.local_conv.kernel_size for layer in model.encoder.layers]
    assert widths == [3, 5]
    assert all(type(layer.encoder_attn) is MultiheadAttention for layer in model.decoder.layers)


def test_quant_noise_reaches_the_hybrid_self_attention_as_fairseqs_attention():
    """``--quant-noise-pq``: fairseq drops blocks of ``--quant-noise-pq-block-size`` input
    columns of its attention's projections in training (writing the weight); the hybrid
    self-attention's input and output projections get the same noise, the decoder's
    cross-attention (fairseq's) keeps its own; evaluation leaves every weight alone."""
    torch.manual_seed(0)
    d = make_dictionary()
    model = build_model(dictionary=d, quant_noise_pq=0.25, quant_noise_pq_block_size=4)
    src = random_tokens(d, 4, 6, seed=1)
    prev = torch.cat([torch.full((4, 1), d.eos()), src[:, :-1]], dim=1)
    layers = list(model.encoder.layers) + list(model.decoder.layers)
    linears = [p for layer in layers for p in (layer.self_attn.in_proj, layer.self_attn.out_proj)]
    linears += [layer.encoder_attn.q_proj for layer in model.decoder.layers]
    before = [p.weight.detach().clone() for p in linears]
    with torch.no_grad():
        model.eval()
        model(src, torch.full((4,), 6), prev)
        assert all(torch.equal(p.weight, w) for p, w in zip(linears, before))
        model.train()
        model(src, torch.full((4,), 6), prev)
    for p, w in zip(linears, before):
        rows = (w != 0).all(1)  # (in_proj's alignment rows are zeros from the start)
        blocks = p.weight[rows].view(int(rows.sum()), -1, 4) == 0  # rows x blocks x 4
        assert torch.equal(blocks.all(-1), blocks.any(-1)), "whole blocks dropped"
        assert 0.1 < blocks.all(-1).float().mean() < 0.4


def train_a_few_steps(model, d, steps=30):
    src = random_tokens(d, 8, 7, seed=5)
    prev = torch.cat([torch.full((8, 1), d.eos()), src[:, :-1]], dim=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(steps):
        logits, _ = model(src, torch.full((8,), 7), prev)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), src.reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("pre_ln", [False, True])
def test_every_parameter_gets_a_gradient(pre_ln):
    """Also with fairseq's pre-LN layers (--encoder/decoder-normalize-before, which
    tpp-study's gpu-short configuration trains): every layer, the hybrid ones included,
    normalises before its sublayers and the final LayerNorms learn."""
    torch.manual_seed(0)
    d = make_dictionary()
    tags = {"pos": make_dictionary(6), "ner": make_dictionary(5)}
    model = build_model(
        dictionary=d,
        tag_dictionaries=tags,
        encoder_normalize_before=pre_ln,
        decoder_normalize_before=pre_ln,
    ).train()
    layers = [*model.encoder.layers, *model.decoder.layers]
    assert [layer.normalize_before for layer in layers] == [pre_ln] * len(layers)
    assert (model.encoder.layer_norm is not None) == pre_ln
    src = random_tokens(d, 4, 8)
    prev = random_tokens(d, 4, 6, seed=1)
    logits, extra = model(src, torch.full((4,), 8), prev, return_tag_logits=True)
    loss = logits.logsumexp(-1).mean()
    for name, tag_logits in extra["tag_logits"].items():
        assert tag_logits.shape[:2] == src.shape
        loss = loss + tag_logits.logsumexp(-1).mean()
    loss.backward()
    missing = [
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    ]
    assert not missing, f"no gradient for: {missing}"


def test_tag_heads_read_their_layers_and_cost_nothing_by_default():
    d = make_dictionary()
    tags = {"pos": make_dictionary(6), "ner": make_dictionary(5)}
    model = build_model(dictionary=d, tag_dictionaries=tags).eval()
    assert model.encoder.tag_heads.layers == {"pos": 1, "ner": 2}
    src = random_tokens(d, 2, 5)
    calls = []
    hook = model.encoder.tag_heads.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        _, extra = model(src, torch.full((2,), 5), src)
    assert "tag_logits" not in extra and not calls
    hook.remove()


@pytest.mark.parametrize("kept", ["pos:1", "ner:2", ""])
def test_a_checkpoint_loads_into_a_model_with_fewer_tag_heads(kept):
    """``--model-overrides "{'encoder_tag_layers': 'pos:1'}"``: the heads are for training
    only, the weights of those the model has not are dropped as it loads."""
    torch.manual_seed(0)
    d = make_dictionary()
    tags = {"pos": make_dictionary(6), "ner": make_dictionary(5)}
    full = build_model(dictionary=d, tag_dictionaries=tags)
    fewer = build_model(dictionary=d, tag_dictionaries=tags, encoder_tag_layers=kept)
    assert sorted(fewer.encoder.tag_heads.heads) == sorted(n.split(":")[0] for n in [kept] if n)
    fewer.load_state_dict(full.state_dict(), strict=True)
    for name, head in fewer.encoder.tag_heads.heads.items():
        assert torch.equal(head.weight, full.encoder.tag_heads.heads[name].weight)
    assert torch.equal(fewer.encoder.embed_tokens.weight, full.encoder.embed_tokens.weight)


@pytest.mark.parametrize("trained_with", ["pos:1", "ner:2", ""])
def test_a_checkpoint_loads_into_a_model_with_more_tag_heads(trained_with):
    """``--finetune-from-model`` into a run with tags: a head the checkpoint has not keeps
    the weights it was built with (it was a missing key, and fairseq refused to load)."""
    torch.manual_seed(0)
    d = make_dictionary()
    tags = {"pos": make_dictionary(6), "ner": make_dictionary(5)}
    fewer = build_model(dictionary=d, tag_dictionaries=tags, encoder_tag_layers=trained_with)
    full = build_model(dictionary=d, tag_dictionaries=tags)
    built = {name: head.weight.clone() for name, head in full.encoder.tag_heads.heads.items()}
    full.load_state_dict(fewer.state_dict(), strict=True)
    for name, head in full.encoder.tag_heads.heads.items():
        source = fewer.encoder.tag_heads.heads[name] if name in trained_with else None
        assert torch.equal(head.weight, built[name] if source is None else source.weight)
    assert torch.equal(full.encoder.embed_tokens.weight, fewer.encoder.embed_tokens.weight)


def test_from_pretrained_names_no_model_of_fairseqs_transformer(tmp_path, monkeypatch):
    from tpp_plugin.models.transformer_pp.model import TransformerPPModel

    assert TransformerPPModel.hub_models() == {}
    monkeypatch.chdir(tmp_path)  # a name that is no folder here: not fairseq's archive
    with pytest.raises(Exception) as raised:
        TransformerPPModel.from_pretrained("transformer.wmt14.en-fr")
    assert "dl.fbaipublicfiles.com" not in str(raised.value), raised.value


def test_under_layerdrop_each_tag_head_reads_its_layers_output():
    """With ``--encoder-layerdrop`` fairseq's encoder returns the states of the layers
    that ran only: a tag head still reads the output of its layer, a skipped layer
    passing its input on (the state of the last layer run before it, or the
    embeddings), and the layers are dropped with fairseq's own random draws."""
    d = make_dictionary()
    tags = {"pos": make_dictionary(6), "ner": make_dictionary(5)}
    options = dict(dictionary=d, tag_dictionaries=tags, encoder_layers=4)
    options.update(encoder_conv_kernel_sizes="3,3,5,5", encoder_tag_layers="pos:1,ner:3")
    torch.manual_seed(0)
    model = build_model(encoder_layerdrop=0.5, **options).train()
    torch.manual_seed(0)
    plain = build_model(**options).train()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    fairseqs = copy.deepcopy(model)
    layers = list(torch.nn.ModuleList.__iter__(fairseqs.encoder.layers))
    fairseqs.encoder.layers = LayerDropModuleList(0.5, layers)
    outputs = {}
    for i, layer in enumerate(torch.nn.ModuleList.__iter__(model.encoder.layers)):  # all 4
        layer.register_forward_hook(lambda m, inputs, out, i=i: outputs.__setitem__(i, out))
    src, lengths = random_tokens(d, 2, 7), torch.full((2,), 7)
    seen = set()
    for seed in range(30):
        outputs.clear()
        with torch.no_grad():
            torch.manual_seed(seed)
            encoder_out = model.encoder(src, src_lengths=lengths, return_all_hiddens=True)
            logits = model.encoder.tag_logits(encoder_out)
            torch.manual_seed(seed)
            expected = fairseqs.encoder(src, src_lengths=lengths, return_all_hiddens=True)
        assert torch.equal(encoder_out["encoder_out"][0], expected["encoder_out"][0])
        assert len(encoder_out["encoder_states"]) == len(outputs) + 1
        for name, layer in model.encoder.tag_heads.layers.items():
            before = [i for i in outputs if i < layer]
            state = outputs[max(before)] if before else encoder_out["encoder_states"][0]
            expected = model.encoder.tag_heads.heads[name](state).transpose(0, 1)
            assert torch.allclose(logits[name], expected, atol=1e-6), (seed, name, sorted(outputs))
            seen.add((name, len(before)))
    assert {("pos", 0), ("ner", 0), ("ner", 1), ("ner", 2)} <= seen, seen


def test_a_checkpoint_before_0_2_loads_pruned_to_any_layers():
    """A state dict with the separate input projections of versions before 0.2 loads
    into a model pruned to its second layers (fairseq upgrades before it prunes: the
    projections were fused under the pruned model's numbers, so layer 1's never were)."""
    from tpp_plugin.modules.hybrid_attention import _LEGACY_NAMES

    torch.manual_seed(0)
    d = make_dictionary()
    full = build_model(dictionary=d, encoder_tag_layers="")
    legacy = full.state_dict()
    for side in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(full, side).layers):
            prefix = f"{side}.layers.{i}.self_attn."
            for part in ("weight", "bias"):
                fused = legacy.pop(f"{prefix}in_proj.{part}")  # projection after projection
                pieces = fused.split(layer.self_attn._widths)
                for name, rows in zip(layer.self_attn._names, pieces):
                    if name != "pad":
                        legacy[f"{prefix}{_LEGACY_NAMES[name]}.{part}"] = rows
    keep = dict(encoder_layers_to_keep="1", decoder_layers_to_keep="1")
    pruned = build_model(dictionary=d, encoder_tag_layers="", **keep)
    cfg = argparse.Namespace(arch="transformer_pp_tiny", **keep)  # as a checkpoint's
    pruned.load_state_dict(legacy, strict=True, model_cfg=cfg)
    for side in ("encoder", "decoder"):
        kept, source = getattr(pruned, side).layers[0], getattr(full, side).layers[1]
        assert all(torch.equal(a, b) for a, b in zip(kept.parameters(), source.parameters()))


def test_layers_to_keep_prunes_a_model_as_fairseq_prunes_its_transformer():
    """fairseq's pruning of a LayerDrop-trained model as it loads
    (``--model-overrides "{'encoder_layers_to_keep': '1', ...}"``): the model is built
    with the kept layers' kernel widths, its tag heads read the kept layers under their
    new numbers, and the full model's state loads through fairseq's own pruning; a head
    whose layer is pruned is refused, naming the way out, unless the checkpoint has no
    such head."""
    torch.manual_seed(0)
    d = make_dictionary()
    tags = {"pos": make_dictionary(6), "ner": make_dictionary(5)}
    options = dict(dictionary=d, tag_dictionaries=tags, encoder_tag_layers="ner:2")
    full = build_model(encoder_conv_kernel_sizes="3,5", decoder_conv_kernel_sizes="3,7", **options)
    keep = dict(encoder_layers_to_keep="1", decoder_layers_to_keep="1")
    pruned = build_model(
        encoder_conv_kernel_sizes="3,5", decoder_conv_kernel_sizes="3,7", **keep, **options
    )
    assert [layer.self_attn.local_conv.kernel_size for layer in pruned.encoder.layers] == [5]
    assert [layer.self_attn.local_conv.kernel_size for layer in pruned.decoder.layers] == [7]
    assert pruned.encoder.tag_heads.layers == {"ner": 1}
    cfg = argparse.Namespace(arch="transformer_pp_tiny", **keep)  # as a checkpoint's
    pruned.load_state_dict(full.state_dict(), strict=True, model_cfg=cfg)
    for side in ("encoder", "decoder"):
        kept, source = getattr(pruned, side).layers[0], getattr(full, side).layers[1]
        assert all(torch.equal(a, b) for a, b in zip(kept.parameters(), source.parameters()))
    # one side's list alone: the other side is kept whole (fairseq dropped its layers)
    sizes = dict(encoder_conv_kernel_sizes="3,5", decoder_conv_kernel_sizes="3,7")
    one = build_model(decoder_layers_to_keep="1", **sizes, **options)
    cfg = argparse.Namespace(arch="transformer_pp_tiny", decoder_layers_to_keep="1")
    one.load_state_dict(full.state_dict(), strict=True, model_cfg=cfg)
    assert torch.equal(one.encoder.layers[1].fc1.weight, full.encoder.layers[1].fc1.weight)
    assert torch.equal(one.decoder.layers[0].fc1.weight, full.decoder.layers[1].fc1.weight)
    assert cfg.decoder_layers_to_keep == "1" and not hasattr(cfg, "encoder_layers_to_keep")
    with pytest.raises(ValueError, match=r"--encoder-layers-to-keep 1 .*pos:1.*encoder_tag_layers"):
        build_model(**keep, dictionary=d, tag_dictionaries=tags)
    # rebuilt from a checkpoint saved without the head of a pruned layer
    for kept, saved, heads in (
        ("1", "ner:5", {"ner": 1}),
        ("1", "", {}),
        ("0", "pos:6", {"pos": 1}),
    ):
        rebuilt = build_model(encoder_layers_to_keep=kept, dictionary=d, encoder_tag_classes=saved)
        assert rebuilt.encoder.tag_heads.layers == heads
    with pytest.raises(
        ValueError,
        match=r"keeps layer 2 \(0-based\), but the encoder has 2 layers \(--encoder-layers\)",
    ):
        build_model(encoder_layers_to_keep="0,2", dictionary=d)
    for bad in ("-1", "0,0"):
        with pytest.raises(ValueError, match=r"--decoder-layers-to-keep: distinct 0-based"):
            build_model(decoder_layers_to_keep=bad, dictionary=d)
    # several layers kept, in any order: fairseq numbers them in increasing order
    deep = dict(encoder_layers=3, encoder_conv_kernel_sizes="3,5,7", encoder_tag_layers="ner:3")
    three = build_model(encoder_layers_to_keep="2,0", dictionary=d, tag_dictionaries=tags, **deep)
    assert [layer.self_attn.local_conv.kernel_size for layer in three.encoder.layers] == [3, 7]
    assert three.encoder.tag_heads.layers == {"ner": 2}


@pytest.mark.parametrize(
    "overrides, option",
    [
        (dict(encoder_attention_heads=3), "--encoder-attention-heads"),
        (dict(decoder_conv_heads=5), "--decoder-conv-heads"),
        (dict(encoder_conv_kernel_sizes="3"), "--encoder-conv-kernel-sizes"),
        (dict(decoder_conv_dilations="1,0"), "--decoder-conv-dilations"),
        (dict(encoder_conv_kernel_sizes="3,x"), "--encoder-conv-kernel-sizes"),
        (dict(encoder_tag_layers="pos:3"), "--encoder-tag-layers"),
        (dict(encoder_tag_layers="pos"), "--encoder-tag-layers"),
        (dict(conv_weight_dropout=1.5), "--conv-weight-dropout"),
        (dict(cross_self_attention=True), "--cross-self-attention"),
        # a window longer than the sentences the model takes (10**20 taps were built)
        (dict(encoder_conv_kernel_sizes="100000000000000000000,3"), "-kernel-sizes and --en"),
        (dict(decoder_conv_dilations="1,1000"), "--decoder-conv-dilations: layer 2's window"),
    ],
)
def test_bad_options_fail_at_build_naming_the_option(overrides, option):
    """As fairseq's commands' one-line errors (a ValueError too)."""
    from tpp_pipeline.errors import OptionError

    with pytest.raises(OptionError) as err:
        build_model(**overrides)
    assert option in str(err.value) and isinstance(err.value, ValueError)


def test_even_kernel_widths_are_supported():
    model = build_model(encoder_conv_kernel_sizes="2,4", decoder_conv_kernel_sizes="4,6").eval()
    assert [layer.self_attn.local_conv.kernel_size for layer in model.decoder.layers] == [4, 6]


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ["transformer_pp_wmt_en_de_big", "transformer_pp_wmt_en_fr_big"])
def test_big_presets_have_the_papers_size(arch):
    # 32,768 types: the joint dictionary our WMT'14 pipeline builds (as fairseq's
    # scaling-NMT recipe); the paper reports 212M parameters.
    d = make_dictionary(32768 - 4)
    assert len(d) == 32768
    tags = {"pos": make_dictionary(18 - 4), "ner": make_dictionary(40 - 4)}
    with torch.device("meta"):
        model = build_model(arch, dictionary=d, tag_dictionaries=tags)
    n = count_parameters(model)
    assert abs(n / 212e6 - 1) <= 0.02, n
    args = model.cfg
    assert (args.encoder.embed_dim, args.encoder.attention_heads, args.encoder.ffn_embed_dim) == (
        1024,
        16,
        4096,
    )
    assert (args.encoder.layers, args.decoder.layers) == (5, 5)


def test_base_preset_shape():
    with torch.device("meta"):
        model = build_model("transformer_pp")
    layer = model.encoder.layers[4].self_attn
    assert (layer.num_heads, layer.conv_heads, layer.head_dim) == (8, 4, 64)
    assert layer.local_conv.kernel_size == 15 and layer.local_conv.dilation == 2


def test_paper_faithful_defaults_are_pinned():
    """The paper's choices stay the defaults whatever options are added: causal
    LocalConv in the encoder too, half the heads convolutional, kernels 3,5,7,11,15,
    POS after layer 1 and NER after layer 2."""
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY["transformer_pp"](args)
    assert args.encoder_conv_centered is False
    assert args.conv_head_scaling == "none"
    assert args.conv_query_temperature == 1.0
    assert (args.encoder_conv_heads, args.decoder_conv_heads) == (4, 4)
    assert args.encoder_conv_kernel_sizes == args.decoder_conv_kernel_sizes == "3,5,7,11,15"
    assert args.encoder_tag_layers == "pos:1,ner:2"
    model = build_model("transformer_pp", encoder_tag_layers="")
    assert all(layer.self_attn.local_conv.lookahead == 0 for layer in model.encoder.layers)
    assert all(
        layer.self_attn.conv_output_scale == 1.0
        for layer in [*model.encoder.layers, *model.decoder.layers]
    )


def test_conv_head_scaling_scales_only_the_conv_heads_output_by_inv_sqrt_head_dim():
    """--conv-head-scaling inv-sqrt-head-dim: the conv heads' LocalConv * Query times
    1/sqrt(d_h), the dot-product heads and LocalConv untouched; in the parallel forward,
    the analysis path and an incremental decoding step alike."""
    torch.manual_seed(0)
    paper = build_model(encoder_tag_layers="", dropout=0.0).eval()
    scaled = build_model(
        encoder_tag_layers="", dropout=0.0, conv_head_scaling="inv-sqrt-head-dim"
    ).eval()
    scaled.load_state_dict(paper.state_dict())
    a, b = paper.decoder.layers[1].self_attn, scaled.decoder.layers[1].self_attn
    assert b.conv_output_scale == a.head_dim**-0.5 == 0.25 and "inv-sqrt-head-dim" in repr(b)
    x = torch.randn(7, 3, a.embed_dim)
    ha, hb = a.head_outputs(x), b.head_outputs(x)
    # the scale (a power of two here) is LocalConv's: exact in its kernel
    assert torch.equal(ha["dot"], hb["dot"]) and torch.equal(hb["local"], ha["local"] * 0.25)
    assert torch.allclose(hb["conv"], ha["conv"] * 0.25, atol=1e-7)
    assert not torch.allclose(a(x, x, x)[0], b(x, x, x)[0], atol=1e-3)
    # the decoding step (its own code path) agrees with the parallel forward
    full = b(x, x, x, need_weights=False)[0]
    state = {}
    steps = [
        b(step, step, step, incremental_state=state, need_weights=False)[0] for step in x.split(1)
    ]
    assert torch.allclose(torch.cat(steps), full, atol=1e-5)
    with pytest.raises(ValueError, match="output_scaling"):
        HybridMultiheadAttention(64, 4, 2, 3, output_scaling="sqrt")


def test_conv_query_temperature_reaches_every_query_and_only_divides_its_scores():
    """--conv-query-temperature T: every layer's Query pools with softmax(s / T), which
    is the T = 1 model with the score rows of the fused projection divided by T; 0 is
    an error naming the option, not the default."""
    torch.manual_seed(0)
    d = make_dictionary(30)
    paper = build_model(dictionary=d, encoder_tag_layers="", dropout=0.0).eval()
    warm = build_model(
        dictionary=d, encoder_tag_layers="", dropout=0.0, conv_query_temperature=2.5
    ).eval()
    warm.load_state_dict(paper.state_dict())
    layers = [*warm.encoder.layers, *warm.decoder.layers]
    assert all(layer.self_attn.context_query.temperature == 2.5 for layer in layers)
    assert "temperature=2.5" in repr(warm.decoder.layers[0].self_attn.context_query)
    with torch.no_grad():  # the same pooling in the T = 1 model: score rows / 2.5
        for layer in [*paper.encoder.layers, *paper.decoder.layers]:
            attn = layer.self_attn
            start = sum(w for n, w in attn.projection_sizes[: attn._names.index("score")])
            rows = slice(start, start + attn.conv_heads)
            attn.in_proj.weight[rows] /= 2.5
            attn.in_proj.bias[rows] /= 2.5
    src, prev = random_tokens(d, 3, 6), random_tokens(d, 3, 5, seed=1)
    lengths = torch.full((3,), 6)
    with torch.no_grad():
        out_warm = warm(src, lengths, prev)[0]
        assert torch.allclose(out_warm, paper(src, lengths, prev)[0], atol=1e-5)
        warm.encoder.layers[0].self_attn.context_query.temperature = 1.0  # it is used
        assert not torch.allclose(warm(src, lengths, prev)[0], out_warm, atol=1e-4)
    with pytest.raises(ValueError, match="--conv-query-temperature"):
        build_model(encoder_tag_layers="", conv_query_temperature=0.0)


def test_centered_encoder_conv_sees_the_next_positions_and_the_decoder_stays_causal():
    torch.manual_seed(0)
    model = build_model(encoder_conv_centered=True, encoder_tag_layers="", dropout=0.0).eval()
    convs = [layer.self_attn.local_conv for layer in model.encoder.layers]
    assert (
        [c.lookahead for c in convs]
        == [(c.kernel_size - 1) // 2 * c.dilation for c in convs]
        != [0, 0]
    )
    assert all(layer.self_attn.local_conv.lookahead == 0 for layer in model.decoder.layers)
    conv = convs[1]  # F=5, dilation 1: output t averages t-2 .. t+2
    u = torch.zeros(9, 1, conv.channels)
    u[6] = 1.0
    out = conv(u)
    assert (out[4:9, 0].abs().sum(-1) > 0).all() and (out[:4, 0].abs().sum(-1) == 0).all()


def test_only_the_cpu_preset_scales_the_conv_heads():
    """The paper's presets keep its unscaled conv heads; the CPU demo's preset, chosen
    for learning speed, scales them (the study's finding)."""
    for arch, expected in (
        ("transformer_pp", "none"),
        ("transformer_pp_wmt_en_de_big", "none"),
        ("transformer_pp_wmt_en_fr_big", "none"),
        ("transformer_pp_iwslt_de_en", "none"),
        ("transformer_pp_tiny", "none"),
        ("transformer_pp_cpu", "inv-sqrt-head-dim"),
    ):
        args = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[arch](args)
        assert args.conv_head_scaling == expected, arch
    model = build_model("transformer_pp_cpu", encoder_tag_layers="")
    assert model.encoder.layers[0].self_attn.conv_output_scale == (256 // 4) ** -0.5


@pytest.mark.parametrize("left_pad_target", [False, True])
def test_the_decoders_attention_is_built_for_the_side_the_task_pads_targets_on(left_pad_target):
    """fairseq pads targets on the right, where a causal attention needs no padding mask;
    a task that pads them on the left gets a decoder built to apply it (at construction:
    nothing walks the model afterwards), whatever the saved configuration says."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    from tpp_plugin.models.transformer_pp import TransformerPPModel

    args = argparse.Namespace(left_pad_target=not left_pad_target)  # as saved: overridden
    ARCH_CONFIG_REGISTRY["transformer_pp_tiny"](args)
    task = FakeTask(make_dictionary())
    task.cfg = argparse.Namespace(left_pad_target=left_pad_target)
    model = TransformerPPModel.build_model(args, task)
    decoder = [m for m in model.decoder.modules() if isinstance(m, HybridMultiheadAttention)]
    encoder = [m for m in model.encoder.modules() if isinstance(m, HybridMultiheadAttention)]
    assert decoder and all(m.right_padded == (not left_pad_target) for m in decoder)
    assert encoder and not any(m.right_padded for m in encoder)
    # a model built without a task's word (fairseq's default): padded on the right
    assert all(
        m.right_padded for m in build_model().decoder.modules() if hasattr(m, "right_padded")
    )


def test_a_model_of_the_triton_kernels_builds_where_triton_is_not_installed(monkeypatch, caplog):
    """``--conv-heads-impl triton`` or ``fused`` (saved in the checkpoint of a model
    trained on a GPU) is resolved once, as the model is built: where Triton is not
    installed the conv heads run as PyTorch operations, said once, with the same
    outputs."""
    from tpp_plugin.modules import conv_heads_triton

    torch.manual_seed(0)
    taps = build_model(conv_heads_impl="taps", encoder_tag_layers="", dropout=0.0).eval()
    monkeypatch.setattr(conv_heads_triton, "available", lambda: False)
    conv_heads_triton._warn_missing.cache_clear()
    with caplog.at_level("WARNING"):
        for impl in ("triton", "fused"):
            model = build_model(conv_heads_impl=impl, encoder_tag_layers="", dropout=0.0)
            attentions = [m for m in model.modules() if isinstance(m, HybridMultiheadAttention)]
            assert attentions and {m.conv_heads_impl for m in attentions} == {"taps"}
            model.load_state_dict(taps.state_dict())
            src, prev = (
                random_tokens(model.encoder.dictionary, 2, 7),
                random_tokens(model.decoder.dictionary, 2, 5),
            )
            src_lengths = torch.full((2,), 7)
            with torch.no_grad():
                got = model.eval()(src, src_lengths, prev)[0]
                expected = taps(src, src_lengths, prev)[0]
            assert torch.equal(got, expected)
    missing = [r for r in caplog.records if "needs Triton, which is not installed" in r.message]
    assert len(missing) == 2  # once per implementation asked for, not once per layer


def test_a_boolean_option_names_what_it_expects(capsys):
    from tpp_plugin.models.transformer_pp.config import add_args

    parser = argparse.ArgumentParser()
    add_args(parser)
    assert parser.parse_args(["--encoder-conv-centered", "True"]).encoder_conv_centered is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--encoder-conv-centered", "maybe"])
    assert "--encoder-conv-centered: expected True or False, got 'maybe'" in capsys.readouterr().err
