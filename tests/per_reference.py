"""Float64 numpy references for prioritized replay (docs/step-spec.md, steps 1, 2 and 9)."""
import numpy as np

MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counters: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 over rows of 4 uint32 counters; returns rows of 4 uint32 words."""
    x = [counters[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    for _ in range(10):
        p0, p1 = m0 * x[0], m1 * x[2]
        x = [(p1 >> np.uint64(32)) ^ x[1] ^ k0, p1 & MASK32, (p0 >> np.uint64(32)) ^ x[3] ^ k1, p0 & MASK32]
        k0, k1 = (k0 + w0) & MASK32, (k1 + w1) & MASK32
    return np.stack(x, axis=1).astype(np.uint32)


def philox_uniforms(seed: int, step: int, batch: int) -> np.ndarray:
    """The U[0,1) doubles the sampler draws for (seed, step), sample j at counter j."""
    j = np.arange(batch, dtype=np.uint64)
    counters = np.stack([j, np.full_like(j, step & 0xFFFFFFFF), np.full_like(j, step >> 32),
                         np.zeros_like(j)], axis=1)
    r = philox4x32_10(counters, (seed & 0xFFFFFFFF, seed >> 32)).astype(np.uint64)
    bits = ((r[:, 0] >> np.uint64(5)) << np.uint64(26)) | (r[:, 1] >> np.uint64(6))
    return bits.astype(np.float64) / 2.0**53


def stratified_masses(uniforms: np.ndarray, total: float) -> np.ndarray:
    b = len(uniforms)
    return (np.arange(b, dtype=np.float64) + uniforms) * total / b


def prefix_search(leaves: np.ndarray, masses: np.ndarray) -> np.ndarray:
    """The leaf whose cumulative range holds each mass; never a zero leaf (clamps to the last non-zero)."""
    p = np.asarray(leaves, np.float64)
    idx = np.searchsorted(np.cumsum(p), masses, side="right")
    nonzero = np.flatnonzero(p > 0)
    return np.minimum(idx, nonzero[-1])


def importance_weights(p: np.ndarray, total: float, stored: int, beta: float) -> np.ndarray:
    """Importance-sampling weights of a batch, from the definition.

    A leaf of value p_j is drawn with probability P(j) = p_j / total; its
    weight is (N * P(j)) ** -beta with N the stored transitions, and the
    batch is scaled so that its largest weight is 1. A sampled leaf of 0 has
    no weight (it could not have been drawn), so it is refused.
    """
    p = np.asarray(p, np.float64)
    if not np.all(p > 0):
        raise ValueError("a sampled leaf of 0 (or NaN) has no importance weight")
    probability = p / float(total)
    unscaled = (float(stored) * probability) ** (-float(beta))
    return unscaled / np.max(unscaled)


def tree_inconsistency(nodes: np.ndarray, leaves: np.ndarray, levels) -> float:
    """Largest relative gap between an internal node and the sum of its 32 children.

    ``levels`` is ``SumTree.levels``: (offset, real nodes, padded size) per level,
    root first. A non-zero padding node counts as an infinite gap.
    """
    children = np.asarray(leaves, np.float64)
    worst = 0.0
    for offset, real, size in reversed(levels):
        padded = np.zeros(real * 32)
        padded[: min(len(children), real * 32)] = children[: real * 32]
        sums = padded.reshape(real, 32).sum(axis=1)
        stored = np.asarray(nodes[offset: offset + real], np.float64)
        worst = max(worst, float(np.max(np.abs(stored - sums) / np.maximum(np.abs(sums), 1e-300))))
        if np.any(nodes[offset + real: offset + size] != 0):
            return float("inf")
        children = stored
    return worst


def fixed_order_sum32(children: np.ndarray) -> np.ndarray:
    """Sums of rows of 32 float64 values in the device's fixed order (sumtree.cuh's
    dt_warp_sum, lane 0's result): v[i] += v[i + d] for i < d, d = 16, 8, 4, 2, 1."""
    v = np.array(children, np.float64).reshape(-1, 32)
    for d in (16, 8, 4, 2, 1):
        v[:, :d] = v[:, :d] + v[:, d: 2 * d]
    return v[:, 0].copy()


def fixed_order_nodes(leaves: np.ndarray, levels, internal: int) -> np.ndarray:
    """The whole ``nodes`` array (padding included, 0) that a tree over ``leaves`` holds
    when every node is the fixed-order sum of its children (:func:`fixed_order_sum32`).
    ``levels`` is ``SumTree.levels``, root first."""
    nodes = np.zeros(internal, np.float64)
    children = np.asarray(leaves, np.float32).astype(np.float64)
    for offset, real, _ in reversed(levels):
        padded = np.zeros(real * 32)
        padded[: min(len(children), real * 32)] = children[: real * 32]
        nodes[offset: offset + real] = fixed_order_sum32(padded)
        children = nodes[offset: offset + real]
    return nodes


def poison_ancestors(nodes: np.ndarray, levels, leaf_indices) -> np.ndarray:
    """A copy of ``nodes`` with every ancestor of ``leaf_indices``, up to the root, set
    to NaN: a refresh that leaves one of them out shows. ``levels`` is ``SumTree.levels``."""
    nodes = np.array(nodes, np.float64)
    leaf_indices = np.asarray(leaf_indices, np.int64)
    for h, (offset, _, _) in enumerate(reversed(levels), start=1):
        nodes[offset + np.unique(leaf_indices >> (5 * h))] = np.nan
    return nodes
