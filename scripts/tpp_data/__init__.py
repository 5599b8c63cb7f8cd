"""Data pipeline of Transformer++: raw parallel text -> tagged, BPE-segmented, binarized data.

The modules each do one job:

- ``errors``       -- the one exception type, always naming a file and line;
- ``textio``       -- strict UTF-8 line reading and atomic (temp name + rename) writing;
- ``steps``        -- skip-if-done bookkeeping shared by all steps;
- ``moses``        -- punctuation normalisation and tokenisation (sacremoses);
- ``cleaning``     -- length/ratio filtering of parallel (and tag) files;
- ``tagging``      -- spaCy POS/NER labels on Moses tokens, sharded and resumable;
- ``projection``   -- token labels -> subword labels;
- ``bpe``          -- joint BPE learning and application (subword-nmt), with projection;
- ``binarize``     -- fairseq-preprocess for text and tag streams;
- ``pipeline``     -- the generic corpus entry point chaining the steps;
- ``download``     -- resumable, checked downloads;
- ``wmt14``        -- WMT'14 En-De / En-Fr corpora: archives, extraction, SGM test sets.
"""
