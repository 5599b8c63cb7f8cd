"""Translate a binarized split with fairseq-generate and score it three ways.

Usage (``python -m tpp_tools.evaluate`` too; options after ``--`` go to fairseq-generate)::

    tpp-evaluate --data data-bin/wmt14_en_de \\
        --checkpoint checkpoints/en-de/checkpoint_avg10.pt \\
        --reference work/wmt14_en_de/raw/test.de --out results/en-de

From Python::

    from tpp_tools.evaluate import evaluate
    scores = evaluate("data-bin/x", "avg.pt", "raw/test.de", "results/x", cpu=True)
    scores["sacrebleu_detok"], scores["chrf"], scores["bleu_tok_compound_split"]

Before anything slow the inputs are checked: the checkpoint must load and match the data
folder's dictionaries; the reference must be UTF-8, with exactly one line per sentence of
the split (split at ``\\n`` only, trailing whitespace and ``\\r`` dropped). Then
``fairseq-generate --beam 5 --lenpen 0.5 --remove-bpe --num-workers 0`` translates (a test
set needs no loader process, one less thing to start and shut down), and sacreBLEU's API
scores: detokenised sacreBLEU (sacremoses, then 13a against the raw reference; with its
signature), chrF on the same text, and the paper's tokenised BLEU with compound splitting
(``a-b`` becomes ``a ##AT##-##AT## b`` in the hypothesis and the tokenised reference, then
``tokenize="none"``, no smoothing, as multi-bleu).

``--out`` gets ``generate-<split>.txt``, ``hyp.tok``, ``ref.tok``, ``hyp.detok``,
``hyp.tok.split``, ``ref.tok.split`` and ``bleu.txt`` (printed; an existing one needs
``--force``), moved in once all succeeded, ``bleu.txt`` last: a failed run leaves the
previous results. Exit status: 0 success, 2 bad input (its file and line named), 1
fairseq-generate failed.
"""

import argparse
import codecs
import contextlib
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tpp_pipeline.errors import UserError, report
from tpp_pipeline.lock import exit_cleanly_on_sigterm, held_locks, work_dir_lock

from .user_dir import PluginNotFound, plugin_dir

PROG = "tpp-evaluate"
TEMP_PREFIX = ".evaluate-"
#: one evaluation at a time in an --out folder (the lock file there)
LOCK_NAME = ".evaluate.lock"
# tensor2tensor's get_ende_bleu.sh and fairseq's compound_split_bleu.sh:
# s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g on text without aggressive hyphen splits; ours has
# them ("a @-@ b"), brought to the same form
_COMPOUND = re.compile(r"(\S)-(\S)", re.ASCII)
_MOSES_HYPHEN = " @ ##AT##-##AT## @ "


class EvaluationError(UserError):
    """Bad input: reported without a traceback, exit status 2."""


class GenerationError(UserError):
    """fairseq-generate failed or did not translate the whole split: exit status 1."""

    status = 1


# --------------------------------------------------------------------------- inputs


def read_lines(path):
    """The lines of a text file as sacreBLEU reads them: split at ``\\n`` only (a last
    line without a final newline counts), trailing whitespace (and ``\\r``) dropped; a
    UTF-8 byte order mark at the start is not text, and is dropped too. Invalid UTF-8 is
    an error naming the file and line."""
    path = Path(path)
    if path.is_dir():
        raise EvaluationError(
            f"{path}: is a folder, not a file (--reference takes the raw "
            "reference file itself, one sentence per line)"
        )
    if not path.is_file():
        raise EvaluationError(f"{path}: no such file")
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()  # the final newline ends the last line; it does not start one
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        try:
            lines.append(raw.decode("utf-8").rstrip())
        except UnicodeDecodeError as error:
            raise EvaluationError(
                f"{path}:{number}: invalid UTF-8 byte {raw[error.start:error.start + 1]!r} "
                f"at column {error.start + 1}"
            ) from None
    return lines


def infer_languages(data, split, source_lang=None, target_lang=None):
    """(source, target) of ``split`` from the data folder's ``<split>.<src>-<tgt>.*.idx``."""
    pairs = set()
    for idx in Path(data).glob(f"{split}.*-*.*.idx"):
        pair = idx.name[len(split) + 1 :].split(".")[0]
        src, _, tgt = pair.partition("-")
        if src and tgt:
            pairs.add((src, tgt))
    if source_lang and target_lang:
        return source_lang, target_lang
    matching = sorted(
        p for p in pairs if (source_lang in (None, p[0])) and (target_lang in (None, p[1]))
    )
    if not matching:
        raise EvaluationError(
            f"{data}: no '{split}' split (expected {split}.<src>-<tgt>.<lang>.idx"
            + (
                f" for {source_lang or '*'}-{target_lang or '*'}"
                if source_lang or target_lang
                else ""
            )
            + ")"
        )
    if len(matching) > 1:
        raise EvaluationError(
            f"{data}: split '{split}' exists for several language pairs "
            f"({', '.join('-'.join(p) for p in matching)}): pass --source-lang and --target-lang"
        )
    return matching[0]


# chrF of the binarized target against the reference below which the reference is taken
# for another text (the source side, another split, shuffled lines): the same text scores
# near 100, less only by Moses round trips and <unk>
REFERENCE_AGREEMENT = 60.0


def reference_agreement(data, split, src, tgt, references, limit=500):
    """chrF of the first ``limit`` sentences of the binarized target of ``split`` (BPE
    removed, Moses-detokenised) against the same lines of ``references``."""
    from fairseq.data import Dictionary, data_utils
    from sacrebleu.metrics import CHRF
    from sacremoses import MosesDetokenizer

    dictionary = Dictionary.load(str(Path(data) / f"dict.{tgt}.txt"))
    dataset = data_utils.load_indexed_dataset(
        str(Path(data) / f"{split}.{src}-{tgt}.{tgt}"), dictionary
    )
    detokenizer = MosesDetokenizer(lang=tgt)
    count = min(limit, len(dataset), len(references))
    targets = [
        detokenizer.detokenize(dictionary.string(dataset[i], bpe_symbol="subword_nmt").split())
        for i in range(count)
    ]
    return CHRF().corpus_score(targets, [references[:count]]).score


# fairseq's translation task and its Transformers take sentences of at most this many
# tokens (--max-source-positions, --max-target-positions; the end of sentence counts)
DEFAULT_MAX_POSITIONS = 1024


def oversized(data, split, src, tgt, limits, max_tokens=None):
    """A sentence of ``split`` longer than ``limits`` (source, target tokens), which
    fairseq refuses to translate or validate, or than a batch of ``max_tokens``, which
    fairseq cannot batch, as an error message; None when all fit."""
    from fairseq.data import data_utils

    sizes = []
    for lang in (src, tgt):
        dataset = data_utils.load_indexed_dataset(
            str(Path(data) / f"{split}.{src}-{tgt}.{lang}"), None
        )
        if dataset is None:  # (a missing split is named where it is needed)
            return None
        sizes.append([int(n) for n in dataset.sizes])  # copied: the sizes are mapped from the file
        del dataset
    over = [i for i, pair in enumerate(zip(*sizes)) if pair[0] > limits[0] or pair[1] > limits[1]]
    if not over and max_tokens is not None and sizes[0]:
        tokens = [max(pair) for pair in zip(*sizes)]  # what fairseq batches a sentence by
        longest = tokens.index(max(tokens))
        if tokens[longest] > max_tokens:
            return (
                f"--max-tokens {max_tokens} is smaller than sentence {longest} of split "
                f"'{split}' of {data} (line {longest + 1} of its {src} and {tgt} files: "
                f"{tokens[longest]} tokens after BPE, end of sentence included): give at "
                f"least {tokens[longest]}"
            )
    if not over:
        return None
    first = over[0]
    more = f" ({len(over)} sentences in all)" if len(over) > 1 else ""
    return (
        f"{data}: sentence {first} of split '{split}' (line {first + 1} of its {src} and {tgt} "
        f"files) is {sizes[0][first]} source and {sizes[1][first]} target tokens after BPE, "
        f"end of sentence included{more}; the model takes at most {limits[0]} and "
        f"{limits[1]} (max_source_positions, max_target_positions), so fairseq would "
        f"refuse the split. Shorten or split that line on both sides (or leave it out of "
        f"both), and prepare the data again"
    )


def max_positions_in(options):
    """(source, target) limits that a fairseq command's ``options`` set with
    --max-source-positions and --max-target-positions (fairseq's default otherwise)."""
    options = [str(option) for option in options]
    limits = []
    for name in ("--max-source-positions", "--max-target-positions"):
        given = [options[i + 1] for i, o in enumerate(options[:-1]) if o == name]
        limits.append(int(given[-1]) if given and given[-1].isdigit() else DEFAULT_MAX_POSITIONS)
    return tuple(limits)


def model_max_positions(state):
    """(max_source_positions, max_target_positions) of a loaded checkpoint's model."""
    cfg = state.get("cfg")
    model = cfg.get("model") if cfg is not None else None
    model = model if model is not None else state.get("args")
    limits = []
    for name in ("max_source_positions", "max_target_positions"):
        value = model.get(name) if hasattr(model, "get") else getattr(model, name, None)
        limits.append(int(value) if value else DEFAULT_MAX_POSITIONS)
    return tuple(limits)


def count_sentences(data, split, src, tgt):
    """Sentences in the binarized ``split`` (from the .idx files, with fairseq's reader),
    its files checked whole first."""
    import logging

    logging.getLogger("fairseq").setLevel(logging.WARNING)
    from fairseq.data import data_utils

    from fairseq.data import Dictionary

    from tpp_fairseq.data_files import check_binarized

    counts = {}
    for lang in (src, tgt):
        prefix = Path(data) / f"{split}.{src}-{tgt}.{lang}"
        if not Path(f"{prefix}.idx").is_file():
            raise EvaluationError(
                f"{prefix}.idx: no such file (the split '{split}' needs its binarized source "
                "and target; the target gives the tokenised reference)"
            )
        dictionary = Path(data) / f"dict.{lang}.txt"
        if dictionary.is_file():  # (whole, and within its dictionary: a DataFileError if not)
            check_binarized(str(prefix), len(Dictionary.load(str(dictionary))), str(dictionary))
        try:
            dataset = data_utils.load_indexed_dataset(str(prefix), None)
        except Exception as error:
            raise EvaluationError(f"{prefix}.idx: cannot be read by fairseq ({error})") from None
        if dataset is None:
            raise EvaluationError(f"{prefix}.idx: cannot be read by fairseq")
        counts[lang] = len(dataset)
        del dataset
    if counts[src] != counts[tgt]:
        raise EvaluationError(
            f"{data}: split '{split}' has {counts[src]} source but "
            f"{counts[tgt]} target sentences"
        )
    return counts[tgt]


def check_checkpoint(path, data, source_lang, target_lang):
    """The checkpoint loads, and was trained with the dictionaries of ``data`` (the
    record the plugin keeps in checkpoints; the embedding sizes for older ones). Returns
    its model's (max_source_positions, max_target_positions)."""
    from .checkpoint_files import CheckpointError, load_checkpoint

    try:
        state = load_checkpoint(path, mmap=True)  # maps the tensors: cheap, but a full unpickle
    except CheckpointError as error:
        raise EvaluationError(str(error)) from None
    from tpp_fairseq.checkpoint_match import (
        CheckpointMismatch,
        check_dictionaries,
        record_of_data_folder,
    )

    try:
        check_dictionaries(
            state,
            record_of_data_folder(data, source_lang, target_lang),
            path,
            hint="Evaluate with the data folder the model was trained on (or one with "
            "the same dictionaries)",
        )
    except CheckpointMismatch as error:
        raise EvaluationError(str(error)) from None
    return model_max_positions(state)


# --------------------------------------------------------------------------- generate output


def parse_generate_output(text):
    """{sentence id: {"S": source, "T": target, "H": best hypothesis, "score": float}}
    from fairseq-generate's output (other lines, e.g. log lines, are ignored)."""
    sentences = {}
    for line in text.split("\n"):
        match = re.match(r"^([STH])-(\d+)\t", line)
        if match is None:
            continue
        kind, sentence_id = match.group(1), int(match.group(2))
        entry = sentences.setdefault(sentence_id, {})
        if kind == "H":
            if "H" in entry:
                continue  # --nbest > 1: the first hypothesis is the best
            fields = line.split("\t", 2)
            entry["score"] = float(fields[1]) if len(fields) > 1 and fields[1] else None
            entry["H"] = fields[2] if len(fields) > 2 else ""
        else:
            entry[kind] = line.split("\t", 1)[1]
    return sentences


def split_compounds(line):
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line).replace(_MOSES_HYPHEN, " ##AT##-##AT## ")


# --------------------------------------------------------------------------- scores


def score_all(hypotheses_tok, references_tok, references_raw, target_lang):
    """Detokenise and score; returns (scores dict, {file name: lines})."""
    import sacrebleu  # noqa: F401  (the metrics below are sacreBLEU's own)
    from sacrebleu.metrics import BLEU, CHRF
    from sacremoses import MosesDetokenizer

    detokenizer = MosesDetokenizer(lang=target_lang)
    detok = [
        detokenizer.detokenize(h.split(), return_str=True, unescape=True).rstrip()
        for h in hypotheses_tok
    ]
    hyp_split = [split_compounds(h).rstrip() for h in hypotheses_tok]
    ref_split = [split_compounds(r).rstrip() for r in references_tok]

    scores = {}
    for key, metric, hyps, refs in (
        ("sacrebleu_detok", BLEU(), detok, references_raw),
        ("chrf", CHRF(), detok, references_raw),
        (
            "bleu_tok_compound_split",
            # tokenised on purpose: sacreBLEU's warning about tokenised input is not for it
            BLEU(tokenize="none", smooth_method="none", force=True),
            hyp_split,
            ref_split,
        ),
    ):
        result = metric.corpus_score(hyps, [refs])
        signature = metric.get_signature().format()
        scores[key] = result.score
        scores[f"{key}_signature"] = signature
        scores[f"{key}_full"] = result.format(width=2, signature=signature)
    files = {
        "hyp.tok": hypotheses_tok,
        "ref.tok": references_tok,
        "hyp.detok": detok,
        "hyp.tok.split": hyp_split,
        "ref.tok.split": ref_split,
    }
    return scores, files


def bleu_report(scores, header):
    lines = list(header)
    for key in ("sacrebleu_detok", "chrf", "bleu_tok_compound_split"):
        lines += [
            f"{key}: {scores[key]:.2f}",
            f"{key}_signature: {scores[key + '_signature']}",
            f"{key}_full: {scores[key + '_full']}",
        ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- files


def _remove_abandoned_temporaries(out):
    """Temporary folders of evaluations killed on this host (their process is gone)."""
    host = socket.gethostname()
    for folder in out.glob(f"{TEMP_PREFIX}*"):
        parts = folder.name[len(TEMP_PREFIX) :].split("-")
        if len(parts) < 3 or parts[0] != host.replace("-", "_") or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass


def _write_lines(path, lines):
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        handle.writelines(line + "\n" for line in lines)


def _publish(staging, out, names):
    """Move the finished files into ``out``: the old bleu.txt goes first (and fairseq's
    output of another split), the new one comes last, so a bleu.txt is only ever next to
    the files it was computed from."""
    bleu = out / "bleu.txt"
    if bleu.exists():
        said = re.search(r" split (\S+) \(", bleu.read_text(encoding="utf-8", errors="replace"))
        earlier = out / f"generate-{said.group(1)}.txt" if said else None
        bleu.unlink()
        if earlier is not None and earlier.name not in names and earlier.exists():
            earlier.unlink()  # the earlier evaluation's, of another split
    for name in names:
        if name != "bleu.txt":
            os.replace(staging / name, out / name)
    os.replace(staging / "bleu.txt", bleu)


# --------------------------------------------------------------------------- evaluation


#: fairseq-generate's options that tpp-evaluate sets itself, refused after ``--``: fairseq
#: would take the last value, and the scores would not be of what the report names
OWN_GENERATE_OPTIONS = {
    **dict.fromkeys(("--gen-subset", "--path"), "use --split and --checkpoint"),
    **dict.fromkeys(("--source-lang", "-s", "--target-lang", "-t"), "give it before --"),
    **dict.fromkeys(("--task", "--user-dir"), "give it before --"),
    **dict.fromkeys(("--beam", "--lenpen", "--max-tokens"), "give it before --"),
    **dict.fromkeys(
        ("--tokenizer", "--bpe", "--remove-bpe", "--post-process", "--results-path"),
        "tpp-evaluate removes the BPE and detokenises fairseq-generate's output itself",
    ),
}


def _checked_inputs(
    data, checkpoint, reference, out, split, source_lang, target_lang, beam, max_tokens,
    user_dir, force, generate_args, log,
):  # fmt: skip
    """:func:`evaluate`'s checks before anything is translated (an
    :class:`EvaluationError` naming the file): the plugin's folder, the languages, the
    number of sentences and the reference's lines."""
    try:
        user_dir = Path(user_dir) if user_dir else plugin_dir()
    except PluginNotFound as error:
        raise EvaluationError(str(error)) from None
    for name, value in (("--beam", beam), ("--max-tokens", max_tokens)):
        if not (isinstance(value, int) and value >= 1):
            raise EvaluationError(f"{name} must be a whole number of at least 1, not {value}")
    for word in map(str, generate_args):
        option = word.split("=", 1)[0]
        if option in OWN_GENERATE_OPTIONS:
            raise EvaluationError(f"{option} after --: {OWN_GENERATE_OPTIONS[option]}")
    if not data.is_dir():
        raise EvaluationError(f"{data}: data folder does not exist")
    if checkpoint.is_dir():
        raise EvaluationError(f"{checkpoint}: a folder, not a checkpoint file (--checkpoint)")
    if not checkpoint.is_file():
        raise EvaluationError(f"{checkpoint}: no such checkpoint")
    if not user_dir.is_dir():
        raise EvaluationError(f"{user_dir}: plugin folder (--user-dir) does not exist")
    if out.exists() and not out.is_dir():
        raise EvaluationError(f"{out}: exists and is not a folder")
    if (out / "bleu.txt").exists() and not force:
        raise EvaluationError(
            f"{out / 'bleu.txt'}: already exists (use --force to evaluate " f"again into {out})"
        )
    src, tgt = infer_languages(data, split, source_lang, target_lang)
    sentences = count_sentences(data, split, src, tgt)
    references = read_lines(reference)
    if len(references) != sentences:
        raise EvaluationError(
            f"{reference}: {len(references)} lines, but split '{split}' of {data} has "
            f"{sentences} sentences (wrong split or reference?)"
        )
    model_limits = check_checkpoint(checkpoint, data, src, tgt)
    # fairseq-generate's limit: the smaller of the model's and the task's (its options)
    task_limits = max_positions_in(generate_args)
    too_long = oversized(
        data, split, src, tgt, [min(pair) for pair in zip(model_limits, task_limits)], max_tokens
    )
    if too_long is not None:
        raise EvaluationError(too_long)
    agreement = reference_agreement(data, split, src, tgt, references)
    if agreement < REFERENCE_AGREEMENT:
        print(
            f"{PROG}: warning: {reference} does not read like the target side of split "
            f"'{split}' of {data} (chrF {agreement:.1f} against its binarized {tgt} text, "
            "where the same text scores near 100): is it the reference of this split, in "
            "the target language, in the same order?",
            file=log,
            flush=True,
        )

    return user_dir, src, tgt, sentences, references


def _generate_command(
    data, checkpoint, split, src, tgt, user_dir, task, beam, lenpen, max_tokens, cpu,
    generate_args,
):  # fmt: skip
    """fairseq-generate's command line for :func:`evaluate`."""
    return [
        sys.executable,
        "-m",
        "fairseq_cli.generate",
        str(data),
        "--user-dir",
        str(user_dir),
        "--task",
        task,
        "--source-lang",
        src,
        "--target-lang",
        tgt,
        "--path",
        str(checkpoint),
        "--gen-subset",
        split,
        "--beam",
        str(beam),
        "--lenpen",
        str(lenpen),
        "--max-tokens",
        str(max_tokens),
        "--remove-bpe",
        "--num-workers",
        "0",
        *(["--cpu"] if cpu else []),
        *map(str, generate_args),
    ]


def _run_generate(command, generated, sentences, split, log):
    """Run fairseq-generate into ``generated``; its output parsed, every sentence's
    hypothesis and target there (a :class:`GenerationError` where not)."""
    started = time.monotonic()
    with open(generated, "w", encoding="utf-8") as handle:
        # (it inherits the --out folder's lock: one left running by a killed evaluation
        # holds it). In a session of its own: Ctrl-C reaches this process alone, which
        # stops it, rather than printing its traceback.
        status = subprocess.run(
            command, stdout=handle, pass_fds=held_locks(), start_new_session=True
        ).returncode
    print(
        f"{PROG}: fairseq-generate exited after {time.monotonic() - started:.0f} s",
        file=log,
        flush=True,
    )
    text = generated.read_text(encoding="utf-8", errors="replace")
    if status != 0:
        # its log and error messages went to stderr, above this one
        tail = "\n".join(text.splitlines()[-10:])
        raise GenerationError(
            f"fairseq-generate failed (exit status {status}; its messages "
            "are above); the previous results in --out are untouched"
            + (f"; the end of its output:\n{tail}" if tail.strip() else "")
        )
    parsed = parse_generate_output(text)
    missing = [i for i in range(sentences) if "H" not in parsed.get(i, {})]
    if missing:
        raise GenerationError(
            f"fairseq-generate translated {sentences - len(missing)} of the {sentences} "
            f"sentences of '{split}' (missing ids: {', '.join(map(str, missing[:10]))}"
            f"{' ...' if len(missing) > 10 else ''})"
        )
    no_target = [i for i in range(sentences) if "T" not in parsed[i]]
    if no_target:
        raise GenerationError(
            f"fairseq-generate printed no target (T- line) for "
            f"sentence {no_target[0]}: is the binarized target missing?"
        )
    return parsed


def _translate_and_score(command, out, split, sentences, references, tgt, header, log):
    """Run ``command`` (fairseq-generate) and score its output in a staging folder of
    ``out``, then publish the files (:func:`_publish`): (scores, the report)."""
    staging = Path(
        tempfile.mkdtemp(
            prefix=f"{TEMP_PREFIX}{socket.gethostname().replace('-', '_')}-{os.getpid()}-", dir=out
        )
    )
    try:
        generated = staging / f"generate-{split}.txt"
        parsed = _run_generate(command, generated, sentences, split, log)
        hypotheses = [parsed[i]["H"] for i in range(sentences)]
        targets = [parsed[i]["T"] for i in range(sentences)]
        started = time.monotonic()
        scores, files = score_all(hypotheses, targets, references, tgt)
        print(f"{PROG}: scored in {time.monotonic() - started:.0f} s", file=log, flush=True)
        for name, lines in files.items():
            _write_lines(staging / name, lines)
        report = bleu_report(scores, header)
        (staging / "bleu.txt").write_text(report, encoding="utf-8")
        _publish(staging, out, [generated.name, *files, "bleu.txt"])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return scores, report


def evaluate(
    data,
    checkpoint,
    reference,
    out,
    split="test",
    source_lang=None,
    target_lang=None,
    beam=5,
    lenpen=0.5,
    max_tokens=4096,
    task="translation",
    user_dir=None,
    cpu=False,
    force=False,
    generate_args=(),
    log=sys.stderr,
):
    """Translate ``split`` of ``data`` with ``checkpoint`` and score it against
    ``reference``; write the files described in the module docstring into ``out``.

    Returns the scores: ``sacrebleu_detok``, ``chrf``, ``bleu_tok_compound_split``
    (floats), each with ``<key>_signature`` and ``<key>_full`` (sacreBLEU's text line),
    plus ``sentences``. Raises :class:`EvaluationError` for bad input (before anything is
    translated) and :class:`GenerationError` when fairseq-generate fails; either way
    ``out`` is left as it was.
    """
    data, checkpoint, reference, out = Path(data), Path(checkpoint), Path(reference), Path(out)
    if not math.isfinite(lenpen):
        raise EvaluationError(f"--lenpen must be a finite number, not {lenpen}")
    user_dir, src, tgt, sentences, references = _checked_inputs(
        data, checkpoint, reference, out, split, source_lang, target_lang, beam, max_tokens,
        user_dir, force, generate_args, log,
    )  # fmt: skip
    writable_folder(out, "--out folder", EvaluationError)
    with work_dir_lock(out, user="evaluation", folder="--out folder", lock_name=LOCK_NAME):
        if (out / "bleu.txt").exists() and not force:  # (by another, since the check)
            raise EvaluationError(f"{out / 'bleu.txt'}: already exists (use --force)")
        _remove_abandoned_temporaries(out)
        command = _generate_command(
            data, checkpoint, split, src, tgt, user_dir, task, beam, lenpen, max_tokens, cpu,
            generate_args,
        )  # fmt: skip
        print(
            f"{PROG}: translating {data}:{split} ({src}-{tgt}, {sentences} sentences) "
            f"with {checkpoint} (beam {beam}, lenpen {lenpen})",
            file=log,
            flush=True,
        )
        header = [
            f"checkpoint: {checkpoint}",
            f"data: {data} split {split} ({src}-{tgt}), beam {beam}, lenpen {lenpen}, "
            f"{sentences} sentences",
        ]
        if generate_args:
            header.append(f"generate options: {shlex.join(map(str, generate_args))}")
        scores, report = _translate_and_score(
            command, out, split, sentences, references, tgt, header, log
        )
    scores["sentences"] = sentences
    scores["report"] = report
    return scores


def build_parser():
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Translate a binarized split with fairseq-generate and score it: "
        "detokenised sacreBLEU, chrF and tokenised BLEU with compound splitting.",
        epilog="Options after '--' go to fairseq-generate. See docs/training_and_evaluation.md "
        "(or the docstring of tpp_tools/evaluate.py).",
    )
    parser.add_argument("--data", required=True, help="binarized data folder")
    parser.add_argument("--checkpoint", required=True, help="model (e.g. the averaged checkpoint)")
    parser.add_argument(
        "--reference",
        required=True,
        help="raw, untokenised reference, one sentence per line, in the "
        "order of the split (e.g. newstest2014.de)",
    )
    parser.add_argument(
        "--out", required=True, help="results folder; its bleu.txt is refused unless --force"
    )
    parser.add_argument("--split", default="test", help="[test]")
    parser.add_argument("--source-lang", help="[inferred from the data folder]")
    parser.add_argument("--target-lang", help="[inferred from the data folder]")
    parser.add_argument("--beam", type=int, default=5, help="[5]")
    parser.add_argument("--lenpen", type=float, default=0.5, help="[0.5]")
    parser.add_argument("--max-tokens", type=int, default=4096, help="[4096]")
    parser.add_argument(
        "--task", default="translation", help="[translation]: the model needs no tags at inference"
    )
    parser.add_argument("--user-dir", default=None, help="[the installed tpp_plugin package]")
    parser.add_argument("--cpu", action="store_true", help="translate on the CPU")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace the results of an earlier run in --out (only once the "
        "new evaluation has succeeded)",
    )
    return parser


def writable_folder(path, what, error):
    """Create ``path`` if need be and check that it takes a file, before the long work:
    ``error`` (an exception class) names it otherwise."""
    from tpp_pipeline.errors import DataError
    from tpp_pipeline.textio import ensure_writable_dir

    try:
        ensure_writable_dir(path, what)
    except DataError as err:
        raise error(str(err)) from None


@contextlib.contextmanager
def staged_files(folder: Path):
    """A fresh folder inside ``folder`` to write a set of outputs into; once the block
    ends without error its files replace ``folder``'s of the same names, so that a run
    stopped or failed part-way leaves the earlier set whole, and two runs never share a
    temporary name. The staging folder is removed either way."""
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder))
    try:
        yield staging
        for path in sorted(staging.iterdir()):
            os.replace(path, Path(folder) / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    generate_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, generate_args = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    exit_cleanly_on_sigterm()  # (the staged outputs are removed on the way out)
    try:
        scores = evaluate(
            args.data,
            args.checkpoint,
            args.reference,
            args.out,
            args.split,
            args.source_lang,
            args.target_lang,
            args.beam,
            args.lenpen,
            args.max_tokens,
            args.task,
            args.user_dir,
            args.cpu,
            args.force,
            generate_args,
        )
    except UserError as error:  # bad input (2), fairseq-generate failing (1)
        return report(PROG, error)
    sys.stdout.write(scores["report"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
