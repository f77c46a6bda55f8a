"""``omni-generate``: load a diffusers pipeline, accelerate it, generate, save.

::

    omni-generate black-forest-labs/FLUX.1-dev --prompt "a red fox in the snow" \\
        --steps 28 --height 1024 --width 1024 --compile --cache first_block -o fox.png
    omni-generate ./Wan2.1-T2V-14B-Diffusers --prompt "..." --num-frames 81 -o fox.mp4

``MODEL`` is a local directory in diffusers' ``save_pretrained`` layout or a
hub id (downloaded through ``huggingface_hub``; offline that fails with a
message saying so); without it, the embedded digits image model
(:mod:`omni_diffusion.embedded`). On an embedded model the size, frames and prompt
length left unset are the ones it was trained for (32x32), not the pipeline's. The acceleration flags are :func:`omni_diffusion.config.add_cli_arguments`'
(``--attention``, ``--quant``, ``--cache``, ``--compile``, ...). Images are
saved as PNG; videos as MP4 (H.264, written by PyAV) when PyAV is installed, else as
numbered PNG frames in a directory named after the output.
A progress bar (tqdm) shows the denoising steps; a summary with timings and
cache hits is printed at the end (``--json PATH`` writes it as JSON too).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from omni_diffusion.config import add_cli_arguments, from_cli_args

logger = logging.getLogger("omni_diffusion.cli")

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "float32": "float32", "fp32": "float32"}


class CLIError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-generate",
        description="Generate an image or video with a diffusers pipeline accelerated by omni.",
    )
    parser.add_argument("model", nargs="?", default=None,
                        help="local pipeline directory (save_pretrained layout) or hub id "
                             "(default: the embedded digits image model)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (pipeline default)")
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--true-cfg-scale", type=float, default=None,
                        help="true classifier-free guidance for guidance-distilled models")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num-frames", type=int, default=None, help="video pipelines")
    parser.add_argument("--image", default=None, help="input image (image-to-video, Kontext editing)")
    parser.add_argument("--max-sequence-length", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto",
                        help="bfloat16 | float16 | float32 | auto (bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--local-files-only", action="store_true",
                        help="never download: MODEL must be local or in the hub cache")
    parser.add_argument("-o", "--output", default=None,
                        help="output file (.png for images, .mp4 for videos); default omni_<time>.png/.mp4")
    parser.add_argument("--fps", type=int, default=16, help="frames per second of saved videos")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cli_arguments(parser)
    return parser


def _load_pipeline(model: str | None, dtype, local_files_only: bool):
    if model is None:
        from omni_diffusion.embedded import load_embedded_pipeline

        try:
            return load_embedded_pipeline("image", dtype)
        except FileNotFoundError as exc:
            raise CLIError(f"no MODEL given and the embedded default model is not installed "
                           f"({exc}); pass a diffusers folder or hub id") from exc
    try:
        from diffusers import DiffusionPipeline
    except ImportError as exc:  # pragma: no cover - diffusers is a dependency
        raise CLIError(f"diffusers is not installed: {exc}") from exc
    is_local = os.path.isdir(model)
    if not is_local and (model.startswith((".", "/", "~")) or model.count("/") > 1):
        raise CLIError(f"{model!r} is not a directory (nor a hub id of the form org/name)")
    try:  # diffusers that know ``dtype=`` deprecate ``torch_dtype=``
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401

        kwargs: dict[str, Any] = dict(dtype=dtype)
    except ImportError:
        kwargs = dict(torch_dtype=dtype)
    if local_files_only:
        kwargs["local_files_only"] = True
    try:
        return DiffusionPipeline.from_pretrained(model, **kwargs)
    except Exception as exc:  # noqa: BLE001 - turn loading failures into one clear message
        where = "the local directory" if is_local else (
            "the hub cache (--local-files-only)" if local_files_only
            else "the Hugging Face hub (no network? set HF_HUB_OFFLINE=1 to use only the cache)"
        )
        raise CLIError(f"could not load {model!r} from {where}: {type(exc).__name__}: {exc}") from exc


def _call_kwargs(pipe, args, generator) -> tuple[dict[str, Any], bool]:
    from omni_diffusion.embedded import native_call_kwargs

    params = inspect.signature(pipe.__call__).parameters
    native = native_call_kwargs(args.model)
    wanted: dict[str, Any] = dict(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        true_cfg_scale=args.true_cfg_scale,
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        max_sequence_length=args.max_sequence_length,
        generator=generator,
    )
    if args.image is not None:
        from PIL import Image

        wanted["image"] = Image.open(args.image).convert("RGB")
    kwargs = {}
    for name, value in wanted.items():
        if value is None and name in native and name in params:
            value = native[name]  # what the embedded model was trained for
        if value is None:
            continue
        if name not in params:
            if name in ("prompt", "generator"):
                raise CLIError(f"{type(pipe).__name__} takes no {name!r} argument")
            raise CLIError(f"{type(pipe).__name__} has no {name!r} argument "
                           f"(flag --{name.replace('_', '-')})")
        kwargs[name] = value
    is_video = "num_frames" in params
    if "output_type" in params:
        kwargs["output_type"] = "np" if is_video else "pil"
    return kwargs, is_video


def _to_uint8_frames(frames) -> list:
    import numpy as np

    if isinstance(frames, np.ndarray):
        arr = frames
    elif hasattr(frames, "detach"):  # torch tensor
        arr = frames.detach().float().cpu().numpy()
    else:  # list of PIL images
        return [np.asarray(f.convert("RGB")) for f in frames]
    if arr.ndim == 4 and arr.shape[1] in (1, 3) and arr.shape[-1] not in (1, 3):
        arr = arr.transpose(0, 2, 3, 1)  # [F, C, H, W] -> [F, H, W, C]
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    return list(arr)


def save_video(frames, output: Path, fps: int) -> tuple[Path, str | None]:
    """MP4 via PyAV when it is installed; else PNG frames. Returns (path, note)."""
    from PIL import Image

    from omni_diffusion.mp4 import write_mp4

    images = _to_uint8_frames(frames)
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_mp4(images, output, fps)
        return output, None
    except ImportError as exc:
        reason = f"{type(exc).__name__}: {exc}"
    folder = output.with_suffix("")
    folder = folder.parent / (folder.name + "_frames")
    folder.mkdir(parents=True, exist_ok=True)
    for index, frame in enumerate(images):
        Image.fromarray(frame).save(folder / f"frame_{index:04d}.png")
    note = (f"MP4 needs PyAV (pip install av): {reason}; "
            f"saved {len(images)} PNG frames instead")
    return folder, note


def save_images(images, output: Path) -> list[Path]:
    output.parent.mkdir(parents=True, exist_ok=True)
    if len(images) == 1:
        images[0].save(output)
        return [output]
    paths = []
    for index, image in enumerate(images):
        path = output.with_name(f"{output.stem}_{index}{output.suffix}")
        image.save(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = from_cli_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return _run(args, config)
    except CLIError as exc:
        print(f"omni-generate: error: {exc}", file=sys.stderr)
        return 2


def _run(args, config) -> int:
    import torch

    import omni_diffusion

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype.lower()
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype_name not in _DTYPES:
        raise CLIError(f"--dtype {args.dtype!r}: one of auto, {', '.join(sorted(set(_DTYPES)))}")
    dtype = getattr(torch, _DTYPES[dtype_name])

    start = time.perf_counter()
    pipe = _load_pipeline(args.model, dtype, args.local_files_only)
    pipe = pipe.to(device)
    load_s = time.perf_counter() - start
    pipe.set_progress_bar_config(disable=True)

    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="denoising", unit="step", file=sys.stderr)
    step_times: list[float] = []
    last = [time.perf_counter()]

    def progress(step: int, total: int | None, latents) -> None:
        now = time.perf_counter()
        step_times.append(now - last[0])
        last[0] = now
        if bar is not None:
            if total is not None and bar.total != total:
                bar.total = total
                bar.refresh()
            bar.update(1)

    try:
        omni_diffusion.accelerate(pipe, config, progress=progress)
    except (ValueError, ImportError) as exc:
        raise CLIError(str(exc)) from exc

    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    kwargs, is_video = _call_kwargs(pipe, args, generator)
    start = last[0] = time.perf_counter()
    try:
        result = pipe(**kwargs)
    finally:
        if bar is not None:
            bar.close()
    generate_s = time.perf_counter() - start

    output = Path(args.output or time.strftime("omni_%Y%m%d_%H%M%S") + (".mp4" if is_video else ".png"))
    note = None
    if is_video:
        frames = result.frames[0]
        saved_path, note = save_video(frames, output, args.fps)
        saved = [saved_path]
    else:
        saved = save_images(result.images, output)

    stats = omni_diffusion.last_cache_stats(pipe)
    summary = dict(
        model=args.model or "embedded:image",
        pipeline=type(pipe).__name__,
        device=device,
        dtype=dtype_name,
        config=config.to_dict(),
        load_s=round(load_s, 3),
        generate_s=round(generate_s, 3),
        steps=len(step_times),
        step_s=[round(t, 4) for t in step_times],
        cache=None if stats is None else stats.to_dict(),
        outputs=[str(p) for p in saved],
        note=note,
    )
    print(f"{type(pipe).__name__}: {len(step_times)} steps in {generate_s:.2f}s "
          f"(load {load_s:.1f}s) -> {', '.join(str(p) for p in saved)}")
    if stats is not None and stats.passes:
        print(f"cache {stats.kind}: {stats.hits}/{stats.passes} transformer calls served from cache, "
              f"{stats.skipped_fraction:.0%} of block calls skipped")
    if note:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
