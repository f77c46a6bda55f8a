"""Tests of q/k/v projection fusion under quantization (Flux, SD3, SD3.5 with its image-only
``attn2`` and q/k norms): the same output as unfused quantization, two fewer activation
quantizations and GEMMs per fused triple, skip/include patterns respected, the models and
processors it leaves alone, undo when quantization fails.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

from omni_diffusion.quantization import (  # noqa: E402
    QuantConfig,
    fused_attention,
    plan_fusion,
    quantize,
    quantized_layers,
    unfuse_projections,
)
from omni_kernels.quant import QuantizedLinear  # noqa: E402

from quantization_cases import (  # noqa: E402
    CPU_OPTIONS,
    FUSED_ATTENTION,
    MODEL_TOLERANCE,
    _TRIPLES,
    _rel,
    _run,
    _tiny_flux,
    _tiny_sd3,
)


def _tiny_sd35():
    """SD3.5-style: q/k RMSNorms and an image-only second attention (attn2) in block 0."""
    return _tiny_sd3(num_layers=2, dual_attention_layers=(0,), qk_norm="rms_norm")


FUSION_MODELS = {"flux": _tiny_flux, "sd3": _tiny_sd3, "sd35": _tiny_sd35}


def _count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("family", sorted(FUSION_MODELS))
def test_fused_projections_same_output_fewer_quantizations(monkeypatch, family, method):
    """Fused and unfused quantization give the same output (same activation scales per token,
    same weight scales per channel), within the model tolerance of the float32 model; each
    fused triple saves two activation quantizations and two GEMMs per forward."""
    import omni_kernels.quant.linear as quant_linear

    model, inputs = FUSION_MODELS[family]()
    ref = _run(model, inputs)
    unfused = copy.deepcopy(model)
    quantize(unfused, QuantConfig(method=method, fuse_projections=False, **CPU_OPTIONS))
    quantize(model, QuantConfig(method=method, **CPU_OPTIONS))  # default: fused for W8A8
    assert fused_attention(unfused) == [] and fused_attention(model) == FUSED_ATTENTION[family]
    fused_layers = [n for n in quantized_layers(model) if n.rsplit(".", 1)[-1] in _TRIPLES]
    assert len(fused_layers) >= len(FUSED_ATTENTION[family])
    for name in fused_layers:
        attn = model.get_submodule(name.rsplit(".", 1)[0])
        assert attn.fused_projections and not any(hasattr(attn, m) for m in _TRIPLES[name.rsplit(".", 1)[-1]])

    quantizations = _count_calls(monkeypatch, quant_linear, "quantize_per_token")
    gemms = _count_calls(monkeypatch, quant_linear, "scaled_mm")
    out_unfused = _run(unfused, inputs)
    counts_unfused = len(quantizations), len(gemms)
    quantizations.clear()
    gemms.clear()
    out = _run(model, inputs)
    assert counts_unfused[0] - len(quantizations) == 2 * len(fused_layers)
    assert counts_unfused[1] - len(gemms) == 2 * len(fused_layers)
    torch.testing.assert_close(out, out_unfused, rtol=1e-5, atol=1e-6)
    err = _rel(out, ref)
    assert err <= MODEL_TOLERANCE[method], f"{family} {method}: relative L2 error {err:.4f}"


def test_fusion_keeps_triples_a_pattern_splits():
    """A triple is fused only when all three layers are quantized: a skip of one layer, or an
    include naming q/k/v but not the added q/k/v, leaves that attention unfused."""
    model, inputs = _tiny_flux()
    plan = plan_fusion(model, QuantConfig(method="int8", skip=("transformer_blocks.0.attn.to_k",)))
    assert plan == ["single_transformer_blocks.0.attn"]
    include = QuantConfig(method="int8", include=("*attn.to_[qkv]",), **CPU_OPTIONS)
    assert plan_fusion(model, include) == ["single_transformer_blocks.0.attn"]
    quantize(model, include)
    assert sorted(quantized_layers(model)) == [
        "single_transformer_blocks.0.attn.to_qkv",
        "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v",
    ]
    assert plan_fusion(*_tiny_flux()[:1], QuantConfig(method="int8", fuse_projections=False)) == []
    assert plan_fusion(*_tiny_flux()[:1], QuantConfig(method="int8_weight_only")) == []  # default off
    assert len(plan_fusion(*_tiny_flux()[:1], QuantConfig(method="int8_weight_only", fuse_projections=True))) == 2


def test_fused_weight_only_matches_unfused():
    model, inputs = _tiny_flux()
    unfused = copy.deepcopy(model)
    quantize(unfused, QuantConfig(method="int8_weight_only", **CPU_OPTIONS))
    quantize(model, QuantConfig(method="int8_weight_only", fuse_projections=True, **CPU_OPTIONS))
    assert fused_attention(model) == FUSED_ATTENTION["flux"] and fused_attention(unfused) == []
    torch.testing.assert_close(_run(model, inputs), _run(unfused, inputs), rtol=1e-5, atol=1e-6)


def test_fusion_without_adapter_or_fused_processor_is_skipped():
    """A model no adapter describes, or a processor that ignores fused projections, stays unfused."""
    class _Other:  # a processor the Flux adapter does not know to read fused projections
        def __call__(self, *args, **kwargs):
            raise AssertionError("not called")

    model, _ = _tiny_flux()
    model.single_transformer_blocks[0].attn.set_processor(_Other())
    assert plan_fusion(model, QuantConfig(method="int8")) == ["transformer_blocks.0.attn"]
    wrapper = nn.Sequential(_tiny_flux()[0])  # no adapter for nn.Sequential
    assert plan_fusion(wrapper, QuantConfig(method="int8")) == []


def test_fusion_undone_when_quantize_fails(monkeypatch):
    """quantize() failing after a fusion puts the separate projections back."""
    model, _ = _tiny_flux()
    attn = model.transformer_blocks[0].attn
    layers = {m: getattr(attn, m) for m in ("to_q", "to_k", "to_v", "add_q_proj")}
    processor = attn.processor
    original = QuantizedLinear.from_linear
    fused_width = 3 * attn.to_q.out_features

    def failing(linear, method, **options):
        if linear.out_features == fused_width:
            raise RuntimeError("boom")
        return original(linear, method, **options)

    monkeypatch.setattr(QuantizedLinear, "from_linear", failing)
    with pytest.raises(RuntimeError, match="boom"):
        quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    assert all(getattr(attn, m) is layer for m, layer in layers.items())
    assert not hasattr(attn, "to_qkv") and not attn.fused_projections and "fused_projections" not in attn.__dict__
    assert attn.processor is processor and fused_attention(model) == []


def test_unfuse_needs_the_separate_projections():
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    with pytest.raises(ValueError, match=r"has no \['to_q', 'to_k', 'to_v'.*only accelerate\(\)'s undo"):
        unfuse_projections(model)
