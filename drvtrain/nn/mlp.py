"""A ReLU MLP over a flat parameter layout: forward on TF32 tensor cores, backward in FP32."""
from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from ..driver import get_device
from ..kernel import builtin_module
from ..memory import Arena, DeviceBuffer
from .layout import FlatBuffer, ParamLayout

__all__ = ["MLP", "Forward", "gemm", "split_count"]

_SIGNATURE = "ptr i32 ptr i32 ptr i32 i32 i32 i32 ptr ptr i32 ptr ptr ptr ptr"
_TILE = 64
_MAX_TILES = 4096  # output tiles a split-k product may have (one counter each)


@dataclass(frozen=True)
class Forward:
    """What one forward leaves for its backward: the input and the output of
    every layer, as arena slices valid until the arena is reset."""
    activations: tuple

    @property
    def output(self) -> DeviceBuffer:
        return self.activations[-1]

    @property
    def batch(self) -> int:
        return self.activations[0].shape[0]


def _kernel(name: str):
    return builtin_module("gemm.cu").kernel(name, _SIGNATURE, fixed_block=True)


def gemm(kernel, a, lda, b, ldb, c, ldc, m, n, k, stream, *, bias=0, mask=0, ldm=0, col_sum=0,
         splits=1, workspace=0, counters=0, gate=0):
    """C[m, n] = sum_k A(i, k) B(k, j) with the operand layouts and epilogue of ``kernel``
    (kernels/gemm.cu names them), the k range split over ``splits`` blocks per tile."""
    kernel.launch((-(-n // _TILE), -(-m // _TILE), splits), kernel.block, a, lda, b, ldb, c, ldc, m, n, k,
                  bias, mask, ldm, col_sum, workspace, counters, gate if gate is not None else 0, stream=stream)


def split_count(m: int, n: int, k: int, sm_count: int) -> int:
    """How many blocks share each output tile's k range: enough blocks to cover the
    SMs twice, at most 4 (the last block's tail grows with the count), whole 64-deep
    k tiles each, none left empty."""
    tiles = -(-m // _TILE) * -(-n // _TILE)
    k_tiles = -(-k // _TILE)
    if tiles > _MAX_TILES:
        return 1
    want = max(1, min(k_tiles, 4, -(-2 * sm_count // tiles)))
    per = -(-k_tiles // want)
    return -(-k_tiles // per)


def _check_input(name: str, buf, shape) -> None:
    if not isinstance(buf, DeviceBuffer):
        raise TypeError(f"{name} must be a DeviceBuffer, got {type(buf).__name__}")
    if buf.dtype != np.float32:
        raise TypeError(f"{name} must hold float32, got {buf.dtype}")
    if buf.shape != tuple(shape):
        raise ValueError(f"{name} has shape {buf.shape}, expected {tuple(shape)}")


class MLP:
    """Linear, bias and ReLU after every layer but the last; the epilogues are fused.

    Stateless between calls: ``forward`` returns a :class:`Forward` holding its
    activations (arena slices) and ``backward`` takes it, so two forwards of
    two parameter sets, on two streams, never touch each other's state. Every
    split-k product takes its tile counters from ``arena.zeroed``.
    ``backward`` writes every gradient of the layout with no float atomics:
    dW = dY^T X and db (column sums of dY) in one kernel, dX = dY W masked by
    the ReLU of the layer's input in another.
    """

    def __init__(self, layout: ParamLayout, *, tf32: bool = True):
        self.layout = layout
        self.tf32 = tf32
        mode = "tf32" if tf32 else "f32"
        self.hidden_kernel = _kernel(f"linear_forward_relu_{mode}")
        self.output_kernel = _kernel(f"linear_forward_{mode}")
        self.weight_grad_kernel = _kernel("linear_grad_weight_f32")
        self.input_grad_kernel = _kernel("linear_grad_input_f32")
        self._sm_count = get_device().sm_count

    @property
    def in_features(self) -> int:
        return self.layout.layers[0][1]

    @property
    def out_features(self) -> int:
        return self.layout.layers[-1][0]

    def _products(self, batch: int):
        """(m, n, k) of every product of a forward and backward, in launch order."""
        last = len(self.layout.layers) - 1
        out = [(batch, o, i) for o, i in self.layout.layers]
        for k in range(last, -1, -1):
            o, i = self.layout.layers[k]
            out.append((o, i, batch))
            if k > 0:
                out.append((batch, i, o))
        return out

    def zeroed_bytes(self, batch: int) -> int:
        """``arena.zeroed`` bytes (tile counters) one forward and backward take."""
        total = 0
        for m, n, k in self._products(batch):
            if split_count(m, n, k, self._sm_count) > 1:
                total += -(-(-(-m // _TILE) * -(-n // _TILE)) * 4 // 256) * 256
        return total

    def scratch_bytes(self, batch: int) -> int:
        """Arena bytes one forward and backward take at this batch size."""
        rounded = lambda floats: -(-floats * 4 // 256) * 256
        total = 0
        for m, n, k in self._products(batch):
            s = split_count(m, n, k, self._sm_count)
            total += rounded(m * n)  # the product's output (activations and their gradients)
            if s > 1:
                total += rounded(s * (m * n + m))
        return total + 1024

    def _gemm(self, kernel, a, lda, b, ldb, c, ldc, m, n, k, arena, stream, gate=None, **epilogue):
        s = split_count(m, n, k, self._sm_count)
        workspace = arena.array(s * (m * n + m), np.float32) if s > 1 else 0
        counters = arena.zeroed(-(-m // _TILE) * -(-n // _TILE), np.uint32) if s > 1 else 0
        gemm(kernel, a, lda, b, ldb, c, ldc, m, n, k, stream, splits=s, workspace=workspace,
             counters=counters, gate=gate, **epilogue)

    def forward(self, params: FlatBuffer, x: DeviceBuffer, *, arena: Arena, stream, gate=None) -> Forward:
        """Every layer's output into arena slices; ``.output`` is [batch, out].

        ``gate``: an int32 device word; while it is non-zero every launch returns
        at once (a training loop's step that is not due)."""
        if params.layout != self.layout:
            raise ValueError("params were made for another layout")
        batch = x.shape[0] if x.shape else 0
        _check_input("x", x, (batch, self.in_features))
        acts = [x]
        last = len(self.layout.layers) - 1
        for k, (out, inp) in enumerate(self.layout.layers):
            y = arena.array((batch, out), np.float32)
            kernel = self.output_kernel if k == last else self.hidden_kernel
            self._gemm(kernel, acts[-1], inp, params.weight(k), inp, y, out, batch, out, inp, arena, stream,
                       gate=gate, bias=params.bias(k))
            acts.append(y)
        return Forward(tuple(acts))

    def backward(self, params: FlatBuffer, grads: FlatBuffer, forward: Forward, dout: DeviceBuffer, *,
                 arena: Arena, stream, gate=None) -> None:
        """Gradients of the loss whose derivative by ``forward.output`` is ``dout``, into ``grads``."""
        if not isinstance(forward, Forward) or len(forward.activations) != len(self.layout.layers) + 1:
            raise TypeError("backward takes the Forward that this MLP's forward returned")
        if grads.layout != self.layout or params.layout != self.layout:
            raise ValueError("params and grads must be made for this MLP's layout")
        batch = forward.batch
        _check_input("dout", dout, (batch, self.out_features))
        dy = dout
        for k in range(len(self.layout.layers) - 1, -1, -1):
            out, inp = self.layout.layers[k]
            x = forward.activations[k]
            self._gemm(self.weight_grad_kernel, dy, out, x, inp, grads.weight(k), inp, out, inp, batch, arena,
                       stream, gate=gate, col_sum=grads.bias(k))
            if k > 0:
                dx = arena.array((batch, inp), np.float32)
                self._gemm(self.input_grad_kernel, dy, out, params.weight(k), inp, dx, inp, batch, inp, out,
                           arena, stream, gate=gate, mask=x, ldm=inp)
                dy = dx
