"""Write a pipeline's LLM text encoder as a model folder vLLM serves for prompt encoding.

The folder is a decoder-only causal LM checkpoint (``config.json``,
``model.safetensors`` with ``model.``-prefixed decoder weights and tied
embeddings, the pipeline's tokenizer) of the base architecture the model
adapter names (a Qwen2.5-VL text encoder is written as its Qwen2 text
decoder: for text-only input its multimodal rotary positions equal plain
ones). When the pipeline reads a layer below the last one,

* the config's ``architectures`` is ``OmniHiddenState<Base>`` and
  ``omni_hidden_layer`` names the layer (see
  :mod:`omni_diffusion.ar.vllm_plugin`, which vLLM loads for it);
* layers above the one read are left out but one (so transformers'
  ``hidden_states[omni_hidden_layer]`` of the written model, which is not its
  last and so not normed, is that same layer, which the transformers
  reference path relies on).

vLLM is then started with ``runner="pooling"`` and the ``token_embed`` task
on this folder (:mod:`omni_diffusion.ar.vllm_engine`,
:mod:`omni_diffusion.ar.vllm_server`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from omni_diffusion.ar.prompt_format import PromptFormat
from omni_diffusion.ar.vllm_plugin import ARCH_PREFIX, BASES

_LAYER = re.compile(r"^layers\.(\d+)\.")


def export_for_vllm(decoder: torch.nn.Module, config: Any, base_architecture: str, tokenizer: Any,
                    fmt: PromptFormat, out_dir: str | Path) -> Path:
    """Write ``decoder`` (a transformers base decoder, e.g. ``LlamaModel``) to ``out_dir``.

    Args:
        decoder: the decoder stack whose ``state_dict`` has ``embed_tokens``,
            ``layers.N`` and ``norm`` entries.
        config: the transformers config of ``base_architecture`` describing it.
        base_architecture: the transformers / vLLM causal LM class name
            (a key of :data:`omni_diffusion.ar.vllm_plugin.BASES`).
        tokenizer: the pipeline's tokenizer (saved beside the weights).
        fmt: the pipeline's prompt format (which hidden layer is read).
        out_dir: created if missing; existing files are overwritten.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.
    """
    from safetensors.torch import save_file

    if base_architecture not in BASES:
        raise ValueError(f"base_architecture: {base_architecture!r} is not allowed; allowed: "
                         f"{', '.join(BASES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    num_layers = int(config.num_hidden_layers)
    index = fmt.layer_index(num_layers)
    keep = num_layers if index == num_layers else index + 1
    fields = config.to_dict()
    fields["num_hidden_layers"] = keep
    if isinstance(fields.get("layer_types"), list):
        fields["layer_types"] = fields["layer_types"][:keep]
    fields["tie_word_embeddings"] = True
    if index == num_layers:  # the final normed output: vLLM's own class computes it
        fields["architectures"] = [base_architecture]
        fields.pop("omni_hidden_layer", None)
    else:
        fields["architectures"] = [ARCH_PREFIX + base_architecture]
        fields["omni_hidden_layer"] = index
    state = {}
    for name, tensor in decoder.state_dict().items():
        match = _LAYER.match(name)
        if match is not None and int(match.group(1)) >= keep:
            continue
        if "rotary_emb" in name:  # buffers, not weights
            continue
        state["model." + name] = tensor.detach().to("cpu").contiguous()
    dtype = next(iter(state.values())).dtype
    fields["torch_dtype"] = fields["dtype"] = str(dtype).removeprefix("torch.")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True, default=str))
    tokenizer.save_pretrained(str(out))
    return out


def export_pipeline_text_encoder(pipe: Any, out_dir: str | Path, adapter: Any = None,
                                 call_kwargs: dict | None = None) -> Path:
    """:func:`export_for_vllm` of ``pipe``'s LLM text encoder, as its model adapter describes it."""
    from omni_diffusion.ar.encoder import prompt_encoding_of

    adapter, fmt = prompt_encoding_of(pipe, adapter, call_kwargs or {})
    decoder, config, base = adapter.llm_text_decoder(pipe)
    return export_for_vllm(decoder, config, base, pipe.tokenizer, fmt, out_dir)


__all__ = ["export_for_vllm", "export_pipeline_text_encoder"]
