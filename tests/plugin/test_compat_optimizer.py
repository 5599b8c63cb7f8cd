"""--bf16 keeps fairseq's float32 master copy flat on a GPU, as --fp16 does
(the ``flat-bf16`` speed-up of tpp_fairseq.speed): fairseq's own FP16Optimizer and Adam on a small
bfloat16 module; the same updates as the per-parameter copy, and optimizer states of
either layout load into the other. The flat layout is taken on the CPU here by adding
"cpu" to the devices that get it (on the CPU it stays per parameter otherwise);
tests/e2e/test_cli_end_to_end.py does it through fairseq's training command and
tests/plugin/test_cuda.py on a GPU as it is."""

import copy

import pytest
import torch
from fairseq import options
from fairseq.dataclass import utils as dataclass_utils
from fairseq.optim.fp16_optimizer import FP16Optimizer
from omegaconf import open_dict

import tpp_plugin  # noqa: F401  (installs the corrections)
from tpp_fairseq import speed


@pytest.fixture(autouse=True)
def flat_on_the_cpu(monkeypatch):
    monkeypatch.setattr(speed, "FLAT_BF16_DEVICE_TYPES", frozenset({"cuda", "cpu"}))


def config(*extra):
    """fairseq's configuration of ``fairseq-train --cpu --bf16`` with Adam."""
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        input_args=[
            "unused-data",
            "--arch",
            "transformer",
            "--cpu",
            "--bf16",
            "--optimizer",
            "adam",
            "--adam-betas",
            "(0.9, 0.98)",
            "--lr",
            "0.01",
            "--weight-decay",
            "0.01",
            *extra,
        ],
    )
    # looked up now: the plugin corrects --bf16's implied --tpu there
    return dataclass_utils.convert_namespace_to_omegaconf(args)


def module():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3)
    ).bfloat16()


def build(model, *extra):
    return FP16Optimizer.build_optimizer(config(*extra), list(model.parameters()))


def train(model, optimizer, steps, seed=1, device="cpu"):
    """``steps`` updates on fixed random batches (fairseq's order: backward, norm, step)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(4, 6, generator=generator).bfloat16().to(device)
        optimizer.backward(model(x).float().pow(2).mean())
        optimizer.clip_grad_norm(0.0)
        optimizer.step()


def test_bf16_master_copy_is_flat_unless_asked_per_parameter():
    flat = build(module())
    assert flat.has_flat_params
    (master,) = flat.fp32_params.values()
    assert master.dtype == torch.float32 and master.numel() == sum(
        p.numel() for p in module().parameters()
    )
    assert not build(module(), "--fp16-no-flatten-grads").has_flat_params


def test_bf16_master_copy_stays_per_parameter_on_the_cpu(monkeypatch):
    monkeypatch.setattr(speed, "FLAT_BF16_DEVICE_TYPES", frozenset({"cuda"}))
    assert not build(module()).has_flat_params


def test_optimizers_without_flat_parameters_keep_one_tensor_per_parameter():
    """fairseq's own --fp16 would refuse Adafactor's flat copy; --bf16 keeps it per parameter."""
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        input_args=[
            "unused-data",
            "--arch",
            "transformer",
            "--cpu",
            "--bf16",
            "--optimizer",
            "adafactor",
            "--lr",
            "0.01",
        ],
    )
    optimizer = FP16Optimizer.build_optimizer(
        dataclass_utils.convert_namespace_to_omegaconf(args), list(module().parameters())
    )
    assert not optimizer.has_flat_params


def test_optimizers_that_treat_parameters_apart_keep_one_tensor_per_parameter():
    """fairseq's composite optimizer (one optimizer per group of parameters) and
    parameters with settings of their own (a group, overrides, an expert's gradient left
    out of the norm) would lose them in a flat copy."""
    for attribute in speed.PER_PARAMETER_ATTRIBUTES:
        model = module()
        setattr(model[0].weight, attribute, "any")
        assert not build(model).has_flat_params, attribute
    cfg = config()
    assert speed._flat_bf16_wanted(cfg, list(module().parameters()))
    with open_dict(cfg):
        cfg.optimizer._name = "composite"
    assert not speed._flat_bf16_wanted(cfg, list(module().parameters()))


def test_flat_and_per_parameter_copies_update_alike():
    a, b = module(), module()
    train(a, build(a), 5)
    train(b, build(b, "--fp16-no-flatten-grads"), 5)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_a_flat_copy_writes_the_state_fairseq_writes_for_bf16_and_fairseq_resumes_it():
    """A checkpoint of the flat copy holds the optimizer state one tensor per parameter,
    equal to the per-parameter copy's; fairseq's own optimizer, without the plugin's
    changes, resumes it, and continues as the flat copy does; writing it changes nothing
    in the flat copy (slices of it are written)."""
    model, twin = module(), module()
    flat, per_parameter = build(model), build(twin, "--fp16-no-flatten-grads")
    train(model, flat, 3)
    train(twin, per_parameter, 3)
    written, expected = flat.state_dict(), per_parameter.state_dict()
    assert flat.has_flat_params and written["param_groups"] == expected["param_groups"]
    assert written["state"].keys() == expected["state"].keys() == set(range(6))
    for i, state in expected["state"].items():
        assert written["state"][i].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(written["state"][i][key]), torch.as_tensor(value))

    # resumed as fairseq resumes (the master copy rebuilt from the bfloat16 parameters)
    stock_model, flat_model = copy.deepcopy(model), copy.deepcopy(model)
    stock = speed._original_build_optimizer(FP16Optimizer, config(), list(stock_model.parameters()))
    assert not stock.has_flat_params
    speed._original_load_state_dict(stock, copy.deepcopy(written))
    train(stock_model, stock, 3, seed=2)
    resumed = build(flat_model)
    resumed.load_state_dict(copy.deepcopy(written))
    train(flat_model, resumed, 3, seed=2)
    for p, q in zip(stock_model.parameters(), flat_model.parameters()):
        assert torch.equal(p, q)
    fresh_model = copy.deepcopy(model)
    train(fresh_model, build(fresh_model), 3, seed=2)  # without the state: other parameters
    assert not all(
        torch.equal(p, q) for p, q in zip(flat_model.parameters(), fresh_model.parameters())
    )


@pytest.mark.parametrize(
    "saved_flags, other_flags",
    [
        (["--fp16-no-flatten-grads"], []),  # a per-parameter checkpoint resumed flat
        ([], ["--fp16-no-flatten-grads"]),  # and a flat one (--fp16's) per parameter
    ],
)
def test_state_of_either_layout_resumes_in_the_other(saved_flags, other_flags):
    """3 updates, the state saved in the optimizer's own layout (a flat one as --fp16's
    copy writes it); resumed from it (the master copy rebuilt from the bfloat16
    parameters, as fairseq resumes) in the other layout, 3 more updates give the
    parameters that 3 more give in the saved layout: Adam's moments and step count
    carried over (without them the parameters differ)."""
    model = module()
    optimizer = build(model, *saved_flags)
    train(model, optimizer, 3)
    state = copy.deepcopy(FP16Optimizer.state_dict(optimizer))
    assert len(state["param_groups"][0]["params"]) == (6 if saved_flags else 1)

    def resume(flags, load=True):
        resumed_model = copy.deepcopy(model)
        resumed = build(resumed_model, *flags)
        if load:
            resumed.load_state_dict(copy.deepcopy(state))
        train(resumed_model, resumed, 3, seed=2)
        return resumed, list(resumed_model.parameters())

    _, same = resume(saved_flags)
    other_optimizer, other = resume(other_flags)
    assert other_optimizer.has_flat_params == (not other_flags)
    (group,) = other_optimizer.optimizer.state_dict()["param_groups"]
    assert group["lr"] == 0.01 and group["betas"] == (0.9, 0.98)
    for p, q in zip(same, other):
        assert torch.equal(p, q)
    _, fresh = resume(other_flags, load=False)
    assert not all(torch.equal(p, q) for p, q in zip(same, fresh))


@pytest.mark.parametrize(
    "saved_flags, other_flags",
    [(["--fp16-no-flatten-grads"], []), ([], ["--fp16-no-flatten-grads"])],
)
def test_the_state_of_a_model_that_trains_one_tensor_resumes_in_the_other_layout(
    saved_flags, other_flags
):
    """One trainable tensor (the rest frozen): the layouts hold as many state tensors,
    of other shapes; resumed in the other layout, 3 more updates give the parameters of
    the saved layout's."""
    model = module()
    for p in list(model.parameters())[1:]:
        p.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = FP16Optimizer.build_optimizer(config(*saved_flags), trained)
    train(model, optimizer, 3)
    state = copy.deepcopy(FP16Optimizer.state_dict(optimizer))  # its own layout
    results = []
    for flags in (saved_flags, other_flags):
        resumed_model = copy.deepcopy(model)
        params = [p for p in resumed_model.parameters() if p.requires_grad]
        resumed = FP16Optimizer.build_optimizer(config(*flags), params)
        assert resumed.has_flat_params == (not flags)
        resumed.load_state_dict(copy.deepcopy(state))
        train(resumed_model, resumed, 3, seed=2)
        results.append(resumed_model[0].weight)
    assert torch.equal(*results)


def test_a_state_that_cannot_be_converted_is_an_error_naming_the_way_out():
    model = module()
    per_parameter = build(model, "--fp16-no-flatten-grads")
    train(model, per_parameter, 2)
    state = per_parameter.state_dict()
    flat = build(module())

    uneven = copy.deepcopy(state)
    uneven["state"][1]["step"] += 1
    with pytest.raises(
        RuntimeError, match=r"state 'step'.*differs between parameters.*--reset-optimizer"
    ):
        flat.load_state_dict(uneven)

    wrong_size = copy.deepcopy(state)
    wrong_size["state"][0]["exp_avg"] = torch.zeros(7)
    with pytest.raises(RuntimeError, match=r"state 'exp_avg'.*parameter's size.*--reset-optimizer"):
        flat.load_state_dict(wrong_size)

    missing = copy.deepcopy(state)
    del missing["state"][2]
    with pytest.raises(RuntimeError, match=r"1 of 6 parameters have none.*--reset-optimizer"):
        flat.load_state_dict(missing)


@pytest.mark.parametrize(
    "saved_flags", [[], ["--fp16-no-flatten-grads"]], ids=["flat", "per-parameter"]
)
def test_a_state_of_other_parameters_is_refused_by_the_flat_copy_at_load(saved_flags):
    """A checkpoint's optimizer state written for other parameters (e.g. resumed with a
    tag head removed) is an error naming --reset-optimizer when it is loaded, not at
    Adam's first step; torch itself only compares the number of parameters."""
    model = module()
    optimizer = build(model, *saved_flags)
    train(model, optimizer, 2)
    state = copy.deepcopy(FP16Optimizer.state_dict(optimizer))  # its own layout
    torch.manual_seed(0)
    smaller = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2)
    ).bfloat16()
    flat = build(smaller)
    assert flat.has_flat_params
    if saved_flags:  # one state per parameter: a parameter's size differs
        match = r"state 'exp_avg'.*parameter's size.*--reset-optimizer"
    else:  # flat: the total size differs
        match = r"state 'exp_avg': it holds 63 values where the flat master copy .* has 57 .*--reset-optimizer"
    with pytest.raises(RuntimeError, match=match):
        flat.load_state_dict(state)
    flat.load_state_dict(
        copy.deepcopy(build(smaller).state_dict())
    )  # a state of its own size loads


def test_states_of_the_same_layout_load_unchanged():
    optimizer = build(module())
    state = {"state": {}, "param_groups": [{"params": [0], "lr": 0.5}]}
    assert speed.match_state_layout(optimizer, state) is state


def counted(fn):
    """The ATen operators ``fn()`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return ops


def wide_module():
    """Many small parameter tensors, one of which gets no gradient (unused)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 4)] + [torch.nn.Linear(4, 4) for _ in range(11)]
    model = torch.nn.Sequential(*layers, torch.nn.LayerNorm(4)).bfloat16()
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(2, 2).bfloat16()))
    return model


def test_multi_tensor_sync_updates_exactly_as_fairseq_in_a_few_operators():
    """``multi-tensor-sync``: the same parameters after 20 updates as fairseq's own
    per-tensor copies (a parameter without a gradient included), with the gradients
    synced in two operators (one copy, one zeroing for the parameter without one) and
    the parameters in one, where fairseq takes one or two per tensor. (The flat copy of
    ``--fp16`` goes through the same two methods.)"""
    fairseq_model, synced_model = wide_module(), wide_module()
    fairseq_opt = build(fairseq_model)
    synced_opt = build(synced_model)
    speed.multi_tensor_sync(synced_opt)  # this optimizer only
    assert fairseq_opt.has_flat_params and synced_opt.has_flat_params
    assert type(fairseq_opt)._sync_fp32_params_to_fp16 is not speed.sync_params
    train(fairseq_model, fairseq_opt, 20)
    train(synced_model, synced_opt, 20)
    for p, q in zip(fairseq_model.parameters(), synced_model.parameters()):
        assert torch.equal(p, q)
    tensors = len(list(synced_model.parameters()))
    for opt, most in ((fairseq_opt, None), (synced_opt, 2)):
        opt.zero_grad()
        opt.backward(synced_model(torch.randn(3, 6).bfloat16()).float().sum())
        grads = counted(opt._sync_fp16_grads_to_fp32)
        params = counted(opt._sync_fp32_params_to_fp16)
        if most is None:  # fairseq: a copy per tensor (and zeros for the one without a gradient)
            assert len(grads) >= tensors and len(params) >= tensors
        else:
            assert grads == ["_foreach_copy_", "_foreach_zero_"] and params == ["_foreach_copy_"]


def test_multi_tensor_sync_leaves_a_per_parameter_copy_to_fairseq():
    model = module()
    optimizer = build(model, "--fp16-no-flatten-grads")
    speed.multi_tensor_sync(optimizer)
    reference = module()
    train(model, optimizer, 5)
    train(reference, build(reference, "--fp16-no-flatten-grads"), 5)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
