"""Tensor maps on the GPU: a TMA copy lands the box the map describes, in the swizzle it
names, with the fill outside the matrix, from eager launches and from graph replays."""
import numpy as np
import pytest

from cuda.bindings import driver as cu

from drvtrain import DeviceBuffer, capture, load_source
from drvtrain.tma import tensor_map_2d

pytestmark = pytest.mark.gpu

# One block copies one box with one TMA copy (thread 0, on an mbarrier), then writes it
# out row-major, undoing the swizzle by its address rule: the box's byte offset L sits
# at L ^ (((L >> 7) & mask) << 4) (mask 7, 3, 1 for the 128, 64, 32-byte swizzles).
SOURCE = r"""
#include "tma.cuh"
extern "C" __global__ void tma_box(const __grid_constant__ DtTensorMap map, float* out, int x, int y,
                                   int box_rows, int box_cols, int swizzle_mask) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long landed;
    const unsigned int raw = (unsigned int)__cvta_generic_to_shared(smem_raw);
    const unsigned int base = (raw + 1023u) & ~1023u;  // the 128-byte swizzle repeats every 1024 bytes
    const unsigned int bar = (unsigned int)__cvta_generic_to_shared(&landed);
    if (threadIdx.x == 0) {
        dt_tma_prefetch_map(&map);
        dt_mbar_init(bar, 1);
        dt_mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        dt_mbar_arrive_expect(bar, (unsigned int)(box_rows * box_cols * 4));
        dt_tma_load_2d(base, &map, x, y, bar);
    }
    dt_mbar_wait(bar, 0);
    const unsigned char* tile = smem_raw + (base - raw);
    for (int e = threadIdx.x; e < box_rows * box_cols; e += blockDim.x) {
        const int linear = (e / box_cols) * box_cols * 4 + (e % box_cols) * 4;
        out[e] = *reinterpret_cast<const float*>(tile + (linear ^ (((linear >> 7) & swizzle_mask) << 4)));
    }
}
"""
MASK = {"none": 0, "32B": 1, "64B": 3, "128B": 7}
WIDEST = {"none": 40, "32B": 8, "64B": 16, "128B": 32}  # box columns (floats)


def kernel():
    return load_source(SOURCE, "tma_box.cu").kernel("tma_box", "tmap, ptr, i32, i32, i32, i32, i32")


def expected(a, x, y, box_rows, box_cols, fill):
    """The box of ``a`` at column x, row y, ``fill`` outside the matrix."""
    want = np.full((box_rows, box_cols), fill, np.float32)
    rows, cols = a.shape
    for r in range(box_rows):
        for c in range(box_cols):
            if 0 <= y + r < rows and 0 <= x + c < cols:
                want[r, c] = a[y + r, x + c]
    return want


def run_box(kern, tm, x, y, stream):
    out = DeviceBuffer(tm.box)
    out.poison(stream=stream)
    kern.launch(1, 128, tm, out, x, y, *tm.box, MASK[tm.swizzle], stream=stream, shared_mem=tm.box_bytes + 1024)
    return out.to_numpy()


@pytest.mark.parametrize("swizzle", ["none", "32B", "64B", "128B"])
@pytest.mark.parametrize("where", ["inside", "past the corner", "before the start"])
def test_a_box_lands_in_the_swizzle_it_names(rng, stream, swizzle, where):
    rows, cols, box = 300, 200, (128, WIDEST[swizzle])
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    tm = tensor_map_2d(DeviceBuffer.from_numpy(a), box, swizzle=swizzle)
    # x: a multiple of 4 floats, as the copy needs (its first column 16-byte aligned); y: any row
    x, y = {"inside": (4 * int(rng.integers(0, (cols - box[1]) // 4)), int(rng.integers(0, rows - box[0]))),
            "past the corner": (cols - box[1] // 2, rows - 50),
            "before the start": (-4, -9)}[where]
    kern = kernel()
    # the driver reports a 128-byte parameter where it can report parameters at all
    assert kern.signature_checked or not hasattr(cu, "cuFuncGetParamInfo")
    got = run_box(kern, tm, x, y, stream)
    np.testing.assert_array_equal(got, expected(a, x, y, *box, 0.0))


def test_a_column_slice_with_its_own_row_stride_and_a_nan_fill(rng, stream):
    full = rng.standard_normal((96, 256)).astype(np.float32)
    buf = DeviceBuffer.from_numpy(full)
    view = buf.view(np.float32, (96 * 256 - 64,), 4 * 64)  # from column 64 on
    tm = tensor_map_2d(view, (64, 32), shape=(96, 100), ld=256, oob="nan")
    got = run_box(kernel(), tm, 80, 50, stream)  # columns 80..111 of the slice: past its 100
    want = expected(full[:, 64:164], 80, 50, 64, 32, np.nan)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    assert np.isnan(want).any() and (~np.isnan(want)).any()


def test_encoding_many_maps_gives_the_same_bytes(rng):
    """The map is encoded into an aligned window of a fresh buffer each time: the same
    request gives the same 128 bytes every time."""
    buf = DeviceBuffer((256, 64))
    first = tensor_map_2d(buf, (128, 32)).raw
    assert all(tensor_map_2d(buf, (128, 32)).raw == first for _ in range(50))
    assert tensor_map_2d(buf, (64, 32)).raw != first


def test_a_captured_copy_reads_the_buffer_as_it_is_at_replay(rng, stream):
    a = rng.standard_normal((256, 64)).astype(np.float32)
    buf = DeviceBuffer.from_numpy(a)
    tm = tensor_map_2d(buf, (128, 32))
    out = DeviceBuffer((128, 32))
    kern = kernel()
    with capture(stream) as graph:
        kern.launch(1, 128, tm, out, 32, 100, 128, 32, MASK["128B"], stream=stream, shared_mem=tm.box_bytes + 1024)
    exe = graph.instantiate()
    for _ in range(2):
        a = rng.standard_normal((256, 64)).astype(np.float32)
        buf.copy_from_numpy(a)
        out.poison(stream=stream)
        exe.launch(stream)
        np.testing.assert_array_equal(out.to_numpy(), a[100:228, 32:64])
