"""Tests of :func:`save_quantized` / :func:`load_quantized` (CPU, CI): the round trip through
safetensors (into a fresh skeleton, a ``meta`` skeleton, and through ``quantize`` +
``load_state_dict``, fused models too), and the load errors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

from omni_diffusion import quantization as Q  # noqa: E402
from omni_diffusion.quantization import (  # noqa: E402
    QuantConfig,
    fused_attention,
    load_quantized,
    quantize,
    quantized_layers,
    save_quantized,
)

from quantization_cases import (  # noqa: E402
    CPU_OPTIONS,
    FUSED_ATTENTION,
    _run,
    _tiny_flux,
    _tiny_wan,
)


@pytest.mark.parametrize("method", ["fp8", "int8_weight_only"])
def test_save_load_round_trip(tmp_path, method):
    model, inputs = _tiny_flux()
    config = QuantConfig(method=method, skip=("proj_out",), **CPU_OPTIONS)
    quantize(model, config)
    expected = _run(model, inputs)
    path = tmp_path / "model.safetensors"
    save_quantized(model, path, config)

    # 1. Into a fresh, unquantized skeleton: the listed layers are rebuilt, nothing re-quantized.
    fresh, _ = _tiny_flux()
    torch.nn.init.zeros_(fresh.x_embedder.weight)  # the file's weights must replace these
    assert load_quantized(fresh, path) is fresh
    assert quantized_layers(fresh) == quantized_layers(model)
    # fp8 (W8A8) fuses q/k/v by default; the file says which attention modules to fuse again
    assert fused_attention(fresh) == fused_attention(model) == (
        FUSED_ATTENTION["flux"] if method == "fp8" else [])
    assert fresh.transformer_blocks[0].attn.to_out[0].backend == "aten"  # options saved with the file
    # W8A8 folds the MLP GELUs into their consumers; the file says which, and they are folded again
    assert Q.fused_activations(fresh) == Q.fused_activations(model)
    assert bool(Q.fused_activations(model)) == (method == "fp8")
    assert torch.equal(_run(fresh, inputs), expected)

    # 2. Into a skeleton on the meta device (no full-precision weights ever allocated).
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        skeleton = FluxTransformer2DModel.from_config(fresh.config).eval()
    load_quantized(skeleton, path, config)
    assert all(t.device.type == "cpu" for t in skeleton.state_dict().values())
    assert fused_attention(skeleton) == fused_attention(model)
    assert Q.fused_activations(skeleton) == Q.fused_activations(model)
    assert torch.equal(_run(skeleton, inputs), expected)

    # 3. quantize() on a fresh model, then the plain state_dict of the file.
    from safetensors.torch import load_file

    other, _ = _tiny_flux()
    quantize(other, config)
    other.load_state_dict(load_file(path))
    assert torch.equal(_run(other, inputs), expected)


def test_load_errors(tmp_path):
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    path = tmp_path / "int8.safetensors"
    save_quantized(model, path)
    with pytest.raises(ValueError, match=r"QuantConfig\.method='fp8' does not match .*\['int8'\]"):
        load_quantized(_tiny_flux()[0], path, QuantConfig(method="fp8"))
    with pytest.raises(ValueError, match=r"fuses the projections of 'transformer_blocks\.0\.attn', which WanTransformer3DModel does not have"):
        load_quantized(_tiny_wan()[0], path)
    unfused, _ = _tiny_flux()
    quantize(unfused, QuantConfig(method="int8", fuse_projections=False, **CPU_OPTIONS))
    save_quantized(unfused, tmp_path / "unfused.safetensors")
    with pytest.raises(ValueError, match=r"quantizes layer 'time_text_embed\.timestep_embedder\.linear_1', which WanTransformer3DModel does not have"):
        load_quantized(_tiny_wan()[0], tmp_path / "unfused.safetensors")
    from omni_diffusion.adapters.base import ModelAdapter

    skeleton = _tiny_flux()[0]  # an adapter without fused processors cannot rebuild the fused layers
    with pytest.raises(ValueError, match=r"cannot fuse the projections of transformer_blocks\.0\.attn"):
        load_quantized(skeleton, path, adapter=ModelAdapter())
    assert fused_attention(skeleton) == [] and hasattr(skeleton.transformer_blocks[0].attn, "to_q")

    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, plain)
    with pytest.raises(ValueError, match=r"is not an omni quantized checkpoint"):
        load_quantized(_tiny_flux()[0], plain)
    with pytest.raises(ValueError, match=r"has no quantized layers: call quantize\(\) before"):
        save_quantized(_tiny_flux()[0], tmp_path / "none.safetensors")
