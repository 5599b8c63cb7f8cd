"""Tokenisation + tagging + BPE + projection on tricky English, with the real tools."""

import pytest

from support import ENGLISH

from tpp_pipeline import bpe, moses, projection, tagging
from tpp_pipeline.errors import DataError

TRICKY = ENGLISH + [
    "",
    "   \t  ",
    "State-of-the-art, e-mail & co-operation: it's 5 o'clock -- 10:30 p.m. in the U.S.",
    "Visit www.example.org or mail info@example.org; price: €20 / £15 (approx.)!",
    "日本語のテキスト and Ελληνικά and emoji 🙂 mixed in.",
    "Control\u0007char and zero\u200bwidth and non\u00a0breaking space and carriage\rreturn.",
    " ".join(f"token{i}" for i in range(400)),
]


@pytest.fixture(scope="module")
def labeler():
    return tagging.Labeler(pos_scheme="upos")


@pytest.fixture(scope="module")
def processed(tmp_path_factory, labeler):
    """Tokenised, tagged, BPE-segmented files for TRICKY."""
    d = tmp_path_factory.mktemp("tricky")
    (d / "raw.en").write_text("\n".join(TRICKY) + "\n", encoding="utf-8")
    moses.tokenize_file(d / "raw.en", d / "tok.en", "en")
    tokens = (d / "tok.en").read_text(encoding="utf-8").splitlines()
    pos, ner = zip(*labeler.label_lines(tokens))
    (d / "tok.pos").write_text("\n".join(pos) + "\n", encoding="utf-8")
    (d / "tok.ner").write_text("\n".join(ner) + "\n", encoding="utf-8")
    bpe.learn_joint_bpe([str(d / "tok.en")], str(d / "codes"), 80)
    bpe.apply_bpe(
        str(d / "codes"),
        d / "tok.en",
        d / "bpe.en",
        [d / "tok.pos", d / "tok.ner"],
        [d / "bpe.pos", d / "bpe.ner"],
    )
    read = lambda name: (d / name).read_text(encoding="utf-8").splitlines()  # noqa: E731
    return {k: read(k) for k in ("tok.en", "tok.pos", "tok.ner", "bpe.en", "bpe.pos", "bpe.ner")}


def test_one_label_per_token_and_per_subword_on_every_line(processed):
    assert len(processed["tok.en"]) == len(TRICKY)
    for level in ("tok", "bpe"):
        text = processed[f"{level}.en"]
        for kind in ("pos", "ner"):
            labels = processed[f"{level}.{kind}"]
            assert len(labels) == len(text)
            for line, tags in zip(text, labels):
                assert len(tags.split()) == len(line.split())
                assert tags == " ".join(tags.split())  # single spaces, no empty labels


def test_tricky_lines_survive_tokenisation(processed):
    tok = processed["tok.en"]
    assert tok[len(ENGLISH)] == "" and tok[len(ENGLISH) + 1] == ""  # empty stays empty
    assert len(tok[-1].split()) == 400  # long line kept whole
    assert "\u0007" not in tok[-2] and "\u200b" not in tok[-2] and "\u00a0" not in tok[-2]
    assert "carriage return" in tok[-2]  # a space, as every control character
    assert "@-@" in tok[len(ENGLISH) + 2] and "&amp;" in tok[1] and "&apos;" in tok[6]
    # the BPE of every line joins back to the tokens
    for t, b in zip(tok, processed["bpe.en"]):
        assert b.replace("@@ ", "") == t


def test_labels_are_from_the_tag_sets(processed, labeler):
    sets = labeler.label_sets()
    for kind in ("pos", "ner"):
        seen = {label for line in processed[f"bpe.{kind}"] for label in line.split()}
        assert seen <= set(sets[kind]), seen - set(sets[kind])


def test_named_entities_get_the_expected_types(labeler):
    sentences = {
        "Barack Obama visited Paris on Monday .": [
            "B-PERSON",
            "I-PERSON",
            "O",
            "B-GPE",
            "O",
            "B-DATE",
            "O",
        ],
        "Angela Merkel met Emmanuel Macron in Berlin .": [
            "B-PERSON",
            "I-PERSON",
            "O",
            "B-PERSON",
            "I-PERSON",
            "O",
            "B-GPE",
            "O",
        ],
        "Google hired 300 engineers in London last year .": [
            "B-ORG",
            "O",
            "B-CARDINAL",
            "O",
            "O",
            "B-GPE",
            "B-DATE",
            "I-DATE",
            "O",
        ],
    }
    for sentence, expected in sentences.items():
        ((pos, ner),) = labeler.label_lines([sentence])
        assert ner.split() == expected, sentence
    ((pos, _),) = labeler.label_lines(["Barack Obama visited Paris on Monday ."])
    assert pos.split() == ["PROPN", "PROPN", "VERB", "PROPN", "ADP", "PROPN", "PUNCT"]


def test_moses_escapes_are_tagged_as_the_characters_they_stand_for(labeler):
    assert tagging.unescape_moses_token("&amp;lt;") == "&lt;"
    assert tagging.unescape_moses_token("O&apos;Brien") == "O'Brien"
    assert tagging.unescape_moses_token("@-@") == "-"
    escaped = (
        "AT &amp; T said &quot; yes &quot; , O&apos;Brien &apos;s well @-@ known &#91; 1 &#93; ."
    )
    plain = "AT & T said \" yes \" , O'Brien 's well - known [ 1 ] ."
    assert list(labeler.label_lines([escaped])) == list(labeler.label_lines([plain]))
    ((pos, _),) = labeler.label_lines([escaped])
    assert pos.split()[1] == "CCONJ" and pos.split()[4] == "PUNCT"


def test_ptb_scheme_uses_penn_tags():
    ptb = tagging.Labeler(pos_scheme="ptb")
    ((pos, _),) = ptb.label_lines(["The two dogs slept quietly ."])
    assert pos.split()[:3] == ["DT", "CD", "NNS"] and pos.split()[-1] == "."
    assert set(pos.split()) <= set(ptb.label_sets()["pos"])


def test_ner_projection_keeps_b_on_the_first_piece_only():
    labels = ["B-PERSON", "O", "B-GPE", "I-GPE"]
    assert projection.project_labels(labels, [3, 1, 2, 2], "ner") == [
        "B-PERSON",
        "I-PERSON",
        "I-PERSON",
        "O",
        "B-GPE",
        "I-GPE",
        "I-GPE",
        "I-GPE",
    ]
    assert projection.project_labels(["PROPN", "VERB"], [2, 1], "pos") == ["PROPN"] * 2 + ["VERB"]
    assert projection.pieces_from_bpe_markers(
        "Schwar@@ zen@@ egger visited Stutt@@ gart".split()
    ) == [3, 1, 2]


def test_label_count_mismatch_names_file_and_line(tmp_path, processed):
    (tmp_path / "codes").write_text("#version: 0.2\na b\n", encoding="utf-8")
    (tmp_path / "t.en").write_text("a b c\nd e\n", encoding="utf-8")
    (tmp_path / "t.pos").write_text("X X X\nX\n", encoding="utf-8")
    (tmp_path / "t.ner").write_text("O O O\nO O\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"t\.pos:2: 1 labels for 2 tokens"):
        bpe.apply_bpe(
            str(tmp_path / "codes"),
            tmp_path / "t.en",
            tmp_path / "b.en",
            [tmp_path / "t.pos", tmp_path / "t.ner"],
            [tmp_path / "b.pos", tmp_path / "b.ner"],
        )
    assert not (tmp_path / "b.en").exists() and not (tmp_path / "b.pos.tmp").exists()
    with pytest.raises(DataError, match=r"f\.pos:7: 2 labels for 3 BPE tokens"):
        projection.check_label_count("X X", "a@@ b c", "f.pos", 7)
