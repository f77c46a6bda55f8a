"""accelerate(AccelConfig(parallel=...)) composed with omni attention, quantization and
compile, on 2 gloo ranks, against the same AccelConfig without parallelism.

Tolerance: fp32, 1e-4 absolute on latents of max |x| ~ 5 (as test_pipelines);
with int8 quantization the shards quantize with their own scales, so 5e-2.
"""

from __future__ import annotations

import pytest

CASES = [
    ("flux", {"ulysses": 2}, {"attention": "sdpa_math"}, 1e-4),
    ("wan", {"cfg": 2}, {"attention": "sdpa_math", "compile": True, "compile_backend": "eager"}, 1e-4),
    ("sd3", {"ring": 2}, {"attention": "sdpa_math", "compile": True, "compile_backend": "eager"}, 1e-4),
    ("flux", {"tp": 2}, {"attention": "sdpa_math", "quant": "int8_weight_only",
                         "quant_min_features": 0}, 5e-2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'-'.join(c[1])}-{'-'.join(c[2])}")
def test_accelerate_with_parallel(pools, case):
    family, parallel, accel, tol = case
    results = pools(2).run("accelerate_case", family, parallel, accel)
    for diff, scale in results:
        assert scale > 0.1 and diff <= tol, results
