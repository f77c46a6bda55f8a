"""Tests of the ``omni_sage`` attention backends in the registry: their declarations, runs
through :func:`attention`, eager launch vs the custom op, clear errors (no FP8 tensor cores,
the sm90 kernel unavailable), and that ``"auto"`` never picks a lossy backend unasked.

GPU part (``-m gpu``): the sm90 backend through :func:`attention` against float32.
"""

from __future__ import annotations

import math

import pytest
import torch

from omni_kernels.attention import attention, get_backend, select_backend
from omni_kernels.attention.quantized.reference import dit_like_qkv, sage_attention_reference

from quantized_attention_cases import _exact, _row_cosine, _skip_without_cuda_sm90


def test_backend_declaration():
    spec = get_backend("omni_sage")
    assert spec.lossy and not spec.causal and spec.key_lengths and spec.lse and spec.gqa
    assert spec.min_capability == (8, 9)
    assert set(spec.layouts) == {"bhsd", "bshd"} and tuple(spec.head_dims) == (64, 128)


def test_backend_runs_through_attention(rel_err):
    gen = torch.Generator().manual_seed(6)
    q, k, v = dit_like_qkv(gen, (1, 2, 48, 64), torch.float32)
    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend="omni_sage",
                    layout="bshd")
    ref = sage_attention_reference(q, k, v, block_n=16)
    assert rel_err(out.transpose(1, 2), ref) <= 1e-5


def test_backend_launches_directly_in_eager_mode_and_through_the_op_otherwise(monkeypatch):
    """Eager calls with plain tensors skip the custom op's dispatch; under a dispatch mode (as
    torch.compile's tracing and fake tensors run) the call goes through the op, with the same result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import omni_kernels.attention.quantized.ops as sage_ops

    calls = []
    real = sage_ops.sage_attention_fwd

    def counting(*args, **kwargs):
        calls.append(args[3])  # the layout
        return real(*args, **kwargs)

    monkeypatch.setattr(sage_ops, "sage_attention_fwd", counting)
    gen = torch.Generator().manual_seed(7)
    q, k, v = dit_like_qkv(gen, (1, 2, 40, 64), torch.float32)
    eager = attention(q, k, v, backend="omni_sage")
    assert calls == []

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        through_op = attention(q, k, v, backend="omni_sage")
    assert calls == ["bhsd"]
    assert torch.equal(through_op, eager)


def test_backend_clear_errors():
    q = torch.randn(1, 2, 16, 64)
    name, reason = select_backend(q, q, q, backend="omni_sage", causal=True)
    assert name is None and "causal" in reason
    x = torch.randn(1, 2, 16, 80)
    name, reason = select_backend(x, x, x, backend="omni_sage")
    assert name is None and "head_dim=80" in reason
    name, reason = select_backend(q.bfloat16(), q.bfloat16(), q.bfloat16(), backend="omni_sage")
    assert name is None and "bfloat16" in reason


def test_sm90_backend_declaration_and_unavailability():
    spec = get_backend("omni_sage_sm90")
    assert spec.lossy and not spec.causal and spec.key_lengths and spec.lse and spec.gqa
    assert spec.min_capability == (9, 0) and tuple(spec.head_dims) == (128,)
    assert spec.devices == ("cuda",)
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in spec.unavailable_reason(None)
    q = torch.randn(1, 2, 16, 128, dtype=torch.float16)
    name, reason = select_backend(q, q, q, backend="omni_sage_sm90")
    assert name is None and reason


def test_auto_never_picks_lossy_unasked():
    q = torch.randn(1, 2, 16, 64)
    name, _ = select_backend(q, q, q, backend="auto", allow_lossy=False)
    assert name != "omni_sage"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to fake its capability")
def test_backend_rejects_gpu_without_fp8(monkeypatch):
    from omni_kernels.attention import spec

    monkeypatch.setattr(spec, "cuda_capability", lambda index: (8, 0))
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.float16)
    name, reason = select_backend(q, q, q, backend="omni_sage")
    assert name is None and "compute capability >= 8.9" in reason


def test_gpu_without_fp8_message(monkeypatch):
    """The kernel's own check names FP8 tensor cores (capability faked: no GPU needed)."""
    from omni_kernels.attention.quantized import attention_kernel

    class FakeCuda:
        is_cuda = True

    q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    # the kernel module's cached lookup, faked (patching torch's query would leave a cached
    # real or fake capability behind for other tests on a GPU machine)
    monkeypatch.setattr(attention_kernel, "cuda_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    reason = attention_kernel.unsupported_reason(q, q, q, "bhsd")
    assert reason is not None and "FP8 tensor cores" in reason and "8.0" in reason


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_sm90_backend_through_attention():
    """The registry backend: bshd, GQA, key lengths and the LSE against float32 attention."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(14)
    q, _, _ = dit_like_qkv(gen, (2, 8, 777, 128), torch.bfloat16, "cuda")
    _, k, v = dit_like_qkv(gen, (2, 2, 1500, 128), torch.bfloat16, "cuda")
    lengths = torch.tensor([1500, 641], device="cuda", dtype=torch.int32)
    out, lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         backend="omni_sage_sm90", layout="bshd", key_lengths=lengths,
                         return_lse=True)
    out = out.transpose(1, 2).float()
    for b, n in enumerate(lengths.tolist()):
        exact = _exact(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        rel = ((out[b:b + 1] - exact).norm() / exact.norm()).item()
        assert rel <= 3e-2 and _row_cosine(out[b:b + 1], exact) >= 0.999, f"sample {b}: rel {rel:.3e}"
        scores = q[b].float() @ k[b, :, :n].float().repeat_interleave(4, 0).transpose(-1, -2)
        exact_lse = torch.logsumexp(scores / math.sqrt(128), dim=-1)
        assert (lse[b] - exact_lse).abs().max().item() <= 0.15
