"""Stream capture into CUDA graphs, graph inspection, and executable graphs."""
from __future__ import annotations

import contextlib
import re
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass

from cuda.bindings import driver as cu

from .driver import (CaptureError, Closable, DriverError, active_captures, check, raise_status, release,
                     release_deferred, release_on_collect)

__all__ = ["capture", "capture_frontier", "Graph", "GraphExec", "GraphUpdateError", "Node", "KernelNode"]


class GraphUpdateError(DriverError):
    """``cuGraphExecUpdate`` refused the new graph; the executable graph is unchanged."""


@dataclass(frozen=True)
class Node:
    index: int
    type: str
    handle: object

    def __repr__(self) -> str:
        return f"<Node {self.index} {self.type}>"


@dataclass(frozen=True)
class KernelNode:
    node: Node
    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    handle: int = 0  # the CUfunction, as an int: tells apart two builds of one kernel name


_PROGRAMMATIC = int(cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)


def _type_name(t) -> str:
    return t.name.removeprefix("CU_GRAPH_NODE_TYPE_").lower()


class Graph(Closable):
    """A captured ``CUgraph``; read its structure, dump it, instantiate it.

    Holds references to the buffers its kernels were launched with, so they
    outlive every executable graph made from it.
    """

    def __init__(self, handle=None):
        self.handle = None
        self.keepalive: list = []
        self._finalizer = None
        self._closed = False
        self._nodes = None
        self._edges = None
        if handle is not None:
            self._adopt(handle)

    def _adopt(self, handle) -> None:
        self.handle = handle
        self._finalizer = release_on_collect(self, release, cu.cuGraphDestroy, handle)

    def _require(self) -> None:
        if self.handle is None:
            if self._closed:
                raise RuntimeError("the graph is closed")
            raise RuntimeError("the graph is not captured yet: use it after the `with capture(...)` block")

    # -------------------------------------------------------------- structure
    def nodes(self) -> list[Node]:
        self._require()
        if self._nodes is None:
            _, count = check(cu.cuGraphGetNodes, self.handle, 0)
            handles, _ = check(cu.cuGraphGetNodes, self.handle, count) if count else ([], 0)
            self._nodes = [Node(i, _type_name(check(cu.cuGraphNodeGetType, h)), h)
                           for i, h in enumerate(handles)]
        return self._nodes

    def node_counts(self) -> dict[str, int]:
        """How many nodes of each type (``kernel``, ``memset``, ``event_record``, ...)."""
        return dict(Counter(n.type for n in self.nodes()))

    def kernel_nodes(self) -> list[KernelNode]:
        out = []
        for node in self.nodes():
            if node.type != "kernel":
                continue
            p = check(cu.cuGraphKernelNodeGetParams, node.handle)
            try:
                name = check(cu.cuFuncGetName, p.func).decode()
            except DriverError:
                name = "?"
            out.append(KernelNode(node, name, (p.gridDimX, p.gridDimY, p.gridDimZ),
                                  (p.blockDimX, p.blockDimY, p.blockDimZ), p.sharedMemBytes, int(p.func)))
        return out

    def _edge_list(self) -> list[tuple[int, int, bool]]:
        """(from, to, programmatic) per edge, read once: a captured graph never changes.

        The edge data is read with the edges: a programmatic edge (from a
        ``dependent=True`` launch) cannot be read without it.
        """
        if self._edges is None:
            index = {int(n.handle): n.index for n in self.nodes()}
            result = check(cu.cuGraphGetEdges, self.handle, 0)
            count = result[-1]
            edges = []
            if count:
                result = check(cu.cuGraphGetEdges, self.handle, count)
                data = result[2] if len(result) > 3 else [None] * count
                for a, b, d in zip(result[0], result[1], data):
                    programmatic = d is not None and int(d.type) == _PROGRAMMATIC
                    edges.append((index[int(a)], index[int(b)], programmatic))
            self._edges = edges
        return self._edges

    def edges(self) -> list[tuple[int, int]]:
        """Dependencies as (from, to) node indices: ``to`` runs after ``from``.

        A programmatic edge counts: ``to`` may start early, but waits for
        ``from`` in ``dt_wait_prior_grid()``.
        """
        return [(a, b) for a, b, _ in self._edge_list()]

    def programmatic_edges(self) -> list[tuple[int, int]]:
        """The edges of programmatic dependent launches (``dependent=True``), as (from, to)."""
        return [(a, b) for a, b, programmatic in self._edge_list() if programmatic]

    def node_for(self, handle) -> Node:
        """The Node of a raw ``CUgraphNode`` handle (e.g. from ``capture_frontier``)."""
        want = int(handle)
        for node in self.nodes():
            if int(node.handle) == want:
                return node
        raise KeyError(f"no node {want:#x} in this graph")

    def dependencies(self, node: Node) -> list[Node]:
        """The nodes ``node`` waits for."""
        return [self.nodes()[a] for a, b in self.edges() if b == node.index]

    def _successors(self) -> dict[int, list[int]]:
        succ = defaultdict(list)
        for a, b in self.edges():
            succ[a].append(b)
        return succ

    def _reaches(self, succ, start: int, goal: int) -> bool:
        stack, seen = [start], {start}
        while stack:
            for nxt in succ[stack.pop()]:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    def can_run_concurrently(self, a: Node, b: Node) -> bool:
        """True when no dependency path joins ``a`` and ``b`` in either direction."""
        if a.index == b.index:
            return False
        succ = self._successors()
        return not (self._reaches(succ, a.index, b.index) or self._reaches(succ, b.index, a.index))

    def _depths(self) -> list[int]:
        """Per node, the number of nodes on the longest chain ending at it."""
        nodes = self.nodes()
        succ = self._successors()
        indegree = Counter(b for _, b in self.edges())
        depth = [1] * len(nodes)
        ready = [n.index for n in nodes if indegree[n.index] == 0]
        while ready:
            i = ready.pop()
            for j in succ[i]:
                depth[j] = max(depth[j], depth[i] + 1)
                indegree[j] -= 1
                if indegree[j] == 0:
                    ready.append(j)
        return depth

    def longest_chain(self) -> int:
        """Nodes on the longest dependent chain: the graph's critical path length."""
        return max(self._depths(), default=0)

    def concurrent_branches(self) -> int:
        """The most nodes at one depth; no path joins any two of them, so they may all run at once."""
        return max(Counter(self._depths()).values(), default=0)

    def summary(self) -> str:
        """A text summary: node counts by type, kernels with grids, branches, critical path."""
        lines = [f"nodes: {len(self.nodes())}  " +
                 ", ".join(f"{t} {n}" for t, n in sorted(self.node_counts().items()))]
        for k in self.kernel_nodes():
            lines.append(f"  kernel {k.function:<24} grid {k.grid} block {k.block}"
                         + (f" smem {k.shared_mem}" if k.shared_mem else ""))
        programmatic = len(self.programmatic_edges())
        if programmatic:
            lines.append(f"programmatic edges (dependent launches): {programmatic}")
        lines.append(f"concurrent branches: {self.concurrent_branches()}")
        lines.append(f"longest dependent chain: {self.longest_chain()} nodes")
        return "\n".join(lines)

    def to_dot(self, path, verbose: bool = True) -> None:
        """Write the graph as Graphviz DOT with ``cuGraphDebugDotPrint``.

        The driver draws a programmatic edge like any other; drvtrain dashes
        it and labels it ``programmatic``.
        """
        self._require()
        flags = (cu.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE if verbose
                 else cu.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_KERNEL_NODE_PARAMS)
        check(cu.cuGraphDebugDotPrint, self.handle, str(path).encode(), int(flags))
        programmatic = self.programmatic_edges()
        if not programmatic:
            return
        path = str(path)
        with open(path) as f:
            text = f.read()
        if verbose:
            handles_text = text
        else:  # only the verbose dump names each DOT node's handle
            with tempfile.TemporaryDirectory() as tmp:
                verbose_path = f"{tmp}/graph.dot"
                check(cu.cuGraphDebugDotPrint, self.handle, verbose_path.encode(),
                      int(cu.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE))
                with open(verbose_path) as f:
                    handles_text = f.read()
        index = {int(n.handle): n.index for n in self.nodes()}
        names = {name: index[h] for name, h in _dot_node_handles(handles_text).items() if h in index}
        with open(path, "w") as f:
            f.write(_mark_programmatic_edges(text, names, set(programmatic)))

    # -------------------------------------------------------------- execution
    def instantiate(self) -> "GraphExec":
        self._require()
        return GraphExec(self)

    def close(self) -> None:
        """Destroy the graph now. Executable graphs made from it keep working; the
        graph itself refuses every later use."""
        if self._finalizer is not None:
            self._finalizer()
        self.handle, self._closed, self._nodes, self._edges = None, True, None, None
        self.keepalive.clear()

    @property
    def closed(self) -> bool:
        """True once ``close()`` destroyed the graph."""
        return self._closed


class GraphExec(Closable):
    """An instantiated graph: ``launch`` replays it, ``update`` swaps in new parameters."""

    def __init__(self, graph: Graph):
        kernels = _kernels_to_replay(graph)
        # What cuGraphExecUpdate requires to match, read now: `update` must not
        # depend on the source graph, which may be closed by then.
        self._topology = _topology(graph)
        self.handle = check(cu.cuGraphInstantiate, graph.handle, 0)
        self.graph = graph
        # Its own list: the kernels (and so their modules) and buffers the
        # replays use stay alive as long as this executable graph, whatever
        # happens to the Graph it came from (Graph.close empties that one's).
        self.keepalive = list(graph.keepalive)
        self._finalizer = release_on_collect(self, release, cu.cuGraphExecDestroy, self.handle)
        _register_with_modules(self, kernels)

    def launch(self, stream) -> None:
        if self.handle is None:
            raise RuntimeError("the executable graph is closed")
        status, = cu.cuGraphLaunch(self.handle, stream.handle)
        if status:
            raise_status("cuGraphLaunch", status)

    @property
    def closed(self) -> bool:
        return self.handle is None

    def update(self, graph: Graph) -> None:
        """Take ``graph``'s node parameters; its topology must equal the instantiated one."""
        if self.handle is None:
            raise RuntimeError("the executable graph is closed")
        kernels = _kernels_to_replay(graph)
        if _topology(graph) != self._topology:
            reason = _UPDATE_REASONS[_R.CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED]
            raise GraphUpdateError("cuGraphExecUpdate", None, f"{reason}; the executable graph is unchanged")
        status, info = cu.cuGraphExecUpdate(self.handle, graph.handle)
        if status:
            try:
                result = _R(int(getattr(info, "result", info)))
                reason = _UPDATE_REASONS.get(result, result.name)
            except (TypeError, ValueError):
                reason = "the driver gave no reason"
            raise GraphUpdateError("cuGraphExecUpdate", status,
                                   f"{reason}; the executable graph is unchanged")
        self.graph = graph
        self.keepalive = list(graph.keepalive)
        _register_with_modules(self, kernels)

    def close(self) -> None:
        """Destroy the executable graph now; later launches and updates are refused."""
        self._finalizer()
        self.handle, self.graph, self.keepalive = None, None, []
        _register_with_modules(self, [])


def _kernels_to_replay(graph: Graph) -> list:
    """The distinct kernels a captured graph launches, from its keepalive entries; refused
    when the graph is closed or one of them belongs to a closed module."""
    graph._require()
    seen = {}
    for entry in graph.keepalive:
        kernel = entry[0] if isinstance(entry, tuple) and entry else None
        if hasattr(kernel, "closed") and id(kernel) not in seen:
            if kernel.closed:
                raise RuntimeError(f"the graph launches {kernel.name}, a kernel of a closed module")
            seen[id(kernel)] = kernel
    return list(seen.values())


def _register_with_modules(exe: "GraphExec", kernels) -> None:
    """Tell each module whose kernels ``exe`` replays, and only those (Module.close refuses
    while it lives): the modules of an earlier graph that ``update`` replaced are told it ended."""
    modules = {id(m): m for m in (getattr(k, "_module", None) for k in kernels) if m is not None}
    for old in getattr(exe, "_modules", {}).values():
        if id(old) not in modules:
            old._graphs.discard(exe)
    for module in modules.values():
        module._graphs.add(exe)
    exe._modules = modules


_DOT_NODE = re.compile(r'^"(graph_\d+_node_\d+)"\[', re.M)
_DOT_HANDLE = re.compile(r"\{\{node handle \|[^}]*\} \| \{0x([0-9A-Fa-f]+)")
_DOT_EDGE = re.compile(r'^("(graph_\d+_node_\d+)" -> "(graph_\d+_node_\d+)")(?: \[(.*)\])?;$', re.M)


def _dot_node_handles(text: str) -> dict[str, int]:
    """DOT node name -> node handle, from a verbose ``cuGraphDebugDotPrint`` dump."""
    starts = list(_DOT_NODE.finditer(text))
    found = {}
    for m, end in zip(starts, [s.start() for s in starts[1:]] + [len(text)]):
        h = _DOT_HANDLE.search(text, m.end(), end)
        if h:
            found[m.group(1)] = int(h.group(1), 16)
    return found


def _mark_programmatic_edges(text: str, names: dict[str, int], programmatic: set) -> str:
    """Dash and label the DOT edges whose (from, to) node indices are in ``programmatic``."""
    def mark(m):
        a, b = names.get(m.group(2)), names.get(m.group(3))
        if a is None or b is None or (a, b) not in programmatic:
            return m.group(0)
        attrs = (m.group(4) + " ") if m.group(4) else ""
        return f'{m.group(1)} [{attrs}style="dashed" label="programmatic"];'
    return _DOT_EDGE.sub(mark, text)


def _topology(graph: Graph) -> tuple:
    """Node types in order and the edge list: what cuGraphExecUpdate requires to match."""
    return tuple(n.type for n in graph.nodes()), tuple(sorted(graph.edges()))


_R = cu.CUgraphExecUpdateResult
_UPDATE_REASONS = {
    _R.CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED:
        "the topology changed (nodes or dependencies differ): capture and instantiate anew",
    _R.CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED:
        "a node's type changed: capture and instantiate anew",
    _R.CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED:
        "a kernel node's function changed in a way update cannot apply",
    _R.CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED:
        "a node's parameters changed in a way update cannot apply",
    _R.CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED:
        "something about the node is not supported by update",
}


@contextlib.contextmanager
def capture(stream):
    """Capture the work queued on ``stream`` (and streams forked from it) into a Graph.

    The capture always ends, also when the block raises; the stream is usable
    afterwards. A call that is illegal during capture raises CaptureError.
    """
    if not hasattr(stream, "handle"):
        raise TypeError("capture() needs a drvtrain Stream; the legacy stream is never captured")
    # Thread-local mode: an unsafe call (a synchronisation, an allocation) made
    # by this thread is refused and breaks only this capture, while other
    # threads (a loader, another trainer) go on unhindered. Global mode would
    # let their calls break our capture; relaxed mode would let our own
    # mistakes pass unreported.
    check(cu.cuStreamBeginCapture, stream.handle,
          cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    graph = Graph()
    captures = active_captures()
    captures.append(graph)
    try:
        yield graph
    except BaseException:
        captures.remove(graph)
        status, handle = cu.cuStreamEndCapture(stream.handle)
        if not status and handle is not None and int(handle):
            cu.cuGraphDestroy(handle)
        release_deferred()
        raise
    captures.remove(graph)
    try:
        handle = check(cu.cuStreamEndCapture, stream.handle)
    except CaptureError as exc:
        raise CaptureError("cuStreamEndCapture", exc.status,
                           f"the capture was invalidated ({exc.detail})") from None
    finally:
        release_deferred()
    graph._adopt(handle)


def capture_frontier(stream) -> list:
    """The ``CUgraphNode`` handles the next work captured on ``stream`` will depend on:
    the last nodes queued there. Lets a library name the nodes a part of its
    capture produced (``Graph.node_for``), e.g. to check two branches overlap."""
    result = check(cu.cuStreamGetCaptureInfo, stream.handle)
    status = result[0]
    if status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        raise CaptureError("cuStreamGetCaptureInfo", None, "the stream is not capturing")
    deps = result[3]
    return list(deps or [])
