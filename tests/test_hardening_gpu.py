"""Regression tests for lifetimes, ownership and error paths found in review (GPU)."""
import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

from drvtrain import (Arena, DeviceBuffer, MappedBuffer, PinnedBuffer, Stream, builtin_module, capture,
                      load_source)
from drvtrain.flags import ErrorFlags
from drvtrain.memory import pinned_total

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCALE_SOURCE = r'''
extern "C" __global__ void scale_by(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}'''


def test_executable_graph_keeps_its_module_loaded(device, stream, rng):
    """A module dropped after capture stays loaded while a GraphExec made from it lives."""
    n = 5000
    src = rng.standard_normal(n).astype(np.float32)
    a = float(rng.uniform(1.5, 3.0))
    x, y = DeviceBuffer.from_numpy(src), DeviceBuffer(n)
    module = load_source(SCALE_SOURCE, "scale_by.cu")
    kernel = module.kernel("scale_by", "ptr ptr f32 i32")
    alive = weakref.ref(module)
    with capture(stream) as graph:
        kernel.launch(-(-n // 128), 128, y, x, a, n, stream=stream)
    exe = graph.instantiate()
    graph.close()  # empties the Graph's own list; the GraphExec keeps its own
    del module, kernel, graph
    gc.collect()
    assert alive() is not None, "the module was unloaded under a live GraphExec"
    y.poison(stream=stream)
    exe.launch(stream)
    np.testing.assert_array_equal(y.to_numpy(), np.float32(a) * src)
    exe.close()
    gc.collect()
    assert alive() is None, "closing the GraphExec should let the module go"


def _scale_graph(stream, kernel, y, x, a, n):
    with capture(stream) as graph:
        kernel.launch(-(-n // 128), 128, y, x, a, n, stream=stream)
    return graph


def test_closed_graphs_refuse_use_and_an_update_needs_no_closed_graph(device, stream, rng):
    """A closed Graph refuses every use; an executable graph updates from a new graph after
    its source graph was closed, and once closed refuses launches and updates."""
    n = int(rng.integers(3000, 9000))
    src = rng.standard_normal(n).astype(np.float32)
    a1, a2 = (float(v) for v in rng.uniform(1.5, 3.0, 2))
    x, y = DeviceBuffer.from_numpy(src), DeviceBuffer(n)
    kernel = load_source(SCALE_SOURCE, "scale_by.cu").kernel("scale_by", "ptr ptr f32 i32")
    first = _scale_graph(stream, kernel, y, x, a1, n)
    exe = first.instantiate()
    first.close()
    for use in (first.nodes, first.edges, first.instantiate, first.summary):
        with pytest.raises(RuntimeError, match="the graph is closed"):
            use()
    second = _scale_graph(stream, kernel, y, x, a2, n)
    exe.update(second)  # the topology is compared with the one read at instantiation
    second.close()
    y.poison(stream=stream)
    exe.launch(stream)
    np.testing.assert_array_equal(y.to_numpy(), np.float32(a2) * src)
    exe.close()
    with pytest.raises(RuntimeError, match="the executable graph is closed"):
        exe.launch(stream)
    third = _scale_graph(stream, kernel, y, x, a1, n)
    with pytest.raises(RuntimeError, match="the executable graph is closed"):
        exe.update(third)
    third.close()


def test_a_closed_module_refuses_its_kernels_and_its_graphs(device, stream, rng):
    """Module.close is refused while an executable graph replays its kernels (and that graph
    still runs); once it is closed, its kernels, bound launches and captured graphs are refused."""
    n = int(rng.integers(3000, 9000))
    src = rng.standard_normal(n).astype(np.float32)
    a = float(rng.uniform(1.5, 3.0))
    x, y = DeviceBuffer.from_numpy(src), DeviceBuffer(n)
    module = load_source(SCALE_SOURCE, "scale_by.cu")
    kernel = module.kernel("scale_by", "ptr ptr f32 i32")
    bound = kernel.bind(-(-n // 128), 128, y, x, a, n)
    graph = _scale_graph(stream, kernel, y, x, a, n)
    exe = graph.instantiate()
    with pytest.raises(RuntimeError, match="still replayed by 1 executable graph: close it first"):
        module.close()
    y.poison(stream=stream)
    exe.launch(stream)  # the refused close changed nothing
    np.testing.assert_array_equal(y.to_numpy(), np.float32(a) * src)
    exe.close()
    module.close()
    for use in (lambda: kernel.launch(-(-n // 128), 128, y, x, a, n, stream=stream),
                lambda: kernel.launch(-(-n // 128), 128, y, x, a, n, stream=stream, dependent=True),
                lambda: bound.launch(stream)):
        with pytest.raises(RuntimeError, match="scale_by: its module is closed"):
            use()
    with pytest.raises(RuntimeError, match="the graph launches scale_by, a kernel of a closed module"):
        graph.instantiate()
    with pytest.raises(RuntimeError, match="the module scale_by.cu is closed"):
        module.kernel("scale_by", "ptr ptr f32 i32")
    module.close()  # a second close does nothing
    graph.close()
    stream.synchronize()


SPIN_SOURCE = r'''
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) { }
}'''


def test_view_of_a_torch_tensor(device, rng):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(rng.standard_normal((64, 33)).astype(np.float32)).cuda()
    buf = DeviceBuffer.from_cuda_array(t)
    view = buf.view(np.float32, (33,), 4 * 33 * 5)  # row 5; raised before: bool(t) of a tensor
    np.testing.assert_array_equal(view.to_numpy(), t[5].cpu().numpy())
    with pytest.raises(ValueError, match="empty"):
        DeviceBuffer.from_cuda_array(torch.empty(0, device="cuda"))


@pytest.mark.parametrize("wait_on", ["stream", "host"])
def test_view_waits_for_the_producer_stream(device, rng, wait_on):
    """__cuda_array_interface__ v3 names the stream still writing the data: the view waits for it."""
    n = 1 << 16
    producer, consumer = Stream(), Stream()
    data = DeviceBuffer(n)
    data.poison(stream=producer)
    producer.synchronize()
    spin = load_source(SPIN_SOURCE, "spin.cu").kernel("spin", "i64")
    fill = builtin_module("elementwise.cu").kernel("fill_f32", "ptr, f32, i32")
    value = float(rng.uniform(1, 2))
    spin.launch(1, 1, 200_000_000, stream=producer)  # ~0.1 s of the producer's time
    fill.launch(64, 256, data, value, n, stream=producer)

    class Foreign:  # what a torch or CuPy array on `producer` would expose
        __cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (data.ptr, False),
                                    "version": 3, "strides": None, "stream": int(producer.handle)}

    view = DeviceBuffer.from_cuda_array(Foreign(), stream=consumer if wait_on == "stream" else None)
    if wait_on == "host":
        assert producer.query(), "without a consumer stream the host waits for the producer"
    out = DeviceBuffer(n)
    builtin_module("elementwise.cu").kernel("scale_f32", "ptr, ptr, f32, i32").launch(
        64, 256, out, view, 1.0, n, stream=consumer)
    consumer.synchronize()
    np.testing.assert_array_equal(out.to_numpy(), np.full(n, value, np.float32))
    Foreign.__cuda_array_interface__ = {**Foreign.__cuda_array_interface__, "stream": 0}
    with pytest.raises(ValueError, match="forbids"):
        DeviceBuffer.from_cuda_array(Foreign())


@pytest.mark.parametrize("kind", [MappedBuffer, PinnedBuffer])
def test_dropped_host_buffers_return_their_pinned_memory(device, kind):
    """1000 buffers dropped without close(): the pinned total and the process size come back."""
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    for _ in range(3):
        kind(1 << 20, np.uint8)
    count0, bytes0 = pinned_total()
    rss0 = rss()
    for _ in range(1000):
        buf = kind(1 << 20, np.uint8)
        buf.view()[:] = 7  # touch every page
        del buf  # no gc.collect(): reference counting alone must free it
    assert pinned_total() == (count0, bytes0)
    assert rss() - rss0 < 256 << 20, f"the process grew by {(rss() - rss0) >> 20} MiB"
    survivor = kind(1 << 20, np.uint8)
    view = survivor.view()
    del survivor  # a live numpy view keeps the memory valid
    view[:] = 3
    assert view.sum() == 3 * (1 << 20) and pinned_total()[0] == count0 + 1
    del view
    assert pinned_total() == (count0, bytes0)


def test_zeros_and_zeroed_arena_slices(device, stream, rng):
    z = DeviceBuffer.zeros((37, 3), np.float64)
    assert z.to_numpy().shape == (37, 3) and not z.to_numpy().any()
    arena = Arena(1 << 12, zeroed_bytes=1024)
    a = arena.zeroed(100)
    b = arena.zeroed(50)
    assert a.ptr % 256 == 0 and b.ptr >= a.ptr + 400
    assert not a.to_numpy().any() and not b.to_numpy().any()
    arena.reset()
    assert arena.zeroed(100).ptr == a.ptr
    big = arena.zeroed(2000)  # beyond the zeroed slab: a tracked, still-zero fallback
    assert not big.to_numpy().any() and arena.fallback_count == 1
    arena.close()


def test_error_flags_are_never_lost(device, stream):
    flags = ErrorFlags(["first", "second"])
    raise_src = r'''
    #include "common.cuh"
    extern "C" __global__ void raise_flag(unsigned int* counts, unsigned int* published, int k, int times) {
        if (dt_thread_index() < times) dt_raise(counts, published, k);
    }'''
    kern = load_source(raise_src, "raise_flag.cu").kernel("raise_flag", "ptr ptr i32 i32")
    assert flags.raised() == []
    kern.launch(4, 128, flags.counts, flags.published, 1, 300, stream=stream)
    stream.synchronize()
    assert flags.raised() == ["second"]
    assert flags.raised() == []  # reported once
    kern.launch(1, 32, flags.counts, flags.published, 0, 1, stream=stream)
    kern.launch(1, 32, flags.counts, flags.published, 1, 1, stream=stream)
    stream.synchronize()
    assert flags.raised() == ["first", "second"]
    assert flags.counts.to_numpy().tolist() == [1, 301]


@pytest.mark.provokes_driver_errors
def test_fixed_block_kernels_and_parameter_check(device, stream):
    kern = builtin_module("optim.cu").kernel("grad_norm_clip", "ptr i64 ptr ptr f32 ptr ptr ptr ptr i32 ptr ptr",
                                             fixed_block=True)
    assert kern.block == 256
    assert kern.signature_checked, "the driver should confirm kernel signatures"
    with pytest.raises(ValueError, match="exactly"):
        kern.launch(2, 128, 0, 0, 0, 0, 1.0, 0, 0, 0, 0, 1, 0, 0, stream=stream)
    with pytest.raises(TypeError, match="takes 12 parameters"):
        builtin_module("optim.cu").kernel("grad_norm_clip", "ptr i64 ptr ptr f32 ptr ptr ptr ptr i32 ptr ptr i32")
    with pytest.raises(TypeError, match="parameter 1 is 8 bytes, declared i32"):
        builtin_module("optim.cu").kernel("grad_norm_clip", "ptr i32 ptr ptr f32 ptr ptr ptr ptr i32 ptr ptr")


def _doctor(*args, env_extra=None, code=None):
    env = {**os.environ, "PYTHONPATH": ROOT, **(env_extra or {})}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "drvtrain", "doctor", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_doctor_bad_device_is_one_line_exit_2(device):
    out = _doctor("--device", "99")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "--device 99" in out.stderr


def test_doctor_compile_error_is_one_line_exit_1(device, tmp_path):
    broken = tmp_path / "broken.cu"
    broken.write_text('extern "C" __global__ void broken() { this is not C++; }\n')
    code = ("import sys, pathlib, drvtrain.compiler as c, drvtrain.cli as cli\n"
            f"c.kernel_files = lambda: [pathlib.Path({str(broken)!r})]\n"
            "sys.exit(cli.main(['doctor']))\n")
    out = _doctor(code=code, env_extra={"DRVTRAIN_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "broken.cu" in out.stderr



class _Made:
    """Every device buffer, pinned allocation, stream and event made while installed, and
    every module a DeviceEnv loads (its own, not a shared builtin one)."""

    def __init__(self, monkeypatch):
        from drvtrain import Event
        from drvtrain.memory import _HostAllocation
        from drvtrain.rl import env as env_module
        self.things = []
        for cls in (DeviceBuffer, _HostAllocation, Stream, Event):
            original = cls.__init__

            def spy(obj, *args, _original=original, **kwargs):
                _original(obj, *args, **kwargs)
                self.things.append(obj)

            monkeypatch.setattr(cls, "__init__", spy)
        original_load = env_module.load_module

        def load(*args, **kwargs):
            module = original_load(*args, **kwargs)
            self.things.append(module)
            return module

        monkeypatch.setattr(env_module, "load_module", load)

    def still_open(self) -> list:
        return [t for t in self.things if t._finalizer is not None and t._finalizer.alive]


def _fail_on_call(monkeypatch, where: str, call: int) -> None:
    """``where`` ("module:name", or "module:Class.name" for a class's method) raises MemoryError
    on its ``call``-th call; earlier calls go through."""
    import importlib
    module_name, name = where.split(":")
    module = importlib.import_module(module_name)
    owner_name, _, name = name.rpartition(".")
    if owner_name:
        module = getattr(module, owner_name)
    original, calls = getattr(module, name), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise MemoryError(f"{name} call {call} refused by the test")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)


def _check_gives_back(made, build, at_least: int = 5) -> None:
    gc.disable()  # nothing may be left for the collector to free
    try:
        with pytest.raises(MemoryError, match="refused by the test"):
            build()
        assert len(made.things) >= at_least, f"the failure came too early to test anything: {made.things}"
        assert made.still_open() == []
    finally:
        gc.enable()


@pytest.mark.parametrize("where, call", [
    ("drvtrain.rl.dqn:ReplayBuffer", 1),      # after the parameters, the metrics ring and the optimizer
    ("drvtrain.rl.replay:builtin_module", 1),  # inside the replay, after its tree and its arrays
    ("drvtrain.rl.dqn:ErrorFlags", 1),        # after the spectral buffers
    ("drvtrain.rl.dqn:Arena", 1),
    ("drvtrain.rl.dqn:Stream", 2),            # one stream of the two made
    ("drvtrain.rl.dqn:_Captured", 1),         # its last statement: everything made
    ("drvtrain.nn.metrics:Event", 5),         # inside the metrics ring, four events made
])
def test_a_dqn_step_that_fails_to_build_gives_back_what_it_made(device, monkeypatch, where, call):
    """DQNStep.__init__ stopped part way (a refused allocation) closes every buffer, pinned
    allocation, stream and event it had made before the error goes on."""
    from drvtrain.rl.dqn import DQNConfig, DQNStep
    made = _Made(monkeypatch)
    _fail_on_call(monkeypatch, where, call)
    _check_gives_back(made, lambda: DQNStep(DQNConfig.small(capacity=4096, seed=1)))


@pytest.mark.parametrize("where, call", [
    ("drvtrain.rl.trainer:_Actor", 2),   # the evaluation actor, after the learner and the training actor
    ("drvtrain.rl.trainer:DQNStep", 1),  # after the stream and the probe env
    ("drvtrain.rl.trainer:Arena", 1),    # inside the training actor, after its envs and rings
])
def test_a_trainer_that_fails_to_build_gives_back_what_it_made(device, monkeypatch, where, call):
    """Trainer.__init__ stopped part way closes the learner, the training actor and its
    environments, the gate and the stream it had made."""
    from drvtrain.rl.trainer import TrainConfig, Trainer
    made = _Made(monkeypatch)
    _fail_on_call(monkeypatch, where, call)
    config = TrainConfig(env="cartpole", n_envs=4, total_steps=4000, learning_starts=400, train_every=4,
                         eval_episodes=8, unroll=10, dqn=dict(capacity=4096), seed=3)
    _check_gives_back(made, lambda: Trainer(config))


@pytest.mark.parametrize("call", [1, 5, 8])  # the first buffer, one in the middle, the last
def test_a_device_env_that_fails_to_build_gives_back_its_module_and_buffers(device, monkeypatch, call):
    """DeviceEnv.__init__ stopped part way (a refused buffer) unloads the module it loaded and
    frees the buffers it had made before the error goes on."""
    from drvtrain.kernel import Module
    from drvtrain.rl.env import make_env
    made = _Made(monkeypatch)
    _fail_on_call(monkeypatch, "drvtrain.memory:DeviceBuffer.zeros", call)
    _check_gives_back(made, lambda: make_env("cartpole", 64, seed=1), at_least=call)
    modules = [t for t in made.things if isinstance(t, Module)]
    assert len(modules) == 1 and modules[0].handle is None
    assert len(made.things) == call  # the module and the call - 1 buffers made before the refusal


def test_an_arena_that_fails_to_build_gives_back_its_slab(device, monkeypatch):
    """Arena's second slab refused: the first is freed before the error goes on."""
    made = _Made(monkeypatch)

    def refuse(*args, **kwargs):
        raise MemoryError("zeros refused by the test")

    monkeypatch.setattr(DeviceBuffer, "zeros", refuse)
    with pytest.raises(MemoryError, match="refused by the test"):
        Arena(1 << 20)
    assert len(made.things) == 1 and made.still_open() == []


@pytest.mark.parametrize("where, call, at_least", [
    ("drvtrain.nn.regression:Stream", 2, 3),   # the second side stream, after the parameters and the first
    ("drvtrain.nn.regression:Metrics", 1, 5),  # after the parameters, the two streams and the step's buffers
    ("drvtrain.nn.regression:AdamW", 1, 5),    # after the metrics ring
    ("drvtrain.nn.optim:FlatBuffer", 2, 5),    # inside the optimizer, its m made
    ("drvtrain.nn.regression:Arena", 1, 5),    # its last statement: everything made
])
def test_a_regression_step_that_fails_to_build_gives_back_what_it_made(device, monkeypatch, where, call, at_least):
    """RegressionStep.__init__ stopped part way closes every buffer, pinned allocation,
    stream and event it had made before the error goes on."""
    from drvtrain.nn import ParamLayout, RegressionStep
    made = _Made(monkeypatch)
    _fail_on_call(monkeypatch, where, call)
    _check_gives_back(made, lambda: RegressionStep(ParamLayout.from_widths([4, 64, 64, 3]), 64, weight_streams=2),
                      at_least=at_least)


def test_a_regression_step_gives_back_everything_on_close_and_at_the_end_of_with(device, monkeypatch):
    """A whole RegressionStep (two side streams) closed by its ``with`` block leaves nothing
    open, and its buffers are closed (a copy of one refused); a second close is harmless."""
    from drvtrain.nn import ParamLayout, RegressionStep
    made = _Made(monkeypatch)
    with RegressionStep(ParamLayout.from_widths([4, 64, 64, 3]), 64, weight_streams=2) as step:
        assert len(step.weight_streams) == 2 and len(made.things) >= 10
    assert made.still_open() == []
    assert step.x.closed and step.params.buffer.closed and step.optimizer.m.buffer.closed
    with pytest.raises(RuntimeError, match="closed"):
        step.x.to_numpy()
    step.close()


@pytest.mark.parametrize("where, call, streams", [
    ("drvtrain.demo:Stream", 3, 2),       # its third stream
    ("drvtrain.demo:Arena", 1, 3),        # its arena, after the streams
    ("drvtrain.demo:DeviceBuffer", 1, 3),  # its output buffer, after the arena
])
def test_a_fork_join_demo_that_fails_to_build_gives_back_what_it_made(device, monkeypatch, where, call, streams):
    """ForkJoinDemo stopped part way: the streams and the arena it had made are closed first."""
    from drvtrain.demo import ForkJoinDemo
    made = _Made(monkeypatch)
    _fail_on_call(monkeypatch, where, call)
    _check_gives_back(made, lambda: ForkJoinDemo(1 << 10), at_least=streams)
    assert len([t for t in made.things if isinstance(t, Stream)]) == streams


class _Boom(Exception):
    pass


def _build_dqn_step():
    from drvtrain.rl import DQNConfig, DQNStep
    stream = Stream()
    step = DQNStep(DQNConfig.small(seed=3))
    try:
        step.fill_random(1, stream=stream)
        with step.capture(stream=stream) as exe, step.graph:  # graphs close at their block's end too
            exe.launch(stream)
            stream.synchronize()
        assert exe.closed and step.graph.closed
    finally:
        stream.close()
    return step


def _build_replay():
    """A replay given host arrays: the uploads it stages are its own to free."""
    from drvtrain.rl import ReplayBuffer
    rng = np.random.default_rng()
    replay = ReplayBuffer(1 << 10, 4, seed=1)
    with Stream() as stream:
        n = 100
        replay.insert(rng.standard_normal((n, 4), dtype=np.float32), rng.integers(0, 2, n, dtype=np.int32),
                      rng.standard_normal(n, dtype=np.float32), rng.standard_normal((n, 4), dtype=np.float32),
                      (rng.random(n) < 0.1).astype(np.float32), stream=stream)
        replay.tree.update(rng.integers(0, n, 32).astype(np.int32), rng.uniform(0.1, 2.0, 32).astype(np.float32),
                           stream=stream)
    return replay


def _build_dqn_step_q_values():
    """q_values stages the observations and an arena of its own."""
    from drvtrain.rl import DQNConfig, DQNStep
    step = DQNStep(DQNConfig.small(seed=4))
    with Stream() as stream:
        q = step.q_values(np.random.default_rng().standard_normal((5, step.config.obs_dim), dtype=np.float32),
                          stream=stream)
    assert q.shape == (5, step.config.n_actions) and np.isfinite(q).all()
    return step


@pytest.mark.parametrize("build", [
    lambda: DeviceBuffer.from_numpy(np.random.default_rng().standard_normal(64).astype(np.float32)),
    lambda: Arena(1 << 16),
    lambda: MappedBuffer(64, np.float32),
    lambda: PinnedBuffer(64, np.float32),
    lambda: Stream(),
    lambda: __import__("drvtrain").Event(),
    lambda: ErrorFlags(["a", "b"]),
    lambda: __import__("drvtrain.demo", fromlist=["ForkJoinDemo"]).ForkJoinDemo(1 << 10),
    _build_replay,
    _build_dqn_step,
    _build_dqn_step_q_values,
    lambda: __import__("drvtrain.rl.env", fromlist=["make_env"]).make_env("cartpole", 64, seed=2),
], ids=["DeviceBuffer", "Arena", "MappedBuffer", "PinnedBuffer", "Stream", "Event", "ErrorFlags", "ForkJoinDemo",
        "ReplayBuffer", "DQNStep", "DQNStep-q_values", "DeviceEnv"])
def test_an_owner_gives_back_everything_when_its_with_block_raises(device, monkeypatch, build):
    """Each owner of device resources closes at the end of its ``with`` block, also when the
    block raises (the error goes on); nothing it made is left open, and a second close is
    harmless."""
    made = _Made(monkeypatch)
    gc.disable()  # nothing may be left for the collector to free
    try:
        with pytest.raises(_Boom):
            with build() as owner:
                assert made.things, "the owner made nothing the test can follow"
                raise _Boom
        assert made.still_open() == []
        owner.close()
    finally:
        gc.enable()


def test_a_graph_and_its_executable_close_at_the_end_of_with(device):
    stream = Stream()
    try:
        iota = builtin_module("elementwise.cu").kernel("iota_f32", "ptr, f32, f32, i32")
        with DeviceBuffer((256,)) as out:
            out.copy_from_numpy(np.full(256, np.nan, np.float32))
            with capture(stream) as graph:
                iota.launch(1, 256, out, 1.0, 2.0, 256, stream=stream)
            with graph:
                with graph.instantiate() as exe:
                    exe.launch(stream)
                    stream.synchronize()
                    assert not exe.closed
                assert exe.closed and not graph.closed
            assert graph.closed
            np.testing.assert_array_equal(out.to_numpy(), 1.0 + 2.0 * np.arange(256, dtype=np.float32))
        assert out.closed
    finally:
        stream.close()
