"""omni's attention inside diffusers models.

:mod:`.diffusers_backend` registers omni as a diffusers attention backend
(``transformer.set_attention_backend("omni")``); :mod:`.policy` says which attention
calls may run a lossy (quantized) backend and which stay exact.
"""

from omni_diffusion.attention.diffusers_backend import (
    FALLBACKS,
    OMNI_BACKEND_NAME,
    register_diffusers_backend,
    register_omni_attention_backend,
    set_attention_backend,
)
from omni_diffusion.attention.policy import (
    AttentionPolicyHandle,
    FullPrecisionPolicy,
    apply_attention_policy,
    attention_modules,
)

__all__ = [
    "FALLBACKS",
    "OMNI_BACKEND_NAME",
    "AttentionPolicyHandle",
    "FullPrecisionPolicy",
    "apply_attention_policy",
    "attention_modules",
    "register_diffusers_backend",
    "register_omni_attention_backend",
    "set_attention_backend",
]
