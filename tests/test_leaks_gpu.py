"""1000 create/free cycles of every resource leave device memory unchanged."""
import gc

import numpy as np
import pytest

from drvtrain import (Arena, DeviceBuffer, Event, MappedBuffer, Module, PinnedBuffer, Stream, builtin_module,
                      capture)

pytestmark = pytest.mark.gpu
CYCLES = 1000


def _graph_cycle(stream, kernel, buf):
    with capture(stream) as g:
        kernel.launch(1, 32, buf, 1.0, 16, stream=stream)
    exe = g.instantiate()
    return [exe, g]


def resource_factories(stream, kernel, buf):
    program = builtin_module("elementwise.cu").program
    return {
        "DeviceBuffer": lambda: [DeviceBuffer(1 << 20, np.uint8)],
        "Arena": lambda: [Arena(1 << 20)],
        "MappedBuffer": lambda: [MappedBuffer(1 << 16, np.float32)],
        "PinnedBuffer": lambda: [PinnedBuffer(1 << 16, np.float32)],
        "Stream": lambda: [Stream()],
        "Event": lambda: [Event(timing=True)],
        "Graph+GraphExec": lambda: _graph_cycle(stream, kernel, buf),
        "Module": lambda: [Module(program)],
    }


@pytest.mark.parametrize("how", ["close", "drop"])
def test_create_free_cycles_leave_memory_unchanged(device, stream, elementwise, how):
    buf = DeviceBuffer(16)
    factories = resource_factories(stream, elementwise["fill"], buf)
    for name, make in factories.items():
        for _ in range(10):  # warm up lazy driver allocations
            for r in make():
                r.close()
        stream.synchronize()
        gc.collect()
        before = device.memory_info()[0]
        for _ in range(CYCLES):
            objs = make()
            if how == "close":
                for r in objs:
                    r.close()
            del objs
        gc.collect()
        stream.synchronize()
        after = device.memory_info()[0]
        assert after == before, f"{name}: {before - after} bytes of device memory leaked over {CYCLES} cycles"
