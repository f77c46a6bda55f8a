"""The sequence-parallel code path at degree 1 runs the same ops as plain execution.

One gloo rank; a tiny pipeline's transformer forward is profiled on CPU
(torch.profiler) plainly and with ``parallelize(..., force_sequence_parallel=True)``:
block hooks, image split and gather, the ``omni_sp`` attention backend and the
Ulysses/Ring steps all run, over 1-rank groups. Nothing is split, so nothing
may be copied, concatenated or exchanged that plain execution does not: the op
counts must be equal (collectives on a 1-rank group are no-ops, shards that
are the whole tensor are the tensor itself). This is what keeps the path's
measured overhead on the GPU (bench/parallel_overhead.py) near zero.
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
