"""Triton kernels for the halo pack / assemble ops (definition: :mod:`.reference`).

One program per (output row, slab): every output row has a single source (a received halo row,
a row of ``x``, an edge row, or zeros), chosen once with compile-time edge modes, then the row is
copied in ``BLOCK_W``-wide chunks (a loop over the width), so a program is one coalesced row
copy that Triton vectorizes when the column stride is 1. A slab is an ``(n, t)`` pair; programs
along grid axis 1 loop over slabs beyond the 65535 grid limit. Row and column indices are int32,
slab offsets int64 (Wan 720p feature maps exceed 2**31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_kernels.halo.reference import HALO_RECV, HALO_ZERO

_MAX_GRID_Y = 65535


@triton.jit
def _copy_row(src, src_stride, dst, dst_stride, W, BLOCK_W: tl.constexpr):
    for c0 in range(0, W, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        mask = cols < W
        tl.store(dst + cols * dst_stride, tl.load(src + cols * src_stride, mask=mask), mask=mask)


@triton.jit
def _zero_row(dst, dst_stride, W, BLOCK_W: tl.constexpr):
    for c0 in range(0, W, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        tl.store(dst + cols * dst_stride, tl.zeros([BLOCK_W], dtype=dst.dtype.element_ty),
                 mask=cols < W)


@triton.jit
def _halo_pack_kernel(
    x_ptr, lo_ptr, hi_ptr,
    T, NT, H, W, N_LO, N_HI,
    sxn, sxt, sxh, sxw,
    BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0)  # int32 send row: [0, N_LO) to lo, then N_HI rows to hi
    in_lo = i < N_LO
    src_row = tl.where(in_lo, i, H - N_HI + i - N_LO)
    for nt in range(tl.program_id(1), NT, tl.num_programs(1)):
        nt64 = tl.cast(nt, tl.int64)
        src = x_ptr + (nt64 // T) * sxn + (nt64 % T) * sxt + src_row * sxh
        if in_lo:
            _copy_row(src, sxw, lo_ptr + (nt64 * N_LO + i) * W, 1, W, BLOCK_W)
        else:
            _copy_row(src, sxw, hi_ptr + (nt64 * N_HI + (i - N_LO)) * W, 1, W, BLOCK_W)


@triton.jit
def _halo_assemble_kernel(
    x_ptr, lo_ptr, hi_ptr, out_ptr,
    T, NT, H, W, LO, HI,
    sxn, sxt, sxh, sxw,
    son, sot, soh, sow,
    LO_MODE: tl.constexpr, HI_MODE: tl.constexpr,
    RECV: tl.constexpr, ZERO: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0)  # int32 output row in [0, LO + H + HI)
    above = i < LO
    below = i >= LO + H
    # x's row for shard rows; the first / last row for replicated edges (int32 throughout).
    src_row = tl.minimum(tl.maximum(i - LO, 0), H - 1)
    for nt in range(tl.program_id(1), NT, tl.num_programs(1)):
        nt64 = tl.cast(nt, tl.int64)
        n = nt64 // T
        t = nt64 % T
        dst = out_ptr + n * son + t * sot + i * soh
        x_row = x_ptr + n * sxn + t * sxt + src_row * sxh
        if above:
            if LO_MODE == RECV:
                _copy_row(lo_ptr + (nt64 * LO + i) * W, 1, dst, sow, W, BLOCK_W)
            elif LO_MODE == ZERO:
                _zero_row(dst, sow, W, BLOCK_W)
            else:
                _copy_row(x_row, sxw, dst, sow, W, BLOCK_W)
        elif below:
            if HI_MODE == RECV:
                _copy_row(hi_ptr + (nt64 * HI + (i - LO - H)) * W, 1, dst, sow, W, BLOCK_W)
            elif HI_MODE == ZERO:
                _zero_row(dst, sow, W, BLOCK_W)
            else:
                _copy_row(x_row, sxw, dst, sow, W, BLOCK_W)
        else:
            _copy_row(x_row, sxw, dst, sow, W, BLOCK_W)


def _launch_shape(width: int, element_size: int) -> tuple[int, int]:
    """``(BLOCK_W, num_warps)``: up to 16 bytes x 4 per thread, whole warps."""
    block = min(4096 // element_size, max(32, triton.next_power_of_2(width)))
    return block, max(1, min(8, block * element_size // 512))


def launch_halo_pack_triton(x: torch.Tensor, send_lo: torch.Tensor, send_hi: torch.Tensor) -> None:
    """Pack the boundary rows of ``x [N, T, h, W]`` into contiguous ``send_lo``/``send_hi``."""
    n, t, h, w = x.shape
    n_lo, n_hi = send_lo.shape[2], send_hi.shape[2]
    if n * t * (n_lo + n_hi) * w == 0:
        return
    block, warps = _launch_shape(w, x.element_size())
    grid = (n_lo + n_hi, min(n * t, _MAX_GRID_Y))
    _halo_pack_kernel[grid](
        x, send_lo, send_hi, t, n * t, h, w, n_lo, n_hi, *x.stride(),
        BLOCK_W=block, num_warps=warps,
    )


def launch_halo_assemble_triton(
    x: torch.Tensor,
    recv_lo: torch.Tensor | None,
    recv_hi: torch.Tensor | None,
    out: torch.Tensor,
    lo_rows: int,
    hi_rows: int,
    lo_mode: int,
    hi_mode: int,
) -> None:
    """Write ``x`` with its halo rows into ``out [N, T, lo + h + hi, W]`` (any strides)."""
    n, t, h, w = x.shape
    if out.numel() == 0:
        return
    block, warps = _launch_shape(w, x.element_size())
    grid = (lo_rows + h + hi_rows, min(n * t, _MAX_GRID_Y))
    # An unused halo pointer still needs a tensor of the right dtype; x stands in.
    _halo_assemble_kernel[grid](
        x, x if recv_lo is None else recv_lo, x if recv_hi is None else recv_hi, out,
        t, n * t, h, w, lo_rows, hi_rows, *x.stride(), *out.stride(),
        LO_MODE=lo_mode, HI_MODE=hi_mode, RECV=HALO_RECV, ZERO=HALO_ZERO,
        BLOCK_W=block, num_warps=warps,
    )
