"""Loading and launching kernels, user-compiled code, driver errors on a real GPU."""
import numpy as np
import pytest
from cuda.bindings import driver as cu

from drvtrain import DriverError, builtin_module, capture, check, load_source

pytestmark = pytest.mark.gpu

TEMPLATE = r'''
#include "common.cuh"
#include "user_scale.cuh"
template <typename T>
__global__ void scale_add(T* out, const T* x, T a, int n) {
    for (long long i = dt_thread_index(); i < n; i += dt_grid_stride()) out[i] = a * x[i] + USER_OFFSET;
}
'''


@pytest.mark.provokes_driver_errors
def test_driver_error_names_call_status_and_message(device):
    with pytest.raises(DriverError) as info:
        check(cu.cuMemAlloc, 0)
    assert str(info.value) == "cuMemAlloc: CUDA_ERROR_INVALID_VALUE (invalid argument)"


@pytest.mark.provokes_driver_errors
def test_unknown_kernel_name_is_a_driver_error(device):
    with pytest.raises(DriverError, match="cuModuleGetFunction: CUDA_ERROR_NOT_FOUND"):
        builtin_module("elementwise.cu").kernel("no_such_kernel", "ptr")


@pytest.mark.provokes_driver_errors
def test_signature_is_checked_against_the_cubin(device):
    mod = builtin_module("elementwise.cu")
    with pytest.raises(TypeError, match="takes 3 parameters"):
        mod.kernel("fill_f32", "ptr, f32, i32, i32")
    with pytest.raises(TypeError, match="parameter 1 is 8 bytes, declared f32 is 4"):
        mod.kernel("add_f32", "ptr, f32, ptr, i32")


def test_user_template_kernel_through_public_compiler(tmp_path, rng, stream, cache_dir):
    from drvtrain import DeviceBuffer
    (tmp_path / "user_scale.cuh").write_text("#pragma once\n#define USER_OFFSET 0.5\n")
    mod = load_source(TEMPLATE, "user.cu", include_dirs=[tmp_path],
                      name_expressions=["scale_add<float>", "scale_add<double>"])
    for name, dtype, sig, tol in (("scale_add<float>", np.float32, "ptr, ptr, f32, i32", 1e-6),
                                  ("scale_add<double>", np.float64, "ptr, ptr, f64, i32", 1e-14)):
        k = mod.kernel(name, sig)
        n = 1000
        x = rng.standard_normal(n).astype(dtype)
        dx, out = DeviceBuffer.from_numpy(x), DeviceBuffer(n, dtype)
        out.poison(stream=stream)
        a = float(rng.uniform(1, 2))
        with capture(stream) as g:  # user kernels capture like drvtrain's own
            k.launch(4, 256, out, dx, a, n, stream=stream)
        g.instantiate().launch(stream)
        ref = a * x.astype(np.float64) + 0.5
        got = out.to_numpy()
        assert not np.isnan(got).any()
        assert np.max(np.abs(got - ref) / np.abs(ref).max()) < tol


def test_bound_launch_updates_arguments_in_place(rng, stream, elementwise):
    from drvtrain import DeviceBuffer
    n = 777
    out = DeviceBuffer(n)
    bound = elementwise["fill"].bind(4, 256, out, 1.0, n)
    value = float(rng.uniform(-5, 5))
    bound.set(1, value)
    bound.launch(stream)
    np.testing.assert_array_equal(out.to_numpy(), np.full(n, value, np.float32))


def test_launch_shape_errors_precede_the_driver(stream, elementwise):
    from drvtrain import DeviceBuffer
    with pytest.raises(ValueError, match="block dimension x"):
        elementwise["fill"].launch(1, 2048, DeviceBuffer(16), 1.0, 16, stream=stream)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        elementwise["fill"].launch(1, 32, DeviceBuffer(16), 1.0, stream=stream)
