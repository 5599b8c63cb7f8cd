"""The tokenisation and BPE pools: their workers are not forks of the calling process
(which has torch's threads by now), and they write what one process writes."""

import subprocess
import sys

import pytest
import torch  # noqa: F401  (the caller's state the pools must not inherit: torch and its threads)

from tpp_pipeline import bpe, moses
from tpp_pipeline.workers import pool_context

LINES = [
    f"Sentence {i}: the \"quick\" brown fox's {i * 7}-th jump, isn't it? (e.g. 3.5%)"
    for i in range(4500)
]


def test_pool_workers_do_not_inherit_the_callers_modules():
    with pool_context().Pool(2) as pool:
        inherited = pool.apply(eval, ("'torch' in __import__('sys').modules",))
    assert inherited is False


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("workers") / "text.en"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return path


def test_tokenisation_in_two_workers_equals_one_process(text, tmp_path):
    # 4,500 lines: three tasks of 2,000 lines, the last one short
    moses.tokenize_file(str(text), str(tmp_path / "one"), "en", workers=1)
    moses.tokenize_file(str(text), str(tmp_path / "two"), "en", workers=2)
    one = (tmp_path / "one").read_text(encoding="utf-8")
    assert one.count("\n") == len(LINES) and "&quot;" in one
    assert (tmp_path / "two").read_text(encoding="utf-8") == one


def test_bpe_in_two_workers_equals_one_process(text, tmp_path):
    codes = tmp_path / "codes"
    bpe.learn_joint_bpe([str(text)], str(codes), 50)
    bpe.apply_bpe(str(codes), str(text), str(tmp_path / "one"), workers=1)
    bpe.apply_bpe(str(codes), str(text), str(tmp_path / "two"), workers=2)
    one = (tmp_path / "one").read_text(encoding="utf-8")
    assert one.count("\n") == len(LINES) and "@@ " in one
    assert (tmp_path / "two").read_text(encoding="utf-8") == one


def test_joint_codes_are_subword_nmts_own_on_the_concatenated_text(text, tmp_path):
    # the words are counted in this process, not by subword-nmt's forked pool: the codes
    # are its command line's on the concatenation of both files
    second = tmp_path / "text.de"
    second.write_text("".join(f"Satz {i}: der braune Fuchs springt.\n" for i in range(900)))
    joined = tmp_path / "joined"
    joined.write_text(text.read_text(encoding="utf-8") + second.read_text(), encoding="utf-8")
    subprocess.run(
        [sys.executable, "-m", "subword_nmt.learn_bpe", "-s", "300"],
        stdin=joined.open(encoding="utf-8"),
        stdout=(tmp_path / "reference").open("w", encoding="utf-8"),
        check=True,
    )
    bpe.learn_joint_bpe([str(text), str(second)], str(tmp_path / "codes"), 300)
    codes = (tmp_path / "codes").read_text(encoding="utf-8")
    assert codes.count("\n") == 301
    assert codes == (tmp_path / "reference").read_text(encoding="utf-8")
