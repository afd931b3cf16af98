"""Launch options (dependent, cluster, large dynamic shared memory) without a GPU.

Every check here happens before any driver call; the driver entry points are
replaced by recorders, so a call that should not happen fails the test.
"""
import ctypes
import struct

import numpy as np
import pytest
from cuda.bindings import driver as cu

import drvtrain.graph as graph_module
import drvtrain.kernel as kernel_module
from drvtrain.driver import DeviceLimits
from drvtrain.graph import Graph, Node
from drvtrain.kernel import BoundLaunch, Kernel, _DynamicShared
from drvtrain.memory import DeviceBuffer

OPTIN = 227 * 1024
H200_LIKE = DeviceLimits(max_threads_per_block=1024, max_block=(1024, 1024, 64),
                         max_grid=(2**31 - 1, 65535, 65535), max_shared_per_block=48 * 1024,
                         max_shared_per_block_optin=OPTIN)
ATTR = cu.CUlaunchAttributeID


def fake_buffer(address: int, n: int = 16) -> DeviceBuffer:
    return DeviceBuffer._view(None, address, (n,), np.float32)


class FakeStream:
    def __init__(self, handle: int = 0):
        self.handle = handle


def hopper_kernel(signature="ptr, i32", cc=(9, 0), function=None, **kw) -> Kernel:
    return Kernel(function, "k", signature, H200_LIKE, compute_capability=cc, **kw)


def packed(params: int, n: int, sizes=(8, 4)) -> list[bytes]:
    table = (ctypes.c_void_p * n).from_address(params)
    return [ctypes.string_at(table[i], sizes[i]) for i in range(n)]


@pytest.fixture
def launches(monkeypatch):
    """Records every launch: ("plain", ...) for cuLaunchKernel, ("ex", ...) for cuLaunchKernelEx."""
    seen = []

    def plain(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        seen.append(("plain", (gx, gy, gz), (bx, by, bz), shared, stream, packed(params, 2)))
        return (cu.CUresult.CUDA_SUCCESS,)

    def ex(config, function, params, extra):
        attrs = [(a.id, a.value.programmaticStreamSerializationAllowed,
                  (a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z))
                 for a in config.attrs[:config.numAttrs]]
        seen.append(("ex", config, int(config.hStream),
                     (config.gridDimX, config.gridDimY, config.gridDimZ),
                     (config.blockDimX, config.blockDimY, config.blockDimZ),
                     config.sharedMemBytes, attrs, packed(params, 2)))
        return (cu.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(kernel_module, "_cuLaunchKernel", plain)
    monkeypatch.setattr(kernel_module, "_cuLaunchKernelEx", ex)
    return seen


@pytest.fixture
def no_driver(monkeypatch):
    """Any launch fails the test."""
    def refuse(*args):
        raise AssertionError("a driver launch was made")
    monkeypatch.setattr(kernel_module, "_cuLaunchKernel", refuse)
    monkeypatch.setattr(kernel_module, "_cuLaunchKernelEx", refuse)


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("grid, cluster, error, match", [
    (8, (0, 1, 1), ValueError, "at least 1"),
    (8, (2, -1), ValueError, "at least 1"),
    (18, (3, 6, 1), ValueError, "18 blocks; at most 16"),
    (17, 17, ValueError, r"at most 16 \(the portable maximum is 8; above it the function is allowed the "
                         r"non-portable size\)"),
    ((8, 8), (8, 4), ValueError, "32 blocks; at most 16"),
    (8, (1, 2, 3, 4), TypeError, "1 to 3 dimensions"),
    (8, "2x1", TypeError, "cluster must be an int or a tuple"),
    (8, True, TypeError, "cluster must be an int or a tuple"),
    (8, (2, None), TypeError, "cluster must be an int or a tuple"),
    (6, (4, 1, 1), ValueError, r"grid \(6, 1, 1\) is not divisible by cluster \(4, 1, 1\) along x"),
    ((4, 3), (2, 2), ValueError, "not divisible.*along y"),
    ((4, 2, 3), (1, 1, 2), ValueError, "not divisible.*along z"),
])
def test_bad_clusters_are_refused_before_any_driver_call(no_driver, grid, cluster, error, match):
    k = hopper_kernel()
    with pytest.raises(error, match=match):
        k.launch(grid, 64, fake_buffer(4096), 1, stream=FakeStream(), cluster=cluster)
    with pytest.raises(error, match=match):
        k.bind(grid, 64, fake_buffer(4096), 1, cluster=cluster)


@pytest.mark.parametrize("options, what", [
    ({"dependent": True}, "dependent=True"),
    ({"cluster": (2, 1, 1)}, "cluster="),
    ({"dependent": True, "cluster": 2}, "dependent=True"),
])
def test_options_need_compute_capability_9(no_driver, options, what):
    for cc, have in (((8, 0), "compute capability 8.0"), ((8, 9), "compute capability 8.9"),
                     (None, "unknown device")):
        k = hopper_kernel(cc=cc)
        with pytest.raises(ValueError, match=f"{what}.*needs compute capability 9.0 or newer.*{have}"):
            k.launch(4, 64, fake_buffer(4096), 1, stream=FakeStream(), **options)
        with pytest.raises(ValueError, match="needs compute capability 9.0"):
            k.bind(4, 64, fake_buffer(4096), 1, **options)


def test_dependent_must_be_a_bool(no_driver):
    with pytest.raises(TypeError, match="dependent must be True or False"):
        hopper_kernel().launch(4, 64, fake_buffer(4096), 1, stream=FakeStream(), dependent="yes")


def test_cooperative_is_checked_before_any_driver_call(no_driver):
    k = hopper_kernel()
    with pytest.raises(TypeError, match="cooperative must be True or False"):
        k.launch(4, 64, fake_buffer(4096), 1, stream=FakeStream(), cooperative=1)
    with pytest.raises(ValueError, match="either cooperative or in clusters"):
        k.launch(4, 64, fake_buffer(4096), 1, stream=FakeStream(), cooperative=True, cluster=2)
    with pytest.raises(ValueError, match="occupancy needs a loaded kernel"):
        k.bind(4, 64, fake_buffer(4096), 1, cooperative=True)


def test_cooperative_launch_sets_the_attribute_within_the_resident_limit(monkeypatch, launches):
    k = hopper_kernel(cc=(8, 0))  # cooperative launches need no Hopper
    monkeypatch.setattr(Kernel, "max_resident_blocks", lambda self, block, shared_mem=0: 264)
    k.launch(264, 64, fake_buffer(4096), 7, stream=FakeStream(3), cooperative=True)
    kind, config, stream, grid, block, shared, attrs, args = launches[-1]
    assert kind == "ex" and grid == (264, 1, 1) and stream == 3
    assert [a[0] for a in attrs] == [ATTR.CU_LAUNCH_ATTRIBUTE_COOPERATIVE]
    assert config.attrs[0].value.cooperative == 1
    with pytest.raises(ValueError, match="cooperative launch of 265 blocks, but at most 264 blocks of 64 threads"):
        k.launch(265, 64, fake_buffer(4096), 7, stream=FakeStream(3), cooperative=True)


@pytest.mark.parametrize("shared, error, match", [
    (-1, ValueError, "shared_mem = -1 bytes is negative"),
    (-(2**20), ValueError, "negative"),
    (OPTIN + 1, ValueError, rf"k: {OPTIN + 1} bytes of dynamic shared memory requested; the device "
                            rf"allows at most {OPTIN} per block \(its opt-in maximum\)"),
    (1 << 40, ValueError, "opt-in maximum"),
    (1.5, TypeError, "shared_mem must be a number of bytes"),
    (True, TypeError, "shared_mem must be a number of bytes"),
    ("64", TypeError, "shared_mem must be a number of bytes"),
])
@pytest.mark.parametrize("options", [{}, {"dependent": True}, {"cluster": (2, 1, 1)}])
def test_bad_shared_memory_is_refused_before_any_driver_call(no_driver, shared, error, match, options):
    with pytest.raises(error, match=match):
        hopper_kernel().launch(4, 64, fake_buffer(4096), 1, stream=FakeStream(), shared_mem=shared,
                               **options)


def test_shared_memory_up_to_the_opt_in_maximum_is_accepted_without_a_function():
    k = hopper_kernel()
    assert k.check_launch(4, 64, OPTIN) == ((4, 1, 1), (64, 1, 1))
    assert k.check_launch(4, 64, np.int64(100 * 1024)) == ((4, 1, 1), (64, 1, 1))


class FakeFunctionDriver:
    """The function-attribute calls of the bindings, over one fake function."""

    def __init__(self, static: int, allowed: int):
        self.static, self.allowed, self.calls = static, allowed, []

    def __getattr__(self, name):
        return getattr(cu, name)

    def cuFuncGetAttribute(self, attr, function):
        self.calls.append(("get", attr))
        a = cu.CUfunction_attribute
        value = {a.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: self.static,
                 a.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: self.allowed}[attr]
        return cu.CUresult.CUDA_SUCCESS, value

    def cuFuncSetAttribute(self, function, attr, value):
        if attr == cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
            self.calls.append(("non_portable", function, value))
            return (cu.CUresult.CUDA_SUCCESS,)
        assert attr == cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.calls.append(("set", value))
        self.allowed = value
        return (cu.CUresult.CUDA_SUCCESS,)


def test_clusters_above_eight_allow_the_non_portable_size_once_per_function(monkeypatch, launches):
    """9 to 16 blocks a cluster: the function gets the non-portable attribute before its first
    such launch (or bind), once, shared by every Kernel of the function; up to 8 never sets it."""
    fake = FakeFunctionDriver(static=0, allowed=48 * 1024)
    monkeypatch.setattr(kernel_module, "cu", fake)
    recorded = kernel_module._cuLaunchKernelEx  # the fixture's recorder

    def launch(config, function, *rest):  # the attribute calls and the launches in one order
        fake.calls.append(("launch", function))
        return recorded(config, function, *rest)

    monkeypatch.setattr(kernel_module, "_cuLaunchKernelEx", launch)
    state, function, other, bound_only = _DynamicShared(), object(), object(), object()
    a = hopper_kernel(function=function, dynamic_shared=state)
    b = hopper_kernel(function=function, dynamic_shared=state)
    c = hopper_kernel(function=other)
    d = hopper_kernel(function=bound_only)
    s = FakeStream(3)
    a.launch(32, 64, fake_buffer(4096), 1, stream=s, cluster=8)
    a.launch(32, 64, fake_buffer(4096), 1, stream=s, cluster=16)
    b.launch(24, 64, fake_buffer(4096), 1, stream=s, cluster=(12, 1, 1))
    b.bind((32, 4), 64, fake_buffer(4096), 1, cluster=(4, 4))
    c.launch((1, 1, 16), 64, fake_buffer(4096), 1, stream=s, cluster=(1, 1, 16))
    d.bind(16, 64, fake_buffer(4096), 1, cluster=16)  # no launch: the bind alone sets it
    assert fake.calls == [("launch", function), ("non_portable", function, 1), ("launch", function),
                          ("launch", function), ("non_portable", other, 1), ("launch", other),
                          ("non_portable", bound_only, 1)]
    dims = [next(x.value.clusterDim for x in entry[1].attrs[:entry[1].numAttrs]
                 if x.id == ATTR.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) for entry in launches]
    assert [(d.x, d.y, d.z) for d in dims] == [(8, 1, 1), (16, 1, 1), (12, 1, 1), (1, 1, 16)]


def test_large_shared_memory_raises_the_function_limit_once_and_never_lowers_it(monkeypatch, launches):
    """Two Kernels of one function share the raised limit: a smaller launch of one never undoes the other."""
    fake = FakeFunctionDriver(static=0, allowed=48 * 1024)
    monkeypatch.setattr(kernel_module, "cu", fake)
    state, function = _DynamicShared(), object()
    a = hopper_kernel(function=function, dynamic_shared=state)
    b = hopper_kernel(function=function, dynamic_shared=state)
    s = FakeStream(7)
    a.launch(4, 64, fake_buffer(4096), 1, stream=s, shared_mem=100 * 1024)
    b.launch(4, 64, fake_buffer(4096), 1, stream=s, shared_mem=60 * 1024)
    a.launch(4, 64, fake_buffer(4096), 1, stream=s, shared_mem=100 * 1024)
    b.launch(4, 64, fake_buffer(4096), 1, stream=s, shared_mem=120 * 1024, dependent=True)
    a.launch(4, 64, fake_buffer(4096), 1, stream=s, shared_mem=1024)
    gets = [c for c in fake.calls if c[0] == "get"]
    sets = [c for c in fake.calls if c[0] == "set"]
    assert len(gets) == 2  # static size and current limit, read once for the function
    assert sets == [("set", 100 * 1024), ("set", 120 * 1024)]
    assert fake.allowed == 120 * 1024
    assert [(x[0], x[-3] if x[0] == "ex" else x[3]) for x in launches] == [
        ("plain", 100 * 1024), ("plain", 60 * 1024), ("plain", 100 * 1024), ("ex", 120 * 1024),
        ("plain", 1024)]


def test_static_shared_arrays_count_against_the_opt_in_maximum(monkeypatch, no_driver):
    static = 16 * 1024
    fake = FakeFunctionDriver(static=static, allowed=48 * 1024 - static)
    monkeypatch.setattr(kernel_module, "cu", fake)
    k = hopper_kernel(function=object())
    request = OPTIN - static + 1
    with pytest.raises(ValueError, match=rf"k: {request} bytes of dynamic shared memory requested; the "
                                         rf"device's opt-in maximum is {OPTIN} bytes per block and the "
                                         rf"kernel's static __shared__ arrays take {static}, so at most "
                                         rf"{OPTIN - static} are available"):
        k.launch(4, 64, fake_buffer(4096), 1, stream=FakeStream(), shared_mem=request)
    assert [c for c in fake.calls if c[0] == "set"] == []


# ------------------------------------------------------------------ launch paths
def test_no_option_keeps_the_plain_cuLaunchKernel_path(launches):
    k = hopper_kernel()
    a = fake_buffer(4096)
    k.launch((2, 3), 64, a, 5, stream=FakeStream(11))
    k.launch((2, 3), 64, a, 5, stream=FakeStream(11), dependent=False, cluster=None)
    bound = k.bind(8, 32, a, 6)
    assert type(bound) is BoundLaunch and not bound.dependent and bound.cluster is None
    bound.launch(FakeStream(12))
    assert [x[0] for x in launches] == ["plain"] * 3
    assert launches[0][1:5] == ((2, 3, 1), (64, 1, 1), 0, 11)
    assert launches[0][5] == [struct.pack("<Q", 4096), struct.pack("<i", 5)]
    assert launches[2][1:6] == ((8, 1, 1), (32, 1, 1), 0, 12, [struct.pack("<Q", 4096), struct.pack("<i", 6)])


def test_options_launch_through_cuLaunchKernelEx_with_a_memoised_config(launches):
    k = hopper_kernel()
    a, b = fake_buffer(4096), fake_buffer(8192)
    k.launch((4, 2), (32, 2), a, 5, stream=FakeStream(1), dependent=True, cluster=(2, 1), shared_mem=96 * 1024)
    k.launch((4, 2), (32, 2), b, 6, stream=FakeStream(2), dependent=True, cluster=(2, 1), shared_mem=96 * 1024)
    k.launch(4, 64, a, 7, stream=FakeStream(3), dependent=True)
    k.launch(4, 64, a, 7, stream=FakeStream(4), cluster=4)
    assert [x[0] for x in launches] == ["ex"] * 4
    first, second, dep, clu = launches
    assert first[1] is second[1]  # one config per shape; only the stream changed
    assert (first[2], second[2]) == (1, 2)
    assert first[3:6] == ((4, 2, 1), (32, 2, 1), 96 * 1024)
    assert first[6] == [(ATTR.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1, (1, 0, 0)),
                        (ATTR.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 2, (2, 1, 1))]
    assert first[7] == [struct.pack("<Q", 4096), struct.pack("<i", 5)]
    assert second[7] == [struct.pack("<Q", 8192), struct.pack("<i", 6)]
    assert dep[1] is not first[1] and dep[3:6] == ((4, 1, 1), (64, 1, 1), 0)
    assert [x[0] for x in dep[6]] == [ATTR.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]
    assert [(x[0], x[2]) for x in clu[6]] == [(ATTR.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (4, 1, 1))]


def test_bound_launch_with_options_replays_through_cuLaunchKernelEx(launches):
    k = hopper_kernel()
    bound = k.bind(8, 32, fake_buffer(4096), 5, dependent=True, cluster=(2, 1, 1))
    assert bound.dependent is True and bound.cluster == (2, 1, 1)
    bound.launch(FakeStream(21))
    bound.set(1, 9)
    bound.launch(FakeStream(22))
    assert [x[0] for x in launches] == ["ex", "ex"]
    assert [x[2] for x in launches] == [21, 22]
    assert launches[1][7] == [struct.pack("<Q", 4096), struct.pack("<i", 9)]
    with pytest.raises(TypeError, match="legacy stream"):
        bound.launch(None)


def test_the_audit_counts_launches_through_cuLaunchKernelEx(launches):
    """Dependent and cluster launches, eager and bound, count as launches outside a graph, and still launch."""
    from drvtrain.audit import CallCounts, count_driver_calls
    k = hopper_kernel()
    a = fake_buffer(4096)
    with count_driver_calls() as calls:
        k.launch(4, 64, a, 5, stream=FakeStream(1), dependent=True)
        k.launch(4, 64, a, 6, stream=FakeStream(2), cluster=2)
        k.bind(8, 32, a, 7, dependent=True).launch(FakeStream(3))
    assert calls["cuLaunchKernelEx"] == 3
    assert CallCounts(calls, 1).category("kernel launches outside a graph") == 3
    assert [x[0] for x in launches] == ["ex"] * 3
    k.launch(4, 64, a, 8, stream=FakeStream(4), dependent=True)
    assert calls["cuLaunchKernelEx"] == 3 and len(launches) == 4  # counted inside the block only


def test_the_audit_undoes_its_patches_when_installing_them_fails(monkeypatch):
    """A failure while the counters go in leaves every module as it was."""
    import sys

    from drvtrain import audit, tma
    from drvtrain.audit import count_driver_calls
    monkeypatch.delattr(tma, "_encode_tiled")  # the last name the audit wraps
    before = {name: mod.cu for name, mod in sys.modules.items()
              if name.startswith("drvtrain") and hasattr(mod, "cu")}
    launch, launch_ex = kernel_module._cuLaunchKernel, kernel_module._cuLaunchKernelEx
    with pytest.raises(AttributeError, match="_encode_tiled"):
        with count_driver_calls():
            pass
    assert before and all(sys.modules[name].cu is cu_ for name, cu_ in before.items())
    assert all(mod is audit._real_driver for mod in before.values())
    assert (kernel_module._cuLaunchKernel, kernel_module._cuLaunchKernelEx) == (launch, launch_ex)


def test_refused_option_leaves_no_stale_arguments(launches):
    """launch(A) ok, launch(B) refused for its options or its arguments, launch(A): A is what is sent."""
    k = hopper_kernel()
    a = (fake_buffer(4096), 5)
    k.launch(4, 64, *a, stream=FakeStream(), dependent=True)
    with pytest.raises(ValueError, match="not divisible"):
        k.launch(4, 64, fake_buffer(8192), 6, stream=FakeStream(), dependent=True, cluster=3)
    k.launch(4, 64, *a, stream=FakeStream(), dependent=True)
    with pytest.raises((ValueError, OverflowError)):
        k.launch(4, 64, fake_buffer(8192), 2**40, stream=FakeStream(), dependent=True)
    k.launch(4, 64, *a, stream=FakeStream(), dependent=True)
    k.launch(4, 64, *a, stream=FakeStream())
    want = [struct.pack("<Q", 4096), struct.pack("<i", 5)]
    assert [x[-1] for x in launches] == [want] * 4


# ------------------------------------------------------------------ graph edges
class FakeEdgeDriver:
    def __init__(self, froms, tos, data):
        self.froms, self.tos, self.data = froms, tos, data

    def __getattr__(self, name):
        return getattr(cu, name)

    def cuGraphGetEdges(self, graph, count=0):
        if not count:
            return cu.CUresult.CUDA_SUCCESS, [], [], [], len(self.froms)
        return cu.CUresult.CUDA_SUCCESS, self.froms, self.tos, self.data, len(self.froms)


def test_graph_edges_keep_programmatic_edges_and_mark_them(monkeypatch):
    handles = [cu.CUgraphNode(4096 * (i + 1)) for i in range(4)]
    default, programmatic = cu.CUgraphEdgeData(), cu.CUgraphEdgeData()
    programmatic.type = int(cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    programmatic.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    monkeypatch.setattr(graph_module, "cu", FakeEdgeDriver(
        [handles[0], handles[1], handles[2]], [handles[1], handles[2], handles[3]],
        [programmatic, default, programmatic]))
    g = Graph()
    g.handle = object()
    g._nodes = [Node(i, "kernel", h) for i, h in enumerate(handles)]
    assert g.edges() == [(0, 1), (1, 2), (2, 3)]
    assert g.programmatic_edges() == [(0, 1), (2, 3)]
    assert [n.index for n in g.dependencies(g.nodes()[2])] == [1]
    assert g.longest_chain() == 4


# What cuGraphDebugDotPrint wrote for three captured kernels, the second launched
# dependent=True (CUDA 13.0 driver; node labels trimmed).
VERBOSE_DOT = r'''digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="bold" shape="record" label="{KERNEL
| {ID | 0 (topoId: 2) | chain_step\<\<\<16,256,0\>\>\>}
| {{node handle | func handle} | {0x0000000027F10DA0 | 0x00000000284A6C60}}
}"];

"graph_1_node_1"[style="bold" shape="record" label="{KERNEL
| {ID | 1 (topoId: 1) | chain_step\<\<\<16,256,0\>\>\>}
| {{node handle | func handle} | {0x0000000027F11508 | 0x00000000284A6C60}}
}"];

"graph_1_node_2"[style="bold" shape="record" label="{KERNEL
| {ID | 2 (topoId: 0) | chain_step\<\<\<16,256,0\>\>\>}
| {{node handle | func handle} | {0x0000000027F11C70 | 0x00000000284A6C60}}
}"];

"graph_1_node_0" -> "graph_1_node_1" [headlabel=0];
"graph_1_node_1" -> "graph_1_node_2" [headlabel=0];
}
}
'''


def test_dot_dump_marks_programmatic_edges():
    names = graph_module._dot_node_handles(VERBOSE_DOT)
    assert names == {"graph_1_node_0": 0x27F10DA0, "graph_1_node_1": 0x27F11508, "graph_1_node_2": 0x27F11C70}
    # Node indices in an order unlike the DOT ids, so a mix-up of the two shows.
    index = {"graph_1_node_0": 2, "graph_1_node_1": 0, "graph_1_node_2": 1}
    marked = graph_module._mark_programmatic_edges(VERBOSE_DOT, index, {(2, 0)})
    assert '"graph_1_node_0" -> "graph_1_node_1" [headlabel=0 style="dashed" label="programmatic"];' in marked
    assert '"graph_1_node_1" -> "graph_1_node_2" [headlabel=0];' in marked
    assert marked.count("programmatic") == 1
    short = '"graph_1_node_0" -> "graph_1_node_1";\n"graph_1_node_1" -> "graph_1_node_2";\n'
    marked = graph_module._mark_programmatic_edges(short, index, {(0, 1)})
    assert marked == ('"graph_1_node_0" -> "graph_1_node_1";\n'
                      '"graph_1_node_1" -> "graph_1_node_2" [style="dashed" label="programmatic"];\n')


# ------------------------------------------------------------------ dependent_launches scope
def _kinds(seen):
    return [(entry[0], [a[:2] for a in entry[6]] if entry[0] == "ex" else None) for entry in seen]


def test_dependent_launches_scope_makes_hopper_launches_dependent_and_restores(launches):
    from drvtrain import dependent_launches
    hopper, ampere = hopper_kernel(), hopper_kernel(cc=(8, 0))
    args = (fake_buffer(4096), 1)
    programmatic = (ATTR.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    hopper.launch(4, 64, *args, stream=FakeStream())
    with dependent_launches():
        hopper.launch(4, 64, *args, stream=FakeStream())
        ampere.launch(4, 64, *args, stream=FakeStream())  # below 9.0 the scope changes nothing
        with dependent_launches(False):  # an inner "off" keeps the outer setting
            hopper.launch(4, 64, *args, stream=FakeStream())
        hopper.launch(4, 64, *args, stream=FakeStream(), dependent=False)  # one launch opts out
    hopper.launch(4, 64, *args, stream=FakeStream())
    with pytest.raises(RuntimeError):
        with dependent_launches():
            raise RuntimeError("inside")
    hopper.launch(4, 64, *args, stream=FakeStream())
    with dependent_launches(False):
        hopper.launch(4, 64, *args, stream=FakeStream())
    assert _kinds(launches) == [("plain", None), ("ex", [programmatic]), ("plain", None),
                                ("ex", [programmatic]), ("plain", None), ("plain", None), ("plain", None),
                                ("plain", None)]


def test_bind_follows_the_scope_at_bind_time(launches):
    """A bound launch takes the scope around bind(); replays keep what it took."""
    from drvtrain import dependent_launches
    hopper, ampere = hopper_kernel(), hopper_kernel(cc=(8, 0))
    args = (fake_buffer(4096), 1)
    plain = hopper.bind(4, 64, *args)
    with dependent_launches():
        bound = hopper.bind(4, 64, *args)
        opted_out = hopper.bind(4, 64, *args, dependent=False)
        older = ampere.bind(4, 64, *args)  # below 9.0 the scope changes nothing
        plain.launch(FakeStream())
    bound.launch(FakeStream())
    assert bound.dependent is True
    assert type(opted_out) is BoundLaunch and not opted_out.dependent
    assert type(older) is BoundLaunch and not older.dependent
    programmatic = (ATTR.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    assert _kinds(launches) == [("plain", None), ("ex", [programmatic])]


def test_dependent_launches_scope_belongs_to_its_thread(launches):
    import threading
    from drvtrain import dependent_launches
    hopper = hopper_kernel()
    args = (fake_buffer(4096), 1)
    with dependent_launches():
        worker = threading.Thread(target=lambda: hopper.launch(4, 64, *args, stream=FakeStream()))
        worker.start()
        worker.join()
        hopper.launch(4, 64, *args, stream=FakeStream())
    assert [entry[0] for entry in launches] == ["plain", "ex"]


def test_arch_specific_builds_need_compute_capability_9(no_driver):
    from types import SimpleNamespace
    from drvtrain.kernel import load_module, load_source
    older = SimpleNamespace(arch="sm_86", compute_capability=(8, 6))
    with pytest.raises(ValueError, match="need compute capability 9.0 or newer; this device is sm_86"):
        load_source('extern "C" __global__ void k() {}', device=older, arch_specific=True)
    with pytest.raises(ValueError, match="need compute capability 9.0"):
        load_module("gemm_sm90a.cu", device=older, arch_specific=True)


@pytest.mark.parametrize("policy, value", [("spread", cu.CUclusterSchedulingPolicy.CU_CLUSTER_SCHEDULING_POLICY_SPREAD),
                                           ("load_balancing",
                                            cu.CUclusterSchedulingPolicy.CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING)])
def test_a_cluster_policy_rides_beside_the_cluster_dimension(launches, policy, value):
    k = hopper_kernel()
    k.launch(8, 64, fake_buffer(4096), 3, stream=FakeStream(5), cluster=4, cluster_policy=policy)
    bound = k.bind(8, 64, fake_buffer(4096), 3, cluster=4, cluster_policy=policy)
    bound.launch(FakeStream(6))
    k.launch(8, 64, fake_buffer(4096), 3, stream=FakeStream(7), cluster=4)
    for config in (launches[0][1], launches[1][1]):
        attrs = config.attrs[:config.numAttrs]
        assert [a.id for a in attrs] == [ATTR.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                                         ATTR.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE]
        assert attrs[1].value.clusterSchedulingPolicyPreference == value
    plain = launches[2][1]  # the same shape without a policy: its own config, no preference
    assert plain is not launches[0][1]
    assert [a.id for a in plain.attrs[:plain.numAttrs]] == [ATTR.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION]


@pytest.mark.parametrize("options, match", [
    ({"cluster_policy": "spread"}, "the launch has none"),
    ({"cluster": 2, "cluster_policy": "packed"}, "cluster_policy must be one of"),
    ({"cluster": 2, "cluster_policy": 1}, "cluster_policy must be one of"),
])
def test_bad_cluster_policies_are_refused_before_any_driver_call(no_driver, options, match):
    k = hopper_kernel()
    with pytest.raises(ValueError, match=match):
        k.launch(8, 64, fake_buffer(4096), 1, stream=FakeStream(), **options)
    with pytest.raises(ValueError, match=match):
        k.bind(8, 64, fake_buffer(4096), 1, **options)


def test_a_kernel_of_a_closed_module_refuses_every_launch_before_the_driver(no_driver):
    k = hopper_kernel()
    a = fake_buffer(4096)
    plain, with_options = k.bind(8, 32, a, 5), k.bind(8, 32, a, 5, dependent=True)
    k._configs[("resident", (32, 1, 1), 0)] = 264  # an occupancy asked before the close
    k.closed, k.function = True, None  # what Module.close does to its kernels
    for launch in (lambda: k.launch(8, 32, a, 5, stream=FakeStream(1)),
                   lambda: k.launch(8, 32, a, 5, stream=FakeStream(1), dependent=True, cluster=2),
                   lambda: plain.launch(FakeStream(1)), lambda: with_options.launch(FakeStream(1)),
                   lambda: k.launch(8, 32, a, 5, stream=FakeStream(1), cooperative=True),
                   lambda: k.bind(8, 32, a, 5), lambda: k.bind(8, 32, a, 5, dependent=True),
                   lambda: k.launch(8, 32, a, 5, stream=FakeStream(1), shared_mem=64 * 1024),
                   lambda: k.max_resident_blocks(32), lambda: k.max_active_clusters(2, 32)):
        with pytest.raises(RuntimeError, match="k: its module is closed"):
            launch()


def test_an_executable_graph_is_registered_with_the_modules_it_replays_only():
    """Module.close is refused while an executable graph replays its kernels: after an update
    to another module's kernels, and after a close, the graph no longer holds the old module."""
    import weakref

    from drvtrain.graph import _register_with_modules

    class FakeModule:
        def __init__(self):
            self._graphs = weakref.WeakSet()

    class FakeExec:
        pass

    first, second = FakeModule(), FakeModule()
    exe = FakeExec()
    _register_with_modules(exe, [hopper_kernel(module=first), hopper_kernel(module=first)])
    assert set(first._graphs) == {exe} and not set(second._graphs)
    _register_with_modules(exe, [hopper_kernel(module=second)])  # what update does
    assert not set(first._graphs) and set(second._graphs) == {exe}
    _register_with_modules(exe, [])  # what close does
    assert not set(first._graphs) and not set(second._graphs)


def test_an_options_launch_of_the_very_same_objects_after_a_close_refuses(launches, rng):
    """The launch with options (cuLaunchKernelEx) skips packing the very same objects too;
    after a close of one of them it packs again and refuses it before any driver call."""
    import weakref
    addr = int(rng.integers(1, 2**40)) * 256
    buf = fake_buffer(addr)
    buf._finalizer = weakref.finalize(buf, lambda: None)  # owning, its free a stand-in
    k = hopper_kernel()
    k.launch(4, 64, buf, 7, stream=FakeStream(1), dependent=True)
    k.launch(4, 64, buf, 7, stream=FakeStream(1), dependent=True)
    buf.close()
    with pytest.raises(RuntimeError, match="argument 0: DeviceBuffer .* is closed"):
        k.launch(4, 64, buf, 7, stream=FakeStream(1), dependent=True)
    assert [x[0] for x in launches] == ["ex", "ex"] and launches[1][-1][0] == struct.pack("<Q", addr)
