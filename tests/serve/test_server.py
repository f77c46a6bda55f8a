"""omni-serve end to end: a real uvicorn on 127.0.0.1 with a tiny Flux pipeline on the CPU."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import time

import httpx
import pytest

GEN = "/v1/images/generations"


def _image(b64: str):
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_health_models_ready(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/health/ready").json()
    assert ready["status"] == "ready"
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny-flux"
    assert models["data"][0]["kind"] == "image"


def test_generate_b64_and_url(server):
    r = httpx.post(server.url + GEN, json={"prompt": "a red fox", "n": 2, "num_inference_steps": 2,
                                           "seed": 3, "size": "32x48"}, timeout=60)
    assert r.status_code == 200, r.text
    images = [_image(d["b64_json"]) for d in r.json()["data"]]
    assert len(images) == 2 and all(im.size == (32, 48) for im in images)
    timing = dict(part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    assert float(timing["engine"]) > 0 and float(timing["queue"]) >= 0
    r = httpx.post(server.url + GEN, json={"prompt": "a red fox", "num_inference_steps": 2,
                                           "response_format": "url", "negative_prompt": "blur"},
                   timeout=60)
    assert r.status_code == 200, r.text
    url = r.json()["data"][0]["url"]
    assert url.startswith(server.url + "/v1/files/")
    got = httpx.get(url)
    assert got.status_code == 200 and got.content.startswith(b"\x89PNG")


def test_openai_python_sdk_images(server):
    """OpenAI's own Python SDK: images.generate, b64_json and url, omni's fields in
    extra_body; a bad size comes back as the SDK's BadRequestError."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    result = client.images.generate(prompt="a red fox", n=2, size="32x48", model="tiny-flux",
                                    response_format="b64_json",
                                    extra_body={"num_inference_steps": 2, "seed": 3})
    images = [_image(d.b64_json) for d in result.data]
    assert len(images) == 2 and all(im.size == (32, 48) for im in images)
    url = client.images.generate(prompt="a red fox", response_format="url",
                                 extra_body={"num_inference_steps": 2}).data[0].url
    assert httpx.get(url).content.startswith(b"\x89PNG")
    with pytest.raises(openai.BadRequestError) as bad:
        client.images.generate(prompt="a red fox", size="33x33")
    assert bad.value.status_code == 400 and "size" in str(bad.value)
    # streamed: the SDK yields omni's progress events, then OpenAI's completed events
    events = list(client.images.generate(prompt="a red fox", n=2, stream=True,
                                         extra_body={"num_inference_steps": 2, "seed": 3}))
    completed = [e for e in events if e.type == "image_generation.completed"]
    assert [e.type for e in events[-2:]] == ["image_generation.completed"] * 2
    assert [_image(e.b64_json).size for e in completed] == [(32, 32), (32, 32)]
    # the same seed gives the same images streamed or not
    plain = client.images.generate(prompt="a red fox", n=2, response_format="b64_json",
                                   extra_body={"num_inference_steps": 2, "seed": 3})
    assert [e.b64_json for e in completed] == [d.b64_json for d in plain.data]
    # OpenAI's format fields: a jpeg at quality 80, streamed too
    jpeg = client.images.generate(prompt="a red fox", output_format="jpeg", output_compression=80,
                                  background="opaque", moderation="auto",
                                  extra_body={"num_inference_steps": 2, "seed": 3})
    assert jpeg.output_format == "jpeg" and _image(jpeg.data[0].b64_json).format == "JPEG"
    streamed = list(client.images.generate(prompt="a red fox", output_format="webp", stream=True,
                                           extra_body={"num_inference_steps": 2, "seed": 3}))
    assert streamed[-1].output_format == "webp" and _image(streamed[-1].b64_json).format == "WEBP"


def test_openai_python_sdk_models_retrieve(server):
    """The SDK's models.retrieve: OpenAI's Model object as /v1/models lists it; an unknown id
    is the SDK's NotFoundError naming it and the served models."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    model = client.models.retrieve("tiny-flux")
    assert (model.id, model.object, model.owned_by, model.created) == ("tiny-flux", "model",
                                                                       "omni", 0)
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("dall-e-3")
    assert "'dall-e-3'" in str(missing.value) and "'tiny-flux'" in str(missing.value)


def test_api_key_guards_files_and_health_details(keyed_server):
    """With --api-key: a url file needs the key or the signed, expiring query the server put
    in the url (401 unsigned, 403 tampered or expired); /health/ready shows only its status
    without the key."""
    key = {"Authorization": "Bearer test-key"}
    bare = httpx.get(keyed_server.url + "/health/ready")
    assert bare.status_code == 200 and bare.json() == {"status": "ready"}
    full = httpx.get(keyed_server.url + "/health/ready", headers=key).json()
    assert full["workers"][0]["worker_pid"] > 0
    assert httpx.get(keyed_server.url + "/v1/models/tiny-flux").status_code == 401
    assert httpx.get(keyed_server.url + "/v1/models/tiny-flux", headers=key).status_code == 200
    r = httpx.post(keyed_server.url + GEN, headers=key, timeout=60,
                   json={"prompt": "a", "num_inference_steps": 1, "response_format": "url"})
    assert r.status_code == 200, r.text
    url = r.json()["data"][0]["url"]
    unsigned, _, query = url.partition("?")
    fields = dict(part.split("=", 1) for part in query.split("&"))
    assert set(fields) == {"expires", "signature"}
    assert httpx.get(url).content.startswith(b"\x89PNG")  # what a browser's <img> does
    assert httpx.get(unsigned, headers=key).content.startswith(b"\x89PNG")
    denied = httpx.get(unsigned)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    later = str(int(fields["expires"]) + 3600)
    flipped = fields["signature"][:-1] + ("0" if fields["signature"][-1] != "0" else "1")
    for tampered in (f"expires={later}&signature={fields['signature']}",
                     f"expires={fields['expires']}&signature={flipped}",
                     f"signature={fields['signature']}"):
        r = httpx.get(f"{unsigned}?{tampered}")
        assert r.status_code == 403, tampered
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    time.sleep(max(0.0, int(fields["expires"]) + 1.1 - time.time()))
    expired = httpx.get(url)
    assert expired.status_code == 403 and "expired" in expired.json()["error"]["message"]


def test_concurrent_results_belong_to_their_requests(server):
    def body(seed):
        return {"prompt": f"prompt {seed}", "num_inference_steps": 2, "seed": seed}

    reference = {s: httpx.post(server.url + GEN, json=body(s), timeout=60).json()["data"][0]
                 for s in (11, 12)}
    assert reference[11] != reference[12]

    async def both():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(client.post(GEN, json=body(s)) for s in (12, 11)))

    r12, r11 = asyncio.run(both())
    assert r11.json()["data"][0] == reference[11]
    assert r12.json()["data"][0] == reference[12]


def test_stream_progress_then_result(server, parse_sse):
    with httpx.stream("POST", server.url + GEN, timeout=60,
                      json={"prompt": "a fox", "num_inference_steps": 3, "stream": True}) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = parse_sse(text)
    names = [e[0] for e in events]
    assert names == ["queued", "progress", "progress", "progress", "image_generation.completed",
                     None], names
    assert [e[1]["step"] for e in events if e[0] == "progress"] == [1, 2, 3]
    assert all(e[1]["total"] == 3 for e in events if e[0] == "progress")
    assert _image(events[4][1]["b64_json"]).size == (32, 32)
    assert events[-1][1] == "[DONE]"


def test_validation_error_from_real_server(server):
    r = httpx.post(server.url + GEN, json={"prompt": "a", "size": "32x31"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "size"


def _metric(server, line_start: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_queue_full_429(server):
    long = {"prompt": "slow", "num_inference_steps": 100}

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post(GEN, json=long) for _ in range(4)))

    before = _metric(server, 'omni_requests_total{endpoint="/v1/images/generations",outcome="rejected"}')
    results = asyncio.run(burst())
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 429, 429], codes  # --max-queue 1: one running, one waiting
    rejected = [r for r in results if r.status_code == 429][0]
    assert int(rejected.headers["retry-after"]) >= 1
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    after = _metric(server, 'omni_requests_total{endpoint="/v1/images/generations",outcome="rejected"}')
    assert after == before + 2


def test_client_disconnect_cancels(server):
    key = 'omni_jobs_total{kind="image",outcome="cancelled"}'
    before = _metric(server, key)
    with httpx.stream("POST", server.url + GEN, timeout=60,
                      json={"prompt": "a", "num_inference_steps": 100, "stream": True,
                            "size": "256x256"}) as r:  # seconds: still running when we act
        for line in r.iter_lines():
            if line.startswith("event: progress"):
                break  # leave after the first step
    deadline = time.monotonic() + 20
    while _metric(server, key) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server, key) == before + 1
    # the worker is free again: a short request goes through
    r = httpx.post(server.url + GEN, json={"prompt": "a", "num_inference_steps": 1}, timeout=60)
    assert r.status_code == 200


def test_client_disconnect_cancels_a_plain_request(server):
    key = 'omni_jobs_total{kind="image",outcome="cancelled"}'
    before = _metric(server, key)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + GEN, timeout=httpx.Timeout(10, read=1.0),
                   json={"prompt": "a", "num_inference_steps": 100, "size": "256x256"})
    deadline = time.monotonic() + 20
    while _metric(server, key) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server, key) == before + 1


def test_worker_killed_mid_request(server):
    pid = httpx.get(server.url + "/health/ready").json()["worker_pid"]
    with httpx.stream("POST", server.url + GEN, timeout=60,
                      json={"prompt": "a", "num_inference_steps": 100, "stream": True,
                            "size": "256x256"}) as r:  # seconds: still running when we act
        events = []
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
                if line == "event: progress" and events.count("progress") == 1:
                    os.kill(pid, signal.SIGKILL)
        assert events[-1] == "error", events
    info = server.wait_ready(60)  # a new worker comes up
    assert info["worker_pid"] != pid
    r = httpx.post(server.url + GEN, json={"prompt": "a", "num_inference_steps": 1}, timeout=60)
    assert r.status_code == 200
    assert _metric(server, "omni_worker_restarts_total") >= 1


def test_metrics_moved(server):
    text = httpx.get(server.url + "/metrics").text
    assert 'omni_jobs_total{kind="image",outcome="completed"}' in text
    assert _metric(server, "omni_denoising_step_seconds_count") > 0
    assert _metric(server, "omni_batch_size_count") > 0
    assert 'omni_request_latency_seconds_bucket{endpoint="/v1/images/generations"' in text


def test_cli_without_model_and_without_embedded_models(monkeypatch, capsys):
    """With no MODEL and no embedded model folders, omni-serve exits 2 and says what is missing."""
    import omni_serve.cli as cli

    monkeypatch.setattr(cli, "_embedded_kinds", lambda: [])
    assert cli.main(["--port", "1"]) == 2
    assert "embedded default models are not installed" in capsys.readouterr().err


def test_embedded_image_model_is_found():
    """The package ships the embedded image model that a bare `omni-serve` serves."""
    from omni_serve.cli import _embedded_kinds

    assert "image" in _embedded_kinds()


async def _playground_in_chromium(url: str, timeout: float = 60.0) -> dict:
    """Open ``url`` in headless Chromium and drive it over the DevTools protocol until the
    page says done (or failed); returns the page's state read from its DOM."""
    import json
    import shutil
    import socket
    import subprocess
    import tempfile

    websockets = pytest.importorskip("websockets")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install -y chromium)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    profile = tempfile.mkdtemp(prefix="omni-serve-chromium-")
    proc = subprocess.Popen([browser, "--headless", "--no-sandbox", "--disable-gpu",
                             "--disable-dev-shm-usage", f"--remote-debugging-port={port}",
                             f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=1).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "Chromium's DevTools endpoint did not come up"
                await asyncio.sleep(0.1)
        page = next(t for t in targets if t["type"] == "page")
        async with websockets.connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
            ids = iter(range(1, 1_000_000))

            async def call(method: str, **params):
                n = next(ids)
                await ws.send(json.dumps({"id": n, "method": method, "params": params}))
                while True:
                    message = json.loads(await ws.recv())
                    if message.get("id") == n:
                        return message["result"]

            await call("Page.navigate", url=url)
            read = ("JSON.stringify({status: $('status').textContent, err: $('err').textContent,"
                    " bar: [$('bar').value, $('bar').max],"
                    " images: [...document.querySelectorAll('#out img')].map(i => i.src)})")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                result = await call("Runtime.evaluate", expression=read, returnByValue=True)
                value = result.get("result", {}).get("value")
                state = json.loads(value) if value else {}
                if state.get("status") == "done" or state.get("err"):
                    return state
                await asyncio.sleep(0.2)
            raise AssertionError(f"the playground did not finish in {timeout}s: {state}")
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(profile, ignore_errors=True)


def test_playground_in_headless_chromium(server):
    """The page streams a generation (progress bar to the last step) and shows the same image
    the API returns for the same request; a bad size shows the server's error message."""
    state = asyncio.run(_playground_in_chromium(
        server.url + "/?prompt=a%20blue%20square&steps=3&seed=5&run=1"))
    assert state["status"] == "done" and state["err"] == "", state
    assert state["bar"] == [3, 3]
    assert len(state["images"]) == 1 and state["images"][0].startswith("data:image/png;base64,")
    api = httpx.post(server.url + GEN, json={"prompt": "a blue square", "num_inference_steps": 3,
                                             "seed": 5}, timeout=60).json()
    assert state["images"][0].split(",", 1)[1] == api["data"][0]["b64_json"]
    state = asyncio.run(_playground_in_chromium(server.url + "/?prompt=a&size=33x32&run=1"))
    assert "size" in state["err"] and state["images"] == []
