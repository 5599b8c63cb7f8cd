"""The two list formats of the plugin's options, parsed in one place: per-layer lists
(``--encoder-conv-kernel-sizes 3,5,7``) and ``name:value`` lists
(``--encoder-tag-layers pos:1,ner:2``, ``--tag-loss-weights pos:1,ner:0.5``). Errors
name the option and quote the value."""

import math
from typing import Callable, Dict, List, TypeVar

from tpp_pipeline.errors import OptionError

T = TypeVar("T")


def parse_int_list(value, option: str) -> List[int]:
    """``"3,5,7"`` (or a list) -> ``[3, 5, 7]``."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [v for v in str(value).replace(" ", "").split(",") if v != ""]
    try:
        return [int(v) for v in items]
    except ValueError:
        raise OptionError(f"--{option}: expected comma-separated integers, got {value!r}") from None


def parse_named(value, option: str, cast: Callable[[str], T] = int) -> Dict[str, T]:
    """``"pos:1,ner:2"`` -> ``{"pos": 1, "ner": 2}`` (``cast`` converts each value; an
    empty string gives ``{}``)."""
    result: Dict[str, T] = {}
    kind = "INT" if cast is int else "NUMBER"
    for item in str(value or "").replace(" ", "").split(","):
        if not item:
            continue
        name, sep, raw = item.partition(":")
        try:
            if not sep or not name:
                raise ValueError
            number = cast(raw)
            if cast is int and not raw.isdigit():
                raise ValueError
        except ValueError:
            raise OptionError(
                f"--{option}: expected NAME:{kind}[,NAME:{kind}...], got {value!r}"
            ) from None
        if name in result:
            raise OptionError(f"--{option}: {name!r} given twice in {value!r}")
        result[name] = number
    return result


def format_named(values: Dict[str, object]) -> str:
    """The inverse of :func:`parse_named`."""
    return ",".join(f"{name}:{number}" for name, number in values.items())


def tag_layers(value, encoder_layers: int) -> Dict[str, int]:
    """``--encoder-tag-layers``: each tag's layer within the encoder's ``1..encoder_layers``."""
    layers = parse_named(value, "encoder-tag-layers")
    for name, layer in layers.items():
        if not 1 <= layer <= encoder_layers:
            raise OptionError(
                f"--encoder-tag-layers: layer {layer} for tag {name!r} is outside the "
                f"encoder's layers 1..{encoder_layers}"
            )
    return layers


def check_tag_weights(weights: Dict[str, float], decay_updates: int) -> None:
    """The tag losses' weights (none negative) and their decay (``--tag-loss-decay-updates``,
    0 or more)."""
    for name, weight in weights.items():
        if not 0 <= weight < math.inf:  # (NaN too)
            raise OptionError(
                f"--tag-loss-weights: weight of {name!r} must be a number >= 0, got {weight}"
            )
    if decay_updates < 0:
        raise OptionError(
            f"--tag-loss-decay-updates must be >= 0 (0: constant weights), got {decay_updates}"
        )
