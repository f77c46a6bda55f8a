"""PyTorch reference of the halo pack / assemble ops (the definition the kernels are tested against).

Layout shared by every backend. A feature map sharded along its height is viewed as
``x [N, T, h, W]`` (``N`` = batch x channels, ``T`` = frames, 1 for images; any strides):

* **pack** copies the first ``n_lo`` rows of ``x`` into ``send_lo [N, T, n_lo, W]`` and the last
  ``n_hi`` rows into ``send_hi [N, T, n_hi, W]`` (both contiguous: they are handed to
  ``isend``), the rows the neighbours above and below need;
* **assemble** writes a convolution's input ``out [N, T, lo + h + hi, W]`` (any strides, normally
  a view into a persistent pre-padded buffer): rows ``[0, lo)`` from ``recv_lo`` (mode
  :data:`HALO_RECV`), zeros (:data:`HALO_ZERO`, a global zero-padded edge) or copies of ``x``'s
  first row (:data:`HALO_REPLICATE`, a global replicate-padded edge); rows ``[lo, lo + h)`` from
  ``x``; rows ``[lo + h, lo + h + hi)`` likewise from ``recv_hi`` / zeros / ``x``'s last row.
"""

from __future__ import annotations

import torch

HALO_RECV = 0
HALO_ZERO = 1
HALO_REPLICATE = 2
HALO_MODES = (HALO_RECV, HALO_ZERO, HALO_REPLICATE)


def halo_pack_reference(x: torch.Tensor, send_lo: torch.Tensor, send_hi: torch.Tensor) -> None:
    """Copy ``x[:, :, :n_lo]`` into ``send_lo`` and ``x[:, :, h - n_hi:]`` into ``send_hi``."""
    n_lo, n_hi, h = send_lo.shape[2], send_hi.shape[2], x.shape[2]
    send_lo.copy_(x[:, :, :n_lo])
    send_hi.copy_(x[:, :, h - n_hi :])


def _edge_rows(x, recv, rows, mode, first):
    if rows == 0:
        return None
    if mode == HALO_RECV:
        return recv
    if mode == HALO_ZERO:
        return x.new_zeros(x.shape[0], x.shape[1], rows, x.shape[3])
    edge = x[:, :, :1] if first else x[:, :, -1:]
    return edge.expand(-1, -1, rows, -1)


def halo_assemble_reference(
    x: torch.Tensor,
    recv_lo: torch.Tensor | None,
    recv_hi: torch.Tensor | None,
    out: torch.Tensor,
    lo_rows: int,
    hi_rows: int,
    lo_mode: int,
    hi_mode: int,
) -> None:
    """Write ``cat([lo edge, x, hi edge], dim=2)`` into ``out`` (see the module docstring)."""
    h = x.shape[2]
    lo = _edge_rows(x, recv_lo, lo_rows, lo_mode, first=True)
    hi = _edge_rows(x, recv_hi, hi_rows, hi_mode, first=False)
    if lo is not None:
        out[:, :, :lo_rows].copy_(lo)
    out[:, :, lo_rows : lo_rows + h].copy_(x)
    if hi is not None:
        out[:, :, lo_rows + h :].copy_(hi)
