"""Halo pack / assemble kernels against the PyTorch reference (CPU: Triton interpreter; GPU: CUDA)."""

from __future__ import annotations

import pytest
import torch

from omni_kernels.halo import (
    HALO_RECV,
    HALO_REPLICATE,
    HALO_ZERO,
    halo_assemble,
    halo_assemble_reference,
    halo_pack,
    halo_pack_reference,
)

# (N, T, h, W): odd heights and widths, one Wan-like video shard, one image shard.
SHAPES = [(3, 1, 7, 37), (2, 3, 5, 130), (4, 2, 1, 9)]
MODES = [(HALO_RECV, HALO_RECV), (HALO_ZERO, HALO_RECV), (HALO_RECV, HALO_REPLICATE),
         (HALO_REPLICATE, HALO_ZERO)]


def _strided_x(inputs, shape, dtype, device):
    # A view with a padded width and frames axis, so strides are not the contiguous ones.
    n, t, h, w = shape
    base = inputs.activations((n, t + 1, h, w + 3), dtype, device)
    return base[:, 1:, :, 2 : w + 2]


def _backends(device):
    return ["cuda", "triton"] if device == "cuda" else ["triton"]


def _x(inputs, shape, dtype, device, dense):
    # dense: contiguous x, the CUDA kernels' vectorized path; else a strided view (rows path).
    return (inputs.activations(shape, dtype, device) if dense
            else _strided_x(inputs, shape, dtype, device))


def _run_pack(inputs, rel_err, shape, dtype, device, n_lo, n_hi, dense=False):
    x = _x(inputs, shape, dtype, device, dense)
    n, t, h, w = shape
    ref_lo = torch.empty(n, t, n_lo, w, dtype=dtype, device=device)
    ref_hi = torch.empty(n, t, n_hi, w, dtype=dtype, device=device)
    halo_pack_reference(x, ref_lo, ref_hi)
    for backend in _backends(device):
        lo = torch.full_like(ref_lo, float("nan"))
        hi = torch.full_like(ref_hi, float("nan"))
        halo_pack(x, lo, hi, backend=backend)
        assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi), backend
        assert rel_err(lo, x[:, :, :n_lo]) == 0.0


def _run_assemble(inputs, shape, dtype, device, lo_rows, hi_rows, modes, dense=False):
    n, t, h, w = shape
    x = _x(inputs, shape, dtype, device, dense)
    recv_lo = inputs.activations((n, t, lo_rows, w), dtype, device)
    recv_hi = inputs.activations((n, t, hi_rows, w), dtype, device)
    ref = torch.empty(n, t, lo_rows + h + hi_rows, w, dtype=torch.float64, device=device)
    halo_assemble_reference(x.double(), recv_lo.double(), recv_hi.double(), ref, lo_rows, hi_rows,
                            *modes)
    for backend in _backends(device):
        # The output is a view into a pre-padded buffer (2 leading zero frames, as the causal
        # conv wrappers pass it; width padding too unless dense).
        pad_w = 0 if dense else 2
        buffer = torch.full((n, t + 2, lo_rows + h + hi_rows, w + pad_w), float("nan"),
                            dtype=dtype, device=device)
        out = buffer[:, 2:, :, pad_w // 2 : w + pad_w // 2]
        halo_assemble(x, recv_lo, recv_hi, out, lo_rows=lo_rows, hi_rows=hi_rows, lo_mode=modes[0],
                      hi_mode=modes[1], backend=backend)
        assert torch.equal(out.double(), ref), backend
        # Nothing outside the view was written.
        assert torch.isnan(buffer[:, :2]).all()
        assert dense or torch.isnan(buffer[..., 0]).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pack_matches_reference(inputs, rel_err, shape, dtype):
    h = shape[2]
    _run_pack(inputs, rel_err, shape, dtype, "cpu", n_lo=min(1, h), n_hi=min(2, h))


def test_pack_zero_rows_on_one_side(inputs, rel_err):
    _run_pack(inputs, rel_err, (2, 1, 6, 11), torch.float32, "cpu", n_lo=0, n_hi=3)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("modes", MODES)
def test_assemble_matches_reference(inputs, shape, modes):
    _run_assemble(inputs, shape, torch.float32, "cpu", 1, 2, modes)


def test_assemble_fp16_no_halo_on_one_side(inputs):
    _run_assemble(inputs, (2, 2, 5, 21), torch.float16, "cpu", 0, 1, (HALO_ZERO, HALO_RECV))


def test_bad_arguments_name_the_argument():
    x = torch.zeros(2, 1, 4, 8)
    with pytest.raises(ValueError, match="send_lo"):
        halo_pack(x, torch.zeros(2, 1, 5, 8), torch.zeros(2, 1, 1, 8))
    with pytest.raises(ValueError, match="recv_lo is required"):
        halo_assemble(x, None, None, torch.zeros(2, 1, 6, 8), lo_rows=1, hi_rows=1,
                      lo_mode=HALO_RECV, hi_mode=HALO_ZERO)
    with pytest.raises(ValueError, match="lo_mode"):
        halo_assemble(x, None, None, torch.zeros(2, 1, 6, 8), lo_rows=1, hi_rows=1,
                      lo_mode=7, hi_mode=HALO_ZERO)
    with pytest.raises(ValueError, match="out must be"):
        halo_assemble(x, None, None, torch.zeros(2, 1, 5, 8), lo_rows=1, hi_rows=1,
                      lo_mode=HALO_ZERO, hi_mode=HALO_ZERO)
    with pytest.raises(ValueError, match="backend"):
        halo_pack(x, torch.zeros(2, 1, 1, 8), torch.zeros(2, 1, 1, 8), backend="cudnn")


def test_assemble_dense_layout(inputs):
    # The layout the spatial wrappers pass (contiguous x, height-padded buffer view).
    _run_assemble(inputs, (2, 3, 5, 16), torch.float32, "cpu", 1, 1, (HALO_RECV, HALO_REPLICATE),
                  dense=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_and_triton_match_reference_on_gpu(inputs, rel_err, dtype):
    # Strided views take the rows path; contiguous ones the vectorized path: widths with 16-, 8-,
    # 4- and 2-byte vectors (W = 160, 4, 2, 37 at 2 bytes), a slab longer than one block.
    for shape, dense in [*[(s, False) for s in SHAPES], ((2, 96, 3, 1280), False),
                         ((3, 2, 45, 160), True), ((2, 3, 5, 4), True), ((4, 1, 3, 2), True),
                         ((3, 1, 7, 37), True), ((1, 70000, 2, 8), True)]:
        h = shape[2]
        _run_pack(inputs, rel_err, shape, dtype, "cuda", n_lo=min(1, h), n_hi=min(2, h),
                  dense=dense)
        for modes in MODES:
            _run_assemble(inputs, shape, dtype, "cuda", 1, 2, modes, dense=dense)


def _opcheck_args(device):
    x = torch.randn(2, 3, 5, 7, device=device)
    send_lo, send_hi = torch.empty(2, 3, 1, 7, device=device), torch.empty(2, 3, 2, 7, device=device)
    recv_lo, recv_hi = torch.randn(2, 3, 1, 7, device=device), torch.randn(2, 3, 2, 7, device=device)
    out = torch.empty(2, 3, 8, 7, device=device)
    return ((x, send_lo, send_hi),
            (x, recv_lo, recv_hi, out, 1, 2, HALO_RECV, HALO_REPLICATE))


def test_triton_ops_pass_opcheck():
    pack_args, assemble_args = _opcheck_args("cpu")
    torch.library.opcheck(torch.ops.omni_kernels.halo_pack_triton.default, pack_args)
    torch.library.opcheck(torch.ops.omni_kernels.halo_assemble_triton.default, assemble_args)


@pytest.mark.gpu
def test_cuda_ops_pass_opcheck():
    pack_args, assemble_args = _opcheck_args("cuda")
    torch.library.opcheck(torch.ops.omni_kernels.halo_pack.default, pack_args)
    torch.library.opcheck(torch.ops.omni_kernels.halo_assemble.default, assemble_args)
