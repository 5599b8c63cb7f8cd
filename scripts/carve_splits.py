#!/usr/bin/env python3
"""Carve valid and test sets out of a parallel corpus that ships none, deduplicated
against training on both sides (see scripts/tpp_data/splits.py for the rules).

    python scripts/carve_splits.py --corpus ../corpora/en-de/train -s en -t de \\
        --valid 1000 --test 2000 --out work/study/raw

writes work/study/raw/{train,valid,test}.{en,de}; inputs may be .xz.
"""
import argparse
import sys
from pathlib import Path

from tpp_data.errors import DataError
from tpp_data.splits import carve_corpus


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--corpus", required=True, help="PREFIX of PREFIX.{src,tgt}[.xz]")
    parser.add_argument("-s", "--source-lang", required=True)
    parser.add_argument("-t", "--target-lang", required=True)
    parser.add_argument("--valid", type=int, default=1000, help="valid pairs (default 1000)")
    parser.add_argument("--test", type=int, default=2000, help="test pairs (default 2000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--force", action="store_true", help="carve again over existing outputs")
    args = parser.parse_args(argv)
    try:
        outputs = carve_corpus(args.corpus, args.source_lang, args.target_lang, args.out,
                               {"test": args.test, "valid": args.valid}, seed=args.seed, force=args.force)
    except DataError as err:
        print(f"carve_splits.py: error: {err}", file=sys.stderr)
        return 2
    for name, (src, _) in outputs.items():
        count = sum(1 for _ in open(src, encoding="utf-8"))
        print(f"{name}: {count} pairs -> {src.with_suffix('')}.{{{args.source_lang},{args.target_lang}}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
