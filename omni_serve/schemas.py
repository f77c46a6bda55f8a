"""Request models: every field typed and bounded, unknown fields rejected.

A request that fails validation gets a 400 with an OpenAI-style error body
(:func:`error_body`) whose ``param`` names the offending field.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    # accepted for compatibility with OpenAI clients, ignored
    quality: str | None = Field(default=None, max_length=32)
    style: str | None = Field(default=None, max_length=32)


class VideoCreateRequest(_Request):
    """``POST /v1/videos``."""

    num_frames: int | None = Field(default=None, ge=1, le=MAX_FRAMES)
