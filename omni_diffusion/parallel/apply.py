"""Putting a :class:`ParallelConfig` on a pipeline: validation, mesh, then each strategy.

:func:`prepare` checks everything that needs no collective (world size,
the family's plans, head/width divisibility, the VAE), then builds the
device mesh. The returned :class:`ParallelRuntime` applies the strategies in
the order ``accelerate()`` needs: :meth:`~ParallelRuntime.shard_weights`
(tensor parallel, before quantization) and :meth:`~ParallelRuntime.install`
(sequence parallel over the installed attention, CFG, VAE). :func:`parallelize`
does both for a pipeline used without ``accelerate()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from omni_diffusion.adapters import ModelAdapter, adapter_for, adapter_for_transformer
from omni_diffusion.parallel.config import ParallelConfig, ParallelMesh, build_mesh


def check(pipe: Any, transformers: dict[str, nn.Module], adapter: ModelAdapter,
          config: ParallelConfig, world_size: int | None = None) -> None:
    """Raise ``ValueError`` for a config this pipeline cannot take (no collective)."""
    from omni_diffusion.parallel.cfg_parallel import check_cfg_parallel
    from omni_diffusion.parallel.tensor_parallel import plan_tensor_parallel

    if world_size is not None:
        config.check_world(world_size)
    if config.sequence_degree > 1 and adapter.sequence_parallel is None:
        raise ValueError(f"ParallelConfig(ulysses={config.ulysses}, ring={config.ring}): sequence "
                         f"parallelism is not available for the {adapter.name} family (its adapter "
                         "declares no SequenceParallelPlan)")
    if config.cfg > 1:
        check_cfg_parallel(adapter, pipe)
    if config.tp > 1:
        for transformer in transformers.values():
            plan_tensor_parallel(transformer, adapter, config.tp)
    if config.vae > 1:
        if getattr(pipe, "vae", None) is None:
            raise ValueError(f"ParallelConfig.vae={config.vae}: {type(pipe).__name__} has no vae")


class ParallelRuntime:
    """A validated config, its mesh, and the undos of what was applied."""

    def __init__(self, pipe: Any, transformers: dict[str, nn.Module], adapter: ModelAdapter,
                 config: ParallelConfig, mesh: ParallelMesh) -> None:
        self.pipe, self.transformers, self.adapter = pipe, transformers, adapter
        self.config, self.mesh = config, mesh

    def shard_weights(self) -> Callable[[], None]:
        """Tensor parallelism (before quantization); returns the undo."""
        from omni_diffusion.parallel.tensor_parallel import enable_tensor_parallel

        if self.config.tp == 1:
            return lambda: None
        undos = [enable_tensor_parallel(t, self.adapter, self.mesh.group("tp"), self.mesh.rank("tp"),
                                        self.config.tp) for t in self.transformers.values()]
        return _chain(undos)

    def install(self, attention_backend: str | None, force_sequence_parallel: bool = False):
        """Sequence parallel, CFG parallel and the VAE group; returns the undo.

        ``force_sequence_parallel`` runs the sequence-parallel code path even at
        degree 1 (benchmarks of its overhead).
        """
        from omni_diffusion.parallel.cfg_parallel import enable_cfg_parallel
        from omni_diffusion.parallel.sequence_attention import SequenceGroups
        from omni_diffusion.parallel.usp import enable_sequence_parallel
        from omni_diffusion.vae_parallel import parallelize_vae, unparallelize_vae

        undos = []
        try:
            if self.config.sequence_degree > 1 or force_sequence_parallel:
                groups = SequenceGroups.from_mesh(self.mesh)
                for transformer in self.transformers.values():
                    undos.append(enable_sequence_parallel(transformer, self.adapter, groups,
                                                          attention_backend))
            if self.config.cfg > 1:
                undos.append(enable_cfg_parallel(self.pipe, self.transformers, self.adapter,
                                                 self.mesh.group("cfg"), self.mesh.rank("cfg"),
                                                 self.config.cfg))
            if self.config.vae > 1:
                vae = self.pipe.vae
                parallelize_vae(vae, self.mesh.vae_group, self.config.vae_mode)
                undos.append(functools.partial(unparallelize_vae, vae))
        except BaseException:
            _chain(undos)()
            raise
        return _chain(undos)


def _chain(undos: list[Callable[[], None]]) -> Callable[[], None]:
    """One undo running ``undos`` last-first; every one runs even when an earlier one
    raises (a half-undone pipeline cannot be accelerated again), then the first error is raised."""
    def undo() -> None:
        first: BaseException | None = None
        for fn in reversed(undos):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - undo the rest, raise after
                first = first or exc
        if first is not None:
            raise first

    return undo


def prepare(pipe: Any, config: ParallelConfig, adapter: ModelAdapter | None = None,
            transformers: dict[str, nn.Module] | None = None,
            device_type: str | None = None) -> ParallelRuntime:
    """Validate ``config`` for ``pipe`` (a pipeline or a bare transformer), then build the mesh."""
    import torch.distributed as dist

    if not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a ParallelConfig, not {type(config).__name__}")
    if isinstance(pipe, nn.Module):
        adapter = adapter or adapter_for_transformer(pipe)
        transformers = transformers or {"transformer": pipe}
    else:
        adapter = adapter or adapter_for(pipe)
        transformers = transformers or adapter.transformers(pipe)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    check(pipe, transformers, adapter, config, world)
    return ParallelRuntime(pipe, transformers, adapter, config, build_mesh(config, device_type))


def parallelize(pipe: Any, config: ParallelConfig, *, adapter: ModelAdapter | None = None,
                attention_backend: str | None = None, device_type: str | None = None,
                force_sequence_parallel: bool = False) -> Callable[[], None]:
    """Apply ``config`` to ``pipe`` without ``accelerate()``; returns the undo.

    Every rank of the job calls it with the same config (torchrun). Raises
    ``ValueError`` before any collective when the config does not fit.
    """
    runtime = prepare(pipe, config, adapter, device_type=device_type)
    undo_weights = runtime.shard_weights()
    try:
        undo_rest = runtime.install(attention_backend, force_sequence_parallel)
    except BaseException:
        undo_weights()
        raise
    return _chain([undo_weights, undo_rest])


__all__ = ["ParallelRuntime", "check", "parallelize", "prepare"]
