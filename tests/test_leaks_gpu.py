"""1000 create/free cycles of every resource leave device memory unchanged."""
import gc

import numpy as np
import pytest

from drvtrain import (Arena, DeviceBuffer, Event, MappedBuffer, Module, PinnedBuffer, Stream, builtin_module,
                      capture)

pytestmark = [pytest.mark.gpu, pytest.mark.counts_device_memory]
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


def test_close_frees_a_trainer_while_it_is_still_referenced(device, tmp_path):
    """Trainer.close() (and the DQNStep, actors and graphs it owns) gives back every byte of
    device memory at once, not when Python collects the objects: each closed trainer is kept
    alive here, with the collector off (1024-wide layers: megabytes a buffer, well above
    the driver's allocation granularity)."""
    import os

    from drvtrain.rl.env import register_env
    from drvtrain.rl.trainer import TrainConfig, Trainer
    register_env("chain", os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs", "chain.cu"),
                 obs_dim=8, n_actions=2, state_dim=1, max_steps=50)
    cfg = TrainConfig(env="chain", n_envs=4, total_steps=4 * 25, learning_starts=40, train_every=4, unroll=10,
                      eval_every=4 * 20, eval_episodes=4, dqn=dict(hidden=(1024, 1024), batch=32, capacity=1024))
    kept = []

    def one():
        trainer = Trainer(cfg)
        trainer.run(until=4 * 23)  # a shorter last launch: its graph too
        trainer.evaluate()
        trainer.close()
        kept.append(trainer)

    one()  # lazy driver allocations and compiles
    gc.collect()
    gc.disable()
    try:
        before = device.memory_info()[0]
        for _ in range(3):
            one()
        after = device.memory_info()[0]
    finally:
        gc.enable()
    assert after == before, f"{before - after} bytes of device memory held by closed trainers"
