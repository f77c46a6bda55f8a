"""Tests of :mod:`omni_diffusion.quantization`: config, layer plan, module swap, save/load, errors.

CPU part (CI): the swap on tiny diffusers transformers (Flux, SD3, Wan 2.1,
Qwen-Image) in float32, whose output stays within a stated tolerance of the
unquantized model; save/load through safetensors (into a fresh skeleton, a
``meta`` skeleton, and through ``quantize`` + ``load_state_dict``); bad
configs, unknown layer names, unquantizable shapes and FP8 on a GPU without
FP8 tensor cores raise. Projection fusion (Flux, SD3, SD3.5 with its
image-only ``attn2`` and q/k norms): the same output as unfused quantization,
two fewer activation quantizations and GEMMs per fused triple, skip/include
patterns respected, save/load of fused models; under ``torch.compile`` no omni
quantization op is traced and Inductor's code gives eager's output.

GPU part (``-m gpu``): a Flux-shaped full transformer (Flux.1 widths, random
bf16 weights, 1024^2: 4096 image + 512 text tokens) whose FP8 step is within
3% relative L2 of its bf16 step, and whose quantized weights take <= 55% of
the bf16 model's memory.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

import omni_kernels._device as omni_device  # noqa: E402
import omni_kernels.quant.dispatch as quant_dispatch  # noqa: E402
import omni_diffusion.quantization.plan as quant_plan  # noqa: E402
from omni_diffusion import quantization as Q  # noqa: E402
from omni_diffusion.testing import tiny_flux_transformer  # noqa: E402
from omni_diffusion.quantization import (  # noqa: E402
    DEFAULT_SKIP,
    QuantConfig,
    fused_attention,
    load_quantized,
    plan_fusion,
    plan_quantization,
    quantize,
    quantized_layers,
    save_quantized,
    unfuse_projections,
)
from omni_kernels.quant import QuantizedLinear  # noqa: E402

# Relative L2 error of the whole tiny transformer's output against the unquantized float32
# model, with every linear layer quantized (embedders and final projection included, so the
# error is the largest it gets). Measured (seed 0; SD3's is lowest, Qwen-Image's highest):
# FP8 W8A8 0.7-5.0%, INT8 W8A8 0.2-1.0%, FP8 weight-only 0.5-3.8%, INT8 weight-only 0.1-0.6%.
# The bounds leave 2x room: FP8 e4m3 rounds each operand to 3 mantissa bits (up to 2**-4
# relative), INT8 to 1/127 of the row/channel maximum, and the errors of ~20 layers of width
# 32 (few terms to average over) compound through the residual connections.
MODEL_TOLERANCE = {"fp8": 0.10, "int8": 0.02, "fp8_weight_only": 0.08, "int8_weight_only": 0.015}
# Fast CPU paths: torch's CPU kernels for the GEMMs, the reference for activations.
CPU_OPTIONS = dict(backend="aten", activation_backend="torch")


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# --------------------------------------------------------------------------- tiny models


def _tiny_flux():
    return tiny_flux_transformer()


def _tiny_sd3(**config):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**{
        **dict(sample_size=8, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=16,
               num_attention_heads=2, caption_projection_dim=32, joint_attention_dim=32,
               pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16),
        **config,
    }).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=gen),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=gen),
        pooled_projections=torch.randn(1, 32, generator=gen),
        timestep=torch.tensor([3.0]),
        return_dict=False,
    )
    return model, inputs


def _tiny_wan():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=64, num_layers=1, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 2, 8, 8, generator=gen),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=gen),
        return_dict=False,
    )
    return model, inputs


def _tiny_qwen_image():
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 4, 4),
    ).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=gen),
        encoder_hidden_states_mask=torch.ones(1, 6),
        timestep=torch.tensor([0.5]),
        img_shapes=[(1, 4, 4)],
        return_dict=False,
    )
    return model, inputs


def _tiny_sd35():
    """SD3.5-style: q/k RMSNorms and an image-only second attention (attn2) in block 0."""
    return _tiny_sd3(num_layers=2, dual_attention_layers=(0,), qk_norm="rms_norm")


TINY_MODELS = {"flux": _tiny_flux, "sd3": _tiny_sd3, "wan": _tiny_wan, "qwen_image": _tiny_qwen_image}
# The attention modules whose q/k/v (and added q/k/v) the adapters declare fusable.
FUSED_ATTENTION = {
    "flux": ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"],
    "sd3": ["transformer_blocks.0.attn"],
    "sd35": ["transformer_blocks.0.attn", "transformer_blocks.0.attn2", "transformer_blocks.1.attn"],
    "wan": [],
    "qwen_image": [],
}
FUSION_MODELS = {"flux": _tiny_flux, "sd3": _tiny_sd3, "sd35": _tiny_sd35}
_TRIPLES = {"to_qkv": ("to_q", "to_k", "to_v"), "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


def _after_fusion(names, fused):
    """Linear layer names once the attention modules ``fused`` have their triples fused."""
    out = set(names)
    for attn in fused:
        for fused_name, members in _TRIPLES.items():
            triple = {f"{attn}.{m}" for m in members}
            if triple <= out:
                out = (out - triple) | {f"{attn}.{fused_name}"}
    return out


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def _linears(model):
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]


# =========================================================================== QuantConfig


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


# =========================================================================== swap on tiny models


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_swap_on_tiny_transformers(family, method):
    model, inputs = TINY_MODELS[family]()
    ref = _run(model, inputs)
    names = _linears(model)
    odd = [n for n in names if any(d % 16 for d in model.get_submodule(n).weight.shape)]
    result = quantize(model, QuantConfig(method=method, **CPU_OPTIONS))
    assert result is model and type(model).__name__.endswith("Model")
    # Every nn.Linear is swapped except those whose shape the 8-bit GEMMs cannot take
    # (SD3's tiny proj_out, 32 -> 4), which stay as they were; q/k/v triples the adapter
    # declares are fused first (the default for W8A8).
    assert _linears(model) == odd
    assert fused_attention(model) == FUSED_ATTENTION[family]
    assert sorted(quantized_layers(model)) == sorted(_after_fusion(set(names) - set(odd), FUSED_ATTENTION[family]))
    out = _run(model, inputs)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err <= MODEL_TOLERANCE[method], f"{family} {method}: relative L2 error {err:.4f}"


@pytest.mark.parametrize("method", ["fp8_weight_only", "int8_weight_only"])
def test_weight_only_swap(method):
    model, inputs = _tiny_flux()
    ref = _run(model, inputs)
    quantize(model, QuantConfig(method=method, skip=("proj_out",), **CPU_OPTIONS))
    assert type(model.proj_out) is nn.Linear
    err = _rel(_run(model, inputs), ref)
    assert err <= MODEL_TOLERANCE[method], f"{method}: relative L2 error {err:.4f}"


def test_swap_with_auto_backends_on_cpu():
    """The defaults (auto: Triton interpreter for INT8 activations, aten GEMMs) give the same
    result as the explicit CPU options, up to float32 summation order."""
    model, inputs = _tiny_wan()
    explicit = copy.deepcopy(model)
    quantize(model, QuantConfig(method="int8"))
    quantize(explicit, QuantConfig(method="int8", **CPU_OPTIONS))
    torch.testing.assert_close(_run(model, inputs), _run(explicit, inputs), rtol=1e-4, atol=1e-5)


def test_skipped_layers_are_untouched():
    model, inputs = _tiny_sd3()
    before = copy.deepcopy(model)
    quantize(model, QuantConfig(method="int8", skip=("transformer_blocks",), **CPU_OPTIONS))
    # The blocks' linears are skipped; proj_out (32 -> 4) stays for its shape.
    assert _linears(model) == [n for n in _linears(before) if n.startswith("transformer_blocks")] + ["proj_out"]
    for name in _linears(model):
        assert torch.equal(model.get_submodule(name).weight, before.get_submodule(name).weight)


@pytest.mark.parametrize("method,options", [("fp8", CPU_OPTIONS), ("int8", {})], ids=["fp8-aten", "int8-auto"])
def test_quantized_blocks_compile_fullgraph(method, options):
    """torch.compile(fullgraph=True) of the repeated blocks (regional compilation, as the
    runtime compiles) traces through the quantized layers of real diffusers blocks."""
    model, inputs = _tiny_flux()
    quantize(model, QuantConfig(method=method, **options))
    expected = _run(model, inputs)
    torch._dynamo.reset()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(backend="aot_eager", fullgraph=True)
    try:
        torch.testing.assert_close(_run(model, inputs), expected, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


# =========================================================================== projection fusion


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


# Inductor evaluates norms and modulation in its own fused order, so a quantized value may
# cross a rounding boundary now and then (one step of one element ~3e-4 relative L2 at these
# sizes); measured 6e-8 (INT8) and 0 (FP8). Far below the quantization error (MODEL_TOLERANCE).
COMPILED_VS_EAGER = 2e-3


def _quantize_ops_traced(model, inputs):
    """omni quantization custom ops in the Dynamo graphs of the compiled blocks, and the output."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(backend=record, fullgraph=True)
    try:
        out = _run(model, inputs)
    finally:
        torch._dynamo.reset()
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block._compiled_call_impl = None
    ops = [str(n.target) for g in graphs for n in g.graph.nodes
           if n.op == "call_function" and "omni_kernels" in str(n.target) and "quantize" in str(n.target)]
    return graphs, ops, out


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_compiled_fused_blocks_trace_no_quantize_op_and_match_eager(method):
    """Regional compile of fused, quantized Flux blocks with the default activation backend:
    no omni quantization op in the traced graphs (the quantization is torch ops Inductor fuses
    into the producing kernel), the traced graphs give eager's output, and so does Inductor."""
    model, inputs = _tiny_flux()
    quantize(model, QuantConfig(method=method, backend="aten", fuse_activations=False))
    eager = _run(model, inputs)
    graphs, ops, traced = _quantize_ops_traced(model, inputs)
    assert len(graphs) == 2 and ops == []
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(backend="inductor", fullgraph=True)
    try:
        compiled = _run(model, inputs)
    finally:
        torch._dynamo.reset()
    assert _rel(compiled, eager) <= COMPILED_VS_EAGER


@pytest.mark.skipif(not quant_dispatch.triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
def test_compiled_blocks_with_a_kernel_backend_trace_its_op():
    """The graph check can fail: an explicit kernel backend shows up as omni's op, once per
    quantized input (the fused q/k/v count once)."""
    model, inputs = _tiny_flux()
    quantize(model, QuantConfig(method="int8", backend="aten", activation_backend="triton", fuse_activations=False))
    block_layers = [n for n in quantized_layers(model) if "transformer_blocks" in n]
    _, ops, _ = _quantize_ops_traced(model, inputs)
    assert len(ops) == len(block_layers) and set(ops) == {"omni_kernels.quantize_per_token_triton"}


def test_split_activation_backend_config_reaches_the_layers():
    config = QuantConfig(method="int8", activation_backend="split", split_k=40)
    assert QuantConfig.from_dict(config.to_dict()) == config
    assert QuantConfig(activation_backend="split").split_k is None  # the layers' default, 8192
    model, _ = _tiny_flux()
    quantize(model, config)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.activation_backend == "split" and m.split_k == 40 for m in layers)
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8", activation_backend="split"))
    assert {m.split_k for m in model.modules() if isinstance(m, QuantizedLinear)} == {8192}


@pytest.mark.skipif(not quant_dispatch.triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("split_k", [40, 128])
def test_compiled_blocks_with_split_activation_backend_trace_the_op_for_wide_inputs_only(split_k):
    """activation_backend="split" under compile: omni's op once per block layer wider than
    split_k (split_k=128: the single block's proj_out, whose input is cat(attention, GELU(mlp)),
    K=160; 40: also the two MLP down projections, K=128), torch ops for the rest. On CPU the
    op is the Triton kernel under the interpreter (the CUDA kernel needs CUDA tensors; on a GPU
    it would be the CUDA op). The traced blocks give eager's output, where every layer runs the
    kernel."""
    model, inputs = _tiny_flux()
    quantize(model, QuantConfig(method="int8", backend="aten", activation_backend="split", split_k=split_k,
                                fuse_activations=False))
    wide = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)
            and "transformer_blocks" in n and m.in_features > split_k]
    assert wide and ("single_transformer_blocks.0.proj_out" in wide)
    eager = _run(model, inputs)
    _, ops, traced = _quantize_ops_traced(model, inputs)
    assert ops == ["omni_kernels.quantize_per_token_triton"] * len(wide)
    assert _rel(traced, eager) <= COMPILED_VS_EAGER


# =========================================================================== GELU folding


def _tiny_hunyuan_video():
    from omni_diffusion.testing import tiny_transformer

    return tiny_transformer("hunyuan_video")


FOLD_MODELS = {**TINY_MODELS, "hunyuan_video": _tiny_hunyuan_video}


def _expected_folds(model):
    """{consumer: (activation, activation_from)} the adapters declare, read off the model."""
    expected = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind == "FeedForward" and getattr(module.net[0], "approximate", None) == "tanh":
            expected[f"{name}.net.2"] = (f"{name}.net.0", 0)
        elif kind in ("FluxSingleTransformerBlock", "HunyuanVideoSingleTransformerBlock"):
            expected[f"{name}.proj_out"] = (f"{name}.act_mlp", module.proj_out.in_features - module.proj_mlp.out_features)
    return expected


@pytest.mark.parametrize("family", sorted(FOLD_MODELS))
def test_gelus_folded_into_their_consumers(family):
    """W8A8 quantization folds every MLP GELU the adapter declares into the layer reading it:
    the GELU module goes (diffusers' GELU keeps its proj), the consumer applies the GELU in its
    quantization. With the torch backend the numbers are those of the unfolded model exactly
    (the same float32 ops); with the Triton kernel (interpreter) within INT8 rounding."""
    model, inputs = FOLD_MODELS[family]()
    unfolded = copy.deepcopy(model)
    expected = _expected_folds(model)
    assert expected, f"{family}: the tiny model has no tanh-GELU MLP"
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    quantize(unfolded, QuantConfig(method="int8", fuse_activations=False, **CPU_OPTIONS))
    assert Q.fused_activations(unfolded) == {}
    folded = Q.fused_activations(model)
    assert {c: (e["activation"], e["activation_from"]) for c, e in folded.items()} == expected
    for consumer, (activation, activation_from) in expected.items():
        layer = model.get_submodule(consumer)
        assert layer.input_activation == "gelu_tanh" and layer.activation_from == activation_from
        gone = model.get_submodule(activation)
        assert isinstance(gone, (nn.Identity, Q.GELUProjection)), type(gone)
        if isinstance(gone, Q.GELUProjection):
            assert isinstance(gone.proj, QuantizedLinear)  # the projection itself is still quantized
    assert torch.equal(_run(model, inputs), _run(unfolded, inputs))
    if quant_dispatch.triton_interpreter_enabled():
        for layer in model.modules():
            if isinstance(layer, QuantizedLinear):
                layer.activation_backend = "triton"
        assert _rel(_run(model, inputs), _run(unfolded, inputs)) <= 1e-2


@pytest.mark.parametrize("family", ["flux", "hunyuan_video"])
def test_single_blocks_read_attention_and_mlp_apart(family, monkeypatch):
    """The adapters' concat-free single-block forward: installed on every single block whose
    GELU is folded, it hands proj_out the attention output and the MLP input apart (no cat of
    the two is built on the kernel path), with the class forward's numbers exactly; removed,
    the class forward is back."""
    model, inputs = FOLD_MODELS[family]()
    # fuse_norms=False: Flux's norm-fused single-block forward (which does the same) would take its place
    quantize(model, QuantConfig(method="int8", fuse_norms=False, **CPU_OPTIONS))
    singles = [m for m in model.modules() if type(m).__name__.endswith("SingleTransformerBlock")]
    assert singles and all("forward" in m.__dict__ for m in singles)
    assert all(type(m).__name__ != type(singles[0]).__name__ or "forward" not in m.__dict__
               for m in model.modules() if m not in singles)
    calls = []
    for block in singles:
        original = block.proj_out.forward_concat
        monkeypatch.setattr(block.proj_out, "forward_concat",
                            lambda head, tail, _f=original: calls.append(head.shape[-1]) or _f(head, tail))
    installed = _run(model, inputs)
    assert calls == [block.proj_out.activation_from for block in singles]
    Q.remove_concat_free_forwards(model)
    assert not any("forward" in m.__dict__ for m in singles)
    assert torch.equal(installed, _run(model, inputs))
    if quant_dispatch.triton_interpreter_enabled():  # the two-input kernel against the kernel on the cat
        for layer in model.modules():
            if isinstance(layer, QuantizedLinear):
                layer.activation_backend = "triton"
        with_cat = _run(model, inputs)
        Q.install_concat_free_forwards(model, None)  # no adapter: nothing installed
        assert not any("forward" in m.__dict__ for m in singles)
        from omni_diffusion.adapters import adapter_for_transformer

        assert len(Q.install_concat_free_forwards(model, adapter_for_transformer(model))) == len(singles)
        assert torch.equal(_run(model, inputs), with_cat)


def test_concat_free_forward_left_out_where_it_does_not_fit():
    """No fold (weight-only), a block with an instance forward of its own, or a block class
    whose forward takes other parameters keeps its forward."""
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8_weight_only", **CPU_OPTIONS))
    assert not any("forward" in m.__dict__ for m in model.single_transformer_blocks)
    model, _ = _tiny_hunyuan_video()
    first, second = model.single_transformer_blocks
    own = first.forward
    first.forward = own
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    assert first.__dict__["forward"] is own and "forward" in second.__dict__

    class OtherSingleBlock(type(second)):
        def forward(self, hidden_states, temb, image_rotary_emb=None):
            raise AssertionError("not called")

    model, _ = _tiny_hunyuan_video()
    first, second = model.single_transformer_blocks
    second.__class__ = OtherSingleBlock
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    assert "forward" in first.__dict__ and "forward" not in second.__dict__


def test_fold_needs_a_w8a8_consumer_and_a_tanh_gelu():
    """Weight-only methods fold nothing (no activation quantization to fuse into); a consumer
    kept in full precision or an exact (erf) GELU is left as it is."""
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8_weight_only", **CPU_OPTIONS))
    assert Q.fused_activations(model) == {}
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8", skip=("transformer_blocks.0.ff.net.2",), **CPU_OPTIONS))
    folded = Q.fused_activations(model)
    assert "transformer_blocks.0.ff.net.2" not in folded and "transformer_blocks.0.ff_context.net.2" in folded
    assert type(model.transformer_blocks[0].ff.net[0]).__name__ == "GELU"
    model, _ = _tiny_flux()
    model.single_transformer_blocks[0].act_mlp = nn.GELU()  # exact GELU: the kernel's is tanh
    quantize(model, QuantConfig(method="int8", **CPU_OPTIONS))
    assert "single_transformer_blocks.0.proj_out" not in Q.fused_activations(model)


@pytest.mark.parametrize("fields,match", [
    (dict(method="int8_weight_only", fuse_activations=True), "needs a W8A8 method"),
    (dict(fuse_activations="yes"), "fuse_activations must be True, False or None"),
])
def test_fuse_activations_config_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**fields)
    assert QuantConfig(activation_backend="cuda").fuses_activations is True  # csrc/quant has a GELU kernel
    assert QuantConfig().fuses_activations and not QuantConfig(method="fp8_weight_only").fuses_activations


# =========================================================================== save / load


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


# =========================================================================== GPU


def _flux_transformer_cuda(dtype=torch.bfloat16):
    """FluxTransformer2DModel at its default (Flux.1) widths, random weights, built on the GPU."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel()
    model = model.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):  # nn.Linear's default init range
                bound = module.in_features ** -0.5
                module.weight.uniform_(-bound, bound, generator=gen)
                if module.bias is not None:
                    module.bias.uniform_(-bound, bound, generator=gen)
        for name, param in model.named_parameters():
            owner = model.get_submodule(name.rpartition(".")[0])
            if not isinstance(owner, nn.Linear):  # norm weights 1, biases 0
                param.fill_(1.0 if name.endswith("weight") else 0.0)
    return model.to(dtype).eval()


def _flux_inputs(seed=1, height=64, width=64, text=512):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.arange(height, device="cuda").repeat_interleave(width)
    cols = torch.arange(width, device="cuda").repeat(height)
    img_ids = torch.stack((torch.zeros_like(rows), rows, cols), dim=-1).float()
    return dict(
        hidden_states=torch.randn(1, height * width, 64, device="cuda", generator=gen, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text, 4096, device="cuda", generator=gen, dtype=torch.bfloat16),
        pooled_projections=torch.randn(1, 768, device="cuda", generator=gen, dtype=torch.bfloat16),
        timestep=torch.tensor([0.5], device="cuda", dtype=torch.bfloat16),
        img_ids=img_ids,
        txt_ids=torch.zeros(text, 3, device="cuda"),
        return_dict=False,
    )


# The layers kept in bf16 for the Flux-shaped check: the input/conditioning embedders and the
# output projection (tiny share of the FLOPs, where an error reaches the output unattenuated).
FLUX_SKIP = ("x_embedder", "context_embedder", "time_text_embed", "norm_out", "proj_out")


def _model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


# Relative L2 bound of the quantized step against the bf16 step: 3% for FP8 is the issue's
# bound. INT8 W8A8 is more sensitive to activation outlier channels (the step of a token is set
# by its largest channel); the random-weight model has few, and INT8 came out below FP8 on CPU
# at Flux widths (2 + 4 blocks, 256 + 64 tokens: FP8 0.34%, INT8 0.12% against float32), so the
# same bound applies, as a check rather than a target.
STEP_TOLERANCE = {"fp8": 0.03, "int8": 0.03}


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_gpu_flux_transformer_step_error_and_memory(method):
    """Flux.1 widths (19 double + 38 single blocks, 3072 wide, 11.9B random bf16 weights) at
    1024^2 (4096 image + 512 text tokens): the quantized step within 3% relative L2 of the bf16
    step (the figure is printed), the quantized model <= 55% of the bf16 model's bytes."""
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    torch.cuda.empty_cache()
    model = _flux_transformer_cuda()
    inputs = _flux_inputs()
    bf16_bytes = _model_bytes(model)
    with torch.no_grad():
        ref = model(**inputs)[0].float()
    quantize(model, QuantConfig(method=method, skip=FLUX_SKIP))
    quant_bytes = _model_bytes(model)
    with torch.no_grad():
        out = model(**inputs)[0].float()
    err = _rel(out, ref)
    print(f"Flux-shaped transformer, {method} W8A8 vs bf16: relative L2 error {err:.4f}; "
          f"model {quant_bytes / 2**30:.2f} GiB vs {bf16_bytes / 2**30:.2f} GiB "
          f"({quant_bytes / bf16_bytes:.1%})")
    assert torch.isfinite(out).all()
    assert err <= STEP_TOLERANCE[method]
    assert quant_bytes <= 0.55 * bf16_bytes
    del model
    torch.cuda.empty_cache()
