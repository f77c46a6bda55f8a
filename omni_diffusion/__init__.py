"""omni_diffusion: the runtime that applies omni's kernels to diffusers pipelines.

It composes attention backends, quantization, caching, compilation and
parallelism on top of ``omni_kernels``; it never imports ``omni_serve``.
"""

__version__ = "0.1.0"
