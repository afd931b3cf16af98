"""The test configuration itself: DRVTRAIN_TEST_SEED gives the ``rng`` fixture its seed, and
DRVTRAIN_TEST_TIMEOUT ends a run whose test outlives it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = str(TESTS.parent)
# A test of the float64 references that takes ``rng`` and needs no GPU.
ONE_TEST = "test_per_reference.py::test_stratified_masses_fall_in_their_strata"


def child_env(*drop, **values):
    """This environment for a child pytest, less `drop`, with `values`; the child imports
    this checkout's drvtrain, installed or not, as the other tests' children do."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    return env | values


def run_pytest(seed):
    # The child runs in tests/: its conftest is the one under test.
    env = child_env("DRVTRAIN_TEST_SEED")
    if seed is not None:
        env["DRVTRAIN_TEST_SEED"] = seed
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", ONE_TEST],
                          capture_output=True, text=True, env=env, cwd=TESTS, timeout=120)


@pytest.mark.parametrize("text, seed", [("42", 42), ("0x2a", 42), ("010", 10), ("8833482274894272575",
                                                                             8833482274894272575)])
def test_the_seed_reaches_the_rng_fixture(text, seed):
    out = run_pytest(text)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"rng seed {seed}\n" in out.stdout


def test_without_it_every_run_draws_a_fresh_seed():
    seeds = set()
    for _ in range(2):
        out = run_pytest(None)
        assert out.returncode == 0, out.stdout + out.stderr
        seeds |= {line for line in out.stdout.splitlines() if line.startswith("rng seed ")}
    assert len(seeds) == 2


@pytest.mark.parametrize("text", ["abc", "-5", "", "1.5"])
def test_a_bad_seed_stops_the_run_before_any_test(text):
    out = run_pytest(text)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR
    assert "DRVTRAIN_TEST_SEED must be a non-negative integer (decimal, or hex with 0x)" in out.stderr
    assert "rng seed" not in out.stdout


TIMED = """import time


def test_first():
    time.sleep(2)


def test_second():
    time.sleep(2)


def test_stuck():
    time.sleep(120)
"""

FAILS_THEN_HANGS = """import time

import pytest


@pytest.fixture
def stuck_teardown():
    yield
    time.sleep(120)


def test_fails(stuck_teardown):
    assert False
"""


def run_timed(tmp_path, limit, source=TIMED, *options):
    """pytest -v over a copy of this conftest and `source` (by default two tests of 2 s,
    then one that would sleep for 120), with DRVTRAIN_TEST_TIMEOUT = limit."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_timed.py").write_text(source)
    env = child_env("PYTEST_ADDOPTS", DRVTRAIN_TEST_TIMEOUT=limit)
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *options, "test_timed.py"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=100)


def test_a_test_past_the_time_limit_ends_the_run_and_names_itself(tmp_path):
    out = run_timed(tmp_path, "3")
    # Each test has the limit to itself: the second ends 4 s into the run, past a
    # limit that was not set again for it.
    assert "test_timed.py::test_first PASSED" in out.stdout, out.stdout + out.stderr
    assert "test_timed.py::test_second PASSED" in out.stdout, out.stdout + out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Timeout (0:00:03)!" in out.stderr
    assert 'test_timed.py", line 13 in test_stuck' in out.stderr


@pytest.mark.parametrize("options", [(), ("-o", "faulthandler_timeout=60")], ids=["plain", "faulthandler_timeout-set"])
def test_a_failed_test_stuck_in_its_teardown_ends_the_run(tmp_path, options):
    """pytest cancels the process's timer when a test fails, and its own
    faulthandler_timeout arms another: the teardown is still limited."""
    out = run_timed(tmp_path, "3", FAILS_THEN_HANGS, *options)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Timeout (0:00:03)!" in out.stderr
    assert 'test_timed.py", line 9 in stuck_teardown' in out.stderr


@pytest.mark.parametrize("text", ["abc", "-1", "", "inf", "nan"])
def test_a_bad_time_limit_stops_the_run_before_any_test(tmp_path, text):
    out = run_timed(tmp_path, text)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR
    assert "DRVTRAIN_TEST_TIMEOUT must be a number of seconds >= 0 (0: no limit)" in out.stderr
    assert "PASSED" not in out.stdout
