"""Error translation and behaviour without a GPU (runs everywhere)."""
import os
import subprocess
import sys

import pytest
from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

import drvtrain
from drvtrain.compiler import CompileError
from drvtrain.driver import CaptureError, DriverError, NoDeviceError, active_captures, check, guard_sync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS_DIR = os.path.join(ROOT, "tools")
# Every command-line tool; _common.py is their shared preamble and torch_dqn.py a
# module the benchmarks import.
TOOLS = sorted(name for name in os.listdir(TOOLS_DIR)
               if name.endswith(".py") and name not in ("_common.py", "torch_dqn.py"))
# Subprocesses see this checkout's drvtrain even when it is not installed.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
NO_GPU_ENV = {**ENV, "CUDA_VISIBLE_DEVICES": ""}


def run_python(code: str, env=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env or NO_GPU_ENV, timeout=120)


def test_check_unpacks_values():
    assert check(lambda: (cu.CUresult.CUDA_SUCCESS,)) is None
    assert check(lambda: (cu.CUresult.CUDA_SUCCESS, 7)) == 7
    assert check(lambda: (cu.CUresult.CUDA_SUCCESS, 7, 8)) == (7, 8)


def test_driver_error_names_call_and_status():
    def cuGraphInstantiate():
        return (cu.CUresult.CUDA_ERROR_INVALID_VALUE,)
    with pytest.raises(DriverError) as info:
        check(cuGraphInstantiate)
    err = info.value
    assert str(err).startswith("cuGraphInstantiate: CUDA_ERROR_INVALID_VALUE")
    assert err.call == "cuGraphInstantiate" and err.status == cu.CUresult.CUDA_ERROR_INVALID_VALUE


def test_nvrtc_errors_carry_their_message():
    def nvrtcCompileProgram():
        return (nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION,)
    with pytest.raises(DriverError, match=r"nvrtcCompileProgram: NVRTC_ERROR_INVALID_OPTION \(.+\)"):
        check(nvrtcCompileProgram)


def test_capture_statuses_become_capture_errors():
    def cuStreamSynchronize():
        return (cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
    with pytest.raises(CaptureError, match="cuStreamSynchronize: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"):
        check(cuStreamSynchronize)


def test_no_device_statuses_become_no_device_error():
    def cuInit(flags):
        return (cu.CUresult.CUDA_ERROR_NO_DEVICE,)
    with pytest.raises(NoDeviceError, match="no CUDA driver/GPU found"):
        check(cuInit, 0)


class FakeStartUp:
    """The driver calls of the start-up path; ``failing`` returns ``status``, the others succeed."""

    def __init__(self, failing: str, status):
        def call(name, value):
            def fn(*args):
                return (status,) if name == failing else (cu.CUresult.CUDA_SUCCESS, value)
            fn.__name__ = name
            return fn
        self.cuInit = call("cuInit", None)
        self.cuDeviceGetCount = call("cuDeviceGetCount", 1)
        self.cuDeviceGet = call("cuDeviceGet", 0)
        self.cuDevicePrimaryCtxRetain = call("cuDevicePrimaryCtxRetain", object())


@pytest.mark.parametrize("call, status", [
    ("cuInit", cu.CUresult.CUDA_ERROR_SYSTEM_NOT_READY),
    ("cuInit", cu.CUresult.CUDA_ERROR_UNKNOWN),
    ("cuInit", cu.CUresult.CUDA_ERROR_NO_DEVICE),
    ("cuInit", cu.CUresult.CUDA_ERROR_DEVICE_UNAVAILABLE),
    ("cuInit", cu.CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH),
    ("cuDeviceGetCount", cu.CUresult.CUDA_ERROR_UNKNOWN),
    ("cuDeviceGet", cu.CUresult.CUDA_ERROR_INVALID_DEVICE),
    ("cuDevicePrimaryCtxRetain", cu.CUresult.CUDA_ERROR_DEVICE_UNAVAILABLE),
    ("cuDevicePrimaryCtxRetain", cu.CUresult.CUDA_ERROR_UNKNOWN),
], ids=lambda v: v.name.removeprefix("CUDA_ERROR_") if isinstance(v, cu.CUresult) else v)
def test_any_start_up_failure_is_no_device_error_naming_the_status(monkeypatch, call, status):
    """Whatever a start-up call returns (CUDA_ERROR_SYSTEM_NOT_READY when the fabric manager is not up,
    CUDA_ERROR_UNKNOWN from a broken driver), making a Device says no GPU is usable, and which call said why."""
    import drvtrain.driver as driver
    monkeypatch.setattr(driver, "cu", FakeStartUp(call, status))
    monkeypatch.setattr(driver, "_initialised", False)
    with pytest.raises(NoDeviceError, match="no CUDA driver/GPU found") as info:
        driver.Device(0)
    assert f"{call}: {status.name}" in str(info.value)


@pytest.mark.parametrize("status, error", [
    (cu.CUresult.CUDA_ERROR_DEVICE_UNAVAILABLE, NoDeviceError),
    (cu.CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, NoDeviceError),
    (cu.CUresult.CUDA_ERROR_INVALID_DEVICE, DriverError),
], ids=["DEVICE_UNAVAILABLE", "SYSTEM_DRIVER_MISMATCH", "INVALID_DEVICE"])
def test_only_machine_statuses_from_later_calls_mean_no_device(status, error):
    """After start-up an exclusive-process GPU taken by another process means no usable GPU; an invalid device
    handle or ordinal passed to a call is the program's error."""
    from drvtrain.driver import raise_status
    with pytest.raises(error) as info:
        raise_status("cuCtxCreate", status)
    assert type(info.value) is error
    assert f"cuCtxCreate: {status.name}" in str(info.value)


def test_guard_sync_refuses_exactly_while_this_thread_captures():
    captures = active_captures()
    saved = list(captures)
    try:
        captures.clear()
        guard_sync("Stream.synchronize")  # nothing capturing: silent
        captures.append(object())
        for call in ("Stream.synchronize", "Device.synchronize"):
            with pytest.raises(CaptureError, match="while a stream is capturing") as info:
                guard_sync(call)
            assert info.value.call == call and str(info.value).startswith(f"{call}: ")
        captures.clear()
        guard_sync("Event.synchronize")  # the capture ended: silent again
    finally:
        captures[:] = saved


def test_resources_are_released_on_collect_or_close_but_never_at_exit():
    """release_on_collect: the finalizer runs once, when the owner is dropped or closed,
    and is not run at interpreter exit (a subprocess checks the exit). Every owner
    of a driver resource in drvtrain is released through it."""
    import gc

    from drvtrain.driver import release_on_collect

    class Owner:
        pass

    calls = []
    owner = Owner()
    finalizer = release_on_collect(owner, calls.append, "dropped")
    assert finalizer.atexit is False
    del owner
    gc.collect()
    assert calls == ["dropped"]
    owner = Owner()
    finalizer = release_on_collect(owner, calls.append, "closed")
    finalizer()
    finalizer()
    del owner
    gc.collect()
    assert calls == ["dropped", "closed"]
    out = run_python("from drvtrain.driver import release_on_collect\n"
                     "class Owner: pass\n"
                     "keep = Owner()\n"
                     "release_on_collect(keep, print, 'released at exit')\n"
                     "print('done')\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["done"]
    pkg = os.path.join(ROOT, "drvtrain")
    for folder, _, names in os.walk(pkg):
        for name in sorted(names):
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != os.path.join(pkg, "driver.py"):
                with open(path) as f:
                    assert "weakref.finalize(" not in f.read(), os.path.relpath(path, ROOT)


def test_import_needs_no_gpu():
    out = run_python("import drvtrain, drvtrain.cli, drvtrain.demo; print('imported', drvtrain.__version__)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"imported {drvtrain.__version__}"


def test_no_gpu_gives_one_clear_error():
    code = ("import drvtrain\n"
            "try:\n    drvtrain.DeviceBuffer(16)\n"
            "except drvtrain.NoDeviceError as e:\n    print(type(e).__name__, '|', e)\n")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("NoDeviceError | no CUDA driver/GPU found")
    assert "Traceback" not in out.stderr


def test_doctor_without_gpu_exits_2_with_the_error():
    out = subprocess.run([sys.executable, "-m", "drvtrain", "doctor"], capture_output=True,
                         text=True, env=NO_GPU_ENV, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drvtrain: no CUDA driver/GPU found"), out.stderr
    assert "nvrtc" in out.stdout


def test_cli_help_matches_commands():
    out = subprocess.run([sys.executable, "-m", "drvtrain", "--help"], capture_output=True, text=True, env=ENV)
    assert out.returncode == 0 and "doctor" in out.stdout
    out = subprocess.run([sys.executable, "-m", "drvtrain", "doctor", "--help"], capture_output=True, text=True,
                         env=ENV)
    assert out.returncode == 0 and "Exits 2 when no CUDA driver or GPU is found" in " ".join(out.stdout.split())


def test_every_tool_is_covered():
    assert {"dump_graph.py", "overfit.py", "bench_launch.py", "bench_engine.py", "bench_replay.py"} <= set(TOOLS)


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_show_help(tool):
    out = subprocess.run([sys.executable, os.path.join(TOOLS_DIR, tool), "--help"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: ") and "--device N" in out.stdout


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_without_gpu_exits_2_with_one_line(tool, tmp_path):
    out = subprocess.run([sys.executable, os.path.join(TOOLS_DIR, tool)], capture_output=True, text=True,
                         env=NO_GPU_ENV, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    stem = tool.removesuffix(".py")
    assert len(lines) == 1 and lines[0].startswith(f"{stem}: no CUDA driver/GPU found"), out.stderr
    assert list(tmp_path.iterdir()) == []  # gave up before writing anything


@pytest.fixture
def common(monkeypatch):
    """The tools' shared preamble, imported as the tools import it."""
    monkeypatch.syspath_prepend(TOOLS_DIR)
    import _common
    return _common


def test_tool_runner_turns_errors_into_one_line_and_exit_code(common, capsys):
    def no_gpu(argv):
        raise NoDeviceError("cuInit: CUDA_ERROR_NO_DEVICE\n(second line)")

    def bad_kernel(argv):
        raise CompileError("spin.cu", 'spin.cu(3): warning: unused\nspin.cu(4): error: identifier "y" is undefined\n'
                                      "1 error detected in the compilation of \"spin.cu\".\n")

    assert common.run(no_gpu, [], name="bench_x") == 2
    err = capsys.readouterr().err
    assert err == "bench_x: no CUDA driver/GPU found (cuInit: CUDA_ERROR_NO_DEVICE (second line))\n"
    assert common.run(bad_kernel, [], name="bench_x") == 1
    err = capsys.readouterr().err
    assert err == 'bench_x: NVRTC failed to compile spin.cu: spin.cu(4): error: identifier "y" is undefined\n'
    assert common.run(lambda argv: len(argv), ["a", "b", "c"]) == 3

    def bug(argv):
        raise ValueError("other errors pass")

    with pytest.raises(ValueError, match="other errors pass"):
        common.run(bug, [])


def test_tool_parser_describes_the_tool_and_selects_the_device(common, monkeypatch, rng):
    parser = common.tool_parser("First line of the tool.\n\nMore prose.\n")
    assert parser.description == "First line of the tool."
    ordinal = int(rng.integers(1, 8))
    # select_device writes os.environ itself: give it a copy, so nothing leaks
    # into later tests (and their subprocesses) whatever monkeypatch records.
    monkeypatch.setattr(os, "environ", os.environ.copy())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert parser.parse_args([]).device == 0
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # device 0 changes nothing
    assert parser.parse_args(["--device", str(ordinal)]).device == ordinal
    assert os.environ["CUDA_VISIBLE_DEVICES"] == str(ordinal)
    listed = [f"GPU-{rng.integers(1 << 32):08x}" for _ in range(ordinal + 1)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(listed))
    parser.parse_args(["--device", str(ordinal)])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == listed[ordinal]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(listed[:ordinal]))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--device", str(ordinal)])
    assert info.value.code == 2
    assert "--device" not in common.tool_parser("x", device=False).format_help()


@pytest.mark.parametrize("tool, args, message", [
    ("overfit.py", ["--steps", "0"], "--steps must be at least 1, got 0"),
    ("overfit.py", ["--print-every", "0"], "--print-every must be at least 1, got 0"),
    ("overfit.py", ["--lr", "nan"], "--lr must be a positive number, got nan"),
    ("bench_train.py", ["--seeds", "-1"], "--seeds at least 0"),
    ("bench_sync.py", ["--repeats", "0"], "--repeats must be at least 1"),
    ("bench_sync.py", ["--only", "grid", "barriers"], "invalid choice: 'barriers'"),
])
def test_tool_arguments_out_of_range_exit_2_with_one_line(tool, args, message, tmp_path):
    """Checked before the device is looked for: the same line with or without a GPU."""
    out = subprocess.run([sys.executable, os.path.join(TOOLS_DIR, tool), *args], capture_output=True, text=True,
                         env=NO_GPU_ENV, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
