"""The HTTP layer in-process (httpx's ASGI transport) over a stub engine: validation,
errors, auth, backpressure, metrics, files. No worker process, no model."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest

from omni_serve.app import create_app
from omni_serve.engine import Engine, Job, QueueFull


def _image_as(output_format: str = "png", compression: int | None = None, size: int = 8) -> bytes:
    from PIL import Image

    from omni_serve.media import encode_image

    return encode_image(Image.new("RGB", (size, size), (10, 200, 30)), output_format, compression)


def _png(size: int = 8) -> bytes:
    return _image_as("png", size=size)


def _assert_invalid(r, param: str) -> None:
    """A 400 with an OpenAI-style error body naming ``param``."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


class StubEngine(Engine):
    """Finishes every job at once with ``n`` small PNGs; never starts a process."""

    def __init__(self, max_queue: int = 4, hold: bool = False, kind: str = "image",
                 name: str | None = None) -> None:
        super().__init__("stub", max_queue=max_queue, name=name)
        self.ready = True
        self.info = {"kind": kind, "pipeline": "StubPipeline"}
        self.kind = kind
        self.hold = hold  # leave jobs running (for backpressure tests)
        self.submitted: list[dict] = []
        self._loop = None

    def _post_later(self, job: Job) -> None:
        loop = asyncio.get_running_loop()

        def finish() -> None:
            self._on_event(("batch", [job.id]))
            for step in (1, 2):
                self._on_event(("progress", [job.id], step, 2, 0.01))
            if job.kind == "video":
                self._on_event(("done", job.id, {"frames": [_png(), _png()]}))
            else:  # encoded as the worker does: in the request's output_format
                image = _image_as(job.params.get("output_format", "png"),
                                  job.params.get("output_compression"))
                self._on_event(("done", job.id, {"images": [image] * job.params["n"]}))

        loop.call_soon(finish)

    def submit(self, kind, params, prefix="req"):
        if self._active() >= self.max_queue + 1:
            raise QueueFull(3)
        job = Job(id=f"{prefix}_stub{len(self.submitted)}", kind=kind, params=params)
        self.jobs[job.id] = job
        self.submitted.append(params)
        if not self.hold:
            self._post_later(job)
        return job

    def cancel(self, job_id):
        job = self.jobs.get(job_id)
        if job is None or job.done:
            return False
        self._finish(job, "cancelled", None)
        return True


def _client(engine=None, **kwargs) -> tuple[httpx.AsyncClient, StubEngine]:
    engine = engine or StubEngine()
    app = create_app(engine, manage_engine=False, model_id="stub-model", default_size="64x64",
                     **kwargs)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return client, engine


def run(coro):
    return asyncio.run(coro)


def test_health_models_and_generation():
    async def main():
        client, engine = _client()
        async with client:
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await client.get("/health/ready")).status_code == 200
            models = (await client.get("/v1/models")).json()
            assert models["object"] == "list" and models["data"][0]["id"] == "stub-model"
            r = await client.post("/v1/images/generations",
                                  json={"prompt": "a fox", "n": 2, "size": "32x48", "seed": 7,
                                        "num_inference_steps": 3, "guidance_scale": 2.5,
                                        "negative_prompt": "blur"})
            assert r.status_code == 200, r.text
            data = r.json()["data"]
            assert len(data) == 2
            assert base64.b64decode(data[0]["b64_json"]).startswith(b"\x89PNG")
            params = engine.submitted[-1]
            assert (params["width"], params["height"], params["seed"]) == (32, 48, 7)
            assert params["num_inference_steps"] == 3 and params["negative_prompt"] == "blur"
            await client.post("/v1/images/generations", json={"prompt": "x"})
            assert (engine.submitted[-1]["width"], engine.submitted[-1]["height"]) == (64, 64)
            assert 0 <= engine.submitted[-1]["seed"] < 2**32
    run(main())


BAD = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": "x" * 4001}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 5}, "n"),
    ({"prompt": "a", "n": "2"}, "n"),
    ({"prompt": "a", "n": 1.5}, "n"),
    ({"prompt": "a", "size": "big"}, "size"),
    ({"prompt": "a", "size": "33x32"}, "size"),
    ({"prompt": "a", "size": "4096x4096"}, "size"),
    ({"prompt": "a", "size": "0x0"}, "size"),
    ({"prompt": "a", "size": "-32x32"}, "size"),
    ({"prompt": "a", "response_format": "png"}, "response_format"),
    ({"prompt": "a", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "a", "num_inference_steps": 1000}, "num_inference_steps"),
    ({"prompt": "a", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "a", "guidance_scale": 1e9}, "guidance_scale"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "seed": 2**40}, "seed"),
    ({"prompt": "a", "seed": True}, "seed"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "negative_prompt": "x" * 5000}, "negative_prompt"),
    ({"prompt": "a", "bogus": 1}, "bogus"),
    ({"prompt": "a", "model": "dall-e-3"}, "model"),
    ({"prompt": "a", "output_format": "gif"}, "output_format"),
    ({"prompt": "a", "output_compression": 50}, "output_compression"),  # png: lossless
    ({"prompt": "a", "output_format": "jpeg", "output_compression": 101}, "output_compression"),
    ({"prompt": "a", "output_format": "webp", "output_compression": -1}, "output_compression"),
    ({"prompt": "a", "background": "transparent"}, "background"),
    ({"prompt": "a", "partial_images": 2}, "partial_images"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_inputs_name_the_field(body, param):
    async def main():
        client, engine = _client()
        async with client:
            r = await client.post("/v1/images/generations", json=body)
        _assert_invalid(r, param)
        assert engine.submitted == []  # nothing reached the engine
    run(main())


def test_image_output_formats():
    """output_format png (as generated), jpeg or webp, inline or as a file of that type;
    output_compression is the lossy formats' quality; the response names format and size."""
    from PIL import Image

    async def main():
        client, engine = _client()
        got = {}
        async with client:
            for fmt, compression in [("png", None), ("jpeg", None), ("jpeg", 10), ("webp", 90)]:
                body = {"prompt": "a", "output_format": fmt, "background": "opaque",
                        "moderation": "low", "partial_images": 0}
                if compression is not None:
                    body["output_compression"] = compression
                r = await client.post("/v1/images/generations", json=body)
                assert r.status_code == 200, r.text
                payload = r.json()
                assert (payload["output_format"], payload["size"]) == (fmt, "64x64")
                data = base64.b64decode(payload["data"][0]["b64_json"])
                image = Image.open(io.BytesIO(data))
                assert image.format == {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt]
                assert image.size == (8, 8)  # the stub's image, re-encoded
                pixel = image.convert("RGB").getpixel((4, 4))
                assert max(abs(a - b) for a, b in zip(pixel, (10, 200, 30))) <= 8, pixel
                got[(fmt, compression)] = data
            assert got[("png", None)] == _png()  # png as generated
            assert len(got[("jpeg", 10)]) < len(got[("jpeg", None)])  # quality 10 < 100
            r = await client.post("/v1/images/generations",
                                  json={"prompt": "a", "output_format": "webp",
                                        "response_format": "url"})
            url = r.json()["data"][0]["url"]
            assert url.endswith(".webp")
            file = await client.get(url.removeprefix("http://test"))
            assert file.headers["content-type"] == "image/webp"
            assert Image.open(io.BytesIO(file.content)).format == "WEBP"
    run(main())


def test_malformed_and_oversized_bodies():
    async def main():
        client, engine = _client()
        async with client:
            r = await client.post("/v1/images/generations", content=b"{not json",
                                  headers={"content-type": "application/json"})
            assert r.status_code == 400 and "error" in r.json()
            r = await client.post("/v1/images/generations", json=["a list"])
            assert r.status_code == 400 and "error" in r.json()
            r = await client.post("/v1/images/generations",
                                  json={"prompt": "a", "negative_prompt": "x" * 100_000})
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
            r = await client.get("/v1/nothing-here")
            assert r.status_code == 404 and "error" in r.json()
        assert engine.submitted == []
    run(main())


def test_api_key():
    async def main():
        client, _ = _client(api_key="s3cret")
        async with client:
            assert (await client.get("/health")).status_code == 200  # liveness stays open
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Basic s3cret"}):
                r = await client.get("/v1/models", headers=headers)
                assert r.status_code == 401, headers
                assert r.json()["error"]["code"] == "invalid_api_key"
                r = await client.post("/v1/images/generations", json={"prompt": "a"},
                                      headers=headers)
                assert r.status_code == 401
            ok = {"Authorization": "Bearer s3cret"}
            assert (await client.get("/v1/models", headers=ok)).status_code == 200
            r = await client.post("/v1/images/generations", json={"prompt": "a"}, headers=ok)
            assert r.status_code == 200
    run(main())


def test_model_retrieve_and_unknown_model_404():
    async def main():
        client, _ = _client()
        async with client:
            listed = (await client.get("/v1/models")).json()["data"][0]
            assert (await client.get("/v1/models/stub-model")).json() == listed
            r = await client.get("/v1/models/gpt-image-1")
            assert r.status_code == 404
            error = r.json()["error"]
            assert (error["param"], error["code"]) == ("model", "model_not_found")
            assert "'gpt-image-1'" in error["message"] and "'stub-model'" in error["message"]
    run(main())


def test_queue_full_gives_429_with_retry_after():
    async def main():
        client, engine = _client(StubEngine(max_queue=1, hold=True))
        async with client:
            tasks = [asyncio.create_task(client.post("/v1/images/generations", json={"prompt": "a"}))
                     for _ in range(2)]
            while len(engine.submitted) < 2:
                await asyncio.sleep(0.01)
            r = await client.post("/v1/images/generations", json={"prompt": "a"})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "queue_full"
            for job in list(engine.jobs.values()):
                engine._on_event(("done", job.id, {"images": [_png()]}))
            assert [t.status_code for t in await asyncio.gather(*tasks)] == [200, 200]
            text = (await client.get("/metrics")).text
            assert 'omni_requests_total{endpoint="/v1/images/generations",outcome="rejected"} 1.0' \
                in text
    run(main())


def test_url_files_and_no_paths_from_requests():
    async def main():
        client, engine = _client(file_ttl=60)
        async with client:
            r = await client.post("/v1/images/generations",
                                  json={"prompt": "a", "response_format": "url"})
            url = r.json()["data"][0]["url"]
            assert url.startswith("http://test/v1/files/")
            got = await client.get(url)
            assert got.status_code == 200 and got.content.startswith(b"\x89PNG")
            for bad in ("../../etc/passwd", "..%2F..%2Fetc%2Fpasswd", "x.png",
                        "AAAAAAAAAAAAAAAAAAAAAAAA.png"):
                assert (await client.get(f"/v1/files/{bad}")).status_code == 404
            files = client._transport.app.state.files
            files.ttl = -1
            name = url.rsplit("/", 1)[1]
            files._index[name] = (files._index[name][0], 0.0, "image/png")
            assert (await client.get(url)).status_code == 404  # expired
            files.close()
    run(main())


def test_stream_events_parse(parse_sse):
    async def main():
        client, _ = _client()
        async with client:
            r = await client.post("/v1/images/generations", json={"prompt": "a", "stream": True})
            assert r.headers["content-type"].startswith("text/event-stream")
            events = parse_sse(r.text)
            r = await client.post("/v1/images/generations",
                                  json={"prompt": "a", "stream": True, "n": 2, "size": "32x48",
                                        "response_format": "url"})
            two = parse_sse(r.text)
        done = "image_generation.completed"
        assert [e[0] for e in events] == ["queued", "progress", "progress", done, None]
        assert [e[1]["step"] for e in events if e[0] == "progress"] == [1, 2]
        completed = events[3][1]
        assert completed["type"] == done and completed["index"] == 0
        assert (completed["size"], completed["output_format"]) == ("64x64", "png")
        assert base64.b64decode(completed["b64_json"]).startswith(b"\x89PNG")
        assert events[-1][1] == "[DONE]"
        assert [e[0] for e in two] == ["queued", "progress", "progress", done, done, None]
        assert [(e[1]["index"], e[1]["size"], "b64_json" in e[1]) for e in two if e[0] == done] \
            == [(0, "32x48", False), (1, "32x48", False)]
        assert all(e[1]["url"].startswith("http://test/v1/files/") for e in two if e[0] == done)
        assert all(e[1]["output_format"] == "png" for e in two if e[0] == done)
    run(main())


def test_metrics_text_and_playground():
    async def main():
        client, _ = _client()
        async with client:
            await client.post("/v1/images/generations", json={"prompt": "a"})
            await client.post("/v1/images/generations", json={"prompt": ""})
            text = (await client.get("/metrics")).text
            page = await client.get("/")
            schema = await client.get("/openapi.json")
        for needle in (
            'omni_requests_total{endpoint="/v1/images/generations",outcome="success"} 1.0',
            'omni_requests_total{endpoint="/v1/images/generations",outcome="client_error"} 1.0',
            'omni_request_latency_seconds_count{endpoint="/v1/images/generations"} 2.0',
            'omni_jobs_total{kind="image",outcome="completed"} 1.0',
            "omni_queue_depth 0.0",
            "omni_denoising_step_seconds_count 2.0",
            "omni_batch_size_count 1.0",
        ):
            assert needle in text, needle
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "/v1/images/generations" in page.text
        assert schema.status_code == 200
        assert {"/v1/images/generations", "/v1/videos", "/v1/models"} <= set(schema.json()["paths"])
    run(main())


def test_videos_refused_by_an_image_model():
    async def main():
        client, engine = _client()
        async with client:
            r = await client.post("/v1/videos", json={"prompt": "a"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_model"
            assert (await client.get("/v1/videos/video_nope")).status_code == 404
    run(main())


def _video_client():
    return _client(StubEngine(kind="video", name="stub-video"))


async def _wait_video(client, video_id: str) -> dict:
    for _ in range(200):
        obj = (await client.get(f"/v1/videos/{video_id}")).json()
        if obj["status"] not in ("queued", "in_progress"):
            return obj
        await asyncio.sleep(0.01)
    raise AssertionError(f"{video_id} never finished")


def test_video_create_from_a_form_as_openais_sdk_sends_it():
    """OpenAI's SDK posts multipart/form-data with ``seconds`` as a string; a JSON body and
    an urlencoded form take the same fields. ``seconds`` is the span: s * FPS + 1 frames."""
    async def main():
        client, engine = _video_client()
        async with client:
            # multipart, every field a form part, as the SDK builds it
            parts = {"prompt": (None, "a cat"), "seconds": (None, "8"), "size": (None, "16x16"),
                     "model": (None, "stub-video")}
            r = await client.post("/v1/videos", files=parts)
            assert r.status_code == 200, r.text
            assert r.request.headers["content-type"].startswith("multipart/form-data")
            params = engine.submitted[-1]
            assert (params["prompt"], params["num_frames"], params["width"]) == ("a cat", 129, 16)
            obj = r.json()
            assert obj["seconds"] == "8" and obj["size"] == "16x16" and obj["prompt"] == "a cat"
            # urlencoded (httpx's data= alone): numbers as strings too
            r = await client.post("/v1/videos", data={"prompt": "a fox", "seconds": "4",
                                                      "size": "32x48", "seed": "3",
                                                      "guidance_scale": "2.5",
                                                      "num_inference_steps": "3"})
            assert r.status_code == 200, r.text
            assert r.request.headers["content-type"] == "application/x-www-form-urlencoded"
            params = engine.submitted[-1]
            assert (params["num_frames"], params["seed"], params["guidance_scale"],
                    params["num_inference_steps"], params["height"]) == (65, 3, 2.5, 3, 48)
            # JSON: seconds as a number or a string; or num_frames; or neither
            r = await client.post("/v1/videos", json={"prompt": "a cat", "seconds": 1})
            assert r.status_code == 200 and engine.submitted[-1]["num_frames"] == 17
            r = await client.post("/v1/videos", json={"prompt": "a cat", "seconds": "0.5"})
            assert r.status_code == 200 and engine.submitted[-1]["num_frames"] == 9
            r = await client.post("/v1/videos", json={"prompt": "a cat", "num_frames": 9})
            assert r.status_code == 200 and r.json()["seconds"] == "0.5"
            r = await client.post("/v1/videos", json={"prompt": "a cat"})
            assert engine.submitted[-1]["num_frames"] is None and r.json()["seconds"] is None
            done = await _wait_video(client, r.json()["id"])  # the stub makes 2 frames
            assert done["status"] == "completed" and done["seconds"] == "0.0625"
            assert abs(done["expires_at"] - done["completed_at"] - engine.keep_videos_s) <= 1
    run(main())


BAD_VIDEO = [
    ({"prompt": "a", "seconds": "0"}, "seconds"),
    ({"prompt": "a", "seconds": "-4"}, "seconds"),
    ({"prompt": "a", "seconds": "17"}, "seconds"),
    ({"prompt": "a", "seconds": "four"}, "seconds"),
    ({"prompt": "a", "seconds": "nan"}, "seconds"),
    ({"prompt": "a", "seconds": "1e400"}, "seconds"),
    ({"prompt": "a", "seconds": "4", "num_frames": "9"}, "num_frames"),
    ({"prompt": "a", "num_frames": "0"}, "num_frames"),
    ({"prompt": "a", "num_frames": "1.5"}, "num_frames"),
    ({"prompt": "a", "seed": "x"}, "seed"),
    ({"prompt": "a", "size": "33x32"}, "size"),
    ({"prompt": "a", "bogus": "1"}, "bogus"),
    ({"prompt": "a", "input_reference": "ref.png"}, "input_reference"),
    ({"seconds": "4"}, "prompt"),
]


@pytest.mark.parametrize("encoding", ["json", "multipart", "urlencoded"])
@pytest.mark.parametrize("fields,param", BAD_VIDEO,
                         ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD_VIDEO)])
def test_bad_video_inputs_name_the_field(fields, param, encoding):
    """The same 400 (naming the field) whichever way the fields come; nothing reaches the
    engine. (JSON gets numbers as numbers; a form can only send strings.)"""
    async def main():
        client, engine = _video_client()
        async with client:
            if encoding == "json":
                body = {k: (v if k in ("prompt", "size", "bogus", "input_reference", "seconds")
                            else float(v) if "." in v else int(v) if v.lstrip("-").isdigit()
                            else v) for k, v in fields.items()}
                r = await client.post("/v1/videos", json=body)
            elif encoding == "multipart":
                r = await client.post("/v1/videos",
                                      files={k: (None, v) for k, v in fields.items()})
            else:
                r = await client.post("/v1/videos", data=fields)
        _assert_invalid(r, param)
        assert engine.submitted == []
    run(main())


def test_video_form_edge_cases():
    async def main():
        client, engine = _video_client()
        async with client:
            # an uploaded reference image: image-to-video is refused by name
            r = await client.post("/v1/videos", data={"prompt": "a"},
                                  files={"input_reference": ("ref.png", _png(), "image/png")})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"
            assert "image-to-video" in r.json()["error"]["message"]
            r = await client.post("/v1/videos", files={"prompt": ("p.txt", b"a fox", "text/plain")})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            r = await client.post("/v1/videos", content=b"prompt=a&prompt=b",
                                  headers={"content-type": "application/x-www-form-urlencoded"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            r = await client.post("/v1/videos", content=b"--x\r\nbroken",
                                  headers={"content-type": "multipart/form-data; boundary=x"})
            assert r.status_code == 400 and "error" in r.json()
            r = await client.post("/v1/videos", content=b"prompt: a",
                                  headers={"content-type": "text/yaml"})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
            r = await client.post("/v1/videos", content=b"{not json",
                                  headers={"content-type": "application/json"})
            assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
            r = await client.post("/v1/videos", json=["a", "list"])
            assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
            r = await client.post("/v1/videos", content=b"[" * 5000 + b"]" * 5000,
                                  headers={"content-type": "application/json"})
            assert r.status_code == 400
            r = await client.post("/v1/videos", data={"prompt": "a", "x": "y" * 70_000})
            assert r.status_code == 413
        assert engine.submitted == []
    run(main())


def test_video_list_pages_and_spritesheet():
    async def main():
        client, engine = _video_client()
        async with client:
            ids = []
            for i in range(5):
                r = await client.post("/v1/videos", json={"prompt": f"clip {i}"})
                ids.append(r.json()["id"])
                await _wait_video(client, ids[-1])
                engine.jobs[ids[-1]].created = 1000.0 + i  # distinct, ordered creation times
            page = (await client.get("/v1/videos", params={"limit": 2})).json()
            assert page["object"] == "list" and page["has_more"] is True
            assert [v["id"] for v in page["data"]] == ids[:2:-1][:2] == [ids[4], ids[3]]
            assert (page["first_id"], page["last_id"]) == (ids[4], ids[3])
            seen = [v["id"] for v in page["data"]]
            while page["has_more"]:
                page = (await client.get("/v1/videos", params={"limit": 2,
                                                               "after": page["last_id"]})).json()
                seen += [v["id"] for v in page["data"]]
            assert seen == ids[::-1]
            asc = (await client.get("/v1/videos", params={"order": "asc", "limit": 100})).json()
            assert [v["id"] for v in asc["data"]] == ids and asc["has_more"] is False
            for params, param in [({"after": "video_nope"}, "after"), ({"limit": 0}, "limit"),
                                  ({"limit": 101}, "limit"), ({"order": "up"}, "order")]:
                r = await client.get("/v1/videos", params=params)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            await client.delete(f"/v1/videos/{ids[0]}")
            left = (await client.get("/v1/videos", params={"limit": 100})).json()["data"]
            assert ids[0] not in [v["id"] for v in left] and len(left) == 4
            empty = (await client.get("/v1/videos", params={"after": ids[1]})).json()
            assert empty["data"] == [] and empty["first_id"] is None and not empty["has_more"]

            from PIL import Image

            r = await client.get(f"/v1/videos/{ids[1]}/content", params={"variant": "spritesheet"})
            assert r.status_code == 200 and r.headers["content-type"] == "image/png"
            sheet = Image.open(io.BytesIO(r.content))
            assert sheet.size == (16, 8)  # the stub's two 8x8 frames side by side
            assert sheet.convert("RGB").getpixel((12, 4)) == (10, 200, 30)
    run(main())


def test_spritesheet_grid():
    import numpy as np
    from PIL import Image

    from omni_serve.media import encode_spritesheet

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (6, 10, 3), dtype=np.uint8) for _ in range(7)]
    frames = []
    for a in arrays:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="PNG")
        frames.append(buf.getvalue())
    sheet = np.asarray(Image.open(io.BytesIO(encode_spritesheet(frames))).convert("RGB"))
    assert sheet.shape == (3 * 6, 3 * 10, 3)  # 7 frames: 3 columns, 3 rows, row by row
    for i, a in enumerate(arrays):
        r, c = divmod(i, 3)
        assert np.array_equal(sheet[6 * r:6 * r + 6, 10 * c:10 * c + 10], a)
    assert not sheet[12:, 10:].any()  # the unused cells stay black
    with pytest.raises(ValueError, match="frames"):
        encode_spritesheet([])


@pytest.mark.parametrize("width,height", [(17, 9), (32, 32), (8, 8)])
def test_mp4_and_apng_round_trip(width, height):
    """H.264 MP4 of smooth frames (odd sides padded to even) decodes to the same frames."""
    import av
    import numpy as np
    from PIL import Image

    from omni_serve.media import encode_apng, encode_mp4

    yy, xx = np.mgrid[0:height, 0:width]
    frames = []
    for t in range(5):
        rgb = np.stack([60 + xx * 100 // width + 10 * t, 50 + yy * 100 // height,
                        np.full_like(xx, 30 + 20 * t)], -1)
        buf = io.BytesIO()
        Image.fromarray(rgb.astype(np.uint8)).save(buf, format="PNG")
        frames.append((rgb, buf.getvalue()))
    data = encode_mp4([f for _, f in frames])
    assert data[4:8] == b"ftyp" and b"moov" in data[:4096]  # index first (+faststart)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(decoded) == 5
    for (rgb, _), got in zip(frames, decoded):
        assert got.shape == (height + height % 2, width + width % 2, 3)
        err = np.abs(got[:height, :width].astype(float) - rgb).mean()
        assert err < 6, err  # lossy (crf 18, 4:2:0 chroma) but the same picture
    apng = Image.open(io.BytesIO(encode_apng([f for _, f in frames])))
    assert apng.n_frames == 5 and apng.size == (width, height)
    with pytest.raises(ValueError, match="frames"):
        encode_mp4([])


def _fuzz_app():
    engines = [StubEngine(max_queue=64, name="stub-image"),
               StubEngine(max_queue=64, kind="video", name="stub-video")]
    return create_app(engines, manage_engine=False, model_id="stub", default_size="32x32")


schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (schemathesis brings hypothesis)

_fuzzed = _fuzz_app()
fuzz_schema = schemathesis.openapi.from_asgi("/openapi.json", _fuzzed)


@fuzz_schema.parametrize()
# derandomized: CI sees the same (at most) 50 examples per operation on every run
@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_fuzz_from_openapi_schema_no_5xx(case):
    """Requests generated from the app's own OpenAPI schema (valid and invalid bodies, query
    and path values): never a 5xx, and every error is an OpenAI-style error body."""
    response = case.call()
    assert response.status_code < 500, (case.method, case.formatted_path, case.body,
                                        response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
