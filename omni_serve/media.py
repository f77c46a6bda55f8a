"""Video containers for ``GET /v1/videos/{id}/content``: MP4 (H.264), animated PNG and a
spritesheet (every frame in one PNG grid).

MP4 is encoded in-process by PyAV, whose wheels bundle FFmpeg with libx264, so no
system ffmpeg is needed (``pip install "omni[serve]"``).
"""

from __future__ import annotations

import io
import math
import os
import tempfile

FPS = 16


def _frames(frames: list[bytes]):
    from PIL import Image

    if not frames:
        raise ValueError("frames: an empty list is not allowed; allowed: one PNG or more")
    return [Image.open(io.BytesIO(f)).convert("RGB") for f in frames]


def encode_mp4(frames: list[bytes], fps: int = FPS) -> bytes:
    """The frames (PNG bytes, equal sizes) as an H.264 MP4 (yuv420p, moov atom first, so a
    browser can start playing before the whole file arrives)."""
    try:
        import av  # noqa: F401 - only to say clearly when it is missing
    except ImportError as exc:
        raise RuntimeError("MP4 output needs PyAV (pip install av, part of omni[serve]); "
                           "ask for format=apng or format=frames instead") from exc
    import numpy as np

    from omni_diffusion.mp4 import write_mp4

    images = [np.asarray(im) for im in _frames(frames)]
    with tempfile.TemporaryDirectory(prefix="omni-serve-mp4-") as tmp:
        # +faststart rewrites the file to move the index first; it needs a real path
        path = os.path.join(tmp, "video.mp4")
        write_mp4(images, path, fps)
        with open(path, "rb") as f:
            return f.read()


def encode_apng(frames: list[bytes], fps: int = FPS) -> bytes:
    """The frames (PNG bytes) as one animated PNG, looping."""
    images = _frames(frames)
    buf = io.BytesIO()
    images[0].save(buf, format="PNG", save_all=True, append_images=images[1:],
                   duration=int(1000 / fps), loop=0)
    return buf.getvalue()


def encode_spritesheet(frames: list[bytes]) -> bytes:
    """The frames (PNG bytes, equal sizes) tiled into one PNG, row by row, in a grid of
    ceil(sqrt(n)) columns (OpenAI's ``variant=spritesheet``: a clip at a glance)."""
    from PIL import Image

    images = _frames(frames)
    columns = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    sheet = Image.new("RGB", (columns * width, rows * height))
    for i, image in enumerate(images):
        sheet.paste(image, ((i % columns) * width, (i // columns) * height))
    buf = io.BytesIO()
    sheet.save(buf, format="PNG")
    return buf.getvalue()


IMAGE_MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(image, output_format: str = "png", compression: int | None = None) -> bytes:
    """A PIL image as ``output_format``: png (lossless), or jpeg/webp at quality
    ``compression`` (0-100, default 100)."""
    if output_format not in IMAGE_MEDIA_TYPES:
        raise ValueError(f"output_format: {output_format!r} is not one of "
                         f"{', '.join(IMAGE_MEDIA_TYPES)}")
    buf = io.BytesIO()
    if output_format == "png":
        image.save(buf, format="PNG")
    else:
        image.convert("RGB").save(buf, format=output_format.upper(),
                                  quality=100 if compression is None else compression)
    return buf.getvalue()
