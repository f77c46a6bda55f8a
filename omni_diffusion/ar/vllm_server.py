"""Placement ``"server"``: an OpenAI-compatible vLLM server reached over HTTP.

:class:`VLLMServerClient` talks to a running server: ``POST /pooling`` with
token ids and ``task="token_embed"`` for prompt encoding (a server started
with ``--runner pooling --pooler-config '{"task": "token_embed"}'`` on a folder
written by :func:`omni_diffusion.ar.export.export_for_vllm`; vLLM loads omni's
plugin for its architecture when omni is installed beside it), and
``POST /v1/chat/completions`` for prompt rewriting.

:func:`launch_server` starts such a server as a child process, with any Python
that has vLLM (another virtual environment, say: vLLM's torch pin need not
match the diffusion side's) and stops it on :meth:`LaunchedServer.close`.
Only the standard library is used for HTTP.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_diffusion.ar.fit import check_fits, explain_startup_failure


class VLLMServerError(RuntimeError):
    """The vLLM server answered with an error or could not be reached."""


def _request(url: str, payload: Mapping[str, Any] | None, timeout_s: float) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method="GET" if payload is None else "POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise VLLMServerError(f"{url}: HTTP {exc.code}: {exc.read()[:2000].decode(errors='replace')}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise VLLMServerError(f"{url}: {exc}") from exc


class VLLMServerClient:
    """A client of one model on an OpenAI-compatible vLLM server.

    Args:
        url: the server's base URL (``http://host:port``).
        model: the served model name (None: the server's only model).
        timeout_s: per-request timeout.
    """

    def __init__(self, url: str, model: str | None = None, timeout_s: float = 600.0) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url: {url!r} is not allowed; allowed: an http(s):// base URL")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        if model is None:
            served = [m["id"] for m in _request(f"{self.url}/v1/models", None, timeout_s)["data"]]
            if len(served) != 1:
                raise ValueError(f"model: None is not allowed for a server serving {served}; "
                                 "name one of them")
            model = served[0]
        self.model = model

    def embed(self, token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per-token hidden states (float32): one ``[len(ids), D]`` tensor per id list."""
        token_ids = [list(ids) for ids in token_ids]
        reply = _request(f"{self.url}/pooling", dict(
            model=self.model, input=token_ids, task="token_embed", use_activation=False,
            encoding_format="base64", embed_dtype="float32", endianness="little",
        ), self.timeout_s)
        out: list[torch.Tensor | None] = [None] * len(token_ids)
        for item in reply["data"]:
            flat = np.frombuffer(base64.b64decode(item["data"]), dtype="<f4")
            out[item["index"]] = torch.from_numpy(flat.reshape(len(token_ids[item["index"]]), -1).copy())
        if any(t is None for t in out):
            raise VLLMServerError(f"{self.url}/pooling returned {len(reply['data'])} results for "
                                  f"{len(token_ids)} inputs")
        return out  # type: ignore[return-value]

    def chat(self, conversations: Sequence[Sequence[Mapping[str, str]]], *, max_tokens: int,
             temperature: float, seed: int) -> list[str]:
        """The assistant's reply to each conversation; the requests go out
        concurrently so the server batches them."""
        def one(messages):
            reply = _request(f"{self.url}/v1/chat/completions", dict(
                model=self.model, messages=list(messages), max_tokens=max_tokens,
                temperature=temperature, seed=seed,
            ), self.timeout_s)
            return reply["choices"][0]["message"]["content"] or ""

        with ThreadPoolExecutor(max_workers=min(32, max(1, len(conversations)))) as pool:
            return list(pool.map(one, conversations))

    def close(self) -> None:
        """Nothing to release (the server is not this client's)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedServer:
    """A vLLM OpenAI-compatible server in a child process; :attr:`url` once ready."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def launch_server(model: str | Path, *, runner: str, python: str | None = None,
                  gpu_memory_utilization: float = 0.3, dtype: str = "auto", port: int | None = None,
                  served_model_name: str | None = None, extra_args: Sequence[str] = (),
                  env: Mapping[str, str] | None = None, startup_timeout_s: float = 600.0,
                  log_path: str | Path | None = None) -> LaunchedServer:
    """Start ``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``) on 127.0.0.1.

    Args:
        model: the model folder or name.
        runner: ``"pooling"`` (prompt encoding, task ``token_embed``) or ``"generate"``.
        python: the interpreter that has vLLM (default: this one).
        gpu_memory_utilization: vLLM's share of the GPU memory.
        dtype: vLLM's ``--dtype``.
        port: the port (default: a free one).
        served_model_name: the name clients use (default: vLLM's, the model path).
        extra_args: further ``vllm serve`` flags.
        env: extra environment variables for the server.
        startup_timeout_s: how long to wait for ``/health``.
        log_path: where the server's output goes (default: a temporary file).

    Raises:
        ValueError: the model does not fit in the GPU share, or the server
            exited while starting with an out-of-memory message.
        RuntimeError: the server exited or did not become ready in time (the
            message carries the end of its log).
    """
    if runner not in ("pooling", "generate"):
        raise ValueError(f"runner: {runner!r} is not allowed; allowed: 'pooling', 'generate'")
    check_fits(model, gpu_memory_utilization)
    python = python or sys.executable
    port = port or free_port()
    args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--runner", runner, "--dtype", dtype,
            "--gpu-memory-utilization", str(gpu_memory_utilization)]
    if runner == "pooling":
        args += ["--pooler-config", json.dumps({"task": "token_embed"})]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    args += list(extra_args)
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix="omni-vllm-", suffix=".log")
        os.close(handle)
        log_path = name
    log_path = Path(log_path)
    full_env = dict(os.environ)
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                   stdin=subprocess.DEVNULL)
    server = LaunchedServer(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        if process.poll() is not None:
            tail = server.log_tail()
            raise explain_startup_failure(RuntimeError(
                f"vLLM server exited with code {process.returncode} while starting; log "
                f"{log_path}:\n{tail}"), model, gpu_memory_utilization)
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            server.close()
            raise RuntimeError(f"vLLM server did not become ready in {startup_timeout_s:.0f}s; "
                               f"log {log_path}:\n{server.log_tail()}")
        time.sleep(0.5)


__all__ = ["LaunchedServer", "VLLMServerClient", "VLLMServerError", "free_port", "launch_server"]
