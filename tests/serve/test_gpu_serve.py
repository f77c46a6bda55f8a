"""omni-serve on NVIDIA GPUs: one replica per GPU (each worker sees only its own) and
batched generation in bfloat16. Skipped without CUDA."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest

from conftest import Server

pytestmark = pytest.mark.gpu
GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def gpu_server(flux_dir, tmp_path_factory):
    srv = Server(flux_dir, "--device", "cuda", "--dtype", "bfloat16", "--default-size", "32x32",
                 "--max-queue", "16", "--max-batch", "4", "--batch-wait-ms", "300",
                 "--model-name", "tiny-flux", "--attention", "none",
                 log=tmp_path_factory.mktemp("serve-log") / "server.log")
    try:
        srv.wait_ready(180)
        yield srv
    finally:
        srv.stop()


def test_one_replica_per_gpu_each_on_its_own_device(gpu_server):
    import torch

    worker = httpx.get(gpu_server.url + "/health/ready").json()["workers"][0]
    replicas = worker["replicas"]
    assert len(replicas) == torch.cuda.device_count()
    assert [r["devices"] for r in replicas] == [[i] for i in range(len(replicas))]
    assert len({r["visible_devices"] for r in replicas}) == len(replicas)
    assert all(len(r["gpus"]) == 1 and r["ready"] for r in replicas)  # each sees one GPU


def test_batched_generation_on_the_gpu(gpu_server):
    from PIL import Image

    def metric(name):
        for line in httpx.get(gpu_server.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def together():
        async with httpx.AsyncClient(base_url=gpu_server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post(GEN, json={
                "prompt": f"prompt {i}", "seed": i, "num_inference_steps": 2}) for i in range(4)))

    calls, requests = metric("omni_batch_size_count"), metric("omni_batch_size_sum")
    responses = asyncio.run(together())
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:300] for r in responses]
    assert metric("omni_batch_size_count") - calls == 1
    assert metric("omni_batch_size_sum") - requests == 4
    images = [Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
              for r in responses]
    assert all(im.size == (32, 32) for im in images)
    assert len({im.tobytes() for im in images}) == 4
