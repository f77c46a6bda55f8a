"""accelerate(AccelConfig(parallel=...)) composed with omni attention, quantization and
compile, on 2 gloo ranks, against the same AccelConfig without parallelism.

Tolerance: fp32, 1e-4 absolute on latents of max |x| ~ 5 (as test_pipelines);
with int8 quantization the shards quantize with their own scales, so 5e-2.
"""

from __future__ import annotations

import pytest

from omni_diffusion.testing import SMALL_CALL

TOL = 1e-4

CASES = [
    ("flux", {"ulysses": 2}, {"attention": "sdpa_math"}, TOL),
    ("wan", {"cfg": 2}, {"attention": "sdpa_math", "compile": True, "compile_backend": "eager"}, TOL),
    ("sd3", {"ring": 2}, {"attention": "sdpa_math", "compile": True, "compile_backend": "eager"}, TOL),
    ("flux", {"tp": 2}, {"attention": "sdpa_math", "quant": "int8_weight_only",
                         "quant_min_features": 0}, 5e-2),
    # the fused QK-norm + RoPE processors under each sequence split and tensor parallelism
    # (Wan's norm spans the heads: under tp its sharded norm keeps diffusers' path)
    ("flux", {"ulysses": 2}, {"attention": "sdpa_math", "fused_norm_rope": True}, TOL, SMALL_CALL),
    ("flux", {"ring": 2}, {"attention": "sdpa_math", "fused_norm_rope": True}, TOL, SMALL_CALL),
    ("wan", {"ulysses": 2}, {"attention": "sdpa_math", "fused_norm_rope": True}, TOL),
    ("wan", {"tp": 2}, {"attention": "sdpa_math", "fused_norm_rope": True}, TOL),
    ("hunyuan_video", {"ulysses": 2}, {"attention": "sdpa_math", "fused_norm_rope": True}, TOL, SMALL_CALL),
    ("qwen_image", {"ring": 2}, {"attention": "sdpa_math", "fused_norm_rope": True}, TOL),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'-'.join(c[1])}-{'-'.join(c[2])}")
def test_accelerate_with_parallel(pools, case):
    family, parallel, accel, tol, *call = case
    results = pools(2).run("accelerate_case", family, parallel, accel, *call)
    for diff, scale in results:
        assert scale > 0.1 and diff <= tol, results


#: the block lists are lengthened to this many blocks, so that a per-block recompile
#: needs more compilations of a code object than RECOMPILE_LIMIT allows
BLOCKS_PER_LIST = 4
#: what a block class needs: one graph, and one more for the inputs of a different
#: layout some of its blocks get (Flux's single-stream blocks pass views on; Ring's
#: graph-break pieces see the double- and single-stream attention)
RECOMPILE_LIMIT = 2
COMPILE_PARALLELS = [{"ulysses": 2}, {"ring": 2}, {"cfg": 2}]


def test_regional_compile_with_parallel(pools):
    """Regional compile (aot_eager: Dynamo and AOTAutograd trace what Inductor would
    compile) at degree 1 and with Ulysses, Ring and CFG parallelism on a tiny Flux of 4 +
    4 blocks, against the uncompiled single-process output. The bookkeeping of the
    sequence-parallel block forward wrappers stays out of the compiled region: without
    Ring's graph break the parallel run compiles as many graphs as degree 1, and no code
    object compiles more than RECOMPILE_LIMIT times (a hit fails the run)."""
    results = pools(2).run("compile_case", "flux", COMPILE_PARALLELS, "aot_eager", BLOCKS_PER_LIST,
                           RECOMPILE_LIMIT)
    for rank, runs in enumerate(results):
        for label, run in runs.items():
            assert run["scale"] > 0.1 and run["diff"] <= TOL, (rank, label, run)
            assert run["undone"], (rank, label, run)
        degree1 = runs["degree1"]
        # degree 1 compiles as before: each block's whole call (block.compile())
        assert degree1["call_compiled"] and not degree1["forward_compiled"], degree1
        for index, parallel in enumerate(COMPILE_PARALLELS):
            run = runs[index]
            if parallel.get("ulysses", 1) * parallel.get("ring", 1) > 1:
                # each block's forward is wrapped: the wrapped forward is compiled and the
                # wrapper's bookkeeping runs around it, with no module hook on any block
                assert run["forward_compiled"] and run["inner_compiled"], (parallel, run)
                assert not run["call_compiled"] and run["block_hooks"] == 0, (parallel, run)
                assert run["image_shares"] and all(mine < total for mine, total in run["image_shares"]), \
                    (parallel, run)
            else:
                assert run["call_compiled"] and not run["image_shares"], (parallel, run)
            if parallel.get("ring", 1) == 1:
                assert run["graphs"] == degree1["graphs"], (parallel, run, degree1)


@pytest.mark.parametrize("compile_undone_first", [True, False], ids=["compile-undone-first",
                                                                     "parallel-undone-first"])
def test_compile_inside_sequence_parallel_wrapper_undoes_in_either_order(pools, compile_undone_first):
    """Regional compile on blocks carrying the sequence-parallel forward wrapper compiles
    the forward the wrapper holds; both undos, in either order, leave each block's
    instance ``forward`` exactly as before (one block had one of its own)."""
    (run,) = pools(1).run("compile_undo_order_case", compile_undone_first)
    assert run["scale"] > 0.1 and run["diff"] <= TOL and run["after_undo"] == 0.0, run
    assert run["inner_compiled"], run
    assert all(run["restored"]) and run["block_hooks"] == 0, run
