"""Tests of :func:`omni_diffusion.quantization.quantize`'s module swap.

CPU part (CI): the swap on tiny diffusers transformers (Flux, SD3, Wan 2.1, Qwen-Image) in
float32, whose output stays within a stated tolerance of the unquantized model; weight-only
methods, auto backends, skipped layers left untouched.

GPU part (``-m gpu``): a Flux-shaped full transformer (Flux.1 widths, random bf16 weights,
1024^2: 4096 image + 512 text tokens) whose FP8 step is within 3% relative L2 of its bf16 step,
and whose quantized weights take <= 55% of the bf16 model's memory.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

from omni_diffusion.testing import full_size_flux_inputs, full_size_flux_transformer  # noqa: E402
from omni_diffusion.quantization import (  # noqa: E402
    QuantConfig,
    fused_attention,
    quantize,
    quantized_layers,
)

from quantization_cases import (  # noqa: E402
    CPU_OPTIONS,
    FUSED_ATTENTION,
    MODEL_TOLERANCE,
    TINY_MODELS,
    _TRIPLES,
    _linears,
    _rel,
    _run,
    _tiny_flux,
    _tiny_sd3,
    _tiny_wan,
)


def _after_fusion(names, fused):
    """Linear layer names once the attention modules ``fused`` have their triples fused."""
    out = set(names)
    for attn in fused:
        for fused_name, members in _TRIPLES.items():
            triple = {f"{attn}.{m}" for m in members}
            if triple <= out:
                out = (out - triple) | {f"{attn}.{fused_name}"}
    return out


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


# =========================================================================== GPU


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
    model = full_size_flux_transformer()
    inputs = full_size_flux_inputs()
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
