"""Spatially-sharded decode: the feature map stays split along its height through the decoder.

:func:`install_spatial` wraps, by layer type (:mod:`.families`), every layer of ``vae.decoder``
(and ``vae.post_quant_conv``) that needs rows it does not own:

* convolutions (``nn.Conv2d``, ``nn.Conv3d``, the cached causal ``Conv3d`` of Wan/Qwen-Image,
  HunyuanVideo's padding causal conv): their halo follows from kernel height, dilation and
  padding (:mod:`.halo_exchange`); the input (with a causal conv's cached frames) is assembled
  in one pre-padded buffer (:meth:`.ShardContext.conv_input`) and the convolution runs with no
  padding along the height; on one rank a plain convolution pads by itself;
* ``nn.GroupNorm``: exact, from one fp32 all-reduce of ``[count, sum x, sum x^2]`` per group;
* attention (global-context layers): the map is gathered, the layer runs on all of it, and each
  rank keeps its own rows;
* nearest upsampling and per-position layers need nothing (checked, not wrapped).

The VAE's ``_decode`` is wrapped to shard the latent, run diffusers' own decode on the shard with
tiling off (the shard is the tile), and gather the rows. Outside that decode every wrapper runs
its layer unchanged, so encoding and the other modes are unaffected.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from omni_diffusion.vae_parallel.families import layer_roles
from omni_diffusion.vae_parallel.halo_exchange import exchange_halo
from omni_diffusion.vae_parallel.patching import Patches
from omni_diffusion.vae_parallel.sharding import (
    SHARD_DIM,
    RowSplit,
    ShardContext,
    all_gather_rows,
    gather_rows_to,
)
from omni_kernels.halo import HALO_REPLICATE, HALO_ZERO

logger = logging.getLogger(__name__)

_NEAREST_MODES = ("nearest", "nearest-exact")


class SpatialDecoder:
    """The state of one VAE's spatial parallelism: context, patches, largest halo."""

    def __init__(self, ctx: ShardContext, patches: Patches, max_halo: int) -> None:
        self.ctx = ctx
        self.patches = patches
        self.max_halo = max_halo
        # The latent's row split during a sharded decode; diffusers' unwrapped ``_decode``.
        self.split: RowSplit | None = None
        self.original_decode = None

    def check_latent(self, z: torch.Tensor) -> RowSplit:
        """The row split of latent ``z``; raises ``ValueError`` (on every rank alike) when a
        shard would be smaller than the largest halo."""
        if z.dim() not in (4, 5):
            raise ValueError(f"z must be [B, C, H, W] or [B, C, T, H, W]; got {tuple(z.shape)}")
        split = RowSplit(z.shape[SHARD_DIM], self.ctx.world)
        need = max(1, self.max_halo)
        if min(split.sizes) < need:
            raise ValueError(
                f"spatial VAE decode over {self.ctx.world} ranks needs a latent height of at least "
                f"{need * self.ctx.world} ({need} rows per rank for the convolution halos); got "
                f"{z.shape[SHARD_DIM]}"
            )
        return split

    def rows_of_all_ranks(self, local_rows: int) -> tuple[int, ...]:
        """Every rank's rows at the resolution where this rank holds ``local_rows``."""
        own = self.split.sizes[self.ctx.rank]
        factor, rest = divmod(local_rows, own)
        if rest:
            raise RuntimeError(f"a shard of {local_rows} rows is not a whole multiple of this "
                               f"rank's {own} latent rows; the decoder changed the shard unevenly")
        return self.split.scaled(factor)


# --------------------------------------------------------------------------- convolutions


def _same_halo(name: str, kernel: int, pad_lo: int, pad_hi: int, dilation: int,
               stride: int) -> tuple[int, int]:
    """``(lo, hi)`` halo rows of a conv along the height, checking it keeps every shard's rows."""
    if stride != 1 or pad_lo + pad_hi != dilation * (kernel - 1):
        raise ValueError(
            f"spatial VAE decode shards the height, which needs stride-1 convolutions that keep "
            f"the height ('same' padding); {name} has kernel {kernel}, stride {stride}, dilation "
            f"{dilation}, padding ({pad_lo}, {pad_hi}) along it"
        )
    return pad_lo, pad_hi


def _wrap_plain_conv(state: SpatialDecoder, name: str, conv: nn.Module) -> int:
    """Wrap an ``nn.Conv2d``/``nn.Conv3d`` with zero padding; returns its largest halo."""
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError(f"{name}: spatial decode supports numeric zero padding; got "
                         f"padding={conv.padding!r}, padding_mode={conv.padding_mode!r}")
    kernel, pad = conv.kernel_size[-2], conv.padding[-2]
    if kernel == 1 and pad == 0:
        return 0
    lo, hi = _same_halo(name, kernel, pad, pad, conv.dilation[-2], conv.stride[-2])
    local_padding = (*conv.padding[:-2], 0, conv.padding[-1])
    conv_fn = F.conv2d if isinstance(conv, nn.Conv2d) else F.conv3d
    original = conv.forward
    ctx = state.ctx

    def forward(self, x):
        # One rank: both edges are the image's, zero-padded by the convolution itself (no copy).
        if not ctx.active or ctx.world == 1:
            return original(x)
        shape = list(x.shape)
        shape[SHARD_DIM] += lo + hi
        buf = ctx.conv_input(tuple(shape), x)
        exchange_halo(ctx, [(x, buf)], lo, hi, HALO_ZERO)
        return conv_fn(buf, self.weight, self.bias, self.stride, local_padding, self.dilation,
                       self.groups)

    state.patches.bind(conv, "forward", forward)
    return max(lo, hi)


def _wrap_cached_causal_conv(state: SpatialDecoder, name: str, conv: nn.Conv3d) -> int:
    """Wrap a Wan/Qwen-Image causal conv (``forward(x, cache_x=None)``, ``_padding``)."""
    w_lo, w_hi, h_lo, h_hi, _, t_after = conv._padding
    if h_lo == h_hi == 0 and conv.kernel_size[1] == 1:
        return 0
    if w_lo != w_hi or t_after != 0:
        raise ValueError(f"{name}: expected symmetric width and causal time padding; got "
                         f"{conv._padding}")
    lo, hi = _same_halo(name, conv.kernel_size[1], h_lo, h_hi, conv.dilation[1], conv.stride[1])
    original = conv.forward
    ctx = state.ctx

    def forward(self, x, cache_x=None):
        if not ctx.active:
            return original(x, cache_x)
        t_front = self._padding[4]
        parts = [x]
        if cache_x is not None and t_front > 0:
            # Cached frames come first in time, as in diffusers; they are assembled (with their
            # halos) straight into the buffer, not concatenated to x first.
            cache_x = cache_x.to(x.device)
            parts = [cache_x, x]
            t_front -= cache_x.shape[2]
        if t_front < 0:
            raise ValueError(f"{name}: {cache_x.shape[2]} cached frames exceed the causal "
                             f"padding of {self._padding[4]} frames")
        b, c, _, h, w = x.shape
        frames = sum(p.shape[2] for p in parts)
        buf = ctx.conv_input((b, c, t_front + frames, lo + h + hi, w), x)
        if t_front:
            buf[:, :, :t_front].zero_()  # the causal zero frames
        views, start = [], t_front
        for p in parts:
            views.append(buf[:, :, start:start + p.shape[2]])
            start += p.shape[2]
        exchange_halo(ctx, list(zip(parts, views)), lo, hi, HALO_ZERO)
        return F.conv3d(buf, self.weight, self.bias, self.stride, (0, 0, w_lo), self.dilation,
                        self.groups)

    state.patches.bind(conv, "forward", forward)
    return max(lo, hi)


def _wrap_padding_causal_conv(state: SpatialDecoder, name: str, module: nn.Module) -> int:
    """Wrap a HunyuanVideo causal conv (``F.pad(time_causal_padding, pad_mode)`` then ``.conv``)."""
    w_lo, w_hi, h_lo, h_hi, t_lo, t_hi = module.time_causal_padding
    inner = module.conv
    if inner.padding[1] != 0 or inner.padding_mode != "zeros":
        raise ValueError(f"{name}.conv: expected no padding of its own; got {inner.padding}")
    if module.pad_mode not in ("replicate", "constant"):
        raise ValueError(f"{name}: pad_mode must be 'replicate' or 'constant'; got "
                         f"{module.pad_mode!r}")
    edge = HALO_REPLICATE if module.pad_mode == "replicate" else HALO_ZERO
    if h_lo == h_hi == 0 and inner.kernel_size[1] == 1:
        return 0
    lo, hi = _same_halo(name, inner.kernel_size[1], h_lo, h_hi, inner.dilation[1], inner.stride[1])
    original = module.forward
    ctx = state.ctx

    def forward(self, x):
        if not ctx.active:
            return original(x)
        # Width and time are whole on every rank: padded locally; the height gets its halo.
        x = F.pad(x, (w_lo, w_hi, 0, 0, t_lo, t_hi), mode=self.pad_mode)
        shape = list(x.shape)
        shape[SHARD_DIM] += lo + hi
        buf = ctx.conv_input(tuple(shape), x)
        exchange_halo(ctx, [(x, buf)], lo, hi, edge)
        return self.conv(buf)

    state.patches.bind(module, "forward", forward)
    return max(lo, hi)


# --------------------------------------------------------------------------- group norm


def distributed_group_norm(group: dist.ProcessGroup, x: torch.Tensor, num_groups: int,
                           weight: torch.Tensor | None, bias: torch.Tensor | None,
                           eps: float) -> torch.Tensor:
    """GroupNorm of a feature map split over ``group``, equal to ``nn.GroupNorm`` on the whole.

    Args:
        x: this rank's shard ``[B, C, *spatial]`` (any spatial split), float.
        weight, bias: ``[C]`` affine parameters or ``None``.

    The statistics are exact: each rank reduces its shard to ``[count, sum x, sum x^2]`` per
    (batch, group) in fp32 (from a local two-pass variance, so the local sums carry no
    cancellation), one all-reduce adds them, and mean and variance come from the totals, never
    from an average of per-rank variances.
    """
    b, c = x.shape[:2]
    xg = x.reshape(b, num_groups, -1)
    var, mean = torch.var_mean(xg.float(), dim=-1, unbiased=False)
    count = torch.full_like(mean, xg.shape[-1])
    stats = torch.stack([count, count * mean, count * (var + mean * mean)], dim=-1)
    dist.all_reduce(stats, group=group)
    count, total, total_sq = stats.unbind(-1)
    mean = total / count
    var = (total_sq / count - mean * mean).clamp_min(0.0)
    rstd = torch.rsqrt(var + eps)
    y = ((xg.float() - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    view = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.float().view(view)
    if bias is not None:
        y = y + bias.float().view(view)
    return y.to(x.dtype)


def _wrap_group_norm(state: SpatialDecoder, norm: nn.GroupNorm) -> None:
    original = norm.forward
    ctx = state.ctx

    def forward(self, x):
        if not ctx.active or ctx.world == 1:  # one rank holds the whole map
            return original(x)
        return distributed_group_norm(ctx.group, x, self.num_groups,
                                      self.weight if self.affine else None,
                                      self.bias if self.affine else None, self.eps)

    state.patches.bind(norm, "forward", forward)


# --------------------------------------------------------------------------- attention


def _wrap_global_context(state: SpatialDecoder, name: str, module: nn.Module) -> None:
    original = module.forward
    ctx = state.ctx

    def forward(self, x, *args, **kwargs):
        if not ctx.active:
            return original(x, *args, **kwargs)
        if x.dim() not in (4, 5):
            raise ValueError(f"{name} got a {x.dim()}-D input {tuple(x.shape)} in a sharded "
                             "decode; only feature maps [B, C, (T,) H, W] can be gathered")
        rows = state.rows_of_all_ranks(x.shape[SHARD_DIM])
        full = all_gather_rows(ctx, x, rows)
        ctx.gathered = True
        try:
            out = original(full, *args, **kwargs)
        finally:
            ctx.gathered = False
        if ctx.world == 1:  # the whole map, no gather and no copy
            return out
        start = sum(rows[: ctx.rank])
        # A copy, so the gathered map is freed once the layer returns.
        return out.narrow(SHARD_DIM, start, rows[ctx.rank]).clone()

    state.patches.bind(module, "forward", forward)


# --------------------------------------------------------------------------- install


def _check_upsample(name: str, module: nn.Upsample) -> None:
    factors = module.scale_factor if isinstance(module.scale_factor, tuple) else (
        module.scale_factor,)
    if module.mode not in _NEAREST_MODES or module.size is not None or any(
            f is None or float(f) != int(f) for f in factors):
        raise ValueError(f"{name}: spatial decode supports nearest upsampling by whole factors "
                         f"(rows stay on their rank); got mode={module.mode!r}, "
                         f"scale_factor={module.scale_factor!r}, size={module.size!r}")


def _is_local_leaf(module: nn.Module, local_types: tuple[type, ...]) -> bool:
    return isinstance(module, local_types) or type(module).__module__ == (
        "torch.nn.modules.activation")


def install_spatial(vae: nn.Module, ctx: ShardContext, patches: Patches,
                    output_rank: int | None = None) -> SpatialDecoder:
    """Wrap ``vae``'s decoder layers and its ``_decode`` for a height-sharded decode.

    Args:
        vae: a supported diffusers VAE (see :func:`.families.check_supported_vae`).
        ctx: the VAE group.
        patches: where the wrappers are recorded (undone by ``patches.undo()``).
        output_rank: ``None`` gathers the decoded output to every rank; a group rank gathers it
            to that rank only (the others get their own rows back).

    Raises:
        ValueError: a decoder layer the spatial mode cannot shard, naming it; raised before any
            collective (what was patched before it is in ``patches``, for the caller to undo).
    """
    roles = layer_roles()
    plan: list[tuple[str, nn.Module, str]] = []
    unsupported = []
    skip_prefixes: list[str] = []
    handled: set[int] = set()
    roots = [("decoder", vae.decoder)]
    if getattr(vae, "post_quant_conv", None) is not None:
        roots.append(("post_quant_conv", vae.post_quant_conv))
    for root_name, root in roots:
        for sub_name, module in root.named_modules():
            name = f"{root_name}.{sub_name}" if sub_name else root_name
            if any(name.startswith(p) for p in skip_prefixes) or id(module) in handled:
                continue
            if isinstance(module, roles.global_context):
                plan.append((name, module, "global"))
                skip_prefixes.append(name + ".")
            elif isinstance(module, roles.cached_causal_convs):
                plan.append((name, module, "cached_causal_conv"))
            elif isinstance(module, roles.padding_causal_convs):
                plan.append((name, module, "padding_causal_conv"))
                handled.add(id(module.conv))
            elif type(module) in (nn.Conv2d, nn.Conv3d):
                plan.append((name, module, "conv"))
            elif isinstance(module, nn.GroupNorm):
                plan.append((name, module, "group_norm"))
            elif isinstance(module, nn.Upsample):
                _check_upsample(name, module)
            elif not list(module.children()) and not _is_local_leaf(module, roles.local):
                unsupported.append(f"{name} ({type(module).__name__})")
    if output_rank is not None and not 0 <= output_rank < ctx.world:
        raise ValueError(f"output_rank must be None or a group rank in [0, {ctx.world}); got "
                         f"{output_rank}")
    if unsupported:
        raise ValueError("spatial VAE decode does not know how to shard these decoder layers: "
                         + ", ".join(unsupported))

    state = SpatialDecoder(ctx, patches, max_halo=0)
    wrappers = {"conv": _wrap_plain_conv, "cached_causal_conv": _wrap_cached_causal_conv,
                "padding_causal_conv": _wrap_padding_causal_conv}
    # A wrapper that refuses its layer raises part-way; the caller undoes `patches`.
    for name, module, kind in plan:
        if kind in wrappers:
            state.max_halo = max(state.max_halo, wrappers[kind](state, name, module))
        elif kind == "group_norm":
            _wrap_group_norm(state, module)
        else:
            _wrap_global_context(state, name, module)
    _install_sharded_decode(vae, state, output_rank)
    return state


def _install_sharded_decode(vae: nn.Module, state: SpatialDecoder, output_rank: int | None):
    original_decode = vae._decode
    ctx = state.ctx

    def sharded_decode(self, z, return_dict: bool = True):
        return decode_sharded(self, state, original_decode, z, return_dict, output_rank)

    state.patches.bind(vae, "_decode", sharded_decode)
    state.original_decode = original_decode
    logger.debug("spatial VAE decode installed on %s, %d ranks, largest halo %d rows",
                 type(vae).__name__, ctx.world, state.max_halo)


def decode_sharded(vae, state: SpatialDecoder, original_decode, z: torch.Tensor,
                   return_dict: bool, output_rank: int | None):
    """Decode ``z`` (the full latent, identical on every rank) with rows sharded over the group.

    Returns what diffusers' ``_decode`` returns (``DecoderOutput`` or a 1-tuple), holding the
    full decoded sample (on every rank, or on ``output_rank`` only).
    """
    ctx = state.ctx
    split = state.check_latent(z)
    rank = ctx.rank
    z_local = z.narrow(SHARD_DIM, split.offsets[rank], split.sizes[rank]).contiguous()
    state.split = split
    was_tiling = vae.use_tiling
    vae.use_tiling = False
    ctx.sharded = True
    try:
        out = original_decode(z_local, return_dict=True)
    finally:
        ctx.sharded = False
        vae.use_tiling = was_tiling
    sample = out.sample
    rows = state.rows_of_all_ranks(sample.shape[SHARD_DIM])
    if output_rank is None:
        sample = all_gather_rows(ctx, sample, rows)
    else:
        sample = gather_rows_to(ctx, sample, rows, output_rank)
    if not return_dict:
        return (sample,)
    out.sample = sample
    return out
