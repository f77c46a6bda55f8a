"""omni-serve's asynchronous video jobs end to end: a real server with a tiny Wan pipeline."""

from __future__ import annotations

import io
import math
import time
import warnings

import httpx
import pytest


def _decode_mp4(data: bytes):
    """Every frame of an MP4 as ``[H, W, 3]`` uint8 arrays, after checking the container:
    ``ftyp`` first, an H.264 video stream."""
    import av

    assert data[4:8] == b"ftyp", data[:16]
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]


def _wait(server, video_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = httpx.get(f"{server.url}/v1/videos/{video_id}").json()
        if obj["status"] in ("completed", "failed", "cancelled"):
            return obj
        time.sleep(0.1)
    raise AssertionError(f"video {video_id} not done after {timeout}s")


def test_video_job_lifecycle(wan_server):
    models = httpx.get(wan_server.url + "/v1/models").json()["data"]
    assert [(m["id"], m["kind"]) for m in models] == [("tiny-wan", "video")]
    r = httpx.post(wan_server.url + "/v1/videos",
                   json={"prompt": "a fox running", "num_frames": 5, "num_inference_steps": 2,
                         "seed": 1})
    assert r.status_code == 200, r.text
    obj = r.json()
    assert obj["object"] == "video" and obj["status"] in ("queued", "in_progress", "completed")
    assert obj["size"] == "32x32"
    done = _wait(wan_server, obj["id"])
    assert done["status"] == "completed" and done["progress"] == 100, done
    content = httpx.get(f"{wan_server.url}/v1/videos/{obj['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    frames = _decode_mp4(content.content)
    assert len(frames) >= 2  # (the tiny VAE decodes at 1/4 of the size)
    apng = httpx.get(f"{wan_server.url}/v1/videos/{obj['id']}/content", params={"format": "apng"})
    assert apng.status_code == 200 and apng.headers["content-type"] == "image/apng"
    from PIL import Image

    video = Image.open(io.BytesIO(apng.content))
    assert video.n_frames == len(frames)
    assert (video.width + video.width % 2, video.height + video.height % 2) == frames[0].shape[1::-1]
    listed = httpx.get(f"{wan_server.url}/v1/videos/{obj['id']}/content",
                       params={"format": "frames"}).json()
    assert listed["object"] == "video.frames" and len(listed["frames"]) == len(frames)
    thumb = httpx.get(f"{wan_server.url}/v1/videos/{obj['id']}/content",
                      params={"variant": "thumbnail"})
    assert thumb.headers["content-type"] == "image/png" and thumb.content.startswith(b"\x89PNG")
    bad = httpx.get(f"{wan_server.url}/v1/videos/{obj['id']}/content", params={"format": "gif"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "format"
    deleted = httpx.delete(f"{wan_server.url}/v1/videos/{obj['id']}").json()
    assert deleted == {"id": obj["id"], "object": "video.deleted", "deleted": True}
    assert httpx.get(f"{wan_server.url}/v1/videos/{obj['id']}").status_code == 404


def test_video_delete_cancels_a_running_job(wan_server):
    r = httpx.post(wan_server.url + "/v1/videos",
                   json={"prompt": "slow", "num_frames": 9, "num_inference_steps": 100,
                         "size": "256x256"})  # a few seconds: still running when deleted
    video_id = r.json()["id"]
    deadline = time.monotonic() + 30
    while httpx.get(f"{wan_server.url}/v1/videos/{video_id}").json()["status"] == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    content = httpx.get(f"{wan_server.url}/v1/videos/{video_id}/content")
    assert content.status_code == 409 and content.json()["error"]["code"] == "not_ready"
    assert httpx.delete(f"{wan_server.url}/v1/videos/{video_id}").status_code == 200
    assert httpx.get(f"{wan_server.url}/v1/videos/{video_id}").status_code == 404
    # the worker is free again
    r = httpx.post(wan_server.url + "/v1/videos",
                   json={"prompt": "quick", "num_frames": 5, "num_inference_steps": 1})
    assert _wait(wan_server, r.json()["id"])["status"] == "completed"
    text = httpx.get(wan_server.url + "/metrics").text
    assert 'omni_jobs_total{kind="video",outcome="cancelled"} 1.0' in text


def test_image_request_to_a_video_model(wan_server):
    r = httpx.post(wan_server.url + "/v1/images/generations", json={"prompt": "a"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_model"


def test_openai_python_sdk_video_round_trip(wan_server):
    """OpenAI's own Python SDK against the real server: create_and_poll (it posts
    multipart/form-data, ``seconds`` as a string; extra_body carries omni's fields), retrieve,
    list (auto-paging), download_content's three variants, a 400 it raises as
    BadRequestError, delete."""
    openai = pytest.importorskip("openai")
    from PIL import Image

    client = openai.OpenAI(base_url=wan_server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the SDK marks Sora's API so
        video = client.videos.create_and_poll(
            prompt="a fox running", seconds="0.25", size="32x32", model="tiny-wan",
            poll_interval_ms=50, extra_body={"num_inference_steps": 2, "seed": 5})
        assert video.status == "completed" and video.progress == 100, video
        assert (video.model, video.size, video.prompt) == ("tiny-wan", "32x32", "a fox running")
        assert client.videos.retrieve(video.id).id == video.id
        frames = _decode_mp4(client.videos.download_content(video.id).content)
        # the span the MP4 holds (this tiny test VAE returns fewer frames than the 5 asked for:
        # 0.25 s at 16 fps; the frames asked for are checked in test_api)
        assert video.seconds == f"{(len(frames) - 1) / 16:g}", (video.seconds, len(frames))
        thumb = client.videos.download_content(video.id, variant="thumbnail").content
        sheet = client.videos.download_content(video.id, variant="spritesheet").content
        assert thumb.startswith(b"\x89PNG") and sheet.startswith(b"\x89PNG")
        width, height = Image.open(io.BytesIO(thumb)).size
        columns = math.ceil(math.sqrt(len(frames)))
        rows = math.ceil(len(frames) / columns)
        assert Image.open(io.BytesIO(sheet)).size == (columns * width, rows * height)
        other = client.videos.create(prompt="a cat", extra_body={"num_frames": 5,
                                                                 "num_inference_steps": 1})
        listed = [v.id for v in client.videos.list(limit=1)]  # one a page: the SDK pages on
        assert listed[:2] == [other.id, video.id], listed
        with pytest.raises(openai.BadRequestError) as bad:
            client.videos.create(prompt="a fox", seconds="99")
        assert bad.value.status_code == 400 and "seconds" in str(bad.value)
        assert client.videos.delete(video.id).deleted is True
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
        _wait(wan_server, other.id)
