"""A bare ``omni-serve`` (no model argument) serves the embedded image and video models, and
what it makes is what the pipeline makes for the same request (the image also scored with
omni_diffusion.embedded's classifier)."""

from __future__ import annotations

import base64
import io
import time

import httpx
import pytest
import torch

pytest.importorskip("sklearn")


def test_bare_server_serves_embedded_image_and_video(embedded_server):
    from PIL import Image

    from omni_diffusion.embedded import CALL_KWARGS, evaluate, evaluate_video, load_embedded_pipeline

    models = httpx.get(embedded_server.url + "/v1/models").json()["data"]
    assert sorted((m["id"], m["kind"]) for m in models) == [
        ("omni-embedded-image", "image"), ("omni-embedded-video", "video")]

    # the request the README shows: default size (32x32) and number of steps
    r = httpx.post(embedded_server.url + "/v1/images/generations", timeout=120,
                   json={"prompt": "a handwritten digit seven", "response_format": "b64_json", "seed": 3})
    assert r.status_code == 200, r.text
    image = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    assert image.size == (32, 32)
    assert evaluate.digit_classifier().predict([image]).tolist() == [7]

    # a video at the defaults: the embedded model's 9 frames (not WanPipeline's 81), 50 steps
    r = httpx.post(embedded_server.url + "/v1/videos",
                   json={"prompt": "a handwritten digit three moving right", "seed": 0})
    assert r.status_code == 200, r.text
    video_id = r.json()["id"]
    deadline = time.monotonic() + 120
    while (obj := httpx.get(f"{embedded_server.url}/v1/videos/{video_id}").json())["status"] \
            not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, obj
        time.sleep(0.2)
    assert obj["status"] == "completed", obj
    frames = httpx.get(f"{embedded_server.url}/v1/videos/{video_id}/content",
                       params={"format": "frames"}).json()["frames"]
    clip = [Image.open(io.BytesIO(base64.b64decode(f))) for f in frames]
    assert len(clip) == 9 and clip[0].size == (32, 32)
    # the same request to the pipeline in this process gives the same clip
    pipe = load_embedded_pipeline("video")
    here = pipe("a handwritten digit three moving right", generator=torch.Generator().manual_seed(0),
                output_type="pil", **CALL_KWARGS["video"]).frames[0]
    assert evaluate_video.to_clips([clip]).sub(evaluate_video.to_clips([here])).abs().max() <= 2 / 255
