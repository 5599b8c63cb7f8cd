"""What the benchmark scripts share: the models (fairseq's ``transformer``, the baseline
the ratios are taken against, and the controls that must come out at 1.0×), fairseq's
command lines, trainers and batches, the device and dtype, and timing: medians, their
spread and paired ratios."""

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tpp_tools.train import fairseq_arguments  # the training recipe's command line

REPO = Path(__file__).resolve().parent.parent
#: the plugin of this checkout, loaded as fairseq's ``--user-dir`` loads it: a benchmark
#: measures its own checkout
PLUGIN = REPO / "tpp_plugin"


def _tpp(*options):
    """``transformer_pp`` without tag heads (the benchmarks' ``tpp``), with ``options``."""
    return ["--arch", "transformer_pp", "--encoder-tag-layers", "", *options]


#: each model's own fairseq-train options (the rest is :func:`command_line`'s, the same for
#: all): ``transformer`` is the baseline, ``tpp-conv0`` and ``transformer-b`` the controls
MODELS = {
    "transformer": ["--arch", "transformer"],
    # fairseq's transformer once more, as if it were another model: the harness's own
    # control (on a GPU, where tpp-conv0 and transformer differ in their attention
    # kernels, this is the one that must come out at 1.0×)
    "transformer-b": ["--arch", "transformer"],
    "tpp": _tpp(),
    "tpp-conv0": _tpp("--encoder-conv-heads", "0", "--decoder-conv-heads", "0"),
    # the conv heads as Triton's kernels, as one fused kernel, as PyTorch operations
    "tpp-triton": _tpp("--conv-heads-impl", "triton"),
    "tpp-fused": _tpp("--conv-heads-impl", "fused"),
    "tpp-taps": _tpp("--conv-heads-impl", "taps"),
    # the flat master copy synced by multi-tensor copies (MULTI_TENSOR_SYNC)
    "transformer-sync": ["--arch", "transformer"],
    "tpp-fused-sync": _tpp("--conv-heads-impl", "fused"),
    # the encoder and decoder layers through torch.compile (COMPILED)
    "transformer-compiled": ["--arch", "transformer"],
    "tpp-compiled": _tpp(),
    "tpp-fused-compiled": _tpp("--conv-heads-impl", "fused"),
    # --bf16's master copy one tensor per parameter (fairseq's own --bf16), not flat
    "transformer-split": ["--arch", "transformer", "--fp16-no-flatten-grads"],
    "tpp-split": _tpp("--fp16-no-flatten-grads"),
    # with its tag losses (POS after layer 1, NER after layer 2): needs a tagged data folder
    "tpp-tags": [
        "--arch",
        "transformer_pp",
        "--task",
        "translation_with_tags",
        "--criterion",
        "label_smoothed_cross_entropy_with_tags",
    ],
}

#: models whose optimizer (only theirs) syncs a flat master copy by multi-tensor copies
#: (the speed-up multi-tensor-sync of tpp_fairseq.speed)
MULTI_TENSOR_SYNC = {"transformer-sync", "tpp-fused-sync"}

#: models whose encoder and decoder layers run through torch.compile (only theirs: the
#: speed-up compiled-layers of tpp_fairseq.speed)
COMPILED = {"transformer-compiled", "tpp-compiled", "tpp-fused-compiled"}

#: the plugin's default speed-ups but cuDNN's attention switch (tpp_fairseq.speed.DEFAULT)
CUDNN_KEPT = "flat-bf16"

#: d -> (heads, FFN); 512 is the base preset's size, 1024 the big presets'
SIZES = {128: (4, 512), 256: (4, 1024), 512: (8, 2048), 1024: (16, 4096)}


# ----------------------------------------------------------------------------- arguments


def check_device(parser, args) -> None:
    """``--device cuda`` where PyTorch sees no CUDA device is an error: fairseq's trainer
    would run the models on the CPU without a word, and the figures would be the CPU's."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: PyTorch {torch.__version__} sees no CUDA device here")


def check_models(parser, args) -> None:
    """Every name of ``args.models`` (a list) is one of :data:`MODELS`."""
    for m in args.models:
        if m not in MODELS:
            parser.error(f"--models: unknown {m!r}; choose from {list(MODELS)}")


# ----------------------------------------------------------------------------- data


def synthetic_data(folder: Path) -> Path:
    """A parallel corpus of 20-40 Zipf-distributed tokens per sentence whose target is
    a permuted, locally reordered copy of the source, binarized by fairseq."""
    rng = random.Random(1234)
    vocab = 4000
    weights = [1.0 / (r + 1) for r in range(vocab)]
    perm = list(range(vocab))
    rng.shuffle(perm)
    raw = folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", 3000), ("valid", 50), ("test", 200)):
        src, tgt = [], []
        for _ in range(size):
            words = rng.choices(range(vocab), weights=weights, k=rng.randint(20, 40))
            out = [perm[w] for w in words]
            for i in range(0, len(out) - 1, 2):
                if rng.random() < 0.3:
                    out[i], out[i + 1] = out[i + 1], out[i]
            src.append(" ".join(f"s{w}" for w in words))
            tgt.append(" ".join(f"t{w}" for w in out))
        (raw / f"{split}.src").write_text("\n".join(src) + "\n")
        (raw / f"{split}.tgt").write_text("\n".join(tgt) + "\n")
    dest = folder / "data-bin"
    subprocess.run(
        [
            str(Path(sys.executable).parent / "fairseq-preprocess"),
            "-s",
            "src",
            "-t",
            "tgt",
            "--joined-dictionary",
            "--trainpref",
            str(raw / "train"),
            "--validpref",
            str(raw / "valid"),
            "--testpref",
            str(raw / "test"),
            "--destdir",
            str(dest),
            "--workers",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    return dest


# ----------------------------------------------------------------------------- fairseq


def command_line(name, size, args):
    """fairseq-train's arguments for one model, by the training recipe's builder
    (everything but the model's own options is the same for all models)."""
    heads, ffn = SIZES[size]
    sides = ("encoder", "decoder")
    options = {
        "user_dir": PLUGIN,
        **{f"{side}_embed_dim": size for side in sides},
        **{f"{side}_ffn_embed_dim": ffn for side in sides},
        **{f"{side}_attention_heads": heads for side in sides},
        **{f"{side}_layers": args.layers for side in sides},
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "activation_dropout": 0.1,
        "share_all_embeddings": True,
        "task": "translation",
        "criterion": "label_smoothed_cross_entropy",
        "label_smoothing": 0.1,
        "lr": "5e-4",
        "warmup_updates": 4000,
        "max_tokens": args.max_tokens,
        "seed": 1,
        "num_workers": 0,
        "no_save": True,
        "disable_validation": True,
        "no_progress_bar": True,
        "cpu": args.device == "cpu",
        "fp16": args.dtype == "fp16",
        "bf16": args.dtype == "bf16",
    }
    return fairseq_arguments(args.data, options, MODELS[name])


def setup(name, size, args):
    """fairseq's configuration and task for one model (the task loads dictionaries)."""
    from fairseq import options, tasks
    from fairseq.dataclass import utils as dataclass_utils

    parser = options.get_training_parser()
    ns = options.parse_args_and_arch(parser, input_args=command_line(name, size, args))
    # looked up after the plugin was loaded (it corrects --bf16's implied --tpu there)
    cfg = dataclass_utils.convert_namespace_to_omegaconf(ns)
    return cfg, tasks.setup_task(cfg.task)


def build_trainer(name, size, args, cfg=None, task=None):
    """The model, criterion and fairseq ``Trainer`` (on the device, in the precision)."""
    import torch
    from fairseq.trainer import Trainer

    flat_master_copy_on_cpu(args)
    if cfg is None:
        cfg, task = setup(name, size, args)
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    check_conv_heads(name, model, args)
    criterion = task.build_criterion(cfg.criterion)
    trainer = Trainer(cfg, task, model, criterion)
    if name in MULTI_TENSOR_SYNC:
        from fairseq.optim.fp16_optimizer import FP16Optimizer

        from tpp_fairseq import speed

        optimizer = trainer.optimizer  # (built here, not at the first step)
        if isinstance(optimizer, FP16Optimizer) and optimizer.has_flat_params:
            speed.multi_tensor_sync(optimizer)
        else:
            raise SystemExit(
                f"{name}: fairseq's optimizer has no flat master copy here (--dtype "
                f"{args.dtype}, TPP_FAIRSEQ_SPEEDUPS={os.environ.get('TPP_FAIRSEQ_SPEEDUPS')!r}): "
                "there is nothing for the multi-tensor sync to do"
            )
    if name in COMPILED:
        from tpp_fairseq.compiled import compile_layers

        compile_layers(model)
    return cfg, task, trainer


def check_conv_heads(name, model, args):
    """On a GPU, a model's conv heads run as its name says: where Triton cannot be
    imported they would fall back to PyTorch's operations with a warning the benchmarks'
    quiet logging hides, and be timed under the kernels' name."""
    if args.device != "cuda" or "taps" in MODELS[name]:
        return
    from tpp_plugin.modules import conv_heads_triton
    from tpp_plugin.modules.local_conv import LocalConv

    if not conv_heads_triton.available() and any(isinstance(m, LocalConv) for m in model.modules()):
        raise SystemExit(
            f"{name}: Triton cannot be imported here, so its conv heads would run as PyTorch "
            "operations (tpp-taps): install triton, or time tpp-taps"
        )


def flat_master_copy_on_cpu(args):
    """On the CPU, ``--bf16``'s master copy flat as on one GPU (the plugin flattens it on
    CUDA only), so that a CPU run times the same update, the multi-tensor sync included."""
    if args.device == "cpu":
        from tpp_fairseq import speed

        speed.FLAT_BF16_DEVICE_TYPES = speed.FLAT_BF16_DEVICE_TYPES | {"cpu"}


def fixed_batches(task, cfg, split, count, max_tokens=None, max_sentences=None, seed=1):
    """``count`` batches of ``split`` in fairseq's own batching (shuffled, seeded)."""
    task.load_dataset(split)
    itr = task.get_batch_iterator(
        dataset=task.dataset(split),
        max_tokens=max_tokens,
        max_sentences=max_sentences,
        max_positions=(1024, 1024),
        ignore_invalid_inputs=True,
        required_batch_size_multiple=8,
        seed=seed,
        num_workers=0,
    ).next_epoch_itr(shuffle=True)
    batches = []
    for sample in itr:
        batches.append(sample)
        if len(batches) == count:
            break
    if len(batches) < count:  # a small split: go round again
        batches = (batches * (count // max(len(batches), 1) + 1))[:count]
    return batches


def training_steps(task, cfg, count, args):
    """``count`` training steps of ``args.update_freq`` batches each (one optimizer step
    per list), from :func:`fixed_batches`."""
    n = args.update_freq
    flat = fixed_batches(task, cfg, "train", count * n, max_tokens=args.max_tokens)
    return [flat[i * n : (i + 1) * n] for i in range(count)]


def test_batches(task, cfg, args):
    """The generation batches: one untimed, then ``--gen-batches`` timed (on the device)."""
    samples = fixed_batches(task, cfg, "test", args.gen_batches + 1, max_sentences=args.gen_batch)
    if args.device == "cuda":
        from fairseq import utils

        samples = [utils.move_to_cuda(s) for s in samples]
    return samples


def beam_search(task, model, args):
    """fairseq's ``SequenceGenerator`` for one model: beam ``--beam``, every output forced
    to ``--gen-len`` tokens (then EOS), so all models decode the same number of steps."""
    gen_args = argparse.Namespace(
        beam=args.beam, max_len_a=0, max_len_b=args.gen_len, min_len=args.gen_len
    )
    return task.build_generator([model], gen_args)


def generation_turns(runs, samples, args, before=None):
    """Beam search of every model of ``runs`` (``{name: (task, model, generator)}``):
    first untimed (on a GPU every batch once: a batch shape's first run pays one-off
    set-up; on the CPU the first batch), then the models take turns batch by batch on
    the other batches, in the orders of :func:`turn_order`. Yields ``(name, seconds, hypotheses)`` for each
    timed batch; ``before(name)``, if given, runs just before it. (fairseq's
    ``inference_step`` runs without gradients itself.)"""
    names = list(runs)
    for task, model, generator in runs.values():
        for sample in samples if args.device == "cuda" else samples[:1]:
            task.inference_step(generator, [model], sample)
    for r, sample in enumerate(samples[1:]):
        for name in turn_order(names, r):
            task, model, generator = runs[name]
            if before is not None:
                before(name)
            seconds, hyps = timed(lambda: task.inference_step(generator, [model], sample), args)
            yield name, seconds, hyps


# ----------------------------------------------------------------------------- device


def gpu_settings(args):
    """The same backend settings for every model: TF32 matrix products in float32 runs
    (not with ``--no-tf32``: float32 as fairseq-train computes it), and cuDNN's attention
    kept on where ``--cudnn-attention`` asks (the plugin, loaded with the first model,
    switches it off otherwise)."""
    import torch

    if args.device != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = not getattr(args, "no_tf32", False)
    torch.backends.cudnn.allow_tf32 = not getattr(args, "no_tf32", False)
    if args.cudnn_attention:
        os.environ["TPP_FAIRSEQ_SPEEDUPS"] = CUDNN_KEPT  # read when the plugin is loaded


def synchronize(args):
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()


def torch_dtype(args):
    """The torch dtype of ``--dtype``."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]


def device_label(args):
    """The device, as the reports name it."""
    import torch

    return (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )


# ----------------------------------------------------------------------------- timing


def timed(fn, args):
    """Seconds of ``fn()``, the device synchronised before and after, and its result."""
    synchronize(args)
    start = time.perf_counter()
    out = fn()
    synchronize(args)
    return time.perf_counter() - start, out


def turn_order(names, turn):
    """The order the models take their turns in in round ``turn``: the rows of a Williams
    design, so that over a full cycle (as many rounds as models, twice that for an odd
    number) each model takes every place equally often and follows every other one
    equally often: load changes and what one model's step leaves behind for the next
    (caches, the allocator) hit all alike."""
    n = len(names)
    if n == 1:
        return list(names)
    first = [0]  # 0, 1, n-1, 2, n-2, ...: each difference between neighbours once
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = [[(k + r) % n for k in first] for r in range(n)]
    if n % 2:  # (an odd number needs the mirrored rows too)
        rows += [row[::-1] for row in rows]
    return [names[k] for k in rows[turn % turn_cycle(n)]]


def turn_cycle(n):
    """The rounds of one cycle of :func:`turn_order`'s orders for ``n`` models."""
    return 1 if n == 1 else n if n % 2 == 0 else 2 * n


def spread(values):
    """Half the interquartile range relative to the median (a robust noise figure); None
    for fewer than 4 values, too few to tell."""
    if len(values) < 4:
        return None
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / 2 / statistics.median(values)


def plus_minus(noise):
    """A :func:`spread` as a table shows it: ``±3%``, or ``±?`` where it cannot tell."""
    return "±?" if noise is None else f"±{100 * noise:.0f}%"


def median_interval(values, level=0.95):
    """A confidence interval of the median of ``values`` (distribution-free: the order
    statistics whose ranks the binomial distribution of a median's side gives), or None
    for too few values to reach ``level``."""
    n = len(values)
    tail = (1 - level) / 2
    k, below = 0, 0.0  # k: values below the interval; below: P(Binomial(n, 1/2) < k + 1)
    while True:
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def paired_ratio(values, base):
    """The median of the per-round ratios ``values[i] / base[i]`` and their
    :func:`spread`."""
    pairs = [a / b for a, b in zip(values, base)]
    return statistics.median(pairs), spread(pairs)


def paired_text(values, base):
    """A :func:`paired_ratio` as a table shows it, with the 95% interval of its median:
    ``paired 1.01×, ±3%, 95% CI 0.99–1.03`` (``95% CI ?`` for fewer than 6 rounds)."""
    median, noise = paired_ratio(values, base)
    interval = median_interval([a / b for a, b in zip(values, base)])
    ci = "?" if interval is None else f"{interval[0]:.2f}–{interval[1]:.2f}"
    return f"paired {median:.2f}×, {plus_minus(noise)}, 95% CI {ci}"
