"""The prompt rewriter ("prompt enhancer"): an LLM turns a short prompt into a detailed one.

Each prompt goes to a chat model as ``[system, user]`` messages; the system
prompt is the model family's (``ModelAdapter.prompt_enhancer_system_prompt``),
or :data:`DEFAULT_SYSTEM_PROMPT`, or the config's own. Prompts of one call go
out as one batch. An empty reply keeps the original prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("omni_diffusion.ar")

DEFAULT_SYSTEM_PROMPT = (
    "You expand prompts for an image generator. Rewrite the user's prompt as one detailed "
    "description of the picture: the subject, its appearance and pose, the setting, lighting, "
    "colours, composition and style. Keep everything the user asked for and add nothing that "
    "contradicts it. Reply with the rewritten prompt only."
)


class PromptRewriter:
    """Rewrites prompts through a chat ``backend`` (``chat(conversations, max_tokens=,
    temperature=, seed=) -> list[str]``).

    Args:
        backend: a :class:`~omni_diffusion.ar.placement.Backend` of a generate runner.
        system_prompt: the instruction.
        max_tokens, temperature, seed: sampling settings.
    """

    def __init__(self, backend: Any, system_prompt: str = DEFAULT_SYSTEM_PROMPT,
                 max_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
                 owns_backend: bool = True) -> None:
        self.backend = backend
        self.system_prompt = system_prompt
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self.owns_backend = owns_backend

    def conversations(self, prompts: Sequence[str]) -> list[list[dict[str, str]]]:
        return [[{"role": "system", "content": self.system_prompt},
                 {"role": "user", "content": prompt}] for prompt in prompts]

    def rewrite(self, prompts: Sequence[str]) -> list[str]:
        """The rewritten prompts, in order."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompts: {prompts!r} is not allowed; allowed: a list of strings")
        replies = self.backend.chat(self.conversations(prompts), max_tokens=self.max_tokens,
                                    temperature=self.temperature, seed=self.seed)
        out = []
        for prompt, reply in zip(prompts, replies):
            reply = reply.strip()
            if not reply:
                logger.warning("the prompt enhancer returned nothing for %r; keeping it", prompt)
            out.append(reply or prompt)
        return out

    def close(self) -> None:
        if self.owns_backend:
            self.backend.close()


__all__ = ["DEFAULT_SYSTEM_PROMPT", "PromptRewriter"]
