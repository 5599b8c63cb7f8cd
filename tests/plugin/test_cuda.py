"""On a CUDA GPU (skipped, and reported as skipped, where there is none): the fused
attention kernels are reachable, and the model's numerics there match the CPU's.

Run on a GPU machine with ``python -m pytest -q tests/plugin/test_cuda.py``."""

import copy

import pytest
import torch
import torch.nn.functional as F

from support import (
    attention_kernels,
    bf16_model_and_batch,
    build_model,
    make_dictionary,
    random_tokens,
)
from tpp_plugin.modules import HybridMultiheadAttention
from tpp_plugin.modules.context_query import PooledQuery, prefix_softmax
from tpp_plugin.modules.local_conv import DilatedDepthwiseConv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_prefix_softmax_on_the_gpu_equals_the_cpu():
    torch.manual_seed(0)
    scores = 10 * torch.randn(4, 8, 2048)
    values = torch.randn(4, 8, 2048, 64)
    q_cpu, lse_cpu = prefix_softmax(scores, values)
    q_gpu, lse_gpu = prefix_softmax(scores.cuda(), values.cuda())
    assert (q_gpu.cpu() - q_cpu).abs().max() < 1e-4
    assert (lse_gpu.cpu() - lse_cpu).abs().max() < 1e-3


@pytest.mark.parametrize("causal", [True, False])
def test_pooled_query_gradients_on_the_gpu(causal):
    """The Query's hand-written backward pass on the GPU: float64 gradcheck over three
    blocks, and the bf16 gradients of a long sequence equal to the CPU's."""
    torch.manual_seed(0)
    scores = torch.randn(40, 2, 3, dtype=torch.float64, device="cuda", requires_grad=True)
    values = torch.randn(40, 2, 12, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda s, v: PooledQuery.apply(s, v, 3, causal, 16), (scores, values)
    )
    s, v = 4 * torch.randn(1000, 4, 8), torch.randn(1000, 4, 8 * 64).bfloat16()
    grads = []
    for device in ("cpu", "cuda"):
        s_d, v_d = s.to(device).requires_grad_(), v.to(device).requires_grad_()
        out = PooledQuery.apply(s_d, v_d, 8, causal, 64)
        grads.append(
            [g.float().cpu() for g in torch.autograd.grad(out, (s_d, v_d), torch.ones_like(out))]
        )
    for cpu, gpu in zip(*grads):
        assert torch.isfinite(gpu).all()
        assert (gpu - cpu).abs().max() <= 1e-2 * cpu.abs().max()


def test_causal_depthwise_conv_gradients_on_the_gpu():
    torch.manual_seed(0)
    u = torch.randn(20, 3, 5, dtype=torch.float64, device="cuda", requires_grad=True)
    kernel = torch.randn(7, 5, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: DilatedDepthwiseConv.apply(a, b, 2, 20), (u, kernel)
    )


def test_decoder_and_unpadded_encoder_self_attention_run_on_flash_attention():
    """With only the flash backend allowed, any explicit mask would make
    scaled_dot_product_attention fail: the decoder (targets padded on the right) and
    an encoder batch without padding must pass none."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    d, model, src, prev = bf16_model_and_batch()
    prev[3, -5:] = d.pad()
    decoder_attn = model.decoder.layers[0].self_attn
    assert isinstance(decoder_attn, HybridMultiheadAttention) and decoder_attn.right_padded
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        # the encoder's dot-product heads are fairseq-free here too: no padding, no mask
        out = model(src, torch.full((8,), 30, device="cuda"), prev)[0]
        out.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(out.float()).all()


def test_loaded_plugin_keeps_attention_off_cudnn_in_half_precision():
    """cuDNN's attention builds a plan for every new shape (tpp_fairseq.speed, cudnn-off): with
    the plugin loaded, a bfloat16 training step, padded and unpadded, and decoding steps
    run the flash or memory-efficient kernels, never cuDNN's, which this GPU ranks first
    (the control: the same calls with the backend switched back on reach it; skipped
    where they do not)."""
    torch.manual_seed(0)
    d, model, src, prev = bf16_model_and_batch()
    lengths = torch.full((8,), 30, device="cuda")

    def kernels_of_a_step_and_decoding(model):
        padded = src.clone()
        padded[2, :6] = d.pad()
        with attention_kernels() as kernels:
            for batch in (src, padded):
                model.train()(batch, lengths, prev)[0].float().logsumexp(-1).mean().backward()
            model.eval()
            with torch.no_grad():
                enc = model.encoder(padded, src_lengths=lengths)
                state = {}
                for t in range(6):
                    model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
        return [name for name, _ in kernels.calls]

    assert not torch.backends.cuda.cudnn_sdp_enabled(), "loading the plugin switched it off"
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        control = kernels_of_a_step_and_decoding(model)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if not [n for n in control if "cudnn" in n]:
        pytest.skip(
            f"this GPU's PyTorch chose no cuDNN attention even where allowed ({sorted(set(control))})"
        )
    names = kernels_of_a_step_and_decoding(model)
    # at least the decoding steps' (2 layers x 6 steps) were fused kernels: without
    # dropout no call falls back to the unfused math path, which names no kernel
    assert len(names) >= 6 * 2, names
    assert not [n for n in names if "cudnn" in n], names


def test_model_in_bfloat16_on_the_gpu_is_close_to_float32():
    torch.manual_seed(0)
    d = make_dictionary(50)
    model = build_model(
        "transformer_pp",
        dictionary=d,
        encoder_tag_layers="",
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        conv_weight_dropout=0.0,
        encoder_layers=3,
        decoder_layers=3,
    ).cuda()
    src = random_tokens(d, 8, 40).cuda()
    src[2, :6] = d.pad()
    prev = random_tokens(d, 8, 35, seed=1).cuda()
    lengths = src.ne(d.pad()).sum(1)
    full = model(src, lengths, prev)[0].float()
    half = copy.deepcopy(model).bfloat16()
    out = half(src, lengths, prev)[0].float()
    assert torch.isfinite(out).all()
    assert (F.log_softmax(out, -1) - F.log_softmax(full, -1)).abs().mean() < 0.05


def test_incremental_decoding_on_the_gpu_equals_full_forward():
    torch.manual_seed(0)
    d = make_dictionary(50)
    model = build_model(dictionary=d, encoder_tag_layers="").cuda().eval()
    src = random_tokens(d, 4, 12).cuda()
    prev = random_tokens(d, 4, 20, seed=1).cuda()
    lengths = torch.full((4,), 12, device="cuda")
    with torch.no_grad():
        full = model(src, lengths, prev)[0]
        enc = model.encoder(src, src_lengths=lengths)
        state, steps = {}, []
        for t in range(prev.size(1)):
            steps.append(
                model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0]
            )
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-4


@pytest.mark.parametrize("impl", ["triton", "fused"])
def test_model_with_triton_local_conv_trains_like_the_taps_in_bfloat16(impl):
    """--conv-heads-impl triton (LocalConv's kernels) and fused (all of the conv heads) at
    the base preset's size, bfloat16, training mode without dropout: the same loss and
    gradients as the taps, within bfloat16's rounding (all sum in float32; the order of
    the sums differs)."""
    torch.manual_seed(0)
    d = make_dictionary(200)
    options = dict(
        encoder_tag_layers="",
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        conv_weight_dropout=0.0,
    )
    taps = (
        build_model("transformer_pp", dictionary=d, conv_heads_impl="taps", **options)
        .cuda()
        .bfloat16()
        .train()
    )
    fused = build_model("transformer_pp", dictionary=d, conv_heads_impl=impl, **options)
    fused.load_state_dict(taps.state_dict())
    fused = fused.cuda().bfloat16().train()
    src = random_tokens(d, 16, 48).cuda()
    src[3, :7] = d.pad()
    prev = random_tokens(d, 16, 40, seed=1).cuda()
    lengths = src.ne(d.pad()).sum(1)
    losses, grads = [], []
    for model in (taps, fused):
        loss = F.log_softmax(model(src, lengths, prev)[0].float(), -1).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) < 1e-3 * abs(losses[0])
    assert grads[0].keys() == grads[1].keys()
    # parameter by parameter: LocalConv's kernels are a small part of the whole gradient.
    # A key bias gets none (it adds one constant to a query's scores, which the softmax
    # removes): what both carry there is rounding, which no relative error can compare
    for name, expected in grads[0].items():
        if name.endswith("k_proj.bias"):
            continue
        error = (grads[1][name] - expected).norm() / expected.norm().clamp_min(1e-12)
        assert error < 5e-2, (name, error.item())
    assert any("local_conv.weight" in name for name in grads[0])


def test_bf16_master_copy_is_flat_on_the_gpu_and_updates_like_per_parameter():
    """The flat-bf16 speed-up (tpp_fairseq.speed) as it is (no device added): on a GPU, --bf16's float32
    master copy is one flat tensor, and 5 Adam updates give the same parameters as the
    per-parameter copy (--fp16-no-flatten-grads)."""
    from test_compat_optimizer import build, module, train

    models, optimizers = [], []
    for extra in ([], ["--fp16-no-flatten-grads"]):
        model = module().cuda()
        models.append(model)
        optimizers.append(build(model, *extra))
    assert optimizers[0].has_flat_params and not optimizers[1].has_flat_params
    (master,) = optimizers[0].fp32_params.values()
    assert master.is_cuda and master.dtype == torch.float32
    for model, optimizer in zip(models, optimizers):
        train(model, optimizer, 5, device="cuda")
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)
