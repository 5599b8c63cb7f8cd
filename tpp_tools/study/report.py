"""The study's report: scores, confidence intervals, the paired bootstrap, learning
curves and the Markdown that holds them."""

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

from .commands import count_lines, json_records
from .config import VARIANTS, Config, tag_settings
from .records import validation_curve, write_atomic
from .runs import Run


#: Student's t 0.975 quantiles for 1 ... 30 degrees of freedom
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_interval(values: List[float]) -> float:
    """Half-width of the 95% confidence interval of the mean over seeds (Student's t)."""
    n = len(values)
    if n < 2:
        return float("nan")
    df = n - 1
    if df <= len(T975):
        t95 = T975[df - 1]
    else:  # Cornish-Fisher's expansion about the normal quantile: within 1e-4 from 30 on
        z = statistics.NormalDist().inv_cdf(0.975)
        t95 = z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    return t95 * statistics.stdev(values) / math.sqrt(n)


class _Recorded:
    """A sacreBLEU metric whose "hypotheses" are keys of per-sentence statistics taken
    from run records: sacreBLEU's own paired bootstrap, on statistics instead of text."""

    def __init__(self, metric, table):
        metric.num_refs = 1  # what scoring against the one reference would have set (signature)
        self._metric, self._table = metric, table

    def _extract_corpus_statistics(self, hypotheses, references):
        return [self._table[h] for h in hypotheses]

    def __getattr__(self, name):
        return getattr(self._metric, name)


def significance(runs_by_variant: Dict[str, List[Run]], records: Dict[str, dict], samples: int):
    """sacreBLEU's paired bootstrap, from the runs' per-sentence statistics, of every
    variant against the baseline (the first) on the seeds both have finished, seed with
    seed, each system its seeds' translations one after the other; the baseline alone
    on all of its seeds. Returns results by variant (``seeds``, ``compared``), signatures."""
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    names = list(runs_by_variant)
    by_seed = {name: {run.seed: run for run in runs_by_variant[name]} for name in names}
    tables = {"BLEU": {}, "chrF": {}}
    for run in (run for runs in runs_by_variant.values() for run in runs):
        for metric, table in tables.items():
            for i, stats in enumerate(records[run.name]["statistics"][metric]):
                table[f"{run.name}:{i}"] = stats
    metrics = {"BLEU": _Recorded(BLEU(), tables["BLEU"]), "chrF": _Recorded(CHRF(), tables["chrF"])}

    def system(name, seeds):
        runs = [by_seed[name][seed] for seed in seeds]
        keys = [f"{r.name}:{i}" for r in runs for i in range(records[r.name]["reference"]["lines"])]
        return (name, keys), [records[r.name]["translations_sha256"] for r in runs]

    out, signatures = {}, None
    for name in names:
        seeds = sorted(by_seed[name])
        common = [seed for seed in seeds if seed in by_seed[names[0]]]
        if name == names[0] or not common:
            systems = [system(name, seeds)]  # its own resampling, compared with nothing
        else:
            seeds = common
            systems = [system(names[0], seeds), system(name, seeds)]
        signatures, scores = PairedTest(
            [named for named, _ in systems], metrics, None, test_type="bs", n_samples=samples
        )()
        # sacreBLEU names the metrics by their own names (e.g. "chrF2")
        bleu_key = next(k for k in scores if k.startswith("BLEU"))
        chrf_key = next(k for k in scores if k.startswith("chrF"))
        out[name] = {
            "BLEU": scores[bleu_key][-1],
            "chrF": scores[chrf_key][-1],
            "seeds": seeds,
            "compared": len(systems) == 2,
            # sacreBLEU gives a system compared with an identical one its smallest
            # p-value ("a zero difference should not be attributed to chance"):
            # the report says "identical" instead of quoting it
            "identical": len(systems) == 2 and systems[0][1] == systems[1][1],
        }
    sigs = {"BLEU": str(signatures[bleu_key]), "chrF": str(signatures[chrf_key])}
    return out, sigs


def plot_curves(
    runs: List[Run], records: Dict[str, dict], target: Path, unfinished: List[Run] = ()
) -> bool:
    """Validation NLL against updates, one line per run (from its record); ``unfinished``
    runs (not in the tables) drawn as far as they validated, named so in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "transformer": "tab:blue",
        "control": "tab:green",
        "hybrid": "tab:orange",
        "hybrid+tags": "tab:red",
    }
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for run in [*runs, *unfinished]:
        valid = (
            records[run.name]["valid"]
            if run.name in records
            else validation_curve(json_records(run.folder / "train.log"))
        )
        if not valid:
            continue
        xs = [v["updates"] for v in valid]
        ys = [v["nll_loss"] for v in valid]
        ax.plot(
            xs,
            ys,
            styles[(run.seed - 1) % len(styles)],
            color=colours.get(run.variant, "k"),
            label=f"{run.variant} seed {run.seed}" + (" (not scored)" if run in unfinished else ""),
            linewidth=1.2,
        )
        drawn = True
    ax.set_xlabel("updates")
    ax.set_ylabel("validation NLL (base 2, per target token)")
    ax.set_title("Learning curves (every variant, every seed)")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = target.with_suffix(f".{os.getpid()}.tmp.png")  # a --report-only may write beside a study
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, target)
    return drawn


def run_facts(record: dict) -> dict:
    from sacrebleu.metrics import CHRF

    wps = record["train"]["wps"]
    valid = record["valid"]
    seconds = record["train"]["seconds"]
    chrf = CHRF()
    return {
        "wps": statistics.median(wps[1:] or wps) if wps else float("nan"),
        "valid_nll": valid[-1]["nll_loss"] if valid else float("nan"),
        "train_seconds": float("nan") if seconds is None else seconds,
        "scores": record["scores"],
        "chrf": chrf._aggregate_and_compute(record["statistics"]["chrF"]).score,
        "parameters": record["parameters"],
        "device": record["device"],
        "code": _code(record),
        "switches": _switches(record),
    }


def analysis_section(by_variant, facts, paths) -> List[str]:
    """The paper's analysis (its Fig. 3 discussion) on the best model of each kind with
    convolution heads: the cosine similarity of "fire" and "mountain" in the dot-product
    heads' output and in LocalConv's representation, per encoder layer."""
    lines = []
    codes = paths.get("bpe_codes")
    for variant in ("hybrid", "hybrid+tags"):
        kept = [r for r in by_variant.get(variant, []) if (r.folder / "checkpoint_avg.pt").exists()]
        if not kept:  # (runs merged from records have no checkpoint here)
            continue
        best = max(kept, key=lambda r: float(facts[r.name]["scores"]["sacrebleu_detok"]))
        cmd = [
            sys.executable,
            "-m",
            "tpp_tools.embedding_similarity",
            "--path",
            best.folder / "checkpoint_avg.pt",
            "--data",
            paths["data"],
        ]
        if codes and Path(codes).exists():
            cmd += ["--bpe-codes", codes]
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
        if not lines:
            lines += [
                "## Fire and mountain",
                "",
                "The paper's analysis on the best model (by test BLEU) of each kind with convolution "
                "heads: cosine similarity of the two words in the dot-product heads' output and in "
                "LocalConv's representation, per encoder layer (paper: 0.21 vs 0.39).",
                "",
            ]
        body = (
            proc.stdout.strip()
            if proc.returncode == 0
            else f"(failed: {proc.stderr.strip()[-300:]})"
        )
        lines += [f"{VARIANTS[variant]['label']}, seed {best.seed}:", "", "```", body, "```", ""]
    return lines


def _fmt(x, digits=2):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _per_run(runs: List[Run], value_of) -> str:
    """The value every run has, or each value with the runs that have it."""
    runs_of: Dict[str, List[str]] = {}
    for run in runs:
        runs_of.setdefault(value_of(run), []).append(run.name)
    if len(runs_of) == 1:
        return next(iter(runs_of))
    return "; ".join(f"{value} ({', '.join(names)})" for value, names in runs_of.items())


def _code(record: dict) -> str:
    """The code a record's run trained with: its commit (``+``: with changes not committed),
    else the package's version."""
    commit = record["code"].get("commit")
    if commit is None:
        return f"version {record['code']['tpp']}"
    return f"{commit[:-1]} with changes not committed" if commit.endswith("+") else commit


def _switches(record: dict) -> str:
    """The plugin's switches of fairseq's loop (``TPP_FAIRSEQ_*``) the run trained under."""
    environment = record.get("environment")
    if not isinstance(environment, dict):
        return "not recorded"
    return ", ".join(f"{k}={v}" for k, v in sorted(environment.items())) or "none"


def _header_lines(args, cfg, paths, runs, records, facts, elapsed, missing, device, baseline):
    """The report's title, the settings every run shares, and the table's head."""
    lines = [
        "# Quality study: Transformer++ against the Transformer",
        "",
        f"Data: `{paths['data']}` ({paths['src']}→{paths['tgt']}; test set {count_lines(paths['reference'])} "
        f"sentences, reference `{paths['reference']}`).",
        f"Budget (every run): {cfg.max_update} updates × up to {cfg.max_tokens * cfg.update_freq * cfg.gpus} tokens "
        f"per update (--max-tokens {cfg.max_tokens} × --update-freq {cfg.update_freq}"
        f"{f' × {cfg.gpus} GPUs' if cfg.gpus > 1 else ''}); Adam (0.9, 0.98), inverse-sqrt "
        f"schedule, peak lr {cfg.lr}, {cfg.warmup_updates} warm-up updates; d={cfg.embed_dim}, {cfg.heads} heads, "
        f"FFN {cfg.ffn_dim}, {cfg.layers}+{cfg.layers} layers{', pre-LN' if cfg.layer_norm == 'pre' else ''}, "
        f"{'shared embeddings' if cfg.shared_embeddings == 'all' else 'tied decoder embeddings'}, "
        f"dropout {cfg.dropout} / "
        f"attention {cfg.attention_dropout} / activation {cfg.activation_dropout}, label smoothing "
        f"{cfg.label_smoothing}, {cfg.dtype}; average of the last {cfg.average} checkpoints; beam 5, lenpen 0.5; "
        f"conv heads' output scaling (hybrid variants): {cfg.conv_head_scaling}"
        f"{' (the paper)' if cfg.conv_head_scaling == 'none' else ''}"
        f"{tag_settings(cfg) if 'hybrid+tags' in args.variants else ''}.",
        f"Seeds: {', '.join(map(str, sorted({r.seed for r in runs})))}. Device: {device}. Code: "
        f"{_per_run(runs, lambda r: facts[r.name]['code'])}. Switches of fairseq's loop "
        f"(TPP_FAIRSEQ_*): {_per_run(runs, lambda r: facts[r.name]['switches'])}. "
        f"Wall time of this invocation: {elapsed / 60:.1f} min; training time per run (median): "
        f"{statistics.median(facts[r.name]['train_seconds'] for r in runs) / 60:.0f} min "
        "(words/s and times are as measured under the machine's load at the time: not a speed comparison, "
        "which is docs/benchmarks.md's).",
        "",
        *(
            [
                f"Not finished, not in the tables: {', '.join(r.name for r in missing)} (re-run the study "
                "to finish them).",
                "",
            ]
            if missing
            else []
        ),
        "| variant | what | parameters | BLEU (mean over seeds ± 95% CI) | per seed | chrF (mean) "
        f"| tok. BLEU, compound split (mean) | bootstrap BLEU: mean ± 95% CI | p vs {baseline} "
        f"| bootstrap chrF: mean ± 95% CI | p vs {baseline} | valid NLL | train words/s |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    return lines


def _table_rows(args, by_variant, facts, boot) -> List[str]:
    """One row per variant: scores over seeds, the bootstrap against the baseline."""
    lines = []
    for variant, vruns in by_variant.items():
        vruns = sorted(vruns, key=lambda r: r.seed)
        bleus = [float(facts[r.name]["scores"]["sacrebleu_detok"]) for r in vruns]
        chrfs = [facts[r.name]["chrf"] for r in vruns]
        toks = [float(facts[r.name]["scores"]["bleu_tok_compound_split"]) for r in vruns]
        b, c = boot[variant]["BLEU"], boot[variant]["chrF"]
        if variant == args.variants[0]:
            p_b = p_c = "—"
        elif not boot[variant]["compared"]:
            p_b = p_c = "no seed in common"
        elif boot[variant]["identical"]:
            p_b = p_c = "identical translations"
        else:
            p_b, p_c = _fmt(b.p_value, 4), _fmt(c.p_value, 4)
            seeds = boot[variant]["seeds"]
            if seeds != boot[args.variants[0]]["seeds"]:  # on some of the baseline's seeds
                on = f" (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"
                p_b, p_c = p_b + on, p_c + on
        lines.append(
            f"| {VARIANTS[variant]['label']} | {VARIANTS[variant]['what']} | {facts[vruns[0].name]['parameters'] / 1e6:.2f}M "
            f"| {statistics.mean(bleus):.2f} ± {_fmt(t_interval(bleus))} | {' / '.join(f'{x:.2f}' for x in bleus)} "
            f"| {statistics.mean(chrfs):.2f} | {statistics.mean(toks):.2f} "
            f"| {b.mean:.2f} ± {b.ci:.2f} | {p_b} | {c.mean:.2f} ± {c.ci:.2f} | {p_c} "
            f"| {statistics.mean(facts[r.name]['valid_nll'] for r in vruns):.3f} "
            f"| {statistics.median(facts[r.name]['wps'] for r in vruns):,.0f} |"
        )
    return lines


def _closing_lines(args, by_variant, records, facts, paths, signatures, boot, command, runs):
    """What the bootstrap is, the signatures, the curves, the commands and the analyses."""
    lines = []
    scores = {r.name: facts[r.name]["scores"] for r in runs}
    seeds = "; ".join(
        f"{VARIANTS[v]['label'].split()[0]} {', '.join(map(str, boot[v]['seeds']))}"
        for v in by_variant
    )
    lines += [
        "",
        f"Bootstrap: sacreBLEU's paired bootstrap resampling ({args.bootstrap_samples} resamples) of each variant "
        f"against {VARIANTS[args.variants[0]]['label']} on the seeds both have finished, each system being "
        "those seeds' translations of the test set one after the other (the reference repeated as often), "
        "seed paired with seed; the baseline's own row (and a variant without a seed in common with it) "
        "resamples all of its seeds. Seeds resampled: "
        f"{seeds}. p is the probability of the "
        "observed difference under the null hypothesis that the two systems are the same. A variant whose "
        "translations are word for word the baseline's is marked \"identical translations\" (sacreBLEU "
        "gives such a pair its smallest p-value by design).",
        f"Signatures: BLEU `{signatures['BLEU']}`; chrF `{signatures['chrF']}`; "
        "per-run detokenised BLEU "
        + _per_run(runs, lambda r: f"`{scores[r.name].get('sacrebleu_detok_signature', '')}`")
        + "; tokenised "
        + _per_run(
            runs, lambda r: f"`{scores[r.name].get('bleu_tok_compound_split_signature', '')}`"
        )
        + ".",
        "",
        "![learning curves](curves.png)",
        "",
        "## Commands",
        "",
        "The study:",
        "",
        "```bash",
        command,
        "```",
        "",
        "Each run's training command (the first seed of each variant; the others differ in --seed "
        "and folder; `tpp-train --dry-run` prints the fairseq-train command it runs):",
        "",
    ]
    for variant, vruns in by_variant.items():
        lines += [
            f"- {variant}:",
            "",
            "```bash",
            " ".join(shlex.quote(c) for c in records[vruns[0].name]["train_command"]),
            "```",
            "",
        ]
    lines += analysis_section(by_variant, facts, paths)
    lines += [
        "Per-run records (scores, validation curve, command, code version, device; numbers only): "
        "`runs/<variant>-s<seed>-<id>/record.json.gz`; translations `eval/hyp.detok`; logs "
        "`train.log`, `run.log`."
    ]
    return lines


def _write_summary(args, cfg, command, runs, facts, boot, signatures) -> None:
    """summary.json: the configuration, the command and every run's facts (numbers only)."""
    summary = {
        "config": asdict(cfg),
        "command": command,
        "runs": {
            r.name: {"folder": str(r.folder), **{k: v for k, v in facts[r.name].items()}}
            for r in runs
        },
        "bootstrap": {
            v: {m: (vars(x) if m in ("BLEU", "chrF") else x) for m, x in d.items()}
            for v, d in boot.items()
        },
        "signatures": signatures,
    }
    write_atomic(
        args.out / "summary.json", (json.dumps(summary, indent=1, default=str) + "\n").encode()
    )


def write_report(
    args,
    cfg: Config,
    paths,
    runs: List[Run],
    records: Dict[str, dict],
    command: str,
    elapsed: float,
    missing: Optional[List[Run]] = None,
) -> Path:
    """The report of ``runs`` (finished, ``records`` by run name); ``missing``: planned
    runs not finished, named."""
    # in --variants' order: the first is the baseline that the bootstrap compares with,
    # also when its first seed has not finished (a partial report)
    by_variant: Dict[str, List[Run]] = {
        v: [run for run in runs if run.variant == v]
        for v in args.variants
        if any(run.variant == v for run in runs)
    }
    facts = {run.name: run_facts(records[run.name]) for run in runs}
    boot, signatures = significance(by_variant, records, args.bootstrap_samples)
    plot = args.out / "curves.png"
    plot_curves(runs, records, plot, unfinished=missing or [])
    device = _per_run(runs, lambda run: facts[run.name]["device"])

    baseline = VARIANTS[args.variants[0]]["label"].split()[0]  # "(a)": what p compares with

    lines = _header_lines(
        args, cfg, paths, runs, records, facts, elapsed, missing, device, baseline
    )
    lines += _table_rows(args, by_variant, facts, boot)
    lines += _closing_lines(
        args, by_variant, records, facts, paths, signatures, boot, command, runs
    )
    report = args.out / "report.md"
    write_atomic(report, ("\n".join(lines) + "\n").encode())
    _write_summary(args, cfg, command, runs, facts, boot, signatures)
    return report
