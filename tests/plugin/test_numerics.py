"""What training on GPUs relies on, checked on the CPU: evaluation sees the weights an
optimizer wrote in place, the O(T) prefix softmax equals its definition (and the
step-by-step decoder state) without overflow, the dot-product heads give the same
result through the fused causal kernel as through an explicit mask, and the model in
bfloat16 (and float16 where torch's CPU kernels allow) stays finite and close to float32."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fairseq.optim.adam import FairseqAdam

from support import build_model, make_dictionary, random_tokens
from tpp_plugin.criterions.label_smoothed_cross_entropy_with_tags import (
    LabelSmoothedCrossEntropyWithTagsCriterion as Criterion,
)
from tpp_plugin.modules import HybridMultiheadAttention, context_query
from tpp_plugin.modules.context_query import (
    ContextQuery,
    PooledQuery,
    prefix_softmax,
    prefix_softmax_transposed,
)


def model_inputs(dictionary, bsz=4, src_len=9, tgt_len=7, seed=0):
    src = random_tokens(dictionary, bsz, src_len, seed=seed)
    src[1, :3] = dictionary.pad()  # left padding, as fairseq pads sources
    prev = random_tokens(dictionary, bsz, tgt_len, seed=seed + 1)
    prev[:, 0] = dictionary.eos()
    prev[2, -2:] = dictionary.pad()  # right padding, as fairseq pads targets
    lengths = src.ne(dictionary.pad()).sum(1)
    return src, lengths, prev


# ----------------------------------------------------------------------------- stale weights


def test_evaluation_after_fairseq_adam_steps_sees_the_new_weights():
    """fairseq's Adam writes parameters through ``.data`` (no version bump): a cache of
    anything derived from a weight would make every later evaluation use the weights
    of the first one. Evaluate, train, evaluate again: the second evaluation must be
    that of a fresh copy of the trained model."""
    torch.manual_seed(0)
    d = make_dictionary(30)
    model = build_model(dictionary=d, encoder_tag_layers="", dropout=0.0)
    src, lengths, prev = model_inputs(d)
    optimizer = FairseqAdam(
        SimpleNamespace(
            lr=[1e-2],
            adam_betas="(0.9, 0.98)",
            adam_eps=1e-8,
            weight_decay=0.0,
            use_old_adam=False,
            fp16_adam_stats=False,
            tpu=False,
        ),
        list(model.parameters()),
    )
    model.eval()
    with torch.no_grad():
        before = model(src, lengths, prev)[0]
    model.train()
    for _ in range(10):
        optimizer.zero_grad()
        model(src, lengths, prev)[0].logsumexp(-1).mean().backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        after = model(src, lengths, prev)[0]
        fresh = copy.deepcopy(model)(src, lengths, prev)[0]
    assert (after - before).abs().max() > 1e-2, "the steps should have changed the output"
    assert torch.equal(after, fresh)


# ----------------------------------------------------------------------------- prefix softmax


def prefix_softmax_by_sdpa(scores, values):
    """The implementation before version 0.2: an attention whose query is ones and
    whose key is the score (width 1), with the causal flag."""
    ones = torch.ones_like(scores).unsqueeze(-1)
    return F.scaled_dot_product_attention(
        ones, scores.unsqueeze(-1), values, is_causal=True, scale=1.0
    )


def prefix_softmax_by_definition(scores, values):
    """``q_t = Σ_{τ≤t} e^{s_τ} v_τ / Σ_{τ≤t} e^{s_τ}`` in float64, position by position."""
    s, v = scores.double(), values.double()
    out = torch.empty_like(v)
    for t in range(s.size(-1)):
        w = torch.softmax(s[..., : t + 1], dim=-1)
        out[..., t, :] = (w.unsqueeze(-1) * v[..., : t + 1, :]).sum(-2)
    return out


@pytest.mark.parametrize(
    "length, block", [(1, 64), (40, 64), (64, 64), (65, 64), (150, 16), (100, 4)]
)
def test_prefix_softmax_equals_definition_and_previous_implementation(length, block):
    torch.manual_seed(length)
    scores = 3 * torch.randn(2, 3, length)
    values = torch.randn(2, 3, length, 5)
    q, lse = prefix_softmax(scores, values, block=block)
    assert q.shape == values.shape and lse.shape == scores.shape
    assert (q.double() - prefix_softmax_by_definition(scores, values)).abs().max() < 1e-5
    assert (q - prefix_softmax_by_sdpa(scores, values)).abs().max() < 1e-5
    assert torch.allclose(lse.double(), torch.logcumsumexp(scores.double(), dim=-1), atol=1e-5)


def test_prefix_softmax_gradients():
    torch.manual_seed(0)
    scores = torch.randn(2, 70, dtype=torch.float64, requires_grad=True)
    values = torch.randn(2, 70, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, v: prefix_softmax(s, v, block=8)[0], (scores, values))


def test_prefix_mask_first_built_in_inference_mode_serves_autograd_later():
    """The prefix softmax's mask is a constant kept per length and device. One first
    built under ``torch.inference_mode`` (decoding) would be an inference tensor, which
    autograd refuses to keep: a later training forward of the same length would fail."""
    context_query._future.cache_clear()
    with torch.inference_mode():
        prefix_softmax(torch.randn(2, 37), torch.randn(2, 37, 3))
    scores = torch.randn(2, 37, dtype=torch.float64, requires_grad=True)
    values = torch.randn(2, 37, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, v: prefix_softmax(s, v)[0], (scores, values))


def test_long_sequences_with_extreme_scores_stay_finite_and_exact():
    """T = 1024 (two levels of blocks), scores spanning 400 nats: a running maximum
    would underflow (e^-400 is 0 in float32), merging spans by their log-normalisers
    does not. In bfloat16 in and out, the result is the float32 one rounded."""
    torch.manual_seed(0)
    length = 1024
    scores = 20 * torch.randn(2, 2, length)
    scores[..., 0] = -250.0  # a first position the later ones outweigh by far
    scores[..., 500] = 150.0
    values = torch.randn(2, 2, length, 8)
    q, lse = prefix_softmax(scores, values, block=16)  # 64 blocks of 16, then 4 of 16
    assert torch.isfinite(q).all() and torch.isfinite(lse).all()
    reference = prefix_softmax_by_definition(scores, values)
    assert (q.double() - reference).abs().max() < 1e-5
    assert torch.allclose(q[..., 0, :], values[..., 0, :]), "position 0 pools itself only"

    query = ContextQuery(2, 8, causal=True)
    # the module: T x B x H scores, T x B x (H*dh) values, in bfloat16
    s_tbh = scores.permute(2, 0, 1).bfloat16()
    v_tbc = values.permute(2, 0, 1, 3).reshape(length, 2, 16).bfloat16()
    out = query(s_tbh, v_tbc)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    expected = prefix_softmax_by_definition(
        s_tbh.permute(1, 2, 0).float(), v_tbc.float().reshape(length, 2, 2, 8).permute(1, 2, 0, 3)
    )
    expected = expected.permute(2, 0, 1, 3).reshape(length, 2, 16)
    # bf16 output: 8 bits of mantissa, relative error <= 2^-8 per element
    assert ((out.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-3).all()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_context_query_step_by_step_equals_parallel(dtype, tolerance):
    """The decoder's running state, fed one position and then chunks of positions,
    against the parallel prefix softmax (with padding on the left of one row)."""
    torch.manual_seed(0)
    query = ContextQuery(3, 4, causal=True)
    length, bsz = 150, 2
    scores = (4 * torch.randn(length, bsz, 3)).to(dtype)
    values = torch.randn(length, bsz, 12).to(dtype)
    pad = torch.zeros(bsz, length, dtype=torch.bool)
    pad[1, :3] = True
    full = query(scores, values, pad)
    state, outs, pos = {}, [], 0
    for n in [1] * 10 + [70, 1, 69]:
        outs.append(
            query(scores[pos : pos + n], values[pos : pos + n], pad[:, pos : pos + n], state)
        )
        pos += n
    inc = torch.cat(outs)
    real = ~pad.t()
    assert (inc[real].float() - full[real].float()).abs().max() <= tolerance


def pooled_query_by_autograd(scores, values, heads, causal):
    """The Query of a whole sequence as autograd differentiates it through
    :func:`prefix_softmax` (decoder) or a softmax (encoder): the reference of
    :class:`PooledQuery`'s backward pass. ``scores`` ``T x B x H``, ``values`` ``T x B x C``."""
    length, bsz, channels = values.shape
    v = values.reshape(length, bsz, heads, -1)
    if causal:
        q, _ = prefix_softmax(scores.permute(1, 2, 0), v.permute(1, 2, 0, 3), block=16)
        return q.permute(2, 0, 1, 3).reshape(length, bsz, channels)
    weights = torch.softmax(scores, dim=0)
    return (weights.unsqueeze(-1) * v).sum(0, keepdim=True).reshape(1, bsz, channels)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 7, 16, 17, 50, 300])
def test_pooled_query_gradients(causal, length):
    """The backward pass that rebuilds the pooling weights from the saved log-normalisers
    (blocks of 16: one block, a partial second, 19 blocks whose forward needs two levels)
    gives autograd's gradients, and passes a float64 gradcheck (up to 50 positions: over
    300 its finite differences take a minute and add nothing to the exact comparison)."""
    torch.manual_seed(length)
    scores = (3 * torch.randn(length, 2, 3, dtype=torch.float64)).requires_grad_()
    values = torch.randn(length, 2, 12, dtype=torch.float64, requires_grad=True)
    if length <= 50:
        assert torch.autograd.gradcheck(
            lambda s, v: PooledQuery.apply(s, v, 3, causal, 16), (scores, values)
        )
    out = PooledQuery.apply(scores, values, 3, causal, 16)
    expected = pooled_query_by_autograd(scores, values, 3, causal)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (scores, values), grad)
    want = torch.autograd.grad(expected, (scores, values), grad)
    assert (out - expected).abs().max() < 1e-12
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-10


def test_prefix_softmax_transposed_is_the_transpose_of_the_weights():
    """``y = Aᵀ x`` against the explicit ``T x T`` matrix of pooling weights, with scores
    spanning 400 nats (no factor of the split weights may overflow) over 3 blocks."""
    torch.manual_seed(0)
    length = 40
    scores = 20 * torch.randn(2, length, dtype=torch.float64)
    scores[:, 0], scores[:, 20] = -250.0, 150.0
    _, lse = prefix_softmax(scores, torch.zeros(2, length, 1, dtype=torch.float64), block=16)
    weights = torch.exp(scores[:, None, :] - lse[:, :, None]).tril()  # B x t x τ
    x = torch.randn(2, length, 5, dtype=torch.float64)
    y = prefix_softmax_transposed(scores, lse, x, block=16)
    assert torch.isfinite(y).all()
    assert (y - weights.transpose(1, 2) @ x).abs().max() < 1e-12


@pytest.mark.parametrize("causal", [True, False])
def test_pooled_query_gradients_in_float32_and_bfloat16(causal):
    """The module's gradients, T = 600 (10 blocks) with padding, against autograd
    through the float64 reference on the same inputs: float32 within 1e-4 of the
    gradient's scale (autograd through the float32 blocks is 5e-5 off here: the values
    share a mean, 1 ± 0.1, so ``v_τ - q_t`` is far smaller than either), bfloat16
    (output and gradients rounded to 8 bits) within 1e-2 — a ``q`` read back in bfloat16
    would put 4% errors into the scores' gradient."""
    torch.manual_seed(0)
    length, bsz, heads, head_dim = 600, 2, 2, 8
    scores = 4 * torch.randn(length, bsz, heads)
    values = 1 + 0.1 * torch.randn(length, bsz, heads * head_dim)
    pad = torch.zeros(bsz, length, dtype=torch.bool)
    pad[1, -40:] = True  # right padding, as fairseq pads targets
    grad = torch.randn(length if causal else 1, bsz, heads * head_dim)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        # the reference: float64 on the same (rounded) inputs
        s64, v64 = (
            scores.to(dtype).double().requires_grad_(),
            values.to(dtype).double().requires_grad_(),
        )
        reference = pooled_query_by_autograd(
            s64.masked_fill(pad.t().unsqueeze(-1), -1e9), v64, heads, causal
        )
        want = torch.autograd.grad(reference, (s64, v64), grad.to(dtype).double())
        query = ContextQuery(heads, head_dim, causal=causal)
        s, v = scores.to(dtype).requires_grad_(), values.to(dtype).requires_grad_()
        out = query(s, v, pad)
        got = torch.autograd.grad(out, (s, v), grad.to(dtype))
        for name, g, w in zip(("scores", "values"), got, want):
            assert g.dtype == dtype and torch.isfinite(g.float()).all()
            assert (g.double() - w).abs().max() <= tolerance * w.abs().max(), (dtype, name)


@pytest.mark.parametrize("causal", [True, False])
def test_pooled_query_pools_again_in_its_backward_pass_only_in_half_precision(causal, monkeypatch):
    """With float32 values the output is the float32 query, kept (with ``L``) for the
    backward pass, which then pools no second time; bfloat16 values keep no float32
    activation, and the backward pass pools again. The gradients of both are those of
    float64 autograd (within 1e-5 of the gradient's scale in float32, 1e-2 in bfloat16)."""
    torch.manual_seed(0)
    length, bsz, heads, head_dim = 70, 2, 2, 8
    pools = []
    real_pool = PooledQuery._pool
    monkeypatch.setattr(
        PooledQuery, "_pool", staticmethod(lambda *a: pools.append(1) or real_pool(*a))
    )
    scores = 3 * torch.randn(length, bsz, heads)
    values = torch.randn(length, bsz, heads * head_dim)
    grad = torch.randn(length if causal else 1, bsz, heads * head_dim)
    for dtype, pooled, tolerance in ((torch.float32, 1, 1e-5), (torch.bfloat16, 2, 1e-2)):
        pools.clear()
        s, v = scores.to(dtype).requires_grad_(), values.to(dtype).requires_grad_()
        got = torch.autograd.grad(
            PooledQuery.apply(s, v, heads, causal, 16), (s, v), grad.to(dtype)
        )
        assert len(pools) == pooled, dtype
        s64, v64 = s.detach().double().requires_grad_(), v.detach().double().requires_grad_()
        want = torch.autograd.grad(
            pooled_query_by_autograd(s64, v64, heads, causal), (s64, v64), grad.to(dtype).double()
        )
        for g, w in zip(got, want):
            assert (g.double() - w).abs().max() <= tolerance * w.abs().max(), dtype


def test_pooled_query_gives_no_gradient_through_rows_that_pool_padding_only():
    """Left padding in a decoder: the rows before the first real position pool padding
    only, and their weights cannot be rebuilt from a log-normaliser float32 cannot tell
    from the masked score. Their outputs are never used; they pass no gradient, and
    every other gradient is exact."""
    torch.manual_seed(0)
    length, bsz, heads = 100, 2, 2
    query = ContextQuery(heads, 4, causal=True)
    scores = 3 * torch.randn(length, bsz, heads, requires_grad=True)
    values = torch.randn(length, bsz, heads * 4, requires_grad=True)
    pad = torch.zeros(bsz, length, dtype=torch.bool)
    pad[1, :70] = True  # past the first block
    grad = torch.randn(length, bsz, heads * 4)  # also on the padding rows
    got = torch.autograd.grad(query(scores, values, pad), (scores, values), grad)
    s64, v64 = scores.detach().double().requires_grad_(), values.detach().double().requires_grad_()
    reference = pooled_query_by_autograd(
        s64.masked_fill(pad.t().unsqueeze(-1), -1e9), v64, heads, True
    )
    want = torch.autograd.grad(
        reference, (s64, v64), grad.double().masked_fill(pad.t().unsqueeze(-1), 0.0)
    )
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert (g.double() - w).abs().max() < 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_conv_heads_keep_no_float32_copies_and_no_masked_copies_for_backward(causal):
    """What a bfloat16 training forward of the module keeps for its backward pass: no
    float32 tensor larger than the scores (one value per position and head), no ``K x K``
    block of pooling weights, and nothing of the conv heads' input but the fused
    projection it is a slice of (the padding applied again in the backward pass)."""
    torch.manual_seed(0)
    length, bsz, dim, heads = 40, 4, 64, 4
    m = (
        HybridMultiheadAttention(dim, heads, 2, kernel_size=5, causal=causal, right_padded=causal)
        .bfloat16()
        .train()
    )
    x = torch.randn(length, bsz, dim, dtype=torch.bfloat16, requires_grad=True)
    pad = torch.zeros(bsz, length, dtype=torch.bool)
    pad[1, -5:] = True
    kept = []
    projections = []
    m.in_proj.register_forward_hook(lambda mod, inp, out: projections.append(out))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        m(x, x, x, key_padding_mask=pad, need_weights=False)[0].float().sum().backward()
    conv_width = 2 * (dim // heads)
    projection = projections[0].untyped_storage().data_ptr()
    for t in kept:
        if t.dtype == torch.float32:
            assert t.numel() <= length * bsz * heads, f"float32 {tuple(t.shape)} kept"
        elif t.numel() == length * bsz * conv_width and t.dim() == 3:
            # T x B x C in bf16: the conv heads' output pieces (LocalConv, Query) or a
            # slice of the projection; a masked copy of LocalConv's input would be another
            assert (
                t.untyped_storage().data_ptr() == projection
                or t.grad_fn is not None
                and "MaskedFill" not in type(t.grad_fn).__name__
            ), tuple(t.shape)


# ----------------------------------------------------------------------------- fused kernels


def test_causal_flag_path_equals_explicit_mask_path():
    """Decoder self-attention through ``is_causal=True`` (no mask at all) against the
    same module given fairseq's float future mask, a boolean one, and (with right
    padding) the padding mask applied explicitly."""
    torch.manual_seed(0)
    length, bsz = 11, 3
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=3, causal=True, right_padded=True).eval()
    x = torch.randn(length, bsz, 16)
    future = torch.triu(torch.full((length, length), float("-inf")), 1)
    with torch.no_grad():
        flag, _ = m(x, x, x, need_weights=False)
        float_mask, _ = m(x, x, x, attn_mask=future, need_weights=False)
        bool_mask, _ = m(x, x, x, attn_mask=future.isinf(), need_weights=False)
    assert (flag - float_mask).abs().max() < 1e-6
    assert (flag - bool_mask).abs().max() < 1e-6

    pad = torch.zeros(bsz, length, dtype=torch.bool)
    pad[1, -4:] = True
    with torch.no_grad():
        dropped, _ = m(x, x, x, key_padding_mask=pad, need_weights=False)
        m.right_padded = False
        applied, _ = m(x, x, x, key_padding_mask=pad, need_weights=False)
    real = ~pad.t()
    assert (dropped[real] - applied[real]).abs().max() < 1e-6
    assert (dropped - flag).abs().max() < 1e-6, "right padding changes nothing"


def test_training_forward_runs_fused_kernels_without_masks(monkeypatch):
    """In a training forward of the whole model the decoder's dot-product heads get
    ``is_causal=True`` and no mask, and an unpadded encoder batch gets no mask."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((q.size(-2), attn_mask is None, is_causal))
        return sdpa(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs
        )

    d = make_dictionary(30)
    model = build_model(dictionary=d, encoder_tag_layers="").train()
    src = random_tokens(d, 4, 9)  # no padding
    prev = random_tokens(d, 4, 7, seed=1)
    prev[2, -2:] = d.pad()  # targets are padded on the right
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model(src, torch.full((4,), 9), prev)
    encoder_calls = [c for c in calls if c[0] == 9]
    decoder_calls = [c for c in calls if c[0] == 7]
    assert len(encoder_calls) == 2 and all(
        no_mask and not causal for _, no_mask, causal in encoder_calls
    )
    assert len(decoder_calls) == 2 and all(
        no_mask and causal for _, no_mask, causal in decoder_calls
    )


# ----------------------------------------------------------------------------- mixed precision


def _loss_and_grads(model, src, lengths, prev, target, pad):
    logits = model(src, lengths, prev)[0]
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=pad
    )
    loss.backward()
    return loss.detach(), {
        n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_backward_is_finite_and_close_to_float32(dtype):
    torch.manual_seed(0)
    d = make_dictionary(30)
    model = build_model(dictionary=d, encoder_tag_layers="", dropout=0.0)
    src, lengths, prev = model_inputs(d)
    target = torch.roll(prev, -1, dims=1)
    loss32, grads32 = _loss_and_grads(model, src, lengths, prev, target, d.pad())
    half = copy.deepcopy(model).to(dtype)
    half.zero_grad()
    try:
        loss16, grads16 = _loss_and_grads(half, src, lengths, prev, target, d.pad())
    except RuntimeError as error:  # a CPU kernel without this dtype: say which
        pytest.fail(f"{dtype} on the CPU: {error}")
    assert torch.isfinite(loss16)
    assert abs(loss16.item() - loss32.item()) < 0.02 * loss32.item()
    total = torch.sqrt(sum(g.norm() ** 2 for g in grads32.values()))
    for name, g32 in grads32.items():
        g16 = grads16[name]
        assert torch.isfinite(g16).all(), name
        # relative to the gradient's scale (half precision keeps 8 (bf16) or 11 bits);
        # parameters whose gradient is nearly zero compare with the whole model's
        assert (g16 - g32).norm() <= 0.1 * g32.norm() + 1e-3 * total, name


def test_bfloat16_incremental_decoding_equals_full_forward():
    torch.manual_seed(0)
    d = make_dictionary(30)
    model = build_model(dictionary=d, encoder_tag_layers="").eval().bfloat16()
    src, lengths, prev = model_inputs(d)
    prev[2, -2:] = d.eos()  # no padding in step-by-step decoding
    with torch.no_grad():
        full = model(src, lengths, prev)[0]
        encoder_out = model.encoder(src, src_lengths=lengths)
        state, steps = {}, []
        for t in range(prev.size(1)):
            steps.append(
                model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0]
            )
    inc = torch.cat(steps, dim=1)
    # bf16 activations through 2+2 layers: logits agree to a few bf16 ulps of their range
    assert torch.isfinite(inc.float()).all()
    assert (inc.float() - full.float()).abs().max() <= 0.05 * full.float().abs().max()


# ----------------------------------------------------------------------------- criterion


def test_tag_loss_is_computed_without_leaving_the_device_and_matches_indexing():
    torch.manual_seed(0)
    tags = make_dictionary(6)
    logits = torch.randn(3, 5, len(tags))
    labels = torch.randint(tags.nspecial, len(tags), (3, 5))
    labels[0, :2] = tags.pad()
    labels[:, -1] = tags.eos()
    loss, correct, count = Criterion.compute_tag_loss(logits, labels, tags)
    assert all(isinstance(x, torch.Tensor) for x in (loss, correct, count))
    real = labels.ne(tags.pad()) & labels.ne(tags.eos())
    lprobs = F.log_softmax(logits[real], dim=-1)
    assert torch.allclose(loss, F.nll_loss(lprobs, labels[real], reduction="sum"))
    assert correct.item() == lprobs.argmax(-1).eq(labels[real]).sum().item()
    assert count.item() == real.sum().item() == 3 * 4 - 2
    assert math.isfinite(loss.item())
