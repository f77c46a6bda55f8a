"""A transformers backend for exported encoders: the reference the vLLM paths are tested against.

:class:`TransformersBackend` loads a folder written by
:func:`omni_diffusion.ar.export.export_for_vllm` with transformers and
returns ``hidden_states[layer]`` per prompt, one prompt per forward (no
padding). It runs where vLLM does not, and shows that the export itself
keeps the pipeline's numbers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch


class TransformersBackend:
    """Per-token hidden states of an exported encoder folder, computed by transformers.

    Args:
        model_dir: the exported folder.
        device, dtype: where and in which dtype to run (default: CPU, the checkpoint's).
    """

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        from transformers import AutoModelForCausalLM

        config = json.loads((Path(model_dir) / "config.json").read_text())
        layer = config.get("omni_hidden_layer")
        self.layer = -1 if layer is None else int(layer)
        self.model_dir = str(model_dir)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        self.decoder = model.model.to(device).eval()
        self.device = torch.device(device)

    @torch.no_grad()
    def embed(self, token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        out = []
        for ids in token_ids:
            inputs = torch.tensor([list(ids)], device=self.device)
            hidden = self.decoder(input_ids=inputs, output_hidden_states=True).hidden_states
            out.append(hidden[self.layer][0])
        return out

    def close(self) -> None:
        self.__dict__.pop("decoder", None)


__all__ = ["TransformersBackend"]
