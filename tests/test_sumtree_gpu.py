"""The device sum tree against float64 numpy references, on fresh random data."""
import math

import numpy as np
import pytest

from drvtrain import DeviceBuffer, capture
from drvtrain.rl import ReplayError, SumTree
from per_reference import (fixed_order_nodes, importance_weights, philox_uniforms, poison_ancestors,
                           prefix_search, stratified_masses, tree_inconsistency)

pytestmark = pytest.mark.gpu


def sample_with(tree, stream, uniforms, beta=0.4):
    b = len(uniforms)
    idx, w = DeviceBuffer(b, np.int32), DeviceBuffer(b, np.float32)
    idx.poison(stream=stream)
    w.poison(stream=stream)
    tree.sample(b, stream=stream, beta=beta, indices=idx, weights=w,
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
def test_exact_prefix_sum_cases_and_their_weights(device, stream, rng, leaves, cases):
    tree = SumTree(4, alpha=1.0, seed=1)
    tree.set_priorities(np.array(leaves, np.float32))
    p = np.array(leaves, np.float64)
    total = tree.read_total()
    assert total == p.sum()
    b = 8
    for mass, want in cases.items():
        # Stratum j holds mass m when (j + u_j) * total / b == m; the other strata draw at random.
        j = min(int(mass * b / total), b - 1)
        u = rng.random(b)
        u[j] = mass * b / total - j
        got, w = sample_with(tree, stream, u, beta=0.4)
        assert got[j] == want, f"mass {mass}: got leaf {got[j]}, want {want}"
        assert np.array_equal(got, prefix_search(p, stratified_masses(u, total)))
        assert len(np.unique(p[got])) > 1, "a batch of one leaf value cannot test the weights"
        assert not np.isnan(w).any()
        np.testing.assert_allclose(w, importance_weights(p[got], total, stored=4, beta=0.4), rtol=2e-6)


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
    trees[0].sample(b, stream=stream, beta=0.4, indices=idx[0], weights=w)
    trees[1].sample(b, stream=stream, beta=0.4, indices=idx[1], weights=w)
    trees[1].sample(b, stream=stream, beta=0.4, indices=idx[2], weights=w)
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
    all_idx.poison(stream=stream)
    w = DeviceBuffer(b, np.float32)
    for i in range(launches):
        tree.sample(b, stream=stream, beta=0.4, indices=all_idx.view(np.int32, (b,), i * b * 4), weights=w)
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
    tree.update(DeviceBuffer.from_numpy(idx), DeviceBuffer.from_numpy(pri), stream=stream)
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
        tree.update(idx.view(np.int32, (per_launch,), off), pri.view(np.float32, (per_launch,), off),
                    stream=stream)
    leaves = padded_leaves(tree)
    exact = math.fsum(leaves.astype(np.float64))
    root_drift = abs(tree.read_total() - exact) / exact
    node_drift = inconsistency(tree)
    print(f"after 1e6 updates at C=2^20: root drift {root_drift:.3e}, worst node drift {node_drift:.3e}")
    assert root_drift < 1e-13
    assert node_drift < 1e-13
    nodes = tree.nodes_numpy()
    assert nodes.tobytes() == fixed_order_nodes(leaves, tree.levels, tree.internal).tobytes()
    tree.rebuild(stream=stream)
    assert tree.nodes_numpy().tobytes() == nodes.tobytes()


@pytest.mark.parametrize("capacity, n, span", [
    (1, 5, 1), (3, 7, 3), (33, 64, 33), (1000, 512, 200), (1 << 17, 256, 1 << 17), (1 << 17, 513, 2000),
    (1 << 17, 5000, 1 << 17), ((1 << 20) + 33, 512, 3000),
])
def test_updates_leave_every_node_the_fixed_order_sum_of_its_children(device, stream, rng, capacity, n, span):
    """Rounds of updates, duplicates among them with values of their own (indices drawn from
    `span` leaves): every node that holds a changed leaf below it is recomputed, in the
    fixed order (per_reference), so the whole array of nodes is a function of the leaves.
    Two blocks (n <= 512) and more; trees of one to five levels, the widest with a first
    level of 32769 nodes, recomputed once an index rather than once a node. Before each
    round, the ancestors of the leaves it writes are poisoned."""
    tree = SumTree(capacity, alpha=0.6, seed=int(rng.integers(2**63)))
    tree.set_priorities(rng.uniform(0.1, 1.1, capacity).astype(np.float32))
    first = int(rng.integers(0, capacity - span + 1))
    for _ in range(3):
        idx = (first + rng.integers(0, span, n)).astype(np.int32)
        pri = rng.uniform(0.05, 5.0, n).astype(np.float32)
        tree.nodes.copy_from_numpy(poison_ancestors(tree.nodes_numpy(), tree.levels, idx))
        tree.update(DeviceBuffer.from_numpy(idx), DeviceBuffer.from_numpy(pri), stream=stream)
        leaves = tree.leaves.to_numpy()
        want = fixed_order_nodes(leaves, tree.levels, tree.internal)
        assert tree.nodes_numpy().tobytes() == want.tobytes()
        written = pri.astype(np.float64) ** 0.6
        for i in np.unique(idx)[:50]:  # a duplicated leaf ends as one of the values written to it
            assert np.min(np.abs(written[idx == i] - leaves[i]) / written[idx == i]) < 1e-6
    assert math.isclose(tree.read_total(), math.fsum(leaves.astype(np.float64)), rel_tol=1e-13)
    tree.check_errors()


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
    tree.update(idx, rng.uniform(0, 2, 64).astype(np.float32), stream=stream)
    assert_consistent(tree)


def test_max_priority_tracks_largest_write(device, stream, rng):
    tree = SumTree(100, alpha=0.5, seed=1, initial_priority=1.0)
    assert tree.max_priority().to_numpy()[0] == 1.0
    pri = rng.uniform(0.1, 9.0, 50).astype(np.float32)
    tree.update(np.arange(50), pri, stream=stream)
    assert tree.max_priority().to_numpy()[0] == pytest.approx(float(pri.max()) ** 0.5, rel=1e-6)


def test_an_empty_host_update_changes_nothing_as_an_empty_device_update(device, stream, rng):
    tree = SumTree(64, alpha=0.6, seed=2)
    tree.update(np.arange(64), rng.uniform(0.1, 3.0, 64).astype(np.float32), stream=stream)
    leaves, nodes = tree.leaves_numpy(), tree.nodes_numpy()
    tree.update(np.zeros(0, np.int32), np.zeros(0, np.float32), stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(tree.leaves_numpy(), leaves)
    np.testing.assert_array_equal(tree.nodes_numpy(), nodes)


def test_device_side_bad_input_sets_flags_not_crashes(device, stream, rng):
    tree = SumTree(10, alpha=1.0, seed=1)
    tree.set_priorities(rng.uniform(0.1, 1, 10).astype(np.float32))
    before = tree.leaves_numpy()
    tree.update(DeviceBuffer.from_numpy(np.array([3, 10, -1], np.int32)),
                DeviceBuffer.from_numpy(np.array([2.0, 1.0, 1.0], np.float32)), stream=stream)
    stream.synchronize()
    with pytest.raises(ReplayError, match="index out of range"):
        tree.check_errors()
    tree.check_errors()  # reported once
    after = tree.leaves_numpy()
    assert after[3] == 2.0 and np.array_equal(np.delete(after, 3), np.delete(before, 3))
    tree.update(DeviceBuffer.from_numpy(np.array([4], np.int32)),
                DeviceBuffer.from_numpy(np.array([np.nan], np.float32)), stream=stream)
    stream.synchronize()
    with pytest.raises(ReplayError, match="NaN"):
        tree.check_errors()
    empty = SumTree(8, seed=1)
    got, w = sample_with(empty, stream, [0.5, 0.25])
    assert got.tolist() == [0, 0] and w.tolist() == [0.0, 0.0]
    with pytest.raises(ReplayError, match="empty tree"):
        empty.check_errors()


def test_error_flags_name_every_new_error_and_lose_none(device, stream, rng):
    c = 16
    tree = SumTree(c, alpha=1.0, seed=1)
    tree.set_priorities(rng.uniform(0.1, 1, c).astype(np.float32))
    one = DeviceBuffer.from_numpy(np.ones(1, np.float32))
    bad_index = DeviceBuffer.from_numpy(np.array([rng.integers(c, 10 * c)], np.int32))
    good_idx = DeviceBuffer.from_numpy(rng.choice(c, 8, replace=False).astype(np.int32))
    good_pri = DeviceBuffer.from_numpy(rng.uniform(0.1, 2.0, 8).astype(np.float32))
    idx, w = DeviceBuffer(8, np.int32), DeviceBuffer(8, np.float32)

    tree.update(bad_index, one, stream=stream)
    stream.synchronize()
    with pytest.raises(ReplayError, match="index out of range") as first:
        tree.check_errors()
    assert "NaN" not in str(first.value) and "empty" not in str(first.value)

    tree.update(good_idx, good_pri, stream=stream)  # a clean step
    tree.sample(8, stream=stream, beta=0.4, indices=idx, weights=w)
    stream.synchronize()
    tree.check_errors()

    tree.update(bad_index, one, stream=stream)  # the same error again is a new error
    stream.synchronize()
    with pytest.raises(ReplayError, match="index out of range"):
        tree.check_errors()

    # Two kinds in one launch: both are named.
    tree.update(DeviceBuffer.from_numpy(np.array([-1, int(rng.integers(c))], np.int32)),
                DeviceBuffer.from_numpy(np.array([1.0, -2.0], np.float32)), stream=stream)
    stream.synchronize()
    with pytest.raises(ReplayError) as both:
        tree.check_errors()
    assert "index out of range" in str(both.value) and "NaN" in str(both.value)
    tree.check_errors()


def test_sampler_never_returns_a_zero_leaf_despite_sums_that_disagree(device, stream, rng):
    """A tree whose level-1 sums hold residue where their leaves are all 0 (as a tree
    written by another program, or loaded from an older file, can): the walk follows the
    sums into dead groups, and must still return only live leaves."""
    groups = 1024
    c = 32 * groups
    b, batches = 1024, 32
    tree = SumTree(c, alpha=1.0, seed=int(rng.integers(2**63)), max_batch=b)
    # Half the groups hold residue of about 1e-10, of either sign, in their level-1 sums;
    # the sums above them add it up. Group 0 stays dead, so leaf 0 is 0.
    churn = rng.choice(np.arange(1, groups), groups // 2, replace=False)
    offset1, real1, _ = tree.levels[-1]
    level1 = np.zeros(real1)
    level1[churn] = rng.uniform(0.5e-10, 2e-10, churn.size) * rng.choice([-1.0, 1.0], churn.size)
    level1[churn[0]] = 3e-10  # at least one positive residue
    nodes = tree.nodes_numpy()
    children = level1
    for offset, real, _ in reversed(tree.levels):
        padded = np.zeros(real * 32)
        padded[: min(children.size, real * 32)] = children[: real * 32]
        nodes[offset: offset + real] = padded.reshape(real, 32).sum(axis=1) if offset != offset1 else level1
        children = nodes[offset: offset + real]
    tree.nodes.copy_from_numpy(nodes)
    assert not (tree.leaves_numpy() > 0).any()

    # Every leaf is 0 though the sums are not: the sampler says the tree is empty.
    got, w = sample_with(tree, stream, rng.random(b))
    assert np.all(got == 0) and np.all(w == 0.0)
    with pytest.raises(ReplayError, match="empty tree"):
        tree.check_errors()

    # Four live leaves in groups without residue: their ancestors are recomputed from
    # their children, which keep the residue of the dead groups beside them.
    quiet = np.setdiff1d(np.arange(1, groups), churn)
    live = rng.choice(quiet, 4, replace=False) * 32 + rng.integers(0, 32, 4)
    tree.update(live, rng.uniform(1e-6, 2e-6, 4).astype(np.float32), stream=stream)
    leaves = tree.leaves_numpy()
    assert np.array_equal(np.flatnonzero(leaves), np.sort(live))
    nodes = tree.nodes_numpy()
    total = nodes[0]
    dead = ~(leaves.reshape(groups, 32) > 0).any(axis=1)
    assert total <= 0 or np.any(nodes[offset1: offset1 + real1][dead] > total * 2.0**-40), \
        "no residue above the sampler's threshold: the case under test was not built"

    all_idx, all_w = DeviceBuffer((batches, b), np.int32), DeviceBuffer((batches, b), np.float32)
    all_idx.poison(stream=stream)
    all_w.poison(stream=stream)
    for i in range(batches):
        tree.sample(b, stream=stream, beta=0.4, indices=all_idx.view(np.int32, (b,), i * b * 4),
                    weights=all_w.view(np.float32, (b,), i * b * 4))
    got, w = all_idx.to_numpy(), all_w.to_numpy()
    edges = np.concatenate([np.zeros(4), np.full(4, np.nextafter(1.0, 0.0)), rng.random(b - 8)])
    got_edges, w_edges = sample_with(tree, stream, edges)
    got, w = np.vstack([got, got_edges]), np.vstack([w, w_edges])
    assert np.all(np.isin(got, live)), f"{np.sum(~np.isin(got, live))} samples are not live leaves"
    assert np.all(np.isfinite(w)) and np.all(w > 0)
    live_total = math.fsum(leaves.astype(np.float64))
    for row, weights in zip(got, w):
        ref = importance_weights(leaves[row].astype(np.float64), live_total, stored=c, beta=0.4)
        np.testing.assert_allclose(weights, ref, rtol=2e-6)
    tree.check_errors()


def test_beta_schedule_runs_on_the_device_across_graph_replays(device, stream, rng):
    c, b, launches, replays = 3000, 256, 3, 5
    tree = SumTree(c, alpha=0.6, seed=int(rng.integers(2**63)), max_batch=b)
    tree.set_priorities(rng.uniform(0.1, 1.1, c).astype(np.float32))
    start, end = float(rng.uniform(0.1, 0.5)), float(rng.uniform(0.6, 1.0))
    steps = int(rng.integers(2 * launches, launches * (replays - 1)))  # saturates before the last replay
    idx = [DeviceBuffer(b, np.int32) for _ in range(launches)]
    w = [DeviceBuffer(b, np.float32) for _ in range(launches)]
    used = [DeviceBuffer(1, np.float32) for _ in range(launches)]
    with capture(stream) as graph:
        for k in range(launches):
            for buf in (idx[k], w[k], used[k]):
                buf.poison(stream=stream)
            tree.sample(b, stream=stream, beta=(start, end, steps), indices=idx[k], weights=w[k],
                        beta_out=used[k])
    exe = graph.instantiate()
    leaves = tree.leaves_numpy().astype(np.float64)
    total = math.fsum(leaves)
    seen = set()
    for r in range(replays):
        exe.launch(stream)
        for k in range(launches):
            step = r * launches + k
            beta = start + (end - start) * min(1.0, step / steps)
            got_beta = float(used[k].to_numpy()[0])
            assert got_beta == pytest.approx(beta, rel=2e-6, abs=2e-7), f"step {step}"
            got, weights = idx[k].to_numpy(), w[k].to_numpy()
            assert not np.isnan(weights).any()
            np.testing.assert_allclose(weights, importance_weights(leaves[got], total, stored=c, beta=beta),
                                       rtol=1e-5, err_msg=f"step {step}, beta {beta}")
            seen.add(round(beta, 9))
    assert len(seen) > launches + 1, "the schedule did not move"
    assert int(tree.step.to_numpy()[0]) == launches * replays
    tree.check_errors()


@pytest.mark.parametrize("beta", [0.0, 1.0, "random"])
def test_constant_beta_weights_and_beta_out(device, stream, rng, beta):
    c, b = 700, 128
    beta = float(np.float32(rng.uniform(0.05, 0.95))) if beta == "random" else beta
    tree = SumTree(c, alpha=0.6, seed=int(rng.integers(2**63)))
    tree.set_priorities(rng.uniform(0.1, 1.1, c).astype(np.float32))
    idx, w, used = DeviceBuffer(b, np.int32), DeviceBuffer(b, np.float32), DeviceBuffer(1, np.float32)
    for buf in (idx, w, used):
        buf.poison(stream=stream)
    tree.sample(b, stream=stream, beta=beta, indices=idx, weights=w, beta_out=used)
    assert used.to_numpy()[0] == np.float32(beta)
    leaves = tree.leaves_numpy().astype(np.float64)
    got, weights = idx.to_numpy(), w.to_numpy()
    assert not np.isnan(weights).any()
    np.testing.assert_allclose(weights, importance_weights(leaves[got], math.fsum(leaves), c, beta), rtol=2e-6)


@pytest.mark.parametrize("beta, error", [
    (-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError), ((0.4, 1.0, 0), ValueError),
    ((0.4, 1.2, 10), ValueError), ((-0.4, 1.0, 10), ValueError), ((0.4, 1.0), ValueError),
    ((0.4, 1.0, 2.5), TypeError), ((0.4, 1.0, True), TypeError), ("0.4", TypeError),
    ([0.4, 1.0, 10], TypeError), (None, TypeError),
])
def test_bad_beta_is_refused_before_any_launch(device, stream, rng, beta, error):
    tree = SumTree(64, seed=1)
    tree.set_priorities(rng.uniform(0.1, 1.0, 64).astype(np.float32))
    idx, w = DeviceBuffer(8, np.int32), DeviceBuffer(8, np.float32)
    with pytest.raises(error):
        tree.sample(8, stream=stream, beta=beta, indices=idx, weights=w)
    assert int(tree.step.to_numpy()[0]) == 0


def test_skip_decides_on_the_device_whether_update_changes_anything(device, stream, rng):
    c, n = 2000, 256
    tree = SumTree(c, alpha=0.6, seed=1)
    tree.set_priorities(rng.uniform(0.1, 1.1, c).astype(np.float32))
    where = rng.choice(c, n, replace=False).astype(np.int32)
    pri = rng.uniform(2.0, 20.0, n).astype(np.float32)  # above every leaf, so the maximum would move
    idx, new_p = DeviceBuffer.from_numpy(where), DeviceBuffer.from_numpy(pri)
    skip = DeviceBuffer(1, np.int32)
    with capture(stream) as graph:
        tree.update(idx, new_p, stream=stream, skip=skip)
    exe = graph.instantiate()
    leaves, nodes, top = tree.leaves_numpy(), tree.nodes_numpy(), tree.max_priority().to_numpy()

    skip.fill_u32(int(rng.integers(1, 2**31)), stream=stream)  # any non-zero value skips
    exe.launch(stream)
    assert tree.leaves_numpy().tobytes() == leaves.tobytes()
    assert tree.nodes_numpy().tobytes() == nodes.tobytes()
    assert tree.max_priority().to_numpy().tobytes() == top.tobytes()

    skip.fill_u32(0, stream=stream)
    exe.launch(stream)
    want = leaves.copy()
    want[where] = pri.astype(np.float64) ** 0.6
    np.testing.assert_allclose(tree.leaves_numpy(), want, rtol=1e-6, atol=0)
    assert tree.max_priority().to_numpy()[0] == pytest.approx(float(pri.max()) ** 0.6, rel=1e-6)
    assert_consistent(tree)
    tree.check_errors()


def test_arguments_of_the_wrong_kind_name_what_is_accepted(device, stream, rng):
    tree = SumTree(16, seed=1)
    d_idx = DeviceBuffer.from_numpy(np.arange(4, dtype=np.int32))
    with pytest.raises(TypeError, match="indices must be a DeviceBuffer, or a numpy array when priorities"):
        tree.update([0, 1], [1.0, 1.0], stream=stream)
    with pytest.raises(TypeError, match="both be numpy arrays or both DeviceBuffers"):
        tree.update(d_idx, np.ones(4, np.float32), stream=stream)
    with pytest.raises(TypeError, match="skip must be a DeviceBuffer or None"):
        tree.update(d_idx, DeviceBuffer.from_numpy(np.ones(4, np.float32)), stream=stream, skip=1)
    w = DeviceBuffer(4, np.float32)
    with pytest.raises(TypeError, match="indices must be a DeviceBuffer, got ndarray"):
        tree.sample(4, stream=stream, beta=0.4, indices=np.zeros(4, np.int32), weights=w)
    with pytest.raises(TypeError, match="beta_out must hold float32"):
        tree.sample(4, stream=stream, beta=0.4, indices=d_idx, weights=w,
                    beta_out=DeviceBuffer(1, np.float64))


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
        tree.update(indices, priorities, stream=stream)
    assert np.array_equal(tree.leaves_numpy(), leaves) and np.array_equal(tree.nodes_numpy(), nodes)


def test_update_sample_rebuild_capture_into_one_graph(device, stream, rng):
    c, b = 4096, 256
    tree = SumTree(c, alpha=0.6, seed=11)
    tree.set_priorities(rng.uniform(0.1, 1.1, c).astype(np.float32))
    idx, w = DeviceBuffer(b, np.int32), DeviceBuffer(b, np.float32)
    new_p = DeviceBuffer.from_numpy(rng.uniform(0.1, 2.0, b).astype(np.float32))
    with capture(stream) as graph:
        tree.sample(b, stream=stream, beta=0.4, indices=idx, weights=w)
        tree.update(idx, new_p, stream=stream)
        tree.rebuild(stream=stream)
    assert graph.node_counts() == {"kernel": 3}
    shapes = {k.function: (k.grid[0], k.block[0]) for k in graph.kernel_nodes()}
    # sample: one warp per sample, 4 warps; update: two blocks of a thread an index, each
    # writing half the leaves, the last refreshing the sums; rebuild: one warp per level-1
    # node, 32 warps.
    assert shapes == {"sumtree_sample": (b // 4, 128), "sumtree_update": (2, b),
                      "sumtree_rebuild": (c // 32 // 32, 1024)}
    exe = graph.instantiate()
    for _ in range(50):
        exe.launch(stream)
    assert int(tree.step.to_numpy()[0]) == 50
    assert_consistent(tree, node_rel=1e-13)
    tree.check_errors()


@pytest.mark.parametrize("b", [1, 300, 512])
@pytest.mark.parametrize("where", ["forked stream", "same stream", "same stream, dependent"])
def test_split_draw_matches_the_one_launch_draw_bit_for_bit(device, stream, rng, where, b):
    """sample(weights_stream=...) draws in two launches (sumtree_sample with no counter, then
    sumtree_weights); across graph replays with a beta schedule and a gate, its indices,
    weights, beta and step are the one-launch draw's, bit for bit, and the weights are the
    float64 reference's. Batches of 300 and 512 give sumtree_weights 10 and 16 blocks of
    one warp, each of which must take the minimum over the whole batch; 512 is max_batch.
    "dependent": the second launch is a programmatic dependent launch of the first."""
    from drvtrain import Stream
    from drvtrain.kernel import dependent_launches
    from drvtrain.stream import join
    c, launches, replays = 5000, 2, 4
    pri = rng.uniform(0.05, 1.5, c).astype(np.float32)
    pri[rng.random(c) < 0.1] = 0.0
    seed = int(rng.integers(2**63))
    trees = [SumTree(c, alpha=0.6, seed=seed, max_batch=512) for _ in range(2)]
    for t in trees:
        t.set_priorities(pri)
    side = Stream() if where == "forked stream" else stream
    start, end, steps = float(rng.uniform(0.1, 0.5)), float(rng.uniform(0.6, 1.0)), 5
    gate = DeviceBuffer.from_numpy(np.zeros(1, np.int32))
    out = [[(DeviceBuffer(b, np.int32), DeviceBuffer(b, np.float32), DeviceBuffer(1, np.float32))
            for _ in range(launches)] for _ in trees]
    with capture(stream) as graph, dependent_launches(where.endswith("dependent")):
        for k in range(launches):
            for t, tree in enumerate(trees):
                idx, w, used = out[t][k]
                for buf in (idx, w, used):
                    buf.poison(stream=stream)
                tree.sample(b, stream=stream, beta=(start, end, steps), indices=idx, weights=w, beta_out=used,
                            gate=gate, weights_stream=side if t == 1 else None)
                if t == 1 and side is not stream:
                    join(stream, side)
    weights = [k for k in graph.kernel_nodes() if k.function == "sumtree_weights"]
    assert len(weights) == launches and {k.grid[0] * k.block[0] for k in weights} == {-(-b // 32) * 32}
    assert bool(graph.programmatic_edges()) == where.endswith("dependent")
    exe = graph.instantiate()
    leaves = trees[0].leaves_numpy().astype(np.float64)
    total = math.fsum(leaves)
    drawn = 0  # ungated replays so far
    for r in range(replays):
        gated = r == 1
        gate.copy_from_numpy(np.array([int(gated)], np.int32))
        exe.launch(stream)
        stream.synchronize()
        for k in range(launches):
            one, two = ([buf.to_numpy() for buf in out[t][k]] for t in range(2))
            if gated:  # nothing drawn, nothing written
                assert all(np.all(a.view(np.uint32) == 0xFFFFFFFF) for a in one + two), f"replay {r}"
                continue
            for name, x, y in zip(("indices", "weights", "beta"), one, two):
                assert x.tobytes() == y.tobytes(), f"replay {r}, launch {k}: {name}"
            idx, w, used = two
            beta = start + (end - start) * min(1.0, (drawn * launches + k) / steps)
            assert float(used[0]) == pytest.approx(beta, rel=2e-6, abs=2e-7), f"replay {r}, launch {k}"
            assert not np.isnan(w).any() and np.all(leaves[idx] > 0)
            np.testing.assert_allclose(w, importance_weights(leaves[idx], total, stored=c, beta=beta),
                                       rtol=1e-5, err_msg=f"replay {r}, launch {k}")
        drawn += not gated
    want_steps = launches * (replays - 1)
    assert [int(t.step.to_numpy()[0]) for t in trees] == [want_steps, want_steps]
    for t in trees:
        t.check_errors()
    if side is not stream:
        side.close()


def test_split_draw_of_an_empty_tree_is_the_one_launch_draw(device, stream, rng):
    """Every leaf 0: both ways draw leaf 0 with weight 0 for every sample, raise the
    empty-tree flag and advance the step."""
    from drvtrain import Stream
    from drvtrain.stream import join
    c, b = 300, 70
    side = Stream()
    got = []
    for split in (False, True):
        tree = SumTree(c, alpha=0.6, seed=int(rng.integers(2**63)))
        tree.set_priorities(np.zeros(c, np.float32))
        idx, w = DeviceBuffer(b, np.int32), DeviceBuffer(b, np.float32)
        for buf in (idx, w):
            buf.poison(stream=stream)
        tree.sample(b, stream=stream, beta=0.4, indices=idx, weights=w, weights_stream=side if split else None)
        join(stream, side)
        got.append((idx.to_numpy(), w.to_numpy()))
        assert int(tree.step.to_numpy()[0]) == 1
        with pytest.raises(ReplayError, match="sampled an empty tree"):
            tree.check_errors()
    assert np.all(got[0][0] == 0) and np.all(got[0][1] == 0)
    assert got[0][0].tobytes() == got[1][0].tobytes() and got[0][1].tobytes() == got[1][1].tobytes()
    side.close()


def test_split_draw_refuses_a_weights_stream_that_is_not_a_stream_before_drawing(device, stream, rng):
    tree = SumTree(64, seed=1)
    tree.set_priorities(rng.uniform(0.1, 1.0, 64).astype(np.float32))
    idx, w = DeviceBuffer(8, np.int32), DeviceBuffer(8, np.float32)
    with pytest.raises(TypeError, match="weights_stream must be a Stream"):
        tree.sample(8, stream=stream, beta=0.4, indices=idx, weights=w, weights_stream=object())
    stream.synchronize()
    assert int(tree.step.to_numpy()[0]) == 0
