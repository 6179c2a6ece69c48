"""The package's environment variables, read one way.

A boolean variable is true for ``1``, ``true``, ``yes`` or ``on`` and false for ``0``, ``false``,
``no``, ``off`` or the empty string (any case, surrounding spaces ignored); anything else is an
error naming the variable, rather than a guess (``PORTABLE_OPS_STRICT=false`` used to turn strict
mode on). ``TRITON_INTERPRET`` is Triton's: the package reads it through Triton
(``backends/triton/interpreter.py``), so the two never disagree.
"""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


_ENCODED: dict[str, bytes] = {}  # names as the environment's own dict keys them
_KEYED_BY_BYTES = os.name != "nt"  # elsewhere its dict is keyed by upper-cased names


def get(name: str) -> str | None:
    """``os.environ.get(name)``. Dispatch reads variables on every call, and ``os.environ.get`` of one that is
    not set raises and catches a KeyError inside ``Mapping.get``; the mapping's own dict, which every change
    through ``os.environ`` updates, keyed by the name encoded once, answers in a fraction of that."""
    data = getattr(os.environ, "_data", None)
    if data is None or not _KEYED_BY_BYTES:
        return os.environ.get(name)
    encoded = _ENCODED.get(name)
    if encoded is None:
        encoded = _ENCODED[name] = os.fsencode(name)
    value = data.get(encoded)
    return None if value is None else os.fsdecode(value)


def flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name``; ``default`` when it is not set."""
    value = get(name)
    if value is None:
        return default
    word = value.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: expected one of {', '.join(TRUE)} (on) or "
                     f"{', '.join(FALSE[:-1])} or empty (off), in any case")


def choice(name: str, choices: tuple[str, ...]) -> str | None:
    """The environment variable ``name`` as one of ``choices`` (any case, surrounding spaces ignored), or None
    when it is unset or empty."""
    value = get(name)
    if value is None:
        return None
    word = value.strip().lower()
    if not word:
        return None
    if word not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {', '.join(choices)} (or unset)")
    return word
