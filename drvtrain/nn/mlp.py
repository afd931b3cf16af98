"""A ReLU MLP over a flat parameter layout: forward on TF32 tensor cores, backward in FP32."""
from __future__ import annotations

import numpy as np

from ..kernel import builtin_module
from ..memory import Arena, DeviceBuffer
from .layout import FlatBuffer, ParamLayout

__all__ = ["MLP", "gemm"]

_SIGNATURE = "ptr i32 ptr i32 ptr i32 i32 i32 i32 ptr ptr i32 ptr"
_TILE = 64


def _kernel(name: str):
    return builtin_module("gemm.cu").kernel(name, _SIGNATURE)


def gemm(kernel, a, lda, b, ldb, c, ldc, m, n, k, stream, *, bias=0, mask=0, ldm=0, col_sum=0):
    """C[m, n] = sum_k A(i, k) B(k, j) with the operand layouts and epilogue of ``kernel``
    (kernels/gemm.cu names them)."""
    threads = 128 if kernel.name.endswith("tf32") else 256
    kernel.launch((-(-n // _TILE), -(-m // _TILE)), threads, a, lda, b, ldb, c, ldc, m, n, k,
                  bias, mask, ldm, col_sum, stream=stream)


def _check_input(name: str, buf, shape) -> None:
    if not isinstance(buf, DeviceBuffer):
        raise TypeError(f"{name} must be a DeviceBuffer, got {type(buf).__name__}")
    if buf.dtype != np.float32:
        raise TypeError(f"{name} must hold float32, got {buf.dtype}")
    if buf.shape != tuple(shape):
        raise ValueError(f"{name} has shape {buf.shape}, expected {tuple(shape)}")


class MLP:
    """Linear, bias and ReLU after every layer but the last; the epilogues are fused.

    ``forward`` keeps the activations (arena slices) for ``backward``, which
    writes every gradient of the layout with no float atomics: dW = dY^T X and
    db (column sums of dY) in one kernel, dX = dY W masked by the ReLU of the
    layer's input in another.
    """

    def __init__(self, layout: ParamLayout, *, tf32: bool = True):
        self.layout = layout
        self.tf32 = tf32
        mode = "tf32" if tf32 else "f32"
        self.hidden_kernel = _kernel(f"linear_forward_relu_{mode}")
        self.output_kernel = _kernel(f"linear_forward_{mode}")
        self.weight_grad_kernel = _kernel("linear_grad_weight_f32")
        self.input_grad_kernel = _kernel("linear_grad_input_f32")
        self.activations: list[DeviceBuffer] = []

    @property
    def in_features(self) -> int:
        return self.layout.layers[0][1]

    @property
    def out_features(self) -> int:
        return self.layout.layers[-1][0]

    def scratch_bytes(self, batch: int) -> int:
        """Arena bytes one forward and backward take at this batch size."""
        widths = [o for o, _ in self.layout.layers]
        per = sum(-(-batch * w * 4 // 256) * 256 for w in widths)
        return 2 * per + 256 * 4

    def forward(self, params: FlatBuffer, x: DeviceBuffer, arena: Arena, stream) -> DeviceBuffer:
        """Activations of every layer into arena slices; returns the output [batch, out]."""
        if params.layout != self.layout:
            raise ValueError("params were made for another layout")
        batch = x.shape[0] if x.shape else 0
        _check_input("x", x, (batch, self.in_features))
        acts = [x]
        last = len(self.layout.layers) - 1
        for k, (out, inp) in enumerate(self.layout.layers):
            y = arena.array((batch, out), np.float32)
            kernel = self.output_kernel if k == last else self.hidden_kernel
            gemm(kernel, acts[-1], inp, params.weight(k), inp, y, out, batch, out, inp, stream, bias=params.bias(k))
            acts.append(y)
        self.activations = acts
        return acts[-1]

    def backward(self, params: FlatBuffer, grads: FlatBuffer, dout: DeviceBuffer, arena: Arena, stream) -> None:
        """Gradients of the loss whose derivative by the output is ``dout``, into ``grads``."""
        if not self.activations:
            raise RuntimeError("backward needs a forward first")
        if grads.layout != self.layout:
            raise ValueError("grads were made for another layout")
        batch = self.activations[0].shape[0]
        _check_input("dout", dout, (batch, self.out_features))
        dy = dout
        for k in range(len(self.layout.layers) - 1, -1, -1):
            out, inp = self.layout.layers[k]
            x = self.activations[k]
            gemm(self.weight_grad_kernel, dy, out, x, inp, grads.weight(k), inp, out, inp, batch, stream,
                 col_sum=grads.bias(k))
            if k > 0:
                dx = arena.array((batch, inp), np.float32)
                gemm(self.input_grad_kernel, dy, out, params.weight(k), inp, dx, inp, batch, inp, out, stream,
                     mask=x, ldm=inp)
                dy = dx
