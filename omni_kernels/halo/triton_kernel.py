"""Triton kernels for the halo pack / assemble ops (definition: :mod:`.reference`).

One program per (output row, block of ``BLOCK_W`` columns): every output row has a single source
(a received halo row, ``x``'s row, an edge row, or zeros), chosen with scalar branches, so a
program is one coalesced row copy. Offsets are computed in int64 (Wan 720p feature maps exceed
2**31 bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_kernels.halo.reference import HALO_RECV, HALO_REPLICATE, HALO_ZERO


@triton.jit
def _halo_pack_kernel(
    x_ptr, lo_ptr, hi_ptr,
    T, H, W, N_LO, N_HI,
    sxn, sxt, sxh, sxw,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    rows = N_LO + N_HI
    i = row % rows
    nt = row // rows
    t = nt % T
    n = nt // T
    cols = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = cols < W
    if i < N_LO:
        src_row = i
        dst = lo_ptr + (nt * N_LO + i) * W + cols
    else:
        src_row = H - N_HI + (i - N_LO)
        dst = hi_ptr + (nt * N_HI + (i - N_LO)) * W + cols
    vals = tl.load(x_ptr + n * sxn + t * sxt + src_row * sxh + cols * sxw, mask=mask)
    tl.store(dst, vals, mask=mask)


@triton.jit
def _halo_assemble_kernel(
    x_ptr, lo_ptr, hi_ptr, out_ptr,
    T, H, W, LO, HI,
    sxn, sxt, sxh, sxw,
    son, sot, soh, sow,
    LO_MODE, HI_MODE,
    RECV: tl.constexpr, ZERO: tl.constexpr, REPLICATE: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    rows = LO + H + HI
    i = row % rows
    nt = row // rows
    t = nt % T
    n = nt // T
    cols = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = cols < W
    x_base = x_ptr + n * sxn + t * sxt + cols * sxw
    # Which source feeds output row i: 0 = zeros, 1 = x row `src`, 2 = recv_lo, 3 = recv_hi.
    kind = 1
    src = i - LO
    if i < LO:
        if LO_MODE == RECV:
            kind = 2
        elif LO_MODE == ZERO:
            kind = 0
        else:
            src = 0
    elif i >= LO + H:
        if HI_MODE == RECV:
            kind = 3
        elif HI_MODE == ZERO:
            kind = 0
        else:
            src = H - 1
    if kind == 1:
        vals = tl.load(x_base + src * sxh, mask=mask)
    elif kind == 2:
        vals = tl.load(lo_ptr + (nt * LO + i) * W + cols, mask=mask)
    elif kind == 3:
        vals = tl.load(hi_ptr + (nt * HI + (i - LO - H)) * W + cols, mask=mask)
    else:
        vals = tl.zeros([BLOCK_W], dtype=out_ptr.dtype.element_ty)
    tl.store(out_ptr + n * son + t * sot + i * soh + cols * sow, vals, mask=mask)


def _block_w(width: int) -> int:
    return min(1024, max(16, triton.next_power_of_2(width)))


def launch_halo_pack_triton(x: torch.Tensor, send_lo: torch.Tensor, send_hi: torch.Tensor) -> None:
    """Pack the boundary rows of ``x [N, T, h, W]`` into contiguous ``send_lo``/``send_hi``."""
    n, t, h, w = x.shape
    n_lo, n_hi = send_lo.shape[2], send_hi.shape[2]
    if n * t * (n_lo + n_hi) * w == 0:
        return
    block = _block_w(w)
    grid = (n * t * (n_lo + n_hi), triton.cdiv(w, block))
    _halo_pack_kernel[grid](
        x, send_lo, send_hi, t, h, w, n_lo, n_hi, *x.stride(),
        BLOCK_W=block, num_warps=4 if block >= 512 else 2,
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
    block = _block_w(w)
    grid = (n * t * (lo_rows + h + hi_rows), triton.cdiv(w, block))
    # An unused halo pointer still needs a tensor of the right dtype; x stands in.
    _halo_assemble_kernel[grid](
        x, x if recv_lo is None else recv_lo, x if recv_hi is None else recv_hi, out,
        t, h, w, lo_rows, hi_rows, *x.stride(), *out.stride(), lo_mode, hi_mode,
        RECV=HALO_RECV, ZERO=HALO_ZERO, REPLICATE=HALO_REPLICATE,
        BLOCK_W=block, num_warps=4 if block >= 512 else 2,
    )
