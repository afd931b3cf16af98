"""Replay storage: wrap-around insertion, validation, fused sample-and-gather, graph replay."""
import numpy as np
import pytest

from drvtrain import Arena, DeviceBuffer, capture
from drvtrain.rl import ReplayBuffer
from per_reference import fixed_order_nodes, importance_weights, poison_ancestors

pytestmark = pytest.mark.gpu


def transitions(rng, n, d):
    return (rng.standard_normal((n, d)).astype(np.float32), rng.integers(0, 18, n).astype(np.int32),
            rng.standard_normal(n).astype(np.float32), rng.standard_normal((n, d)).astype(np.float32),
            (rng.random(n) < 0.05).astype(np.float32))


def host_copy(rb):
    return [f.to_numpy() for f in (rb.obs, rb.action, rb.reward, rb.next_obs, rb.done)]


@pytest.mark.parametrize("on_device", [False, True])
def test_insert_wraps_around_in_order(device, stream, rng, on_device):
    c, d = 10, 3
    rb = ReplayBuffer(c, d, alpha=0.6, seed=1)
    batches = [transitions(rng, n, d) for n in (7, 7, 4)]
    expected = [np.zeros((c, d), np.float32), np.zeros(c, np.int32), np.zeros(c, np.float32),
                np.zeros((c, d), np.float32), np.zeros(c, np.float32)]
    cursor = 0
    for batch in batches:
        args = [DeviceBuffer.from_numpy(a) for a in batch] if on_device else list(batch)
        rb.insert(*args, stream=stream)
        slots = (cursor + np.arange(len(batch[1]))) % c
        for e, a in zip(expected, batch):
            e[slots] = a
        cursor += len(batch[1])
    for got, want in zip(host_copy(rb), expected):
        np.testing.assert_array_equal(got, want)
    assert rb.cursor() == 18 and rb.stored() == 10
    leaves = rb.tree.leaves_numpy()
    np.testing.assert_array_equal(leaves, np.ones(c, np.float32))  # initial max priority 1 ** alpha
    assert rb.tree.read_total() == 10.0


def test_new_transitions_enter_at_the_largest_priority(device, stream, rng):
    rb = ReplayBuffer(100, 4, alpha=0.6, seed=2)
    rb.insert(*transitions(rng, 50, 4), stream=stream)
    pri = rng.uniform(0.1, 3.0, 50).astype(np.float32)
    rb.update_priorities(np.arange(50), pri, stream=stream)
    rb.insert(*transitions(rng, 10, 4), stream=stream)
    leaves = rb.tree.leaves_numpy()
    np.testing.assert_allclose(leaves[50:60], float(pri.max()) ** 0.6, rtol=1e-6)
    assert rb.stored() == 60


@pytest.mark.parametrize("case, error, match", [
    ("obs_shape", ValueError, "obs must have shape"),
    ("reward_shape", ValueError, "reward must have shape"),
    ("nan_obs", ValueError, "NaN"),
    ("inf_reward", ValueError, "NaN or infinite"),
    ("float_action", TypeError, "action must be integers"),
    ("negative_action", ValueError, "non-negative"),
    ("bad_done", ValueError, "only 0 and 1"),
    ("too_many", ValueError, "1 to 10 transitions"),
    ("string_obs", TypeError, "numeric"),
    ("mixed", TypeError, "all fields as numpy arrays"),
    ("device_dtype", TypeError, "must hold float32"),
])
def test_bad_inserts_are_refused_and_change_nothing(device, stream, rng, case, error, match):
    rb = ReplayBuffer(10, 3, seed=1)
    rb.insert(*transitions(rng, 4, 3), stream=stream)
    before, state, leaves = host_copy(rb), rb.state.to_numpy(), rb.tree.leaves_numpy()
    obs, action, reward, next_obs, done = transitions(rng, 3, 3)
    if case == "obs_shape":
        obs = obs[:, :2].copy()
    elif case == "reward_shape":
        reward = reward[:2].copy()
    elif case == "nan_obs":
        obs[1, 1] = np.nan
    elif case == "inf_reward":
        reward[0] = np.inf
    elif case == "float_action":
        action = action.astype(np.float32)
    elif case == "negative_action":
        action[2] = -1
    elif case == "bad_done":
        done[0] = 0.5
    elif case == "too_many":
        obs, action, reward, next_obs, done = transitions(rng, 11, 3)
    elif case == "string_obs":
        obs = obs.astype(str)
    elif case == "mixed":
        obs = DeviceBuffer.from_numpy(obs)
    elif case == "device_dtype":
        obs, action, reward, next_obs, done = (DeviceBuffer.from_numpy(a)
                                               for a in (obs, action, reward, next_obs, done))
        obs = DeviceBuffer.from_numpy(np.zeros((3, 3), np.float64))
    with pytest.raises(error, match=match):
        rb.insert(obs, action, reward, next_obs, done, stream=stream)
    for got, want in zip(host_copy(rb), before):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(rb.state.to_numpy(), state)
    np.testing.assert_array_equal(rb.tree.leaves_numpy(), leaves)


@pytest.mark.parametrize("d", [7, 37, 4, 128, 132])  # 4-byte rows of one and two a lane; 16-byte of 1, 32, 33
def test_sample_gathers_the_sampled_rows(device, stream, rng, d):
    c, b = 3000, 512
    rb = ReplayBuffer(c, d, alpha=0.6, seed=int(rng.integers(2**63)))
    rb.insert(*transitions(rng, c, d), stream=stream)
    rb.update_priorities(np.arange(c), rng.uniform(0.1, 1.1, c).astype(np.float32), stream=stream)
    arena = Arena(1 << 20)
    arena.array((arena.capacity // 4,), np.uint32).poison(stream=stream)  # the batch lands on NaN and -1
    arena.reset()
    beta_used = DeviceBuffer(1, np.float32)
    beta_used.poison(stream=stream)
    batch = rb.sample(b, stream=stream, beta=0.4, arena=arena, beta_out=beta_used)
    assert arena.fallback_count == 0  # the batch is on the poisoned slab
    idx = batch.indices.to_numpy()
    obs, action, reward, next_obs, done = host_copy(rb)
    np.testing.assert_array_equal(batch.obs.to_numpy(), obs[idx])
    np.testing.assert_array_equal(batch.next_obs.to_numpy(), next_obs[idx])
    np.testing.assert_array_equal(batch.action.to_numpy(), action[idx])
    np.testing.assert_array_equal(batch.reward.to_numpy(), reward[idx])
    np.testing.assert_array_equal(batch.done.to_numpy(), done[idx])
    leaves = rb.tree.leaves_numpy().astype(np.float64)
    w = batch.weights.to_numpy()
    assert not np.isnan(w).any()
    np.testing.assert_allclose(w, importance_weights(leaves[idx], rb.tree.read_total(), rb.stored(), 0.4),
                               rtol=2e-6)
    assert beta_used.to_numpy()[0] == np.float32(0.4)
    rb.check_errors()


def run_steps(rb, stream, arena, new_p, inserts, steps, graph=False):
    """One step: sample, write new priorities for the sampled leaves, insert a few transitions."""
    def step():
        arena.reset()
        batch = rb.sample(64, stream=stream, beta=0.4, arena=arena)
        rb.update_priorities(batch.indices, new_p, stream=stream)
        rb.insert(*inserts, stream=stream)
        return batch

    if not graph:
        for _ in range(steps):
            batch = step()
        return batch.indices.to_numpy()
    with capture(stream) as g:
        batch = step()
    # One warp per sample and per inserted transition, four warps per block; the update two
    # blocks of a thread an index, each writing half the leaves, the last refreshing the sums.
    shapes = {k.function: (k.grid[0], k.block[0]) for k in g.kernel_nodes()}
    assert shapes == {"sumtree_sample": (64 // 4, 128), "sumtree_update": (2, 64),
                      "replay_insert": (-(-inserts[1].size // 4), 128)}
    exe = g.instantiate()
    for _ in range(steps):
        exe.launch(stream)
    return batch.indices.to_numpy()


def test_graph_replay_matches_eager_sequence(device, stream, rng):
    c, d = 2048, 4
    seed = int(rng.integers(2**63))
    init = transitions(rng, c, d)
    pri = rng.uniform(0.1, 1.1, c).astype(np.float32)
    # One value for every sampled slot: duplicate indices then write the same value,
    # so the leaves do not depend on which duplicate lands last.
    new_p = DeviceBuffer.from_numpy(np.full(64, rng.uniform(0.1, 2.0), np.float32))
    inserts = [DeviceBuffer.from_numpy(a) for a in transitions(rng, 8, d)]
    results = []
    for graph in (False, True):
        rb = ReplayBuffer(c, d, alpha=0.6, seed=seed, max_batch=64)
        rb.insert(*init, stream=stream)
        rb.update_priorities(np.arange(c), pri, stream=stream)
        last = run_steps(rb, stream, Arena(1 << 16), new_p, inserts, 1000, graph=graph)
        results.append((last, rb.tree.leaves_numpy(), rb.tree.nodes_numpy(), rb.state.to_numpy(),
                        host_copy(rb)))
        rb.check_errors()
    (i0, l0, n0, s0, h0), (i1, l1, n1, s1, h1) = results
    np.testing.assert_array_equal(s0, s1)
    assert s1.tolist() == [c + 8000, c]
    np.testing.assert_array_equal(i0, i1)
    np.testing.assert_array_equal(l0, l1)
    assert n0.tobytes() == n1.tobytes()  # the sums, too, are a function of the leaves
    for a, b in zip(h0, h1):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("b, d", [(1, 1), (100, 7), (512, 128)])
def test_scratch_bytes_is_what_one_sample_takes(device, stream, rng, b, d):
    c = 1000
    rb = ReplayBuffer(c, d, alpha=0.6, seed=int(rng.integers(2**63)), max_batch=512)
    rb.insert(*transitions(rng, c, d), stream=stream)
    rb.update_priorities(np.arange(c), rng.uniform(0.1, 1.1, c).astype(np.float32), stream=stream)

    def slice_bytes(nbytes):  # the arena starts every slice on a 256-byte boundary
        return -(-nbytes // 256) * 256

    # indices, weights, action, reward, done: 4 bytes per sample; obs, next_obs: 4 * d.
    want = 5 * slice_bytes(4 * b) + 2 * slice_bytes(4 * b * d)
    assert rb.scratch_bytes(b) == want
    arena = Arena(want)  # exactly enough: a capture cannot fall back to an allocation
    with capture(stream) as graph:
        arena.reset()
        batch = rb.sample(b, stream=stream, beta=0.4, arena=arena)
    assert slice_bytes(arena.high_water) == want and arena.fallback_count == 0
    exe = graph.instantiate()
    exe.launch(stream)
    idx = batch.indices.to_numpy()
    assert idx.min() >= 0 and idx.max() < c
    np.testing.assert_array_equal(batch.next_obs.to_numpy(), rb.next_obs.to_numpy()[idx])
    np.testing.assert_array_equal(batch.done.to_numpy(), rb.done.to_numpy()[idx])
    rb.check_errors()


@pytest.mark.parametrize("capacity", [33, 1000, 5000])
def test_inserts_that_wrap_leave_the_fixed_order_sums(device, stream, rng, capacity):
    """Inserts of 1 slot, of a whole buffer and of runs that wrap past the end, with
    priority updates between them: after each, every node is, bit for bit, the fixed-order
    sum of its children (per_reference), nodes poisoned beforehand included."""
    d = 3
    rb = ReplayBuffer(capacity, d, alpha=0.6, seed=int(rng.integers(2**63)), max_batch=64)
    tree = rb.tree
    tree.update(np.arange(capacity), rng.uniform(0.1, 1.1, capacity).astype(np.float32), stream=stream)
    inserted = 0
    for n in (1, capacity, capacity - 7, 31, capacity // 2 + 3, capacity):
        # Poison the sums above the slots the insert takes: they must all be recomputed.
        slots = (inserted + np.arange(n)) % capacity
        tree.nodes.copy_from_numpy(poison_ancestors(tree.nodes_numpy(), tree.levels, slots))
        rb.insert(*transitions(rng, n, d), stream=stream)
        inserted += n
        assert rb.cursor() == inserted
        leaves = tree.leaves.to_numpy()
        assert tree.nodes_numpy().tobytes() == fixed_order_nodes(leaves, tree.levels, tree.internal).tobytes()
        idx = rng.integers(0, capacity, 64).astype(np.int32)
        tree.update(idx, rng.uniform(0.1, 3.0, 64).astype(np.float32), stream=stream)
        leaves = tree.leaves.to_numpy()
        assert tree.nodes_numpy().tobytes() == fixed_order_nodes(leaves, tree.levels, tree.internal).tobytes()
    tree.check_errors()
