"""The model worker: a separate process that loads the pipeline and runs jobs.

The server process never imports torch for generation; it talks to the worker
through three multiprocessing queues (see :mod:`omni_serve.engine`):

* ``jobs`` (server -> worker): ``("run", job_id, kind, params)`` or ``("stop",)``;
* ``control`` (server -> worker): job ids to cancel, drained between steps;
* ``events`` (worker -> server): ``("ready", info)``, ``("start", job_id)``,
  ``("progress", job_id, step, total, step_seconds)``, ``("done", job_id, result)``,
  ``("error", job_id, type, message)``, ``("cancelled", job_id)``, ``("fatal", message)``.

A job that fails (bad input reaching the model, out of memory) reports an
error and the worker keeps serving.
"""

from __future__ import annotations

import inspect
import io
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
    pipe = DiffusionPipeline.from_pretrained(model, **kwargs)
    return pipe.to(device)


def _model_kind(pipe) -> str:
    name = type(pipe).__name__.lower()
    return "video" if ("video" in name or "wan" in name) else "image"


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _call_kwargs(pipe, kind: str, params: dict[str, Any], callback) -> dict[str, Any]:
    import torch

    accepted = inspect.signature(type(pipe).__call__).parameters
    kwargs: dict[str, Any] = dict(
        prompt=params["prompt"],
        height=params["height"],
        width=params["width"],
        generator=torch.Generator("cpu").manual_seed(params["seed"]),
        output_type="pil",
        callback_on_step_end=callback,
    )
    if "num_images_per_prompt" in accepted:
        kwargs["num_images_per_prompt"] = params.get("n", 1)
    for key in ("negative_prompt", "num_inference_steps", "guidance_scale", "num_frames"):
        if params.get(key) is not None:
            kwargs[key] = params[key]
    if params.get("negative_prompt") and "true_cfg_scale" in accepted \
            and params.get("true_cfg_scale") is None:
        kwargs["true_cfg_scale"] = 2.0  # guidance-distilled models need true CFG for negatives
    tokenizer = getattr(pipe, "tokenizer_2", None) or getattr(pipe, "tokenizer", None)
    max_len = getattr(tokenizer, "model_max_length", None)
    if "max_sequence_length" in accepted and isinstance(max_len, int) and max_len < 512:
        kwargs["max_sequence_length"] = max_len
    return {k: v for k, v in kwargs.items() if k in accepted}


def run_worker(model: str | None, accel: dict | None, device: str, dtype_name: str,
               jobs, control, events, kind: str | None = None,
               parent_pid: int | None = None) -> None:
    """Process entry point (spawned by :class:`omni_serve.engine.Engine`)."""
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
    events.put(("ready", {"kind": kind, "pipeline": type(pipe).__name__}))
    cancelled: set[str] = set()

    def drain_control() -> None:
        while True:
            try:
                cancelled.add(control.get_nowait())
            except queue.Empty:
                return

    import omni_diffusion as od

    while True:
        message = jobs.get()
        if message[0] == "stop":
            return
        _, job_id, job_kind, params = message
        drain_control()
        if job_id in cancelled:
            cancelled.discard(job_id)
            events.put(("cancelled", job_id))
            continue
        events.put(("start", job_id))
        last = [time.perf_counter()]

        def progress(step, total, _latents, job_id=job_id):
            now = time.perf_counter()
            events.put(("progress", job_id, int(step), total, now - last[0]))
            last[0] = now
            drain_control()
            if job_id in cancelled:
                raise _Cancelled()

        try:
            if job_kind != kind:
                raise ValueError(f"this server's model makes {kind}s, not {job_kind}s")
            kwargs = _call_kwargs(pipe, kind, params, od.step_callback(progress))
            with torch.inference_mode():
                out = pipe(**kwargs)
            if kind == "image":
                result = {"images": [_png(im) for im in out.images]}
            else:
                frames = out.frames[0]
                result = {"frames": [_png(_to_pil(f)) for f in frames]}
            events.put(("done", job_id, result))
        except _Cancelled:
            events.put(("cancelled", job_id))
        except Exception as exc:  # noqa: BLE001 - the job fails alone
            traceback.print_exc()
            etype = "invalid_request_error" if isinstance(exc, (ValueError, TypeError)) \
                else "server_error"
            events.put(("error", job_id, etype, f"{type(exc).__name__}: {exc}"))
        finally:
            cancelled.discard(job_id)


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
