"""The block sums of kernels/common.cuh against a float64 emulation of their tree (the
emulation on the CPU, the kernels on the GPU)."""
import math

import numpy as np
import pytest

from drvtrain import DeviceBuffer, Stream, builtin_module


def tree_sum(x):
    """The documented order over the last axis (a power of two long): level w = n/2, ..., 1
    adds element t + w into element t for t < w; the sum is element 0."""
    s = np.array(x, np.float64)
    n = s.shape[-1]
    assert n >= 1 and n & (n - 1) == 0, f"the tree needs a power of two, got {n}"
    w = n // 2
    while w >= 1:
        s[..., :w] = s[..., :w] + s[..., w:2 * w]
        w //= 2
    return s[..., 0]


def test_tree_sum_is_the_documented_pairing():
    """The emulation itself, on values where the order of the adds shows in the bits."""
    x = np.array([1e16, 1.0, -1e16, 1.0, 3.0, 1e-3, -3.0, 0.5])
    # level 4: [1e16+3, 1+1e-3, -1e16-3, 1+0.5]; level 2: [(1e16+3)+(-1e16-3), (1+1e-3)+1.5]; level 1.
    want = ((1e16 + 3.0) + (-1e16 + -3.0)) + ((1.0 + 1e-3) + (1.0 + 0.5))
    assert tree_sum(x) == want
    assert tree_sum(x) != np.cumsum(x)[-1]  # a sequential sum loses the first 1.0 to 1e16
    assert tree_sum(np.stack([x, x[::-1]])).tolist() == [want, tree_sum(x[::-1])]


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [32, 128, 256])
def test_block_sums_have_the_tree_bits(device, rng, threads):
    """dt_block_sums (three sums in one pass) and dt_block_sum (twice back to back, on one
    shared array) give every thread the bits of the shared-memory tree, on values of 16
    orders of magnitude and both signs, where a sequential sum gives other bits."""
    blocks = 37
    mags = 10.0 ** rng.uniform(-8, 8, (3, blocks, threads))
    x = rng.standard_normal((3, blocks, threads)) * mags
    kernel = builtin_module("probe.cu").kernel(f"block_sums_{threads}", "ptr ptr")
    xin = DeviceBuffer.from_numpy(x.ravel())
    out = DeviceBuffer(blocks * 5 * threads, np.float64)
    stream = Stream()
    out.poison(stream=stream)
    kernel.launch(blocks, threads, xin, out, stream=stream)
    stream.synchronize()
    got = out.to_numpy().reshape(blocks, 5, threads)
    want = tree_sum(x)  # [3, blocks]
    assert not np.isnan(got).any()
    for i in range(3):
        assert (got[:, i, :] == want[i][:, None]).all(), f"sum {i}"
    assert (got[:, 3, :] == want[0][:, None]).all(), "the first single sum"
    assert (got[:, 4, :] == want[1][:, None]).all(), "the second single sum, on the same array"
    # The check can tell orders apart on these values: a sequential sum differs
    # from the tree in some blocks; and every tree sum is close to the exact one.
    assert (np.cumsum(x, axis=-1)[..., -1] != want).any()
    fsum = np.array([[math.fsum(row) for row in xi] for xi in x])
    scale = np.abs(x).sum(axis=-1)
    assert (np.abs(want - fsum) <= 1e-14 * scale).all()
