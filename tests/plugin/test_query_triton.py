"""The conv heads as Triton kernels for training (``--conv-heads-impl fused``): the Query
times LocalConv's output, and LocalConv computed in the same launch, give the same
function and gradients as the explicit softmax and convolution in float64, as accurate
as the PyTorch operations in float32 and half precision, every output element written,
and the hybrid attention equal to its PyTorch path. On a CUDA GPU where there is one, otherwise through
Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` without a GPU)."""

import pytest
import torch

from tpp_plugin.modules import ContextQuery, HybridMultiheadAttention, conv_heads_triton

pytest.importorskip("triton", reason="Triton is installed with the test requirements on Linux")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not conv_heads_triton.interpreting():
    pytest.skip(
        "no GPU, and TRITON_INTERPRET is not set (tests/conftest.py sets it)",
        allow_module_level=True,
    )

from tpp_plugin.modules.local_conv import DilatedDepthwiseConv  # noqa: E402
from tpp_plugin.modules.query_triton import BLOCK_T, conv_heads  # noqa: E402


def explicit(local, scores, values, padding, heads, causal, temperature):
    """``local ⊙ q`` with every softmax written out as a ``T x T`` matrix."""
    length, bsz, channels = values.shape
    s = scores.permute(1, 2, 0) / temperature  # B x H x T
    if padding is not None:
        s = s.masked_fill(padding[:, None, :], -1e9)
    logits = s.unsqueeze(-2).expand(-1, -1, length, -1)  # B x H x t x τ
    if causal:
        future = torch.ones(length, length, dtype=torch.bool, device=s.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
    values = values.reshape(length, bsz, heads, -1).permute(1, 2, 0, 3)  # B x H x T x dh
    q = torch.softmax(logits, -1) @ values  # B x H x T x dh
    return local * q.permute(2, 0, 1, 3).reshape(length, bsz, channels)


def zero_padding(local, padding):
    """LocalConv reads padding as zero: with a one-tap kernel, its output there is zero."""
    return local if padding is None else local.masked_fill(padding.t().unsqueeze(-1), 0.0)


def explicit_query(local, scores, values, padding, heads, causal, temperature):
    """:func:`explicit` with ``local`` as a one-tap LocalConv of ones gives it."""
    return explicit(
        zero_padding(local, padding), scores, values, padding, heads, causal, temperature
    )


def query_times(local, scores, values, padding, heads, causal, temperature=1.0):
    """``local ⊙ q`` through :func:`conv_heads`: LocalConv one tap (whose softmax is 1),
    the identity (but at padding), so that the Query's part is checked on its own."""
    acc = torch.promote_types(local.dtype, torch.float32)
    weight = torch.zeros(local.size(-1), 1, dtype=acc, device=local.device)
    return conv_heads(local, weight, scores, values, padding, heads, causal, temperature, (1, 0))


def inputs(length, padded, dtype, bsz=3, heads=2, head_dim=8, seed=0):
    """Random ``local``, ``scores``, ``values`` (sharing a mean of 5, as after a projection
    can), a padding mask (``left``: up to half of a sentence, the source side; ``right``)
    and the output's gradient, which is 0 where a decoder row's prefix is padding only."""
    gen = torch.Generator().manual_seed(seed)
    channels = heads * head_dim

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(DEVICE)

    local = rand(length, bsz, channels)
    scores = rand(length, bsz, heads, scale=3.0)
    values = rand(length, bsz, channels, shift=5.0)
    padding = None
    if padded:
        lengths = torch.tensor([length, max(1, length - length // 2), max(1, length - 1)])
        positions = torch.arange(length)
        if padded == "left":
            padding = positions[None, :] < (length - lengths)[:, None]
        else:
            padding = positions[None, :] >= lengths[:, None]
        padding = padding.to(DEVICE)
    grad = rand(length, bsz, channels)
    if padding is not None:
        # a decoder row that pools padding only is never used: no gradient reaches it
        grad = grad * (~padding.t().cumprod(0).bool()).unsqueeze(-1)
    cast = [t.to(dtype).requires_grad_() for t in (local, scores, values)]
    exact = [t.requires_grad_() for t in (local, scores, values)]
    return cast, exact, padding, grad


def outputs_and_grads(fn, tensors, padding, grad, causal, temperature, heads=2):
    out = fn(*tensors, padding, heads, causal, temperature)
    return [out, *torch.autograd.grad(out, tensors, grad.to(out.dtype))]


def errors(got, expected, rows):
    """Relative errors (norms) of the output and the three gradients; the output and
    ``local``'s gradient on the rows in use only."""
    pairs = [
        (g[rows] if i < 2 else g, e[rows] if i < 2 else e)
        for i, (g, e) in enumerate(zip(got, expected))
    ]
    return [((g.double() - e).norm() / e.norm().clamp_min(1e-300)).item() for g, e in pairs]


def used_rows(padding, causal, length, bsz=3):
    """Rows whose output is used: all but a decoder's rows that pool padding only."""
    if padding is None or not causal:
        return torch.ones(length, bsz, dtype=torch.bool, device=DEVICE)
    return ~padding.t().cumprod(0).bool()


# lengths around the kernels' blocks of BLOCK_T rows, one position, and several blocks
LENGTHS = [1, 2, BLOCK_T - 1, BLOCK_T, BLOCK_T + 1, 2 * BLOCK_T + 1, 300]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("padded", [None, "left", "right"])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_equals_the_explicit_softmax_in_float64(length, padded, causal):
    _, exact, padding, grad = inputs(length, padded, torch.float64)
    detached = [t.detach().clone().requires_grad_() for t in exact]
    got = outputs_and_grads(query_times, detached, padding, grad, causal, 0.75)
    expected = outputs_and_grads(explicit_query, exact, padding, grad, causal, 0.75)
    rows = used_rows(padding, causal, length)
    for name, error in zip(("output", "local", "scores", "values"), errors(got, expected, rows)):
        assert error < 1e-12, (name, error)
    if padding is not None:  # padding positions get no gradient
        pad = padding.t()
        assert (got[2][pad] == 0).all() and (got[3][pad] == 0).all()


# (length, taps, dilation, lookahead): a kernel wider than the sentence, a centred
# (encoder) one, several blocks
CONVS = [(1, 3, 1, 0), (7, 15, 2, 0), (BLOCK_T + 1, 5, 2, 0), (40, 5, 1, 2), (70, 3, 1, 0)]


@pytest.mark.parametrize(
    "causal, conv",
    [(causal, conv) for causal in (False, True) for conv in CONVS if not (causal and conv[3])],
    ids=lambda c: "T{}-F{}-d{}-a{}".format(*c)
    if isinstance(c, tuple)
    else ("decoder" if c else "encoder"),
)
@pytest.mark.parametrize("padded", [None, "left", "right"])
@pytest.mark.parametrize("dropconnect", [False, True], ids=["", "dropconnect"])
def test_conv_heads_equal_the_convolution_and_softmax_in_float64(causal, conv, padded, dropconnect):
    """LocalConv in the same launch (:func:`conv_heads`): against the PyTorch convolution
    (its taps in float64) of the weight's softmax (times a DropConnect mask and an output
    scale) times the explicit softmax; gradients of ``u``, the weight, the scores and
    the values."""
    length, taps, dilation, lookahead = conv  # (a decoder's LocalConv looks ahead never)
    _, (u, scores, values), padding, grad = inputs(length, padded, torch.float64, seed=1)
    weight = torch.randn(u.size(-1), taps, dtype=torch.float64, device=DEVICE)
    mask, scale = None, 1.0
    if dropconnect:
        gen = torch.Generator().manual_seed(2)
        mask = torch.rand(weight.shape, generator=gen, dtype=torch.float64).gt(0.3).double()
        mask, scale = mask.to(DEVICE), 0.625  # (exact in float32, as the kernels take it)
    rows = padding.t().unsqueeze(-1) if padding is not None else None

    def pytorch(u, weight, scores, values):
        kernel = torch.softmax(weight, -1) * (mask if dropconnect else 1) * scale
        local = DilatedDepthwiseConv.apply(u, kernel.t(), dilation, length, lookahead, rows)
        return explicit(local, scores, values, padding, 2, causal, 0.75)

    def fused(u, weight, scores, values):
        return conv_heads(
            u, weight, scores, values, padding, 2, causal, 0.75, (dilation, lookahead), mask, scale
        )

    results = []
    for fn in (pytorch, fused):
        leaves = [t.detach().clone().requires_grad_() for t in (u, weight, scores, values)]
        out = fn(*leaves)
        results.append([out, *torch.autograd.grad(out, leaves, grad)])
    used = used_rows(padding, causal, length)
    expected, got = results
    assert (got[0] - expected[0])[used].abs().max() <= 1e-12 * expected[0].abs().max()
    for name, g, e in zip(("u", "weight", "scores", "values"), got[1:], expected[1:]):
        assert (g - e).abs().max() <= 1e-12 * (1 + e.abs().max()), name
    assert got[2].stride() == weight.stride()  # the parameter's layout: no copy to store it


def pytorch_path(local, scores, values, padding, heads, causal, temperature):
    """The PyTorch operations the kernels replace (ContextQuery's pooling, then the product)."""
    query = ContextQuery(heads, values.size(-1) // heads, causal, temperature)
    return zero_padding(local, padding) * query(scores, values, padding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_as_accurate_as_the_pytorch_operations(dtype, causal):
    """Against float64, in each training dtype: no error more than twice the PyTorch
    path's (both compute in float32, by other formulas: a scan where it multiplies
    blocks of weights)."""
    length = 2 * BLOCK_T + 7
    cast, exact, padding, grad = inputs(length, "left" if causal else "right", dtype)
    expected = outputs_and_grads(explicit_query, exact, padding, grad, causal, 1.0)
    rows = used_rows(padding, causal, length)
    kernel = errors(
        outputs_and_grads(query_times, cast, padding, grad, causal, 1.0), expected, rows
    )
    again = [t.detach().clone().requires_grad_() for t in cast]
    torch_ = errors(
        outputs_and_grads(pytorch_path, again, padding, grad, causal, 1.0), expected, rows
    )
    for name, k, t in zip(("output", "local", "scores", "values"), kernel, torch_):
        assert k <= 2 * t + 1e-7, (name, k, t)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_every_output_element_is_written(causal):
    """With uninitialised memory filled with NaN (PyTorch's deterministic mode), every
    element of the output and of the gradients comes out finite: the kernels wrote it
    (the Query times a given LocalConv output, and LocalConv computed in the launch)."""
    cast, _, padding, grad = inputs(BLOCK_T + 5, "left", torch.float32)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.empty(4, device=DEVICE).isnan().all()  # the poison is on
        got = outputs_and_grads(query_times, cast, padding, grad, causal, 1.0)
        u = cast[0].detach().requires_grad_()
        weight = torch.rand(u.size(-1), 5, device=DEVICE).requires_grad_()
        mask = torch.ones(u.size(-1), 5, device=DEVICE)
        for m in (None, mask):  # (with a mask: the kernel's own copy of the softmax too)
            out = conv_heads(u, weight, *cast[1:], padding, 2, causal, 1.0, (2, 0), m, 0.5)
            got += [out, *torch.autograd.grad(out, (u, weight, *cast[1:]), grad.float())]
    finally:
        torch.use_deterministic_algorithms(was)
    for t in got:
        assert t.isfinite().all()


def test_inputs_of_any_row_stride_and_expanded_gradients():
    """Slices of one projection (the layer's case: rows 40 wide) and a gradient that is one
    value expanded (``out.sum().backward()``), whose strides are 0."""
    torch.manual_seed(0)
    proj = torch.randn(20, 3, 40, dtype=torch.float64, device=DEVICE)
    for causal in (False, True):
        grads = []
        for fn in (query_times, explicit):
            leaf = proj.clone().requires_grad_()
            local, values, scores = leaf[..., :16], leaf[..., 16:32], leaf[..., 32:34]
            out = fn(local, scores, values, None, 2, causal, 1.0)
            out.sum().backward()
            grads.append((out, leaf.grad))
        (out, grad), (want_out, want_grad) = grads
        assert (out - want_out).abs().max() < 1e-12
        assert (grad - want_grad).abs().max() < 1e-11
        assert grad[..., 34:].abs().max() == 0  # nothing written outside the slices


class GivenMask(torch.nn.Module):
    """DropConnect with a given mask (``C x F``, 0 or 1) and rate ``p``."""

    def __init__(self, mask, p):
        super().__init__()
        self.mask, self.p = mask, p

    def forward(self, kernel):  # C x F
        return kernel * self.mask / (1 - self.p)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("length", [1, 40])
@pytest.mark.parametrize("dropconnect", [0.0, 0.5], ids=["", "dropconnect"])
def test_hybrid_attention_fused_equals_its_pytorch_path(causal, length, dropconnect):
    """The layer with ``conv_heads_impl="fused"`` against ``"taps"`` in float64: output and
    every parameter's gradient, with padding (left in the encoder, right in the decoder,
    where the layer drops the mask), a temperature, the output scale and DropConnect
    (the taps given the mask the fused layer draws). The kernels take the output scale as
    float32, as Triton passes a float: a head width whose scale is exact in float32."""
    torch.manual_seed(0)
    options = dict(
        kernel_size=5,
        dilation=2,
        causal=causal,
        right_padded=causal,
        output_scaling="inv-sqrt-head-dim",
        query_temperature=0.5,
        conv_weight_dropout=dropconnect,
    )
    taps = HybridMultiheadAttention(64, 4, 2, conv_heads_impl="taps", **options).double()
    fused = HybridMultiheadAttention(64, 4, 2, conv_heads_impl="fused", **options).double()
    fused.load_state_dict(taps.state_dict())
    fused.to(DEVICE)
    torch.manual_seed(1)
    mask, scale = fused.local_conv.dropconnect()  # the draw the fused layer's forward makes
    assert (mask is None) == (dropconnect == 0)
    if mask is not None:
        assert scale == fused.local_conv.output_scale / 0.5 == 0.5  # (1 / √16 / 0.5)
        taps.local_conv.weight_dropout_module = GivenMask(mask, 0.5)
    x = torch.randn(length, 3, 64, dtype=torch.float64)
    padding = torch.zeros(3, length, dtype=torch.bool)
    padding[1, slice(-2, None) if causal else slice(0, 2)] = length > 2
    results = []
    for layer in (taps, fused):
        layer.to(DEVICE)
        torch.manual_seed(1)
        out, _ = layer(
            x.to(DEVICE), None, None, key_padding_mask=padding.to(DEVICE), need_weights=False
        )
        out = out * ~padding.t().unsqueeze(-1).to(DEVICE)
        out.square().sum().backward()
        results.append((out, {n: p.grad for n, p in layer.named_parameters()}))
    (out_taps, grads_taps), (out_fused, grads_fused) = results
    assert (out_fused - out_taps).abs().max() < 1e-12
    for name, g in grads_taps.items():
        assert (grads_fused[name] - g).abs().max() <= 1e-11 * (1 + g.abs().max()), name


def test_fused_layer_keeps_drop_connect_in_inference_where_retained():
    """Under ``--retain-dropout`` (fairseq's ``make_generation_fast_``) the fused layer
    draws DropConnect's mask in inference too (a new one per forward, from the seed);
    otherwise an evaluated layer has none."""
    torch.manual_seed(0)
    layer = HybridMultiheadAttention(
        32, 4, 2, kernel_size=5, conv_weight_dropout=0.5, conv_heads_impl="fused"
    )
    layer = layer.to(DEVICE).eval()
    x = torch.randn(7, 2, 32, device=DEVICE)

    def output(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return layer(x, None, None, need_weights=False)[0]

    plain = output(1)
    assert layer.local_conv.dropconnect()[0] is None
    assert torch.equal(output(2), plain)
    layer.local_conv.weight_dropout_module.make_generation_fast_("", retain_dropout=True)
    mask, scale = layer.local_conv.dropconnect()
    assert mask is not None and scale == layer.local_conv.output_scale / 0.5
    assert torch.equal(output(1), output(1))
    assert (output(1) - plain).abs().max() > 1e-3
    assert (output(2) - output(1)).abs().max() > 1e-3


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_the_operators_torch_compile_calls_pass_torch_library_checks(causal, weight_dtype):
    """The forward and backward operators (``torch.compile``'s graphs call them): schema,
    fake tensors (shapes, strides, dtypes, also symbolic), autograd, and AOTAutograd's
    dynamic-shape dispatch, by ``torch.library.opcheck``; padding and DropConnect's mask;
    LocalConv's weight in each training dtype (``--bf16``, ``--fp16`` cast it). Sentences
    of two blocks of rows with the float32 weight, of a few rows with the others (each
    check runs the kernels several times, slowly in Triton's interpreter)."""
    from tpp_plugin.modules import query_triton

    length = BLOCK_T + 3 if weight_dtype == torch.float32 else 5
    (u, scores, values), _, padding, grad = inputs(length, "left", torch.float32)
    weight = torch.randn(u.size(-1), 3, device=DEVICE).to(weight_dtype).requires_grad_()
    mask = torch.ones(u.size(-1), 3, device=DEVICE)
    mask[0, 1] = 0
    geometry = torch.tensor((2, 0))  # (dilation, lookahead)
    forward = (u, weight, mask, scores, values, padding, 2, causal, 0.5, 0.25, geometry)
    torch.library.opcheck(query_triton.conv_heads_forward, forward)
    out, *kept = query_triton.conv_heads_forward(*forward)
    local, lse, soft, kernel = (t.detach() for t in kept)
    backward = (
        grad.float(), u.detach(), soft, kernel, mask, local, scores.detach(), values.detach(),
        padding, lse, geometry, 2, causal, 0.5, 0.25, weight_dtype,
    )  # fmt: skip
    torch.library.opcheck(query_triton.conv_heads_backward, backward)
    # an empty batch: no program runs, the outputs are still written
    empty = [t[:0].detach().requires_grad_() for t in (u, scores, values)]
    forward = (empty[0], weight, mask, *empty[1:], padding[:, :0], 2, causal, 0.5, 0.25, geometry)
    torch.library.opcheck(query_triton.conv_heads_forward, forward)
