"""The study's data: a raw corpus carved and prepared once per identity, or a prepared
folder checked."""

import hashlib
import json
import sys
from pathlib import Path
from typing import Dict, Optional

from .commands import count_lines, log, run_command
from .config import Config, StudyError


def split_size(data: Path, split: str) -> Optional[int]:
    """Sentences in a binarized split (from the target side's .idx header), or None."""
    import numpy as np

    idx = sorted(data.glob(f"{split}.*-*.*.idx"))
    if not idx:
        return None
    with open(idx[0], "rb") as handle:
        header = handle.read(9 + 8 + 1 + 8)
    return int(np.frombuffer(header[18:26], dtype="<i8")[0])


def language_pair(data: Path):
    for idx in sorted(data.glob("train.*-*.*.idx")):
        pair = idx.name.split(".")[1]
        src, _, tgt = pair.partition("-")
        if src and tgt:
            return src, tgt
    raise StudyError(f"{data}: no train.<src>-<tgt>.*.idx: not a fairseq data folder")


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_identity(
    args, cfg: Config, src: str, tgt: str, given: Dict[str, str], sizes: Dict[str, int]
) -> str:
    """Identity of the data a raw corpus becomes: the inputs' contents (not their names
    or modification times: a corpus copied or unpacked again is the same corpus), the
    carving and the preparation settings. Any change prepares a new folder."""
    from tpp_pipeline.splits import side_path

    identity = {
        "corpus": [file_digest(side_path(args.corpus, lang)) for lang in (src, tgt)],
        "given": {
            n: [file_digest(side_path(p, lang)) for lang in (src, tgt)] for n, p in given.items()
        },
        "sizes": sizes,
        "seed": args.split_seed,
        "bpe": cfg.bpe_merges,
        "max_len": cfg.max_len,
        "tags": args.variants_need_tags,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def fingerprint(data: Path) -> str:
    """Identity of a data folder: its dictionaries and the sizes of its splits."""
    digest = hashlib.sha256()
    for path in sorted(data.glob("dict.*.txt")) + sorted(data.glob("*.idx")):
        digest.update(path.name.encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _given_data(args) -> Dict[str, Path]:
    """``--data``: a prepared folder, checked."""
    data = args.data
    if not data.is_dir():
        raise StudyError(f"--data {data}: no such folder")
    language_pair(data)  # (refuses a folder that is not fairseq data)
    if args.test_reference is None:
        raise StudyError("--data needs --test-reference (the raw, untokenised test target)")
    reference = args.test_reference
    if not reference.is_file():
        raise StudyError(f"--test-reference {reference}: no such file")
    if args.variants_need_tags and not (data / "dict.pos.txt").exists():
        raise StudyError(
            f"{data} has no POS/NER labels (dict.pos.txt) for the hybrid+tags variant: "
            "prepare it with tpp-prepare-corpus, or leave that variant out"
        )
    paths = {
        "data": data,
        "reference": reference,
        "source": args.test_source,
        "bpe_codes": args.bpe_codes,
    }
    return paths


def _prepared_data(args, cfg: Config, plan_only: bool) -> Dict[str, Path]:
    """``--corpus``: its valid and test sets carved and the whole prepared, once (the
    data folder's name is the settings' digest)."""
    src, tgt = args.source_lang, args.target_lang
    if not (src and tgt):
        raise StudyError("--corpus needs -s/--source-lang and -t/--target-lang")
    from tpp_pipeline.errors import DataError
    from tpp_pipeline.splits import carve_corpus

    given = {name: getattr(args, name) for name in ("test", "valid") if getattr(args, name)}
    sizes = {
        name: size
        for name, size in (("test", args.test_size), ("valid", args.valid_size))
        if name not in given
    }
    try:
        digest = data_identity(args, cfg, src, tgt, given, sizes)
        root = args.out / "data" / f"{src}-{tgt}-{digest}"
        raw = root / "raw"
        name = f"{src}_{tgt}_bpe{cfg.bpe_merges}"
        data = root / "data-bin" / name
        if plan_only and not (data / "preprocess.done").exists():
            return {"data": data, "prepared": False, "src": src, "tgt": tgt}
        # (keep_unrecorded: a folder of this study's, carved before the record existed)
        carve_corpus(
            args.corpus,
            src,
            tgt,
            raw,
            sizes,
            seed=args.split_seed,
            given=given,
            keep_unrecorded=True,
        )
    except DataError as err:
        raise StudyError(str(err)) from None
    if not (data / "preprocess.done").exists():
        log(f"preparing {raw} -> {data} (tokenise, tag, BPE {cfg.bpe_merges}, binarize)")
        cmd = [
            sys.executable,
            "-m",
            "tpp_pipeline.pipeline",
            "-s",
            src,
            "-t",
            tgt,
            "--trainpref",
            raw / "train",
            "--validpref",
            raw / "valid",
            "--testpref",
            raw / "test",
            "--name",
            name,
            "--work-dir",
            root / "work",
            "--data-bin",
            root / "data-bin",
            "--bpe-merges",
            cfg.bpe_merges,
            "--max-len",
            cfg.max_len,
            "--workers",
            args.workers,
        ]
        if not args.variants_need_tags:
            cmd.append("--no-tags")
        run_command(cmd, root / "prepare.log")
        (data / "preprocess.done").write_text("ok\n")
    paths = {
        "data": data,
        "reference": raw / f"test.{tgt}",
        "source": raw / f"test.{src}",
        "bpe_codes": root / "work" / "bpe" / "codes",
    }
    return paths


def prepare_data(args, cfg: Config, plan_only: bool = False) -> Dict[str, Path]:
    """Carve (if needed) and prepare raw text; or check a prepared data folder.
    Returns ``data`` (the data-bin), ``reference`` (raw test target), ``source`` (raw
    test source, optional), ``bpe_codes`` (optional). ``plan_only``: carve and prepare
    nothing; ``prepared`` says whether the folder is there already."""
    paths = _given_data(args) if args.data is not None else _prepared_data(args, cfg, plan_only)
    if not paths.get("prepared", True):
        return paths
    size = split_size(paths["data"], "test")
    if size is None:
        raise StudyError(f"{paths['data']}: no test split (test.*.idx)")
    ref_lines = count_lines(paths["reference"])
    if ref_lines != size:
        raise StudyError(
            f"test reference {paths['reference']} has {ref_lines} lines but the test split of "
            f"{paths['data']} has {size} sentences"
        )
    paths["src"], paths["tgt"] = language_pair(paths["data"])
    from ..evaluate import max_positions_in, oversized

    for split in ("valid", "test"):  # validated and translated by every run: checked once
        too_long = oversized(
            paths["data"], split, paths["src"], paths["tgt"], max_positions_in(cfg.extra)
        )
        if too_long is not None:
            raise StudyError(too_long)
    paths["prepared"] = True
    return paths
