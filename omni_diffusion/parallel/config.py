"""``ParallelConfig``: how the ranks of a job split one generation, and the device mesh it maps to.

The degrees multiply to the world size. The mesh is laid out outermost to
innermost as ``("cfg", "ring", "ulysses", "tp")``: tensor parallelism, which
all-reduces inside every block, gets the closest ranks (consecutive ranks, one
node with torchrun's usual rank order); Ulysses' all-to-alls come next, Ring's
neighbour passes next, and CFG's one gather per step is outermost (it can cross
nodes). The VAE group is a separate ``("vae_replica", "vae")`` mesh over the
same ranks: consecutive groups of ``vae`` ranks, each of which holds the same
latents after denoising.

Everything here that can be checked without a collective is checked in
:meth:`ParallelConfig.__post_init__` (field values) and
:meth:`ParallelConfig.check_world` (world size) before
:func:`build_mesh` creates any process group.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from omni_diffusion._fields import choice, known_fields, not_allowed

VAE_MODES = ("tile", "spatial", "auto")
#: mesh dimension names, outermost first
MESH_DIMS = ("cfg", "ring", "ulysses", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Degrees of each kind of parallelism; their product is the world size.

    Args:
        cfg: classifier-free-guidance parallel degree, 1 or 2: the conditional
            and unconditional branches run on different ranks and one
            all-gather per step combines them.
        ulysses: Ulysses sequence-parallel degree (all-to-all from sequence to
            head sharding around attention). Heads need not divide evenly.
        ring: Ring sequence-parallel degree (key/value blocks passed around the
            ring, partial results merged by log-sum-exp). ``ulysses * ring`` is
            the sequence-parallel degree (USP when both are > 1).
        tp: tensor-parallel degree (column/row sharded attention projections
            and MLPs); must divide the heads and MLP widths.
        vae: VAE group degree: that many ranks decode together through
            ``omni_diffusion.vae_parallel.parallelize_vae``; must divide the
            world size. With every other degree 1 (VAE-only parallelism) the
            world may be any multiple of ``vae``: each rank then runs the
            transformer whole (replicated).
        vae_mode: ``"tile"``, ``"spatial"`` or ``"auto"``, passed to
            ``parallelize_vae``.
    """

    cfg: int = 1
    ulysses: int = 1
    ring: int = 1
    tp: int = 1
    vae: int = 1
    vae_mode: str = "auto"

    def __post_init__(self) -> None:
        for field in ("cfg", "ulysses", "ring", "tp", "vae"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise not_allowed("ParallelConfig", field, value, "an integer >= 1")
        if self.cfg > 2:
            raise not_allowed("ParallelConfig", "cfg", self.cfg, "1 or 2 (one rank per guidance branch)")
        object.__setattr__(self, "vae_mode", choice("ParallelConfig", "vae_mode", self.vae_mode, VAE_MODES))

    # ------------------------------------------------------------------ sizes

    @property
    def world_size(self) -> int:
        """The number of ranks the denoising degrees need: ``cfg*ring*ulysses*tp``."""
        return self.cfg * self.ring * self.ulysses * self.tp

    @property
    def sequence_degree(self) -> int:
        return self.ulysses * self.ring

    @property
    def enabled(self) -> bool:
        """True when anything is split across ranks."""
        return self.world_size > 1 or self.vae > 1

    @property
    def vae_only(self) -> bool:
        """True when only the VAE is split: the transformer runs whole on every rank."""
        return self.world_size == 1 and self.vae > 1

    def check_world(self, world_size: int) -> None:
        """Raise ``ValueError`` unless this config fits ``world_size`` ranks (no collective)."""
        if world_size != self.world_size and not self.vae_only:
            raise ValueError(
                f"ParallelConfig(cfg={self.cfg}, ring={self.ring}, ulysses={self.ulysses}, "
                f"tp={self.tp}) needs cfg*ring*ulysses*tp = {self.world_size} ranks, but the "
                f"world size is {world_size} (only with all four 1 may vae alone split any world)"
            )
        if world_size % self.vae:
            raise not_allowed("ParallelConfig", "vae", self.vae, f"a divisor of the world size {world_size}")

    @classmethod
    def from_dict(cls, data: Any) -> ParallelConfig:
        if not isinstance(data, dict):
            raise ValueError(f"ParallelConfig.from_dict needs a mapping, got {type(data).__name__}")
        return cls(**known_fields(cls, data))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ParallelMesh:
    """The process groups of one :class:`ParallelConfig` on this rank.

    ``mesh`` is the 4-D ``torch.distributed`` DeviceMesh over
    :data:`MESH_DIMS`; ``vae_mesh`` the 2-D one for the VAE (None when
    ``vae == 1``). ``group(name)`` returns a dimension's process group and
    ``rank(name)`` this rank's coordinate along it. With VAE-only parallelism
    ``mesh`` has a leading ``"replica"`` dimension over the world (every other
    dimension of size 1).
    """

    config: ParallelConfig
    mesh: Any
    vae_mesh: Any = None

    def group(self, name: str):
        return self.mesh.get_group(name)

    def rank(self, name: str) -> int:
        return self.mesh.get_local_rank(name)

    def size(self, name: str) -> int:
        return self.mesh.size(self.mesh.mesh_dim_names.index(name))

    @property
    def sequence_rank(self) -> int:
        """This rank's position among the ``ulysses * ring`` sequence shards (ring-major)."""
        return self.rank("ring") * self.config.ulysses + self.rank("ulysses")

    @property
    def vae_group(self):
        return None if self.vae_mesh is None else self.vae_mesh.get_group("vae")


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(config: ParallelConfig, device_type: str | None = None) -> ParallelMesh:
    """Create the device meshes of ``config`` over the default process group.

    Checks the world size first (``ValueError``, before any collective). The
    default process group must exist (torchrun + ``init_process_group``, or a
    test launcher); ``device_type`` defaults to ``"cuda"`` when CUDA is
    available (NCCL), else ``"cpu"`` (gloo).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        config.check_world(world)  # a wrong config is reported before the missing group
        raise RuntimeError(
            "ParallelConfig needs torch.distributed initialized (torchrun, then "
            "torch.distributed.init_process_group) before the pipeline is parallelized"
        )
    config.check_world(dist.get_world_size())
    device_type = device_type or default_device_type()
    shape = tuple(getattr(config, name) for name in MESH_DIMS)
    names = MESH_DIMS
    if config.vae_only:  # the denoising dimensions span one rank, replicated over the world
        shape, names = (dist.get_world_size() // config.world_size, *shape), ("replica", *MESH_DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    vae_mesh = None
    if config.vae > 1:
        world = dist.get_world_size()
        vae_mesh = init_device_mesh(device_type, (world // config.vae, config.vae),
                                    mesh_dim_names=("vae_replica", "vae"))
    return ParallelMesh(config=config, mesh=mesh, vae_mesh=vae_mesh)


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` items over ``parts`` shards as ``torch.tensor_split`` cuts them:
    the first ``total % parts`` shards hold one more. Shards may be empty."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


__all__ = ["MESH_DIMS", "VAE_MODES", "ParallelConfig", "ParallelMesh", "build_mesh", "split_sizes"]
