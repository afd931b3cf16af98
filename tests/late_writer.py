"""A late writer for testing reads before a kernel's grid wait.

`late_copy` copies up to two buffers (out = x, in 32-bit words), one block, after
spinning `ns` nanoseconds on %globaltimer. It calls dt_wait_prior_grid() before it
touches memory and dt_allow_dependents() before it spins, so a kernel launched after
it as a dependent launch starts at once, and meets the poison wherever it reads
these buffers before its own wait, however long the host takes between the two
launches (tests/test_late_writer_gpu.py checks that it does).
"""
import functools

from drvtrain import kernel_dir, load_source

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
