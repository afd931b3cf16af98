"""The numpy references for prioritized replay, checked on the CPU."""
import math

import numpy as np
import pytest

from drvtrain.rl.sumtree import tree_levels

from per_reference import (fixed_order_nodes, fixed_order_sum32, importance_weights, philox4x32_10,
                           philox_uniforms, poison_ancestors, prefix_search, stratified_masses,
                           tree_inconsistency)


@pytest.mark.parametrize("counter, key, expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_matches_known_answers(counter, key, expected):
    got = philox4x32_10(np.array([counter], np.uint32), key)[0]
    assert tuple(int(v) for v in got) == expected


def test_uniforms_are_in_unit_interval_and_depend_on_seed_and_step():
    a = philox_uniforms(1234, 0, 10_000)
    assert a.min() >= 0.0 and a.max() < 1.0
    assert abs(a.mean() - 0.5) < 0.02
    assert not np.array_equal(a, philox_uniforms(1234, 1, 10_000))
    assert not np.array_equal(a, philox_uniforms(1235, 0, 10_000))
    assert np.array_equal(a, philox_uniforms(1234, 0, 10_000))


@pytest.mark.parametrize("leaves, cases", [
    ([0, 0, 1, 3], {0.0: 2, 0.5: 2, 0.99: 2, 1.01: 3, 3.0: 3, 4.0: 3}),
    ([0.5, 1, 1, 3], {0.0: 0, 0.55: 1, 0.99: 1, 1.51: 2, 3.0: 3, 5.5: 3}),
])
def test_prefix_search_exact_cases(leaves, cases):
    masses = np.array(list(cases))
    assert prefix_search(np.array(leaves, float), masses).tolist() == list(cases.values())


def test_stratified_masses_fall_in_their_strata(rng):
    u = rng.random(512)
    total = float(rng.uniform(1, 100))
    m = stratified_masses(u, total)
    j = np.arange(512)
    assert np.all(m >= j * total / 512) and np.all(m < (j + 1) * total / 512 * (1 + 1e-15))


def test_importance_weights_hand_computed_case():
    # P = p / 7; N * P = 10/7, 20/7, 40/7; (N P)^-1/2 scaled by its largest: 1, 2^-1/2, 1/2.
    w = importance_weights(np.array([1.0, 2.0, 4.0]), total=7.0, stored=10, beta=0.5)
    np.testing.assert_allclose(w, [1.0, 2 ** -0.5, 0.5], rtol=1e-15, atol=0)


def test_importance_weights_follow_the_definition(rng):
    p = rng.uniform(0.01, 3.0, 256)
    total = float(p.sum() * rng.uniform(1.5, 20.0))
    stored, beta = int(rng.integers(300, 10_000)), float(rng.uniform(0.1, 1.0))
    w = importance_weights(p, total, stored, beta)
    assert not np.isnan(w).any()
    assert w.max() == 1.0 and np.argmax(w) == np.argmin(p)
    # The batch scaling leaves ratios alone: w_i / w_k = (p_k / p_i)^beta.
    i, k = rng.choice(256, 2, replace=False)
    assert math.isclose(w[i] / w[k], (p[k] / p[i]) ** beta, rel_tol=1e-12)
    # beta 0 weighs every sample alike; beta 1 undoes the sampling bias exactly.
    assert np.array_equal(importance_weights(p, total, stored, 0.0), np.ones(256))
    w1 = importance_weights(p, total, stored, 1.0)
    np.testing.assert_allclose(w1 * p, p.min(), rtol=1e-12)


@pytest.mark.parametrize("bad", [0.0, np.nan])
def test_importance_weights_refuse_a_zero_leaf(rng, bad):
    p = rng.uniform(0.1, 1.0, 8)
    p[int(rng.integers(8))] = bad
    with pytest.raises(ValueError, match="no importance weight"):
        importance_weights(p, float(p[p > 0].sum()), 8, 0.4)


def build_tree(leaves: np.ndarray, levels) -> np.ndarray:
    """Exact internal nodes for ``leaves`` in the device layout (a reference builder)."""
    nodes = np.zeros(sum(size for _, _, size in levels))
    children = leaves.astype(np.float64)
    for offset, real, _ in reversed(levels):
        padded = np.zeros(real * 32)
        padded[: len(children[: real * 32])] = children[: real * 32]
        nodes[offset: offset + real] = [math.fsum(row) for row in padded.reshape(real, 32)]
        children = nodes[offset: offset + real]
    return nodes


@pytest.mark.parametrize("capacity, expected", [
    (1, [(0, 1, 32)]),
    (32, [(0, 1, 32)]),
    (33, [(0, 1, 32), (32, 2, 32)]),
    (1 << 17, [(0, 1, 32), (32, 4, 32), (64, 128, 128), (192, 4096, 4096)]),
    (1 << 20, [(0, 1, 32), (32, 32, 32), (64, 1024, 1024), (1088, 32768, 32768)]),
])
def test_tree_layout_levels(capacity, expected):
    assert tree_levels(capacity) == expected


def test_tree_inconsistency_sees_a_wrong_node(rng):
    capacity = 5000
    levels = tree_levels(capacity)
    leaves = np.zeros((capacity + 31) // 32 * 32, np.float32)
    leaves[:capacity] = rng.random(capacity)
    nodes = build_tree(leaves, levels)
    assert tree_inconsistency(nodes, leaves, levels) < 1e-15
    assert math.isclose(nodes[0], math.fsum(leaves.astype(np.float64)), rel_tol=1e-15)
    wrong = nodes.copy()
    wrong[levels[1][0]] *= 1.001
    assert tree_inconsistency(wrong, leaves, levels) > 1e-4
    padded = nodes.copy()
    padded[levels[1][0] + levels[1][1]] = 1.0  # a padding node must stay 0
    assert tree_inconsistency(padded, leaves, levels) == float("inf")


def butterfly_lanes(values: np.ndarray) -> np.ndarray:
    """The 32 lanes of dt_warp_sum emulated literally: v += shfl_xor(v, d), d = 16 .. 1."""
    v = np.array(values, np.float64)
    lanes = np.arange(32)
    for d in (16, 8, 4, 2, 1):
        v = v + v[lanes ^ d]
    return v


def test_fixed_order_sum_is_the_butterfly_in_every_lane(rng):
    """The reference's pairwise order is the warp's: every lane of the literal butterfly
    ends with its bits; a sequential sum, in another order, differs somewhere."""
    rows = rng.standard_normal((2000, 32)) * np.exp2(rng.integers(-40, 40, (2000, 32)))
    want = fixed_order_sum32(rows)
    differs = 0
    for row, w in zip(rows, want):
        lanes = butterfly_lanes(row)
        assert lanes.tobytes() == np.full(32, w).tobytes()
        s = 0.0
        for x in row:
            s += x
        differs += s != w
    assert differs > 100, "the rows are too tame to tell one order from another"


@pytest.mark.parametrize("capacity", [1, 33, 5000, 1 << 17])
def test_fixed_order_nodes_follow_the_layout(rng, capacity):
    levels = tree_levels(capacity)
    internal = sum(size for _, _, size in levels)
    leaves = np.zeros((capacity + 31) // 32 * 32, np.float32)
    leaves[:capacity] = rng.uniform(0.1, 1.1, capacity)
    nodes = fixed_order_nodes(leaves, levels, internal)
    assert tree_inconsistency(nodes, leaves, levels) < 1e-15  # sums of their children, padding 0
    assert math.isclose(nodes[0], math.fsum(leaves.astype(np.float64)), rel_tol=1e-14)
    offset1, real1, _ = levels[-1]
    group = int(rng.integers(real1))
    assert nodes[offset1 + group] == fixed_order_sum32(leaves[32 * group: 32 * group + 32].astype(np.float64))[0]


def test_poison_marks_exactly_the_ancestors(rng):
    """Poisoned nodes are the ancestors of the given leaves on every level, the root
    included, and nothing else; the array it was given is not changed."""
    capacity = 5000
    levels = tree_levels(capacity)
    internal = sum(size for _, _, size in levels)
    nodes = rng.uniform(1.0, 2.0, internal)
    leaves = rng.choice(capacity, 7, replace=False)
    poisoned = poison_ancestors(nodes, levels, leaves)
    assert not np.isnan(nodes).any()
    want = set()
    for h, (offset, _, _) in enumerate(reversed(levels), start=1):
        want |= {offset + int(i) // 32 ** h for i in leaves}
    assert set(np.flatnonzero(np.isnan(poisoned)).tolist()) == want and 0 in want
