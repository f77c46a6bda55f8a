"""Q/K/V quantization in CUDA for the Hopper kernel: ``omni_kernels::sage_quantize_qkv``.

The format of :func:`.reference.quantize_qkv_reference` (``k_mean`` the mean of K's strided
sample, ``v_scale`` one scale per key block) for head_dim 128 and key blocks of 128: the same
bytes but for ``k_mean``'s float32 summation order (and what follows from it: K's codes, its
scales, ``q_kmean``), in one dispatched call. Its two launches (``csrc/attention/sage_quant.cu``)
are K's sample mean (~512 keys a head) and the codes, which read each of Q, K and V once; the
quantization costs one op's host time instead of Triton launches and the Python around them.
"""

from __future__ import annotations

import torch

from omni_kernels.attention.quantized.reference import QuantizedQKV
from omni_kernels.attention.triton_flash import bhs_sizes

BLOCK_N = 128
HEAD_DIM = 128


def cuda_quantize_unsupported_reason(q, k, v) -> str | None:
    """None when :func:`quantize_qkv_cuda` takes these tensors, else why not."""
    from omni_kernels._extension import has_compiled_extension

    if not has_compiled_extension() or not hasattr(torch.ops.omni_kernels, "sage_quantize_qkv"):
        return "omni_kernels._C has no sage_quantize_qkv (no compiled extension, or a ROCm build)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda or t.dtype not in (torch.float16, torch.bfloat16):
            return f"{name} must be a float16/bfloat16 CUDA tensor; got {t.dtype} on {t.device}"
        if t.shape[-1] != HEAD_DIM:
            return f"head_dim must be {HEAD_DIM}; got {t.shape[-1]}"
        if t.stride(3) != 1 or any(s % 4 for s in t.stride()[:3]) or t.data_ptr() % 8:
            return f"{name} needs a contiguous last dim, strides that are multiples of 4 and an 8-byte aligned start"
    return None


def quantize_qkv_cuda(q, k, v, *, layout: str = "bhsd", key_lengths=None,
                      permute_v: bool = True) -> QuantizedQKV:
    """Quantize ``q``/``k``/``v`` (``[B, H, S, 128]`` bhsd or ``[B, S, H, 128]`` bshd, float16 or
    bfloat16 CUDA) as :func:`.quantize.quantize_qkv` does with ``block_n=128``.

    ``key_lengths``: optional int32 ``[B]`` on q's device. ``permute_v``: V^T's keys in
    ``reference.v_key_permutation``'s order (the Hopper kernel's). Raises ValueError naming the
    constraint when :func:`cuda_quantize_unsupported_reason` refuses the inputs.
    """
    reason = cuda_quantize_unsupported_reason(q, k, v)
    if reason is not None:
        raise ValueError(f"quantize_qkv_cuda: {reason}")
    if key_lengths is not None:
        key_lengths = key_lengths.to(device=q.device, dtype=torch.int32).contiguous()
    q8, qs, qkm, k8, ks, kmean, v8, vs = torch.ops.omni_kernels.sage_quantize_qkv(
        q, k, v, layout == "bshd", key_lengths, permute_v)
    seq_kv = bhs_sizes(k, layout)[2]
    return QuantizedQKV(q8, qs, k8, ks, kmean, v8, vs, seq_kv, BLOCK_N, qkm, permute_v)


def _fake_sage_quantize_qkv(q, k, v, bshd, key_lengths, permute_v):
    def sizes(t):
        return (t.shape[0], t.shape[2], t.shape[1]) if bshd else tuple(t.shape[:3])

    b, hq, sq = sizes(q)
    _, hkv, skv = sizes(k)
    pad = -(-skv // BLOCK_N) * BLOCK_N
    f32 = torch.float32
    return [
        q.new_empty((b, hq, sq, HEAD_DIM), dtype=torch.int8), q.new_empty((b, hq, sq), dtype=f32),
        q.new_empty((b, hq, sq), dtype=f32), q.new_empty((b, hkv, pad, HEAD_DIM), dtype=torch.int8),
        q.new_empty((b, hkv, pad // BLOCK_N), dtype=f32), q.new_empty((b, hkv, HEAD_DIM), dtype=f32),
        q.new_empty((b, hkv, HEAD_DIM, pad), dtype=torch.float8_e4m3fn),
        q.new_empty((b, hkv, pad // BLOCK_N), dtype=f32),
    ]


def _register_fake():
    from omni_kernels._extension import has_compiled_extension

    if has_compiled_extension() and hasattr(torch.ops.omni_kernels, "sage_quantize_qkv"):
        torch.library.register_fake("omni_kernels::sage_quantize_qkv")(_fake_sage_quantize_qkv)


_register_fake()

__all__ = ["cuda_quantize_unsupported_reason", "quantize_qkv_cuda"]
