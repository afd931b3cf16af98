"""Parameters as views into one flat buffer.

A :class:`ParamLayout` places every layer's ``W`` (``[out, in]``) and ``b``
(``[out]``) in one flat fp32 buffer, each view starting on a 256-byte
boundary. Parameters, gradients, Adam moments and a target network all use
the same layout in buffers of their own, so one elementwise kernel covers a
whole buffer and no per-layer allocation ever exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..driver import Closable
from ..memory import ALIGNMENT, DeviceBuffer

__all__ = ["ParamLayout", "Slot", "FlatBuffer"]

_FLOATS_PER_ALIGN = ALIGNMENT // 4


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the flat buffer: its name, shape and float offset."""
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


class ParamLayout:
    """The placement of an MLP's weights and biases in one flat buffer.

    ``layers`` is a list of ``(out_features, in_features)``.
    """

    def __init__(self, layers):
        self.layers = [(int(o), int(i)) for o, i in layers]
        if not self.layers:
            raise ValueError("a layout needs at least one layer")
        for o, i in self.layers:
            if o < 1 or i < 1:
                raise ValueError(f"layer shape must be positive, got [out={o}, in={i}]")
        for (o_prev, _), (_, i_next) in zip(self.layers, self.layers[1:]):
            if o_prev != i_next:
                raise ValueError(f"layer outputs {o_prev} but the next layer takes {i_next}")
        slots, offset = [], 0
        for k, (o, i) in enumerate(self.layers):
            for name, shape in ((f"layer{k}.weight", (o, i)), (f"layer{k}.bias", (o,))):
                slots.append(Slot(name, shape, offset))
                size = int(np.prod(shape))
                offset += -(-size // _FLOATS_PER_ALIGN) * _FLOATS_PER_ALIGN
        self.slots = slots
        self.size = offset  # floats, a multiple of 64
        self._by_name = {s.name: s for s in slots}

    @classmethod
    def from_widths(cls, widths) -> "ParamLayout":
        """``[4, 256, 256, 3]``: input width, hidden widths, output width."""
        widths = [int(w) for w in widths]
        if len(widths) < 2:
            raise ValueError(f"from_widths needs an input and an output width, got {widths}")
        return cls([(o, i) for i, o in zip(widths, widths[1:])])

    @property
    def widths(self) -> list[int]:
        return [self.layers[0][1]] + [o for o, _ in self.layers]

    def weight(self, k: int) -> Slot:
        return self._by_name[f"layer{k}.weight"]

    def bias(self, k: int) -> Slot:
        return self._by_name[f"layer{k}.bias"]

    @property
    def parameter_count(self) -> int:
        return sum(s.size for s in self.slots)

    def init_numpy(self, seed: int) -> np.ndarray:
        """A flat host array initialised like ``torch.nn.Linear``: U(-1/sqrt(in), 1/sqrt(in)).

        Padding between views is 0. The same seed gives the same parameters.
        """
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.size, np.float32)
        for k, (o, i) in enumerate(self.layers):
            bound = 1.0 / np.sqrt(i)
            for slot in (self.weight(k), self.bias(k)):
                flat[slot.offset: slot.offset + slot.size] = rng.uniform(-bound, bound, slot.size)
        return flat

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named host arrays (copies) from a flat host array."""
        flat = np.asarray(flat)
        if flat.shape != (self.size,):
            raise ValueError(f"flat array has shape {flat.shape}, the layout needs ({self.size},)")
        return {s.name: flat[s.offset: s.offset + s.size].reshape(s.shape).copy() for s in self.slots}

    def flatten(self, named: dict[str, np.ndarray]) -> np.ndarray:
        """A flat host array from named arrays; names and shapes must match exactly."""
        missing = sorted(set(self._by_name) - set(named))
        extra = sorted(set(named) - set(self._by_name))
        if missing or extra:
            raise ValueError(f"parameters do not match the layout: missing {missing}, unexpected {extra}")
        flat = np.zeros(self.size, np.float32)
        for s in self.slots:
            a = np.asarray(named[s.name])
            if a.shape != s.shape:
                raise ValueError(f"{s.name} has shape {a.shape}, the layout needs {s.shape}")
            flat[s.offset: s.offset + s.size] = a.reshape(-1)
        return flat

    def save(self, path, flat: np.ndarray) -> None:
        """Write a flat host array as named tensors to an ``.npz`` file."""
        np.savez(Path(path), **self.unflatten(flat))

    def load(self, path) -> np.ndarray:
        """Read an ``.npz`` of named tensors into a flat host array; a mismatch is refused."""
        with np.load(Path(path)) as data:
            return self.flatten({k: data[k] for k in data.files})

    def __eq__(self, other) -> bool:
        return isinstance(other, ParamLayout) and other.layers == self.layers

    def __repr__(self) -> str:
        return f"<ParamLayout {self.layers}: {self.parameter_count} parameters in {self.size} floats>"


class FlatBuffer(Closable):
    """One device buffer in a layout, with a view per weight and bias."""

    def __init__(self, layout: ParamLayout, host: np.ndarray | None = None):
        self.layout = layout
        host = np.zeros(layout.size, np.float32) if host is None else np.ascontiguousarray(host, np.float32)
        if host.shape != (layout.size,):  # before the allocation: nothing to free
            raise ValueError(f"host array has shape {host.shape}, the layout needs ({layout.size},)")
        self.buffer = DeviceBuffer.from_numpy(host)

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    def view(self, slot: Slot) -> DeviceBuffer:
        return self.buffer.view(np.float32, slot.shape, 4 * slot.offset)

    def weight(self, k: int) -> DeviceBuffer:
        return self.view(self.layout.weight(k))

    def bias(self, k: int) -> DeviceBuffer:
        return self.view(self.layout.bias(k))

    def to_numpy(self) -> dict[str, np.ndarray]:
        return self.layout.unflatten(self.buffer.to_numpy())

    def load_numpy(self, named: dict[str, np.ndarray]) -> None:
        self.buffer.copy_from_numpy(self.layout.flatten(named))

    def save(self, path) -> None:
        """Write the named tensors to an ``.npz`` file."""
        self.layout.save(path, self.buffer.to_numpy())

    def load(self, path) -> None:
        """Read an ``.npz`` written by ``save``; a different layout is refused, nothing changes."""
        self.buffer.copy_from_numpy(self.layout.load(path))

    def close(self) -> None:
        self.buffer.close()
