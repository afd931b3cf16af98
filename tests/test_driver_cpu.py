"""Error translation and behaviour without a GPU (runs everywhere)."""
import os
import subprocess
import sys

import pytest
from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

import drvtrain
from drvtrain.driver import CaptureError, DriverError, NoDeviceError, check, guard_sync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def test_guard_sync_is_silent_outside_capture():
    guard_sync("Stream.synchronize")


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


@pytest.mark.parametrize("tool", ["dump_graph.py", "bench_launch.py", "bench_replay.py", "bench_engine.py", "overfit.py"])
def test_tools_show_help(tool):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), "--help"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout


def test_dump_graph_without_gpu_exits_2():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "dump_graph.py"), "--no-svg"],
                         capture_output=True, text=True, env=NO_GPU_ENV, timeout=120)
    assert out.returncode == 2
    assert "no CUDA driver/GPU found" in out.stderr and "Traceback" not in out.stderr
