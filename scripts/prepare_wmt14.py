#!/usr/bin/env python3
"""Prepare WMT'14 En-De or En-Fr for Transformer++ (download or --raw-dir, then the pipeline).

Examples::

    python scripts/prepare_wmt14.py --pair en-de --workers 8
    python scripts/prepare_wmt14.py --pair en-de --raw-dir /data/wmt14-archives --workers 8
    python scripts/prepare_wmt14.py --pair en-fr --list-files

See docs/data_pipeline.md.
"""
import sys

from tpp_data.wmt14 import main

if __name__ == "__main__":
    sys.exit(main())
