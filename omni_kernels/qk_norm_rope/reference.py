"""PyTorch reference for the fused QK-RMSNorm + rotary embedding.

This is the definition the Triton and CUDA kernels are tested against, and the
``backend="torch"`` path of :func:`omni_kernels.qk_rmsnorm_rope`.

Shapes and layouts (the diffusers convention, after ``to_q(x).unflatten(-1, (H, D))``):

* ``q``: ``[B, S, Hq, D]``, ``k``: ``[B, S, Hk, D]``; any float dtype; the last
  dimension must have stride 1 (a slice of a fused QKV projection is fine).
* ``q_weight`` / ``k_weight``: ``[D]`` (RMSNorm per head: Flux, SD3, Qwen-Image,
  HunyuanVideo) or ``[H*D]`` with ``norm_across_heads=True`` (RMSNorm over the
  whole projection, as Wan does); ``None`` for a norm without affine weight.
* ``cos`` / ``sin``: ``[S, D]`` (or anything that squeezes to it, e.g. Wan's
  ``[1, S, 1, D]``), the full-width tables diffusers builds (each value repeated
  for both members of its rotation pair).
* ``interleaved=True`` rotates pairs ``(x[2i], x[2i+1])`` (Flux, Wan, Qwen-Image,
  HunyuanVideo: diffusers' ``use_real_unbind_dim=-1``); ``False`` rotates halves
  ``(x[i], x[i + D/2])`` (GPT-NeoX style, ``use_real_unbind_dim=-2``).

Computation, per token and head, in float32 (float64 for float64 inputs)::

    y   = x * rsqrt(mean(x**2) + eps) * weight      # mean over D, or over H*D
    out = y * cos + rotate(y) * sin                 # rotate(y)[2i] = -y[2i+1],
                                                    # rotate(y)[2i+1] = y[2i]

and the result is rounded once to the input dtype. (diffusers rounds to the
input dtype after the norm and again after the rotation; the fused kernels
round once, which is closer to the exact value.)
"""

from __future__ import annotations

import torch


def rotate_pairs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Return ``rotate(x)`` over the last dimension (see the module docstring)."""
    if interleaved:
        even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rmsnorm_rope_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    interleaved: bool,
    norm_across_heads: bool,
) -> torch.Tensor:
    """RMSNorm then RoPE on one tensor ``x`` of shape ``[B, S, H, D]``.

    Returns a new contiguous tensor of ``x``'s shape and dtype.
    """
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    batch, seq, heads, head_dim = x.shape
    xf = x.to(compute_dtype)
    if norm_across_heads:
        flat = xf.reshape(batch, seq, heads * head_dim)
        inv_rms = torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + eps)
        y = flat * inv_rms
        if weight is not None:
            y = y * weight.to(compute_dtype)
        y = y.reshape(batch, seq, heads, head_dim)
    else:
        inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        y = xf * inv_rms
        if weight is not None:
            y = y * weight.to(compute_dtype)
    cos_t = cos.reshape(seq, head_dim).to(compute_dtype)[None, :, None, :]
    sin_t = sin.reshape(seq, head_dim).to(compute_dtype)[None, :, None, :]
    out = y * cos_t + rotate_pairs(y, interleaved) * sin_t
    return out.to(x.dtype).contiguous()


def qk_rmsnorm_rope_reference(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`omni_kernels.qk_rmsnorm_rope`; returns ``(q_out, k_out)``."""
    options = dict(eps=eps, interleaved=interleaved, norm_across_heads=norm_across_heads)
    return (
        rmsnorm_rope_reference(q, q_weight, cos, sin, **options),
        rmsnorm_rope_reference(k, k_weight, cos, sin, **options),
    )
