"""The names an environment variable chooses from a table (``all``, ``none``, or names
separated by commas)."""

import os

from tpp_pipeline.errors import UserError


class SwitchError(UserError, ValueError):
    """A variable naming what it does not know: one line (a ``ValueError`` too)."""


def chosen(variable: str, known, default, what: str, value=None):
    """The names of ``known`` that ``variable`` (or ``value``) gives, ``default`` when it is
    unset; a name not in ``known`` is an error naming the variable and ``what`` they are."""
    if value is None:
        value = os.environ.get(variable)
    if value is None:
        return list(default)
    value = value.strip()
    if value == "all":
        return list(known)
    if value in ("", "none"):
        return []
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SwitchError(
            f"{variable}={value!r}: unknown {', '.join(unknown)}; {what} are "
            f"{', '.join(known)} (or all, none)"
        )
    return names
