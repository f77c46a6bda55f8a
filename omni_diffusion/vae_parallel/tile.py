"""Tile-parallel encode and decode: diffusers' own tiles, spread over the ranks of the VAE group.

diffusers' ``tiled_decode`` / ``tiled_encode`` split the input into overlapping tiles, run the
decoder (encoder) on each, then blend the seams. Here they run twice, unchanged:

1. **plan and compute**: each call of the heavy module (``decoder`` / ``encoder``) belongs to a
   *unit* (one tile: for VAEs with a feature cache, the calls between two ``clear_cache()``
   calls, i.e. one tile's frames; otherwise one call). Unit ``u`` belongs to group rank
   ``u % world``. A rank runs its own units for real and the others under ``FakeTensorMode``,
   which yields only their output shapes; every call's output is then broadcast from its owner.
2. **blend**: diffusers' method runs again with the heavy module replaced by a lookup of those
   outputs, so the tiles, the blending and the crop are exactly diffusers' own.

Every rank ends with the whole result. Only the heavy module's work is split; the cheap parts
(``post_quant_conv``, blending) run on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from omni_diffusion.vae_parallel.patching import Patches
from omni_diffusion.vae_parallel.sharding import ShardContext


class _ShapeCache:
    """Output shape and dtype of a heavy module per call signature, and the fake mode that
    traces them: one per installed method, so every decode after the first reuses the shapes
    (a smoke profile spent 1.1 of 1.2 s a decode re-tracing other ranks' tiles on fake tensors
    when each run traced afresh). A signature is input shapes, dtypes and flags, which fix the
    output shape of a module whose configuration does not change."""

    def __init__(self) -> None:
        self.shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)


class _TileRun:
    """One distributed run of a diffusers tiled method (see the module docstring)."""

    def __init__(self, ctx: ShardContext, vae: nn.Module, heavy: nn.Module,
                 shapes: _ShapeCache | None = None) -> None:
        self.ctx = ctx
        self.vae = vae
        self.heavy = heavy
        self.unit = -1
        self.outputs: list[torch.Tensor] = []
        self.owners: list[int] = []
        self.counts_units_by_cache = hasattr(vae, "clear_cache")
        # Output shape and dtype per call signature (see _signature), kept across runs.
        shapes = shapes if shapes is not None else _ShapeCache()
        self.shapes = shapes.shapes
        self.fake_mode = shapes.fake_mode

    def _owner(self) -> int:
        return self.unit % self.ctx.world

    def run(self, method, *args, **kwargs):
        patches = Patches()
        original_forward = self.heavy.forward
        try:
            if self.counts_units_by_cache:
                original_clear = self.vae.clear_cache

                def clear_cache(vae_self):
                    self.unit += 1
                    return original_clear()

                patches.bind(self.vae, "clear_cache", clear_cache)
            patches.bind(self.heavy, "forward",
                         lambda _, *a, **k: self._compute(original_forward, a, k))
            method(*args, **kwargs)
            patches.undo()
            self._broadcast()
            lookup = iter(self.outputs)
            patches.bind(self.heavy, "forward", lambda _, *a, **k: next(lookup))
            result = method(*args, **kwargs)
            if next(lookup, None) is not None:
                raise RuntimeError("the tiled method called its heavy module fewer times on the "
                                   "second run than on the first; it is not deterministic")
            return result
        finally:
            patches.undo()

    def _compute(self, forward, args, kwargs) -> torch.Tensor:
        if not self.counts_units_by_cache:
            self.unit += 1
        owner = self._owner()
        if owner == self.ctx.rank:
            out = forward(*args, **kwargs)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"tile-parallel VAE expects the {type(self.heavy).__name__} to "
                                f"return a tensor; got {type(out).__name__}")
            out = out.contiguous()
            self.shapes.setdefault(_signature(args, kwargs), (out.shape, out.dtype))
        else:
            # Another rank decodes this tile; only its shape is needed (to keep diffusers'
            # loop going and to receive it): known from an earlier call with the same input
            # shapes and flags, else traced on fake tensors.
            key = _signature(args, kwargs)
            if key not in self.shapes:
                with self.fake_mode:
                    fake = forward(*args, **kwargs)
                self.shapes[key] = (fake.shape, fake.dtype)
            shape, dtype = self.shapes[key]
            out = torch.empty(shape, dtype=dtype, device=args[0].device)
        self.outputs.append(out)
        self.owners.append(owner)
        # The first run's result is thrown away, and diffusers blends tiles in place: it gets a
        # scratch tensor of the right shape, so the recorded outputs stay untouched.
        return torch.empty_like(out)

    def _broadcast(self) -> None:
        for out, owner in zip(self.outputs, self.owners):
            dist.broadcast(out, group=self.ctx.group, group_src=owner)


def _signature(args, kwargs) -> tuple:
    """What a heavy module's output shape depends on: its tensor arguments' shapes and dtypes and
    its scalar flags (Wan's ``first_chunk``). Lists (the feature cache and its index) are left
    out: they hold state whose shapes follow from the earlier calls of the same tile."""

    def describe(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return type(value).__name__

    return (tuple(describe(a) for a in args),
            tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def install_tile(vae: nn.Module, ctx: ShardContext, patches: Patches) -> None:
    """Make ``vae``'s tiled decode and encode run tile-parallel over ``ctx``'s group.

    diffusers decides when to tile (``vae.use_tiling`` and an input larger than one tile); this
    only changes how the tiles are computed. The encode entry is ``_tiled_encode`` where the class
    has it (AutoencoderKL), else ``tiled_encode``.
    """
    for method_name, heavy in (("tiled_decode", vae.decoder),
                               ("_tiled_encode" if hasattr(type(vae), "_tiled_encode")
                                else "tiled_encode", vae.encoder)):
        original = getattr(vae, method_name)

        def parallel(vae_self, *args, _original=original, _heavy=heavy, _shapes=_ShapeCache(), **kwargs):
            if ctx.world == 1:
                return _original(*args, **kwargs)
            return _TileRun(ctx, vae_self, _heavy, _shapes).run(_original, *args, **kwargs)

        patches.bind(vae, method_name, parallel)
