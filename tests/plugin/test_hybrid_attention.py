"""The hybrid attention module against a direct, loop-based implementation of its
equations, and its incremental (step-by-step) decoding against the parallel forward."""

import math

import pytest
import torch
from fairseq.modules.fairseq_dropout import FairseqDropout

from tpp_plugin.modules import HybridMultiheadAttention, LocalConv
from tpp_plugin.modules.local_conv import DilatedDepthwiseConv


def reference_hybrid(m: HybridMultiheadAttention, x: torch.Tensor, pad: torch.Tensor):
    """Loop-by-loop evaluation of the module's equations for ``x`` (``T x B x d``) with
    padding mask ``pad`` (``B x T``). Returns the output ``T x B x d`` and the per-head
    maps ``H x B x T x T``; differentiable."""
    T, B, d = x.shape
    dh, Ha, Hc = m.head_dim, m.dot_heads, m.conv_heads
    F_, dil = m.local_conv.kernel_size, m.local_conv.dilation
    out = torch.zeros(T, B, d, dtype=torch.float64)
    maps = torch.zeros(m.num_heads, B, T, T, dtype=torch.float64)

    def lin(name, v):  # one slice of the module's fused input projection
        weight, bias = m.projection(name) if name != "out" else (m.out_proj.weight, m.out_proj.bias)
        return v @ weight.double().t() + bias.double()

    kernel = torch.softmax(m.local_conv.weight.double(), dim=-1)  # C x F
    for b in range(B):
        xb = x[:, b].double()
        allowed = lambda t, tau: (not pad[b, tau]) and (tau <= t or not m.causal)  # noqa: E731
        heads = []
        for h in range(Ha):
            sl = slice(h * dh, (h + 1) * dh)
            q, k, v = (lin(p, xb)[:, sl] for p in ("q", "k", "v"))
            head = torch.zeros(T, dh, dtype=torch.float64)
            for t in range(T):
                if not any(allowed(t, tau) for tau in range(T)):
                    continue  # a padding row that sees nothing (its output is not used)
                scores = [
                    q[t] @ k[tau] / math.sqrt(dh)
                    if allowed(t, tau)
                    else x.new_tensor(-math.inf).double()
                    for tau in range(T)
                ]
                w = torch.softmax(torch.stack(scores), dim=0)
                maps[h, b, t] = w
                head[t] = sum(w[tau] * v[tau] for tau in range(T))
            heads.append(head)
        u = lin("local", xb)
        u[pad[b]] = 0.0
        s = lin("score", xb)  # T x Hc
        vals = lin("value", xb)  # T x (Hc*dh)
        for h in range(Hc):
            sl = slice(h * dh, (h + 1) * dh)
            head = torch.zeros(T, dh, dtype=torch.float64)
            for t in range(T):
                local = torch.zeros(dh, dtype=torch.float64)
                for c in range(dh):
                    ch = h * dh + c
                    for k_ in range(F_):
                        src = t - (F_ - 1 - k_) * dil
                        if src >= 0:
                            local[c] += kernel[ch, k_] * u[src, ch]
                pool = [tau for tau in range(T) if allowed(t, tau)] or [t]
                w = torch.softmax(
                    torch.stack([s[tau, h] for tau in pool]) / m.context_query.temperature, dim=0
                )
                query = sum(wi * vals[tau, sl] for wi, tau in zip(w, pool))
                maps[Ha + h, b, t, pool] = w
                head[t] = local * query
            heads.append(head)
        out[:, b] = lin("out", torch.cat(heads, dim=-1))
    return out, maps


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("conv_heads, temperature", [(2, 1.0), (4, 1.0), (2, 0.3)])
def test_module_matches_loop_reference(causal, conv_heads, temperature):
    torch.manual_seed(0)
    m = HybridMultiheadAttention(
        12, 4, conv_heads, kernel_size=3, dilation=2, causal=causal, query_temperature=temperature
    ).eval()
    with torch.no_grad():  # non-trivial biases, so that padding handling is visible
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    T, B = 7, 3
    x = torch.randn(T, B, 12)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, :2] = True  # left-padded sentence (encoder style)
    if causal:
        pad[2, -2:] = True  # right-padded sentence (decoder style)
    out, maps = m(x, x, x, key_padding_mask=pad, need_weights=True, need_head_weights=True)
    with torch.no_grad():
        ref_out, ref_maps = reference_hybrid(m, x, pad)
    real = ~pad.t()  # outputs at padding positions are not used by anyone
    assert torch.allclose(out[real].double(), ref_out[real], atol=1e-5)
    rows = ~pad  # B x T
    for h in range(4):
        assert torch.allclose(maps[h][rows].double(), ref_maps[h][rows], atol=1e-5), f"head {h}"


def test_need_weights_averages_heads_and_rows_sum_to_one():
    torch.manual_seed(0)
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=3, causal=True).eval()
    x = torch.randn(5, 2, 16)
    _, per_head = m(x, x, x, need_head_weights=True)
    _, mean = m(x, x, x, need_weights=True)
    assert per_head.shape == (4, 2, 5, 5)
    assert torch.allclose(mean, per_head.mean(0))
    assert torch.allclose(per_head.sum(-1), torch.ones(4, 2, 5), atol=1e-6)
    assert torch.all(per_head.triu(1) == 0), "decoder maps must not look at the future"


def test_need_weights_when_decoding_step_by_step_averages_the_dot_product_heads():
    """The Query keeps a running sum while decoding, not its weights over the past: the
    averaged map is the dot-product heads' (rows sum to one), as in the parallel forward."""
    torch.manual_seed(0)
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=3, causal=True).eval()
    x = torch.randn(5, 2, 16)
    _, per_head = m(x, x, x, need_head_weights=True)
    state = {}
    for t in range(5):
        step = x[t : t + 1]
        _, mean = m(step, step, step, incremental_state=state)
        assert mean.shape == (2, 1, t + 1)
        assert torch.allclose(mean[:, 0], per_head[:2, :, t, : t + 1].mean(0), atol=1e-6)


def test_local_conv_is_a_weighted_average_of_past_positions():
    conv = LocalConv(4, kernel_size=3, dilation=2).eval()
    u = torch.ones(9, 1, 4)
    y = conv(u)
    # positions >= (F-1)*dilation see three real inputs of value 1: an average is 1
    assert torch.allclose(y[4:], torch.ones(5, 1, 4), atol=1e-6)
    assert torch.all(y[:4] < 1.0), "the first positions see the zero history"
    assert conv.receptive_field == 4


@pytest.mark.parametrize(
    "kernel_size, dilation, history, lookahead",
    [
        (3, 2, 0, 0),
        (5, 1, 4, 0),
        (4, 3, 9, 0),
        (1, 1, 0, 0),
        (7, 2, 3, 0),
        (5, 1, 0, 2),
        (7, 2, 0, 6),
        (4, 1, 0, 1),
        (2, 2, 0, 1),
    ],
)
def test_dilated_depthwise_conv_forward_and_gradients(kernel_size, dilation, history, lookahead):
    """The autograd function against the definition (float64 gradcheck), including a
    buffered history in front of the new positions and a lookahead (centred kernels).
    Most cases have a tap that every output row reads, which starts the sum; the last
    (lags 1 and -1) has none, and sums into zeros."""
    torch.manual_seed(0)
    T, B, C = 6, 2, 3
    u = torch.randn(history + T, B, C, dtype=torch.float64, requires_grad=True)
    kernel = torch.randn(kernel_size, C, dtype=torch.float64, requires_grad=True)
    out = DilatedDepthwiseConv.apply(u, kernel, dilation, T, lookahead)
    expected = torch.zeros(T, B, C, dtype=torch.float64)
    for t in range(T):
        for k in range(kernel_size):
            src = history + t + lookahead - (kernel_size - 1 - k) * dilation
            if 0 <= src < history + T:
                expected[t] += kernel[k] * u[src]
    assert torch.allclose(out, expected)
    assert torch.autograd.gradcheck(
        lambda a, b: DilatedDepthwiseConv.apply(a, b, dilation, T, lookahead), (u, kernel)
    )


@pytest.mark.parametrize("lookahead", [0, 2])
def test_dilated_depthwise_conv_reads_padding_rows_as_zeros(lookahead):
    """With ``padding``, the function equals itself on a copy of ``u`` whose padding
    rows are zero, forward and backward (the padding rows' gradient is zero), without
    keeping that copy: it keeps ``u`` (a view) and the mask."""
    torch.manual_seed(0)
    T, B, C = 9, 3, 4
    u = torch.randn(T, B, C + 2, dtype=torch.float64)[:, :, 1 : 1 + C].requires_grad_()
    kernel = torch.randn(5, C, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(T, B, 1, dtype=torch.bool)
    padding[:3, 1] = True  # left padding
    padding[-2:, 2] = True  # right padding
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = DilatedDepthwiseConv.apply(u, kernel, 2, T, lookahead, padding)
    assert all(
        t.untyped_storage().data_ptr()
        in {u.untyped_storage().data_ptr(), kernel.data_ptr(), padding.data_ptr()}
        for t in kept
    )
    expected = DilatedDepthwiseConv.apply(u.masked_fill(padding, 0.0), kernel, 2, T, lookahead)
    grad = torch.randn_like(out)
    got, want = (
        torch.autograd.grad(out, (u, kernel), grad),
        torch.autograd.grad(expected, (u, kernel), grad),
    )
    assert torch.equal(out, expected)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-12)
    assert torch.all(got[0][padding.expand(T, B, C)] == 0)
    assert torch.autograd.gradcheck(
        lambda a, b: DilatedDepthwiseConv.apply(a, b, 2, T, lookahead, padding), (u, kernel)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_module_gradients_match_loop_reference(causal):
    """The module's gradients (input and every parameter, with padding, in training
    mode without dropout) against autograd through the loop reference, float64: the
    hand-written backward passes of LocalConv and the Query included. Outputs at
    padding positions are not used by anyone, so they get no gradient."""
    torch.manual_seed(1)
    m = (
        HybridMultiheadAttention(12, 4, 2, kernel_size=3, dilation=2, causal=causal)
        .double()
        .train()
    )
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    T, B = 7, 3
    x = torch.randn(T, B, 12, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, :2] = True
    if causal:
        pad[2, -2:] = True
    grad = torch.randn(T, B, 12, dtype=torch.float64).masked_fill(pad.t().unsqueeze(-1), 0.0)
    inputs = [x, *m.parameters()]
    got = torch.autograd.grad(m(x, x, x, key_padding_mask=pad, need_weights=False)[0], inputs, grad)
    want = torch.autograd.grad(reference_hybrid(m, x, pad)[0], inputs, grad, allow_unused=True)
    for (name, _), g, w in zip([("input", x), *m.named_parameters()], got, want):
        w = torch.zeros_like(g) if w is None else w  # the alignment rows of in_proj are never read
        # 1e-6: LocalConv's kernel softmax runs in float32 even in a float64 module
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6), name


def test_local_conv_in_bfloat16_sums_in_float32():
    torch.manual_seed(0)
    conv = LocalConv(16, kernel_size=15, dilation=2).eval()
    u = torch.randn(40, 3, 16)
    full = conv(u)
    half = conv.bfloat16()(u.bfloat16())
    assert half.dtype == torch.bfloat16
    # bf16 inputs and output (8-bit mantissa); the sums themselves are float32
    assert (half.float() - full).abs().max() < 2e-2


def test_dilated_depthwise_conv_gradients_in_bfloat16_are_float32_sums():
    """bfloat16 input and output gradient, float32 kernel (as LocalConv calls it): the
    kernel's gradient is a float32 sum, equal to the float64 one of the same values to
    float32 rounding; the input's gradient is that of float64 rounded once to bfloat16."""
    torch.manual_seed(0)
    T = 40
    u = torch.randn(T, 3, 16).bfloat16().requires_grad_()
    kernel = torch.softmax(torch.randn(7, 16), dim=0).requires_grad_()
    grad = torch.randn(T, 3, 16).bfloat16()
    got_u, got_kernel = torch.autograd.grad(
        DilatedDepthwiseConv.apply(u, kernel, 2, T, 0), (u, kernel), grad
    )
    u64, kernel64 = u.detach().double().requires_grad_(), kernel.detach().double().requires_grad_()
    want_u, want_kernel = torch.autograd.grad(
        DilatedDepthwiseConv.apply(u64, kernel64, 2, T, 0), (u64, kernel64), grad.double()
    )
    assert got_u.dtype == torch.bfloat16 and got_kernel.dtype == torch.float32
    assert torch.allclose(got_kernel.double(), want_kernel, rtol=1e-5, atol=1e-5)
    # one rounding to bfloat16 (8 significant bits): within half a step, plus float32's share
    assert ((got_u.double() - want_u).abs() <= want_u.abs() * 2**-8 + 1e-6).all()


def test_drop_connect_only_in_training():
    conv = LocalConv(8, kernel_size=5, weight_dropout=0.5)
    conv.train()
    kernels = {tuple(conv.normalized_kernel().flatten().tolist()) for _ in range(5)}
    assert len(kernels) > 1, "DropConnect should resample the kernel in training"
    conv.eval()
    k = conv.normalized_kernel()
    assert torch.allclose(k.sum(0), torch.ones(8)), "eval kernel is the plain softmax"


def retain_dropout(module, only=None):
    """What ``fairseq-generate --retain-dropout [--retain-dropout-modules ...]`` does to
    a model's dropouts: fairseq's own ``make_generation_fast_`` of each."""
    for name, m in module.named_modules():
        if isinstance(m, FairseqDropout):
            m.make_generation_fast_(name, retain_dropout=True, retain_dropout_modules=only)
    return module


@pytest.mark.parametrize("kernel_size", [5, 1])
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.enable_grad], ids=["step", "autograd"])
def test_retained_drop_connect_decodes_as_the_whole_sequence_with_its_mask(grad_mode, kernel_size):
    """Under ``--retain-dropout`` (Monte-Carlo dropout) DropConnect stays on in inference,
    one mask per search as one per batch in a whole sequence's forward: decoding step by
    step from a seed gives that forward's output from the same seed (also for a kernel
    of one tap, which decodes without a ring)."""
    torch.manual_seed(0)
    m = HybridMultiheadAttention(
        16, 4, 2, kernel_size=kernel_size, dilation=2, conv_weight_dropout=0.5, causal=True
    ).eval()
    x = torch.randn(9, 3, 16)
    with torch.no_grad():
        plain, _ = m(x, x, x)
        retain_dropout(m, only=["LocalConv"])
        outputs = []
        for seed in (1, 1, 2):
            torch.manual_seed(seed)
            outputs.append(m(x, x, x)[0])
    assert (outputs[0] - plain).abs().max() > 1e-2, "the mask must change the output"
    assert torch.equal(outputs[0], outputs[1])
    assert (outputs[2] - outputs[0]).abs().max() > 1e-2, "another seed, another mask"
    torch.manual_seed(1)
    with grad_mode():
        steps = _incremental_outputs(m, x, [1] * 9)
    assert (steps - outputs[0]).abs().max() <= 1e-5


def test_retained_attention_dropout_reaches_the_dot_product_heads_when_decoding():
    """``--retain-dropout`` keeps the dot-product heads' attention dropout on: decoding
    one position at a time takes the general path, which applies it; without the option
    an evaluated module decodes deterministically."""
    torch.manual_seed(0)
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=3, dropout=0.5, causal=True).eval()
    x = torch.randn(8, 3, 16)

    def decoded(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return _incremental_outputs(m, x, [1] * 8)

    assert torch.equal(decoded(1), decoded(2))
    retain_dropout(m)
    assert torch.equal(decoded(1), decoded(1))
    assert (decoded(1) - decoded(2)).abs().max() > 1e-2


def _incremental_outputs(m, x, chunks, reorder_at=None, new_order=None):
    """Feed ``x`` to ``m`` in chunks through fairseq's incremental state; optionally
    reorder the state (as beam search does) before chunk ``reorder_at``."""
    state = {}
    outs = []
    pos = 0
    for i, n in enumerate(chunks):
        if reorder_at is not None and i == reorder_at:
            for module in m.modules():  # what FairseqIncrementalDecoder does
                if hasattr(module, "reorder_incremental_state"):
                    module.reorder_incremental_state(state, new_order)
        chunk = x[pos : pos + n]
        y, _ = m(chunk, chunk, chunk, incremental_state=state, need_weights=False)
        outs.append(y)
        pos += n
    return torch.cat(outs, dim=0)


# without gradients (as fairseq decodes) a single position takes the module's decoding
# step, which writes in place; with gradients, the differentiable path
STEP_PATHS = [
    pytest.param(torch.no_grad, id="decoding-step"),
    pytest.param(torch.enable_grad, id="autograd"),
]


@pytest.mark.parametrize("grad_mode", STEP_PATHS)
@pytest.mark.parametrize(
    "conv_heads, temperature, scaling",
    [(2, 1.0, "none"), (2, 4.0, "inv-sqrt-head-dim"), (4, 1.0, "none")],
)
def test_module_incremental_equals_full_multi_step_chunks(
    conv_heads, temperature, scaling, grad_mode
):
    torch.manual_seed(0)
    m = HybridMultiheadAttention(
        16,
        4,
        conv_heads,
        kernel_size=5,
        dilation=2,
        causal=True,
        query_temperature=temperature,
        output_scaling=scaling,
    ).eval()
    x = torch.randn(23, 3, 16)
    full, _ = m(x, x, x)
    # single steps, then several positions at once (fairseq's own lightconv gets this wrong)
    with grad_mode():
        inc = _incremental_outputs(m, x, [1] * 10 + [3, 1, 5, 4])
    assert (inc - full).abs().max() <= 1e-5


class OffsetLinear(torch.nn.Linear):
    """A linear layer whose forward is not ``F.linear`` of its weight, as fairseq's scalar
    quantization's ``IntLinear`` (which quantizes its weight in the forward, on CUDA)."""

    def forward(self, x):
        return super().forward(x) + 0.5


def test_decoding_step_calls_the_projections_that_replace_its_own():
    """fairseq's quantization replaces every ``nn.Linear`` of a model by a module of its
    own: the one-token decoding step calls the projections it finds, as the general path
    does, and so decodes as the whole sequence's forward."""
    torch.manual_seed(0)
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=3, causal=True).eval()
    for name in ("in_proj", "out_proj"):
        old = getattr(m, name)
        new = OffsetLinear(old.in_features, old.out_features)
        new.load_state_dict(old.state_dict())
        setattr(m, name, new)
    x = torch.randn(7, 2, 16)
    with torch.no_grad():
        full, _ = m(x, x, x)
        steps = _incremental_outputs(m, x, [1] * 7)
    assert (steps - full).abs().max() <= 1e-5


def test_incremental_decoding_under_autograd_gives_the_parallel_gradients():
    """With gradients on, the modules' one decoding path (LocalConv's ring, the Query's
    running merge) is differentiable: writing the ring in place would corrupt an earlier
    step's graph, and the Query's in-place merge is not followed by autograd."""
    torch.manual_seed(0)
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=3, dilation=2, causal=True).eval()
    x = torch.randn(9, 2, 16, requires_grad=True)
    full, _ = m(x, x, x)
    (grad_full,) = torch.autograd.grad(full.square().sum(), x)
    inc = _incremental_outputs(m, x, [1] * 6 + [3])
    (grad_inc,) = torch.autograd.grad(inc.square().sum(), x)
    assert (grad_inc - grad_full).abs().max() <= 1e-5


def test_scaled_decoding_step_rounds_its_half_precision_output_once():
    """--conv-head-scaling inv-sqrt-head-dim in a bf16 decoding step: the float32
    LocalConv and Query are multiplied and scaled in float32 and rounded once, as they
    are written into ``W^O``'s input (rounding the product, then the scaled product,
    is one bf16 step off in about a quarter of the entries)."""
    torch.manual_seed(0)
    # d_h = 12: a scale that is no power of two (one would multiply a bf16 exactly)
    m = HybridMultiheadAttention(
        48, 4, 2, kernel_size=3, causal=True, output_scaling="inv-sqrt-head-dim"
    )
    u = torch.randn(64, 24)  # B x Hc·dh
    proj = {"local": u, "score": torch.randn(64, 2), "value": torch.randn(64, 24)}
    paper = LocalConv(24, kernel_size=3)  # the same kernel, unscaled
    paper.load_state_dict(m.local_conv.state_dict())
    with torch.no_grad():  # (a search's steps)
        local = m.local_conv.step(u, {})  # the scale applied by LocalConv, in float32
        assert local.dtype == torch.float32
        assert torch.equal(local, paper.step(u, {}) * m.conv_output_scale)
        context = m.context_query.step(proj["score"], proj["value"], {})  # B x Hc x dh
        out = torch.empty(64, 24, dtype=torch.bfloat16)  # B x Hc·dh, a slice of W^O's input
        m._conv_step(proj, {}, out=out)
    assert torch.equal(out.view(64, 2, 12), (local.view(64, 2, 12) * context).to(torch.bfloat16))


@pytest.mark.parametrize("grad_mode", STEP_PATHS)
def test_module_incremental_reorder_follows_history(grad_mode):
    torch.manual_seed(0)
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=3, dilation=3, causal=True).eval()
    x = torch.randn(22, 4, 16)
    new_order = torch.tensor([2, 2, 0, 3])
    with grad_mode():
        inc = _incremental_outputs(m, x, [1] * 22, reorder_at=11, new_order=new_order)
    # the history after the reorder: rows take the first 11 positions of the rows they copy
    hist = torch.cat([x[:11, new_order], x[11:]], dim=0)
    full, _ = m(hist, hist, hist)
    assert (inc[11:] - full[11:]).abs().max() <= 1e-5
    assert (inc[:11][:, new_order] - full[:11]).abs().max() <= 1e-5


@pytest.mark.parametrize("grad_mode", STEP_PATHS)
@pytest.mark.parametrize("right_padded", [True, False])
def test_padding_fed_step_by_step_stays_out_of_later_steps(grad_mode, right_padded):
    """fairseq's decoder passes the padding mask of the new position only, and only at a
    step where some sentence has padding there (beam search never feeds any): the padded
    keys stay out of every later step, the steps without a mask included, as in the
    parallel forward over the whole prefix with its mask; a reordering reorders that
    history with the caches."""
    torch.manual_seed(0)
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=3, causal=True).eval()
    m.right_padded = right_padded  # the parallel forward below needs the mask applied
    x = torch.randn(12, 3, 16)
    pad = torch.zeros(3, 12, dtype=torch.bool)
    pad[0, 3] = pad[2, 1] = pad[2, 7] = True
    new_order, reorder_at = torch.tensor([2, 0, 2]), 6
    state, outs = {}, []
    with grad_mode():
        for t in range(12):
            if t == reorder_at:
                for module in m.modules():
                    if hasattr(module, "reorder_incremental_state"):
                        module.reorder_incremental_state(state, new_order)
            mask = pad[:, t : t + 1] if pad[:, t].any() else None
            step = x[t : t + 1]
            outs.append(
                m(
                    step,
                    step,
                    step,
                    key_padding_mask=mask,
                    incremental_state=state,
                    need_weights=False,
                )[0]
            )
    inc = torch.cat(outs, dim=0)
    hist = torch.cat([x[:reorder_at, new_order], x[reorder_at:]], dim=0)
    hist_pad = torch.cat([pad[new_order, :reorder_at], pad[:, reorder_at:]], dim=1)
    m.right_padded = False
    full, _ = m(hist, hist, hist, key_padding_mask=hist_pad)
    real = ~hist_pad.t()  # T x B: padded positions' own outputs are not compared
    inc[:reorder_at] = inc[:reorder_at, new_order]
    assert (inc[real] - full[real]).abs().max() <= 1e-5


def test_decoding_step_keeps_its_rotated_kernels_for_one_search_only():
    """The decoding step takes LocalConv's kernel (softmax and its rotations to the
    ring's order) once per search and keeps it in that search's incremental state. A weight written in place between two
    searches (fairseq's optimizers write through ``.data``) must reach the next search,
    which starts with a new state: it decodes as the full forward of the new weights."""
    torch.manual_seed(0)
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=5, dilation=2, causal=True).eval()
    x = torch.randn(9, 3, 16)
    with torch.no_grad():
        before = _incremental_outputs(m, x, [1] * 9)
        m.local_conv.weight.data.add_(torch.randn_like(m.local_conv.weight))
        after = _incremental_outputs(m, x, [1] * 9)
        full, _ = m(x, x, x)
    assert (before - full).abs().max() > 1e-3, "the weight change must change the output"
    assert (after - full).abs().max() <= 1e-5


def test_self_attention_only():
    m = HybridMultiheadAttention(8, 2, 1, kernel_size=3)
    x, y = torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="self-attention only"):
        m(x, y, y)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(embed_dim=10, num_heads=4, conv_heads=2, kernel_size=3), "divisible"),
        (dict(embed_dim=8, num_heads=4, conv_heads=5, kernel_size=3), "conv_heads"),
        (dict(embed_dim=8, num_heads=4, conv_heads=2, kernel_size=0), "kernel_size"),
        (dict(embed_dim=8, num_heads=4, conv_heads=2, kernel_size=3, dilation=0), "dilation"),
        (
            dict(embed_dim=8, num_heads=4, conv_heads=2, kernel_size=3, query_temperature=0.0),
            "temperature",
        ),
    ],
)
def test_module_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridMultiheadAttention(**kwargs)


def test_head_outputs_are_what_the_output_projection_mixes():
    torch.manual_seed(0)
    m = HybridMultiheadAttention(16, 4, 2, kernel_size=3, dilation=2).eval()
    x = torch.randn(6, 2, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, :2] = True
    with torch.no_grad():
        heads = m.head_outputs(x, pad)
        out, _ = m(x, x, x, key_padding_mask=pad)
        mixed = m.out_proj(torch.cat([heads["dot"], heads["conv"]], dim=-1))
        weight, bias = m.projection("local")
        local = m.local_conv(torch.nn.functional.linear(x, weight, bias), pad)
    assert torch.allclose(mixed, out, atol=1e-6)
    assert torch.allclose(heads["local"], local, atol=1e-6)


@pytest.mark.parametrize(
    "embed_dim, heads, conv_heads", [(512, 8, 4), (1024, 16, 8), (256, 4, 2), (128, 4, 1)]
)
def test_projected_q_k_v_are_aligned_for_fused_kernels(embed_dim, heads, conv_heads):
    """Fused attention kernels on GPUs read q, k and v in place and need every row to
    start on a 16-byte boundary (8 half-precision elements): the fused projection's
    width and each slice's offset are multiples of 8 (a misaligned width crashed the
    flash kernel with 'misaligned address' on an H100)."""
    m = HybridMultiheadAttention(embed_dim, heads, conv_heads, kernel_size=3)
    assert m.in_proj.out_features % 8 == 0
    proj = m._project(torch.randn(5, 2, embed_dim))
    for name in ("q", "k", "v", "local", "value"):
        if name in proj:
            assert proj[name].storage_offset() % 8 == 0, name
            assert all(stride % 8 == 0 for stride in proj[name].stride()[:-1]), name


@pytest.mark.parametrize("impl", ["taps", "triton"])
def test_scaled_conv_heads_do_not_overflow_in_float16(impl):
    """--fp16 with --conv-head-scaling inv-sqrt-head-dim: the scale is folded into
    LocalConv's float32 kernel, so a conv-head product of 300 x 300 (past float16's 65504)
    comes out as 300 x 300 / 4, finite, in the parallel forward and step by step alike."""
    from tpp_plugin.modules import conv_heads_triton

    if impl == "triton" and not conv_heads_triton.usable_on(torch.zeros(1, dtype=torch.float16)):
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    if impl == "triton":
        pytest.importorskip("triton")
    assert torch.isinf(torch.tensor(300.0, dtype=torch.float16) ** 2)  # unscaled, it would overflow
    m = HybridMultiheadAttention(
        32,
        2,
        2,
        kernel_size=3,
        causal=True,
        output_scaling="inv-sqrt-head-dim",
        conv_heads_impl=impl,
    ).eval()  # d_h = 16: scale 1/4
    with torch.no_grad():
        m.in_proj.weight.zero_()
        m.in_proj.bias.zero_()
        for name in ("local", "value"):  # LocalConv and the Query both 300 wherever there is input
            m.projection(name)[1].fill_(300.0)
        m.out_proj.weight.copy_(torch.eye(32) / 256)
        m.out_proj.bias.zero_()
    m.half()
    x = torch.randn(6, 2, 32).half()
    with torch.no_grad():
        conv = m.head_outputs(x)["conv"]
        full = m(x, x, x, need_weights=False)[0]
        state = {}
        steps = torch.cat(
            [m(t, t, t, incremental_state=state, need_weights=False)[0] for t in x.split(1)]
        )
    assert torch.isfinite(conv).all() and torch.isfinite(full).all() and torch.isfinite(steps).all()
    # from position 2 on, the three taps all read input: LocalConv = 300 exactly
    assert torch.equal(conv[2:], torch.full_like(conv[2:], 22500.0))
    assert torch.allclose(
        full[2:].float(), torch.full((4, 2, 32), 22500.0 / 256), rtol=1e-3
    )  # a float16 step
    assert torch.allclose(steps.float(), full.float(), rtol=1e-3)
