#!/usr/bin/env python3
"""Tagging throughput: the pipeline's tagger (1 and N workers) against the naive way.

Naive = ``nlp(doc)`` one sentence at a time with the full pipeline (parser and
lemmatizer included). To compare labels honestly, the naive way gets the same Moses
tokens (a ``Doc`` built from the unescaped tokens): both then label exactly the same
tokens, and the check is that every POS and NER label is identical, line by line.
Words/s counts Moses tokens; the pipeline's time includes starting its worker processes
but not loading the model (done once per job in either case).

    python -m benchmarks.bench_tagging --sentences 2000 --runs 3
"""

import argparse
import os
import statistics
import tempfile
import time

from benchmarks import harness
from tpp_pipeline import moses, tagging


def load_sentences(path, count):
    prep = moses.MosesPreprocessor("en")
    lines = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            tokens = prep(line.rstrip("\n"))
            if tokens:
                lines.append(tokens)
            if len(lines) == count:
                break
    return lines


def naive(lines, model):
    import spacy
    from spacy.tokens import Doc

    nlp = spacy.load(model)
    start = time.perf_counter()
    out = []
    for line in lines:
        doc = nlp(Doc(nlp.vocab, words=[tagging.unescape_moses_token(t) for t in line.split()]))
        out.append(
            (
                " ".join(t.pos_ or "X" for t in doc),
                " ".join(f"{t.ent_iob_}-{t.ent_type_}" if t.ent_type_ else "O" for t in doc),
            )
        )
    return time.perf_counter() - start, out


def pipeline(lines, model, workers, chunk_size, folder):
    path = os.path.join(folder, "tok.en")
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(line + "\n" for line in lines)
    prefix = os.path.join(folder, f"tags{workers}")
    job = tagging.TagJob(path, prefix, chunk_size)
    _, _, seconds = tagging.tag_files([job], model, workers=workers, force=True, progress=False)
    tagging.merge_tags(job)
    with open(prefix + ".pos", encoding="utf-8") as p, open(prefix + ".ner", encoding="utf-8") as n:
        labels = [(a.rstrip("\n"), b.rstrip("\n")) for a, b in zip(p, n)]
    return seconds, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", default=os.path.join(harness.REPO, "data", "sample", "train.en"))
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunk-size", type=int, default=250)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model = args.model or tagging.default_model_name()
    lines = load_sentences(args.input, args.sentences)
    words = sum(len(line.split()) for line in lines)
    print(f"{len(lines)} sentences, {words} words, model {model}, {os.cpu_count()} cores")
    tagging._init_worker(model, "upos", 256)  # load once, outside the timings

    # Runs are interleaved (naive, 1 worker, 2 workers, naive, ...) so that load from
    # other jobs on the machine affects all variants alike.
    rates = {"naive": []}
    rates.update({w: [] for w in args.workers})
    differing = {w: 0 for w in args.workers}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.runs):
            seconds, reference = naive(lines, model)
            rates["naive"].append(words / seconds)
            for workers in args.workers:
                seconds, labels = pipeline(lines, model, workers, args.chunk_size, folder)
                rates[workers].append(words / seconds)
                differing[workers] += sum(a != b for a, b in zip(labels, reference))
    naive_wps = statistics.median(rates["naive"])
    print(
        f"naive nlp(doc), full pipeline: {naive_wps:,.0f} words/s "
        f"(runs: {', '.join(f'{r:,.0f}' for r in rates['naive'])})"
    )
    for workers in args.workers:
        wps = statistics.median(rates[workers])
        print(
            f"pipeline, {workers} worker(s): {wps:,.0f} words/s = {wps / naive_wps:.2f}x naive "
            f"(runs: {', '.join(f'{r:,.0f}' for r in rates[workers])}); lines whose labels "
            f"differ from naive: {differing[workers]} of {len(lines) * args.runs}"
        )


if __name__ == "__main__":
    main()
