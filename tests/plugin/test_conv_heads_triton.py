"""The conv heads' Triton kernels (``--conv-heads-impl triton``) compute the same functions
as the PyTorch operations: LocalConv's convolution forward and both gradients, and a
decoding step of the conv heads (with beam reordering, after a multi-position call,
mixed with the PyTorch step). Compiled on a CUDA GPU where there is one, otherwise on
the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, which tests/conftest.py
sets on machines without a GPU); and compiled ahead of time for an H100 by Triton's own
compiler in any case. Also: the option reaches every conv head of a model and changes
nothing in its output, gradients or step-by-step decoding, and the default stays the
PyTorch operations."""

import argparse

import pytest
import torch
from fairseq.models import ARCH_CONFIG_REGISTRY

from support import build_model, make_dictionary, random_tokens
from tpp_plugin.modules import HybridMultiheadAttention, LocalConv, conv_heads_triton
from tpp_plugin.models.transformer_pp.config import ConvHeadsConfig
from tpp_plugin.modules.local_conv import DilatedDepthwiseConv

triton = pytest.importorskip(
    "triton", reason="Triton is installed with the test requirements on Linux"
)
TritonConv = conv_heads_triton.TritonDilatedDepthwiseConv
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not conv_heads_triton.interpreting():
    pytest.skip(
        "no GPU, and TRITON_INTERPRET is not set (tests/conftest.py sets it)",
        allow_module_level=True,
    )


def relative_error(got, expected):
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def conv_and_grads(fn, u, kernel, dilation, out_len, lookahead, grad, padding=None):
    out = fn.apply(u, kernel, dilation, out_len, lookahead, padding)
    grad_u, grad_kernel = torch.autograd.grad(out, (u, kernel), grad)
    return out, grad_u, grad_kernel


# (len(u), out_len, batch, channels, taps, dilation, lookahead): a whole sequence; new
# positions behind a buffered history; a centred (encoder) kernel; a kernel wider than
# the sequence; rows and channels that are not multiples of the kernels' blocks
SHAPES = [
    (9, 9, 3, 8, 5, 1, 0),
    (13, 13, 2, 70, 3, 2, 0),
    (20, 4, 3, 16, 7, 2, 0),
    (11, 11, 2, 8, 5, 2, 4),
    (5, 5, 2, 8, 15, 2, 0),
    (31, 31, 3, 130, 15, 2, 0),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-out{}-B{}-C{}-F{}-d{}-a{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_triton_kernels_equal_the_taps(shape, dtype):
    length, out_len, bsz, channels, taps, dilation, lookahead = shape
    torch.manual_seed(hash(shape) % 1000)
    # u as the attention hands it over: a slice of a wider projection (not contiguous)
    u = torch.randn(length, bsz, channels + 10, dtype=dtype, device=DEVICE)[:, :, 3 : 3 + channels]
    u.requires_grad_(True)
    kernel = (
        torch.randn(channels, taps, dtype=dtype, device=DEVICE).softmax(-1).t()
    )  # F x C, a view
    kernel = kernel.detach().requires_grad_(True)
    grad = torch.randn(out_len, bsz, channels, dtype=dtype, device=DEVICE)
    padding = None
    if length == out_len:  # a whole sequence: padding rows, read as zeros, in one of them
        padding = torch.zeros(length, bsz, 1, dtype=torch.bool, device=DEVICE)
        padding[: length // 3, 1] = True
    expected = conv_and_grads(
        DilatedDepthwiseConv, u, kernel, dilation, out_len, lookahead, grad, padding
    )
    got = conv_and_grads(TritonConv, u, kernel, dilation, out_len, lookahead, grad, padding)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    for name, g, e in zip(("output", "input gradient", "kernel gradient"), got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        assert relative_error(g, e) < tolerance, name


def test_triton_kernels_in_bfloat16_sum_in_float32():
    """In bfloat16 the kernels sum the taps in float32 and round once, so every element
    lies within one bfloat16 step (2^-7 relative) of the float64 result, plus what the
    float32 sum itself may be off by, which scales with the terms summed, not with the
    result (1e-6 of the largest element: for a sum that nearly cancels, the float32
    error alone can exceed a step of the result; a float32 sum in another order than
    the interpreter's, rounded to nearest, did so for 1 of 300 seeds). (Triton's
    interpreter converts to bfloat16 by truncation, a GPU rounds to nearest: the bound
    holds for both.)"""
    torch.manual_seed(0)
    u = torch.randn(33, 4, 72, device=DEVICE).bfloat16().requires_grad_(True)
    kernel = (
        torch.randn(72, 11, device=DEVICE).softmax(-1).t().bfloat16().detach().requires_grad_(True)
    )
    grad = torch.randn(33, 4, 72, device=DEVICE).bfloat16()
    exact = conv_and_grads(
        DilatedDepthwiseConv,
        u.double().detach().requires_grad_(True),
        kernel.double().detach().requires_grad_(True),
        2,
        33,
        0,
        grad.double(),
    )
    got = conv_and_grads(TritonConv, u, kernel, 2, 33, 0, grad)
    for name, g, e in zip(("output", "input gradient", "kernel gradient"), got, exact):
        assert g.dtype == torch.bfloat16, name
        step = (
            e.abs() * 2.0**-7 + 1e-6 * e.abs().max()
        )  # a bfloat16 step above |e|, and the float32 sum's error
        assert ((g.double() - e).abs() <= step).all(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernels_take_a_float32_kernel_with_half_precision_input(dtype):
    """As LocalConv runs them in a half-precision model: the input (and its gradient) in
    bf16 or fp16, the kernel its float32 softmax. Output and input gradient as the taps
    give them (both sum in float32 and round once: within a step of the dtype), the
    kernel's gradient in float32."""
    torch.manual_seed(1)
    u = torch.randn(29, 3, 40, device=DEVICE).to(dtype).requires_grad_(True)
    kernel = (
        torch.randn(40, 7, device=DEVICE).softmax(-1).t().detach().requires_grad_(True)
    )  # F x C, float32
    grad = torch.randn(29, 3, 40, device=DEVICE).to(dtype)
    expected = conv_and_grads(DilatedDepthwiseConv, u, kernel, 2, 29, 0, grad)
    got = conv_and_grads(TritonConv, u, kernel, 2, 29, 0, grad)
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    for name, g, e, tolerance in zip(
        ("output", "input gradient", "kernel gradient"), got, expected, (step, step, 1e-6)
    ):
        assert g.dtype == e.dtype and torch.isfinite(g).all(), name
        assert relative_error(g, e) < tolerance, name


# (width of the projection that u is a slice of, u's first channel): 8 mod 16 at an
# aligned offset (every preset's), aligned for float32 only, and aligned for neither
ROWS = [(40, 8), (44, 4), (42, 3)]


@pytest.mark.parametrize("width, offset", ROWS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_with_aligned_and_unaligned_rows(width, offset, dtype):
    """The kernels are told that u's rows start on 16 bytes only where they do (a false
    hint reads wrong or faults on a GPU; the interpreter ignores hints, so the alignment
    itself is checked here, and the results on a GPU)."""
    torch.manual_seed(width)
    proj = torch.randn(21, 3, width, device=DEVICE).to(dtype)
    u = proj[:, :, offset : offset + 32]  # T x B x C, a slice as the attention hands it
    per_row = 16 // proj.element_size()
    aligned = width % per_row == 0 and offset % per_row == 0
    assert conv_heads_triton._row_align(u) == (per_row if aligned else 1)
    assert conv_heads_triton._row_align(u.contiguous()) == per_row
    u.requires_grad_(True)
    kernel = (
        torch.randn(32, 5, device=DEVICE).softmax(-1).t().detach().requires_grad_(True)
    )  # float32, a view
    grad = torch.randn(21, 3, 32, device=DEVICE).to(dtype)
    expected = conv_and_grads(DilatedDepthwiseConv, u, kernel, 2, 21, 0, grad)
    got = conv_and_grads(TritonConv, u, kernel, 2, 21, 0, grad)
    tolerance = 1e-6 if dtype == torch.float32 else 2.0**-7
    for name, g, e in zip(("output", "input gradient", "kernel gradient"), got, expected):
        assert g.dtype == e.dtype and relative_error(g, e) < tolerance, name


@pytest.mark.parametrize("programs", [1, 2, 3, 7, 1000])
def test_kernel_gradient_splits_rows_among_programs(programs):
    """A GPU splits the rows among a few programs per multiprocessor; any split gives the
    same sums (one program each where there is no GPU, unless asked)."""
    torch.manual_seed(programs)
    u = torch.randn(23, 3, 70, dtype=torch.float64, device=DEVICE)
    grad = torch.randn(23, 3, 70, dtype=torch.float64, device=DEVICE)
    kernel = (
        torch.randn(70, 5, dtype=torch.float64, device=DEVICE).softmax(-1).t().requires_grad_(True)
    )
    (expected,) = torch.autograd.grad(DilatedDepthwiseConv.apply(u, kernel, 2, 23, 0), kernel, grad)
    got = conv_heads_triton._kernel_grad(
        grad, u, 5, 8, -2, programs=programs
    )  # a = (F-1)·δ, s = -δ
    assert relative_error(got, expected) < 1e-12


def test_triton_kernels_accept_empty_batches_and_single_positions():
    kernel = torch.randn(4, 3, device=DEVICE).softmax(-1).t()
    assert TritonConv.apply(torch.randn(0, 2, 4, device=DEVICE), kernel, 1, 0, 0).shape == (0, 2, 4)
    u = torch.randn(1, 2, 4, device=DEVICE, requires_grad=True)
    out = TritonConv.apply(u, kernel, 2, 1, 0)
    assert torch.allclose(out, u * kernel[-1])  # one position sees only itself
    (grad_u,) = torch.autograd.grad(out.sum(), u)
    assert torch.allclose(grad_u, kernel[-1].expand_as(u))


@pytest.mark.parametrize("version,refused", [("3.6.0", True), ("3.7.0", False), ("4.0.1", False)])
def test_an_interpreter_that_cannot_run_the_kernels_is_refused_with_the_reason(
    version, refused, monkeypatch
):
    """Triton 3.6's interpreter fails deep inside every launch with NumPy 2.4 (it reads
    integer arguments as one-element arrays), and on the decoding step's kernel."""
    if DEVICE == "cuda":
        pytest.skip("the interpreter runs only where there is no GPU")
    monkeypatch.setattr(triton, "__version__", version)
    conv_heads_triton.interpreter_problem.cache_clear()
    try:
        kernel = torch.randn(4, 3).softmax(-1).t()
        u = torch.randn(5, 2, 4)
        if refused:
            with pytest.raises(RuntimeError, match=r"Triton 3\.6\.0's interpreter .* triton>=3\.7"):
                TritonConv.apply(u, kernel, 1, 5, 0)
        else:
            assert TritonConv.apply(u, kernel, 1, 5, 0).shape == u.shape
    finally:
        conv_heads_triton.interpreter_problem.cache_clear()


def test_local_conv_uses_triton_only_where_asked_and_possible(monkeypatch):
    u = torch.randn(6, 2, 8, device=DEVICE)
    assert LocalConv(8, 3, impl="taps")._convolution(u) is DilatedDepthwiseConv
    assert LocalConv(8, 3, impl="triton")._convolution(u) is TritonConv
    # the default: the kernels for CUDA tensors, never the interpreter's for CPU ones
    assert LocalConv(8, 3)._convolution(u) is (TritonConv if u.is_cuda else DilatedDepthwiseConv)
    assert LocalConv(8, 3)._convolution(u.cpu()) is DilatedDepthwiseConv
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU tensor without the interpreter: the taps
    assert LocalConv(8, 3, impl="triton")._convolution(u.cpu()) is DilatedDepthwiseConv
    with pytest.raises(ValueError, match="taps, triton"):
        LocalConv(8, 3, impl="cuda")


@pytest.mark.parametrize("impl", ["triton", "fused"])
def test_option_reaches_every_conv_head_and_changes_no_output(impl, monkeypatch):
    """``fused``: all of the conv heads as one function in every layer (training)."""
    from tpp_plugin.modules import query_triton

    products = []
    original = query_triton.conv_heads
    monkeypatch.setattr(
        query_triton, "conv_heads", lambda *a: products.append(a[6]) or original(*a)
    )
    torch.manual_seed(0)
    d = make_dictionary(30)
    taps = build_model(
        dictionary=d,
        encoder_conv_dilations="1,2",
        decoder_conv_dilations="2,1",
        conv_heads_impl="taps",
    )
    fused = build_model(
        dictionary=d,
        encoder_conv_dilations="1,2",
        decoder_conv_dilations="2,1",
        conv_heads_impl=impl,
    )
    fused.load_state_dict(taps.state_dict())  # same parameters: the option is not one
    taps, fused = taps.to(DEVICE), fused.to(DEVICE)
    convs = [m for m in fused.modules() if isinstance(m, LocalConv)]
    assert len(convs) == 4 and all(m.impl == impl for m in convs)
    attentions = [m for m in fused.modules() if isinstance(m, HybridMultiheadAttention)]
    assert len(attentions) == 4 and all(m.conv_heads_impl == impl for m in attentions)
    assert all(m.impl == "taps" for m in taps.modules() if isinstance(m, LocalConv))
    src = random_tokens(d, 3, 9).to(DEVICE)
    src[1, :2] = d.pad()  # left-padded source: LocalConv's padding mask
    prev = random_tokens(d, 3, 11, seed=1).to(DEVICE)
    lengths = src.ne(d.pad()).sum(1)
    taps.eval(), fused.eval()  # no dropout: the same computation
    outputs = []
    for model in (taps, fused):
        out = model(src, lengths, prev)[0]
        out.logsumexp(-1).sum().backward()
        outputs.append(
            (out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        )
    (out_taps, grads_taps), (out_fused, grads_fused) = outputs
    # causal: two encoder layers (False), then two decoder layers (True)
    assert products == ([False, False, True, True] if impl == "fused" else [])
    assert (out_fused - out_taps).abs().max() < 1e-5
    assert grads_fused.keys() == grads_taps.keys()
    for name, g in grads_taps.items():
        assert (grads_fused[name] - g).abs().max() <= 1e-5 * (1 + g.abs().max()), name


def test_presets_default_to_the_kernels_where_they_run_and_old_checkpoints_load():
    """The default is ``auto``: the Triton kernels for CUDA tensors (measured faster on
    an H100), the taps for CPU tensors, also under Triton's interpreter; a checkpoint
    written before the option existed has none and gets the default."""
    model = build_model("transformer_pp")
    convs = [m for m in model.modules() if isinstance(m, LocalConv)]
    assert {m.impl for m in convs} == {"auto"}
    cpu = torch.zeros(2, 2)
    assert not conv_heads_triton.runs("auto", cpu)
    assert conv_heads_triton.runs("triton", cpu) == conv_heads_triton.interpreting()
    if torch.cuda.is_available():
        assert conv_heads_triton.runs("auto", cpu.cuda())
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY["transformer_pp"](args)
    assert args.conv_heads_impl == "auto"
    del args.conv_heads_impl
    attention = ConvHeadsConfig(args, "decoder").attention(0, 0.0, causal=True)
    assert attention.conv_heads_impl == "auto" and attention.local_conv.impl == "auto"


def decode(attention, x, state, steps, reorder_at, new_order):
    """A 3-position call, then one position at a time, beams reordered once."""
    outputs = [attention(x[:3], None, None, incremental_state=state, need_weights=False)[0]]
    for t in range(3, steps):
        if t == reorder_at:
            attention.reorder_incremental_state(state, new_order)
        outputs.append(
            attention(x[t : t + 1], None, None, incremental_state=state, need_weights=False)[0]
        )
    return torch.cat(outputs)


def count_kernel_steps(monkeypatch):
    """Record every call of the fused step (so a test knows the kernel ran)."""
    calls = []
    original = conv_heads_triton.conv_step

    def recording(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(conv_heads_triton, "conv_step", recording)
    return calls


# (d, heads, conv heads, F, dilation, output scaling, temperature): d_h = 6 is no power
# of two; F = 15 with dilation 2 is the widest paper layer
STEP_SHAPES = [
    (16, 4, 2, 5, 2, "none", 1.0),
    (24, 4, 3, 3, 1, "inv-sqrt-head-dim", 0.5),
    (64, 8, 4, 15, 2, "none", 1.0),
    (40, 4, 2, 7, 3, "none", 2.0),
]


@pytest.mark.parametrize(
    "shape", STEP_SHAPES, ids=lambda s: "d{}-H{}-Hc{}-F{}-dil{}-{}-T{}".format(*s)
)
def test_decoding_step_kernel_equals_the_modules_steps(shape, monkeypatch):
    d, heads, conv_heads, taps, dilation, scaling, temperature = shape
    torch.manual_seed(sum(shape[:5]))
    options = dict(
        kernel_size=taps,
        dilation=dilation,
        causal=True,
        output_scaling=scaling,
        query_temperature=temperature,
    )
    reference = (
        HybridMultiheadAttention(d, heads, conv_heads, conv_heads_impl="taps", **options)
        .to(DEVICE)
        .eval()
    )
    fused = (
        HybridMultiheadAttention(d, heads, conv_heads, conv_heads_impl="triton", **options)
        .to(DEVICE)
        .eval()
    )
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(18, 4, d, device=DEVICE)
    new_order = torch.tensor([1, 1, 3, 0], device=DEVICE)
    launches = count_kernel_steps(monkeypatch)
    with torch.no_grad():
        expected = decode(reference, x, {}, 18, 9, new_order)
        assert not launches
        got = decode(fused, x, {}, 18, 9, new_order)
        assert len(launches) == 15  # every single-position step ran the kernel
        # the two steps keep the same states: switching in the middle, either way,
        # changes nothing
        for first_impl, then in (("triton", "taps"), ("taps", "triton")):
            fused.local_conv.impl, state = first_impl, {}
            first = decode(fused, x[:12], state, 12, 9, new_order)
            fused.local_conv.impl = then
            rest = torch.cat(
                [
                    fused(x[t : t + 1], None, None, incremental_state=state, need_weights=False)[0]
                    for t in range(12, 18)
                ]
            )
            assert (torch.cat([first, rest]) - expected).abs().max() < 1e-5, (first_impl, then)
    assert (got - expected).abs().max() < 1e-5


@pytest.mark.parametrize(
    "dtype, scaling", [(torch.bfloat16, "none"), (torch.float16, "inv-sqrt-head-dim")]
)
def test_decoding_step_kernel_in_half_precision(dtype, scaling):
    """In bfloat16 and float16 both steps compute LocalConv, the Query and their product
    (scaled, with d_h = 12, by no power of two) in float32 and round once, as the product
    is written. Both stay within a few steps of the dtype of the float32 result."""
    torch.manual_seed(0)
    options = dict(kernel_size=7, dilation=2, causal=True, output_scaling=scaling)
    exact = HybridMultiheadAttention(96, 8, 4, conv_heads_impl="taps", **options).to(DEVICE).eval()
    fused = (
        HybridMultiheadAttention(96, 8, 4, conv_heads_impl="triton", **options).to(DEVICE).eval()
    )
    fused.load_state_dict(exact.state_dict())
    fused.to(dtype)
    x = torch.randn(20, 6, 96, device=DEVICE)
    order = torch.arange(6, device=DEVICE).flip(0)
    with torch.no_grad():
        expected = decode(exact, x, {}, 20, 9, order)
        got = decode(fused, x.to(dtype), {}, 20, 9, order).float()
        fused.local_conv.impl = "taps"
        taps = decode(fused, x.to(dtype), {}, 20, 9, order).float()
    assert torch.isfinite(got).all()
    scale = expected.abs().mean()
    assert (got - expected).abs().mean() < 0.02 * scale
    assert (got - expected).abs().mean() <= 1.5 * (taps - expected).abs().mean()


def test_decoding_step_with_gradients_takes_the_differentiable_path(monkeypatch):
    """The kernel has no backward: where a step must be differentiated (gradients on,
    parameters that want them) the PyTorch step runs, and LocalConv's kernel gets its
    gradient."""
    torch.manual_seed(0)
    reference = (
        HybridMultiheadAttention(16, 4, 2, kernel_size=3, causal=True, conv_heads_impl="taps")
        .to(DEVICE)
        .eval()
    )
    fused = HybridMultiheadAttention(16, 4, 2, kernel_size=3, causal=True, conv_heads_impl="triton")
    fused = fused.to(DEVICE).eval()
    fused.load_state_dict(reference.state_dict())
    launches = count_kernel_steps(monkeypatch)
    x = torch.randn(4, 2, 16, device=DEVICE)
    for module in (reference, fused):
        decode(module, x, {}, 4, 99, None).sum().backward()
    assert not launches
    assert fused.local_conv.weight.grad.abs().sum() > 0
    assert torch.allclose(fused.local_conv.weight.grad, reference.local_conv.weight.grad, atol=1e-6)


def test_retained_drop_connect_decodes_through_the_pytorch_step(monkeypatch):
    """The step kernel applies no DropConnect: under ``--retain-dropout`` (fairseq's
    ``make_generation_fast_``) the PyTorch step decodes, with the mask the taps module
    draws from the same seed."""
    torch.manual_seed(0)
    modules = [
        HybridMultiheadAttention(
            16, 4, 2, kernel_size=3, conv_weight_dropout=0.5, causal=True, conv_heads_impl=impl
        )
        for impl in ("taps", "triton")
    ]
    modules[1].load_state_dict(modules[0].state_dict())
    launches = count_kernel_steps(monkeypatch)
    x = torch.randn(6, 2, 16, device=DEVICE)
    outputs = []
    for module in modules:
        module.to(DEVICE).eval()
        module.local_conv.weight_dropout_module.make_generation_fast_("", retain_dropout=True)
        torch.manual_seed(1)
        with torch.no_grad():
            outputs.append(decode(module, x, {}, 6, 99, None))
    assert not launches
    assert torch.allclose(outputs[1], outputs[0], atol=1e-6)


def test_decoding_step_kernel_rejects_a_state_of_another_batch():
    """A wrong shape would read out of bounds on a GPU: the step checks first."""
    u = torch.randn(3, 8, device=DEVICE)
    scores, values = torch.randn(3, 2, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    weight, ring = torch.randn(8, 3, device=DEVICE), torch.zeros(3, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"state is \(2, 2, 5\), expected \(3, 2, 5\)"):
        conv_heads_triton.conv_step(
            u, scores, values, weight, ring, 0, torch.zeros(2, 2, 5, device=DEVICE), 1, 1.0, 1.0
        )
    with pytest.raises(ValueError, match=r"ring is \(2, 3, 8\), expected \(3, 3, 8\)"):
        conv_heads_triton.conv_step(u, scores, values, weight, ring[:2], 0, None, 1, 1.0, 1.0)


def test_model_decodes_step_by_step_as_in_parallel_with_the_kernels():
    """As tests/plugin/test_model.py checks for the PyTorch steps: beam search's step by
    step decoding, reordering included, equals the parallel forward."""
    torch.manual_seed(0)
    d = make_dictionary(30)
    model = (
        build_model(
            dictionary=d,
            encoder_conv_dilations="1,2",
            decoder_conv_dilations="2,3",
            conv_heads_impl="triton",
        )
        .to(DEVICE)
        .eval()
    )
    beam, steps, reorder_step = 4, 16, 7
    src = random_tokens(d, 1, 9).repeat(beam, 1).to(DEVICE)
    enc = model.encoder(src, src_lengths=torch.full((beam,), 9, device=DEVICE))
    hist = torch.cat(
        [torch.full((beam, 1), d.eos()), random_tokens(d, beam, steps - 1, seed=3)], dim=1
    ).to(DEVICE)
    new_order = torch.tensor([1, 1, 3, 0], device=DEVICE)
    state, step_logits = {}, []
    with torch.no_grad():
        for t in range(steps):
            if t == reorder_step:
                model.decoder.reorder_incremental_state_scripting(state, new_order)
                enc = model.encoder.reorder_encoder_out(enc, new_order)
                hist = torch.cat([hist[new_order, :t], hist[:, t:]], dim=1)
            step_logits.append(
                model.decoder(hist[:, : t + 1], encoder_out=enc, incremental_state=state)[0][:, 0]
            )
        full = model.decoder(hist, encoder_out=enc)[0]
    for t in range(steps):
        got = step_logits[t][new_order] if t < reorder_step else step_logits[t]
        assert (got - full[:, t]).abs().max() <= 1e-5, f"step {t}"


COMPILE_FOR_HOPPER = r"""
import inspect
import itertools
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tpp_plugin.modules import conv_heads_triton as m

taps, grad, step = m._kernels(False)
blocks = {"BLOCK_R": m.BLOCK_R, "BLOCK_C": m.BLOCK_C}
for dtype in ("bf16", "fp16", "fp32"):
    align = 4 if dtype == "fp32" else 8  # 16-byte rows: the hint where a tensor's rows allow it
    variants = [
        # the kernel as LocalConv hands it over: its softmax in float32, whatever the input
        (taps, {"x_ptr": "*" + dtype, "y_ptr": "*" + dtype, "k_ptr": "*fp32"},
         dict(ACC=tl.float32, X_ALIGN=align, Y_ALIGN=1, **blocks)),
        (grad, {"g_ptr": "*" + dtype, "u_ptr": "*" + dtype, "part_ptr": "*fp32"},
         dict(ACC=tl.float32, G_ALIGN=1, U_ALIGN=align, **blocks)),
    ] + [
        (step, {**{p: "*" + dtype for p in ("u_ptr", "s_ptr", "v_ptr", "w_ptr", "ring_ptr", "row_ptr", "out_ptr")},
                "state_ptr": "*fp32", "new_state_ptr": "*fp32", "temperature": "fp32", "out_scale": "fp32"},
         dict(HAS_STATE=has_state, BLOCK_D=64, BLOCK_F=16))
        for has_state in (False, True)
    ]
    for kernel, types, constants in variants:
        # integer arguments as they come, and (Triton compiles a variant for integer
        # arguments equal to 1, as constants) all of them equal to 1
        ints = [name for name in inspect.signature(kernel.fn).parameters if name not in types and name not in constants]
        for ones in (False, True):
            signature = {name: types.get(name, "i32") for name in inspect.signature(kernel.fn).parameters}
            fixed = dict(constants, **({name: 1 for name in ints} if ones else {}))
            signature.update({name: "constexpr" for name in fixed})
            binary = triton.compile(ASTSource(kernel, signature, constexprs=fixed), target=GPUTarget("cuda", 90, 32))
            print(kernel.fn.__name__, dtype, len(binary.asm["cubin"]))
    # the conv heads for training (--conv-heads-impl fused), encoder and decoder, with and
    # without a padding mask (a bool tensor; without one, the scores stand in for it)
    from tpp_plugin.modules import query_triton as qt
    # (the forward kernel with LocalConv computed in it, from u and a float32 kernel)
    for kernel in (qt.conv_heads_kernel, qt.conv_heads_grad_kernel):
        names = inspect.signature(kernel.fn).parameters
        for causal, has_pad, has_mask in itertools.product((False, True), repeat=3):
            if kernel is qt.conv_heads_grad_kernel and has_mask:
                continue  # (the backward kernel takes no mask)
            signature = {name: "*" + dtype if name.endswith("_ptr") else "i32" for name in names}
            signature.update(lse_ptr="*fp32", c_ptr="*fp32", m_ptr="*fp32", soft_ptr="*fp32",
                             kern_ptr="*fp32", temperature="fp32", out_scale="fp32")
            signature["pad_ptr"] = "*i1" if has_pad else "*" + dtype
            fixed = dict(CAUSAL=causal, HAS_PAD=has_pad, HAS_MASK=has_mask, ACC=tl.float32,
                         BLOCK_T=qt.BLOCK_T, BLOCK_D=64)
            fixed = {name: value for name, value in fixed.items() if name in names}
            signature = {name: "constexpr" if name in fixed else t for name, t in signature.items() if name in names}
            binary = triton.compile(ASTSource(kernel, signature, constexprs=fixed), target=GPUTarget("cuda", 90, 32))
            print(kernel.fn.__name__, dtype, len(binary.asm["cubin"]))
"""


def test_kernels_compile_to_hopper_machine_code():
    """The interpreter is lax about types; Triton's compiler is not. Every kernel, in
    every training dtype and with the argument types it gets at run time (the
    convolution's kernel in float32 also for half-precision input), compiled ahead of
    time for an H100 (sm_90) by Triton's own compiler and ptxas, which need no GPU; the
    fused Query's two kernels in every variant they are launched in."""
    import os
    import subprocess
    import sys

    from support import REPO

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_HOPPER],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split()
    compiled = [
        (name, dtype)
        for name, dtype, size in zip(lines[::3], lines[1::3], lines[2::3])
        if int(size) > 0
    ]
    assert len(compiled) == 24 + 36, proc.stdout


COUNT_COMPILATIONS = r"""
import json
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from tpp_plugin.modules import HybridMultiheadAttention
try:  # the launcher's own specialisation (Triton's internals: not in every version)
    from triton.runtime.jit import JITFunction, create_function_from_signature
    assert hasattr(JITFunction, "_pack_args")
except (ImportError, AssertionError):
    print(json.dumps({"skip": "this Triton has no create_function_from_signature or _pack_args"}))
    sys.exit(0)
from tpp_plugin.modules import conv_heads_triton as m

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
kernels = m._kernels(False)
# the function by which Triton's launcher specialises a call, as it builds it for an H100
binders = {k: create_function_from_signature(k.signature, k.params, backend) for k in kernels}
calls = {k.fn.__name__: 0 for k in kernels}
variants = {k.fn.__name__: {} for k in kernels}


class Recorder:
    # stands for a kernel: the launcher's compile-cache key of every call, no launch
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound, specialization, options = binders[self.kernel](*args, **kwargs)
            name = self.kernel.fn.__name__
            calls[name] += 1
            variants[name].setdefault(str((specialization, options)), (bound, specialization, options, kwargs))
        return launch


m._kernels = lambda interpret: tuple(Recorder(k) for k in kernels)
m.interpreting = lambda: True  # the kernels' launch path, on CPU tensors
torch.manual_seed(0)
# d_h = 16, 2 + 2 heads: the fused projection is 168 wide, 8 mod 16 as in every preset
attn = HybridMultiheadAttention(64, 4, 2, kernel_size=15, dilation=2, causal=True, conv_heads_impl="triton")
assert attn.in_proj.weight.size(0) % 16 == 8
with torch.no_grad():
    attn.eval()
    state = {}
    for step in range(50):  # beam search: the ring's row changes at every step
        attn(torch.randn(1, 5, 64), None, None, incremental_state=state, need_weights=False)
steps = dict(calls=calls["conv_step_kernel"], variants=len(variants["conv_step_kernel"]))
attn.train()
for length, bsz in [(5, 1), (17, 2), (9, 3), (32, 4), (23, 5), (40, 6), (1, 7), (16, 8), (33, 9), (12, 16)]:
    attn(torch.randn(length, bsz, 64), None, None, need_weights=False)[0].sum().backward()
compiled = 0
for kernel in kernels:
    for bound, specialization, options, kwargs in variants[kernel.fn.__name__].values():
        _, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        binary = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=target)
        compiled += len(binary.asm["cubin"]) > 0
print(json.dumps(dict(steps=steps, calls=calls, variants={k: len(v) for k, v in variants.items()}, compiled=compiled)))
"""


def test_compilations_are_bounded_over_decoding_steps_and_batch_shapes():
    """Triton compiles a kernel anew for every new specialisation of its integer
    arguments (== 1, divisible by 16, neither). Counted by the function Triton's launcher
    keys its compile cache with, built for an H100, over the calls a hybrid attention
    makes: 50 beam-search steps (the ring's row changes at every one) take two
    compilations of the step, one without the Query's state (the first step) and one with;
    training steps of ten batch shapes take a few, which differ only in a stride's
    divisibility (the batch size's parity times the projection's width). Every variant
    then compiles for sm_90."""
    import json
    import os
    import subprocess
    import sys

    from support import REPO

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_COMPILATIONS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in counts:
        pytest.skip(counts["skip"])
    assert counts["steps"] == {"calls": 50, "variants": 2}, counts
    assert (
        counts["calls"]["taps_kernel"] == 20 and counts["calls"]["kernel_grad_kernel"] == 10
    ), counts
    # forward (two stride classes of u) and input gradient; the kernel's gradient (two)
    assert (
        counts["variants"]["taps_kernel"] <= 3 and counts["variants"]["kernel_grad_kernel"] <= 2
    ), counts
    assert counts["compiled"] == sum(counts["variants"].values()), counts
