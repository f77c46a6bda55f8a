"""The model worker: a separate process that loads the pipeline and runs batches of jobs.

The server process never imports torch for generation; it talks to the worker
through three multiprocessing queues (see :mod:`omni_serve.engine`):

* ``jobs`` (server -> worker): ``("run", [(job_id, kind, params), ...])`` (one batch of
  compatible jobs, :mod:`omni_serve.batching`) or ``("stop",)``;
* ``control`` (server -> worker): job ids to cancel, drained between steps;
* ``events`` (worker -> server): ``("ready", info)``, ``("batch", [job_id, ...])`` (a
  pipeline call starts), ``("progress", [job_id, ...], step, total, step_seconds)``,
  ``("done", job_id, result)``, ``("error", job_id, type, message)``,
  ``("cancelled", job_id)``, ``("stats", {"prompt_encoder": {...}})``, ``("idle",)``
  (the batch is over), ``("fatal", message)``.

A job that fails (bad input reaching the model, out of memory) reports an
error and the worker keeps serving; when it shared a pipeline call, the others are
retried one at a time, so only the bad job fails.
"""

from __future__ import annotations

import inspect
import queue
import time
import traceback
from typing import Any


class _Cancelled(Exception):
    pass


def load_pipeline(model: str | None, dtype_name: str, device: str, kind: str | None = None):
    import torch

    dtype = getattr(torch, dtype_name)
    if model is None:
        try:
            from omni_diffusion.embedded import load_embedded_pipeline
        except ImportError as exc:
            raise RuntimeError(
                "no MODEL given and the embedded default models are not installed "
                f"(omni_diffusion.embedded: {exc}); pass a diffusers folder or hub id"
            ) from exc
        return load_embedded_pipeline(kind or "image", dtype, device)
    from diffusers import DiffusionPipeline

    try:  # diffusers that know ``dtype=`` deprecate ``torch_dtype=``
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401

        kwargs: dict[str, Any] = dict(dtype=dtype)
    except ImportError:
        kwargs = dict(torch_dtype=dtype)
    if device == "cuda" and torch.cuda.device_count() > 1:
        # a GPU group of several devices (--gpus-per-replica): diffusers spreads the
        # pipeline's components (text encoders, transformer, VAE) over them
        return DiffusionPipeline.from_pretrained(model, device_map="balanced", **kwargs)
    pipe = DiffusionPipeline.from_pretrained(model, **kwargs)
    return pipe.to(device)


def _model_kind(pipe) -> str:
    name = type(pipe).__name__.lower()
    return "video" if ("video" in name or "wan" in name) else "image"


def _call_kwargs(pipe, kind: str, batch: list[tuple[str, dict[str, Any]]], callback,
                 defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pipeline's call arguments for a batch of compatible jobs (``[(job_id, params)]``,
    equal :func:`omni_serve.batching.batch_key`); ``defaults`` (the embedded model's
    ``CALL_KWARGS``) fill what the request leaves unset, e.g. its trained number of frames.

    Each job adds ``n`` rows (its prompt repeated), and row ``i`` of a job gets its own CPU
    generator seeded ``seed + i``: diffusers draws each row's initial noise from its own
    generator, so an image does not depend on what else shares its batch.
    """
    import torch

    from omni_serve.batching import rows_of

    accepted = inspect.signature(type(pipe).__call__).parameters
    first = batch[0][1]
    prompts, negatives, generators = [], [], []
    for _, params in batch:
        for i in range(rows_of(params)):
            prompts.append(params["prompt"])
            negatives.append(params.get("negative_prompt"))
            generators.append(torch.Generator("cpu").manual_seed((params["seed"] + i) % 2**32))
    kwargs: dict[str, Any] = dict(
        prompt=prompts,
        height=first["height"],
        width=first["width"],
        generator=generators,
        output_type="pil",
        callback_on_step_end=callback,
        num_images_per_prompt=1,
        num_videos_per_prompt=1,
    )
    for key in ("num_inference_steps", "guidance_scale", "num_frames"):
        if first.get(key) is not None:
            kwargs[key] = first[key]
        elif defaults and key in defaults:
            kwargs[key] = defaults[key]
    if first.get("negative_prompt") is not None:  # equal keys: all rows have one
        kwargs["negative_prompt"] = negatives
        if "true_cfg_scale" in accepted:
            kwargs["true_cfg_scale"] = 2.0  # guidance-distilled models need true CFG for negatives
    elif defaults and "negative_prompt" in defaults:
        kwargs["negative_prompt"] = [defaults["negative_prompt"]] * len(prompts)
    tokenizer = getattr(pipe, "tokenizer_2", None) or getattr(pipe, "tokenizer", None)
    max_len = getattr(tokenizer, "model_max_length", None)
    if "max_sequence_length" in accepted and isinstance(max_len, int) and max_len < 512:
        kwargs["max_sequence_length"] = max_len
    return {k: v for k, v in kwargs.items() if k in accepted}


def _outputs(out, kind: str,
             batch: list[tuple[str, dict[str, Any]]]) -> list[dict[str, list[bytes]]]:
    """One entry per row of a pipeline output: ``{"images": [bytes]}``, each image encoded
    once, here, in its request's ``output_format`` (png when absent), or ``{"frames": [png...]}``."""
    from omni_serve.batching import rows_of
    from omni_serve.media import encode_image

    if kind == "image":
        formats = [(params.get("output_format", "png"), params.get("output_compression"))
                   for _, params in batch for _ in range(rows_of(params))]
        return [{"images": [encode_image(im, *fmt)]} for im, fmt in zip(out.images, formats)]
    return [{"frames": [encode_image(_to_pil(f)) for f in video]} for video in out.frames]


def prompt_stage_stats(pipe) -> dict[str, int] | None:
    """The prompt encoder's batch counts when ``accelerate()`` gave ``pipe`` an LLM prompt
    stage with an encoder (``--prompt-encoder``), else None."""
    from omni_diffusion.accelerate import prompt_stage_of

    stage = prompt_stage_of(pipe)
    encoder = getattr(stage, "encoder", None)
    if encoder is None:
        return None
    stats = encoder.stats
    return {"batches": stats.batches, "submissions": stats.submissions, "prompts": stats.items}


class _BatchRunner:
    """Runs the worker's batches: one pipeline call per batch, per-job progress, cancellation
    between steps, and a failed batch retried one job at a time so a bad job fails alone."""

    def __init__(self, pipe, kind: str, defaults, control, events) -> None:
        self.pipe, self.kind, self.defaults = pipe, kind, defaults
        self.control, self.events = control, events
        self.cancelled: set[str] = set()

    def drain_control(self) -> None:
        while True:
            try:
                self.cancelled.add(self.control.get_nowait())
            except queue.Empty:
                return

    def run(self, batch: list[tuple[str, str, dict[str, Any]]]) -> None:
        """``batch``: ``[(job_id, kind, params)]`` with equal batch keys."""
        self.drain_control()
        todo = []
        for job_id, job_kind, params in batch:
            if job_id in self.cancelled:
                self.events.put(("cancelled", job_id))
            elif job_kind != self.kind:
                self.events.put(("error", job_id, "invalid_request_error",
                                 f"ValueError: this server's model makes {self.kind}s, "
                                 f"not {job_kind}s"))
            else:
                todo.append((job_id, params))
        if todo:
            self._call(todo, retry_alone=len(todo) > 1)
        for job_id, _, _ in batch:
            self.cancelled.discard(job_id)

    def _call(self, batch: list[tuple[str, dict[str, Any]]], retry_alone: bool) -> None:
        import torch

        import omni_diffusion as od
        from omni_serve.batching import rows_of

        ids = [job_id for job_id, _ in batch]
        self.events.put(("batch", ids))
        last = [time.perf_counter()]

        def progress(step, total, _latents):
            now = time.perf_counter()
            live = [i for i in ids if i not in self.cancelled]
            self.events.put(("progress", live, int(step), total, now - last[0]))
            last[0] = now
            self.drain_control()
            if all(i in self.cancelled for i in ids):
                raise _Cancelled()  # nobody wants this call any more: free the worker

        try:
            kwargs = _call_kwargs(self.pipe, self.kind, batch, od.step_callback(progress),
                                  self.defaults)
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.pipe(**kwargs)
            seconds = time.perf_counter() - start  # the pipeline call alone (Server-Timing)
            rows = _outputs(out, self.kind, batch)
        except _Cancelled:
            for job_id in ids:
                self.events.put(("cancelled", job_id))
            return
        except Exception as exc:  # noqa: BLE001 - the job fails alone
            traceback.print_exc()
            if retry_alone:
                # which job broke the call is unknown: run each alone, so only it fails
                for job in batch:
                    if job[0] in self.cancelled:
                        self.events.put(("cancelled", job[0]))
                    else:
                        self._call([job], retry_alone=False)
                return
            etype = "invalid_request_error" if isinstance(exc, (ValueError, TypeError)) \
                else "server_error"
            self.events.put(("error", ids[0], etype, f"{type(exc).__name__}: {exc}"))
            return
        at = 0
        for job_id, params in batch:
            mine = rows[at:at + rows_of(params)]
            at += rows_of(params)
            if job_id in self.cancelled:
                self.events.put(("cancelled", job_id))
            elif self.kind == "image":
                self.events.put(("done", job_id, {"images": [r["images"][0] for r in mine],
                                                  "engine_seconds": seconds}))
            else:
                self.events.put(("done", job_id, {**mine[0], "engine_seconds": seconds}))


def run_worker(model: str | None, accel: dict | None, device: str, dtype_name: str,
               jobs, control, events, kind: str | None = None,
               parent_pid: int | None = None, visible_devices: str | None = None) -> None:
    """Process entry point (spawned by :class:`omni_serve.engine.Engine`).

    ``visible_devices``: this worker's GPU group as ``CUDA_VISIBLE_DEVICES`` (set before
    torch initializes CUDA), or None to leave it alone (CPU workers).
    """
    import os

    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    _watch_parent(parent_pid)
    try:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads()))
        pipe = load_pipeline(model, dtype_name, device, kind)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        if accel is not None:
            import omni_diffusion as od

            od.accelerate(pipe, od.AccelConfig.from_dict(accel))
    except BaseException as exc:  # noqa: BLE001 - report, then exit
        events.put(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    kind = _model_kind(pipe)
    from omni_diffusion.embedded import native_call_kwargs

    defaults = native_call_kwargs(model, kind) or None
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if device.startswith("cuda") else []
    events.put(("ready", {"kind": kind, "pipeline": type(pipe).__name__,
                          "visible_devices": visible_devices, "gpus": gpus}))
    runner = _BatchRunner(pipe, kind, defaults, control, events)
    while True:
        message = jobs.get()
        if message[0] == "stop":
            return
        runner.run(message[1])
        stats = prompt_stage_stats(pipe)
        if stats is not None:
            events.put(("stats", {"prompt_encoder": stats}))
        events.put(("idle",))


def _watch_parent(parent: int | None) -> None:
    """Ignore Ctrl-C (the server drains, then stops us) and exit when the server process dies."""
    import os
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is None:
        parent = os.getppid()
    if os.getppid() != parent:  # the server died while this process started
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="omni-serve-parent-watch", daemon=True).start()


def _to_pil(frame):
    from PIL import Image
    import numpy as np

    if isinstance(frame, Image.Image):
        return frame
    arr = np.asarray(frame)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0, 1) * 255).round().astype(np.uint8)
    return Image.fromarray(arr)
