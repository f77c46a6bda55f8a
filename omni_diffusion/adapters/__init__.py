"""Per-family model adapters and the registry that picks one for a pipeline.

:func:`adapter_for` resolves a diffusers pipeline (instance or class) to its
:class:`~omni_diffusion.adapters.base.ModelAdapter`: first by the pipeline
class (along its MRO, so subclasses resolve too), then by the class of its
``transformer`` (pipelines of a supported family that are not listed, such as
Flux img2img, resolve that way). An unsupported pipeline raises ``ValueError``
listing the supported ones. One module per family registers its adapter with
:func:`register_adapter`: flux, sd3, wan, qwen_image, hunyuan_video.
"""

from __future__ import annotations

from omni_diffusion.adapters.base import (
    BlockCall,
    BlockList,
    CFGInfo,
    ModelAdapter,
    SequenceLayout,
    SequenceParallelPlan,
    TensorParallelPlan,
    block_call,
)
from omni_diffusion.adapters.registry import (
    adapter_for,
    adapter_for_transformer,
    list_adapters,
    register_adapter,
    supported_pipelines,
)

# Family modules register themselves on import.
from omni_diffusion.adapters import flux, hunyuan_video, qwen_image, sd3, wan  # noqa: F401

__all__ = [
    "BlockCall",
    "BlockList",
    "CFGInfo",
    "ModelAdapter",
    "SequenceLayout",
    "SequenceParallelPlan",
    "TensorParallelPlan",
    "adapter_for",
    "adapter_for_transformer",
    "block_call",
    "list_adapters",
    "register_adapter",
    "supported_pipelines",
]
