"""Tests of :class:`omni_diffusion.quantization.QuantConfig` and the layer plan (CPU, CI):
defaults, round trip and bad configs naming the field; skip/include patterns and
``min_features``; a pattern matching no module, unquantizable shapes, a bare linear, and FP8
on a GPU without FP8 tensor cores raise or are handled.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

import omni_kernels._device as omni_device  # noqa: E402
import omni_kernels.quant.dispatch as quant_dispatch  # noqa: E402
import omni_diffusion.quantization.plan as quant_plan  # noqa: E402
from omni_diffusion.quantization import (  # noqa: E402
    DEFAULT_SKIP,
    QuantConfig,
    plan_quantization,
    quantize,
    quantized_layers,
)
from omni_kernels.quant import QuantizedLinear  # noqa: E402

from quantization_cases import _linears, _tiny_flux  # noqa: E402


def test_config_defaults_and_round_trip():
    config = QuantConfig()
    assert config.method == "fp8" and config.skip == DEFAULT_SKIP == () and config.include is None
    assert config.min_features == 0 and config.backend == "auto" and not config.weight_only
    custom = QuantConfig(method="int8_weight_only", skip=["proj_out", "*.norm*"], min_features=256, clamp=8)
    assert custom.skip == ("proj_out", "*.norm*") and custom.clamp == 8.0 and custom.weight_only
    assert QuantConfig.from_dict(custom.to_dict()) == custom
    assert QuantConfig.from_dict({"method": "int8"}) == QuantConfig(method="int8")


BAD_CONFIGS = [
    ("method", dict(method="fp4"), r"QuantConfig\.method must be one of \('fp8', 'int8', 'fp8_weight_only', 'int8_weight_only'\); got 'fp4'"),
    ("skip_str", dict(skip="proj_out"), r"QuantConfig\.skip must be a list or tuple of fnmatch patterns"),
    ("skip_item", dict(skip=["ok", 3]), r"QuantConfig\.skip patterns must be non-empty strings; got 3"),
    ("include_empty", dict(include=[""]), r"QuantConfig\.include patterns must be non-empty strings"),
    ("min_features", dict(min_features=-1), r"QuantConfig\.min_features must be an int >= 0; got -1"),
    ("min_features_float", dict(min_features=1.5), r"QuantConfig\.min_features must be an int"),
    ("backend", dict(backend="cublas"), r"QuantConfig\.backend must be one of \('auto', 'aten', 'cublaslt', 'triton', 'torch'\)"),
    ("activation_backend", dict(activation_backend="aten"), r"QuantConfig\.activation_backend must be one of"),
    ("clamp", dict(clamp=0), r"QuantConfig\.clamp must be None or a finite number > 0; got 0"),
    ("clamp_inf", dict(clamp=float("inf")), r"QuantConfig\.clamp must be None or a finite number > 0"),
    ("fast_accum", dict(fast_accum="yes"), r"QuantConfig\.fast_accum must be True, False or 'auto'"),
    ("split_k_negative", dict(activation_backend="split", split_k=-1),
     r"QuantConfig\.split_k must be None or an int >= 0 \(an input width K\); got -1"),
    ("split_k_float", dict(activation_backend="split", split_k=8192.0), r"QuantConfig\.split_k must be None or an int"),
    ("split_k_without_split", dict(split_k=4096),
     r"QuantConfig\.split_k=4096 applies only to activation_backend='split'; got activation_backend='auto'"),
]


@pytest.mark.parametrize("change,match", [pytest.param(c, m, id=n) for n, c, m in BAD_CONFIGS])
def test_bad_config_raises_naming_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**change)
    with pytest.raises(ValueError, match=match):
        QuantConfig.from_dict(change)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['skip_layers'\]; allowed fields are \('method'"):
        QuantConfig.from_dict({"method": "fp8", "skip_layers": ["proj_out"]})
    with pytest.raises(ValueError, match=r"needs a dict"):
        QuantConfig.from_dict("fp8")


def test_fuse_projections_config_field():
    assert QuantConfig().fuses_projections and QuantConfig(method="int8").fuses_projections
    assert not QuantConfig(method="fp8_weight_only").fuses_projections
    assert not QuantConfig(fuse_projections=False).fuses_projections
    assert QuantConfig.from_dict(QuantConfig(fuse_projections=False).to_dict()).fuse_projections is False
    with pytest.raises(ValueError, match=r"QuantConfig.fuse_projections must be True, False or None"):
        QuantConfig(fuse_projections="yes")


def test_cublaslt_backend_config_is_fp8_only():
    assert QuantConfig(backend="cublaslt").backend == "cublaslt"
    with pytest.raises(ValueError, match=r"backend='cublaslt' is omni's FP8 W8A8 GEMM; .*\['int8'\]"):
        QuantConfig(method="int8", backend="cublaslt")
    with pytest.raises(ValueError, match=r"cannot run method\(s\) \['int8_weight_only'\]"):
        QuantConfig(backend="cublaslt", layer_methods={"*.norm1.linear": "int8_weight_only"})


@pytest.mark.parametrize("fields,match", [
    (dict(method="int8_weight_only", fuse_activations=True), "needs a W8A8 method"),
    (dict(fuse_activations="yes"), "fuse_activations must be True, False or None"),
])
def test_fuse_activations_config_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**fields)
    assert QuantConfig(activation_backend="cuda").fuses_activations is True  # csrc/quant has a GELU kernel
    assert QuantConfig().fuses_activations and not QuantConfig(method="fp8_weight_only").fuses_activations


# =========================================================================== plan


def test_plan_skip_include_and_min_features():
    model, _ = _tiny_flux()
    config = QuantConfig(skip=("time_text_embed", "*.proj_out", "proj_out", "x_embedder"))
    plans = {p.name: p for p in plan_quantization(model, config)}
    assert set(plans) == set(_linears(model))
    # A parent name keeps every linear under it; "*" crosses dots.
    assert plans["time_text_embed.timestep_embedder.linear_1"].action == "keep"
    assert "'time_text_embed'" in plans["time_text_embed.text_embedder.linear_2"].reason
    assert plans["single_transformer_blocks.0.proj_out"].action == "keep"
    assert plans["proj_out"].action == "keep" and plans["x_embedder"].action == "keep"
    assert plans["transformer_blocks.0.attn.to_q"].action == "quantize"

    only_attention = {p.name: p for p in plan_quantization(model, QuantConfig(include=("*.attn",)))}
    assert only_attention["transformer_blocks.0.attn.to_out.0"].action == "quantize"
    assert only_attention["transformer_blocks.0.ff.net.2"].reason == "matches no include pattern"

    small = {p.name: p for p in plan_quantization(model, QuantConfig(min_features=64))}
    assert small["transformer_blocks.0.attn.to_q"].action == "keep"  # 32 -> 32
    assert "min(in, out) = 32 < min_features 64" in small["transformer_blocks.0.attn.to_q"].reason
    assert small["transformer_blocks.0.ff.net.0.proj"].action == "keep"  # 32 -> 128: min is 32


def test_pattern_matching_no_module_raises():
    model, _ = _tiny_flux()
    with pytest.raises(ValueError, match=r"QuantConfig\.skip pattern\(s\) \['proj_outt'\] match no module of FluxTransformer2DModel"):
        quantize(model, QuantConfig(skip=("proj_outt",)))
    with pytest.raises(ValueError, match=r"QuantConfig\.include pattern\(s\) \['blocks\.\*'\] match no module"):
        quantize(model, QuantConfig(include=("blocks.*",)))
    # Nothing was swapped by the failed calls.
    assert not quantized_layers(model)


class _Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.good = nn.Linear(32, 64)
        self.odd = nn.Linear(20, 32)  # in_features not a multiple of 16

    def forward(self, x):
        return self.good(x)


def test_unquantizable_shape_is_kept_or_raises_when_named():
    module = _Odd()
    plans = {p.name: p for p in plan_quantization(module, QuantConfig())}
    assert plans["good"].action == "quantize"
    assert plans["odd"].action == "keep" and "in_features=20 not a multiple of 16" in plans["odd"].reason
    quantize(module, QuantConfig(method="int8"))
    assert isinstance(module.good, QuantizedLinear) and type(module.odd) is nn.Linear
    with pytest.raises(ValueError, match=r"layer 'odd' of _Odd \(named by include pattern 'odd'\) cannot be quantized: in_features=20"):
        quantize(_Odd(), QuantConfig(include=("odd",)))


def test_quantize_a_bare_linear_returns_the_replacement():
    linear = nn.Linear(32, 16)
    new = quantize(linear, {"method": "int8"})
    assert isinstance(new, QuantizedLinear) and new.method == "int8"


def test_fp8_on_gpu_without_fp8_tensor_cores_raises(monkeypatch):
    """The capability check: an A100 (8.0) is refused with the reason and the alternative."""
    monkeypatch.setattr(omni_device, "_capabilities", {0: (8, 0)})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    reason = quant_dispatch.fp8_unsupported_reason(torch.device("cuda:0"))
    assert "compute capability >= 8.9" in reason and "A100" in reason and "'int8'" in reason
    monkeypatch.setattr(omni_device, "_capabilities", {0: (9, 0)})
    assert quant_dispatch.fp8_unsupported_reason(torch.device("cuda:0")) is None
    assert quant_dispatch.fp8_unsupported_reason(torch.device("cpu")) is None

    # quantize() asks for every device its layers sit on: here the CPU, reported as unsupported.
    monkeypatch.setattr(quant_plan, "fp8_unsupported_reason", lambda device: "FP8 needs FP8 tensor cores (test)")
    model, _ = _tiny_flux()
    with pytest.raises(RuntimeError, match=r"QuantConfig\.method='fp8_weight_only': FP8 needs FP8 tensor cores"):
        quantize(model, QuantConfig(method="fp8_weight_only"))
    quantize(model, QuantConfig(method="int8"))  # INT8 is not affected
