"""Which queued requests run together, and on which devices each replica runs.

Batching happens at admission, not mid-loop: a diffusers pipeline builds its latents,
prompt embeddings and timesteps once before the denoising loop, so a request cannot
join a loop that is already running. Instead, when a worker is free, the engine takes
the oldest queued request and every queued request *compatible* with it (same
:func:`batch_key`), up to ``max_batch`` images, and the worker runs them as one pipeline
call with a list of prompts and one seeded generator per image. Requests that arrive
while a batch runs wait for the next one (continuous batching at call granularity).

Data-parallel replicas: :func:`plan_replicas` splits the visible GPUs into groups of
``gpus_per_replica``; each group gets its own worker process (its ``CUDA_VISIBLE_DEVICES``
is the group). On the CPU there is one worker unless ``replicas`` asks for more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

#: request fields that must be equal for requests to share one pipeline call: they set
#: the latent shape, the schedule, the guidance, or whether a negative branch runs
_SHAPE_FIELDS = ("width", "height", "num_inference_steps", "guidance_scale", "num_frames")


def batch_key(kind: str, params: dict[str, Any]) -> tuple:
    """Requests with equal keys can run as one pipeline call. The prompt, the negative
    prompt's text, the seed and ``n`` may differ; everything that shapes the call may not."""
    return (kind, *(params.get(f) for f in _SHAPE_FIELDS), params.get("negative_prompt") is not None)


def rows_of(params: dict[str, Any]) -> int:
    """Images (or videos) a request adds to a batch: its ``n``."""
    return int(params.get("n") or 1)


def select_batch(queued: Sequence[Any], max_batch: int) -> list[Any]:
    """The next batch from ``queued`` (oldest first; items have ``.kind`` and ``.params``).

    The oldest request always runs (alone when its ``n`` exceeds ``max_batch``); compatible
    younger requests join it, in order, while the images stay within ``max_batch``.
    Incompatible requests keep their place for a later batch.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch: {max_batch!r} is not allowed; allowed: an integer >= 1")
    if not queued:
        return []
    first = queued[0]
    key = batch_key(first.kind, first.params)
    batch, rows = [first], rows_of(first.params)
    for job in queued[1:]:
        if rows >= max_batch:
            break
        if batch_key(job.kind, job.params) == key and rows + rows_of(job.params) <= max_batch:
            batch.append(job)
            rows += rows_of(job.params)
    return batch


def plan_replicas(device: str, *, num_devices: int, replicas: int | None = None,
                  gpus_per_replica: int = 1) -> list[tuple[int, ...] | None]:
    """The device group of each worker: a tuple of GPU indexes (into the visible devices),
    or None for a CPU worker.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"`` pins one group to GPU N).
        num_devices: GPUs visible to the server (``torch.cuda.device_count()``).
        replicas: workers to start; None: one on the CPU, as many groups as fit on GPUs.
        gpus_per_replica: GPUs in each group (a worker spreads its pipeline's components
            over them, see :func:`omni_serve.worker.load_pipeline`).
    """
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)
                                 or replicas < 1):
        raise ValueError(f"replicas: {replicas!r} is not allowed; allowed: an integer >= 1")
    if isinstance(gpus_per_replica, bool) or not isinstance(gpus_per_replica, int) \
            or gpus_per_replica < 1:
        raise ValueError(f"gpus_per_replica: {gpus_per_replica!r} is not allowed; "
                         "allowed: an integer >= 1")
    if device == "cpu":
        if gpus_per_replica != 1:
            raise ValueError(f"gpus_per_replica: {gpus_per_replica} is not allowed on the CPU; "
                             "allowed: 1")
        return [None] * (replicas or 1)
    if device.startswith("cuda:"):
        index = device.split(":", 1)[1]
        if not index.isdigit() or int(index) >= num_devices:
            raise ValueError(f"device: {device!r} is not allowed; allowed: cuda or cuda:N with "
                             f"N < {num_devices} (the visible GPUs)")
        if (replicas or 1) != 1 or gpus_per_replica != 1:
            raise ValueError(f"device: {device!r} pins one GPU, so replicas and "
                             "gpus_per_replica must be 1; use device 'cuda' to spread replicas")
        return [(int(index),)]
    if device != "cuda":
        raise ValueError(f"device: {device!r} is not allowed; allowed: cpu, cuda, cuda:N")
    fit = num_devices // gpus_per_replica
    if fit < 1:
        raise ValueError(f"gpus_per_replica: {gpus_per_replica} is not allowed with "
                         f"{num_devices} visible GPU(s); allowed: 1..{max(1, num_devices)}")
    count = fit if replicas is None else replicas
    if count > fit:
        raise ValueError(f"replicas: {replicas} is not allowed: {num_devices} GPU(s) hold at most "
                         f"{fit} group(s) of {gpus_per_replica}")
    return [tuple(range(r * gpus_per_replica, (r + 1) * gpus_per_replica)) for r in range(count)]


def visible_devices(group: Iterable[int], parent_visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker whose group indexes the server's visible GPUs
    (``parent_visible``, the server's own ``CUDA_VISIBLE_DEVICES``, or None for all)."""
    group = list(group)
    if parent_visible is None or not parent_visible.strip():
        return ",".join(map(str, group))
    names = [n.strip() for n in parent_visible.split(",") if n.strip()]
    if max(group) >= len(names):
        raise ValueError(f"GPU group {group} is not allowed: CUDA_VISIBLE_DEVICES={parent_visible!r} "
                         f"shows {len(names)} GPU(s)")
    return ",".join(names[i] for i in group)
