"""NVRTC compilation to CUBIN and the on-disk cache (CPU only: NVRTC needs no GPU)."""
import os
import struct
import tempfile
import warnings

import pytest
from cuda.bindings import nvrtc

from drvtrain import compiler
from drvtrain.compiler import CacheWarning, CompileError, KernelCache, compile_file, compile_source

EM_CUDA = 190


def cubin_arch(cubin: bytes) -> int:
    """The SM version recorded in a CUDA ELF's e_flags (e.g. 90 for sm_90)."""
    assert cubin[:4] == b"\x7fELF", "not an ELF image: NVRTC returned something other than CUBIN"
    assert cubin[4] == 2, "expected a 64-bit ELF"
    (machine,) = struct.unpack_from("<H", cubin, 18)
    assert machine == EM_CUDA
    (flags,) = struct.unpack_from("<I", cubin, 48)
    return (flags >> 8) & 0xFF


def builds_the_step_picks():
    """The kernel builds DQNStep picks by name for a count of actions, by source file."""
    from drvtrain.rl.dqn import head_kernel_name, loss_dwl_kernel_name
    counts = (1, 2, 3, 18, 64)
    return {"dqn.cu": {head_kernel_name(a) for a in counts},
            "gemm.cu": {loss_dwl_kernel_name(a, vec) for a in counts for vec in (4, 16)}}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("path", compiler.kernel_files(), ids=lambda p: p.name)
def test_every_kernel_compiles_to_cubin(path, arch, cache_dir):
    prog = compile_file(path, arch=arch)
    assert not prog.cache_hit
    assert cubin_arch(prog.cubin) == int(arch[3:])
    # Every build the step may launch from this file is an entry of its CUBIN.
    for name in builds_the_step_picks().get(path.name, ()):
        assert b".text." + name.encode() + b"\0" in prog.cubin, f"{path.name} has no kernel {name}"


def test_kernel_sources_are_found_and_documented():
    files = compiler.kernel_files()
    names = {p.name for p in files}
    assert {"elementwise.cu", "probe.cu"} <= names
    for p in files:
        first = p.read_text().lstrip().splitlines()[0]
        assert first.startswith("//"), f"{p.name} must open with its contract comment"


def test_ptx_targets_are_refused():
    with pytest.raises(ValueError, match="CUBIN"):
        compile_source("extern \"C\" __global__ void k() {}", arch="compute_90", use_cache=False)


def test_cache_miss_then_hit_returns_same_cubin(cache_dir):
    first = compile_file("probe.cu", arch="sm_90")
    second = compile_file("probe.cu", arch="sm_90")
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert first.cubin == second.cubin and first.key == second.key
    entries = list(cache_dir.glob("*.cubin"))
    assert [p.name for p in entries] == [f"{first.key}.cubin"]
    assert not list(cache_dir.glob(".tmp-*")), "atomic write left a temp file behind"


def test_key_follows_the_nvrtc_build_in_the_process(cache_dir, monkeypatch):
    """nvrtcVersion gives (major, minor) only, and patch releases of one version may
    compile differently: the key also holds the loaded library's name and size (the
    library this process mapped, as /proc/self/maps lists it), so another build of
    the same version misses the cache."""
    from drvtrain import driver
    first = compile_file("probe.cu", arch="sm_90")  # NVRTC is loaded now
    build = driver.nvrtc_build()
    with open("/proc/self/maps") as maps:
        mapped = {os.path.realpath(line.split()[-1]) for line in maps if "libnvrtc.so" in line}
    assert len(mapped) == 1, mapped
    lib = mapped.pop()
    assert build[0] == [os.path.basename(lib), os.path.getsize(lib)]
    assert all("nvrtc-builtins" in name and size > 0 for name, size in build[1:])
    assert compile_file("probe.cu", arch="sm_90").cache_hit
    monkeypatch.setattr(compiler, "nvrtc_build", lambda: [[build[0][0], build[0][1] + 1]] + build[1:])
    other = compile_file("probe.cu", arch="sm_90")
    assert not other.cache_hit and other.key != first.key


def test_key_covers_arch_options_and_name_expressions(cache_dir):
    src = 'template <typename T> __global__ void twice(T* x) { x[0] *= 2; }\n'
    base = compile_source(src, arch="sm_90", name_expressions=["twice<float>"])
    keys = {
        base.key,
        compile_source(src, arch="sm_80", name_expressions=["twice<float>"]).key,
        compile_source(src, arch="sm_90", name_expressions=["twice<double>"]).key,
        compile_source(src, arch="sm_90", options=("-std=c++17",), name_expressions=["twice<float>"]).key,
    }
    assert len(keys) == 4
    assert base.lowered_names["twice<float>"].startswith("_Z")


def test_header_change_invalidates_entry(tmp_path, cache_dir):
    inc = tmp_path / "inc"
    inc.mkdir()
    header = inc / "scale.cuh"
    header.write_text("#pragma once\n#define FACTOR 2.0f\n")
    nested = tmp_path / "nested.cuh"
    nested.write_text('#include "scale.cuh"\n')
    src = tmp_path / "k.cu"
    src.write_text('#include "nested.cuh"\nextern "C" __global__ void k(float* x) { x[0] *= FACTOR; }\n')
    a = compile_file(src, arch="sm_90", include_dirs=[inc])
    b = compile_file(src, arch="sm_90", include_dirs=[inc])
    header.write_text("#pragma once\n#define FACTOR 3.0f\n")  # two levels down
    c = compile_file(src, arch="sm_90", include_dirs=[inc])
    assert (a.cache_hit, b.cache_hit, c.cache_hit) == (False, True, False)
    assert c.key != a.key and c.cubin != a.cubin


@pytest.mark.parametrize("fresh_cache", [False, True], ids=["no-cache", "fresh-cache"])
def test_header_in_the_current_directory_does_not_shadow_drvtrains(fresh_cache, tmp_path, monkeypatch):
    """A common.cuh in the current directory is never compiled in place of kernels/common.cuh.

    NVRTC would search the program name's folder, the current directory for a
    bare name, before the -I folders; the key, which hashes kernels/common.cuh,
    would then name a CUBIN built from the other header.
    """
    monkeypatch.chdir(tmp_path)
    (tmp_path / "common.cuh").write_text("#error shadow\n")
    monkeypatch.setenv("DRVTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    prog = compile_file(compiler.kernel_dir() / "elementwise.cu", arch="sm_90", use_cache=fresh_cache)
    assert cubin_arch(prog.cubin) == 90
    assert not prog.cache_hit


def test_key_follows_the_header_nvrtc_reads(tmp_path, cache_dir):
    """A header's own include is looked up in the -I folders only, and the key hashes the header found there."""
    src_dir, inc = tmp_path / "src", tmp_path / "inc"
    (src_dir / "sub").mkdir(parents=True)
    inc.mkdir()
    (src_dir / "sub" / "outer.cuh").write_text('#include "factor.cuh"\n')
    (src_dir / "sub" / "factor.cuh").write_text("#error the including header's own folder is not searched\n")
    (inc / "factor.cuh").write_text("#define FACTOR 2.0f\n")
    src = src_dir / "k.cu"
    src.write_text('#include "sub/outer.cuh"\nextern "C" __global__ void k(float* x) { x[0] *= FACTOR; }\n')
    a = compile_file(src, arch="sm_90", include_dirs=[inc])
    (inc / "factor.cuh").write_text("#define FACTOR 3.0f\n")
    b = compile_file(src, arch="sm_90", include_dirs=[inc])
    assert (a.cache_hit, b.cache_hit) == (False, False)
    assert b.cubin != a.cubin


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_entry_is_recompiled(damage, cache_dir):
    good = compile_file("probe.cu", arch="sm_90")
    path = cache_dir / f"{good.key}.cubin"
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        mid = len(blob) // 2
        path.write_bytes(blob[:mid] + bytes([blob[mid] ^ 0x40]) + blob[mid + 1:])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(os.urandom(len(blob)))
    cache = compiler.default_cache()
    corrupt_before = cache.stats.corrupt
    again = compile_file("probe.cu", arch="sm_90")
    assert not again.cache_hit
    assert again.cubin == good.cubin
    assert cache.stats.corrupt == corrupt_before + 1
    assert path.read_bytes() == blob, "the damaged entry was not rewritten"
    assert compile_file("probe.cu", arch="sm_90").cache_hit


def test_unwritable_cache_degrades_with_a_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    cache = KernelCache(blocker / "cache")
    with pytest.warns(CacheWarning, match="not writable"):
        prog = compile_file("probe.cu", arch="sm_90", cache=cache)
    assert cubin_arch(prog.cubin) == 90
    assert not cache.writable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not on every compile
        compile_file("elementwise.cu", arch="sm_90", cache=cache)


def test_read_only_cache_dir_degrades_with_a_warning(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    cache = KernelCache(ro)
    if os.geteuid() == 0:
        # root writes through mode bits; make the write fail as a read-only mount would.
        def refuse(*a, **k):
            raise OSError(30, "Read-only file system")
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    try:
        with pytest.warns(CacheWarning, match="not writable"):
            prog = compile_file("probe.cu", arch="sm_90", cache=cache)
        assert cubin_arch(prog.cubin) == 90
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_compile_error_carries_file_and_full_log(tmp_path, cache_dir):
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n')
    with pytest.raises(CompileError) as info:
        compile_file(bad, arch="sm_90")
    err = info.value
    assert err.filename == "broken.cu"
    assert "undefined_name" in err.log and "error" in err.log
    assert "broken.cu" in str(err)
    assert not list(cache_dir.glob("*.cubin")), "a failed compile must not be cached"


def test_rejected_option_carries_nvrtcs_log(cache_dir):
    """A failure other than a compilation error (an unknown option) keeps the log that says what was wrong."""
    with pytest.raises(CompileError) as info:
        compile_file("probe.cu", arch="sm_90", options=("-std=c++17", "--bogus-flag"))
    err = info.value
    assert err.filename == "probe.cu"
    assert err.status == nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION
    assert "unrecognized option --bogus-flag" in err.log
    assert "NVRTC_ERROR_INVALID_OPTION" in str(err) and "unrecognized option --bogus-flag" in str(err)
    assert not list(cache_dir.glob("*.cubin"))


def test_user_source_can_include_drvtrain_headers(cache_dir):
    src = '#include "common.cuh"\nextern "C" __global__ void k(float* x) { x[dt_thread_index()] = 1; }\n'
    assert cubin_arch(compile_source(src, "user.cu", arch="sm_90").cubin) == 90



def test_the_tests_late_writer_compiles_for_sm_90(cache_dir):
    """The GPU tests' late writer (tests/late_writer.py), so that a mistake in it shows here too."""
    from late_writer import LATE_COPY_SOURCE
    prog = compile_source(LATE_COPY_SOURCE, "late_copy.cu", arch="sm_90", include_dirs=[compiler.kernel_dir()])
    assert cubin_arch(prog.cubin) == 90
    assert b"late_copy" in prog.cubin and b"copy_around_the_wait" in prog.cubin
