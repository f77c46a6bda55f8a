"""Triton GEMM for quantized linear layers, with the dequantization fused into the epilogue.

``c[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n] + bias[n]``, rounded once
to ``c``'s dtype. ``b`` is the weight as ``nn.Linear`` stores it, ``[N, K]``
row-major, so a ``[BLOCK_K, BLOCK_N]`` tile of ``b^T`` is K-contiguous.

Operand pairs (one kernel, specialized by constexprs):

* INT8 x INT8 (W8A8): ``tl.dot`` with int32 accumulation (exact), per-row and
  per-channel scales in the epilogue.
* FP8 x FP8 (W8A8): ``tl.dot`` on e4m3 with float32 accumulation.
* float16/bfloat16/float32 x INT8 or FP8 (weight-only): the weight tile is
  converted to the activation dtype in registers (exact: every INT8 and e4m3
  value is representable in bfloat16/float16), float32 accumulation, the
  per-channel scale in the epilogue (it factors out of the sum over ``k``).

On a GPU the tile sizes are autotuned per ``(M, N, K)`` from a short list
(small-M configurations for ``M <= 64``); under ``TRITON_INTERPRET=1`` a fixed
small configuration runs (the interpreter cannot time configurations, and has
no FP8 or bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_kernels._triton import cdiv, triton_interpreter_enabled


@triton.jit
def _scaled_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_A_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, B_TO_A: tl.constexpr,
    INT_ACC: tl.constexpr, EVEN_K: tl.constexpr, IEEE_FP32: tl.constexpr, FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row blocks share each column block of b while it is in L2.
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows/columns past M/N load a valid row instead (their results are never stored),
    # so the loads need no mask on M/N.
    ram = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
    rbn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + ram[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rbn[None, :].to(tl.int64) * stride_bn + rk[:, None] * stride_bk

    if INT_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if B_TO_A:
            b = b.to(a.dtype)
        if INT_ACC:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        elif IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        elif FAST_ACCUM:
            acc = tl.dot(a, b, acc)  # FP8 on sm_90: Triton's default, no promotion over K
        else:
            # FP8 on sm_90: promote the tensor cores' reduced-precision partial sums to
            # float32 after every MMA (what torch._scaled_mm's use_fast_accum=False does).
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=0)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c = acc.to(tl.float32)
    n_mask = rn < N
    m_mask = rm < M
    if HAS_A_SCALE:
        c = c * tl.load(a_scale_ptr + rm, mask=m_mask, other=0.0)[:, None]
    c = c * tl.load(b_scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _config(bm, bn, bk, stages, warps, group_m=8):
    return triton.Config(
        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m), num_stages=stages, num_warps=warps
    )


# Tile lists by operand width (8-bit operands take BLOCK_K twice as deep for the same bytes).
# Chosen from the usual Hopper GEMM shapes; bench/linear.py measures the result.
_LARGE_M_CONFIGS = {
    1: [
        _config(128, 256, 128, 3, 8),
        _config(256, 128, 128, 3, 8),
        _config(128, 128, 128, 4, 8),
        _config(128, 128, 128, 4, 4),
        _config(64, 128, 128, 4, 4),
    ],
    2: [
        _config(128, 256, 64, 3, 8),
        _config(128, 128, 64, 4, 8),
        _config(128, 128, 64, 4, 4),
        _config(64, 128, 64, 4, 4),
    ],
}
_SMALL_M_CONFIGS = {
    1: [
        _config(16, 64, 256, 4, 4),
        _config(32, 64, 128, 4, 4),
        _config(64, 64, 128, 4, 4),
        _config(16, 128, 128, 4, 4),
    ],
    2: [
        _config(16, 64, 128, 4, 4),
        _config(32, 64, 64, 4, 4),
        _config(64, 64, 64, 4, 4),
        _config(16, 128, 64, 4, 4),
    ],
}
_SMALL_M = 64
# The interpreter runs one fixed small configuration.
_INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=4)

_autotuned: dict[tuple[bool, int], object] = {}


def _kernel_for(small_m: bool, operand_bytes: int):
    key = (small_m, operand_bytes)
    if key not in _autotuned:
        configs = (_SMALL_M_CONFIGS if small_m else _LARGE_M_CONFIGS)[operand_bytes]
        _autotuned[key] = triton.autotune(configs=configs, key=["M", "N", "K"])(_scaled_gemm_kernel)
    return _autotuned[key]


def launch_scaled_gemm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a @ b^T) * a_scale * b_scale + bias`` as ``[M, N]`` ``out_dtype``.

    ``fast_accum`` (FP8 x FP8 only) lets the Hopper tensor cores accumulate over
    all of K in their reduced-precision accumulator; otherwise partial sums are
    promoted to float32 after every MMA.

    ``a`` ``[M, K]`` (INT8, FP8, or float for weight-only), ``b`` ``[N, K]``
    (INT8 or FP8), both with any strides; ``a_scale`` ``[M, 1]`` float32 or
    ``None`` (weight-only); ``b_scale`` ``[N]`` float32; ``bias`` ``[N]`` or ``None``.
    Arguments are validated by the callers in :mod:`omni_kernels.quant.linear`.
    """
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        c.zero_()
        if bias is not None:
            c += bias.to(out_dtype)
        return c
    weight_only = not (a.dtype == b.dtype and a.dtype in (torch.int8, torch.float8_e4m3fn))
    a_scale = a_scale.reshape(-1) if a_scale is not None else None
    b_scale = b_scale.reshape(-1)
    args = (
        a, b, c,
        a_scale if a_scale is not None else b_scale,
        b_scale,
        bias if bias is not None else b_scale,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
    )
    flags = dict(
        HAS_A_SCALE=a_scale is not None,
        HAS_BIAS=bias is not None,
        B_TO_A=weight_only,
        INT_ACC=a.dtype == torch.int8 and b.dtype == torch.int8,
        IEEE_FP32=a.dtype == torch.float32,
        FAST_ACCUM=bool(fast_accum),
    )
    if triton_interpreter_enabled():
        config = _INTERPRETER_CONFIG
        grid = (cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"]),)
        _scaled_gemm_kernel[grid](*args, EVEN_K=k % config["BLOCK_K"] == 0, **flags, **config)
        return c
    operand_bytes = 1 if not weight_only else 2
    kernel = _kernel_for(m <= _SMALL_M, operand_bytes)
    # EVEN_K holds for every config when K is a multiple of the deepest BLOCK_K (256).
    even_k = k % 256 == 0

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)

    kernel[grid](*args, EVEN_K=even_k, **flags)
    return c
