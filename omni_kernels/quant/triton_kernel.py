"""Triton kernel for per-token activation quantization, optionally fused with a norm and adaLN.

The operation is defined by :mod:`omni_kernels.quant.reference`; this is the
``backend="triton"`` path of :func:`omni_kernels.quant.quantize_per_token`,
reached through the custom op ``torch.ops.omni_kernels.quantize_per_token_triton``.

One program per row (token) by default. When the row fits one register tile
(``K <= MAX_TILE``, every DiT width up to Flux's 15360), the row is loaded
once and kept in registers: the mean, the variance (two-pass, exact), the
absolute maximum and the quantized values all come from the same registers, so
HBM sees one read of ``x`` and one write of ``q``. Longer rows loop over chunks
and re-read them (from L2) for each pass. As a tuning option (``rows_per_program``), a program
quantizes several consecutive single-tile rows as one ``[ROWS, BLOCK_K]`` tile, each row with its
own reductions along the tile's rows and the same arithmetic, so the same codes and scales: short
rows (Flux's 3072) leave one program per row too little work to keep HBM busy.

Rounding: FP8 through Triton's float32 -> e4m3 conversion (round to nearest
even; the value is clamped to +-448 first), INT8 through ``rint`` (round half
to even, as ``torch.round``). Under the interpreter ``rint`` is computed with
``floor`` (libdevice has no interpreter implementation); the interpreter has no
FP8 either, so there the kernel produces INT8 only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from omni_kernels._triton import cdiv, triton_interpreter_enabled
from omni_kernels.quant.reference import FP8_DTYPE, MIN_ABSMAX, qmax_of

try:  # triton >= 3.0
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older triton
    libdevice = None

# Rows up to this many elements stay in registers (one tile per program).
MAX_TILE = 16384
# Chunk length when a row is longer than MAX_TILE.
_CHUNK = 4096

NORM_NONE, NORM_RMS, NORM_LAYER = 0, 1, 2
_NORM_CODES = {None: NORM_NONE, "rms": NORM_RMS, "layer": NORM_LAYER}


@triton.jit
def _round_half_even(v, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        return libdevice.rint(v)
    else:
        # floor(v + 0.5), moved down by one at exact ties that landed on an odd value.
        r = tl.floor(v + 0.5)
        tie = (r - v) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _inv_sqrt(v):
    """``1 / sqrt(v)``, both correctly rounded, as the reference computes it."""
    root = tl.sqrt_rn(v)
    return tl.math.div_rn(root * 0.0 + 1.0, root)  # a 1.0 of root's (scalar tensor) type


@triton.jit
def _transform(
    x, cols, mask, mean, rstd, w_ptr, b_ptr, ms_ptr, mt_ptr, mod_row, clamp_val,
    NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    HAS_MOD_SCALE: tl.constexpr, HAS_MOD_SHIFT: tl.constexpr, HAS_CLAMP: tl.constexpr,
):
    """``y`` of the reference from float32 ``x`` given the row's ``mean``/``rstd``."""
    if NORM == 2:
        y = (x - mean) * rstd
    elif NORM == 1:
        y = x * rstd
    else:
        y = x
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_MOD_SCALE:
        y = y * (1.0 + tl.load(ms_ptr + mod_row + cols, mask=mask, other=0.0).to(tl.float32))
    if HAS_MOD_SHIFT:
        y = y + tl.load(mt_ptr + mod_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_CLAMP:
        y = tl.minimum(tl.maximum(y, -clamp_val), clamp_val)
    return tl.where(mask, y, 0.0)


@triton.jit
def quantize_store(y, inv, q_ptr, cols, mask, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
                    USE_LIBDEVICE: tl.constexpr):
    v = tl.minimum(tl.maximum(y * inv, -QMAX), QMAX)
    if IS_INT8:
        v = _round_half_even(v, USE_LIBDEVICE)
    tl.store(q_ptr + cols, v.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, q_ptr, s_ptr, w_ptr, b_ptr, ms_ptr, mt_ptr,
    K, x_row_stride, q_row_stride, mod_row_stride, rows_per_group,
    eps, clamp_val,
    p_ptr, p_row_stride, sample_rows, prefix_rows,
    NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    HAS_MOD_SCALE: tl.constexpr, HAS_MOD_SHIFT: tl.constexpr, HAS_CLAMP: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, MIN_AMAX: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_TILE: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    # Inductor launches a traced triton_op's kernel with Python floats typed fp64; the math is fp32.
    eps = tl.cast(eps, tl.float32)
    clamp_val = tl.cast(clamp_val, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    if HAS_PREFIX:
        # Row r of cat([prefix, x], dim=-2): each sample's sample_rows rows are its prefix_rows
        # rows of prefix, then its rows of x; read in place, the cat is never written.
        sample = row // sample_rows
        t = row - sample * sample_rows
        if t < prefix_rows:
            x_row = p_ptr + (sample * prefix_rows + t) * p_row_stride
        else:
            x_row = x_ptr + (sample * (sample_rows - prefix_rows) + t - prefix_rows) * x_row_stride
    else:
        x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * q_row_stride
    mod_row = (row // rows_per_group) * mod_row_stride
    kf = K * 1.0
    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_K)
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        mean = 0.0
        rstd = 1.0
        if NORM == 2:
            mean = tl.math.div_rn(tl.sum(x, axis=0), kf)
            d = tl.where(mask, x - mean, 0.0)
            rstd = _inv_sqrt(tl.math.div_rn(tl.sum(d * d, axis=0), kf) + eps)
        elif NORM == 1:
            rstd = _inv_sqrt(tl.math.div_rn(tl.sum(x * x, axis=0), kf) + eps)
        y = _transform(x, cols, mask, mean, rstd, w_ptr, b_ptr, ms_ptr, mt_ptr, mod_row, clamp_val,
                       NORM, HAS_W, HAS_B, HAS_MOD_SCALE, HAS_MOD_SHIFT, HAS_CLAMP)
        amax = tl.maximum(tl.max(tl.abs(y), axis=0), MIN_AMAX)
        tl.store(s_ptr + row, tl.math.div_rn(amax, QMAX))
        inv = tl.math.div_rn(QMAX, amax)
        quantize_store(y, inv, q_row, cols, mask, QMAX, IS_INT8, USE_LIBDEVICE)
    else:
        # Long rows: one pass per statistic, each re-reading the row (from L2).
        mean = 0.0
        rstd = 1.0
        if NORM == 2:
            acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                acc += tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            mean = tl.math.div_rn(tl.sum(acc, axis=0), kf)
            acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                mask = cols < K
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                d = tl.where(mask, x - mean, 0.0)
                acc += d * d
            rstd = _inv_sqrt(tl.math.div_rn(tl.sum(acc, axis=0), kf) + eps)
        elif NORM == 1:
            acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
                acc += x * x
            rstd = _inv_sqrt(tl.math.div_rn(tl.sum(acc, axis=0), kf) + eps)
        amax_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            y = _transform(x, cols, mask, mean, rstd, w_ptr, b_ptr, ms_ptr, mt_ptr, mod_row,
                           clamp_val, NORM, HAS_W, HAS_B, HAS_MOD_SCALE, HAS_MOD_SHIFT, HAS_CLAMP)
            amax_acc = tl.maximum(amax_acc, tl.abs(y))
        amax = tl.maximum(tl.max(amax_acc, axis=0), MIN_AMAX)
        tl.store(s_ptr + row, tl.math.div_rn(amax, QMAX))
        inv = tl.math.div_rn(QMAX, amax)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            y = _transform(x, cols, mask, mean, rstd, w_ptr, b_ptr, ms_ptr, mt_ptr, mod_row,
                           clamp_val, NORM, HAS_W, HAS_B, HAS_MOD_SCALE, HAS_MOD_SHIFT, HAS_CLAMP)
            quantize_store(y, inv, q_row, cols, mask, QMAX, IS_INT8, USE_LIBDEVICE)



@triton.jit
def _quantize_rows_per_token_kernel(
    x_ptr, q_ptr, s_ptr, w_ptr, b_ptr, ms_ptr, mt_ptr,
    M, K, x_row_stride, q_row_stride, mod_row_stride, rows_per_group,
    eps, clamp_val,
    NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    HAS_MOD_SCALE: tl.constexpr, HAS_MOD_SHIFT: tl.constexpr, HAS_CLAMP: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, MIN_AMAX: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_TILE: tl.constexpr,
    ROWS: tl.constexpr,
):
    """``ROWS`` consecutive rows a program, as a ``[ROWS, BLOCK_K]`` register tile.

    Each row's statistics are reductions along axis 1 with ``keep_dims`` (``[ROWS, 1]``), and
    every element goes through the single-tile path of :func:`_quantize_per_token_kernel`'s
    operations in the same order, so each row gets that kernel's codes and scale. (On the GPU
    the sums' order follows the thread layout: for sm_90 Triton lays a row of the tile out as
    the one-row kernel's row at the same ``num_warps``; another warp count may round the
    LayerNorm/RMS sums apart in the last bit, as it would for the one-row kernel.)
    """
    eps = tl.cast(eps, tl.float32)  # (fp64 when Inductor launches it: see _quantize_per_token_kernel)
    clamp_val = tl.cast(clamp_val, tl.float32)
    tl.static_assert(SINGLE_TILE, "rows_per_program > 1 needs rows that fit one register tile")
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    row_ids = first_row + tl.arange(0, ROWS)
    row_valid = (row_ids < M)[:, None]
    # The last program's rows past M repeat row M - 1, so loads need only the column mask; the
    # stores are masked by row_valid.
    rows = tl.minimum(row_ids, M - 1)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
    col_mask = cols < K
    mod_row = (rows // rows_per_group) * mod_row_stride
    kf = K * 1.0
    x = tl.load(x_ptr + rows * x_row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    mean = 0.0
    rstd = 1.0
    if NORM == 2:
        mean = tl.math.div_rn(tl.sum(x, axis=1, keep_dims=True), kf)
        d = tl.where(col_mask, x - mean, 0.0)
        rstd = _inv_sqrt(tl.math.div_rn(tl.sum(d * d, axis=1, keep_dims=True), kf) + eps)
    elif NORM == 1:
        rstd = _inv_sqrt(tl.math.div_rn(tl.sum(x * x, axis=1, keep_dims=True), kf) + eps)
    y = _transform(x, cols, col_mask, mean, rstd, w_ptr, b_ptr, ms_ptr, mt_ptr, mod_row, clamp_val,
                   NORM, HAS_W, HAS_B, HAS_MOD_SCALE, HAS_MOD_SHIFT, HAS_CLAMP)
    amax = tl.maximum(tl.max(tl.abs(y), axis=1, keep_dims=True), MIN_AMAX)  # [ROWS, 1]
    tl.store(s_ptr + rows, tl.math.div_rn(amax, QMAX), mask=row_valid)
    inv = tl.math.div_rn(QMAX, amax)
    quantize_store(y, inv, q_ptr + rows * q_row_stride, cols, col_mask & row_valid, QMAX, IS_INT8,
                   USE_LIBDEVICE)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=256)
def launch_config(k: int, max_tile: int) -> tuple[int, bool, int]:
    """``(BLOCK_K, SINGLE_TILE, num_warps)``: a single tile gets about 32 values a thread, 1 to 8
    warps; chunked rows 8 warps.

    32 rather than 16 values a thread: at K = 3072 (a 4096 tile) 4 warps beat 8, plain and
    norm-fused; tiles of 8192 and more keep 8 warps (best in the GELU-fused kernel's sweep)."""
    if k <= max_tile:
        block = max(16, _next_power_of_2(k))
        return block, True, max(1, min(8, block // 1024))
    return _CHUNK, False, 8


def multi_row_warps(rows_per_program: int, block: int) -> int:
    """Default ``num_warps`` of a ``[rows_per_program, block]`` tile: about 16 values a thread, 1 to 8."""
    return max(1, min(8, rows_per_program * block // 512))


def row_quantization_constants(out_dtype: torch.dtype, clamp: float, block: int, single: bool) -> dict:
    """The constexpr arguments every per-row quantization kernel here takes."""
    return dict(
        HAS_CLAMP=clamp > 0,
        QMAX=qmax_of(out_dtype),
        IS_INT8=out_dtype != FP8_DTYPE,
        MIN_AMAX=MIN_ABSMAX,
        USE_LIBDEVICE=libdevice is not None and not triton_interpreter_enabled(),
        BLOCK_K=block,
        SINGLE_TILE=single,
    )


ROWS_PER_PROGRAM_CHOICES = (1, 2, 4, 8, 16, 32, 64)
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16, 32)


def _check_tuning_options(rows_per_program, num_warps, k: int, single: bool, max_tile: int) -> None:
    """Raise ``ValueError`` for a ``rows_per_program``/``num_warps`` the kernels cannot take."""
    if isinstance(rows_per_program, bool) or rows_per_program not in ROWS_PER_PROGRAM_CHOICES:
        raise ValueError(f"rows_per_program must be one of {ROWS_PER_PROGRAM_CHOICES}; got {rows_per_program!r}")
    if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in NUM_WARPS_CHOICES):
        raise ValueError(f"num_warps must be None or one of {NUM_WARPS_CHOICES}; got {num_warps!r}")
    if rows_per_program > 1 and not single:
        raise ValueError(
            f"rows_per_program={rows_per_program} needs rows that fit one register tile "
            f"(K <= max_tile={max_tile}); got K={k}: use rows_per_program=1"
        )


def launch_quantize_per_token_triton(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    mod_scale: torch.Tensor | None,
    mod_shift: torch.Tensor | None,
    norm: int,
    eps: float,
    clamp: float,
    out_dtype: torch.dtype,
    *,
    max_tile: int = MAX_TILE,
    rows_per_program: int = 1,
    num_warps: int | None = None,
    prefix: torch.Tensor | None = None,
    batch: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``x`` ``[M, K]``; returns ``(q [M, K], scale [M, 1] float32)``.

    With ``prefix`` ``[batch * P, K]`` (unit column stride, ``x``'s dtype), the rows quantized
    are those of ``cat([prefix.view(batch, P, K), x.view(batch, S, K)], 1)`` flattened, read in
    place: ``q`` and ``scale`` have ``batch * (P + S)`` rows in that order (a joint text + image
    sequence whose two parts are separate tensors). One row a program only.

    Arguments are validated by :func:`omni_kernels.quant.quantize_per_token`:
    ``x`` has unit column stride; ``norm_weight``/``norm_bias`` are ``[K]``;
    ``mod_scale``/``mod_shift`` are ``[G, K]`` with ``M % G == 0`` (copied to
    contiguous if they are not: they are small); ``norm`` is 0 (none), 1 (RMS) or 2 (LayerNorm); ``clamp``
    <= 0 means no clamp. ``max_tile`` exists for tests of the chunked path.

    Tuning options (the defaults are what the op launches): ``rows_per_program`` (a power of
    two, 1 to 64; > 1 only for rows of at most ``max_tile`` values) quantizes that many
    consecutive rows in one program, as a ``[rows_per_program, BLOCK_K]`` tile, with the same
    arithmetic a row; ``num_warps`` (a power of two, 1 to 32; ``None``: :func:`launch_config`'s
    for one row, and for several rows about 16 values a thread, at most 8 warps).
    """
    m, k = x.shape
    if prefix is not None:
        if rows_per_program != 1:
            raise ValueError(f"prefix takes one row a program; got rows_per_program={rows_per_program}")
        if batch < 1 or prefix.shape[0] % batch or m % batch or prefix.shape[1] != k:
            raise ValueError(f"prefix [batch * P, K={k}] and x [batch * S, K] with batch={batch}; "
                             f"got {tuple(prefix.shape)} and {tuple(x.shape)}")
        m += prefix.shape[0]
    block, single, default_warps = launch_config(k, max_tile)
    _check_tuning_options(rows_per_program, num_warps, k, single, max_tile)
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        scale.fill_(MIN_ABSMAX / qmax_of(out_dtype))
        return q, scale
    norm_weight = norm_weight.contiguous() if norm_weight is not None else None
    norm_bias = norm_bias.contiguous() if norm_bias is not None else None
    mod_scale = mod_scale.contiguous() if mod_scale is not None else None
    mod_shift = mod_shift.contiguous() if mod_shift is not None else None
    mod = mod_scale if mod_scale is not None else mod_shift
    groups = mod.shape[0] if mod is not None else 1
    dummy = scale  # an unused pointer argument still needs a tensor; never dereferenced
    pointers = (
        x, q, scale,
        norm_weight if norm_weight is not None else dummy,
        norm_bias if norm_bias is not None else dummy,
        mod_scale if mod_scale is not None else dummy,
        mod_shift if mod_shift is not None else dummy,
    )
    row_scalars = (x.stride(0), q.stride(0), k, m // groups, float(eps), float(clamp))
    constants = dict(
        NORM=int(norm),
        HAS_W=norm_weight is not None,
        HAS_B=norm_bias is not None,
        HAS_MOD_SCALE=mod_scale is not None,
        HAS_MOD_SHIFT=mod_shift is not None,
        **row_quantization_constants(out_dtype, clamp, block, single),
    )
    # wrap_triton: under torch.compile Inductor traces the triton_op around this and launches
    # the kernel from its generated code (no Python launcher, no custom-op call a step).
    if rows_per_program == 1:
        prefix_args = ((prefix, prefix.stride(0), m // batch, prefix.shape[0] // batch) if prefix is not None
                       else (dummy, 0, 1, 0))
        wrap_triton(_quantize_per_token_kernel)[(m,)](
            *pointers, k, *row_scalars, *prefix_args, **constants, HAS_PREFIX=prefix is not None,
            num_warps=num_warps or default_warps,
        )
    else:
        wrap_triton(_quantize_rows_per_token_kernel)[(cdiv(m, rows_per_program),)](
            *pointers, m, k, *row_scalars, **constants, ROWS=rows_per_program,
            num_warps=num_warps or multi_row_warps(rows_per_program, block),
        )
    return q, scale
