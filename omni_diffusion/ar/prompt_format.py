"""How a pipeline turns prompts into LLM token ids and LLM hidden states into ``prompt_embeds``.

:class:`PromptFormat` holds one family's facts (its adapter builds it from the
pipeline, see ``ModelAdapter.prompt_format``): the prompt template, how many
template tokens are dropped from the front, which hidden layer is read, the
tokenizer's length limit and how the batch is padded. :func:`tokenize` and
:func:`collate` reproduce what the pipeline's own encoder does around the LLM
call, so that the LLM itself can run elsewhere (vLLM) on unpadded token lists:

* tokenize ``template.format(prompt)`` with the pipeline's tokenizer, special
  tokens added, truncated to ``max_tokens`` (the pipelines pad the batch, but
  with causal attention and right padding the valid tokens' hidden states do
  not depend on the padding, so each prompt is sent unpadded);
* read ``hidden_states[hidden_layer]`` (transformers' numbering: 0 is the
  embedding output, -1 the final normed output) for every token;
* drop the first ``drop_tokens`` positions (the template's system part);
* pad to the longest prompt of the call (``pad_to=None``) or to a fixed
  length, with zeros, and build the ``[B, S]`` mask.

Positions where the mask is 0 hold zeros. HunyuanVideo's own encoder leaves
the LLM's outputs at padded positions there instead; its transformer never
reads them (they are masked keys and pooled out), which the tests check by
comparing whole generations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """One pipeline's LLM prompt encoding.

    Args:
        template: the prompt template, with one ``{}`` where the prompt goes.
        drop_tokens: template tokens dropped from the front of the hidden states.
        hidden_layer: index into transformers' ``hidden_states`` tuple of
            ``num_hidden_layers + 1`` entries: ``-1`` is the final normed
            output, ``-3`` the (unnormed) output two layers below the last.
        max_tokens: the tokenizer's truncation length (template included).
        pad_to: the padded sequence length after dropping (None: the longest
            prompt of the call).
    """

    template: str
    drop_tokens: int
    hidden_layer: int
    max_tokens: int
    pad_to: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.template, str) or self.template.count("{}") != 1:
            raise ValueError(f"PromptFormat.template: {self.template!r} is not allowed; allowed: "
                             "a string with exactly one '{}'")
        for name, minimum in (("drop_tokens", 0), ("max_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"PromptFormat.{name}: {value!r} is not allowed; allowed: an "
                                 f"integer >= {minimum}")
        if isinstance(self.hidden_layer, bool) or not isinstance(self.hidden_layer, int):
            raise ValueError(f"PromptFormat.hidden_layer: {self.hidden_layer!r} is not allowed; "
                             "allowed: an integer index into hidden_states")
        if self.pad_to is not None and (not isinstance(self.pad_to, int) or self.pad_to < 1):
            raise ValueError(f"PromptFormat.pad_to: {self.pad_to!r} is not allowed; allowed: None "
                             "or an integer >= 1")

    def layer_index(self, num_hidden_layers: int) -> int:
        """``hidden_layer`` as a count of decoder layers applied (0..num_hidden_layers)."""
        index = self.hidden_layer + num_hidden_layers + 1 if self.hidden_layer < 0 else self.hidden_layer
        if not 0 <= index <= num_hidden_layers:
            raise ValueError(f"PromptFormat.hidden_layer: {self.hidden_layer} is out of range for "
                             f"a model of {num_hidden_layers} layers")
        return index

    def key(self) -> tuple:
        """What decides the token ids and hidden states (cache / batching key)."""
        return (self.template, self.drop_tokens, self.hidden_layer, self.max_tokens, self.pad_to)


def tokenize(tokenizer: Any, prompts: Sequence[str], fmt: PromptFormat) -> list[list[int]]:
    """Token ids of ``fmt.template.format(p)`` for each prompt, as the pipeline's
    tokenizer call makes them (special tokens, truncation), unpadded."""
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts: {prompts!r} is not allowed; allowed: a list of strings")
    texts = [fmt.template.format(p) for p in prompts]
    encoded = tokenizer(texts, max_length=fmt.max_tokens, truncation=True, padding=False)
    return [list(ids) for ids in encoded["input_ids"]]


def collate(hidden: Sequence[torch.Tensor], fmt: PromptFormat, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pipeline-ready ``(prompt_embeds, mask)`` from per-prompt hidden states.

    Args:
        hidden: one ``[T_i, D]`` tensor per prompt (the hidden states of all its
            tokens, template included).
        fmt: the pipeline's :class:`PromptFormat`.
        dtype, device: of ``prompt_embeds`` (default: those of ``hidden[0]``).

    Returns:
        ``prompt_embeds`` ``[B, S, D]`` (zeros where the mask is 0) and the mask
        ``[B, S]`` int64 (1 for prompt tokens), ``S = fmt.pad_to`` or the
        longest prompt after dropping ``fmt.drop_tokens``.
    """
    if not hidden:
        raise ValueError("collate: hidden is empty; allowed: one [T, D] tensor per prompt")
    kept = [h[fmt.drop_tokens:] for h in hidden]
    length = fmt.pad_to if fmt.pad_to is not None else max(h.shape[0] for h in kept)
    width = hidden[0].shape[-1]
    dtype = dtype or hidden[0].dtype
    device = device if device is not None else hidden[0].device
    embeds = torch.zeros(len(kept), length, width, dtype=dtype, device=device)
    mask = torch.zeros(len(kept), length, dtype=torch.long, device=device)
    for row, h in enumerate(kept):
        n = min(h.shape[0], length)
        embeds[row, :n] = h[:n].to(device=device, dtype=dtype)
        mask[row, :n] = 1
    return embeds, mask


__all__ = ["PromptFormat", "collate", "tokenize"]
