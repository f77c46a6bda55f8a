"""Blocks that quantize their LayerNorm + adaLN output once, for every W8A8 layer reading it.

A block's LayerNorm + adaLN modulation output that only W8A8 layers read
(a DiT block's attention and MLP inputs) is quantized once, in omni's norm/adaLN-fused
kernel, where the adapter declares the block
(:attr:`~omni_diffusion.adapters.base.ModelAdapter.norm_fusions`,
``QuantConfig.fuse_norms``, on by default for W8A8): the block gets a forward that
computes the norm, modulation and per-token quantization in one pass and gives the
8-bit tensor to every layer reading it (``QuantizedLinear.forward_quantized``),
instead of writing the modulated output in 16 bits and quantizing it once per
reader (under ``torch.compile``, in a kernel Inductor writes).
"""

from __future__ import annotations

import logging
import types
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from omni_diffusion.quantization.modules import (
    append_record,
    instance_forward_unfit,
    modules_of_class,
    remove_instance_forwards,
)
from omni_kernels.quant import QuantizedLinear, quantize_per_token

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter

logger = logging.getLogger("omni_diffusion.quantization")

# Where it records the blocks given a norm-fused forward: [(name, function)] (module.__dict__).
_NORM_FUSED_RECORD_ATTR = "_omni_norm_fused_forwards"
# Where a block given a norm-fused forward keeps its class forward, for that forward's fallback.
_CLASS_FORWARD_ATTR = "_omni_class_forward"


def w8a8_readers_unfit(*layers: nn.Module | None) -> str | None:
    """Why ``layers`` cannot share one quantized input, or ``None``: each must be a W8A8
    :class:`QuantizedLinear` applying no activation of its own, all with one weight dtype,
    ``clamp`` and ``activation_backend`` (their input quantization is then the same)."""
    first = None
    for layer in layers:
        if not isinstance(layer, QuantizedLinear) or layer.weight_only:
            return f"a reader is a {type(layer).__name__}{' (weight-only)' if isinstance(layer, QuantizedLinear) else ''}, not a W8A8 QuantizedLinear"
        if layer.input_activation is not None:
            return f"a reader applies {layer.input_activation!r} to its input"
        key = (layer.qweight.dtype, layer.clamp, layer.activation_backend)
        if first is None:
            first = key
        elif key != first:
            return f"the readers quantize their input differently ({first} vs {key})"
    return None if first is not None else "no reader"


def layer_norm_unfit(norm: nn.Module | None) -> str | None:
    """Why ``norm`` is not a LayerNorm over the last dim that omni's fused kernel computes, or ``None``."""
    if not isinstance(norm, nn.LayerNorm):
        return f"a {type(norm).__name__}, not a LayerNorm"
    if len(norm.normalized_shape) != 1:
        return f"a LayerNorm over {tuple(norm.normalized_shape)}, not over the last dim"
    return None


def quantize_modulated_norm(
    x: torch.Tensor, norm: nn.LayerNorm, shift: torch.Tensor, scale: torch.Tensor, reader: QuantizedLinear,
    prefix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reader``'s per-token quantization of ``norm(x) * (1 + scale) + shift``, in one pass.

    ``x`` ``[B, S, K]`` (16-bit or float32), ``shift``/``scale`` ``[B, K]`` (the adaLN
    modulation of each sample; any float dtype); ``norm`` a LayerNorm over K (with or
    without its affine); ``reader`` a W8A8 :class:`QuantizedLinear` whose weight dtype and
    ``clamp`` the quantization takes. Returns ``(codes [B, S, K], scales [B, S, 1] float32)``
    for ``reader.forward_quantized`` (and any other layer :func:`w8a8_readers_unfit`
    accepts with it). The kernel is omni's (Triton first under ``torch.compile``, where
    Inductor launches it: its point is the pass Inductor would otherwise write), unless the
    layer asks for ``activation_backend="torch"``.

    With ``prefix`` ``[B, P, K]`` the input is ``cat([prefix, x], 1)`` (a joint text + image
    sequence held as two tensors), read in place by the Triton kernel (the CUDA one cannot:
    ``auto`` takes Triton, and a layer asking for ``"cuda"`` gets the cat); the results then
    have ``P + S`` rows a sample.
    """
    backend = reader.activation_backend if reader.activation_backend in ("cuda", "triton", "torch") else "auto"
    if prefix is not None and backend == "cuda":
        prefix, x = None, torch.cat([prefix, x], dim=1)  # the CUDA kernel reads one tensor
    return quantize_per_token(
        x, reader.qweight.dtype, norm="layer", norm_weight=norm.weight, norm_bias=norm.bias, eps=norm.eps,
        mod_scale=scale, mod_shift=shift, clamp=reader.clamp, backend=backend, prefix=prefix,
    )


def install_norm_fused_forwards(module: nn.Module, adapter: ModelAdapter | None) -> list[str]:
    """Give each block of the adapter's :class:`~omni_diffusion.adapters.base.NormFusion`
    classes that its ``unfit`` accepts the fusion's ``forward`` as its instance ``forward``.

    Skipped, with a debug log: a block ``unfit`` names a reason for, one that already has an
    instance ``forward`` (someone else's wrapper), or one whose class ``forward`` takes other
    parameters than the function (a diffusers version it was not written for). Returns the
    blocks' names; :func:`remove_norm_fused_forwards` undoes it.
    """
    if adapter is None:
        return []
    installed: list[tuple[str, Any]] = []
    for fusion in adapter.norm_fusions:
        for name, owner in modules_of_class(module, fusion.owner_class):
            why = instance_forward_unfit(owner, fusion.forward) or fusion.unfit(owner)
            if why is not None:
                logger.debug("quantize: %s keeps its norm outputs in 16 bits: %s", name, why)
                continue
            owner.__dict__[_CLASS_FORWARD_ATTR] = type(owner).forward
            owner.forward = types.MethodType(fusion.forward, owner)
            installed.append((name, fusion.forward))
    append_record(module, _NORM_FUSED_RECORD_ATTR, installed)
    return [name for name, _ in installed]


def remove_norm_fused_forwards(module: nn.Module) -> None:
    """Undo :func:`install_norm_fused_forwards` (an instance ``forward`` that is no longer the
    installed one is left alone)."""
    for name, _ in module.__dict__.get(_NORM_FUSED_RECORD_ATTR, []):
        module.get_submodule(name).__dict__.pop(_CLASS_FORWARD_ATTR, None)
    remove_instance_forwards(module, _NORM_FUSED_RECORD_ATTR)


def class_forward(block: nn.Module):
    """The class ``forward`` function of a block given a norm-fused forward (kept at install:
    ``torch.compile`` traces neither ``type(block).forward(block, ...)`` nor a walk of the MRO)."""
    return block.__dict__[_CLASS_FORWARD_ATTR]


def norm_fused_blocks(module: nn.Module) -> list[str]:
    """Names of the blocks of ``module`` given a norm-fused forward by :func:`quantize`."""
    return [name for name, _ in module.__dict__.get(_NORM_FUSED_RECORD_ATTR, [])]
