"""Triton weight-only GEMV for a few rows: ``y = x @ (w_q * w_scale[:, None])^T + bias``.

For linear layers that read one row per sample (a DiT's adaLN modulation, Flux's
``norm1.linear`` 3072 -> 18432 at batch 1 or 2): with ``M <= 16`` the GEMM is a
matrix-vector product bound by reading the weight, so an 8-bit weight read once
at full bandwidth takes about half the time of the bf16 one. Shapes and dtypes:
``x`` ``[M, K]`` float16/bfloat16/float32 (any strides), ``w_q`` ``[N, K]`` INT8 or
FP8 e4m3 (row-major for full speed; any strides work), ``w_scale`` ``[N]`` float32
(one scale per output channel), ``bias`` ``[N]`` in ``x``'s dtype or float32 or
``None``; ``y`` ``[M, N]`` in ``x``'s dtype, accumulated in float32.

Each program owns ``BLOCK_N`` output channels and streams their ``[BLOCK_N, K]``
weight slab once, ``BLOCK_K`` columns at a time (K-contiguous: 16-byte loads of
8-bit values), with an eviction hint so that the slab does not push ``x`` out of
L2. Two inner products, chosen by the number of rows:

* ``M <= 4`` (the modulation case): per row, a ``[BLOCK_N, BLOCK_K]`` float32
  accumulator of ``w * x`` products (CUDA-core FMAs), summed over ``K`` once after
  the loop, so the loop has no cross-thread reduction. ``x`` is loaded as a ``[BLOCK_K]``
  vector, which Triton moves into the weight tile's layout through shared memory (in the
  sm_90 code: 4 to 8 block-wide barriers a loop step at the default tiles);
  ``x_tile_load=True`` loads it in the tile's ``[BLOCK_N, BLOCK_K]`` layout instead (no
  barrier or shared-memory load in the loop; the tile's rows read the same addresses). Off
  by default; pipelined (``num_stages > 1``) it copies that whole ``x`` tile through shared
  memory too.
* ``4 < M <= 16``: ``tl.dot`` on a 16-row tile (rows past ``M`` repeat a valid row
  and are never stored), the weight tile converted to ``x``'s dtype in registers
  (exact: every INT8 and e4m3 value is a bfloat16/float16 value). At 8 or more rows
  CUDA-core FMAs at full read bandwidth would exceed the GPU's FP32 FMA rate.
  The crossover is a guess (``use_dot`` selects either).

The per-channel scale factors out of the sum over ``K`` and is applied once, with
the bias, in the epilogue. When ``N / BLOCK_N`` programs are too few to fill the
GPU (``N < 4096``), ``K`` is split over ``split_k`` programs per column block that
write float32 partial sums; a second small kernel adds them in a fixed order (no
atomics: the result does not depend on scheduling) and applies scale, bias and cast.

The launcher's keyword arguments are the tuning knobs (``bench/gemv_tune.py``). Under
``TRITON_INTERPRET=1`` (CPU tests) the same kernels run; FP8 weights load there too,
bfloat16 does not (the interpreter's bfloat16 is broken).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from omni_kernels._triton import cdiv
from omni_kernels.quant.reference import FP8_DTYPE, INT8_DTYPE

#: the most rows the GEMV takes; more are a GEMM (:mod:`.triton_gemm`)
GEMV_MAX_M = 16
# Up to this many rows the CUDA-core path; above it, tl.dot on a 16-row tile.
FMA_MAX_ROWS = 4
# From this many output channels on, K is never split (4096 / 32 = 128 column blocks: about
# one per SM of a Hopper GPU).
NO_SPLIT_MIN_N = 4096
_MAX_SPLIT_K = 16
# Streaming multiprocessors assumed where there is no GPU to ask (the interpreter).
_DEFAULT_SM_COUNT = 132
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_W_DTYPES = (INT8_DTYPE, FP8_DTYPE)
_sm_counts: dict[int, int] = {}


@triton.jit
def _finish_tile(acc, rows, cols, pid_k, M, N, scale_ptr, bias_ptr, out_ptr,
                 stride_os, stride_om, stride_on, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Store a float32 tile ``acc`` ``[R, BLOCK_N]`` of rows ``rows`` and columns ``cols``:
    as it is into split ``pid_k`` of the partial sums, or scaled, biased and cast."""
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    if PARTIAL:
        ptrs = out_ptr + pid_k.to(tl.int64) * stride_os + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(ptrs, acc, mask=mask)
    else:
        y = acc * tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_product(x_ptr, row, stride_xm, x_cols, rk, w, k_left, EVEN_K: tl.constexpr, X_TILE_LOAD: tl.constexpr):
    """``w * x[row, cols]`` in float32, ``[BLOCK_N, BLOCK_K]`` (columns ``rk >= k_left`` are 0).

    ``X_TILE_LOAD``: load ``x[row, cols]`` directly in ``w``'s ``[BLOCK_N, BLOCK_K]`` shape and
    layout (each thread reads the ``x`` values of its own weight columns; the rows of the tile
    repeat addresses, served from L1). Otherwise ``x`` is loaded as a ``[BLOCK_K]`` vector, which
    Triton moves into ``w``'s layout through shared memory (block-wide barriers every loop step
    in the sm_90 code).
    """
    if X_TILE_LOAD:
        ptrs = tl.broadcast_to(x_ptr + row * stride_xm + x_cols[None, :], w.shape)
        if EVEN_K:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=tl.broadcast_to((rk < k_left)[None, :], w.shape), other=0.0)
        return w * x.to(tl.float32)
    if EVEN_K:
        x = tl.load(x_ptr + row * stride_xm + x_cols)
    else:
        x = tl.load(x_ptr + row * stride_xm + x_cols, mask=rk < k_left, other=0.0)
    return w * x.to(tl.float32)[None, :]


@triton.jit
def _weight_only_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_os, stride_om, stride_on,
    ROWS: tl.constexpr, USE_DOT: tl.constexpr, IEEE_FP32: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FMA_LOOP_STAGES: tl.constexpr, X_TILE_LOAD: tl.constexpr,
):
    """Program ``(pid_n, pid_k)``: output columns ``pid_n * BLOCK_N + [0, BLOCK_N)`` over the
    ``K`` range ``pid_k * k_per_split + [0, k_per_split)`` (one range when not split).

    ``ROWS``: ``M`` itself on the CUDA-core path (1 to 4, one accumulator per row), 16 on
    the ``tl.dot`` path. ``EVEN_K``: every ``BLOCK_K`` chunk is full (no column masks).
    ``FMA_LOOP_STAGES``: the CUDA-core loop's software-pipelining depth, or ``None`` (not
    pipelined). Triton pipelines the loads of a loop without ``tl.dot`` only when the loop
    itself carries ``num_stages``; the launch option alone pipelines the ``tl.dot`` loop only.
    ``X_TILE_LOAD``: the CUDA-core loop reads ``x`` in the weight tile's layout (:func:`_row_product`).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N re-read a valid weight row (their results are never stored): no row masks.
    w_rows = cols % N
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_len = tl.minimum(K - k_start, k_per_split)
    w_ptrs = w_ptr + w_rows[:, None].to(tl.int64) * stride_wn + (k_start + rk)[None, :] * stride_wk
    x_cols = (k_start + rk) * stride_xk

    if USE_DOT:
        rows = tl.arange(0, ROWS)
        x_rows = tl.minimum(rows, M - 1)  # rows past M repeat the last one; never stored
        x_ptrs = x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + x_cols[None, :]
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_len, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                x = tl.load(x_ptrs)
            else:
                w = tl.load(w_ptrs, mask=rk[None, :] < k_len - k0, other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=rk[None, :] < k_len - k0, other=0.0)
            w_t = tl.trans(w.to(x.dtype))
            if IEEE_FP32:
                acc = tl.dot(x, w_t, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w_t, acc)
            w_ptrs += BLOCK_K * stride_wk
            x_ptrs += BLOCK_K * stride_xk
        _finish_tile(acc, rows, cols, pid_k, M, N, scale_ptr, bias_ptr, out_ptr,
                     stride_os, stride_om, stride_on, HAS_BIAS, PARTIAL)
    else:
        # One [BLOCK_N, BLOCK_K] accumulator per row (unused ones are compiled away).
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, k_len, BLOCK_K, num_stages=FMA_LOOP_STAGES):
            k_left = k_len - k0
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=rk[None, :] < k_left, other=0.0, eviction_policy="evict_first")
            w = w.to(tl.float32)
            acc0 += _row_product(x_ptr, 0, stride_xm, x_cols, rk, w, k_left, EVEN_K, X_TILE_LOAD)
            if ROWS > 1:
                acc1 += _row_product(x_ptr, 1, stride_xm, x_cols, rk, w, k_left, EVEN_K, X_TILE_LOAD)
            if ROWS > 2:
                acc2 += _row_product(x_ptr, 2, stride_xm, x_cols, rk, w, k_left, EVEN_K, X_TILE_LOAD)
            if ROWS > 3:
                acc3 += _row_product(x_ptr, 3, stride_xm, x_cols, rk, w, k_left, EVEN_K, X_TILE_LOAD)
            w_ptrs += BLOCK_K * stride_wk
            x_cols += BLOCK_K * stride_xk
        one = tl.arange(0, 1)
        _finish_tile(tl.sum(acc0, axis=1)[None, :], one, cols, pid_k, M, N, scale_ptr, bias_ptr,
                     out_ptr, stride_os, stride_om, stride_on, HAS_BIAS, PARTIAL)
        if ROWS > 1:
            _finish_tile(tl.sum(acc1, axis=1)[None, :], one + 1, cols, pid_k, M, N, scale_ptr, bias_ptr,
                         out_ptr, stride_os, stride_om, stride_on, HAS_BIAS, PARTIAL)
        if ROWS > 2:
            _finish_tile(tl.sum(acc2, axis=1)[None, :], one + 2, cols, pid_k, M, N, scale_ptr, bias_ptr,
                         out_ptr, stride_os, stride_om, stride_on, HAS_BIAS, PARTIAL)
        if ROWS > 3:
            _finish_tile(tl.sum(acc3, axis=1)[None, :], one + 3, cols, pid_k, M, N, scale_ptr, bias_ptr,
                         out_ptr, stride_os, stride_om, stride_on, HAS_BIAS, PARTIAL)


@triton.jit
def _reduce_splits_kernel(
    partial_ptr, scale_ptr, bias_ptr, out_ptr, M, N, SPLIT,
    stride_ps, stride_pm, stride_pn, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row ``program_id(1)``, columns ``program_id(0) * BLOCK_N + [0, BLOCK_N)``: the split
    partial sums added in split order, then scale, bias and cast."""
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ptrs = partial_ptr + row * stride_pm + cols * stride_pn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(ptrs + s * stride_ps, mask=col_mask, other=0.0)
    rows = row + tl.arange(0, 1)
    _finish_tile(acc[None, :], rows, cols, 0, M, N, scale_ptr, bias_ptr, out_ptr,
                 0, stride_om, stride_on, HAS_BIAS, False)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def default_tiles(m: int) -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)`` for ``m`` rows.

    CUDA-core path: the per-row accumulators hold ``m * block_n * block_k`` float32
    values, kept at 32-64 registers a thread, with 8 KiB of INT8/FP8 weight per loop step.
    ``m = 1``: 16 x 512 tiles, 8 warps, the best of bench/gemv_tune.py's sweep at Flux's adaLN
    shapes (INT8 and FP8, 3072 -> 18432). ``m >= 2``: not changed by that sweep.
    ``tl.dot`` path: a 16-row tile, 64 x 128 weight tiles.
    """
    if m > FMA_MAX_ROWS:
        return 64, 128, 4
    if m == 1:
        return 16, 512, 8
    if m == 2:
        return 16, 256, 4
    return 16, 128, 4


def default_split_k(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> int:
    """How many programs share each column block's ``K``: 1 for ``n >= NO_SPLIT_MIN_N`` or
    when the column blocks fill every SM; otherwise enough to fill them, at most 16 and at
    most one ``block_k`` chunk each."""
    column_blocks = cdiv(n, block_n)
    sm_count = _sm_count(device)
    if n >= NO_SPLIT_MIN_N or column_blocks >= sm_count:
        return 1
    return max(1, min(cdiv(sm_count, column_blocks), cdiv(k, block_k), _MAX_SPLIT_K))


def _check_power_of_two(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high or value & (value - 1):
        raise ValueError(f"{name} must be None or a power of two from {low} to {high}; got {value!r}")


def launch_weight_only_gemv(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    use_dot: bool | None = None,
    x_tile_load: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (w_q * w_scale[:, None])^T + bias`` as ``[M, N]`` in ``x``'s dtype (module docstring).

    ``x`` ``[M, K]`` with ``M <= 16``, float16/bfloat16/float32; ``w_q`` ``[N, K]`` INT8 or FP8
    e4m3; ``w_scale`` ``[N]`` float32; ``bias`` ``[N]`` (``x``'s dtype or float32) or ``None``.
    Tuning knobs (``None``: :func:`default_tiles`, :func:`default_split_k`, Triton's default
    stages, ``tl.dot`` for ``M > 4``): ``block_n`` (16 to 256) and ``block_k`` (16 to 1024),
    powers of two; ``num_warps`` (1 to 16, a power of two); ``num_stages`` (>= 1: weight tiles
    in flight per program, on both paths; ``None`` leaves the CUDA-core loop unpipelined);
    ``split_k`` (>= 1: programs sharing each column block's ``K``; the effective value can
    be lower, so that no program gets an empty range); ``use_dot`` (the ``tl.dot`` path;
    ``False`` needs ``M <= 4``); ``x_tile_load`` (CUDA-core path only: read ``x`` in the weight
    tile's layout, no shared-memory shuffle of ``x`` in the loop; with ``num_stages = s > 1``
    the pipeline holds ``s - 1`` such ``x`` tiles, ``M * block_n * block_k`` values each, in
    shared memory; ``False`` keeps the default kernel). ``out``: an ``[M, N]`` tensor of
    ``x``'s dtype to write into (any strides; for tests that poison it), else a new one. Launched through
    ``torch.library.wrap_triton``, so that Inductor tracing the op around it
    (``omni_kernels.quant.linear``) launches the kernels from its own code.
    """
    if x.dim() != 2 or w_q.dim() != 2 or x.shape[1] != w_q.shape[1]:
        raise ValueError(f"x [M, K] and w_q [N, K] must agree in K; got {tuple(x.shape)}, {tuple(w_q.shape)}")
    # Plain ints: under torch.compile with dynamic shapes M may be symbolic; it picks constexprs
    # (one compiled kernel per M, at most 16), so it is specialized here.
    m, k, n = int(x.shape[0]), int(x.shape[1]), int(w_q.shape[0])
    if m > GEMV_MAX_M:
        raise ValueError(f"the weight-only GEMV takes x with M <= {GEMV_MAX_M} rows; got M={m}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32; got {x.dtype}")
    if w_q.dtype not in _W_DTYPES:
        raise ValueError(f"w_q must be int8 or float8_e4m3fn; got {w_q.dtype}")
    if w_scale.numel() != n or w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be float32 with N={n} values; got {w_scale.dtype} {tuple(w_scale.shape)}")
    if bias is not None and (bias.numel() != n or bias.dtype not in (x.dtype, torch.float32)):
        raise ValueError(
            f"bias must be None or [N={n}] in x's dtype {x.dtype} or float32; got {bias.dtype} {tuple(bias.shape)}"
        )
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be [M={m}, N={n}] {x.dtype} on {x.device}; got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    use_dot = m > FMA_MAX_ROWS if use_dot is None else use_dot
    if not isinstance(use_dot, bool) or (not use_dot and m > FMA_MAX_ROWS):
        raise ValueError(f"use_dot must be None, True, or False with M <= {FMA_MAX_ROWS}; got {use_dot!r} for M={m}")
    if not isinstance(x_tile_load, bool) or (x_tile_load and use_dot):
        raise ValueError(
            f"x_tile_load must be a bool, and True only on the CUDA-core path (use_dot False, M <= {FMA_MAX_ROWS}); "
            f"got {x_tile_load!r} with use_dot={use_dot} for M={m}"
        )
    default_n, default_k, default_warps = default_tiles(m if not use_dot else GEMV_MAX_M)
    block_n = default_n if block_n is None else block_n
    block_k = default_k if block_k is None else block_k
    num_warps = default_warps if num_warps is None else num_warps
    _check_power_of_two("block_n", block_n, 16, 256)
    _check_power_of_two("block_k", block_k, 16, 1024)
    _check_power_of_two("num_warps", num_warps, 1, 16)
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages must be None or an int >= 1; got {num_stages!r}")
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or an int >= 1; got {split_k!r}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.copy_(bias.to(x.dtype).expand(m, n) if bias is not None else torch.zeros_like(out))
        return out

    k_blocks = cdiv(k, block_k)
    split = default_split_k(n, k, block_n, block_k, x.device) if split_k is None else split_k
    blocks_per_split = cdiv(k_blocks, min(split, k_blocks))
    split = cdiv(k_blocks, blocks_per_split)  # no program without K
    k_per_split = blocks_per_split * block_k
    w_scale = w_scale.reshape(n).contiguous()
    bias = bias.reshape(n).contiguous() if bias is not None else None
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else None
    target = partial if partial is not None else out
    target_strides = (partial.stride(0), partial.stride(1), partial.stride(2)) if partial is not None else (
        0, out.stride(0), out.stride(1))
    options = dict(num_warps=num_warps)
    if num_stages is not None:
        options["num_stages"] = num_stages
    wrap_triton(_weight_only_gemv_kernel)[(cdiv(n, block_n), split)](
        x, w_q, w_scale, bias if bias is not None else w_scale, target,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), w_q.stride(0), w_q.stride(1), *target_strides,
        ROWS=GEMV_MAX_M if use_dot else m,
        USE_DOT=use_dot,
        IEEE_FP32=x.dtype == torch.float32,
        HAS_BIAS=bias is not None,
        PARTIAL=partial is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FMA_LOOP_STAGES=None if use_dot else num_stages,
        X_TILE_LOAD=x_tile_load,
        **options,
    )
    if partial is not None:
        reduce_block = 128
        wrap_triton(_reduce_splits_kernel)[(cdiv(n, reduce_block), m)](
            partial, w_scale, bias if bias is not None else w_scale, out, m, n, split,
            partial.stride(0), partial.stride(1), partial.stride(2), out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, BLOCK_N=reduce_block, num_warps=4,
        )
    return out
