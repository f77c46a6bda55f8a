"""Dense attention forward (FlashAttention-2 style) in Triton, tuned for Hopper.

:func:`flash_attention_forward` computes ``softmax(scale * q k^T + mask) v``
with the semantics defined in :mod:`omni_kernels.attention.reference`:
layouts ``bhsd``/``bshd`` (read through strides, never copied), GQA/MQA
(query head ``h`` reads kv head ``h // (Hq // Hkv)``), ``causal`` **top-left
aligned** as torch SDPA's ``is_causal=True`` (query ``i`` sees keys ``j <= i``,
also when ``Sq != Skv``), per-sample ``key_lengths`` (keys ``j >= key_lengths[b]``
masked), and rows with no valid key output 0 with ``lse = -inf``.

Kernel design
-------------
* One program per ``(query block of BLOCK_M rows, batch * query head)``, on a
  1-D grid with the query block fastest: all query blocks of a head (and the
  heads of a GQA group, which are adjacent) run together, so each K/V head is
  read from HBM about once and then served from L2. Under ``causal`` the query
  blocks of a head run heaviest-first, so the grid's tail is short programs.
* ``BLOCK_M = 128`` with ``num_warps = 8`` on Hopper: two warpgroups of 64 rows
  each issue ``wgmma`` for ``S = Q K^T`` and ``O += P V``. Q stays on chip for
  the whole program; K/V tiles stream through a ``num_stages``-deep ``cp.async``
  pipeline, or TMA loads from host-built descriptors with ``use_tma``.
* Online softmax in base 2 with ``log2(e)`` folded into the scale: one FMA and
  one ``exp2`` per score.
* The key range of a program is split into *full* blocks, run by a loop with
  no masks and no predicated loads, and at most a few *masked* blocks: the
  ragged end (``Skv`` or ``key_lengths[b]`` not a multiple of ``BLOCK_N``) and,
  under ``causal``, the blocks crossing the diagonal. Blocks entirely above the
  diagonal are never visited.
* Head dims that are multiples of 16 but not powers of two (80, 96, 160, 192)
  are padded to ``BLOCK_D`` with masked (zero) loads.
* Batch/head/row offsets are formed in 64-bit; tensors over 2**31 elements work.

Configs: a fixed default per head dim (:func:`default_config`). Setting
``OMNI_ATTENTION_AUTOTUNE=1`` times :func:`autotune_candidates` once per
``(head_dim, causal, dtype)`` and keeps the winner for the process. Under
``TRITON_INTERPRET=1`` 16x16 blocks are used and nothing is tuned.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from omni_kernels._device import cuda_capability, cuda_index
from omni_kernels._triton import cdiv, triton_interpreter_enabled, triton_unavailable_reason
from omni_kernels.attention.reference import ATTENTION_LAYOUTS

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
AUTOTUNE_ENV = "OMNI_ATTENTION_AUTOTUNE"

try:  # host-built TMA descriptors (Triton >= 3.4); only for the optional use_tma path
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except Exception:  # pragma: no cover - older Triton
    _TensorDescriptor = None

_LN2 = tl.constexpr(0.6931471805599453)


# --------------------------------------------------------------------------- kernel


@triton.jit
def _attn_range(
    acc, l_i, m_i, q,
    k_base, v_base, k_desc, v_desc, kv_row0, kv_col,
    stride_kn, stride_vn,
    offs_m, offs_n, offs_d,
    lo, hi, kv_len, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr, FP32: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """Online-softmax over key blocks ``[lo, hi)`` (``lo`` a multiple of ``BLOCK_N``).

    ``MASKED=False`` is the hot loop: every key of every block is visible to
    every row, so there are no compares and no predicated loads.
    ``WARP_SPECIALIZE`` asks Triton's compiler to split the loop into producer
    (loads) and consumer (MMA + softmax) warp groups.
    """
    k_ptrs = k_base + tl.cast(lo, tl.int64) * stride_kn + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = v_base + tl.cast(lo, tl.int64) * stride_vn + offs_n[:, None] * stride_vn + offs_d[None, :]
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if MASKED:
            key_ok = (start_n + offs_n) < kv_len
        # ---- K tile, [BLOCK_D, BLOCK_N] (transposed: B operand of q @ k)
        if USE_TMA:
            k = tl.trans(k_desc.load([kv_row0 + start_n, kv_col]))
        elif MASKED:
            kmask = key_ok[None, :]
            if HEAD_DIM != BLOCK_D:
                kmask = kmask & (offs_d < HEAD_DIM)[:, None]
            k = tl.load(k_ptrs, mask=kmask, other=0.0)
        elif HEAD_DIM != BLOCK_D:
            k = tl.load(k_ptrs, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        # ---- scores (log2 domain) and online softmax
        if FP32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if MASKED:
            valid = key_ok[None, :]
            if CAUSAL:
                valid = valid & ((start_n + offs_n)[None, :] <= offs_m[:, None])
            s = tl.where(valid, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # qk_scale > 0, so max(s) * qk_scale == max(s * qk_scale).
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        # ---- V tile, [BLOCK_N, BLOCK_D]
        if USE_TMA:
            v = v_desc.load([kv_row0 + start_n, kv_col])
            if MASKED:
                # Rows past kv_len may hold anything (padding, the next head):
                # p is 0 there, but 0 * NaN is NaN.
                v = tl.where(key_ok[:, None], v, 0.0)
        elif MASKED:
            vmask = key_ok[:, None]
            if HEAD_DIM != BLOCK_D:
                vmask = vmask & (offs_d < HEAD_DIM)[None, :]
            v = tl.load(v_ptrs, mask=vmask, other=0.0)
        elif HEAD_DIM != BLOCK_D:
            v = tl.load(v_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        if FP32:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _load_kv_tile(
    ptrs, desc, row, col, offs_d,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, D_AXIS: tl.constexpr,
):
    """An unmasked K (``D_AXIS=0``: ``[BLOCK_D, BLOCK_N]``) or V (``D_AXIS=1``) tile."""
    if USE_TMA:
        t = desc.load([row, col])
        if D_AXIS == 0:
            t = tl.trans(t)
    elif HEAD_DIM != BLOCK_D:
        if D_AXIS == 0:
            t = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
        else:
            t = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        t = tl.load(ptrs)
    return t


@triton.jit
def _attn_range_pipelined(
    acc, l_i, m_i, q,
    k_base, v_base, k_desc, v_desc, kv_row0, kv_col,
    stride_kn, stride_vn,
    offs_n, offs_d,
    hi, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Full key blocks ``[0, hi)``, ``hi > 0``, with ``S = Q K^T`` of the next block
    issued before the softmax of the current one (software pipelining in the
    source, so the tensor cores can work on block ``j+1`` while block ``j``'s
    exponentials run). 16/32-bit inputs only."""
    k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
    k = _load_kv_tile(k_ptrs, k_desc, kv_row0, kv_col, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, 0)
    s = tl.dot(q, k)
    for start_n in range(BLOCK_N, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_ptrs += BLOCK_N * stride_kn
        k = _load_kv_tile(
            k_ptrs, k_desc, kv_row0 + start_n, kv_col, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, 0
        )
        s_next = tl.dot(q, k)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        v = _load_kv_tile(
            v_ptrs, v_desc, kv_row0 + start_n - BLOCK_N, kv_col, offs_d,
            HEAD_DIM, BLOCK_D, USE_TMA, 1,
        )
        acc = tl.dot(p.to(v.dtype), v, acc)
        v_ptrs += BLOCK_N * stride_vn
        s = s_next
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = _load_kv_tile(
        v_ptrs, v_desc, kv_row0 + hi - BLOCK_N, kv_col, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, 1
    )
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, LSE, KEY_LENGTHS,
    q_desc, k_desc, v_desc,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    num_heads, num_kv_heads, seq_q, seq_k, num_m_blocks,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KEY_LENGTHS: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    USE_TMA: tl.constexpr,
    TMA_BSHD: tl.constexpr,
    FP32: tl.constexpr,
    PIPELINE_QK: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    m_block = pid % num_m_blocks
    if CAUSAL:
        m_block = num_m_blocks - 1 - m_block  # heaviest query block of the head first
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    kvh = h // (num_heads // num_kv_heads)
    start_m = m_block * BLOCK_M

    kv_len = seq_k
    if HAS_KEY_LENGTHS:
        kv_len = tl.minimum(tl.maximum(tl.load(KEY_LENGTHS + b), 0), seq_k)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_q

    b64 = b.to(tl.int64)
    k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh

    # TMA coordinates. bhsd descriptors view a tensor as [B*H*S, D];
    # bshd ones as [B*S, H*D] with the head as a column block.
    if TMA_BSHD:
        q_row0 = b * seq_q
        q_col = h * HEAD_DIM
        kv_row0 = b * seq_k
        kv_col = kvh * HEAD_DIM
    else:
        q_row0 = pid_bh * seq_q
        q_col = 0
        kv_row0 = (b * num_kv_heads + kvh) * seq_k
        kv_col = 0

    if USE_TMA:
        q = q_desc.load([q_row0 + start_m, q_col])
    else:
        q_ptrs = (
            Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
            + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
        )
        if HEAD_DIM == BLOCK_D:
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)

    # m starts finite (not -inf), so a row whose keys are all masked never forms
    # (-inf) - (-inf): its p stays 0, its l stays 0 and it is written as 0.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys [0, full_end) are visible to every row of the block: no mask.
    # Keys [full_end, hi) take the masked path: the ragged end and, for causal,
    # the blocks crossing the diagonal. Keys >= hi are never touched.
    if CAUSAL:
        hi = tl.minimum(kv_len, start_m + BLOCK_M)
        full_end = (tl.minimum(kv_len, start_m) // BLOCK_N) * BLOCK_N
    else:
        hi = kv_len
        full_end = (kv_len // BLOCK_N) * BLOCK_N

    if PIPELINE_QK:
        if full_end > 0:
            acc, l_i, m_i = _attn_range_pipelined(
                acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, kv_row0, kv_col,
                stride_kn, stride_vn, offs_n, offs_d,
                full_end, qk_scale,
                HEAD_DIM, BLOCK_D, BLOCK_N, USE_TMA,
            )
    else:
        acc, l_i, m_i = _attn_range(
            acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, kv_row0, kv_col,
            stride_kn, stride_vn, offs_m, offs_n, offs_d,
            0, full_end, kv_len, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, USE_TMA, FP32, WARP_SPECIALIZE,
        )
    acc, l_i, m_i = _attn_range(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, kv_row0, kv_col,
        stride_kn, stride_vn, offs_m, offs_n, offs_d,
        full_end, hi, kv_len, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, USE_TMA, FP32,
    )

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc * (1.0 / l_safe)[:, None]  # acc is 0 where l is 0
    o_ptrs = (
        Out + b64 * stride_ob + h.to(tl.int64) * stride_oh
        + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    )
    if HEAD_DIM == BLOCK_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(
            o_ptrs, out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
        )
    if RETURN_LSE:
        lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * _LN2, float("-inf"))
        tl.store(LSE + pid_bh.to(tl.int64) * seq_q + offs_m, lse, mask=row_ok)


# --------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of the kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # TMA loads from host-built descriptors (sm_90+, packed layouts)
    pipeline_qk: bool = False  # issue the next block's Q K^T before this block's softmax
    maxnreg: int | None = None  # register cap per thread (e.g. 128: two 8-warp CTAs per SM)
    warp_specialize: bool = False  # Triton's automatic producer/consumer warp specialization

    def describe(self) -> str:
        flags = ("+tma" if self.use_tma else "") + ("+pqk" if self.pipeline_qk else "")
        flags += "+ws" if self.warp_specialize else ""
        if self.maxnreg:
            flags += f" r{self.maxnreg}"
        return f"M{self.block_m}xN{self.block_n} w{self.num_warps} s{self.num_stages}{flags}"


_INTERPRETER_CONFIG = AttentionConfig(16, 16, 4, 1)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and cuda_capability(cuda_index(device))[0] == 9


def default_config(
    head_dim: int, causal: bool = False, dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> AttentionConfig:
    """The fixed (untimed) config for a head dim.

    Hopper (sm_90) values are the winners of bench/attention_tune.py: D=128
    ``M128xN128 w8 s3 +tma``, D=64 ``M128xN64 w8 s3``, D=256 ``M128xN32 w8 s3``.
    ``use_tma`` silently falls back to plain loads when a tensor's strides or
    alignment do not allow a TMA descriptor. Other GPUs get conservative
    configs that fit ~100 KB of shared memory.
    """
    if triton_interpreter_enabled():
        return _INTERPRETER_CONFIG
    device = torch.device("cuda") if device is None else torch.device(device)
    block_d = _block_d(head_dim)
    if dtype == torch.float32:
        return AttentionConfig(64, 32, 4, 2)
    if _is_hopper(device):
        if block_d <= 64:
            return AttentionConfig(128, 64, 8, 3)
        if block_d <= 128:
            return AttentionConfig(128, 128, 8, 3, use_tma=True)
        return AttentionConfig(128, 32, 8, 3)
    if block_d <= 64:
        return AttentionConfig(128, 64, 4, 3)
    if block_d <= 128:
        return AttentionConfig(128, 64, 8, 2)
    return AttentionConfig(64, 32, 4, 2)


def autotune_candidates(
    head_dim: int, causal: bool = False, dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> list[AttentionConfig]:
    """The short list that ``OMNI_ATTENTION_AUTOTUNE=1`` times (default config first)."""
    first = default_config(head_dim, causal, dtype, device)
    if triton_interpreter_enabled() or dtype == torch.float32:
        return [first]
    block_d = _block_d(head_dim)
    if block_d <= 64:
        cands = [(128, 64, 8, 3), (128, 64, 8, 4, True), (128, 128, 8, 3), (64, 64, 4, 3)]
    elif block_d <= 128:
        cands = [(128, 128, 8, 3, True), (128, 128, 8, 3), (128, 64, 8, 3, True),
                 (128, 128, 8, 2, True), (128, 64, 8, 4, True)]
    else:
        cands = [(128, 32, 8, 3), (128, 32, 8, 4), (128, 32, 8, 3, True), (128, 64, 8, 2)]
    out = [first]
    for c in cands:
        cfg = AttentionConfig(*c)
        if cfg not in out:
            out.append(cfg)
    return out


_AUTOTUNE_CACHE: dict[tuple, AttentionConfig] = {}


# --------------------------------------------------------------------------- host side


def bhs_strides(x: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, head, seq) strides of ``x`` in ``layout`` ("bhsd", else read as "bshd"; unchecked)."""
    if layout == "bhsd":
        return x.stride(0), x.stride(1), x.stride(2)
    return x.stride(0), x.stride(2), x.stride(1)


def bhs_sizes(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(B, H, S, D) of ``x`` in ``layout`` ("bhsd", else read as "bshd"; unchecked)."""
    if layout == "bhsd":
        return x.shape[0], x.shape[1], x.shape[2], x.shape[3]
    return x.shape[0], x.shape[2], x.shape[1], x.shape[3]


def _tma_view(x: torch.Tensor, layout: str, block_rows: int):
    """A 2-D TMA descriptor of ``x`` (see the kernel's coordinates), or None if it has none.

    bhsd needs [B, H, S] to flatten into one row index; bshd needs [B, S] to
    flatten and the heads packed (head stride == D). Both need 16-byte aligned
    base and row stride.
    """
    if _TensorDescriptor is None:
        return None
    batch, heads, seq, dim = bhs_sizes(x, layout)
    sb, sh, ss = bhs_strides(x, layout)
    esize = x.element_size()
    if x.data_ptr() % 16 or (ss * esize) % 16 or x.stride(3) != 1:
        return None
    if layout == "bhsd":
        if (heads > 1 and sh != seq * ss) or (batch > 1 and sb != heads * seq * ss):
            return None
        shape = [batch * heads * seq, dim]
    else:
        if (batch > 1 and sb != seq * ss) or (heads > 1 and sh != dim):
            return None
        shape = [batch * seq, heads * dim]
    try:
        return _TensorDescriptor(x, shape, [ss, 1], [block_rows, dim])
    except AssertionError:
        return None


def _validate(q, k, v, layout, key_lengths, out):
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f"layout must be one of {ATTENTION_LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor ({layout}), got {getattr(t, 'shape', t)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
        if t.stride(3) != 1 and t.shape[3] > 1:
            raise ValueError(
                f"{name}'s last dimension must be contiguous (stride 1), got strides {t.stride()}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    bq, hq, sq, d = bhs_sizes(q, layout)
    bk, hk, sk, dk = bhs_sizes(k, layout)
    bv, hv, sv, dv = bhs_sizes(v, layout)
    if not (bq == bk == bv):
        raise ValueError(f"batch sizes differ: q {bq}, k {bk}, v {bv}")
    if (hk, sk) != (hv, sv):
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not (d == dk == dv):
        raise ValueError(f"head dims differ: q {d}, k {dk}, v {dv}")
    if d % 16 != 0 or not 16 <= d <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {d} is not supported: use a multiple of 16 from 16 to {MAX_HEAD_DIM} "
            f"(64, 128 and 256 are the tuned ones)"
        )
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    if key_lengths is not None:
        if not isinstance(key_lengths, torch.Tensor) or key_lengths.shape != (bq,):
            raise ValueError(f"key_lengths must be an integer tensor of shape [{bq}]")
        if key_lengths.dtype.is_floating_point or key_lengths.dtype == torch.bool:
            raise ValueError(f"key_lengths must be an integer tensor, got {key_lengths.dtype}")
        if key_lengths.device != q.device:
            raise ValueError(f"key_lengths is on {key_lengths.device}, q on {q.device}")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must match q: shape {tuple(q.shape)} {q.dtype} on {q.device}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if out.stride(3) != 1 and out.shape[3] > 1:
            raise ValueError(f"out's last dimension must be contiguous, got strides {out.stride()}")
    return bq, hq, hk, sq, sk, d


def _launch(q, k, v, out, lse, key_lengths, layout, causal, qk_scale, cfg, dims):
    batch, hq, hkv, sq, sk, d = dims
    block_d = _block_d(d)
    num_m_blocks = cdiv(sq, cfg.block_m)
    fp32 = q.dtype == torch.float32
    q_desc = k_desc = v_desc = None
    use_tma = False
    if cfg.use_tma and block_d == d and not fp32:
        q_desc = _tma_view(q, layout, cfg.block_m)
        k_desc = _tma_view(k, layout, cfg.block_n)
        v_desc = _tma_view(v, layout, cfg.block_n)
        use_tma = q_desc is not None and k_desc is not None and v_desc is not None
        if not use_tma:
            q_desc = k_desc = v_desc = None
    sqb, sqh, sqm = bhs_strides(q, layout)
    skb, skh, skn = bhs_strides(k, layout)
    svb, svh, svn = bhs_strides(v, layout)
    sob, soh, som = bhs_strides(out, layout)
    grid = (num_m_blocks * batch * hq,)
    extra = {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}
    return _attn_fwd_kernel[grid](
        q, k, v, out, lse if lse is not None else out,
        key_lengths if key_lengths is not None else out,
        q_desc, k_desc, v_desc,
        sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
        hq, hkv, sq, sk, num_m_blocks,
        qk_scale,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        CAUSAL=bool(causal),
        HAS_KEY_LENGTHS=key_lengths is not None,
        RETURN_LSE=lse is not None,
        USE_TMA=use_tma,
        TMA_BSHD=use_tma and layout == "bshd",
        FP32=fp32,
        PIPELINE_QK=bool(cfg.pipeline_qk) and not fp32,
        WARP_SPECIALIZE=bool(cfg.warp_specialize) and not fp32 and not triton_interpreter_enabled(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **extra,
    )


def kernel_resource_usage(q, k, v, *, layout="bhsd", causal=False, config=None) -> dict:
    """Launch once with ``config`` and report the compiled kernel's registers,
    spills and shared memory (for tuning; GPU only)."""
    dims = _validate(q, k, v, layout, None, None)
    d = dims[-1]
    cfg = config or default_config(d, causal, q.dtype, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kernel = _launch(q, k, v, out, None, None, layout, causal, LOG2E / math.sqrt(d), cfg, dims)
    info = {}
    for name in ("n_regs", "n_spills"):
        info[name] = getattr(kernel, name, None)
    meta = getattr(kernel, "metadata", None)
    info["shared"] = getattr(meta, "shared", None)
    return info


def _autotuned_config(q, k, v, out, lse, key_lengths, layout, causal, qk_scale, dims):
    d = dims[-1]
    key = (d, bool(causal), q.dtype, q.device.index)
    cfg = _AUTOTUNE_CACHE.get(key)
    if cfg is not None:
        return cfg
    best, best_ms = None, float("inf")
    for cand in autotune_candidates(d, causal, q.dtype, q.device):
        def run(c=cand):
            _launch(q, k, v, out, lse, key_lengths, layout, causal, qk_scale, c, dims)
        try:
            ms = triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median")
        except Exception:  # a config that does not compile/fit on this GPU
            continue
        if ms < best_ms:
            best, best_ms = cand, ms
    if best is None:
        best = default_config(d, causal, q.dtype, q.device)
    _AUTOTUNE_CACHE[key] = best
    return best


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bhsd",
    causal: bool = False,
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
):
    """Attention forward: ``softmax(scale * q k^T + mask) v``.

    Args:
        q, k, v: ``layout="bhsd"``: ``[B, Hq, Sq, D]``, ``[B, Hkv, Skv, D]``;
            ``layout="bshd"``: ``[B, Sq, Hq, D]``, ``[B, Skv, Hkv, D]``.
            float16/bfloat16 (float32 accepted; slow on GPU). Any strides with
            the last dim contiguous (views of a fused qkv tensor are read in
            place). ``D`` a multiple of 16 up to 256; ``Hq % Hkv == 0``.
        causal: top-left aligned (torch SDPA ``is_causal=True``): query ``i``
            attends keys ``j <= i``.
        scale: positive; default ``1 / sqrt(D)``.
        key_lengths: optional integer ``[B]`` tensor on q's device; keys
            ``j >= key_lengths[b]`` are masked. A row with no valid key outputs
            0 and gets ``lse = -inf``.
        return_lse: also return ``lse``, float32 ``[B, Hq, Sq]`` (natural log)
            whatever the layout.
        out: optional output tensor (q's shape, dtype and device; any strides
            with the last dim contiguous). Default: a new tensor contiguous in
            ``layout``.
        config: optional :class:`AttentionConfig` overriding the default.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse``.
    """
    dims = _validate(q, k, v, layout, key_lengths, out)
    batch, hq, hkv, sq, sk, d = dims
    reason = triton_unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(reason)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous in layout
    lse = None
    if return_lse:
        lse = torch.empty((batch, hq, sq), dtype=torch.float32, device=q.device)
    if key_lengths is not None and key_lengths.dtype != torch.int32:
        key_lengths = key_lengths.to(torch.int32)
    if key_lengths is not None:
        key_lengths = key_lengths.contiguous()
    if batch * hq * sq > 0:
        qk_scale = scale * LOG2E
        if config is None:
            if os.environ.get(AUTOTUNE_ENV, "0") not in ("", "0") and q.is_cuda:
                config = _autotuned_config(
                    q, k, v, out, lse, key_lengths, layout, causal, qk_scale, dims
                )
            else:
                config = default_config(d, causal, q.dtype, q.device)
        _launch(q, k, v, out, lse, key_lengths, layout, causal, qk_scale, config, dims)
    if return_lse:
        return out, lse
    return out


__all__ = [
    "AttentionConfig",
    "autotune_candidates",
    "bhs_sizes",
    "bhs_strides",
    "default_config",
    "flash_attention_forward",
]
