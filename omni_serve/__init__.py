"""omni_serve: the HTTP server (OpenAI-compatible image and video endpoints).

It calls ``omni_diffusion``; nothing below it imports this package.
"""

__version__ = "0.1.0"
