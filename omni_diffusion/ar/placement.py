"""Open the vLLM backend a config's placement names: an engine here, or a server client."""

from __future__ import annotations

import os
from typing import Any

from omni_diffusion.ar.config import _VLLMPlacement


class Backend:
    """A vLLM engine or server client, plus the server this process launched (if any).

    ``embed(token_ids)`` and ``chat(conversations, ...)`` go to the engine or
    client; :meth:`close` stops what was started here.
    """

    def __init__(self, client: Any, launched: Any = None) -> None:
        self.client = client
        self.launched = launched

    def embed(self, token_ids):
        return self.client.embed(token_ids)

    def chat(self, conversations, **kwargs):
        return self.client.chat(conversations, **kwargs)

    @property
    def description(self) -> str:
        where = getattr(self.client, "url", None) or "in-process engine"
        return f"vLLM {getattr(self.client, 'model', '?')} at {where}"

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self.launched is not None:
                self.launched.close()


def open_backend(config: _VLLMPlacement, model: str, runner: str) -> Backend:
    """Start or reach vLLM for ``model`` as ``config`` places it.

    ``runner`` is ``"pooling"`` (prompt encoding) or ``"generate"`` (rewriting).
    """
    if config.placement == "engine":
        from omni_diffusion.ar.vllm_engine import VLLMEngine

        return Backend(VLLMEngine(model, runner=runner, dtype=config.dtype,
                                  gpu_memory_utilization=config.gpu_memory_utilization,
                                  engine_args=config.engine_args))
    from omni_diffusion.ar.vllm_server import VLLMServerClient, launch_server

    if config.url is not None:
        return Backend(VLLMServerClient(config.url))
    extra = []
    for key, value in config.engine_args.items():  # engine arguments as `vllm serve` flags
        flag = "--" + key.replace("_", "-")
        if value is True:
            extra.append(flag)
        elif value is not False and value is not None:
            extra += [flag, str(value)]
    # vLLM on CPU sizes its KV cache from this variable, not from gpu_memory_utilization.
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    launched = launch_server(model, runner=runner, python=config.python, dtype=config.dtype,
                             gpu_memory_utilization=config.gpu_memory_utilization,
                             extra_args=extra, env=env)
    try:
        return Backend(VLLMServerClient(launched.url), launched)
    except BaseException:
        launched.close()
        raise


__all__ = ["Backend", "open_backend"]
