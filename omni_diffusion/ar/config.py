"""Configuration of the LLM prompt stages: :class:`PromptEncoderConfig` and
:class:`PromptEnhancerConfig` (fields of :class:`omni_diffusion.AccelConfig`).

Both validate on construction (``ValueError`` naming the field, the value and
what is allowed) and read from dicts (:meth:`from_dict`, unknown keys raise).

Placement, for both:

* ``"engine"``: a vLLM engine started by this process (``vllm.LLM``, whose
  engine core runs in a child process); vLLM must be importable here.
* ``"server"``: an OpenAI-compatible vLLM server: the one at ``url``, or, with
  no ``url``, one this process launches with the interpreter ``python``
  (another virtual environment's, when vLLM's pins clash with the diffusion
  side's) and stops when the pipeline is un-accelerated.

``gpu_memory_utilization`` is vLLM's share of the GPU memory; the diffusion
model is left the rest. It is always set explicitly (no vLLM default of 0.9
that would starve the diffusion model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omni_diffusion._fields import known_fields, not_allowed

PLACEMENTS = ("engine", "server")


@dataclasses.dataclass(frozen=True)
class _VLLMPlacement:
    model: str | None = None
    placement: str = "engine"
    url: str | None = None
    python: str | None = None
    gpu_memory_utilization: float = 0.3
    dtype: str = "auto"
    engine_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise not_allowed(name, "model", self.model, "None or a model folder / name")
        if self.placement not in PLACEMENTS:
            raise not_allowed(name, "placement", self.placement, ", ".join(map(repr, PLACEMENTS)))
        if self.url is not None:
            if self.placement != "server":
                raise not_allowed(name, "url", self.url, "None unless placement='server'")
            if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
                raise not_allowed(name, "url", self.url, "None or an http(s):// base URL")
        if self.python is not None and (self.placement != "server" or self.url is not None):
            raise not_allowed(name, "python", self.python,
                              "None unless placement='server' without url (the interpreter that launches vLLM)")
        value = self.gpu_memory_utilization
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise not_allowed(name, "gpu_memory_utilization", value, "a number in (0, 1]")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise not_allowed(name, "dtype", self.dtype, "a vLLM dtype name ('auto', 'bfloat16', ...)")
        if not isinstance(self.engine_args, Mapping) or not all(isinstance(k, str) for k in self.engine_args):
            raise not_allowed(name, "engine_args", self.engine_args, "a mapping of vLLM engine arguments")
        object.__setattr__(self, "engine_args", dict(self.engine_args))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str):
        """From a mapping of field names (unknown keys raise) or a bare model string."""
        if isinstance(data, str):
            return cls(model=data)
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}.from_dict needs a mapping or a model string, "
                             f"got {type(data).__name__}")
        return cls(**known_fields(cls, data))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["engine_args"] = dict(self.engine_args)
        return out


@dataclasses.dataclass(frozen=True)
class PromptEncoderConfig(_VLLMPlacement):
    """The pipeline's LLM text encoder run in vLLM (:mod:`omni_diffusion.ar`).

    Args:
        model: a folder written by :func:`omni_diffusion.ar.export.export_for_vllm`
            for this pipeline (load the pipeline with ``text_encoder=None`` then),
            or None: write the pipeline's own text encoder to ``export_dir``
            when accelerating.
        placement, url, python, gpu_memory_utilization, dtype, engine_args:
            see the module docstring.
        export_dir: where ``model=None`` writes the encoder (default: a
            temporary folder).
        batch_window_ms: how long the batcher waits for concurrent prompt
            requests after the first one.
        max_batch_prompts: at most this many prompts per vLLM request.
    """

    export_dir: str | None = None
    batch_window_ms: float = 5.0
    max_batch_prompts: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        value = self.batch_window_ms
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise not_allowed(name, "batch_window_ms", value, "a number >= 0")
        value = self.max_batch_prompts
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise not_allowed(name, "max_batch_prompts", value, "an integer >= 1")


@dataclasses.dataclass(frozen=True)
class PromptEnhancerConfig(_VLLMPlacement):
    """An LLM that rewrites each prompt before it is encoded (``--prompt-enhancer MODEL``).

    Args:
        model: the chat model (folder or name); required.
        placement, url, python, gpu_memory_utilization, dtype, engine_args:
            see the module docstring.
        system_prompt: the instruction given to the model (None: the model
            family's, from its adapter).
        max_tokens: the longest rewritten prompt, in tokens.
        temperature: sampling temperature (0: greedy, reproducible).
        seed: sampling seed.
    """

    system_prompt: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.model is None:
            raise not_allowed(name, "model", None, "a chat model folder or name")
        if self.system_prompt is not None and (not isinstance(self.system_prompt, str)
                                               or not self.system_prompt.strip()):
            raise not_allowed(name, "system_prompt", self.system_prompt, "None or a non-empty string")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise not_allowed(name, "max_tokens", self.max_tokens, "an integer >= 1")
        value = self.temperature
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise not_allowed(name, "temperature", value, "a number >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise not_allowed(name, "seed", self.seed, "an integer")


__all__ = ["PLACEMENTS", "PromptEncoderConfig", "PromptEnhancerConfig"]
