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
