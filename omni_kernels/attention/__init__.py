"""Attention for diffusion transformers: one entry point over many backends.

:func:`attention` runs scaled dot-product attention (forward) through omni's
own Triton kernel (``omni_triton``), torch SDPA's kernels (``sdpa_cudnn``,
``sdpa_flash``, ``sdpa_efficient``, ``sdpa_math``), or third-party packages
when installed (``flash_attn``, ``flash_attn3``, ``flashinfer``,
``sageattention`` (lossy), ``xformers``). ``backend="auto"`` picks the fastest
eligible one for the GPU from ``auto_table.json``; :func:`attention_backend`
(context manager) and ``$OMNI_ATTENTION_BACKEND`` choose one for code that does
not pass ``backend=``. :func:`patch_sdpa` routes other code's
``torch.nn.functional.scaled_dot_product_attention`` calls here. See
:mod:`omni_kernels.attention.selection` for the selection rules.

Kernel-level pieces: :mod:`.triton_flash` (the Triton kernel), :mod:`.reference`
(PyTorch math defining the semantics), :mod:`.merge` (merging partial results
by log-sum-exp), :mod:`.ops` (the ``torch.library`` op).
"""

from omni_kernels.attention.api import attention, run_backend, select_backend
from omni_kernels.attention.masks import key_padding_mask_to_lengths, normalize_key_padding_mask
from omni_kernels.attention.registry import (
    AUTO,
    backend_status,
    get_backend,
    list_backends,
    register_backend,
    unregister_backend,
)
from omni_kernels.attention.sdpa_patch import SdpaPatch, patch_sdpa
from omni_kernels.attention.selection import (
    ENV_ALLOW_LOSSY,
    ENV_AUTO_TABLE,
    ENV_BACKEND,
    attention_backend,
    auto_ranking,
    load_auto_table,
    lossy_min_seq,
    reload_auto_table,
)
from omni_kernels.attention.spec import AttentionProblem, BackendSpec

# Imported for their side effects: the built-in backends register themselves,
# ops registers torch.ops.omni_kernels.flash_attention_fwd.
from omni_kernels.attention import backends, ops  # noqa: E402,F401


__all__ = [
    "AUTO",
    "ENV_ALLOW_LOSSY",
    "ENV_AUTO_TABLE",
    "ENV_BACKEND",
    "AttentionProblem",
    "BackendSpec",
    "SdpaPatch",
    "attention",
    "attention_backend",
    "auto_ranking",
    "backend_status",
    "get_backend",
    "key_padding_mask_to_lengths",
    "list_backends",
    "load_auto_table",
    "lossy_min_seq",
    "normalize_key_padding_mask",
    "patch_sdpa",
    "register_backend",
    "reload_auto_table",
    "run_backend",
    "select_backend",
    "unregister_backend",
]
