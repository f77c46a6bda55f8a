"""omni_diffusion.ar: the LLM (autoregressive) prompt stages of diffusion pipelines, through vLLM.

* :class:`PromptEncoder`: the pipeline's LLM text encoder run in vLLM, handing
  the pipeline the ``prompt_embeds`` and masks its own encoder would (the right
  hidden layer, its template and dropped tokens, its padding), with prompts of
  concurrent calls batched into one vLLM request.
* :class:`PromptRewriter`: an optional chat LLM that rewrites prompts first
  (``--prompt-enhancer MODEL``), with a system prompt per model family.
* Placement (:mod:`~omni_diffusion.ar.config`): a vLLM engine started here
  (:mod:`~omni_diffusion.ar.vllm_engine`) or an OpenAI-compatible vLLM server
  (:mod:`~omni_diffusion.ar.vllm_server`, reached at a URL or launched with
  another Python).
* :func:`~omni_diffusion.ar.export.export_for_vllm`: the text encoder written
  as a folder vLLM serves (:mod:`~omni_diffusion.ar.vllm_plugin` adds the
  architectures that return a layer below the last).

The usual entry point is :func:`omni_diffusion.accelerate` with
``AccelConfig(prompt_encoder=PromptEncoderConfig(...), prompt_enhancer=...)``;
the per-family facts come from the model adapters (``prompt_format``,
``llm_text_decoder``, ``prompt_embeds_kwargs``, ``prompt_enhancer_system_prompt``).
"""

from omni_diffusion.ar.batching import BatchStats, RequestBatcher
from omni_diffusion.ar.config import PromptEncoderConfig, PromptEnhancerConfig
from omni_diffusion.ar.encoder import PromptEncoder, prompt_encoding_of
from omni_diffusion.ar.prompt_format import PromptFormat, collate, tokenize
from omni_diffusion.ar.rewriter import DEFAULT_SYSTEM_PROMPT, PromptRewriter

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "BatchStats",
    "PromptEncoder",
    "PromptEncoderConfig",
    "PromptEnhancerConfig",
    "PromptFormat",
    "PromptRewriter",
    "RequestBatcher",
    "collate",
    "prompt_encoding_of",
    "tokenize",
]
