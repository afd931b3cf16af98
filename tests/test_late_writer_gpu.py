"""The late writer that the tests of reads before a grid wait rely on (late_writer.py)."""
import os

import numpy as np
import pytest

from drvtrain import DeviceBuffer, dependent_launches
from late_writer import LATE_NS, copy_around_the_wait, late_copy, words

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("early", [1, 0], ids=["read-before-the-wait", "read-after-the-wait"])
def test_a_read_before_the_wait_meets_the_late_writers_poison(device, stream, rng, early):
    """Poisoned x, then `late_copy` writes it and a kernel launched dependent on it copies
    x: where it reads x before its grid wait it gets the poison in every element (the
    test of a settled read can fail), after the wait the values."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"programmatic dependent launch needs compute capability 9.0; this device is {device.arch}")
    if early and any(key.startswith("NV_SANITIZER_") for key in os.environ):
        pytest.skip("a CUDA tool is attached (compute-sanitizer, say), which runs kernels one after another")
    n = 8192
    values = rng.standard_normal(n).astype(np.float32)
    source = DeviceBuffer.from_numpy(values)
    x, out = DeviceBuffer((n,), np.float32), DeviceBuffer((n,), np.float32)
    writer, reader = late_copy(), copy_around_the_wait()
    for _ in range(2):
        x.poison(stream=stream)
        out.poison(stream=stream)
        with dependent_launches(True):
            writer.launch(1, 128, x, source, words(x), 0, 0, 0, LATE_NS, stream=stream)
            reader.launch(n // 256, 256, out, x, n, early, stream=stream)
        got = out.to_numpy()
        if early:
            assert np.isnan(got).all(), f"{np.isfinite(got).sum()} of {n} reads came after the writer"
        else:
            assert got.tobytes() == values.tobytes()
