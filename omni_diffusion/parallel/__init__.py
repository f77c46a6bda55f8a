"""Multi-GPU parallelism for one generation: CFG, Ulysses, Ring (USP) and tensor parallel.

One :class:`ParallelConfig` maps onto a ``torch.distributed`` DeviceMesh
(:mod:`.config`); each strategy is one module: :mod:`.cfg_parallel`,
:mod:`.ulysses`, :mod:`.ring`, :mod:`.sequence_attention` (their composition in one
attention call) and :mod:`.usp` (the token placement: image tokens sharded, text tokens
replicated),
:mod:`.tensor_parallel`. :mod:`.apply` validates and installs them; the
per-model facts come from the adapters (``sequence_parallel``,
``tensor_parallel``, ``cfg``). Use it through
``accelerate(pipe, AccelConfig(parallel=ParallelConfig(...)))`` under torchrun,
or :func:`parallelize`.
"""

from omni_diffusion.parallel.apply import ParallelRuntime, parallelize, prepare
from omni_diffusion.parallel.config import MESH_DIMS, ParallelConfig, ParallelMesh, build_mesh

__all__ = ["MESH_DIMS", "ParallelConfig", "ParallelMesh", "ParallelRuntime", "build_mesh",
           "parallelize", "prepare"]
