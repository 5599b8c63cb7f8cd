"""Data pipeline of Transformer++: raw parallel text -> tagged, BPE-segmented, binarized data.

Command lines: ``tpp-prepare-corpus`` (``pipeline``), ``tpp-prepare-wmt14`` (``wmt14``),
``tpp-carve-splits`` (``splits``). The modules each do one job:

- ``contract``     -- the tagged data folder: file layout, tag kinds, alignment check,
                      label dictionaries (shared with the ``translation_with_tags`` task);
- ``errors``       -- the one exception type, always naming a file and line;
- ``textio``       -- strict UTF-8 line reading and atomic (temp name + rename) writing;
- ``steps``        -- skip-if-done bookkeeping shared by all steps;
- ``lock``         -- one run per work folder;
- ``workers``      -- tokenisation and BPE pools, never forked from a threaded process;
- ``moses``        -- punctuation normalisation and tokenisation (sacremoses);
- ``cleaning``     -- length/ratio filtering of parallel (and tag) files;
- ``tagging``      -- spaCy POS/NER labels on Moses tokens, sharded and resumable;
- ``projection``   -- token labels -> subword labels;
- ``bpe``          -- joint BPE learning and application (subword-nmt), with projection;
- ``binarize``     -- fairseq-preprocess for text and tag streams;
- ``pipeline``     -- the generic corpus entry point chaining the steps;
- ``splits``       -- held-out sets carved out of a corpus that ships none;
- ``download``     -- resumable, checked downloads;
- ``wmt14``        -- WMT'14 En-De / En-Fr corpora: archives, extraction, SGM test sets.
"""

import os
from pathlib import Path
from typing import Optional


def checkout() -> Optional[Path]:
    """The repository these packages run from (the checkout itself, or an editable
    install of it), known by its setup.cfg; None where they are installed from a wheel."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "setup.cfg").is_file() else None


def project_root() -> Path:
    """Where the commands' default folders (``work/``, ``data-bin/``, ``checkpoints/``)
    are: ``$TPP_ROOT`` where set (the repository a SLURM job was submitted from), else
    the checkout these packages run from, else (a wheel's install) the current folder."""
    root = os.environ.get("TPP_ROOT")
    return Path(root).resolve() if root else (checkout() or Path.cwd())
