"""A late writer for testing reads before a kernel's grid wait.

`late_copy` copies up to two buffers (out = x, in 32-bit words), one block, after
spinning `ns` nanoseconds on %globaltimer. It calls dt_wait_prior_grid() before it
touches memory and dt_allow_dependents() before it spins, so a kernel launched after
it as a dependent launch starts at once, and meets the poison wherever it reads
these buffers before its own wait, however long the host takes between the two
launches (tests/test_late_writer_gpu.py checks that it does).
"""
import functools
import os

import numpy as np
import pytest

from drvtrain import DeviceBuffer, kernel_dir, load_source

LATE_COPY_SOURCE = r"""
#include "common.cuh"
extern "C" __global__ void late_copy(unsigned int* out, const unsigned int* x, int n, unsigned int* out2,
                                     const unsigned int* x2, int n2, unsigned long long ns) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i];
    for (int i = threadIdx.x; i < n2; i += blockDim.x) out2[i] = x2[i];
}

// The positive control: out = x, read before the wait (as no drvtrain kernel may),
// or after it.
extern "C" __global__ void copy_around_the_wait(float* out, const float* x, int n, int early) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float value = 0.0f;
    if (early && i < n) value = x[i];
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (!early && i < n) value = x[i];
    if (i < n) out[i] = value;
}
"""
LATE_NS = 1_000_000  # 1 ms: far more than the host takes between two eager launches


@functools.lru_cache(maxsize=None)
def _module():
    # Held for the whole run: a module whose last kernel is dropped unloads, and the
    # unload waits for its kernels, so `late_copy().launch(...)` on a temporary would
    # hold the host until the writer ends, and the kernel after it would not overlap.
    return load_source(LATE_COPY_SOURCE, "late_copy.cu", include_dirs=[kernel_dir()])


def late_copy():
    """The `late_copy` kernel: launch(1, 128, out, x, n, out2, x2, n2, ns) (out2 and x2 0 with n2 = 0)."""
    return _module().kernel("late_copy", "ptr ptr i32 ptr ptr i32 u64")


def copy_around_the_wait():
    return _module().kernel("copy_around_the_wait", "ptr ptr i32 i32")


def words(buf) -> int:
    """The 32-bit words of a buffer."""
    return buf.nbytes // 4


def skip_unless_a_read_can_race(device, early: bool) -> None:
    """Skip a test of a read before the wait where it cannot meet the poison: on a device
    without programmatic dependent launch, and (an early read) under a CUDA tool such as
    compute-sanitizer, which runs kernels one after another."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"programmatic dependent launch needs compute capability 9.0; this device is {device.arch}")
    if early and any(key.startswith("NV_SANITIZER_") for key in os.environ):
        pytest.skip("a CUDA tool is attached (compute-sanitizer, say), which runs kernels one after another")


class CopyCase:
    """Fresh values, their device copy ``source``, and ``x`` (for the late writer to fill
    from ``source``) and ``out`` (for `copy_around_the_wait` to fill from ``x``)."""

    def __init__(self, rng, n: int = 8192):
        self.n = n
        self.values = rng.standard_normal(n).astype(np.float32)
        self.source = DeviceBuffer.from_numpy(self.values)
        self.x, self.out = DeviceBuffer((n,), np.float32), DeviceBuffer((n,), np.float32)

    def poison(self, stream) -> None:
        self.x.poison(stream=stream)
        self.out.poison(stream=stream)

    def check(self, read_before_the_writer: bool) -> None:
        """``out`` holds the poison in every element, or the values in every one."""
        got = self.out.to_numpy()
        if read_before_the_writer:
            assert np.isnan(got).all(), f"{np.isfinite(got).sum()} of {self.n} reads came after the writer"
        else:
            assert got.tobytes() == self.values.tobytes()
