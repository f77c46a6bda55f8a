"""The built-in attention backends; importing this package registers them.

Registration order is the tie-break order of ``"auto"`` for backends that the
ranking table does not list (lossless ones only). Each module imports its
third-party package lazily, inside its availability check and run function.
"""

from omni_kernels.attention.backends import (  # noqa: F401  (imported to register)
    omni_triton,
    sdpa,
    flash_attn,
    flashinfer,
    sageattention,
    omni_sage,
    omni_sage_sm90,
    xformers,
)
