"""Shared by the analysis tools (plot_attention, embedding_similarity): load a trained
checkpoint with fairseq and turn one source sentence into model input.

Not a command-line tool itself.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tpp_pipeline.errors import UserError


class AnalysisError(UserError):
    """A problem with the user's input; the message says what to fix."""

    status = 1


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every analysis script takes to find a model and a sentence."""
    parser.add_argument("--path", type=Path, required=True, help="model checkpoint (.pt)")
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        help="data-bin folder the model was trained on (for its dictionaries)",
    )
    parser.add_argument(
        "--bpe-codes",
        type=Path,
        default=None,
        help="subword-nmt BPE codes: the sentence is raw text, to be "
        "Moses-tokenised and BPE-segmented as in training",
    )
    parser.add_argument(
        "--tokenize",
        action="store_true",
        help="Moses-tokenise the raw sentence (implied by --bpe-codes)",
    )


@dataclass
class LoadedModel:
    model: object  # the fairseq model, in eval mode on the CPU
    task: object
    cfg: object

    @property
    def source_lang(self) -> str:
        return getattr(self.task.cfg, "source_lang", None) or "en"


def check_model_arguments(args: argparse.Namespace) -> None:
    """What :func:`add_model_arguments` gave that can be checked before the (slow) model
    loading: the BPE codes, read as subword-nmt reads them."""
    if args.bpe_codes is not None:
        from tpp_pipeline.bpe import check_codes
        from tpp_pipeline.errors import DataError

        try:
            check_codes(str(args.bpe_codes))
        except DataError as err:
            raise AnalysisError(str(err)) from None


def load_model(checkpoint: Path, data: Path) -> LoadedModel:
    """Load ``checkpoint`` with fairseq, reading the dictionaries from ``data``."""
    from .checkpoint_files import format_problem

    problem = format_problem(checkpoint)
    if problem is not None:
        raise AnalysisError(f"{checkpoint}: {problem} (--path)")
    if not data.is_dir():
        raise AnalysisError(f"data folder not found: {data}")
    if not list(data.glob("dict.*.txt")) or not list(data.glob("*.idx")):
        raise AnalysisError(
            f"no dictionaries (dict.*.txt) or no binarized split (*.idx) in {data}: pass "
            "the data-bin folder the model was trained on"
        )

    # imported here: fairseq takes seconds to import, the argument checks above do not
    from fairseq import checkpoint_utils, utils

    # importing fairseq configures the root logger verbosely: keep the output readable
    for name in ("matplotlib", "fairseq", "PIL"):
        logging.getLogger(name).setLevel(logging.WARNING)

    # register the plugin's model/task/criterion, as --user-dir does for fairseq's tools
    import tpp_plugin

    utils.import_user_module(argparse.Namespace(user_dir=os.path.dirname(tpp_plugin.__file__)))
    try:
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [str(checkpoint)], arg_overrides={"data": str(data)}
        )
    except AnalysisError:
        raise
    except Exception as err:  # fairseq raises many kinds; the user needs the reason
        reason = (str(err).strip().splitlines() or [""])[0]  # torch's messages run long
        raise AnalysisError(
            f"cannot load checkpoint {checkpoint}: " f"{type(err).__name__}: {reason}"
        ) from err
    model = models[0].cpu().eval()
    return LoadedModel(model, task, cfg)


def prepare_sentence(
    sentence: str, lang: str, bpe_codes: Path | None = None, tokenize: bool = False
) -> str:
    """Raw sentence -> the space-separated (sub)word tokens the model was trained on.

    Without --bpe-codes and --tokenize the sentence is taken as already prepared.
    """
    sentence = " ".join(sentence.split())
    if not sentence:
        raise AnalysisError("the sentence is empty")
    if bpe_codes is not None or tokenize:
        # the data pipeline's own Moses preprocessing, so tokens match training
        from tpp_pipeline.moses import MosesPreprocessor

        sentence = MosesPreprocessor(lang)(sentence)
    if bpe_codes is not None:
        if not bpe_codes.is_file():
            raise AnalysisError(f"BPE codes not found: {bpe_codes}")
        from subword_nmt.apply_bpe import BPE

        with open(bpe_codes, encoding="utf-8") as codes:
            sentence = BPE(codes).process_line(sentence)
    return sentence


def encode(loaded: LoadedModel, prepared: str):
    """Token ids (1 x T tensor, EOS appended) and their strings, for the source side."""
    import torch

    src_dict = loaded.task.source_dictionary
    ids = src_dict.encode_line(prepared, add_if_not_exist=False, append_eos=True).long()
    tokens = [src_dict[i] for i in ids.tolist()]
    if all(i in (src_dict.unk(), src_dict.eos()) for i in ids.tolist()):
        raise AnalysisError(
            f"no token of {prepared!r} is in the source dictionary: is "
            "the sentence tokenised/BPE-segmented like the training data?"
        )
    limit = loaded.model.encoder.max_positions()
    if len(tokens) > limit:
        raise AnalysisError(
            f"the sentence is {len(tokens)} subwords long with its end of sentence, and "
            f"the model reads at most {limit} (its --max-source-positions): give a "
            "shorter one"
        )
    return torch.as_tensor(ids).unsqueeze(0), tokens


def word_spans(tokens: list[str]) -> list[tuple[str, list[int]]]:
    """Group BPE pieces (``fi@@ re``) into words: [(word, [positions])]; EOS excluded."""
    words: list[tuple[str, list[int]]] = []
    current, positions = "", []
    for i, token in enumerate(tokens):
        if token == "</s>":
            break
        if token.endswith("@@"):
            current += token[:-2]
            positions.append(i)
            continue
        words.append((current + token, positions + [i]))
        current, positions = "", []
    if positions:
        words.append((current, positions))
    return words
