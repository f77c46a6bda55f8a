"""What the quantized attention tests share: input shapes, float32 attention, error measures,
a bitwise comparison and the skip for the Hopper CUDA kernel.

pytest puts this folder on ``sys.path`` for the test modules in it (it has no ``__init__.py``),
so they import this module by its name.
"""

from __future__ import annotations

import math

import pytest
import torch

from omni_kernels.attention.quantized.attention_kernel import cuda_sm90_unsupported_reason


def _shape(layout, b, h, s, d):
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


def _exact(q, k, v, scale=None):
    """float32 attention, ``[B, H, S, D]`` inputs (GQA expanded)."""
    q, k, v = (t.float() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v


def _row_cosine(out, ref):
    return torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=-1).mean().item()


def _assert_same_bytes(got: torch.Tensor, ref: torch.Tensor, name: str):
    """Bitwise equality (so -0.0 vs +0.0 counts), naming the first mismatch:
    index, both bit patterns and values, and how many differ."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{name}: {got.shape} {got.dtype} vs {ref.shape} {ref.dtype}"
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    gb, rb = got.view(bits), ref.view(bits)
    bad = (gb != rb).nonzero()
    if len(bad):
        i = tuple(bad[0].tolist())
        width = 2 * got.element_size()
        raise AssertionError(
            f"{name}: {len(bad)} of {gb.numel()} elements differ bitwise; first at {i}: "
            f"got 0x{gb[i].item() & (2 ** (4 * width) - 1):0{width}x} ({got[i].float().item()!r}), "
            f"reference 0x{rb[i].item() & (2 ** (4 * width) - 1):0{width}x} ({ref[i].float().item()!r})"
        )


CHECK_HEADS = 2


CHECK_QUERIES = 2048


def _subset_errors(out, q, k, v):
    """(row cosine, rel L2) of out's first heads / queries against float32."""
    qs = q[:, :CHECK_HEADS, :CHECK_QUERIES]
    exact = torch.cat([
        _exact(qs[:, :, i:i + 512], k[:, :CHECK_HEADS], v[:, :CHECK_HEADS])
        for i in range(0, qs.shape[2], 512)
    ], dim=2)
    o = out[:, :CHECK_HEADS, :CHECK_QUERIES].float()
    return _row_cosine(o, exact), ((o - exact).norm() / exact.norm()).item()


def _skip_without_cuda_sm90():
    reason = cuda_sm90_unsupported_reason(torch.device("cuda"), 128, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
