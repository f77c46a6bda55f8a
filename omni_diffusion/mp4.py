"""MP4 (H.264) writing through PyAV, shared by ``omni-generate`` and ``omni-serve``.

PyAV's wheels bundle FFmpeg with libx264, so no system ffmpeg (nor imageio) is needed.
"""

from __future__ import annotations

import os


def write_mp4(frames, path: str | os.PathLike, fps: int = 16) -> None:
    """Write ``frames`` (``[H, W, 3]`` uint8 RGB arrays, equal sizes) to ``path`` as an H.264
    MP4 (yuv420p, moov atom first, so a browser can start playing before the file arrives).

    Raises ImportError when PyAV is missing, ValueError for no frames or unequal sizes."""
    import av
    import numpy as np

    if len(frames) == 0:
        raise ValueError("frames: an empty list is not allowed; allowed: one frame or more")
    height, width = frames[0].shape[:2]
    # yuv420p subsamples chroma 2x2: odd sides get their last row/column repeated
    pad_h, pad_w = height % 2, width % 2
    with av.open(os.fspath(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = width + pad_w, height + pad_h
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        for arr in frames:
            if arr.shape[:2] != (height, width):
                raise ValueError(f"frames: sizes differ ({arr.shape[1]}x{arr.shape[0]} vs "
                                 f"{width}x{height}); allowed: equal sizes")
            if pad_h or pad_w:
                arr = np.pad(arr, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(arr), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():  # flush the encoder's delayed frames
            out.mux(packet)
