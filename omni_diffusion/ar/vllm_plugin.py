"""vLLM plugin (entry point ``vllm.general_plugins: omni_ar``): hidden-state models.

vLLM's pooling runner returns a decoder's final, normed hidden states. Some
pipelines read a lower layer, unnormed (HunyuanVideo: two layers below the
last). :func:`omni_diffusion.ar.export.export_for_vllm` writes such a text
encoder with the architecture ``OmniHiddenState<Base>`` (``Base`` a vLLM
causal LM class, e.g. ``LlamaForCausalLM``) and ``omni_hidden_layer`` in its
config; this plugin registers those architectures. Each is the vLLM class
with the layer's residual stream (hidden + residual, as transformers'
``hidden_states[k]``) taken through vLLM's auxiliary hidden-state outputs
(the ones EAGLE-3 uses) and returned instead of the final norm's output.

vLLM calls :func:`register` in every process it starts (engine core,
workers, API server); it only records names, the classes are built lazily.
"""

from __future__ import annotations

from typing import Any

#: architecture prefix of exported hidden-state encoders
ARCH_PREFIX = "OmniHiddenState"
#: vLLM causal LM classes that can be wrapped: name -> module (all carry
#: vLLM's EagleModelMixin, which collects auxiliary hidden states)
BASES = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama",
    "MistralForCausalLM": "vllm.model_executor.models.mistral",
    "Qwen2ForCausalLM": "vllm.model_executor.models.qwen2",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3",
}

_BUILT: dict[str, type] = {}


def register() -> None:
    """Register ``OmniHiddenState<Base>`` for every base in :data:`BASES` (idempotent)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for base in BASES:
        name = ARCH_PREFIX + base
        if name not in supported:
            ModelRegistry.register_model(name, f"{__name__}:{name}")


def _build(base_name: str) -> type:
    import importlib

    base = getattr(importlib.import_module(BASES[base_name]), base_name)

    class HiddenStateModel(base):  # type: ignore[misc, valid-type]
        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            layer = getattr(vllm_config.model_config.hf_config, "omni_hidden_layer", None)
            self.omni_hidden_layer = layer
            if layer is not None:
                self.model._set_aux_hidden_state_layers((int(layer),))

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            if self.omni_hidden_layer is None or not isinstance(out, tuple):
                return out
            _, aux = out
            return aux[0]

    HiddenStateModel.__name__ = HiddenStateModel.__qualname__ = ARCH_PREFIX + base_name
    return HiddenStateModel


def __getattr__(name: str) -> type:  # vLLM imports "module:Class" lazily
    if name.startswith(ARCH_PREFIX) and name[len(ARCH_PREFIX):] in BASES:
        if name not in _BUILT:
            _BUILT[name] = _build(name[len(ARCH_PREFIX):])
        return _BUILT[name]
    raise AttributeError(name)
