"""Fixtures for omni-serve: a tiny Flux pipeline on disk and a real server on loopback.

The server is ``python -m omni_serve.cli`` in a subprocess on 127.0.0.1 and an
ephemeral port, in its own session, under ``timeout`` (a bounded lifetime even
if the tests are killed), stopped at the end of the module.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Without the serving stack the whole directory is left out, with its reason in the
# report header: pytest.importorskip here would be an error, not a skip, when tests/serve
# is named on the command line (pytest loads that conftest before collecting).
try:
    import fastapi  # noqa: F401
    import httpx
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as exc:
    httpx = None
    SERVE_STACK_MISSING = f"tests/serve left out: the serving stack does not import ({exc})"
    collect_ignore_glob = ["test_*.py"]
else:
    SERVE_STACK_MISSING = None


def pytest_report_header(config):
    return SERVE_STACK_MISSING

REPO = Path(__file__).resolve().parents[2]
SERVER_LIFETIME_S = 420


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory) -> str:
    from omni_diffusion.testing import tiny_pipeline

    path = tmp_path_factory.mktemp("tiny-flux") / "flux"
    tiny_pipeline("flux").save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def wan_dir(tmp_path_factory) -> str:
    from omni_diffusion.testing import tiny_pipeline

    path = tmp_path_factory.mktemp("tiny-wan") / "wan"
    tiny_pipeline("wan").save_pretrained(str(path))
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str | None, *args: str, log: Path) -> None:
        """``model`` None: a bare ``omni-serve``, on the embedded default models."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "omni_serve.cli", *([model] if model else []), "--host",
               "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *args]
        if shutil.which("timeout"):
            cmd = ["timeout", "-s", "KILL", str(SERVER_LIFETIME_S), *cmd]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TRITON_INTERPRET", None)
        env["OMP_NUM_THREADS"] = "1"  # tiny model on shared cores: no thread oversubscription
        self.log = log
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 180.0) -> dict:
        # Ready in ~10 s on an idle 2-core machine; a loaded one (a compile beside the tests)
        # once took over 60 s just to import torch. Not a speed check: only a bound on a hang.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omni-serve exited ({self.proc.returncode}):\n{self.output()}")
            try:
                r = httpx.get(self.url + "/health/ready", timeout=1.0)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"omni-serve not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of its session: server, worker, timeout
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self._log_file.close()


def _ready(srv: Server):
    """Fixture body: wait until ``srv`` is ready, yield it, stop it at teardown."""
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def wan_server(wan_dir, tmp_path_factory):
    srv = Server(wan_dir, "--default-size", "32x32", "--max-queue", "2", "--model-name", "tiny-wan",
                 "--attention", "none", log=tmp_path_factory.mktemp("serve-log") / "server.log")
    yield from _ready(srv)


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory):
    """``omni-serve`` with no model argument: the embedded image and video models."""
    srv = Server(None, "--max-queue", "2", "--attention", "none",
                 log=tmp_path_factory.mktemp("serve-log") / "server.log")
    yield from _ready(srv)


@pytest.fixture(scope="module")
def server(flux_dir, tmp_path_factory):
    srv = Server(flux_dir, "--default-size", "32x32", "--max-queue", "1", "--model-name", "tiny-flux",
                 "--attention", "none",
                 log=tmp_path_factory.mktemp("serve-log") / "server.log")
    yield from _ready(srv)


@pytest.fixture(scope="module")
def keyed_server(flux_dir, tmp_path_factory):
    """The tiny Flux behind ``--api-key test-key``, its url files living 4 s."""
    srv = Server(flux_dir, "--default-size", "32x32", "--model-name", "tiny-flux",
                 "--attention", "none", "--api-key", "test-key", "--file-ttl", "4",
                 log=tmp_path_factory.mktemp("serve-log") / "server.log")
    yield from _ready(srv)


def _parse_sse(text: str) -> list[tuple[str | None, object]]:
    """``[(event name or None, parsed data)]``; ``[DONE]`` stays a string."""
    import json

    events = []
    for block in text.strip().split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        payload = "\n".join(data)
        events.append((name, payload if payload == "[DONE]" else json.loads(payload)))
    return events


@pytest.fixture
def parse_sse():
    """Parse a server-sent-events body into ``[(event name or None, data)]``."""
    return _parse_sse
