"""What the per-token activation quantization tests share: the Triton skip, the comparison of
codes and scales with the reference's, the poisoned CUDA allocator, the GPU skips and
opcheck's utilities.

pytest puts this folder on ``sys.path`` for the test modules in it (it has no ``__init__.py``),
so they import this module by its name.
"""

from __future__ import annotations

import os

import pytest
import torch

from omni_kernels import has_compiled_extension
from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import FP8_DTYPE


needs_interpreter_or_gpu = pytest.mark.skipif(
    not (triton_interpreter_enabled() or torch.cuda.is_available()),
    reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1",
)


def _assert_same_quantization(q, scale, q_ref, scale_ref, *, max_code_diff=0, max_diff_fraction=0.0,
                              scale_rtol=0.0):
    """``scale`` within ``scale_rtol`` of the reference; ``q`` equal, or (for fused norms,
    whose float32 sums run in another order) off by at most ``max_code_diff`` quantization
    steps in at most ``max_diff_fraction`` of the elements."""
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype
    assert scale.shape == scale_ref.shape and scale.dtype == torch.float32
    assert torch.isfinite(scale).all() and (scale > 0).all()
    rel = ((scale.double() - scale_ref.double()).abs() / scale_ref.double()).max().item()
    assert rel <= scale_rtol, f"scale relative difference {rel:.3e} > {scale_rtol:.1e}"
    if q.dtype == FP8_DTYPE:
        assert not torch.isnan(q.float()).any(), "NaN in the FP8 output (unwritten or overflow)"
        # Distance in e4m3 steps: the spacing at |b| is 2**(floor(log2|b|) - 3), at least 2**-9.
        a, b = q.double(), q_ref.double()
        # frexp, not floor(log2): CUDA's log2 of an exact power of two can land just below it.
        exponent = torch.frexp(b.abs().clamp_min(2.0**-6)).exponent.double() - 1
        codes = (a - b).abs() / torch.pow(2.0, exponent - 3)
    else:
        codes = (q.int() - q_ref.int()).abs().double()
    worst = codes.max().item()
    if worst > max_code_diff + 1e-9:
        at = int(codes.argmax().item())
        row = at // q.shape[-1]
        raise AssertionError(
            f"quantized values differ by up to {worst} steps: at flat index {at} (row {row}) "
            f"{q.reshape(-1)[at].item()} vs reference {q_ref.reshape(-1)[at].item()}, row scale "
            f"{scale.reshape(-1)[row].item():.9e} vs {scale_ref.reshape(-1)[row].item():.9e}; "
            f"{int((codes > max_code_diff + 1e-9).sum().item())} such values"
        )
    fraction = (codes > 0).double().mean().item()
    assert fraction <= max_diff_fraction, f"{fraction:.2e} of the values differ (allowed {max_diff_fraction:.1e})"


def _poison_cuda_allocator(nbytes: int) -> None:
    """Fill freed blocks of the caching allocator with 0xFF so unwritten outputs are NaN/-1."""
    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block.fill_(0xFF)
    del block


def _require_cuda_extension():
    if not has_compiled_extension():
        from omni_kernels._extension import compiled_extension_error

        message = f"backend='cuda' needs the compiled extension: {compiled_extension_error()}"
        if os.environ.get("OMNI_REQUIRE_CUDA_EXT", "0") not in ("", "0"):
            pytest.fail(message + " (OMNI_REQUIRE_CUDA_EXT=1 makes this a failure)")
        pytest.skip(message)


def _require_fp8(qdtype):
    if qdtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")


OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
