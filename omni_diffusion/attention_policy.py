"""The former import path of :mod:`omni_diffusion.attention.policy`, kept for users (the README names it)."""

from omni_diffusion.attention.policy import (  # noqa: F401
    AttentionPolicyHandle,
    FullPrecisionPolicy,
    apply_attention_policy,
    attention_modules,
)

__all__ = ["AttentionPolicyHandle", "FullPrecisionPolicy", "apply_attention_policy", "attention_modules"]
