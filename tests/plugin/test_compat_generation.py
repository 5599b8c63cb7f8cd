"""fairseq's beam search as the plugin leaves it: ``--no-repeat-ngram-size`` blocks
repeated n-grams without fairseq's CUDA extension (fairseq issue #4709)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# beam search's token buffer at step 3 of 7: <eos> 5 6 5, then padding (1); the bigram
# (5, 6) was generated, so after 5 the token 6 must be blocked
PROBE = """
import torch
{imports}
from fairseq.ngram_repeat_block import NGramRepeatBlock
tokens = torch.tensor([[2, 5, 6, 5, 1, 1, 1, 1]])
lprobs = torch.zeros(1, 10)
blocked = NGramRepeatBlock(2, use_extension=False)(tokens, lprobs, 1, 1, step=3)
print(sorted(torch.nonzero(blocked[0] == -float("inf")).flatten().tolist()))
"""


def blocked(imports: str):
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(imports=imports)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_repeated_ngrams_are_blocked_without_the_cuda_extension():
    assert blocked("") == "[]", "fairseq alone compares the padding: nothing blocked"
    assert blocked("import tpp_plugin") == "[6]"
