"""The sequence-parallel code path at degree 1 runs the same ops as plain execution, and
little Python besides.

One gloo rank; a tiny pipeline's transformer forward is profiled on CPU
(torch.profiler) plainly and with ``parallelize(..., force_sequence_parallel=True)``:
block forward wrappers, image split and gather, the ``omni_sp`` attention backend and the
Ulysses/Ring steps all run, over 1-rank groups. Nothing is split, so nothing
may be copied, concatenated or exchanged that plain execution does not: the op
counts must be equal (collectives on a 1-rank group are no-ops, shards that
are the whole tensor are the tensor itself). This is what keeps the path's
measured overhead on the GPU (bench/parallel_overhead.py) near zero.

Where eager execution is bound by the CPU's kernel launches (Flux at 512x512 on an
H200) the path's Python time per block shows too, so the Python function calls it
adds per block are counted as well (not timed: counts do not depend on the load of
the machine).
"""

from __future__ import annotations

import pytest

#: ops that move data or talk to other ranks: any extra one is a real cost
COPYING = ("aten::copy_", "aten::cat", "aten::stack", "aten::clone", "aten::contiguous",
           "aten::empty", "aten::empty_like", "aten::new_empty", "aten::new_zeros")


def _is_collective(name: str) -> bool:
    return name.startswith(("c10d", "_c10d_functional", "gloo", "nccl", "PythonSubclass"))


@pytest.mark.parametrize("family", ["flux", "sd3", "wan", "qwen_image", "hunyuan_video"])
def test_sequence_parallel_path_at_degree_one_adds_no_ops(pools, family):
    (plain, sp, diff), = pools(1).run("op_count_case", family)
    assert diff == 0.0
    collectives = {name: n for name, n in sp.items() if _is_collective(name)}
    assert not collectives, f"collectives on a 1-rank group: {collectives}"
    extra = {name: (plain.get(name, 0), sp.get(name, 0)) for name in COPYING
             if sp.get(name, 0) != plain.get(name, 0)}
    assert not extra, f"copying ops (plain, sequence-parallel path): {extra}"
    diffs = {name: (plain.get(name, 0), sp.get(name, 0)) for name in set(plain) | set(sp)
             if name.startswith("aten::") and plain.get(name, 0) != sp.get(name, 0)}
    assert not diffs, f"op counts differ (plain, sequence-parallel path): {sorted(diffs.items())}"


#: Python calls the sequence-parallel path may add per block at degree 1: the block's
#: forward wrapper, its bookkeeping and one helper (the attention wrapper replaces the
#: plain backend's mask check, one call for one). As forward pre-hooks (before the
#: wrapper) the same bookkeeping cost 5 (3 of them torch's hook dispatch in
#: ``nn.Module.__call__``'s slow path); before its degree-1 fast paths, 8 to 12.5.
MAX_CALLS_PER_BLOCK = 3
#: per forward (the first block's split, the last block's gather)
MAX_CALLS_PER_FORWARD = 12


@pytest.mark.parametrize("family", ["flux", "sd3", "wan", "qwen_image", "hunyuan_video"])
def test_sequence_parallel_path_at_degree_one_adds_little_python_per_block(pools, family):
    (rows,) = pools(1).run("python_call_case", family, (2, 6))
    (blocks, plain, sp, diff, hooks), (more_blocks, more_plain, more_sp, more_diff, more_hooks) = rows
    assert diff == 0.0 and more_diff == 0.0
    # a block hook would send every block call through nn.Module.__call__'s slow path
    assert hooks == 0 and more_hooks == 0, f"{family}: forward hooks on the blocks: {hooks}, {more_hooks}"
    # the slope over depth: per-block calls, apart from what runs once per forward
    per_block = ((more_sp - more_plain) - (sp - plain)) / (more_blocks - blocks)
    plain_per_block = (more_plain - plain) / (more_blocks - blocks)
    per_forward = (sp - plain) - per_block * blocks
    assert per_block <= MAX_CALLS_PER_BLOCK, (
        f"{family}: the degree-1 sequence-parallel path adds {per_block:g} Python calls per block "
        f"(a plain block makes {plain_per_block:g})")
    assert per_forward <= MAX_CALLS_PER_FORWARD, (
        f"{family}: the degree-1 sequence-parallel path adds {per_forward:g} Python calls per forward")
