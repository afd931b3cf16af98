"""An object whose __init__ stops part way gives back what it had made (CPU: the mechanism
and every owner's close() on a half-built object; the GPU half is in test_hardening_gpu.py)."""
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
