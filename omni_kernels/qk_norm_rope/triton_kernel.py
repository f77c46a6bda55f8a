"""Triton kernel for the fused QK-RMSNorm + rotary embedding.

The operation is defined by :mod:`omni_kernels.qk_norm_rope.reference`; this is
the ``backend="triton"`` path of :func:`omni_kernels.qk_rmsnorm_rope`, reached
through the custom op ``torch.ops.omni_kernels.qk_rmsnorm_rope_triton``.

Layout of the work: one program per (token, tensor), where a token is one
``(b, s)`` position and the tensor is ``q`` or ``k``; programs ``2t`` and
``2t + 1`` are token ``t``'s ``q`` and ``k``, so the two programs that read the
same ``cos``/``sin`` row run side by side and the second finds it in L2. A
program walks the token's heads in blocks of ``BLOCK_H`` heads, each block a
register tile of ``[BLOCK_H, BLOCK_D]`` values held as two ``[BLOCK_H,
BLOCK_D // 2]`` tiles ``a`` and ``b``: the two members of each rotation pair.

* ``interleaved=True`` pairs are ``(x[2i], x[2i+1])``: the row is loaded as one
  contiguous (vectorizable) tile and split in registers.
* ``interleaved=False`` pairs are ``(x[i], x[i + D/2])``: the two halves of the
  row are loaded as two contiguous tiles.

Every element is loaded once per pass and stored once, and each stored value
depends on the loaded values of its own address (through the pair and the
row's sum of squares), so an output that aliases its input (in-place) is safe.
With ``norm_across_heads`` the program first sums squares over all ``H*D``
values of the token, then makes a second pass that normalizes, rotates and
stores; the second pass re-reads the row from L1/L2, not HBM (a Wan row is
40 heads x 128 x 2 bytes = 10 KiB).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Upper bound on the values in one [BLOCK_H, BLOCK_D] register tile. With
# ~32 values a thread (see _num_warps) that is 4 warps, and the pair tiles,
# cos/sin rows and weights still fit in registers without spilling.
_MAX_TILE_ELEMENTS = 4096
# A head block may leave at most this share of its lanes idle (padding heads
# past H); above it, a smaller power-of-two block with less padding is used.
_MAX_PADDING_FRACTION = 0.2


@triton.jit
def _load_pairs(
    ptr,
    row_offsets,
    row_mask,
    ROWS: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    """Load rows ``ptr + row_offsets[r] + [0, 2*HALF_D)`` as pair tiles.

    Returns ``(a, b)``, each ``[ROWS, BLOCK_D // 2]`` in ``COMPUTE_DTYPE``, where
    column ``i`` holds the two members of rotation pair ``i``; masked lanes
    (rows with ``row_mask`` False, pairs ``i >= HALF_D``) are 0.
    """
    if INTERLEAVED:
        cols = tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < 2 * HALF_D)[None, :]
        x = tl.load(ptr + row_offsets[:, None] + cols[None, :], mask=mask, other=0.0)
        a, b = tl.split(tl.reshape(x.to(COMPUTE_DTYPE), (ROWS, BLOCK_D // 2, 2)))
    else:
        pairs = tl.arange(0, BLOCK_D // 2)
        mask = row_mask[:, None] & (pairs < HALF_D)[None, :]
        first = ptr + row_offsets[:, None] + pairs[None, :]
        a = tl.load(first, mask=mask, other=0.0).to(COMPUTE_DTYPE)
        b = tl.load(first + HALF_D, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    return a, b


@triton.jit
def _store_pairs(
    ptr,
    row_offsets,
    row_mask,
    a,
    b,
    ROWS: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Inverse of :func:`_load_pairs`: round ``a``/``b`` once to ``ptr``'s dtype and store."""
    out_dtype = ptr.dtype.element_ty
    if INTERLEAVED:
        cols = tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < 2 * HALF_D)[None, :]
        x = tl.reshape(tl.join(a, b), (ROWS, BLOCK_D))
        tl.store(ptr + row_offsets[:, None] + cols[None, :], x.to(out_dtype), mask=mask)
    else:
        pairs = tl.arange(0, BLOCK_D // 2)
        mask = row_mask[:, None] & (pairs < HALF_D)[None, :]
        first = ptr + row_offsets[:, None] + pairs[None, :]
        tl.store(first, a.to(out_dtype), mask=mask)
        tl.store(first + HALF_D, b.to(out_dtype), mask=mask)


@triton.jit
def _inv_rms(mean_square, eps, COMPUTE_DTYPE: tl.constexpr):
    """``1 / sqrt(mean_square + eps)``, correctly rounded square root.

    One per head (or per token): the approximate ``rsqrt`` would save nothing
    measurable in this memory-bound kernel. ``sqrt_rn`` is float32-only; the
    float64 ``sqrt`` is IEEE-exact already.
    """
    if COMPUTE_DTYPE == tl.float64:
        return 1.0 / tl.sqrt(mean_square + eps)
    else:
        return 1.0 / tl.sqrt_rn(mean_square + eps)


@triton.jit
def _norm_rope_token(
    x_ptr,
    out_ptr,
    w_ptr,
    x_row,
    out_row,
    x_stride_h,
    out_stride_h,
    heads,
    eps,
    cos_a,
    cos_b,
    sin_a,
    sin_b,
    HAS_WEIGHT: tl.constexpr,
    NORM_ACROSS_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    """RMSNorm + RoPE of all ``heads`` heads of one token of one tensor.

    ``x_row``/``out_row`` are the (int64) element offsets of the token's head 0;
    ``cos_a`` ... ``sin_b`` are the token's table rows as ``[1, BLOCK_D // 2]``
    pair tiles.
    """
    head_dim = 2 * HALF_D
    zero_row = tl.zeros([1], dtype=tl.int64)
    one_row = zero_row == 0
    if HAS_WEIGHT and not NORM_ACROSS_HEADS:
        # Per-head weight [D]: the same for every head, loaded once.
        w_a, w_b = _load_pairs(
            w_ptr, zero_row, one_row, 1, HALF_D, BLOCK_D, INTERLEAVED, COMPUTE_DTYPE
        )

    if NORM_ACROSS_HEADS:
        # Pass 1: one mean square over the token's H*D values. Lane-wise
        # partial sums, reduced once after the loop.
        partial = tl.zeros([BLOCK_H, BLOCK_D // 2], dtype=COMPUTE_DTYPE)
        for h0 in range(0, heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            a, b = _load_pairs(
                x_ptr + x_row, h.to(tl.int64) * x_stride_h, h < heads,
                BLOCK_H, HALF_D, BLOCK_D, INTERLEAVED, COMPUTE_DTYPE,
            )
            partial += a * a + b * b
        mean_square = tl.sum(tl.sum(partial, axis=1), axis=0) / (heads * head_dim)
        token_scale = _inv_rms(mean_square, eps, COMPUTE_DTYPE)

    for h0 in range(0, heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        head_mask = h < heads
        a, b = _load_pairs(
            x_ptr + x_row, h.to(tl.int64) * x_stride_h, head_mask,
            BLOCK_H, HALF_D, BLOCK_D, INTERLEAVED, COMPUTE_DTYPE,
        )
        if NORM_ACROSS_HEADS:
            scale = token_scale
        else:
            mean_square = tl.sum(a * a + b * b, axis=1) / head_dim
            scale = _inv_rms(mean_square, eps, COMPUTE_DTYPE)[:, None]
        a = a * scale
        b = b * scale
        if HAS_WEIGHT:
            if NORM_ACROSS_HEADS:
                # Weight [H*D]: this block's heads' slices.
                w_a, w_b = _load_pairs(
                    w_ptr, h.to(tl.int64) * head_dim, head_mask,
                    BLOCK_H, HALF_D, BLOCK_D, INTERLEAVED, COMPUTE_DTYPE,
                )
            a = a * w_a
            b = b * w_b
        # out = y * cos + rotate(y) * sin, rotate(y) = -b at a's place, a at b's.
        out_a = a * cos_a - b * sin_a
        out_b = b * cos_b + a * sin_b
        _store_pairs(
            out_ptr + out_row, h.to(tl.int64) * out_stride_h, head_mask, out_a, out_b,
            BLOCK_H, HALF_D, BLOCK_D, INTERLEAVED,
        )


@triton.jit
def _qk_rmsnorm_rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    seq_len,
    heads_q,
    heads_k,
    q_stride_b,
    q_stride_s,
    q_stride_h,
    k_stride_b,
    k_stride_s,
    k_stride_h,
    q_out_stride_b,
    q_out_stride_s,
    q_out_stride_h,
    k_out_stride_b,
    k_out_stride_s,
    k_out_stride_h,
    eps,
    HAS_Q_WEIGHT: tl.constexpr,
    HAS_K_WEIGHT: tl.constexpr,
    NORM_ACROSS_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    token = pid // 2
    # int64: batch/sequence offsets of a fused QKV buffer can pass 2**31 elements.
    batch = (token // seq_len).to(tl.int64)
    pos = (token % seq_len).to(tl.int64)

    zero_row = tl.zeros([1], dtype=tl.int64)
    one_row = zero_row == 0
    table_row = cos_ptr + pos * (2 * HALF_D)
    cos_a, cos_b = _load_pairs(
        table_row, zero_row, one_row, 1, HALF_D, BLOCK_D, INTERLEAVED, tl.float32
    )
    table_row = sin_ptr + pos * (2 * HALF_D)
    sin_a, sin_b = _load_pairs(
        table_row, zero_row, one_row, 1, HALF_D, BLOCK_D, INTERLEAVED, tl.float32
    )
    cos_a = cos_a.to(COMPUTE_DTYPE)
    cos_b = cos_b.to(COMPUTE_DTYPE)
    sin_a = sin_a.to(COMPUTE_DTYPE)
    sin_b = sin_b.to(COMPUTE_DTYPE)

    if pid % 2 == 0:
        _norm_rope_token(
            q_ptr, q_out_ptr, q_weight_ptr,
            batch * q_stride_b + pos * q_stride_s,
            batch * q_out_stride_b + pos * q_out_stride_s,
            q_stride_h, q_out_stride_h, heads_q, eps,
            cos_a, cos_b, sin_a, sin_b,
            HAS_Q_WEIGHT, NORM_ACROSS_HEADS, BLOCK_HQ, HALF_D, BLOCK_D, INTERLEAVED,
            COMPUTE_DTYPE,
        )
    else:
        _norm_rope_token(
            k_ptr, k_out_ptr, k_weight_ptr,
            batch * k_stride_b + pos * k_stride_s,
            batch * k_out_stride_b + pos * k_out_stride_s,
            k_stride_h, k_out_stride_h, heads_k, eps,
            cos_a, cos_b, sin_a, sin_b,
            HAS_K_WEIGHT, NORM_ACROSS_HEADS, BLOCK_HK, HALF_D, BLOCK_D, INTERLEAVED,
            COMPUTE_DTYPE,
        )


def _next_power_of_2(n: int) -> int:
    # Plain Python: triton.next_power_of_2 is a constexpr_function, whose
    # wrapper costs microseconds a call on the launch path.
    return 1 << max(0, n - 1).bit_length()


def _head_block(heads: int, block_d: int) -> int:
    """Power-of-two number of heads per register tile.

    The largest block with at most ``_MAX_TILE_ELEMENTS`` values and at most
    ``_MAX_PADDING_FRACTION`` idle head lanes; if none pads that little, the
    block with the fewest padded lanes (ties: the larger block, fewer loop trips).
    Flux (24 heads of 128) gets 8: three full blocks rather than one block of 32
    with 8 idle heads.
    """
    cap = max(1, _MAX_TILE_ELEMENTS // block_d)
    cap = min(cap, _next_power_of_2(heads))
    candidates = []
    block = cap
    while block >= 1:
        padded = -(-heads // block) * block
        if (padded - heads) <= _MAX_PADDING_FRACTION * heads:
            return block
        candidates.append((padded, -block))
        block //= 2
    padded, neg_block = min(candidates)
    return -neg_block


def _num_warps(block_h: int, block_d: int) -> int:
    """About 32 tile values per thread (four 16-byte vectors of fp16/bf16), 1 to 8 warps.

    The best of a BLOCK_H x warps sweep at Flux, Wan and SD3.5 shapes (about 90% of a device
    copy's bandwidth). More warps per program lowered bandwidth: the work per token is small,
    and many small programs keep more loads in flight.
    """
    return max(1, min(8, (block_h * block_d) // 1024))


@functools.lru_cache(maxsize=256)
def _launch_config(heads_q: int, heads_k: int, head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_D, BLOCK_HQ, BLOCK_HK, num_warps)``, memoized: the launch path is host-bound
    for image-sized inputs."""
    block_d = _next_power_of_2(head_dim)
    block_hq = _head_block(heads_q, block_d)
    block_hk = _head_block(heads_k, block_d)
    return block_d, block_hq, block_hk, _num_warps(max(block_hq, block_hk), block_d)


def launch_qk_rmsnorm_rope_triton(
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    interleaved: bool,
    norm_across_heads: bool,
) -> None:
    """Write RMSNorm + RoPE of ``q``/``k`` into ``q_out``/``k_out`` with one launch.

    Arguments are validated by :func:`omni_kernels.qk_rmsnorm_rope`; this
    launcher assumes:

    * ``q``: ``[B, S, Hq, D]``, ``k``: ``[B, S, Hk, D]``, one float dtype
      (float16, bfloat16, float32; float64 computes in float64), ``D`` even,
      last-dimension stride 1, other strides arbitrary (views of a fused QKV
      projection are read in place, never copied).
    * ``q_out``/``k_out``: shapes and dtype of ``q``/``k``, last-dimension
      stride 1, other strides arbitrary; each may be the very tensor ``q``/``k``
      (in-place) but must not otherwise overlap an input.
    * ``q_weight``/``k_weight``: ``None`` or 1-D contiguous ``[D]`` (per-head
      norm) or ``[H*D]`` (``norm_across_heads``), any float dtype.
    * ``cos``/``sin``: ``[S, D]`` float32, contiguous.

    Computation is in float32 (float64 for float64 inputs), rounded once to
    the output dtype. Runs on CUDA tensors, or on CPU tensors under
    ``TRITON_INTERPRET=1``.
    """
    batch, seq, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    if batch * seq == 0 or head_dim == 0:
        return
    block_d, block_hq, block_hk, num_warps = _launch_config(heads_q, heads_k, head_dim)
    # Weights are indexed as contiguous vectors; a strided 1-D weight is rare
    # and tiny, so it is copied rather than given its own stride argument.
    q_weight = q_weight.contiguous() if q_weight is not None else None
    k_weight = k_weight.contiguous() if k_weight is not None else None
    compute_dtype = tl.float64 if q.dtype == torch.float64 else tl.float32

    grid = (2 * batch * seq,)
    args = (
        q, k, q_out, k_out,
        # An unused pointer argument still needs a tensor; HAS_*_WEIGHT=False
        # means it is never dereferenced.
        q_weight if q_weight is not None else cos,
        k_weight if k_weight is not None else cos,
        cos, sin,
        seq, heads_q, heads_k,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        float(eps),
    )
    meta = dict(
        HAS_Q_WEIGHT=q_weight is not None,
        HAS_K_WEIGHT=k_weight is not None,
        NORM_ACROSS_HEADS=bool(norm_across_heads),
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        HALF_D=head_dim // 2,
        BLOCK_D=block_d,
        INTERLEAVED=bool(interleaved),
        COMPUTE_DTYPE=compute_dtype,
        num_warps=num_warps,
    )
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        # Triton launches on the current device; make it q's (the guard costs
        # a few microseconds, so only when needed).
        with torch.cuda.device(q.device):
            _qk_rmsnorm_rope_kernel[grid](*args, **meta)
    else:
        _qk_rmsnorm_rope_kernel[grid](*args, **meta)
