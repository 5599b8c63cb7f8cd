#!/usr/bin/env python3
"""Detokenise Moses-tokenised text (one sentence per line), stdin to stdout.

    detokenize_moses.py -l de < hyp.tok > hyp.detok

Used by scripts/evaluate.sh before sacreBLEU, which wants plain text. Moses XML escapes
(&amp; &apos; &quot; ...) written by the tokeniser are turned back into characters.
"""

import argparse
import sys

from sacremoses import MosesDetokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-l", "--language", required=True, help="target language code, e.g. de")
    args = parser.parse_args(argv)
    detokenizer = MosesDetokenizer(lang=args.language)
    for line in sys.stdin:
        tokens = line.split()
        sys.stdout.write(detokenizer.detokenize(tokens, return_str=True, unescape=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
