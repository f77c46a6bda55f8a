"""Batching and replica dispatch without processes: the batch choice, the placement math,
the engine's scheduling over fake replicas, and the worker's batch runner on a tiny Flux
pipeline in this process (one pipeline call per batch, results to the right jobs, a bad
job failing alone)."""

from __future__ import annotations

import asyncio
import functools
import io
import queue
import types

import numpy as np
import pytest

from omni_serve.batching import batch_key, plan_replicas, select_batch, visible_devices
from omni_serve.engine import Engine, QueueFull


def _job(prompt="a", n=1, **over):
    params = dict(prompt=prompt, negative_prompt=None, num_inference_steps=2, guidance_scale=3.5,
                  width=32, height=32, n=n, seed=1, num_frames=None)
    params.update(over)
    return types.SimpleNamespace(kind="image", params=params)


def test_batch_key_and_select_batch():
    a, b = _job("a", seed=1), _job("b", seed=2, negative_prompt=None)
    assert batch_key("image", a.params) == batch_key("image", b.params)  # prompt/seed may differ
    for field, value in (("width", 48), ("num_inference_steps", 3), ("guidance_scale", 1.0),
                         ("negative_prompt", "blur")):
        assert batch_key("image", _job(**{field: value}).params) != batch_key("image", a.params)
    assert batch_key("video", a.params) != batch_key("image", a.params)
    big, other, small = _job(n=3), _job(width=48), _job(n=2)
    queued = [a, big, other, small, _job(), _job()]
    # oldest first; the 48-wide one keeps its place; images stay within max_batch
    assert select_batch(queued, 4) == [a, big]
    assert select_batch(queued, 6) == [a, big, small]
    assert select_batch([big, a], 2) == [big]  # n above max_batch still runs, alone
    assert select_batch(queued, 1) == [a]
    assert select_batch([], 4) == []
    with pytest.raises(ValueError, match="max_batch"):
        select_batch(queued, 0)


@pytest.mark.parametrize("device,gpus,replicas,per,expected", [
    ("cpu", 0, None, 1, [None]),
    ("cpu", 0, 2, 1, [None, None]),
    ("cuda", 8, None, 1, [(i,) for i in range(8)]),
    ("cuda", 8, None, 2, [(0, 1), (2, 3), (4, 5), (6, 7)]),
    ("cuda", 8, 2, 4, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ("cuda", 7, None, 2, [(0, 1), (2, 3), (4, 5)]),  # the odd GPU stays unused
    ("cuda", 1, None, 1, [(0,)]),
    ("cuda:3", 4, None, 1, [(3,)]),
])
def test_plan_replicas(device, gpus, replicas, per, expected):
    assert plan_replicas(device, num_devices=gpus, replicas=replicas,
                         gpus_per_replica=per) == expected


@pytest.mark.parametrize("device,gpus,replicas,per,match", [
    ("cpu", 0, None, 2, "gpus_per_replica"),
    ("cpu", 0, 0, 1, "replicas"),
    ("cuda", 4, 3, 2, "replicas: 3"),
    ("cuda", 2, None, 4, "gpus_per_replica: 4"),
    ("cuda", 0, None, 1, "gpus_per_replica"),
    ("cuda:4", 4, None, 1, "device"),
    ("cuda:0", 4, 2, 1, "pins one GPU"),
    ("tpu", 4, None, 1, "device"),
])
def test_plan_replicas_refuses(device, gpus, replicas, per, match):
    with pytest.raises(ValueError, match=match):
        plan_replicas(device, num_devices=gpus, replicas=replicas, gpus_per_replica=per)


def test_visible_devices_maps_through_the_servers_own():
    assert visible_devices((2, 3), None) == "2,3"
    assert visible_devices((1,), "4,5,6") == "5"
    assert visible_devices((0, 1), "GPU-a, GPU-b") == "GPU-a,GPU-b"
    with pytest.raises(ValueError, match="shows 2"):
        visible_devices((2,), "0,1")


# --------------------------------------------------------------------------- engine


class _FakeQueue:
    def __init__(self) -> None:
        self.items: list = []

    def put(self, item) -> None:
        self.items.append(item)


def _engine(replicas: int = 1, **kwargs) -> Engine:
    """An engine whose replicas are ready and whose worker queues are lists."""
    engine = Engine("fake", placement=[None] * replicas, **kwargs)
    for replica in engine.replicas:
        replica.ready, replica.jobs_q, replica.control_q = True, _FakeQueue(), _FakeQueue()
    engine.ready = True
    return engine


def _runs(engine: Engine, replica: int = 0) -> list[list[str]]:
    return [[j[0] for j in m[1]] for m in engine.replicas[replica].jobs_q.items if m[0] == "run"]


def test_engine_batches_what_queued_while_the_worker_was_busy():
    async def main():
        engine = _engine(max_queue=8, max_batch=4)
        engine._loop = asyncio.get_running_loop()
        first = engine.submit("image", _job().params)
        assert _runs(engine) == [[first.id]]  # a free worker starts at once
        jobs = [engine.submit("image", _job(f"p{i}", seed=i).params) for i in range(3)]
        odd = engine.submit("image", _job(width=64).params)
        assert engine.queue_depth == 4 and len(_runs(engine)) == 1
        engine._on_event(("done", first.id, {"images": [b"x"]}))
        engine._on_event(("idle",))
        assert _runs(engine)[1] == [j.id for j in jobs]  # one call for the three
        engine._on_event(("batch", [j.id for j in jobs]))
        assert all(j.status == "in_progress" for j in jobs) and odd.status == "queued"
        for i, job in enumerate(jobs):
            engine._on_event(("done", job.id, {"images": [bytes([i])]}))
        engine._on_event(("idle",))
        assert _runs(engine)[2] == [odd.id]
        assert [j.result["images"] for j in jobs] == [[b"\x00"], [b"\x01"], [b"\x02"]]
        text = engine.metrics.render().decode()
        assert "omni_batch_size_count 1.0" in text and "omni_batch_size_sum 3.0" in text
        assert 'omni_replica_batches_total{replica="0"} 1.0' in text
    asyncio.run(main())


def test_engine_batch_wait_window_collects_late_joiners():
    async def main():
        engine = _engine(max_queue=8, max_batch=4, batch_wait_s=0.15)
        engine._loop = asyncio.get_running_loop()
        a = engine.submit("image", _job().params)
        await asyncio.sleep(0.05)
        b = engine.submit("image", _job("b").params)
        assert _runs(engine) == []  # still inside the window
        await asyncio.sleep(0.2)
        assert _runs(engine) == [[a.id, b.id]]
    asyncio.run(main())


def test_engine_spreads_batches_over_replicas_and_a_dead_one_fails_only_its_jobs():
    async def main():
        engine = _engine(replicas=2, max_queue=8, max_batch=2)
        engine._loop = asyncio.get_running_loop()
        jobs = [engine.submit("image", _job(f"p{i}", width=32 + 16 * i).params) for i in range(3)]
        assert _runs(engine, 0) == [[jobs[0].id]] and _runs(engine, 1) == [[jobs[1].id]]
        assert jobs[2].status == "queued" and engine.queue_depth == 1
        engine._on_event(("worker_died",), replica=1)
        assert jobs[1].status == "failed" and "died" in jobs[1].error[1]
        assert jobs[0].status == "queued" and jobs[2].status == "queued"  # not touched
        assert engine.ready  # replica 0 still serves
        engine._on_event(("idle",), replica=0)
        assert _runs(engine, 0)[1] == [jobs[2].id]
        assert engine.cancel(jobs[2].id)
        assert engine.replicas[0].control_q.items == [jobs[2].id]  # told to stop at a step
    asyncio.run(main())


def test_engine_queue_bound_inside_a_batching_window():
    async def main():
        engine = _engine(max_queue=1, max_batch=2, batch_wait_s=5.0)
        engine._loop = asyncio.get_running_loop()
        for _ in range(3):  # two for the free worker's window, one waiting beyond it
            engine.submit("image", _job().params)
        with pytest.raises(QueueFull):
            engine.submit("image", _job().params)
        engine._wakeup.cancel()
    asyncio.run(main())


def test_engine_queue_full_counts_waiting_jobs_only():
    async def main():
        engine = _engine(max_queue=1, max_batch=4)
        engine._loop = asyncio.get_running_loop()
        engine.submit("image", _job().params)  # runs
        engine.submit("image", _job().params)  # waits
        with pytest.raises(QueueFull) as info:
            engine.submit("image", _job().params)
        assert info.value.retry_after >= 1
    asyncio.run(main())


def test_engine_exports_prompt_encoder_stats():
    engine = _engine()
    engine._on_event(("stats", {"prompt_encoder": {"batches": 3, "submissions": 7, "prompts": 9}}))
    text = engine.metrics.render().decode()
    assert 'omni_prompt_encoder{count="batches",replica="0"} 3.0' in text
    assert 'omni_prompt_encoder{count="prompts",replica="0"} 9.0' in text


def test_prompt_stage_stats_reads_the_encoder_batcher():
    from omni_diffusion.accelerate import _STATE_ATTR
    from omni_diffusion.ar.batching import BatchStats
    from omni_serve.worker import prompt_stage_stats

    pipe = types.SimpleNamespace()
    assert prompt_stage_stats(pipe) is None  # not accelerated
    stats = BatchStats(batches=2, submissions=5, items=6)
    encoder = types.SimpleNamespace(stats=stats)
    pipe.__dict__[_STATE_ATTR] = types.SimpleNamespace(prompt_stage=types.SimpleNamespace(encoder=encoder))
    assert prompt_stage_stats(pipe) == {"batches": 2, "submissions": 5, "prompts": 6}
    pipe.__dict__[_STATE_ATTR].prompt_stage.encoder = None  # an enhancer alone
    assert prompt_stage_stats(pipe) is None


# --------------------------------------------------------------------------- worker


@pytest.fixture(scope="module")
def tiny_flux():
    from omni_diffusion.testing import tiny_pipeline

    pipe = tiny_pipeline("flux")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _counting(pipe, fail_on: str | None = None):
    """``pipe`` with a __call__ that counts calls (and raises when a prompt holds ``fail_on``)."""
    base = type(pipe)
    calls = []

    @functools.wraps(base.__call__)
    def call(self, *args, **kwargs):
        calls.append(list(kwargs["prompt"]))
        if fail_on is not None and any(fail_on in p for p in kwargs["prompt"]):
            raise RuntimeError(f"cannot draw {fail_on}")
        return base.__call__(self, *args, **kwargs)

    counted = type(f"Counting{base.__name__}", (base,), {"__call__": call})
    pipe.__class__ = counted
    return calls, lambda: setattr(pipe, "__class__", base)


def _run(pipe, batch):
    from omni_serve.worker import _BatchRunner

    events = queue.Queue()
    runner = _BatchRunner(pipe, "image", None, queue.Queue(), events)
    runner.run(batch)
    out = []
    while not events.empty():
        out.append(events.get())
    return out


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.float64)


def test_worker_runs_a_batch_as_one_call_and_results_go_to_their_jobs(tiny_flux):
    params = [_job(f"prompt {i}", seed=10 * (i + 1), n=1 + (i == 1)).params for i in range(3)]
    solo = {}
    for i, p in enumerate(params):
        events = _run(tiny_flux, [(f"solo{i}", "image", p)])
        solo[i] = [e for e in events if e[0] == "done"][0][2]["images"]
    calls, undo = _counting(tiny_flux)
    try:
        events = _run(tiny_flux, [(f"job{i}", "image", p) for i, p in enumerate(params)])
    finally:
        undo()
    assert len(calls) == 1 and len(calls[0]) == 4  # one call, 1 + 2 + 1 images
    assert [e for e in events if e[0] == "batch"] == [("batch", ["job0", "job1", "job2"])]
    steps = [e[2] for e in events if e[0] == "progress"]
    assert steps == [1, 2] and all(e[1] == ["job0", "job1", "job2"]
                                   for e in events if e[0] == "progress")
    done = {e[1]: e[2]["images"] for e in events if e[0] == "done"}
    assert [len(done[f"job{i}"]) for i in range(3)] == [1, 2, 1]
    for i in range(3):
        for k, png in enumerate(done[f"job{i}"]):
            own = np.abs(_pixels(png) - _pixels(solo[i][k])).max()
            assert own <= 2, (i, k, own)  # same image as alone (up to batched-GEMM rounding)
            others = [np.abs(_pixels(png) - _pixels(solo[j][0])).mean() for j in range(3) if j != i]
            assert min(others) > 5 * max(own, 0.5), (i, own, others)


def test_worker_encodes_each_job_in_its_own_output_format(tiny_flux):
    """One pipeline call, three jobs: each job's images come encoded once by the worker, in
    that job's output_format (the server sends them as they are)."""
    from PIL import Image

    batch = [("p", "image", _job("a", seed=1, n=2).params),
             ("j", "image", {**_job("b", seed=2).params, "output_format": "jpeg",
                             "output_compression": 50}),
             ("w", "image", {**_job("c", seed=3).params, "output_format": "webp"})]
    calls, undo = _counting(tiny_flux)
    try:
        events = _run(tiny_flux, batch)
    finally:
        undo()
    assert len(calls) == 1
    done = {e[1]: e[2]["images"] for e in events if e[0] == "done"}
    formats = {k: [Image.open(io.BytesIO(b)).format for b in v] for k, v in done.items()}
    assert formats == {"p": ["PNG", "PNG"], "j": ["JPEG"], "w": ["WEBP"]}


def test_a_bad_job_in_a_batch_fails_alone(tiny_flux):
    calls, undo = _counting(tiny_flux, fail_on="boom")
    try:
        events = _run(tiny_flux, [("ok1", "image", _job("fine", seed=1).params),
                                  ("bad", "image", _job("boom", seed=2).params),
                                  ("ok2", "image", _job("also fine", seed=3).params),
                                  ("vid", "video", _job("wrong kind").params)])
    finally:
        undo()
    assert len(calls) == 4  # the batch of three, then each alone
    final = {e[1]: e[0] for e in events if e[0] in ("done", "error", "cancelled")}
    assert final == {"ok1": "done", "bad": "error", "ok2": "done", "vid": "error"}
    bad = [e for e in events if e[0] == "error" and e[1] == "bad"][0]
    assert bad[2] == "server_error" and "cannot draw boom" in bad[3]
    assert [e[1] for e in events if e[0] == "batch"] == [["ok1", "bad", "ok2"], ["ok1"], ["bad"],
                                                         ["ok2"]]


class _CancelAt(queue.Queue):
    """A control queue that hands the worker ``job_id`` at its ``at``-th look."""

    def __init__(self, job_id: str, at: int) -> None:
        super().__init__()
        self.job_id, self.at, self.looks = job_id, at, 0

    def get_nowait(self):
        self.looks += 1
        if self.looks == self.at:
            return self.job_id
        raise queue.Empty


@pytest.mark.parametrize("cancel", ["one", "all"])
def test_cancel_inside_a_batch(tiny_flux, cancel):
    """Cancelling one job of a running batch leaves the others running (and answered);
    cancelling every job stops the call at the next step."""
    from omni_serve.worker import _BatchRunner

    events = queue.Queue()
    batch = [("a", "image", _job("a", seed=1, num_inference_steps=4).params),
             ("b", "image", _job("b", seed=2, num_inference_steps=4).params)]
    control = _CancelAt("a", at=2)  # the first look is before the call, the second after step 1
    runner = _BatchRunner(tiny_flux, "image", None, control, events)
    if cancel == "all":
        runner.cancelled.add("b")
    runner.run(batch)
    got = []
    while not events.empty():
        got.append(events.get())
    final = {e[1]: e[0] for e in got if e[0] in ("done", "cancelled", "error")}
    steps = [e[2] for e in got if e[0] == "progress"]
    if cancel == "one":
        assert final == {"a": "cancelled", "b": "done"} and steps == [1, 2, 3, 4]
        assert [e[1] for e in got if e[0] == "progress"][1:] == [["b"]] * 3
    else:
        assert final == {"a": "cancelled", "b": "cancelled"} and steps == [1]
