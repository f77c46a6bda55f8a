"""Reading config dataclasses from dicts: the field check the config classes share."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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
