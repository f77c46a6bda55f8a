"""Embedded default models: tiny diffusers pipelines, trained, that ship inside the package.

``"image"``: a FluxPipeline (``models/digits-image``) trained on scikit-learn's handwritten
digits: ``pipe("a handwritten digit seven", **IMAGE_CALL_KWARGS)`` draws a seven, 32x32.
Its text encoders (CLIP and T5, byte-level tokenizers) are tiny, trained with the
transformer in the last training stage. Retrain with ``python -m omni_diffusion.embedded.train``;
score with ``python -m omni_diffusion.embedded.evaluate``.

Call it with ``max_sequence_length=32`` (:data:`IMAGE_CALL_KWARGS`): it was trained with the
prompts padded to 32 tokens, and FluxPipeline's default (512) pads the T5 sequence far longer.

``"video"``: a WanPipeline (``models/digits-video``: AutoencoderKLWan, WanTransformer3DModel,
UMT5 text encoder) trained on the same digits crossing the frame:
``pipe("a handwritten digit three moving right", **VIDEO_CALL_KWARGS)`` makes 9 frames of 32x32
(:data:`VIDEO_CALL_KWARGS`: WanPipeline's defaults are 81 frames and 512 prompt tokens).
Retrain with ``python -m omni_diffusion.embedded.train --kind video``; score with
``python -m omni_diffusion.embedded.evaluate --kind video``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

KINDS = ("image", "video")

_FOLDERS = {"image": "digits-image", "video": "digits-video"}
_PIPELINES = {"image": "FluxPipeline", "video": "WanPipeline"}

#: call arguments the image model was trained for (height/width 32, T5 prompt length 32)
IMAGE_CALL_KWARGS = dict(height=32, width=32, max_sequence_length=32)
#: call arguments the video model was trained for (9 frames of 32x32, UMT5 prompt length 16)
VIDEO_CALL_KWARGS = dict(height=32, width=32, num_frames=9, max_sequence_length=16)
#: the call arguments of each kind
CALL_KWARGS = {"image": IMAGE_CALL_KWARGS, "video": VIDEO_CALL_KWARGS}


def embedded_pipeline_path(kind: str = "image") -> Path:
    """The folder of the embedded ``kind`` model (``"image"`` or ``"video"``), loadable with
    ``<Pipeline>.from_pretrained``. Raises ``FileNotFoundError`` when it is not there."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    path = Path(__file__).resolve().parent / "models" / _FOLDERS[kind]
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"no embedded {kind} model at {path}")
    return path


def native_call_kwargs(model: str | os.PathLike | None, kind: str = "image") -> dict:
    """The call arguments (size, frames, prompt length) ``model`` was trained for, to fill what
    a caller leaves unset: :data:`CALL_KWARGS` of ``kind`` when ``model`` is None (the embedded
    default), of the folder's kind when ``model`` is an embedded model folder, else ``{}`` (the
    pipeline's own defaults apply)."""
    if model is None:
        return dict(CALL_KWARGS[kind])
    resolved = Path(model).expanduser().resolve()
    for folder_kind in KINDS:
        try:
            if embedded_pipeline_path(folder_kind) == resolved:
                return dict(CALL_KWARGS[folder_kind])
        except FileNotFoundError:
            continue
    return {}


def load_embedded_pipeline(kind: str = "image", dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu"):
    """The embedded ``kind`` pipeline, in ``dtype`` on ``device``, progress bar off."""
    import diffusers

    cls = getattr(diffusers, _PIPELINES[kind])
    pipe = cls.from_pretrained(embedded_pipeline_path(kind), dtype=dtype, local_files_only=True)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


__all__ = ["CALL_KWARGS", "IMAGE_CALL_KWARGS", "KINDS", "VIDEO_CALL_KWARGS", "embedded_pipeline_path",
           "load_embedded_pipeline", "native_call_kwargs"]
