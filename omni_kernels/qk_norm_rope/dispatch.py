"""Argument checks and backend choice for :func:`qk_rmsnorm_rope`.

Each backend is a ``torch.library`` op that writes into preallocated outputs:

* ``torch.ops.omni_kernels.qk_rmsnorm_rope`` — CUDA C++ (``csrc/qk_norm_rope``);
  its fake implementation is registered here, its schema in
  ``csrc/torch_bindings.cpp``.
* ``torch.ops.omni_kernels.qk_rmsnorm_rope_triton`` — the Triton kernel.

so ``torch.compile(fullgraph=True)`` traces through :func:`qk_rmsnorm_rope`.
"""

from __future__ import annotations

import logging

import torch

from omni_kernels._backend_choice import choose_backend
from omni_kernels._extension import compiled_extension_error, has_compiled_extension
from omni_kernels._triton import triton_unavailable_reason
from omni_kernels.qk_norm_rope.reference import qk_rmsnorm_rope_reference

logger = logging.getLogger(__name__)

QK_NORM_ROPE_BACKENDS = ("auto", "cuda", "triton", "torch")
# Fastest first, per norm mode (bench/results/INDEX.md): per-head norm, CUDA (same GPU time as
# Triton, less host overhead); norm across heads, Triton.
_AUTO_ORDER = ("cuda", "triton", "torch")
_AUTO_ORDER_ACROSS_HEADS = ("triton", "cuda", "torch")
_CUDA_HEAD_DIMS = (64, 128, 256)
_CUDA_DTYPES = (torch.float16, torch.bfloat16)
# The CUDA kernel moves 16 bytes per thread: 8 half-precision elements.
_CUDA_VECTOR_ELEMENTS = 8

_logged_auto_choices: set[tuple] = set()


@torch.library.custom_op(
    "omni_kernels::qk_rmsnorm_rope_triton", mutates_args=("q_out", "k_out"), device_types=None
)
def _qk_rmsnorm_rope_triton_op(
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
    from omni_kernels.qk_norm_rope.triton_kernel import launch_qk_rmsnorm_rope_triton

    launch_qk_rmsnorm_rope_triton(
        q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps, interleaved, norm_across_heads
    )


@_qk_rmsnorm_rope_triton_op.register_fake
def _(q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps, interleaved, norm_across_heads):
    return None


if has_compiled_extension():

    @torch.library.register_fake("omni_kernels::qk_rmsnorm_rope")
    def _(q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps, interleaved, norm_across_heads):
        return None


def _check_arguments(q, k, q_weight, k_weight, cos, sin, eps, norm_across_heads, q_out, k_out):
    """Raise ``ValueError`` naming the argument, its value and what is allowed."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [B, S, H, D]; got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor; got dtype {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dimension (stride 1); got strides {t.stride()}"
            )
    batch, seq, heads_q, head_dim = q.shape
    if k.shape[0] != batch or k.shape[1] != seq or k.shape[3] != head_dim:
        raise ValueError(
            f"k must match q in batch, sequence and head_dim; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(
            f"q and k must share dtype and device; got {q.dtype}/{q.device} and {k.dtype}/{k.device}"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding; got {head_dim}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    heads_k = k.shape[2]
    for name, weight, heads in (("q_weight", q_weight, heads_q), ("k_weight", k_weight, heads_k)):
        if weight is None:
            continue
        expected = heads * head_dim if norm_across_heads else head_dim
        if weight.dim() != 1 or weight.numel() != expected:
            mode = "H*D (norm_across_heads=True)" if norm_across_heads else "D (per-head norm)"
            raise ValueError(
                f"{name} must be 1-D with {expected} elements, {mode}; got shape {tuple(weight.shape)}"
            )
        if weight.device != q.device or not weight.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point tensor on {q.device}; got {weight.dtype} on "
                f"{weight.device}"
            )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.numel() != seq * head_dim:
            raise ValueError(
                f"{name} must hold [S, D] = [{seq}, {head_dim}] values (diffusers' full-width table); "
                f"got shape {tuple(table.shape)}"
            )
        if table.device != q.device or not table.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point tensor on {q.device}; got {table.dtype} on "
                f"{table.device}"
            )
    for name, out, src in (("q_out", q_out, q), ("k_out", k_out, k)):
        if out is None:
            continue
        if out.shape != src.shape or out.dtype != src.dtype or out.device != src.device:
            raise ValueError(
                f"{name} must match {name[0]} in shape, dtype and device: expected "
                f"{tuple(src.shape)} {src.dtype} {src.device}; got {tuple(out.shape)} {out.dtype} "
                f"{out.device}"
            )
        if out.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension; got {out.stride()}")


def _cuda_ineligible_reason(q, k, q_weight, k_weight, q_out, k_out) -> str | None:
    error = compiled_extension_error()
    if error is not None:
        return error
    if q.device.type != "cuda":
        return f"the CUDA kernel needs CUDA tensors; got device {q.device}"
    if q.dtype not in _CUDA_DTYPES:
        return f"the CUDA kernel takes float16 or bfloat16; got {q.dtype}"
    head_dim = q.shape[-1]
    if head_dim not in _CUDA_HEAD_DIMS:
        return f"the CUDA kernel takes head_dim in {_CUDA_HEAD_DIMS}; got {head_dim}"
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and w.dtype not in (q.dtype, torch.float32):
            return f"the CUDA kernel takes {name} in {q.dtype} or float32; got {w.dtype}"
    for name, t in (("q", q), ("k", k), ("q_out", q_out), ("k_out", k_out)):
        if t.stride(2) != head_dim:
            return (
                f"the CUDA kernel needs the heads of {name} packed (stride(2) == head_dim); "
                f"got strides {t.stride()}"
            )
        if any(s % _CUDA_VECTOR_ELEMENTS for s in t.stride()[:2]):
            return (
                f"the CUDA kernel needs 16-byte aligned rows of {name}: batch/sequence strides "
                f"multiples of {_CUDA_VECTOR_ELEMENTS}; got strides {t.stride()}"
            )
        # torch.compile cannot trace storage_offset(); while compiling, the C++ op's own check
        # of the start address is what guards against a misaligned view.
        if not torch.compiler.is_compiling() and t.storage_offset() % _CUDA_VECTOR_ELEMENTS:
            return (
                f"the CUDA kernel needs {name} to start 16-byte aligned; got storage offset "
                f"{t.storage_offset()}"
            )
    return None


def _triton_ineligible_reason(q) -> str | None:
    reason = triton_unavailable_reason(q.device)
    if reason is not None:
        return f"the Triton kernel cannot run: {reason}"
    return None


def _ineligible_reason(backend, q, k, q_weight, k_weight, q_out, k_out) -> str | None:
    if backend == "cuda":
        return _cuda_ineligible_reason(q, k, q_weight, k_weight, q_out, k_out)
    if backend == "triton":
        return _triton_ineligible_reason(q)
    return None


def supported_backends(q: torch.Tensor, k: torch.Tensor) -> dict[str, str | None]:
    """For each concrete backend, ``None`` if it can take these inputs, else the reason."""
    return {
        backend: _ineligible_reason(backend, q, k, None, None, q, k) for backend in _AUTO_ORDER
    }


def _as_table(table: torch.Tensor, seq: int, head_dim: int) -> torch.Tensor:
    # The kernels read [S, D] float32 rows; diffusers already hands float32 tables, so this is
    # normally a free view.
    table = table.reshape(seq, head_dim)
    if table.dtype != torch.float32:
        table = table.float()
    return table.contiguous()


def qk_rmsnorm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float = 1e-6,
    interleaved: bool = True,
    norm_across_heads: bool = False,
    backend: str = "auto",
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm ``q`` and ``k`` and apply rotary embedding, in one pass over each.

    Args:
        q: ``[B, S, Hq, D]``, float16/bfloat16/float32; last dimension contiguous
            (other strides free, so a view into a fused QKV projection works).
        k: ``[B, S, Hk, D]``, same dtype and device as ``q`` (``Hk`` may differ: GQA).
        q_weight, k_weight: RMSNorm weights, ``[D]`` per head, or ``[H*D]`` with
            ``norm_across_heads=True``; ``None`` for no affine weight.
        cos, sin: ``[S, D]`` tables (any shape with ``S*D`` elements, e.g.
            ``[1, S, 1, D]``), each value repeated for both members of its pair
            as diffusers builds them; float32 preferred.
        eps: added to the mean square before the reciprocal square root.
        interleaved: rotate pairs ``(2i, 2i+1)`` (True) or halves ``(i, i+D/2)``.
        norm_across_heads: one RMS over all ``H*D`` values of a token (Wan)
            instead of one per head.
        backend: ``"auto"``, ``"cuda"``, ``"triton"`` or ``"torch"``.
        q_out, k_out: optional outputs (shapes of ``q``/``k``, last dimension
            contiguous); may alias ``q``/``k`` for an in-place update, or be a
            slice of a larger joint-sequence buffer.

    Returns:
        ``(q_out, k_out)`` in the input layout ``[B, S, H, D]``.

    Raises:
        ValueError: a bad argument, an unknown backend, or a requested backend
            that cannot take these inputs (the message names the constraint).
    """
    if backend not in QK_NORM_ROPE_BACKENDS:
        raise ValueError(f"backend must be one of {QK_NORM_ROPE_BACKENDS}; got {backend!r}")
    _check_arguments(q, k, q_weight, k_weight, cos, sin, eps, norm_across_heads, q_out, k_out)
    seq, head_dim = q.shape[1], q.shape[3]

    if backend == "torch":
        q_ref, k_ref = qk_rmsnorm_rope_reference(
            q, k, q_weight, k_weight, cos, sin,
            eps=eps, interleaved=interleaved, norm_across_heads=norm_across_heads,
        )
        if q_out is None and k_out is None:
            return q_ref, k_ref
        q_out = q_ref if q_out is None else q_out.copy_(q_ref)
        k_out = k_ref if k_out is None else k_out.copy_(k_ref)
        return q_out, k_out

    q_out = torch.empty_like(q, memory_format=torch.contiguous_format) if q_out is None else q_out
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format) if k_out is None else k_out

    backend = choose_backend(
        "qk_rmsnorm_rope", backend,
        _AUTO_ORDER_ACROSS_HEADS if norm_across_heads else _AUTO_ORDER,
        lambda name: _ineligible_reason(name, q, k, q_weight, k_weight, q_out, k_out),
        log_key=(q.device.type, q.dtype, head_dim),
        describe=lambda: f"{q.device.type} {q.dtype} head_dim={head_dim}",
        logged=_logged_auto_choices, logger=logger,
    )
    if backend == "torch":
        return qk_rmsnorm_rope(
            q, k, q_weight, k_weight, cos, sin, eps=eps, interleaved=interleaved,
            norm_across_heads=norm_across_heads, backend="torch", q_out=q_out, k_out=k_out,
        )

    cos = _as_table(cos, seq, head_dim)
    sin = _as_table(sin, seq, head_dim)
    op = (
        torch.ops.omni_kernels.qk_rmsnorm_rope
        if backend == "cuda"
        else torch.ops.omni_kernels.qk_rmsnorm_rope_triton
    )
    op(q_out, k_out, q, k, q_weight, k_weight, cos, sin, float(eps), interleaved, norm_across_heads)
    return q_out, k_out
