"""The prompt encoder: a pipeline's LLM prompt encoding with the LLM in vLLM.

:class:`PromptEncoder` tokenizes with the pipeline's tokenizer, sends the token
ids of all prompts submitted at about the same time (by concurrent pipeline
calls too) to the backend in one request (:class:`~omni_diffusion.ar.batching.RequestBatcher`),
and collates the per-token hidden states into what the pipeline's own encoder
returns (:func:`~omni_diffusion.ar.prompt_format.collate`).

A backend is anything with ``embed(token_ids: list[list[int]]) ->
list[Tensor [T, D]]``: :class:`~omni_diffusion.ar.placement.Backend` (vLLM
engine or server), or :class:`~omni_diffusion.ar.reference.TransformersBackend`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omni_diffusion.ar.batching import RequestBatcher
from omni_diffusion.ar.prompt_format import PromptFormat, collate, tokenize


def prompt_encoding_of(pipe: Any, adapter: Any = None, call_kwargs: dict | None = None):
    """``(adapter, PromptFormat)`` of ``pipe`` for a call with ``call_kwargs``.

    Raises:
        ValueError: the pipeline's family has no LLM prompt encoder the bridge
            can run (its adapter declares no ``prompt_format``).
    """
    if adapter is None:
        from omni_diffusion.adapters import adapter_for

        adapter = adapter_for(pipe)
    make = getattr(adapter, "prompt_format", None)
    if make is None:
        raise ValueError(f"the {adapter.name} adapter declares no LLM prompt encoder "
                         f"({type(pipe).__name__}'s text encoders cannot run through vLLM)")
    return adapter, make(pipe, dict(call_kwargs or {}))


class PromptEncoder:
    """Encodes prompts for one pipeline family through ``backend``, batching
    concurrent requests.

    Args:
        backend: see the module docstring; closed by :meth:`close` when ``owns_backend``.
        window_s, max_prompts: the batcher's wait window and batch size.
    """

    def __init__(self, backend: Any, window_s: float = 0.005, max_prompts: int = 256,
                 owns_backend: bool = True) -> None:
        self.backend = backend
        self.owns_backend = owns_backend
        self.batcher = RequestBatcher(self._run, window_s=window_s, max_items=max_prompts)

    @property
    def stats(self):
        """The batcher's :class:`~omni_diffusion.ar.batching.BatchStats`."""
        return self.batcher.stats

    def _run(self, key: Any, token_ids: list[list[int]]) -> list[torch.Tensor]:
        return self.backend.embed(token_ids)

    def hidden_states(self, tokenizer: Any, prompts: Sequence[str], fmt: PromptFormat) -> list[torch.Tensor]:
        """Per-token hidden states ``[T_i, D]`` of each prompt (template included)."""
        ids = tokenize(tokenizer, prompts, fmt)
        return self.batcher.submit(fmt.key(), ids)

    def encode(self, tokenizer: Any, groups: Sequence[Sequence[str]], fmt: PromptFormat,
               dtype: torch.dtype | None = None, device: torch.device | str | None = None,
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(prompt_embeds [B_g, S_g, D], mask [B_g, S_g])`` for each group of
        prompts (e.g. the positive and the negative prompts of one call), all
        sent in one request, each group padded as the pipeline pads one call."""
        flat = [p for group in groups for p in group]
        hidden = self.hidden_states(tokenizer, flat, fmt)
        out, start = [], 0
        for group in groups:
            out.append(collate(hidden[start:start + len(group)], fmt, dtype=dtype, device=device))
            start += len(group)
        return out

    def close(self) -> None:
        self.batcher.close()
        if self.owns_backend:
            self.backend.close()


__all__ = ["PromptEncoder", "prompt_encoding_of"]
