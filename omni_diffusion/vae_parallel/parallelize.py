"""``parallelize_vae`` / ``unparallelize_vae``: the entry points of VAE parallelism."""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

from omni_diffusion.vae_parallel.families import check_supported_vae
from omni_diffusion.vae_parallel.mode import VAE_PARALLEL_MODES, choose_decode_mode
from omni_diffusion.vae_parallel.patching import Patches
from omni_diffusion.vae_parallel.sharding import SHARD_DIM, ShardContext
from omni_diffusion.vae_parallel.spatial import decode_sharded, install_spatial
from omni_diffusion.vae_parallel.tile import install_tile
from omni_kernels.halo import HALO_BACKENDS

logger = logging.getLogger(__name__)

# The instance attribute holding a parallelized VAE's state (not a module, parameter or buffer,
# so state_dict is unchanged).
_STATE_ATTR = "_omni_vae_parallel"


def parallelize_vae(vae: nn.Module, group: dist.ProcessGroup, mode: str = "auto", *,
                    output_rank: int | None = None, halo_backend: str = "auto") -> nn.Module:
    """Make ``vae``'s decode (and tiled encode) run in parallel over the ranks of ``group``.

    Every rank of ``group`` must call this with the same arguments, and then call
    ``vae.decode(z)`` / ``vae.encode(x)`` with the same inputs.

    Args:
        vae: a diffusers ``AutoencoderKL``, ``AutoencoderKLQwenImage``, ``AutoencoderKLWan`` or
            ``AutoencoderKLHunyuanVideo``; modified in place (instance attributes only:
            parameter names and ``state_dict`` keys are unchanged, checkpoints still load).
        group: the VAE's process group (e.g. ``dist.new_group(ranks)``).
        mode: ``"tile"``: diffusers' tiled decode/encode with the tiles spread over the ranks
            (tiling is switched on if it was off; output equals diffusers' tiled output).
            ``"spatial"``: decode with the feature map split along its height through the
            whole decoder (output equals an untiled single-GPU decode; a latent with fewer rows
            per rank than the largest convolution halo raises). ``"auto"``: spatial when every
            rank gets enough rows (:mod:`.mode`), else diffusers' decode with tile-parallel
            tiling; chosen per call. Encode is tile-parallel in "tile" and "auto" (when
            diffusers tiles it) and untouched in "spatial".
        output_rank: ``None`` (default) gathers spatially decoded output to every rank; a group
            rank gathers it there only (other ranks get their own rows).
        halo_backend: the halo pack/assemble backend: ``"auto"``, ``"cuda"``, ``"triton"`` or
            ``"torch"``.

    Returns:
        ``vae``. :func:`unparallelize_vae` undoes it.

    Raises:
        ValueError: an unsupported VAE, mode, group or layer, before any collective.
    """
    if mode not in VAE_PARALLEL_MODES:
        raise ValueError(f"mode must be one of {VAE_PARALLEL_MODES}; got {mode!r}")
    if halo_backend not in HALO_BACKENDS:
        raise ValueError(f"halo_backend must be one of {HALO_BACKENDS}; got {halo_backend!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("parallelize_vae needs torch.distributed initialized "
                         "(dist.init_process_group) and a process group")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup; got "
                         f"{type(group).__name__}")
    check_supported_vae(vae)
    if hasattr(vae, _STATE_ATTR):
        raise ValueError("vae is already parallelized; call unparallelize_vae(vae) first")
    ctx = ShardContext.for_group(group, halo_backend=halo_backend)
    patches = Patches()
    try:
        if mode in ("tile", "auto"):
            if mode == "tile" and not vae.use_tiling:
                patches.set(vae, "use_tiling", True)
            install_tile(vae, ctx, patches)
        if mode in ("spatial", "auto"):
            state = install_spatial(vae, ctx, patches, output_rank=output_rank)
            if mode == "auto":
                _install_auto_decode(vae, state, patches, output_rank)
    except Exception:
        patches.undo()
        raise
    setattr(vae, _STATE_ATTR, (mode, ctx, patches))
    return vae


def _install_auto_decode(vae, state, patches: Patches, output_rank: int | None) -> None:
    original_decode = state.original_decode
    logged: set[str] = set()

    def auto_decode(self, z, return_dict: bool = True):
        choice = choose_decode_mode(z.shape[SHARD_DIM], state.ctx.world)
        if choice not in logged:
            logged.add(choice)
            logger.info("vae_parallel='auto' chose %s for a latent of shape %s on %d ranks",
                        choice, tuple(z.shape), state.ctx.world)
        if choice == "spatial":
            return decode_sharded(self, state, original_decode, z, return_dict, output_rank)
        return original_decode(z, return_dict=return_dict)

    patches.bind(vae, "_decode", auto_decode)


def unparallelize_vae(vae: nn.Module) -> nn.Module:
    """Undo :func:`parallelize_vae` (restores every patched method and frees the buffers)."""
    state = vae.__dict__.get(_STATE_ATTR)
    if state is None:
        raise ValueError("vae is not parallelized (parallelize_vae was not called on it)")
    _, ctx, patches = state
    patches.undo()
    ctx.buffers.clear()
    delattr(vae, _STATE_ATTR)
    return vae


def vae_parallel_mode(vae: nn.Module) -> str | None:
    """The mode ``vae`` was parallelized with, or ``None``."""
    state = vae.__dict__.get(_STATE_ATTR)
    return None if state is None else state[0]
