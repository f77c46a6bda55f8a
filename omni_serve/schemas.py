"""Request models: every field typed and bounded, unknown fields rejected.

A request that fails validation gets a 400 with an OpenAI-style error body
(:func:`error_body`) whose ``param`` names the offending field.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from omni_serve.media import FPS

MAX_PROMPT_CHARS = 4000
MAX_BODY_BYTES = 64 * 1024
MIN_SIDE, MAX_SIDE, SIDE_MULTIPLE = 16, 2048, 16
MAX_N = 4
MAX_STEPS = 100
MAX_FRAMES = 257


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI's API sends it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` -> ``(width, height)``; ValueError when malformed or out of bounds."""
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and 0 < len(p) <= 5 for p in parts):
        raise ValueError(f"size must be 'WIDTHxHEIGHT', e.g. '1024x1024'; got {size!r}")
    width, height = int(parts[0]), int(parts[1])
    for side in (width, height):
        if not MIN_SIDE <= side <= MAX_SIDE or side % SIDE_MULTIPLE:
            raise ValueError(
                f"size {size!r}: width and height must be multiples of {SIDE_MULTIPLE} "
                f"between {MIN_SIDE} and {MAX_SIDE}")
    return width, height


def _shown(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "a number too long to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(default=None, max_length=256)
    size: str | None = Field(default=None, max_length=16,
                             description="'WIDTHxHEIGHT' (the model's default when absent)")
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=50.0)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    user: str | None = Field(default=None, max_length=256)

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)
        return value

    @field_validator("guidance_scale")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value


class ImageGenerationRequest(_Request):
    """``POST /v1/images/generations``."""

    n: int = Field(default=1, ge=1, le=MAX_N)
    response_format: Literal["b64_json", "url"] = "b64_json"
    stream: bool = False
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(
        default=None, ge=0, le=100,
        description="jpeg/webp quality, 0-100 (default 100; png is lossless: not allowed)")
    # what the models here make: an opaque image, and no partial images while it denoises
    background: str | None = Field(default=None, max_length=32,
                                   description="'auto' or 'opaque' (transparency is not offered)")
    partial_images: int | None = Field(default=None, description="0 (partial images are not "
                                                                 "offered)")
    # accepted for compatibility with OpenAI clients, ignored
    quality: str | None = Field(default=None, max_length=32)
    style: str | None = Field(default=None, max_length=32)
    moderation: str | None = Field(default=None, max_length=32)

    @field_validator("background")
    @classmethod
    def _opaque(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "opaque"):
            raise ValueError(f"{_shown(value)} is not offered: the models here make opaque "
                             "images; allowed: 'auto', 'opaque'")
        return value

    @field_validator("partial_images")
    @classmethod
    def _no_partials(cls, value: int | None) -> int | None:
        if value not in (None, 0):
            raise ValueError("partial images are not offered (the image is decoded once, at "
                             "the end); allowed: 0. stream: true gives per-step progress")
        return value

    @field_validator("output_compression")
    @classmethod
    def _lossy_only(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("output_format", "png") == "png":
            raise ValueError("applies to output_format 'jpeg' or 'webp' only; png is lossless")
        return value


def frames_for_seconds(seconds: str | int | float) -> int:
    """A clip spanning ``seconds`` (a number, or a numeric string as OpenAI's SDK sends it) at
    :data:`omni_serve.media.FPS`: ``seconds * FPS + 1`` frames, the first frame plus FPS a
    second, as video DiTs count them (Wan's 81 frames at 16 fps are its 5 s; 4 s asks for 65,
    a length Wan and HunyuanVideo take as it is). ValueError unless that is 2 to MAX_FRAMES."""
    if isinstance(seconds, bool):
        raise ValueError(f"must be a number of seconds, e.g. '4'; got {_shown(seconds)}")
    try:
        value = float(seconds.strip() if isinstance(seconds, str) else seconds)
    except (ValueError, OverflowError):
        raise ValueError(f"must be a number of seconds, e.g. '4'; got {_shown(seconds)}") from None
    # bounds first: round() of an overflowed product would raise OverflowError, not ValueError
    if not (math.isfinite(value) and 0 < value <= (MAX_FRAMES - 1) / FPS
            and round(value * FPS) >= 1):
        raise ValueError(f"must be between {1 / FPS:g} and {(MAX_FRAMES - 1) / FPS:g} seconds "
                         f"({FPS} frames a second); got {_shown(seconds)}")
    return round(value * FPS) + 1


def seconds_of(frames: int) -> str:
    """The time a clip of ``frames`` spans (first frame to last, at FPS), as OpenAI's Video
    object gives ``seconds``: ``frames_for_seconds``'s inverse."""
    return f"{(frames - 1) / FPS:g}"


class VideoCreateRequest(_Request):
    """``POST /v1/videos``: a JSON body, or the same fields as a form (OpenAI's SDK posts
    ``multipart/form-data``). The clip's length is ``seconds`` or ``num_frames`` (not both);
    neither: the model's default."""

    seconds: str | int | float | None = Field(
        default=None, description=f"the time the clip spans, at {FPS} frames a second: "
                                  f"seconds * {FPS} + 1 frames (OpenAI's field; its SDK sends a "
                                  "string such as '4')")
    num_frames: int | None = Field(default=None, ge=1, le=MAX_FRAMES)

    @field_validator("seconds")
    @classmethod
    def _seconds(cls, value: str | int | float | None) -> str | int | float | None:
        if value is not None:
            frames_for_seconds(value)
        return value

    @field_validator("num_frames")
    @classmethod
    def _one_length(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("seconds") is not None:
            raise ValueError("give seconds or num_frames, not both")
        return value

    @property
    def frames(self) -> int | None:
        """The frame count asked for (from ``num_frames`` or ``seconds``), or None."""
        if self.num_frames is not None:
            return self.num_frames
        return None if self.seconds is None else frames_for_seconds(self.seconds)
