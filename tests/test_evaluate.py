"""scripts/evaluate.sh on a tiny model trained by scripts/train.sh and averaged by
scripts/average_checkpoints.py: the scores match sacreBLEU computed independently."""

import re
import subprocess

import pytest
import sacrebleu
from sacremoses import MosesDetokenizer

from tiny_nmt import SCRIPTS, binarize, make_corpus, tool_env, train_command


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Train 100 updates, average the last 3 checkpoints, evaluate the test split."""
    root = tmp_path_factory.mktemp("evaluate")
    corpus = make_corpus(root / "corpus")
    data = binarize(corpus, root / "data-bin")
    # a checkpoint every update: fairseq skips checkpoint_<epoch>_<update>.pt when the
    # interval falls on an epoch's last batch, so a sparser interval could leave fewer
    # than three to average, depending on how the tiny corpus is batched
    subprocess.run(train_command(data, root / "ckpt", max_update=100, save_interval_updates=1),
                   check=True, env=tool_env(), capture_output=True)
    average = root / "ckpt" / "checkpoint_avg3.pt"
    subprocess.run(["python", str(SCRIPTS / "average_checkpoints.py"), "--inputs", str(root / "ckpt"),
                    "--num-update-checkpoints", "3", "--output", str(average)],
                   check=True, env=tool_env(), capture_output=True)
    out = root / "eval"
    result = subprocess.run(
        ["bash", str(SCRIPTS / "evaluate.sh"), "--data", str(data), "--checkpoint", str(average),
         "--reference", str(corpus / "raw" / "test.de"), "--out", str(out), "--cpu"],
        env=tool_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return {"root": root, "corpus": corpus, "data": data, "checkpoint": average, "out": out,
            "stdout": result.stdout}


def read_scores(path):
    fields = dict(line.split(": ", 1) for line in path.read_text().splitlines())
    return fields


def generated_lines(path, prefix):
    """Lines of fairseq-generate output starting with prefix ('H' or 'T'), in corpus order."""
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(rf"^{prefix}-(\d+)\t", line)
        if match:
            found[int(match.group(1))] = line.split("\t")[-1]
    return [found[i] for i in sorted(found)]


def test_detokenized_sacrebleu_matches_direct_sacrebleu(evaluated):
    out, corpus = evaluated["out"], evaluated["corpus"]
    hypotheses = generated_lines(out / "generate-test.txt", "H")
    references = (corpus / "raw" / "test.de").read_text().splitlines()
    assert len(hypotheses) == len(references) == 40
    assert not any("@@" in h for h in hypotheses), "BPE not removed"
    detokenizer = MosesDetokenizer(lang="de")
    detokenized = [detokenizer.detokenize(h.split()) for h in hypotheses]
    metric = sacrebleu.BLEU()
    direct = metric.corpus_score(detokenized, [references])

    scores = read_scores(out / "bleu.txt")
    assert scores["sacrebleu_detok"] == f"{direct.score:.2f}"
    assert direct.score > 1.0, "the tiny model should have learnt something"
    signature = str(metric.get_signature())
    assert scores["sacrebleu_detok_signature"] == signature
    assert "tok:13a" in signature
    assert signature in evaluated["stdout"]  # printed as well as written
    # and the sacrebleu command line on the script's own detokenised file agrees
    cli = subprocess.run(["sacrebleu", str(corpus / "raw" / "test.de"), "-i", str(out / "hyp.detok"),
                          "-m", "bleu", "-b", "-w", "2"],
                         env=tool_env(), capture_output=True, text=True, check=True)
    assert cli.stdout.strip() == scores["sacrebleu_detok"]


def test_tokenized_compound_split_bleu(evaluated):
    out = evaluated["out"]
    generated = out / "generate-test.txt"

    def split(line):
        return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)

    hypotheses = [split(h) for h in generated_lines(generated, "H")]
    references = [split(t) for t in generated_lines(generated, "T")]
    assert any("##AT##-##AT##" in r for r in references), "test data should have compounds"
    direct = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="none", smooth_method="none")
    scores = read_scores(out / "bleu.txt")
    assert scores["bleu_tok_compound_split"] == f"{direct.score:.2f}"
    assert "tok:none" in scores["bleu_tok_compound_split_signature"]


def test_refuses_to_overwrite_and_checks_reference_length(evaluated, tmp_path):
    base = ["bash", str(SCRIPTS / "evaluate.sh"), "--data", str(evaluated["data"]),
            "--checkpoint", str(evaluated["checkpoint"]), "--cpu"]
    reference = evaluated["corpus"] / "raw" / "test.de"
    before = (evaluated["out"] / "bleu.txt").read_text()
    result = subprocess.run(base + ["--reference", str(reference), "--out", str(evaluated["out"])],
                            env=tool_env(), capture_output=True, text=True)
    assert result.returncode != 0 and "--force" in result.stderr
    assert (evaluated["out"] / "bleu.txt").read_text() == before

    short = tmp_path / "short.de"
    short.write_text("\n".join(reference.read_text().splitlines()[:-1]) + "\n")
    out = tmp_path / "eval"
    result = subprocess.run(base + ["--reference", str(short), "--out", str(out)],
                            env=tool_env(), capture_output=True, text=True)
    assert result.returncode != 0
    assert str(short) in result.stderr and "40 hypotheses" in result.stderr
    assert not (out / "bleu.txt").exists()
