"""Run a function on N CPU processes joined by a gloo group (forked: the model is not re-imported)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, queue, fn, args):
    try:
        # Two cores are shared by every rank: one intra-op thread each.
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        result = fn(rank, world, dist.group.WORLD, *args)
        queue.put((rank, True, result))
    except BaseException:  # reported to the parent, which fails the test with it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 240.0) -> list:
    """``[fn(rank, world, group, *args) for rank]``, each in its own process; re-raises failures."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, queue, fn, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, failures = {}, []
    try:
        for _ in range(world):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = payload
            else:
                failures.append(f"rank {rank}:\n{payload}")
                break  # the other ranks may now wait forever in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.1)
            if p.is_alive():
                p.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world)]
