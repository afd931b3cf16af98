"""Test configuration: the ``gpu`` marker and fresh random inputs.

Tests marked ``gpu`` skip, with the reason, when no CUDA driver or GPU is
present. Set ``DRVTRAIN_REQUIRE_GPU=1`` to make that a collection error
instead, so a GPU run can never pass by skipping.

Every test that takes ``rng`` draws a fresh seed and prints it (pytest shows it
when the test fails); ``DRVTRAIN_TEST_SEED=<seed>`` gives every such test that
seed, to run a failure again.

A test whose setup, call or teardown runs past ``DRVTRAIN_TEST_TIMEOUT`` seconds
(default 1800 each; 0 for no limit) ends the whole run: every thread's stack goes
to stderr (the test's frame among them) and pytest exits with status 1; the test's
captured output is lost (run with ``-s`` to see it). A kernel that never ends would
otherwise hold the run, and the machine's GPU, until something outside killed it,
with nothing said about which test it was. Unless it is 0 it replaces pytest's own
``faulthandler_timeout``, whether set or not (one such timer exists in a process).
"""
import faulthandler
import os
import secrets
import sys

import numpy as np
import pytest

from drvtrain import NoDeviceError, get_device

_gpu_reason = None
_gpu_probed = False


def gpu_unavailable_reason():
    """None when a GPU is usable, else why not."""
    global _gpu_reason, _gpu_probed
    if not _gpu_probed:
        _gpu_probed = True
        try:
            get_device()
        except NoDeviceError as exc:
            _gpu_reason = str(exc)
    return _gpu_reason


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("DRVTRAIN_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"DRVTRAIN_REQUIRE_GPU=1 but {reason}")
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


def fixed_seed():
    """DRVTRAIN_TEST_SEED as a seed, or None when it is not set."""
    text = os.environ.get("DRVTRAIN_TEST_SEED")
    if text is None:
        return None
    try:
        seed = int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        raise pytest.UsageError(f"DRVTRAIN_TEST_SEED must be a non-negative integer (decimal, or hex with 0x), "
                                f"got {text!r}")
    return seed


DEFAULT_TIME_LIMIT_S = 1800.0


def time_limit():
    """DRVTRAIN_TEST_TIMEOUT in seconds (DEFAULT_TIME_LIMIT_S when it is not set; 0: none)."""
    text = os.environ.get("DRVTRAIN_TEST_TIMEOUT")
    if text is None:
        return DEFAULT_TIME_LIMIT_S
    try:
        limit = float(text)
    except ValueError:
        limit = -1.0
    if not 0 <= limit < float("inf"):
        raise pytest.UsageError(f"DRVTRAIN_TEST_TIMEOUT must be a number of seconds >= 0 (0: no limit), got {text!r}")
    return limit


_stderr_copy = None  # the run's own stderr, for the time limit's report (pytest captures fd 2 in tests)


def pytest_configure(config):
    global _stderr_copy
    fixed_seed()  # a bad DRVTRAIN_TEST_SEED stops the run before any test
    if time_limit() > 0:  # and so does a bad DRVTRAIN_TEST_TIMEOUT
        # Here, after the capture of the conftests' import and before the tests', fd 2 is the run's own.
        _stderr_copy = os.dup((sys.__stderr__ or sys.stderr).fileno())


def pytest_unconfigure(config):
    global _stderr_copy
    if _stderr_copy is not None:
        os.close(_stderr_copy)
        _stderr_copy = None


def _time_limited():
    """The time limit over one phase of a test (a hook wrapper's body). Each phase arms it
    again: pytest's faulthandler plugin cancels the process's one timer when a test
    fails (before its teardown) and arms its own around the whole test where
    faulthandler_timeout is set. faulthandler's own thread keeps the time, so it fires
    even while the test waits inside a driver call."""
    if _stderr_copy is not None:
        faulthandler.dump_traceback_later(time_limit(), exit=True, file=_stderr_copy)
    try:
        yield
    finally:
        if _stderr_copy is not None:
            faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _time_limited()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _time_limited()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield from _time_limited()


@pytest.fixture
def rng():
    """A generator with a fresh seed per test (or DRVTRAIN_TEST_SEED's); the seed is printed."""
    seed = fixed_seed()
    if seed is None:
        seed = secrets.randbits(63)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def device():
    return get_device()


@pytest.fixture
def stream(device):
    from drvtrain import Stream
    s = Stream()
    yield s
    s.synchronize()
    s.close()


@pytest.fixture
def elementwise(device):
    from drvtrain import builtin_module
    mod = builtin_module("elementwise.cu")
    return {
        "fill": mod.kernel("fill_f32", "ptr, f32, i32"),
        "iota": mod.kernel("iota_f32", "ptr, f32, f32, i32"),
        "scale": mod.kernel("scale_f32", "ptr, ptr, f32, i32"),
        "axpy": mod.kernel("axpy_f32", "ptr, ptr, f32, i32"),
        "add": mod.kernel("add_f32", "ptr, ptr, ptr, i32"),
    }


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty kernel cache, private to the test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("DRVTRAIN_CACHE_DIR", str(d))
    return d
