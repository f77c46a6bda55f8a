"""Resolving ``backend=`` for ops with several implementations (cuda / triton / torch).

``auto`` takes the first backend of a measured order that can take the inputs and logs that
choice once per kind of input; an explicit name is checked and refused with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable

import torch


def choose_backend(
    op_name: str,
    backend: str,
    auto_order: Iterable[str],
    ineligible_reason: Callable[[str], str | None],
    *,
    log_key: tuple[Hashable, ...],
    describe: Callable[[], str],
    logged: set[tuple],
    logger: logging.Logger,
    log_name: str | None = None,
    where: str = "for",
) -> str:
    """Return the concrete backend to run.

    Args:
        op_name: the public op's name, for messages.
        backend: ``"auto"`` or a concrete backend name.
        auto_order: concrete backends, fastest first; the last must take any input.
        ineligible_reason: ``None`` when the named backend can take the inputs, else why not.
        log_key: what makes two ``auto`` choices "the same kind of input" (logged once).
        describe: the inputs in words, for the log line (called only when logging).
        logged: the op's set of already-logged keys.
        log_name: the op's name in the log line (default ``op_name``).
        where: the word between the choice and ``describe()`` in the log line.

    Raises:
        ValueError: an explicit backend that cannot take the inputs, with the reason.
    """
    if backend != "auto":
        reason = ineligible_reason(backend)
        if reason is not None:
            raise ValueError(f"{op_name} backend={backend!r} cannot take these inputs: {reason}")
        return backend
    reasons = {}
    for candidate in auto_order:
        reasons[candidate] = ineligible_reason(candidate)
        if reasons[candidate] is None:
            backend = candidate
            break
    key = (backend, *log_key)
    # Logging cannot be traced by torch.compile; the eager call before compiling logs instead.
    if key not in logged and not torch.compiler.is_compiling():
        logged.add(key)
        skipped = "; ".join(f"{b}: {r}" for b, r in reasons.items() if r is not None)
        logger.info(
            "%s backend='auto' chose %r %s %s%s",
            log_name or op_name, backend, where, describe(), f" (skipped {skipped})" if skipped else "",
        )
    return backend
