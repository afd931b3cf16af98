"""The device sum tree against float64 numpy references, on fresh random data."""
import math

import numpy as np
import pytest

from drvtrain import DeviceBuffer, capture
from drvtrain.rl import ReplayError, SumTree
from per_reference import (importance_weights, philox_uniforms, prefix_search, stratified_masses,
                           tree_inconsistency)

pytestmark = pytest.mark.gpu


def sample_with(tree, stream, uniforms, beta=0.4):
    b = len(uniforms)
    idx, w = DeviceBuffer(b, np.int32), DeviceBuffer(b, np.float32)
    idx.poison(stream)
    w.poison(stream)
    tree.sample(b, stream, beta=beta, indices=idx, weights=w,
                uniforms=DeviceBuffer.from_numpy(np.asarray(uniforms, np.float64)))
    return idx.to_numpy(), w.to_numpy()


def padded_leaves(tree):
    return tree.leaves.to_numpy()


def inconsistency(tree):
    return tree_inconsistency(tree.nodes_numpy(), padded_leaves(tree), tree.levels)


def assert_consistent(tree, node_rel=1e-12):
    """Every internal node equals the sum of its children; the root equals the exact leaf sum."""
    leaves = padded_leaves(tree)
    assert inconsistency(tree) <= node_rel
    exact = math.fsum(leaves.astype(np.float64))
    assert math.isclose(tree.read_total(), exact, rel_tol=1e-12, abs_tol=1e-300)


@pytest.mark.parametrize("leaves, cases", [
    ([0, 0, 1, 3], {0.0: 2, 0.5: 2, 0.99: 2, 1.01: 3, 3.0: 3, 4.0: 3}),
    ([0.5, 1, 1, 3], {0.0: 0, 0.55: 1, 0.99: 1, 1.51: 2, 3.0: 3, 5.5: 3}),
])
def test_exact_prefix_sum_cases(device, stream, leaves, cases):
    tree = SumTree(4, alpha=1.0, seed=1)
    tree.set_priorities(np.array(leaves, np.float32))
    total = tree.read_total()
    assert total == sum(leaves)
    for mass, want in cases.items():
        idx, w = sample_with(tree, stream, [mass / total])  # batch of one: mass = u * total
        assert idx[0] == want, f"mass {mass}: got leaf {idx[0]}, want {want}"
        assert w[0] == 1.0


def test_injected_uniforms_match_searchsorted(device, stream, rng):
    c = int(rng.integers(2000, 6000))
    pri = rng.uniform(0.1, 1.1, c).astype(np.float32)
    pri[rng.random(c) < 0.2] = 0.0
    tree = SumTree(c, alpha=0.6, seed=int(rng.integers(2**63)))
    tree.set_priorities(pri)
    leaves = tree.leaves_numpy()
    u = rng.random(4096)
    total = tree.read_total()
    masses = stratified_masses(u, total)
    got, w = sample_with(tree, stream, u, beta=0.4)
    want = prefix_search(leaves, masses)
    cs = np.cumsum(leaves.astype(np.float64))
    near = np.min(np.abs(masses[:, None] - cs[None, :]), axis=1) < 1e-5
    assert np.array_equal(got[~near], want[~near]), f"{np.sum(got[~near] != want[~near])} mismatches"
    assert near.mean() < 0.05
    assert np.all(leaves[got] > 0)
    ref_w = importance_weights(leaves[got], total, stored=c, beta=0.4)
    assert not np.isnan(w).any()
    np.testing.assert_allclose(w, ref_w, rtol=2e-6)


def test_philox_draws_are_reproducible_and_fresh_per_replay(device, stream, rng):
    c, b = 500, 256
    pri = rng.uniform(0.1, 1.1, c).astype(np.float32)
    seed = int(rng.integers(2**63))
    trees = [SumTree(c, alpha=0.6, seed=seed) for _ in range(2)]
    idx = [DeviceBuffer(b, np.int32) for _ in range(3)]
    w = DeviceBuffer(b, np.float32)
    for t in trees:
        t.set_priorities(pri)
    trees[0].sample(b, stream, beta=0.4, indices=idx[0], weights=w)
    trees[1].sample(b, stream, beta=0.4, indices=idx[1], weights=w)
    trees[1].sample(b, stream, beta=0.4, indices=idx[2], weights=w)
    first, same, second = (i.to_numpy() for i in idx)
    assert np.array_equal(first, same)
    assert not np.array_equal(first, second)
    assert int(trees[1].step.to_numpy()[0]) == 2
    leaves = trees[0].leaves_numpy()
    total = trees[0].read_total()
    for step, got in ((0, first), (1, second)):
        masses = stratified_masses(philox_uniforms(seed, step, b), total)
        assert np.array_equal(got, prefix_search(leaves, masses))


def test_chi_square_and_strata_over_a_million_draws(device, stream, rng):
    c, b, launches = 64, 1000, 1000
    pri = rng.uniform(0.1, 1.1, c).astype(np.float32)
    pri[rng.choice(c, 8, replace=False)] = 0.0
    tree = SumTree(c, alpha=0.6, seed=int(rng.integers(2**63)), max_batch=b)
    tree.set_priorities(pri)
    all_idx = DeviceBuffer((launches, b), np.int32)
    all_idx.poison(stream)
    w = DeviceBuffer(b, np.float32)
    for i in range(launches):
        tree.sample(b, stream, beta=0.4, indices=all_idx.view(np.int32, (b,), i * b * 4), weights=w)
    idx = all_idx.to_numpy()
    leaves = tree.leaves_numpy().astype(np.float64)
    assert idx.min() >= 0 and np.all(leaves[idx] > 0), "a zero-priority leaf was sampled"
    counts = np.bincount(idx.ravel(), minlength=c)
    expected = leaves / leaves.sum() * idx.size
    live = expected > 0
    stat = float(np.sum((counts[live] - expected[live]) ** 2 / expected[live]))
    df = int(live.sum()) - 1
    assert stat < df + 5 * math.sqrt(2 * df), f"chi-square {stat:.1f} with {df} degrees of freedom"
    # Stratification: sample j lands in a leaf whose range meets [j, j+1) * total / B.
    assert np.all(np.diff(idx, axis=1) >= 0), "indices must not decrease within a stratified batch"
    hi = np.cumsum(leaves)
    lo = hi - leaves
    j = np.arange(b)
    total = tree.read_total()
    assert np.all(lo[idx] <= (j + 1) * total / b * (1 + 1e-12))
    assert np.all(hi[idx] >= j * total / b * (1 - 1e-12))


@pytest.mark.parametrize("pattern", ["all_equal", "half_repeats"])
def test_duplicate_indices_keep_tree_consistent(device, stream, rng, pattern):
    c, b = 1000, 512
    tree = SumTree(c, alpha=0.6, seed=3)
    tree.set_priorities(rng.uniform(0.1, 1.1, c).astype(np.float32))
    if pattern == "all_equal":
        idx = np.full(b, rng.integers(c), np.int32)
    else:
        base = rng.integers(0, c, b // 2)
        idx = np.concatenate([base, rng.choice(base, b - b // 2)]).astype(np.int32)
    pri = rng.uniform(0.1, 5.0, b).astype(np.float32)
    tree.update(DeviceBuffer.from_numpy(idx), DeviceBuffer.from_numpy(pri), stream)
    leaves = tree.leaves_numpy()
    written = (pri.astype(np.float32) ** np.float32(0.6))
    for i in np.unique(idx):
        candidates = written[idx == i]
        assert np.any(np.isclose(leaves[i], candidates, rtol=1e-6, atol=0)), f"leaf {i} is none of its writes"
    assert_consistent(tree)
    tree.check_errors()


def test_drift_after_a_million_updates(device, stream, rng):
    c, per_launch, launches = 1 << 20, 1000, 1000
    tree = SumTree(c, alpha=0.6, seed=5)
    tree.set_priorities(rng.uniform(0.1, 1.1, c).astype(np.float32))
    idx = DeviceBuffer.from_numpy(rng.integers(0, c, per_launch * launches).astype(np.int32))
    pri = DeviceBuffer.from_numpy(rng.uniform(0.0, 2.0, per_launch * launches).astype(np.float32))
    for i in range(launches):
        off = i * per_launch * 4
        tree.update(idx.view(np.int32, (per_launch,), off), pri.view(np.float32, (per_launch,), off), stream)
    leaves = padded_leaves(tree)
    exact = math.fsum(leaves.astype(np.float64))
    root_drift = abs(tree.read_total() - exact) / exact
    node_drift = inconsistency(tree)
    print(f"after 1e6 updates at C=2^20: root drift {root_drift:.3e}, worst node drift {node_drift:.3e}")
    assert root_drift < 1e-6
    assert node_drift < 1e-9
    tree.rebuild(stream)
    assert inconsistency(tree) < 1e-13
    assert math.isclose(tree.read_total(), exact, rel_tol=1e-13)


@pytest.mark.parametrize("capacity", [1, 3, 1000, 1 << 17])
def test_capacities_sample_only_live_leaves(device, stream, rng, capacity):
    pri = rng.uniform(0.1, 1.1, capacity).astype(np.float32)
    if capacity > 1:
        dead = rng.random(capacity) < 0.9
        dead[[0, -1]] = True
        dead[rng.integers(1, capacity - 1) if capacity > 2 else 0] = False
        pri[dead] = 0.0
        if not (pri > 0).any():
            pri[capacity // 2] = 1.0
    tree = SumTree(capacity, alpha=0.6, seed=int(rng.integers(2**63)))
    tree.set_priorities(pri)
    assert_consistent(tree)
    b = 1024
    edges = np.concatenate([np.zeros(4), np.full(4, np.nextafter(1.0, 0.0)), rng.random(b - 8)])
    got, w = sample_with(tree, stream, edges)
    live = tree.leaves_numpy() > 0
    assert got.min() >= 0 and got.max() < capacity and np.all(live[got])
    assert np.all((w > 0) & (w <= 1))
    idx = rng.integers(0, capacity, 64).astype(np.int32)
    tree.update(idx, rng.uniform(0, 2, 64).astype(np.float32), stream)
    assert_consistent(tree)


def test_max_priority_tracks_largest_write(device, stream, rng):
    tree = SumTree(100, alpha=0.5, seed=1, initial_priority=1.0)
    assert tree.max_priority().to_numpy()[0] == 1.0
    pri = rng.uniform(0.1, 9.0, 50).astype(np.float32)
    tree.update(np.arange(50), pri, stream)
    assert tree.max_priority().to_numpy()[0] == pytest.approx(float(pri.max()) ** 0.5, rel=1e-6)


def test_device_side_bad_input_sets_flags_not_crashes(device, stream, rng):
    tree = SumTree(10, alpha=1.0, seed=1)
    tree.set_priorities(rng.uniform(0.1, 1, 10).astype(np.float32))
    before = tree.leaves_numpy()
    tree.update(DeviceBuffer.from_numpy(np.array([3, 10, -1], np.int32)),
                DeviceBuffer.from_numpy(np.array([2.0, 1.0, 1.0], np.float32)), stream)
    stream.synchronize()
    with pytest.raises(ReplayError, match="index out of range"):
        tree.check_errors()
    tree.check_errors()  # cleared
    after = tree.leaves_numpy()
    assert after[3] == 2.0 and np.array_equal(np.delete(after, 3), np.delete(before, 3))
    tree.update(DeviceBuffer.from_numpy(np.array([4], np.int32)),
                DeviceBuffer.from_numpy(np.array([np.nan], np.float32)), stream)
    stream.synchronize()
    with pytest.raises(ReplayError, match="NaN"):
        tree.check_errors()
    empty = SumTree(8, seed=1)
    sample_with(empty, stream, [0.5])
    with pytest.raises(ReplayError, match="empty tree"):
        empty.check_errors()


@pytest.mark.parametrize("indices, priorities, error", [
    (np.array([0, 10]), np.array([1.0, 1.0]), IndexError),
    (np.array([-1]), np.array([1.0]), IndexError),
    (np.array([0, 1]), np.array([1.0, np.nan]), ValueError),
    (np.array([0, 1]), np.array([1.0, -0.5]), ValueError),
    (np.array([0, 1]), np.array([1.0, np.inf]), ValueError),
    (np.array([0, 1]), np.array([1.0]), ValueError),
    (np.array([0.0, 1.0]), np.array([1.0, 1.0]), TypeError),
])
def test_host_bad_input_is_refused_and_changes_nothing(device, stream, rng, indices, priorities, error):
    tree = SumTree(10, alpha=0.6, seed=1)
    tree.set_priorities(rng.uniform(0.1, 1, 10).astype(np.float32))
    leaves, nodes = tree.leaves_numpy(), tree.nodes_numpy()
    with pytest.raises(error):
        tree.update(indices, priorities, stream)
    assert np.array_equal(tree.leaves_numpy(), leaves) and np.array_equal(tree.nodes_numpy(), nodes)


def test_update_sample_rebuild_capture_into_one_graph(device, stream, rng):
    c, b = 4096, 256
    tree = SumTree(c, alpha=0.6, seed=11)
    tree.set_priorities(rng.uniform(0.1, 1.1, c).astype(np.float32))
    idx, w = DeviceBuffer(b, np.int32), DeviceBuffer(b, np.float32)
    new_p = DeviceBuffer.from_numpy(rng.uniform(0.1, 2.0, b).astype(np.float32))
    with capture(stream) as graph:
        tree.sample(b, stream, beta=0.4, indices=idx, weights=w)
        tree.update(idx, new_p, stream)
        tree.rebuild(stream)
    assert graph.node_counts() == {"kernel": 3}
    assert all(k.grid[0] > 1 for k in graph.kernel_nodes()), "a single-block kernel on the PER path"
    exe = graph.instantiate()
    for _ in range(50):
        exe.launch(stream)
    assert int(tree.step.to_numpy()[0]) == 50
    assert_consistent(tree, node_rel=1e-13)
    tree.check_errors()
