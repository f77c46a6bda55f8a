"""omni-serve under concurrent clients, on loopback, with the embedded model on the CPU (or a GPU).

For each mode, batched (``--max-batch 8``) and one-at-a-time (``--max-batch 1``), it
starts ``omni-serve`` on 127.0.0.1 and a free port, warms it up, then:

* ``sequential``: one client, ``--sequential`` requests one after another: latency and the
  server's overhead per request beyond engine time (client latency minus the pipeline
  call the server reports in its ``Server-Timing`` header; the overhead holds HTTP,
  validation, queueing hand-off to the worker process, PNG encoding and the response);
* ``concurrent``: ``--clients`` clients each sending ``--requests`` small requests back to
  back (bounded by ``--time-limit``): throughput, p50/p99 latency, and a ledger: every
  request sent got exactly one answer, with its own id and its own seed's image, and
  the server counted each job exactly once (``omni_jobs_total``/``omni_batch_size_sum``).

Targets (from the issue): overhead <= 5 ms per request; batched throughput >= 1.5x
one-at-a-time at 8 concurrent small requests. Results go to ``--out-dir`` (default
``$OUT`` or bench/results/) as JSON and Markdown::

    .venv/bin/python bench/serve.py --out-dir bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness


GEN = "/v1/images/generations"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m omni_serve.cli`` on loopback, in its own session (killed whole at the end)."""

    def __init__(self, args: argparse.Namespace, max_batch: int, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "omni_serve.cli", *([args.model] if args.model else []),
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
               "--attention", args.attention, "--max-batch", str(max_batch),
               "--max-queue", str(4 * args.clients), "--device", args.device]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
        env.pop("TRITON_INTERPRET", None)
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, cwd=harness.REPO_ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"omni-serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"omni-serve not ready after {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self.log.close()


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _engine_ms(response) -> float:
    match = re.search(r"engine;dur=([0-9.]+)", response.headers.get("server-timing", ""))
    if match is None:
        raise RuntimeError("the server sent no Server-Timing engine duration")
    return float(match.group(1))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _post(client, body: dict):
    start = time.perf_counter()
    response = await client.post(GEN, json=body)
    return response, (time.perf_counter() - start) * 1000


async def run_mode(args: argparse.Namespace, max_batch: int, log: Path) -> dict:
    import httpx

    server = Server(args, max_batch, log)
    try:
        await asyncio.to_thread(server.wait_ready, args.startup_timeout)
        body = dict(num_inference_steps=args.steps, response_format="b64_json")
        async with httpx.AsyncClient(base_url=server.url, timeout=args.time_limit) as client:
            for i in range(2):  # warm-up: first-call allocations and caches
                (await client.post(GEN, json={**body, "prompt": "warm up", "seed": i})).raise_for_status()
            # sequential: overhead beyond the pipeline call
            overhead, seq_latency = [], []
            for i in range(args.sequential):
                response, ms = await _post(client, {**body, "prompt": f"a digit {i % 10}",
                                                    "seed": 10_000 + i})
                response.raise_for_status()
                seq_latency.append(ms)
                overhead.append(ms - _engine_ms(response))
            before = (await client.get("/metrics")).text
            # concurrent: closed-loop clients
            deadline = time.monotonic() + args.time_limit
            sent: list[tuple[int, int]] = []
            answers: list[tuple[int, int, int, str, str, float]] = []

            async def one_client(c: int) -> None:
                for r in range(args.requests):
                    if time.monotonic() > deadline:
                        return
                    seed = 1_000_000 * (c + 1) + r
                    sent.append((c, r))
                    response, ms = await _post(client, {**body, "prompt": f"a digit {(c + r) % 10}",
                                                        "seed": seed})
                    images = response.json().get("data", []) if response.status_code == 200 else []
                    answers.append((c, r, response.status_code,
                                    response.headers.get("x-request-id", ""),
                                    images[0]["b64_json"] if images else "", ms))

            start = time.perf_counter()
            await asyncio.gather(*(one_client(c) for c in range(args.clients)))
            wall = time.perf_counter() - start
            after = (await client.get("/metrics")).text
    finally:
        await asyncio.to_thread(server.stop)
    ok = [a for a in answers if a[2] == 200]
    completed = _metric(after, 'omni_jobs_total{kind="image",outcome="completed"}') - \
        _metric(before, 'omni_jobs_total{kind="image",outcome="completed"}')
    calls = _metric(after, "omni_batch_size_count") - _metric(before, "omni_batch_size_count")
    batched_requests = _metric(after, "omni_batch_size_sum") - _metric(before, "omni_batch_size_sum")
    ledger = dict(
        sent=len(sent),
        answered=len(answers),
        ok=len(ok),
        lost=len(set(sent) - {(a[0], a[1]) for a in answers}),
        duplicated=len(answers) - len({(a[0], a[1]) for a in answers}),
        distinct_request_ids=len({a[3] for a in ok}),
        distinct_images=len({a[4] for a in ok}),
        server_jobs_completed=completed,
        server_requests_in_calls=batched_requests,
        server_pipeline_calls=calls,
    )
    latencies = [a[5] for a in ok]
    return dict(
        max_batch=max_batch,
        sequential=dict(requests=len(seq_latency), latency_ms_p50=statistics.median(seq_latency),
                        overhead_ms_p50=statistics.median(overhead),
                        overhead_ms_mean=statistics.fmean(overhead),
                        overhead_ms_p99=_pct(overhead, 0.99)),
        concurrent=dict(clients=args.clients, wall_s=wall,
                        throughput_rps=len(ok) / wall if wall > 0 else 0.0,
                        latency_ms_p50=statistics.median(latencies) if latencies else None,
                        latency_ms_p99=_pct(latencies, 0.99) if latencies else None,
                        mean_batch=batched_requests / calls if calls else None,
                        ledger=ledger),
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a diffusers folder (default: the embedded model)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--sequential", type=int, default=20, help="one-client requests for overhead")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per request")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--attention", default="none")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the server's worker runs (the clients stay on loopback)")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per concurrent phase")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or str(harness.REPO_ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    for name in ("clients", "requests", "sequential", "steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} is not allowed; allowed: an integer >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = harness.base_environment(("diffusers", "fastapi", "uvicorn", "httpx", "av"))
    env["cpu_count"] = os.cpu_count()
    results = {}
    for label, max_batch in (("batched", 8), ("one_at_a_time", 1)):
        log = Path(tempfile.gettempdir()) / f"omni-bench-serve-{os.getpid()}-{label}.log"
        results[label] = asyncio.run(run_mode(args, max_batch, log))
        print(label, json.dumps(results[label]), flush=True)
    speedup = results["batched"]["concurrent"]["throughput_rps"] / \
        max(1e-9, results["one_at_a_time"]["concurrent"]["throughput_rps"])
    overhead = results["one_at_a_time"]["sequential"]["overhead_ms_p50"]
    ledgers = [results[k]["concurrent"]["ledger"] for k in results]
    intact = all(lg["lost"] == 0 and lg["duplicated"] == 0 and lg["ok"] == lg["sent"]
                 and lg["distinct_request_ids"] == lg["sent"] and lg["distinct_images"] == lg["sent"]
                 and lg["server_jobs_completed"] == lg["sent"] for lg in ledgers)
    summary = dict(batched_speedup=speedup, speedup_target=1.5, overhead_ms_p50=overhead,
                   overhead_target_ms=5.0, no_request_lost_or_duplicated=intact)
    where = "cpu" if args.device == "cpu" else re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    stem = out / f"serve_{where}_{time.strftime('%Y%m%d')}"
    stem.with_suffix(".json").write_text(json.dumps(dict(environment=env, args=vars(args),
                                                         summary=summary, results=results),
                                                    indent=2))
    lines = [
        f"# omni-serve on {'the CPU' if args.device == 'cpu' else env['device']}: embedded model "
        "over loopback",
        "",
        f"commit `{env['git_commit']}`, torch {env['torch']}, python {env['python']}, device "
        f"{args.device} ({env['device']}), {env['cpu_count']} CPU cores, server "
        f"OMP_NUM_THREADS={args.threads}, "
        f"{args.steps} denoising steps per 32x32 request.",
        "",
        f"Command: `{env['command']}`",
        "",
        "| mode | clients | throughput (req/s) | p50 latency (ms) | p99 latency (ms) | "
        "mean batch | overhead/request p50 (ms, sequential) | sent / ok / lost / dup |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, r in results.items():
        c, s, lg = r["concurrent"], r["sequential"], r["concurrent"]["ledger"]
        mean_batch = f"{c['mean_batch']:.2f}" if c["mean_batch"] else "-"
        lines.append(f"| {label} (max-batch {r['max_batch']}) | {c['clients']} | "
                     f"{c['throughput_rps']:.2f} | {c['latency_ms_p50']:.0f} | "
                     f"{c['latency_ms_p99']:.0f} | {mean_batch} | {s['overhead_ms_p50']:.2f} | "
                     f"{lg['sent']} / {lg['ok']} / {lg['lost']} / {lg['duplicated']} |")
    lines += [
        "",
        f"- batched vs one-at-a-time throughput: **{speedup:.2f}x** (target >= 1.5x)",
        f"- server overhead per request beyond the pipeline call (sequential, p50): "
        f"**{overhead:.2f} ms** (target <= 5 ms)",
        f"- every request answered once, with its own id and image, and counted once by the "
        f"server: **{intact}**",
        "",
        "The machine's cores are shared with other jobs, so throughputs move between runs; "
        "`-dirty` in the commit means tracked files outside this benchmark had uncommitted "
        "changes in the working tree.",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
