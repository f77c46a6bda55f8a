"""The prompt stage that :func:`omni_diffusion.accelerate` puts in front of a pipeline call.

With a :class:`~omni_diffusion.ar.config.PromptEncoderConfig` and/or a
:class:`~omni_diffusion.ar.config.PromptEnhancerConfig` in the
:class:`~omni_diffusion.AccelConfig`, every call's ``prompt`` (and
``negative_prompt``) is rewritten by the enhancer, then encoded by the vLLM
prompt encoder (positive and negative in one batch, batched with concurrent
calls) and handed to the pipeline as ``prompt_embeds`` and masks, the way the
family's adapter says (``ModelAdapter.prompt_embeds_kwargs``). Calls that pass
embeddings themselves go through untouched.
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import torch

from omni_diffusion.ar.config import PromptEncoderConfig, PromptEnhancerConfig
from omni_diffusion.ar.encoder import PromptEncoder, prompt_encoding_of
from omni_diffusion.ar.rewriter import DEFAULT_SYSTEM_PROMPT, PromptRewriter

logger = logging.getLogger("omni_diffusion.ar")


def _as_list(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"{name}: {value!r} is not allowed; allowed: a string or a list of strings")


class PromptStage:
    """Rewriting and encoding for one accelerated pipeline (see the module docstring)."""

    def __init__(self, pipe: Any, adapter: Any, encoder: PromptEncoderConfig | None,
                 enhancer: PromptEnhancerConfig | None) -> None:
        from omni_diffusion.ar.placement import open_backend

        self.adapter = adapter
        self.encoder: PromptEncoder | None = None
        self.rewriter: PromptRewriter | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        try:
            if encoder is not None:
                prompt_encoding_of(pipe, adapter)  # the family must have an LLM encoder
                model = encoder.model or self._export(pipe, encoder)
                backend = open_backend(encoder, model, runner="pooling")
                self.encoder = PromptEncoder(backend, window_s=encoder.batch_window_ms / 1000,
                                             max_prompts=encoder.max_batch_prompts)
            if enhancer is not None:
                system = enhancer.system_prompt or getattr(
                    adapter, "prompt_enhancer_system_prompt", None) or DEFAULT_SYSTEM_PROMPT
                backend = open_backend(enhancer, enhancer.model, runner="generate")
                self.rewriter = PromptRewriter(backend, system, max_tokens=enhancer.max_tokens,
                                               temperature=enhancer.temperature, seed=enhancer.seed)
        except BaseException:
            self.close()
            raise

    def _export(self, pipe: Any, config: PromptEncoderConfig) -> str:
        from omni_diffusion.ar.export import export_pipeline_text_encoder

        if getattr(pipe, "text_encoder", None) is None:
            raise ValueError("PromptEncoderConfig.model: None needs the pipeline's text_encoder to "
                             "export; the pipeline has none, so name an exported folder")
        out = config.export_dir
        if out is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="omni-ar-encoder-")
            out = self._tmp.name
        return str(export_pipeline_text_encoder(pipe, out, self.adapter))

    def prepare(self, pipe: Any, kwargs: dict) -> dict:
        """The call's keyword arguments with prompts rewritten and/or replaced by embeddings."""
        prompt = kwargs.get("prompt")
        if prompt is None:
            return kwargs
        prompts = _as_list(prompt, "prompt")
        kwargs = dict(kwargs)
        if self.rewriter is not None:
            prompts = self.rewriter.rewrite(prompts)
            kwargs["prompt"] = prompts
        if self.encoder is None:
            return kwargs
        negative = kwargs.get("negative_prompt")
        negatives = None if negative is None else _as_list(negative, "negative_prompt")
        _, fmt = prompt_encoding_of(pipe, self.adapter, kwargs)
        dtype, device = _embeds_dtype_device(pipe, self.adapter)
        groups = [prompts] if negatives is None else [prompts, negatives]
        encoded = self.encoder.encode(pipe.tokenizer, groups, fmt, dtype=dtype, device=device)
        return self.adapter.prompt_embeds_kwargs(pipe, kwargs, encoded[0],
                                                 encoded[1] if negatives is not None else None)

    def close(self) -> None:
        for part in (self.encoder, self.rewriter):
            if part is not None:
                part.close()
        self.encoder = self.rewriter = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _embeds_dtype_device(pipe: Any, adapter: Any) -> tuple[torch.dtype, torch.device]:
    """The dtype the pipeline's own encoder would return (its text encoder's,
    else the denoiser's) and the device the pipeline runs on."""
    text_encoder = getattr(pipe, "text_encoder", None)
    denoiser = next(iter(adapter.transformers(pipe).values()))
    dtype = text_encoder.dtype if isinstance(text_encoder, torch.nn.Module) else denoiser.dtype
    return dtype, pipe._execution_device


__all__ = ["PromptStage"]
