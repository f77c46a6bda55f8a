"""What the config dataclasses share: the unknown-field check of ``from_dict`` and the error of a bad value."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


def known_fields(cls, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` as a dict, after checking that every key is a field of dataclass ``cls``.

    Raises:
        ValueError: naming the unknown keys and listing the fields.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(
            f"{cls.__name__}: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"fields: {', '.join(names)}"
        )
    return dict(data)


def not_allowed(owner: str, field: str, value: Any, allowed: str) -> ValueError:
    """The error for ``owner.field = value``, saying what is ``allowed``."""
    return ValueError(f"{owner}.{field}: {value!r} is not allowed; allowed: {allowed}")


def choice(owner: str, field: str, value: Any, choices: Sequence[str], extra: str = "") -> str:
    """``value`` as the canonical (lowercase) name among ``choices``; any case is accepted.

    Raises:
        ValueError: ``value`` is not a string naming one of ``choices`` (``extra`` is
        appended to the list of allowed values, e.g. ``", None"``).
    """
    name = value.lower() if isinstance(value, str) else None
    if name not in choices:
        raise not_allowed(owner, field, value, ", ".join(map(repr, choices)) + extra)
    return name
