"""WMT'14 script end to end on small archives in the real formats (no network)."""

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from support import REPO, english_pairs, run_pipeline, tool_env

pytestmark = pytest.mark.slow

SPLITS = ("train", "valid", "test")


def _add(archive, name, text):
    data = text.encode("utf-8")
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def _tgz(path, members):
    with tarfile.open(path, "w:gz") as archive:
        for name, text in members.items():
            _add(archive, name, text)


def _sgm(setid, lang, kind, segments):
    """An SGM file laid out like the WMT ones (doc/p/seg markup)."""
    tag = "srcset" if kind == "src" else "refset"
    lines = [
        f'<{tag} setid="{setid}" srclang="any" trglang="{lang}">',
        '<doc sysid="ref" docid="doc-1" genre="news" origlang="en">',
        "<p>",
    ]
    lines += [f'<seg id="{i}"> {seg} </seg>' for i, seg in enumerate(segments, start=1)]
    lines += ["</p>", "</doc>", f"</{tag}>"]
    return "\n".join(lines) + "\n"


def _corpus_text(pairs, side):
    return "".join(pair[side] + "\n" for pair in pairs)


@pytest.fixture(scope="module")
def wmt_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("wmt")
    raw = root / "archives"
    raw.mkdir()
    europarl = english_pairs(60) + [("", "leer"), (" ".join(["word"] * 300), "Wort")]
    commoncrawl = english_pairs(50, offset=5)
    news = english_pairs(40, offset=7)
    _tgz(
        raw / "training-parallel-europarl-v7.tgz",
        {
            "training/europarl-v7.de-en.de": _corpus_text(europarl, 1),
            "training/europarl-v7.de-en.en": _corpus_text(europarl, 0),
            "training/europarl-v7.fr-en.fr": "ignored\n",
        },
    )
    _tgz(
        raw / "training-parallel-commoncrawl.tgz",
        {
            "commoncrawl.de-en.annotation": "x\n" * len(commoncrawl),
            "commoncrawl.de-en.de": _corpus_text(commoncrawl, 1),
            "commoncrawl.de-en.en": _corpus_text(commoncrawl, 0),
        },
    )
    _tgz(
        raw / "training-parallel-nc-v9.tgz",
        {
            "training/news-commentary-v9.de-en.de": _corpus_text(news, 1).replace("\n", "\r\n"),
            "training/news-commentary-v9.de-en.en": _corpus_text(news, 0).replace("\n", "\r\n"),
        },
    )
    dev = english_pairs(8, offset=3)
    test = english_pairs(9, offset=1)
    _tgz(
        raw / "dev.tgz",
        {
            "dev/newstest2013-src.en.sgm": _sgm("newstest2013", "en", "src", [e for e, _ in dev]),
            "dev/newstest2013-ref.de.sgm": _sgm("newstest2013", "de", "ref", [d for _, d in dev]),
            "dev/newstest2012-src.en.sgm": _sgm("newstest2012", "en", "src", ["not this"]),
        },
    )
    _tgz(
        raw / "test-full.tgz",
        {
            "test-full/newstest2014-deen-src.en.sgm": _sgm(
                "newstest2014", "en", "src", [e for e, _ in test]
            ),
            "test-full/newstest2014-deen-ref.de.sgm": _sgm(
                "newstest2014", "de", "ref", [d for _, d in test]
            ),
            "test-full/newstest2014-deen-src.de.sgm": _sgm("newstest2014", "de", "src", ["nein"]),
        },
    )
    work, data_bin = root / "work", root / "data-bin"
    args = [
        "--pair",
        "en-de",
        "--raw-dir",
        raw,
        "--work-dir",
        work,
        "--data-bin",
        data_bin,
        "--bpe-merges",
        300,
        "--quiet",
    ]
    first = run_pipeline("tpp-prepare-wmt14", *args)
    second = run_pipeline("tpp-prepare-wmt14", *args)
    return {
        "root": root,
        "raw": raw,
        "work": work,
        "dest": data_bin / "wmt14_en_de",
        "dev": dev,
        "test": test,
        "n_train": len(europarl) + len(commoncrawl) + len(news),
        "args": args,
        "first": first,
        "second": second,
    }


def test_data_bin_has_the_task_layout(wmt_run):
    dest = wmt_run["dest"]
    expected = {"dict.en.txt", "dict.de.txt", "dict.pos.txt", "dict.ner.txt"}
    for split in SPLITS:
        for stream in ("en", "de", "pos", "ner"):
            expected |= {f"{split}.en-de.{stream}.bin", f"{split}.en-de.{stream}.idx"}
    assert expected <= set(os.listdir(dest))
    assert (dest / "dict.en.txt").read_text() == (dest / "dict.de.txt").read_text()
    info = json.loads((dest / "preprocess_info.json").read_text())
    assert info["dict_size"] == 32768 and info["bpe"] == {"merges": 300}
    assert info["tags"]["pos_scheme"] == "upos"


def test_valid_and_test_come_from_the_sgm_sets_and_train_is_cleaned(wmt_run):
    raw = wmt_run["work"] / "raw"
    assert (raw / "valid.en").read_text().splitlines() == [e for e, _ in wmt_run["dev"]]
    assert (raw / "test.de").read_text().splitlines() == [d for _, d in wmt_run["test"]]
    assert len((raw / "train.en").read_text().splitlines()) == wmt_run["n_train"]
    final, bpe = wmt_run["work"] / "final", wmt_run["work"] / "bpe"
    # the empty and the 300-token pair go before tagging ...
    bpe_en = (bpe / "train.en").read_text().splitlines()
    bpe_de = (bpe / "train.de").read_text().splitlines()
    assert len(bpe_en) == wmt_run["n_train"] - 2

    # ... and the recipe's 1-250 tokens / ratio 1.5 filter runs on the BPE text, dropping
    # the same lines from text and tags
    def keep(a, b):
        a, b = len(a.split()), len(b.split())
        return 1 <= a <= 250 and 1 <= b <= 250 and a <= 1.5 * b and b <= 1.5 * a

    kept = [i for i, (a, b) in enumerate(zip(bpe_en, bpe_de)) if keep(a, b)]
    assert 0 < len(kept) < len(bpe_en)
    assert (final / "train.en").read_text().splitlines() == [bpe_en[i] for i in kept]
    assert (final / "train.de").read_text().splitlines() == [bpe_de[i] for i in kept]
    bpe_ner = (bpe / "train.ner").read_text().splitlines()
    assert (final / "train.ner").read_text().splitlines() == [bpe_ner[i] for i in kept]
    for split in SPLITS:
        text = (final / f"{split}.en").read_text().splitlines()
        for kind in ("pos", "ner"):
            labels = (final / f"{split}.{kind}").read_text().splitlines()
            assert len(labels) == len(text)
            assert all(len(a.split()) == len(b.split()) for a, b in zip(text, labels))
        assert len((final / f"{split}.de").read_text().splitlines()) == len(text)
    assert len((final / "test.en").read_text().splitlines()) == len(wmt_run["test"])


def test_rerun_skips_every_step(wmt_run):
    log = wmt_run["second"].stderr
    for step in ("extract", "tokenize", "tag", "bpe_learn", "bpe_apply", "clean", "binarize"):
        assert f"step {step}: already done" in log


def test_a_tag_shard_reads_the_extracted_text_and_needs_no_archives(wmt_run, tmp_path):
    """Shards run at once: they must not download or extract (same files for all)."""
    args = list(wmt_run["args"])
    args[args.index("--raw-dir") + 1] = tmp_path  # empty: no archives at all
    result = run_pipeline("tpp-prepare-wmt14", *args, "--tag-shard", "0/2")
    assert "tagging already complete" in result.stderr
    assert "missing archives" not in result.stderr


def test_missing_archive_is_reported_with_the_expected_names(wmt_run, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    os.symlink(wmt_run["raw"] / "dev.tgz", partial / "dev.tgz")
    result = run_pipeline(
        "tpp-prepare-wmt14",
        "--pair",
        "en-de",
        "--raw-dir",
        partial,
        "--work-dir",
        tmp_path / "w",
        "--data-bin",
        tmp_path / "b",
        check=False,
    )
    assert result.returncode == 2
    assert "training-parallel-commoncrawl.tgz" in result.stderr
    assert "test-full.tgz" in result.stderr and "dev.tgz  <-" not in result.stderr


def test_existing_output_is_not_overwritten_without_force(wmt_run, tmp_path):
    dest = tmp_path / "b" / "wmt14_en_de"
    dest.mkdir(parents=True)
    (dest / "precious.txt").write_text("keep me")
    result = run_pipeline(
        "tpp-prepare-wmt14",
        "--pair",
        "en-de",
        "--raw-dir",
        wmt_run["raw"],
        "--work-dir",
        tmp_path / "w",
        "--data-bin",
        tmp_path / "b",
        check=False,
    )
    assert result.returncode == 2 and "pass --force to overwrite it" in result.stderr, result.stderr
    assert (dest / "precious.txt").read_text() == "keep me"


def test_fairseq_train_runs_on_the_result(wmt_run, tmp_path):
    command = [
        os.path.join(os.path.dirname(sys.executable), "fairseq-train"),
        str(wmt_run["dest"]),
        "--user-dir",
        str(REPO / "tpp_plugin"),
        "--task",
        "translation_with_tags",
        "--arch",
        "transformer_pp_tiny",
        "--criterion",
        "label_smoothed_cross_entropy_with_tags",
        "--label-smoothing",
        "0.1",
        "--share-all-embeddings",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--max-tokens",
        "500",
        "--max-update",
        "3",
        "--no-save",
        "--cpu",
        "--num-workers",
        "0",
        "--log-format",
        "simple",
        "--log-interval",
        "1",
        "--seed",
        "1",
        "--save-dir",
        str(tmp_path / "ckpt"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "num_updates=3" in output and "done training" in output
    assert "pos_loss=" in output and "ner_loss=" in output


def test_every_segment_of_an_sgm_line_is_read():
    """(a second <seg> on a line was dropped, on both sides alike: nothing said so)"""
    from tpp_pipeline.errors import DataError
    from tpp_pipeline.wmt14 import _sgm_segments

    data = b'<doc>\n<seg id="1">a b</seg> <seg id="2"> c </seg>\n<seg id=3>d</seg>\n</doc>\n'
    assert _sgm_segments(data, "dev.sgm") == ["a b", "c", "d"]
    with pytest.raises(DataError, match=r"dev\.sgm:2: malformed <seg> line"):
        _sgm_segments(b'<doc>\n<seg id="1">a</seg><seg id="2">b\n', "dev.sgm")


def test_the_list_of_files_read_by_a_reader_that_stops_early_is_no_traceback():
    """(``tpp-prepare-wmt14 --list-files | head -5``: BrokenPipeError's traceback)"""
    listing = subprocess.Popen(
        ["tpp-prepare-wmt14", "--pair", "en-de", "--list-files"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=tool_env(),
    )
    listing.stdout.close()  # before it writes: every write meets a closed pipe
    error = listing.stderr.read().decode()
    assert listing.wait(timeout=120) == 0 and "Traceback" not in error, error
    shown = subprocess.run(
        ["tpp-prepare-wmt14", "--pair", "en-de", "--list-files"],
        capture_output=True,
        text=True,
        env=tool_env(),
        check=True,
    )
    assert "training-parallel-europarl-v7.tgz\thttp" in shown.stdout
    assert "    training/europarl-v7.de-en.en" in shown.stdout.splitlines()
