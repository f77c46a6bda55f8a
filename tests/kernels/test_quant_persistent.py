"""Persistent launches of the per-row quantization kernels (``programs=``, a tuning option of
:func:`omni_kernels.quant.triton_kernel.launch_quantize_per_token_triton` and
:func:`omni_kernels.quant.activated_triton_kernel.launch_quantize_activated_triton`).

Fewer programs than rows, each walking its rows with a stride and loading the next row while it
quantizes the current one: only the schedule changes, every row goes through the one-row
kernel's arithmetic, so codes and scales must be bit-identical to the default launch's. Row
counts that are not multiples of the program count leave programs with one row fewer; more
programs than rows are clamped.

CPU (CI): Triton's interpreter, float32/float16 in, INT8 out; outputs are allocated filled with
0xFF bytes, so a row the kernel fails to write shows up. GPU (``-m gpu``): bfloat16 -> FP8/INT8
at Flux's widths, with the program counts bench/quant_activation_tune.py and
bench/quant_per_token.py time.
"""

from __future__ import annotations

import pytest
import torch

from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import FP8_DTYPE
from omni_kernels.quant.activated_triton_kernel import launch_quantize_activated_triton
from omni_kernels.quant.triton_kernel import launch_quantize_per_token_triton

needs_interpreter_or_gpu = pytest.mark.skipif(
    not (triton_interpreter_enabled() or torch.cuda.is_available()),
    reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1",
)


@pytest.fixture(autouse=True)
def _outputs_poisoned(poisoned_outputs):
    """Every tensor the kernels allocate here starts as 0xFF bytes (see conftest)."""
    with poisoned_outputs():
        yield


def _same_bits(result, expected):
    (q, scale), (q_exp, scale_exp) = result, expected
    assert torch.isfinite(scale).all(), "a row's scale was not written (NaN)"
    assert q.shape == q_exp.shape and scale.shape == scale_exp.shape
    assert torch.equal(scale, scale_exp)
    assert torch.equal(q.view(torch.uint8), q_exp.view(torch.uint8))


def _device_and_dtype(dtype):
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16 if dtype == torch.float16 else dtype
    return "cpu", dtype


def _per_token(x, out_dtype=torch.int8, *, fused=None, prefix=None, batch=1, **tuning):
    """Per-token launch; ``fused`` = (norm weight, mod scale, mod shift) for LayerNorm + adaLN."""
    weight, scale, shift = fused if fused is not None else (None, None, None)
    return launch_quantize_per_token_triton(
            x, weight, None, scale, shift, 2 if fused is not None else 0, 1e-6, 6.0 if fused else 0.0,
            out_dtype, prefix=prefix, batch=batch, **tuning)


def _adaln_tables(inputs, groups, k, device):
    tables = inputs.activations((groups, 2 * k), torch.float32, device, outlier_channels=0)
    shift, scale = tables.chunk(2, dim=-1)
    return inputs.activations((k,), torch.float32, device, outlier_channels=0), scale, shift


# ============================================================================ CPU (interpreter) or GPU


@needs_interpreter_or_gpu
@pytest.mark.parametrize("programs", [1, 3, 8, 64])
@pytest.mark.parametrize("k", [40, 200])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "layernorm-adaln"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_per_token_persistent_matches_the_default_launch(inputs, dtype, fused, k, programs):
    """39 rows in 3 modulation groups: 3 and 8 programs leave some a row fewer; 64 > rows."""
    device, dtype = _device_and_dtype(dtype)
    x = inputs.activations((39, k), dtype, device)
    tables = _adaln_tables(inputs, 3, k, device) if fused else None
    _same_bits(_per_token(x, fused=tables, programs=programs), _per_token(x, fused=tables))


@needs_interpreter_or_gpu
@pytest.mark.parametrize("programs", [2, 5])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "layernorm-adaln"])
def test_per_token_persistent_reads_the_prefix_in_place(inputs, fused, programs):
    """A joint sequence held as two tensors: a program's rows cross from prefix to x and from
    one sample to the next; same rows as the default launch of the prefix form."""
    device, dtype = _device_and_dtype(torch.float16)
    batch, p, s, k = 2, 3, 8, 72
    x = inputs.activations((batch * s, k), dtype, device)
    prefix = inputs.activations((batch * p, k), dtype, device)
    tables = _adaln_tables(inputs, batch, k, device) if fused else None
    expected = _per_token(x, fused=tables, prefix=prefix, batch=batch)
    _same_bits(_per_token(x, fused=tables, prefix=prefix, batch=batch, programs=programs), expected)


@needs_interpreter_or_gpu
@pytest.mark.parametrize("programs", [1, 4, 50])
@pytest.mark.parametrize("prefix_width,width", [(0, 96), (0, 200), (24, 200), (40, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_activated_persistent_matches_the_default_launch(inputs, dtype, prefix_width, width, programs):
    """GELU-folded quantization, with and without the prefix (the attention half of Flux's
    ``proj_out`` input), a clamp; 37 rows."""
    device, dtype = _device_and_dtype(dtype)
    x = inputs.activations((37, width), dtype, device)
    prefix = inputs.activations((37, prefix_width), dtype, device) if prefix_width else None

    def launch(**tuning):
        return launch_quantize_activated_triton(x, 0, 8.0, torch.int8, prefix=prefix, **tuning)

    _same_bits(launch(programs=programs), launch())


# ============================================================================ CPU: arguments


@pytest.mark.parametrize("programs,match", [
    (0, "programs must be None or a positive int"),
    (True, "programs must be None or a positive int"),
    (2.0, "programs must be None or a positive int"),
])
def test_bad_programs_raise_value_error(programs, match):
    with pytest.raises(ValueError, match=match):
        launch_quantize_per_token_triton(torch.ones(4, 40), None, None, None, None, 0, 1e-6, 0.0,
                                         torch.int8, programs=programs)
    with pytest.raises(ValueError, match=match):
        launch_quantize_activated_triton(torch.ones(4, 40), 0, 0.0, torch.int8, programs=programs)


def test_persistent_launch_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="rows_per_program=2"):
        launch_quantize_per_token_triton(torch.ones(4, 40), None, None, None, None, 0, 1e-6, 0.0,
                                         torch.int8, programs=2, rows_per_program=2)
    with pytest.raises(ValueError, match="one register tile"):
        launch_quantize_per_token_triton(torch.ones(4, 40), None, None, None, None, 0, 1e-6, 0.0,
                                         torch.int8, programs=2, max_tile=32)
    with pytest.raises(ValueError, match="one register tile"):
        launch_quantize_activated_triton(torch.ones(4, 40), 0, 0.0, torch.int8, programs=2, max_tile=32)
    with pytest.raises(ValueError, match="recompute_activation=False"):
        launch_quantize_activated_triton(torch.ones(4, 40), 0, 0.0, torch.int8, programs=2,
                                         recompute_activation=True)


# ============================================================================ GPU: Flux's widths, bf16


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [FP8_DTYPE, torch.int8], ids=["fp8", "int8"])
def test_gpu_flux_widths_persistent_match_the_default(inputs, out_dtype):
    """bfloat16: the single blocks' ``proj_out`` input (4608 x (3072 + 12288), prefix form), the
    MLP down projection's (4096 x 12288), and the per-token LayerNorm + adaLN input (4608 x 3072),
    at the program counts the benchmarks time (1 to 8 per SM) and 4/8/16 warps."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mlp = inputs.activations((4608, 12288), torch.bfloat16, "cuda")
    attn = inputs.activations((4608, 3072), torch.bfloat16, "cuda")
    for x, prefix in ((mlp, attn), (mlp[:4096], None)):
        expected = launch_quantize_activated_triton(x, 0, 0.0, out_dtype, prefix=prefix)
        for per_sm in (1, 2, 4, 8):
            for warps in (8, 16):
                got = launch_quantize_activated_triton(x, 0, 0.0, out_dtype, prefix=prefix, programs=per_sm * sms,
                                                       num_warps=warps)
                _same_bits(got, expected)
    tables = _adaln_tables(inputs, 1, 3072, "cuda")
    for fused in (None, tables):
        expected = _per_token(attn, out_dtype, fused=fused)
        for per_sm in (1, 2, 4, 8):
            for warps in (4, 8):
                got = _per_token(attn, out_dtype, fused=fused, programs=per_sm * sms, num_warps=warps)
                if fused is None:
                    _same_bits(got, expected)
                else:  # LayerNorm sums: another warp count may reduce in another order
                    assert torch.allclose(got[1], expected[1], rtol=1e-5, atol=0)
                    assert (got[0].float() != expected[0].float()).double().mean().item() <= 0.01
