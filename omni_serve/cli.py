"""``omni-serve [MODEL]``: serve a diffusers pipeline over HTTP (OpenAI-style API).

::

    omni-serve ./FLUX.1-schnell --port 8000 --api-key "$KEY" --max-queue 16 --cache first_block

With no MODEL it serves the embedded default models (``omni_diffusion.embedded``): the
image model and, when installed, the video model, each in its own worker process.
The acceleration flags are :func:`omni_diffusion.config.add_cli_arguments`', including the
LLM prompt stages (``--prompt-encoder``, ``--prompt-encoder-url``, ``--prompt-enhancer``,
``--prompt-enhancer-url``, ``--vllm-gpu-memory-utilization``; see ``omni_diffusion.ar``).
Batching (``--max-batch``, ``--batch-wait-ms``) and data-parallel replicas (``--replicas``,
``--gpus-per-replica``) are :mod:`omni_serve.batching`'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    from omni_diffusion.config import add_cli_arguments

    parser = argparse.ArgumentParser(prog="omni-serve", description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None,
                        help="local diffusers folder or hub id (default: the embedded model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("OMNI_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $OMNI_API_KEY)")
    parser.add_argument("--max-queue", type=int, default=16,
                        help="requests that may wait beside the running one; more get 429")
    parser.add_argument("--model-name", default=None, help="the id /v1/models lists")
    parser.add_argument("--default-size", default=None,
                        help="WxH when a request names no size (default: 32x32 for the embedded "
                             "digits model, 1024x1024 for a MODEL)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--file-ttl", type=float, default=3600.0,
                        help="seconds a response_format=url file (and its signed url) stays "
                             "available")
    parser.add_argument("--log-level", default="info")
    g = parser.add_argument_group("batching and replicas")
    g.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="images one pipeline call may hold: compatible queued requests (same "
                        "model, size, steps, guidance, frames) run together (1: no batching)")
    g.add_argument("--batch-wait-ms", type=float, default=0.0, metavar="MS",
                   help="how long a free worker waits for compatible requests to join a "
                        "batch (default 0: batch only what is already queued)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="data-parallel worker processes (default: one per GPU group on CUDA, "
                        "one on the CPU)")
    g.add_argument("--gpus-per-replica", type=int, default=1, metavar="G",
                   help="GPUs in each replica's group; its pipeline's components are spread "
                        "over them (default 1)")
    add_cli_arguments(parser)
    return parser


def _embedded_kinds() -> list[str]:
    """The kinds of embedded default model that are installed."""
    if importlib.util.find_spec("omni_diffusion.embedded") is None:
        return []
    from omni_diffusion import embedded

    kinds = []
    for kind in getattr(embedded, "KINDS", ("image",)):
        try:
            embedded.embedded_pipeline_path(kind)
        except (FileNotFoundError, ValueError, AttributeError):
            continue
        kinds.append(kind)
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from omni_diffusion.config import from_cli_args

    from omni_serve.schemas import parse_size

    try:
        accel = from_cli_args(args).to_dict()
        if args.default_size is None:
            # the embedded models' trained size (32x32); other models default to 1024x1024
            from omni_diffusion.embedded import native_call_kwargs

            native = native_call_kwargs(args.model)
            args.default_size = f"{native['width']}x{native['height']}" if native else "1024x1024"
        parse_size(args.default_size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.max_queue < 0:
        parser.error("--max-queue must be >= 0")
    if args.max_batch < 1:
        parser.error(f"--max-batch {args.max_batch} is not allowed; allowed: an integer >= 1")
    if not 0 <= args.batch_wait_ms <= 10_000:
        parser.error(f"--batch-wait-ms {args.batch_wait_ms} is not allowed; allowed: 0 to 10000")
    kinds: list[str | None] = [None]
    if args.model is None:
        kinds = _embedded_kinds()
        if not kinds:
            print("omni-serve: no MODEL given and the embedded default models are not installed "
                  "(omni_diffusion.embedded and its model folders); pass a diffusers folder or "
                  "hub id", file=sys.stderr)
            return 2
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    from omni_serve.batching import plan_replicas

    try:
        num_gpus = 0
        if device.startswith("cuda"):
            import torch

            num_gpus = torch.cuda.device_count()
        placement = plan_replicas(device, num_devices=num_gpus, replicas=args.replicas,
                                  gpus_per_replica=args.gpus_per_replica)
    except ValueError as exc:
        parser.error(str(exc))
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"

    import uvicorn

    from omni_serve.app import create_app
    from omni_serve.engine import Engine

    logging.basicConfig(level=args.log_level.upper())
    from omni_serve.metrics import Metrics

    metrics = Metrics()
    engines = []
    for kind in kinds:
        if args.model is not None:
            name = args.model_name or os.path.basename(os.path.normpath(args.model))
        else:
            name = f"{args.model_name or 'omni-embedded'}-{kind}"
        engines.append(Engine(args.model, accel, kind=kind, name=name, max_queue=args.max_queue,
                              device=device, dtype=dtype, metrics=metrics, placement=placement,
                              max_batch=args.max_batch, batch_wait_s=args.batch_wait_ms / 1000))
    app = create_app(engines, api_key=args.api_key, model_id=name,
                     default_size=args.default_size, file_ttl=args.file_ttl)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
