"""Tests of per-layer quantization methods: :attr:`omni_diffusion.quantization.QuantConfig.layer_methods`.

CPU part (CI): validation (each bad value named with the field and what is allowed), dict and
pair forms, ``to_dict``/``from_dict`` through JSON; first matching pattern wins, parents
match; a pattern matching no linear layer raises at :func:`quantize` and swaps nothing; a tiny
Flux transformer with its adaLN modulation linears INT8/FP8 weight-only and the rest FP8
W8A8 (torch's CPU kernels) stays within tolerance of the unquantized model, its modulation
linears run the Triton GEMV (interpreter) with the aten path's result, and each layer's
method survives save/load (a config disagreeing with the file is refused, naming the layer);
q/k/v triples are fused only when their methods agree; the FP8 hardware check names the
``layer_methods`` entry that asked for FP8.

GPU part (``-m gpu``): the same tiny Flux in bfloat16 on CUDA with ``backend="auto"``: the
modulation linears (one row per sample) run the GEMV.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

import omni_diffusion.quantization.plan as quant_plan  # noqa: E402
from omni_diffusion import quantization as Q  # noqa: E402
from omni_diffusion.quantization import (  # noqa: E402
    QuantConfig,
    fused_attention,
    load_quantized,
    plan_quantization,
    quantize,
    quantized_layers,
    save_quantized,
)
from omni_diffusion.testing import tiny_flux_transformer  # noqa: E402
from omni_kernels._triton import triton_interpreter_enabled  # noqa: E402
from omni_kernels.quant import QUANT_METHODS, QuantizedLinear  # noqa: E402

CPU_OPTIONS = dict(backend="aten", activation_backend="torch")
# Flux's adaLN modulation linears (one input row per sample).
MODULATION = {
    "*.norm1.linear": "int8_weight_only",
    "*.norm1_context.linear": "int8_weight_only",
    "single_transformer_blocks.*.norm.linear": "fp8_weight_only",
}
# Relative L2 error of the tiny Flux against its unquantized float32 output: FP8 W8A8 everywhere
# measured up to 5% on the tiny families (tests/diffusion/test_quantization_swap.py allows 10%);
# weight-only modulation linears only lower it.
MODEL_TOLERANCE = 0.10


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def _expected_method(name: str) -> str:
    last = name.split(".")
    if last[-2:] in (["norm1", "linear"], ["norm1_context", "linear"]):
        return "int8_weight_only"
    if name.startswith("single_transformer_blocks.") and last[-2:] == ["norm", "linear"]:
        return "fp8_weight_only"
    return "fp8"


# =========================================================================== config


def test_layer_methods_forms_and_round_trip():
    config = QuantConfig(method="fp8", layer_methods=MODULATION)
    assert config.layer_methods == tuple(MODULATION.items())
    assert QuantConfig(layer_methods=[["a", "int8"], ("b", "fp8_weight_only")]).layer_methods == (
        ("a", "int8"), ("b", "fp8_weight_only"))
    assert QuantConfig().layer_methods == ()
    through_json = QuantConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert through_json == config and hash(through_json) == hash(config)
    assert QuantConfig.from_dict({"method": "int8", "layer_methods": {"x": "fp8"}}).layer_methods == (("x", "fp8"),)


def test_method_for_first_match_wins_and_parents_match():
    config = QuantConfig(method="fp8", layer_methods=[
        ("transformer_blocks.0.norm1.linear", "int8"),
        ("*.norm1*", "int8_weight_only"),
        ("transformer_blocks.0", "fp8_weight_only"),
    ])
    assert config.method_for("transformer_blocks.0.norm1.linear") == "int8"  # first pattern
    assert config.method_for("transformer_blocks.3.norm1_context.linear") == "int8_weight_only"
    assert config.method_for("transformer_blocks.0.ff.net.2") == "fp8_weight_only"  # a parent matches
    assert config.method_for("transformer_blocks.10.ff.net.2") == "fp8"  # "transformer_blocks.0" is not a prefix match
    assert config.method_for("proj_out") == "fp8"


BAD_LAYER_METHODS = [
    ("unknown-method", {"*.norm1.linear": "int4"},
     r"QuantConfig\.layer_methods\['\*\.norm1\.linear'\] must be one of "
     + r"\('fp8', 'int8', 'fp8_weight_only', 'int8_weight_only'\); got 'int4'"),
    ("string", "*.norm1.linear=int8",
     r"QuantConfig\.layer_methods must be a dict \{pattern: method\} or a list of \(pattern, method\) pairs"),
    ("not-a-pair", [("*.norm1.linear",)], r"QuantConfig\.layer_methods entries must be \(pattern, method\) pairs; got"),
    ("bare-string-entry", ["*.norm1.linear"], r"QuantConfig\.layer_methods entries must be \(pattern, method\) pairs"),
    ("empty-pattern", {"": "int8"}, r"QuantConfig\.layer_methods patterns must be non-empty strings; got ''"),
    ("method-none", [("a", None)], r"QuantConfig\.layer_methods\['a'\] must be one of .*; got None"),
]


@pytest.mark.parametrize("value,match", [pytest.param(v, m, id=i) for i, v, m in BAD_LAYER_METHODS])
def test_bad_layer_methods_raise_naming_the_field(value, match):
    assert QUANT_METHODS == ("fp8", "int8", "fp8_weight_only", "int8_weight_only")
    with pytest.raises(ValueError, match=match):
        QuantConfig(layer_methods=value)
    with pytest.raises(ValueError, match=match):
        QuantConfig.from_dict({"layer_methods": value})


def test_layer_methods_pattern_matching_no_linear_raises():
    model, _ = tiny_flux_transformer()
    with pytest.raises(ValueError, match=r"QuantConfig\.layer_methods pattern\(s\) \['\*\.norm2\.linear'\] "
                                         r"match no linear layer of FluxTransformer2DModel"):
        quantize(model, QuantConfig(layer_methods={"*.norm1.linear": "int8", "*.norm2.linear": "int8"}))
    # A module that exists but holds no linear layer is no match either.
    with pytest.raises(ValueError, match=r"\['\*\.attn\.norm_q'\] match no linear layer"):
        quantize(model, QuantConfig(layer_methods={"*.attn.norm_q": "int8"}))
    assert not quantized_layers(model)


def test_plan_carries_each_layers_method():
    model, _ = tiny_flux_transformer()
    config = QuantConfig(method="fp8", layer_methods=MODULATION, skip=("proj_out",))
    plans = {p.name: p for p in plan_quantization(model, config)}
    for name, plan in plans.items():
        if plan.action == "quantize":
            assert plan.method == _expected_method(name), name
        else:
            assert plan.method is None
    assert plans["transformer_blocks.0.norm1.linear"].method == "int8_weight_only"
    assert plans["proj_out"].action == "keep"


# =========================================================================== tiny Flux


def test_tiny_flux_with_weight_only_modulation(tmp_path):
    model, inputs = tiny_flux_transformer()
    ref = _run(model, inputs)
    config = QuantConfig(method="fp8", layer_methods=MODULATION, **CPU_OPTIONS)
    quantize(model, config)
    layers = quantized_layers(model)
    assert layers["transformer_blocks.0.norm1.linear"] == "int8_weight_only"
    assert layers["transformer_blocks.0.norm1_context.linear"] == "int8_weight_only"
    assert layers["single_transformer_blocks.0.norm.linear"] == "fp8_weight_only"
    assert layers["transformer_blocks.0.ff.net.2"] == "fp8"
    for name, method in layers.items():
        if not name.endswith(("to_qkv", "to_added_qkv")):
            assert method == _expected_method(name), name
    # The rest is as with one method: q/k/v fused, the GELUs folded into their W8A8 consumers.
    assert fused_attention(model) == ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"]
    assert Q.fused_activations(model)
    out = _run(model, inputs)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err <= MODEL_TOLERANCE, f"relative L2 error {err:.4f}"

    # Every layer's method survives save/load, into a fresh skeleton and with the config.
    path = tmp_path / "mixed.safetensors"
    save_quantized(model, path, config)
    fresh, _ = tiny_flux_transformer()
    load_quantized(fresh, path)
    assert quantized_layers(fresh) == layers
    assert torch.equal(_run(fresh, inputs), out)
    again, _ = tiny_flux_transformer()
    load_quantized(again, path, config)
    assert quantized_layers(again) == layers

    # A config that gives a layer another method than the file's is refused, naming the layer.
    with pytest.raises(ValueError, match=r"QuantConfig \(method='fp8', layer_methods=.*\) does not match .* "
                                         r"for 2 layer\(s\): transformer_blocks\.0\.norm1\.linear: file "
                                         r"'int8_weight_only', config 'fp8'"):
        load_quantized(tiny_flux_transformer()[0], path,
                       QuantConfig(method="fp8", layer_methods={"*.norm1_context.linear": "int8_weight_only"}))
    with pytest.raises(ValueError, match=r"QuantConfig\.method='fp8' does not match .*\['fp8', 'fp8_weight_only', "
                                         r"'int8_weight_only'\]"):
        load_quantized(tiny_flux_transformer()[0], path, QuantConfig(method="fp8"))


@pytest.mark.skipif(not triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
def test_modulation_linears_run_the_gemv_with_the_aten_result(monkeypatch):
    """The modulation linears of the tiny Flux read one row (batch 1): with the GEMV backend
    (under the interpreter) the model gives the aten path's output, and the GEMV ran once per
    modulation linear."""
    from omni_kernels.quant import triton_gemv

    model, inputs = tiny_flux_transformer()
    quantize(model, QuantConfig(method="fp8", layer_methods=MODULATION, **CPU_OPTIONS))
    expected = _run(model, inputs)
    modulation = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.weight_only]
    assert len(modulation) == 3
    for layer in modulation:
        layer.backend = "triton_gemv"
    rows = []
    launch = triton_gemv.launch_weight_only_gemv

    def counting(x, *args, **kwargs):
        rows.append(x.shape[0])
        return launch(x, *args, **kwargs)

    monkeypatch.setattr(triton_gemv, "launch_weight_only_gemv", counting)
    out = _run(model, inputs)
    assert rows == [1, 1, 1]
    assert _rel(out, expected) <= 1e-5


def test_layer_methods_through_accelerate_quant_options(caplog):
    """``AccelConfig.quant_options`` passes ``layer_methods`` on to :func:`quantize`. The Flux
    adapter's skip list keeps the modulation linears in bf16 and wins over ``layer_methods``
    (logged as a warning); undo restores the model."""
    import omni_diffusion as od

    model, inputs = tiny_flux_transformer()
    ref = _run(model, inputs)
    methods = {**MODULATION, "transformer_blocks.*.ff.net.2": "int8_weight_only"}
    with caplog.at_level(logging.WARNING, logger="omni_diffusion.quantization"):
        od.accelerate(model, od.AccelConfig(attention=None, quant="fp8",
                                            quant_options=dict(layer_methods=methods, **CPU_OPTIONS)))
    layers = quantized_layers(model)
    assert layers["transformer_blocks.0.ff.net.2"] == "int8_weight_only"
    assert layers["transformer_blocks.0.ff_context.net.2"] == "fp8"
    assert "transformer_blocks.0.norm1.linear" not in layers  # the adapter's quant_skip
    warnings = [r.getMessage() for r in caplog.records if "changes nothing" in r.getMessage()]
    assert len(warnings) == 3 and "'*.norm1.linear' (int8_weight_only)" in warnings[0]
    assert "matches skip pattern 'transformer_blocks.*.norm1.linear'" in warnings[0]
    assert _rel(_run(model, inputs), ref) <= MODEL_TOLERANCE
    od.undo(model)
    assert not quantized_layers(model)
    assert torch.equal(_run(model, inputs), ref)


def test_fusion_needs_one_method_per_triple():
    model, inputs = tiny_flux_transformer()
    split = QuantConfig(method="fp8", layer_methods={"transformer_blocks.0.attn.to_k": "int8"}, **CPU_OPTIONS)
    quantize(model, split)
    # The double block's image q/k/v disagree: kept separate; its text triple and the single
    # block's attention are fused.
    assert fused_attention(model) == ["single_transformer_blocks.0.attn"]
    assert quantized_layers(model)["transformer_blocks.0.attn.to_k"] == "int8"
    assert quantized_layers(model)["transformer_blocks.0.attn.to_q"] == "fp8"

    whole, _ = tiny_flux_transformer()
    quantize(whole, QuantConfig(method="fp8", layer_methods={"transformer_blocks.0.attn.add_*": "int8_weight_only"},
                                **CPU_OPTIONS))
    # Both triples agree within themselves: fused, each fused layer with its members' method.
    layers = quantized_layers(whole)
    assert fused_attention(whole) == ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"]
    assert layers["transformer_blocks.0.attn.to_qkv"] == "fp8"
    assert layers["transformer_blocks.0.attn.to_added_qkv"] == "int8_weight_only"
    ref_model, _ = tiny_flux_transformer()
    ref = _run(ref_model, inputs)
    assert _rel(_run(whole, inputs), ref) <= MODEL_TOLERANCE


def test_fp8_hardware_check_names_the_layer_methods_entry(monkeypatch):
    monkeypatch.setattr(quant_plan, "fp8_unsupported_reason", lambda device: "FP8 needs FP8 tensor cores (test)")
    model, _ = tiny_flux_transformer()
    with pytest.raises(RuntimeError, match=r"QuantConfig\.layer_methods gives 'transformer_blocks\.0\.norm1\.linear' "
                                           r"'fp8_weight_only': FP8 needs FP8 tensor cores \(test\)"):
        quantize(model, QuantConfig(method="int8", layer_methods={"*.norm1.linear": "fp8_weight_only"}))
    assert not quantized_layers(model)
    quantize(model, QuantConfig(method="int8", layer_methods={"*.norm1.linear": "int8_weight_only"}, **CPU_OPTIONS))
    assert quantized_layers(model)["transformer_blocks.0.norm1.linear"] == "int8_weight_only"


# =========================================================================== GPU


@pytest.mark.gpu
def test_gpu_modulation_linears_take_the_gemv(monkeypatch):
    from omni_kernels.quant import triton_gemv

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    model, inputs = tiny_flux_transformer()
    model = model.to("cuda", torch.bfloat16)
    # activations in bfloat16; the positions (img_ids, txt_ids) stay float32
    inputs = {k: v.to("cuda", torch.bfloat16 if k not in ("img_ids", "txt_ids") else v.dtype)
              if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    ref = _run(model, inputs)
    quantize(model, QuantConfig(method="fp8", layer_methods=MODULATION))
    rows = []
    launch = triton_gemv.launch_weight_only_gemv
    monkeypatch.setattr(triton_gemv, "launch_weight_only_gemv",
                        lambda x, *a, **kw: rows.append(x.shape[0]) or launch(x, *a, **kw))
    out = _run(model, inputs)
    assert rows == [1, 1, 1]
    assert _rel(out.float(), ref.float()) <= MODEL_TOLERANCE
    assert model.transformer_blocks[0].norm1.linear.method == "int8_weight_only"
