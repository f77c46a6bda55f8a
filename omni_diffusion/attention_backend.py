"""The former import path of :mod:`omni_diffusion.attention.diffusers_backend`, kept for users."""

from omni_diffusion.attention.diffusers_backend import (  # noqa: F401
    FALLBACKS,
    OMNI_BACKEND_NAME,
    register_diffusers_backend,
    register_omni_attention_backend,
    set_attention_backend,
)

__all__ = ["FALLBACKS", "OMNI_BACKEND_NAME", "register_diffusers_backend", "register_omni_attention_backend",
           "set_attention_backend"]
