"""An object whose __init__ stops part way gives back what it had made (CPU: the mechanism
and every owner's close() on a half-built object; the GPU half is in test_hardening_gpu.py)."""
import warnings

import pytest

from drvtrain.flags import ErrorFlags
from drvtrain.demo import ForkJoinDemo
from drvtrain.memory import Arena, close_attributes, closes_on_failure
from drvtrain.nn.metrics import Metrics
from drvtrain.nn.optim import AdamW
from drvtrain.nn.regression import RegressionStep
from drvtrain.rl.dqn import DQNStep
from drvtrain.rl.env import DeviceEnv
from drvtrain.rl.replay import ReplayBuffer
from drvtrain.rl.sumtree import SumTree
from drvtrain.rl.trainer import Trainer, _Actor


class Resource:
    def __init__(self, name, log, fail_close=False):
        self.name, self.log, self.fail_close = name, log, fail_close

    def close(self):
        self.log.append(self.name)
        if self.fail_close:
            raise RuntimeError(f"{self.name} would not close")


class Owner:
    @closes_on_failure
    def __init__(self, log, fail_after, fail_close=()):
        for name in ("a", "b", "c"):
            if name == fail_after:
                raise MemoryError(f"no room for {name}")
            setattr(self, name, Resource(name, log, name in fail_close))
        self.done = True

    def close(self):
        close_attributes(self, "a", "b", "c")


@pytest.mark.parametrize("fail_at, closed", [("a", []), ("b", ["a"]), ("c", ["a", "b"])])
def test_a_failed_init_closes_what_it_made_and_raises_its_error(fail_at, closed):
    log = []
    with pytest.raises(MemoryError, match=f"no room for {fail_at}"):
        Owner(log, fail_at)
    assert log == closed


def test_a_finished_init_closes_nothing():
    log = []
    owner = Owner(log, None)
    assert owner.done and log == []
    owner.close()
    assert log == ["a", "b", "c"]


def test_a_close_that_fails_during_cleanup_is_a_note_on_the_first_error():
    log = []
    with pytest.raises(MemoryError, match="no room for c") as info:
        Owner(log, "c", fail_close=("a",))
    assert log == ["a", "b"]  # b still closed after a's failure
    if hasattr(BaseException, "add_note"):  # Python 3.11 and later
        assert any("closing the partly made Owner failed too" in note and "a would not close" in note
                   for note in info.value.__notes__)


def test_a_second_failure_is_a_note_or_before_python_3_11_a_warning():
    """note_on: a note where the error takes notes; where it does not (Python 3.10's
    exceptions, stood in for here by an object without add_note), a RuntimeWarning
    naming both failures, not nothing."""
    from drvtrain.driver import note_on
    if hasattr(BaseException, "add_note"):  # Python 3.11 and later
        error = ValueError("the first failure")
        note_on(error, "the second failure")
        assert error.__notes__ == ["the second failure"]

    class WithoutNotes:
        def __repr__(self):
            return "WithoutNotes('the first failure')"

    said = r"the second failure \(while WithoutNotes\('the first failure'\) goes on\)"
    with pytest.warns(RuntimeWarning, match=said):
        note_on(WithoutNotes(), "the second failure")
    with warnings.catch_warnings():  # made an error: dropped, so the first error still goes on
        warnings.simplefilter("error")
        note_on(WithoutNotes(), "the second failure")


def test_close_attributes_tries_every_one_and_raises_the_first_error():
    log = []

    class Holder:
        pass

    h = Holder()
    h.x, h.y, h.z, h.none = Resource("x", log, True), Resource("y", log, True), Resource("z", log), None
    with pytest.raises(RuntimeError, match="x would not close"):
        close_attributes(h, "x", "missing", "none", "y", "z")
    assert log == ["x", "y", "z"]


@pytest.mark.parametrize("cls", [Arena, ErrorFlags, Metrics, AdamW, SumTree, ReplayBuffer, DeviceEnv, DQNStep,
                                 _Actor, Trainer, RegressionStep, ForkJoinDemo])
def test_close_of_an_object_whose_init_made_nothing(cls):
    """close() on an object with none of its attributes set (its __init__ failed at once)
    returns quietly, as closes_on_failure needs it to."""
    cls.close(object.__new__(cls))


@pytest.mark.parametrize("cls", [Arena, ErrorFlags, Metrics, AdamW, SumTree, ReplayBuffer, DeviceEnv, DQNStep,
                                 _Actor, Trainer, RegressionStep, ForkJoinDemo])
def test_every_owner_closes_on_failure(cls):
    assert cls.__init__.__code__ is closes_on_failure(object).__code__, f"{cls.__name__}.__init__ is not decorated"


def test_a_flat_buffer_refuses_a_host_array_of_the_wrong_size_before_it_allocates(monkeypatch):
    """FlatBuffer checks the host array's shape first: a refused one allocates nothing (no
    device is needed to see the ValueError)."""
    import numpy as np

    from drvtrain.nn import layout as layout_module

    class NoAllocation:
        @staticmethod
        def from_numpy(array):
            raise AssertionError("allocated before the shape was checked")

    monkeypatch.setattr(layout_module, "DeviceBuffer", NoAllocation)
    layout = layout_module.ParamLayout.from_widths([4, 8, 2])
    with pytest.raises(ValueError, match=rf"the layout needs \({layout.size},\)"):
        layout_module.FlatBuffer(layout, np.zeros(layout.size + 1, np.float32))


def test_zeros_while_capturing_is_refused_before_it_allocates(monkeypatch):
    """DeviceBuffer.zeros synchronises: while a stream is capturing it raises CaptureError
    before any allocation (no device is needed to see it)."""
    from drvtrain import driver
    from drvtrain.memory import DeviceBuffer

    monkeypatch.setattr(driver._tls, "captures", [object()], raising=False)
    monkeypatch.setattr(DeviceBuffer, "__init__", lambda self, *a, **k: pytest.fail("allocated first"))
    with pytest.raises(driver.CaptureError, match="DeviceBuffer.zeros"):
        DeviceBuffer.zeros(16)


@pytest.mark.parametrize("how, refused_call", [("from_numpy", 1), ("zeros", 1), ("zeros", 2)],
                         ids=["from_numpy", "zeros-memset", "zeros-synchronize"])
def test_a_buffer_whose_fill_fails_is_freed_before_the_error_goes_on(monkeypatch, how, refused_call):
    """from_numpy's copy or zeros' memset refused: the new buffer is closed, then the error
    goes on (the allocation itself stands in for the device here)."""
    import numpy as np

    from drvtrain import memory
    from drvtrain.memory import DeviceBuffer

    closed = []

    def fake_init(self, shape, dtype=np.float32):
        self.shape, self.dtype, self.ptr = (int(shape),) if np.isscalar(shape) else tuple(shape), np.dtype(dtype), 64

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[0] if args else None)
        if len(calls) == refused_call:
            raise MemoryError("fill refused by the test")

    monkeypatch.setattr(DeviceBuffer, "__init__", fake_init)
    monkeypatch.setattr(DeviceBuffer, "close", lambda self: closed.append(self))
    monkeypatch.setattr(DeviceBuffer, "nbytes", property(lambda self: 4 * int(np.prod(self.shape))), raising=False)
    if how == "from_numpy":
        monkeypatch.setattr(DeviceBuffer, "copy_from_numpy", refuse)
        build = lambda: DeviceBuffer.from_numpy(np.arange(6, dtype=np.float32))  # noqa: E731
    else:
        monkeypatch.setattr(memory, "check", refuse)
        build = lambda: DeviceBuffer.zeros(6)  # noqa: E731
    with pytest.raises(MemoryError, match="fill refused"):
        build()
    assert len(closed) == 1 and closed[0].shape == (6,) and len(calls) == refused_call


def _owners():
    """Every class of drvtrain that defines ``close()``."""
    import importlib
    import inspect
    import pkgutil

    import drvtrain
    found = {}
    for info in pkgutil.walk_packages(drvtrain.__path__, "drvtrain."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and "close" in vars(cls):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


# Device.close releases the primary context that every other owner lives in: a process
# closes it once, at its end, never at the end of a block. MetricsWriter owns a CSV file
# only (a context manager of its own).
NOT_SCOPED = {"drvtrain.driver.Device", "drvtrain.rl.run.MetricsWriter"}


def test_every_owner_of_resources_derives_from_closable():
    from drvtrain import Closable
    owners = _owners()
    assert len(owners) >= 20 and "drvtrain.rl.dqn.DQNStep" in owners and "drvtrain.memory.DeviceBuffer" in owners
    assert NOT_SCOPED <= set(owners)
    missing = [name for name, cls in owners.items() if name not in NOT_SCOPED and not issubclass(cls, Closable)]
    assert missing == []


class _Refuses(__import__("drvtrain").Closable):
    def __init__(self):
        self.closes = 0

    def close(self):
        self.closes += 1
        raise RuntimeError("close refused by the test")


def test_a_failing_close_is_a_note_on_the_blocks_error_and_raised_when_the_block_ended_well():
    owner = _Refuses()
    with pytest.raises(KeyError, match="from the block") as info:
        with owner:
            raise KeyError("from the block")
    assert owner.closes == 1
    assert any("close refused by the test" in note for note in getattr(info.value, "__notes__", []))
    with pytest.raises(RuntimeError, match="close refused"):
        with owner:
            pass
    assert owner.closes == 2


@pytest.mark.parametrize("cls", [DQNStep, RegressionStep, ForkJoinDemo, ReplayBuffer, SumTree, Trainer, AdamW,
                                 Metrics, ErrorFlags, Arena, DeviceEnv], ids=lambda c: c.__name__)
def test_with_closes_once_and_lets_the_error_go_on(cls, monkeypatch):
    closes = []
    monkeypatch.setattr(cls, "close", lambda self: closes.append(self))
    owner = cls.__new__(cls)
    with owner as entered:
        assert entered is owner and closes == []
    assert closes == [owner]
    with pytest.raises(KeyError, match="from the block"):
        with owner:
            raise KeyError("from the block")
    assert closes == [owner, owner]
