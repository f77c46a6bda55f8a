"""Batching and data-parallel replicas end to end: a real uvicorn with two CPU worker
processes (``--replicas 2``) of a tiny Flux pipeline, ``--max-batch 4`` and a 400 ms
batching window."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest

from conftest import Server

GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def batch_server(flux_dir, tmp_path_factory):
    srv = Server(flux_dir, "--default-size", "32x32", "--max-queue", "8", "--model-name",
                 "tiny-flux", "--attention", "none", "--replicas", "2", "--max-batch", "4",
                 "--batch-wait-ms", "400",
                 log=tmp_path_factory.mktemp("serve-log") / "server.log")
    try:
        srv.wait_ready(90)
        yield srv
    finally:
        srv.stop()


def _metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))), dtype=np.float64)


async def _together(server, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        return await asyncio.gather(*(client.post(GEN, json=b) for b in bodies))


def test_two_replicas_are_up(batch_server):
    ready = httpx.get(batch_server.url + "/health/ready").json()
    pids = ready["workers"][0]["worker_pids"]
    assert len(pids) == 2 and len(set(pids)) == 2 and ready["workers"][0]["max_batch"] == 4
    replicas = ready["workers"][0]["replicas"]
    assert [(r["replica"], r["devices"], r["ready"], r["gpus"]) for r in replicas] == \
        [(0, None, True, []), (1, None, True, [])]  # CPU workers: no device group


def test_concurrent_compatible_requests_run_as_one_call(batch_server):
    bodies = [{"prompt": f"prompt number {i}", "seed": 100 * (i + 1), "num_inference_steps": 2}
              for i in range(4)]
    alone = [_pixels(r.json()["data"][0]["b64_json"]) for r in
             [httpx.post(batch_server.url + GEN, json=b, timeout=60) for b in bodies]]
    before = _metrics(batch_server)
    responses = asyncio.run(_together(batch_server, bodies))
    after = _metrics(batch_server)
    assert [r.status_code for r in responses] == [200] * 4
    assert after["omni_batch_size_count"] - before["omni_batch_size_count"] == 1  # one call
    assert after["omni_batch_size_sum"] - before["omni_batch_size_sum"] == 4  # of four requests
    assert after['omni_batch_size_bucket{le="4.0"}'] - before['omni_batch_size_bucket{le="4.0"}'] == 1
    assert after['omni_batch_size_bucket{le="2.0"}'] == before['omni_batch_size_bucket{le="2.0"}']
    ids = {r.headers["x-request-id"] for r in responses}
    assert len(ids) == 4
    for i, r in enumerate(responses):  # each result is its own request's image
        got = _pixels(r.json()["data"][0]["b64_json"])
        distances = [np.abs(got - ref).mean() for ref in alone]
        assert int(np.argmin(distances)) == i and distances[i] <= 1.0, (i, distances)


def test_incompatible_requests_spread_over_both_replicas(batch_server):
    before = _metrics(batch_server)
    bodies = [{"prompt": "wide", "size": "48x32", "num_inference_steps": 2, "seed": 1},
              {"prompt": "tall", "size": "32x48", "num_inference_steps": 2, "seed": 2}]
    responses = asyncio.run(_together(batch_server, bodies))
    after = _metrics(batch_server)
    from PIL import Image

    sizes = [Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size
             for r in responses]
    assert sizes == [(48, 32), (32, 48)]
    assert after["omni_batch_size_count"] - before["omni_batch_size_count"] == 2
    for replica in ("0", "1"):  # each worker ran one of them
        key = f'omni_replica_batches_total{{replica="{replica}"}}'
        assert after[key] - before.get(key, 0.0) == 1, (replica, before, after)
