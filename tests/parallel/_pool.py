"""A pool of gloo worker processes that stays up across tests.

Starting a process and importing torch + diffusers takes seconds; each test
would pay it per rank. :class:`DistPool` starts ``world`` processes once (a
``torch.distributed`` gloo group over TCP on localhost), and
:meth:`DistPool.run` has every rank call ``fn(rank, world, *args)`` (``fn`` a
module-level function of ``tests/parallel/_workers.py``, named by string) and
returns the per-rank results, re-raising the first rank's exception.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import traceback

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
#: a rank left waiting in a collective this long raises (gloo's timeout): a hang fails fast
COLLECTIVE_TIMEOUT_S = 60
#: how long a task may run before the pool gives up on a rank that never answers. Separate
#: from the collective timeout: under TRITON_INTERPRET=1 a legitimate task can outlast it
#: (HunyuanVideo with the fused QK-norm + RoPE kernel interpreted took ~93 s at 32x32 on a
#: 2-core CI machine; its test now calls it at 16x16, ~25 s).
TASK_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    sys.path.insert(0, HERE)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    workers = importlib.import_module("_workers")
    while True:
        task = tasks.get()
        if task is None:
            break
        name, args = task
        try:
            results.put((rank, True, getattr(workers, name)(rank, world, *args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        finally:
            _destroy_subgroups(dist)
    dist.destroy_process_group()


def _destroy_subgroups(dist) -> None:
    """Destroys the process groups a task created (every parallelize builds its device meshes
    anew). Each gloo group keeps polling threads: the ~120 groups tests/parallel left in each
    worker kept the idle pools at ~0.9 of a core of a 2-core machine for the rest of the session."""
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


class DistPool:
    def __init__(self, world: int) -> None:
        self.world = world
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, name: str, *args):
        for q in self.tasks:
            q.put((name, args))
        out: dict[int, object] = {}
        errors = []
        try:
            for _ in range(self.world):
                # once a rank failed, the others may wait in a collective forever: give them
                # a few seconds, then shut the pool down and report the failure
                timeout = 10 if errors else TASK_TIMEOUT_S
                rank, ok, value = self.results.get(timeout=timeout)
                (out.__setitem__(rank, value) if ok else errors.append((rank, value)))
        except queue.Empty:
            self.close()
            if not errors:
                raise TimeoutError(f"{name}: ranks {sorted(set(range(self.world)) - set(out))} did "
                                   "not answer (a hung collective?); the pool was shut down") from None
        if errors:
            rank, message = sorted(errors)[0]
            raise AssertionError(f"{name} failed on rank {rank}:\n{message}")
        return [out[r] for r in range(self.world)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.terminate()
