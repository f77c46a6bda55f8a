"""Ulysses, Ring and USP attention on gloo ranks against full attention (float64 reference).

Tolerance: fp32 inputs, max abs difference <= 2e-5 against the float64
reference (outputs are O(1); the merge adds a few ulp).
"""

from __future__ import annotations

import pytest

TOL = 2e-5

CASES = [
    # world, ulysses, ring, batch, text, image, heads, dim, text_first
    (2, 2, 1, 1, 5, 32, 4, 16, True),     # Ulysses, even
    (2, 2, 1, 2, 3, 31, 3, 8, False),     # Ulysses, odd heads and tokens, text last
    (2, 1, 2, 1, 5, 29, 2, 16, True),     # Ring, odd tokens
    (4, 1, 4, 1, 0, 13, 2, 8, True),      # Ring of 4, image only, uneven shards
    (4, 2, 2, 1, 7, 37, 5, 8, True),      # USP 2x2, odd heads and tokens
    (4, 4, 1, 2, 4, 30, 6, 8, False),     # Ulysses of 4, 6 heads (uneven), text last
    (4, 2, 1, 1, 3, 3, 2, 8, True),       # cfg x Ulysses mesh; 3 tokens over 2: one shard of 1
    (2, 2, 1, 1, 2, 1, 2, 8, True),       # fewer tokens than ranks: an empty shard
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "w{}-u{}-r{}-b{}-t{}-s{}-h{}-d{}-{}".format(
    *c[:8], "txtfirst" if c[8] else "txtlast"))
def test_sequence_parallel_attention_matches_full(pools, case):
    world, *args = case
    errors = pools(world).run("attention_case", *args, 1234)
    assert max(errors) <= TOL, errors
