"""The tools around the model: checkpoint averaging and recovery, evaluation, plots and
analyses, the quality study and the demo. Each command-line tool is a module with a
``main`` and a console script (``tpp-...``; see setup.cfg)."""

from pathlib import Path
from typing import Optional


def checkout() -> Optional[Path]:
    """The repository these packages run from (the checkout itself, or an editable
    install of it), known by its setup.cfg; None where they are installed from a wheel."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "setup.cfg").is_file() else None
