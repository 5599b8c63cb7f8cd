#!/usr/bin/env python3
"""Prepare any parallel corpus for Transformer++: tokenise, tag, BPE, binarize.

Example::

    python scripts/prepare_corpus.py -s en -t de --trainpref raw/train --validpref raw/valid \\
        --testpref raw/test --name my_en_de --workers 4

See docs/data_pipeline.md for every option and the output layout.
"""
import sys

from tpp_data.pipeline import main

if __name__ == "__main__":
    sys.exit(main())
