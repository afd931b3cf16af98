"""Float64 numpy references for the MLP engine (docs/step-spec.md, steps 5-7)."""
from fractions import Fraction

import numpy as np


def f32_round(x: Fraction) -> np.float32:
    """The float32 nearest the exact rational ``x`` (ties to even), rounded once.

    float(x) is the correctly rounded float64, but rounding that again to
    float32 can land on the wrong side of a tie; so the candidates around it
    are compared exactly."""
    c = np.float32(float(x))
    best = None
    for cand in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        err = abs(Fraction(float(cand)) - x)
        if best is None or err < best[0] or (err == best[0] and int(cand.view(np.uint32)) % 2 == 0):
            best = (err, cand)
    return best[1]


def mlp_forward(named: dict, x: np.ndarray, layers: int) -> list[np.ndarray]:
    """Activations [x, h1, ..., out]; ReLU after every layer but the last."""
    acts = [np.asarray(x, np.float64)]
    for k in range(layers):
        w = named[f"layer{k}.weight"].astype(np.float64)
        b = named[f"layer{k}.bias"].astype(np.float64)
        z = acts[-1] @ w.T + b
        acts.append(np.maximum(z, 0.0) if k < layers - 1 else z)
    return acts


def forward_scales(named: dict, acts: list[np.ndarray]) -> list[np.ndarray]:
    """Per layer, the size of what its outputs sum: |W| |a| + |b| elementwise, from the
    float64 activations ``acts`` of mlp_forward. A rounding error in the products (TF32
    operands) is a fraction of this, however much the terms cancel in the result."""
    out = []
    for k in range(len(acts) - 1):
        w = np.abs(named[f"layer{k}.weight"].astype(np.float64))
        b = np.abs(named[f"layer{k}.bias"].astype(np.float64))
        out.append(np.abs(acts[k]) @ w.T + b)
    return out


def scaled_rel(got, want, scale) -> float:
    """||got - want|| / ||scale||: the error against the size of the summands (forward_scales)
    rather than of a result they may cancel to; NaN anywhere fails."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if np.isnan(got).any():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(scale), 1e-300))


def mlp_backward(named: dict, acts: list[np.ndarray], dout: np.ndarray, masks=None) -> dict:
    """Gradients of a loss whose derivative by the output is ``dout``. ``masks``: the ReLU
    decisions of the hidden layers (one boolean array per hidden layer) to use instead of
    ``acts[k] > 0``."""
    layers = len(acts) - 1
    grads, dy = {}, np.asarray(dout, np.float64)
    for k in range(layers - 1, -1, -1):
        x = acts[k]
        grads[f"layer{k}.weight"] = dy.T @ x
        grads[f"layer{k}.bias"] = dy.sum(axis=0)
        if k > 0:
            keep = x > 0 if masks is None else masks[k - 1]
            dy = (dy @ named[f"layer{k}.weight"].astype(np.float64)) * keep
    return grads


def mse(pred: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    d = np.asarray(pred, np.float64) - target
    return float(np.mean(d * d)), 2.0 * d / d.size


def clip_scale(grads_flat: np.ndarray, max_norm: float) -> tuple[float, float]:
    norm = float(np.sqrt(np.sum(np.asarray(grads_flat, np.float64) ** 2)))
    return norm, min(1.0, max_norm / (norm + 1e-6))


def adamw(theta, m, v, g, t, lr, b1, b2, eps, wd):
    """One PyTorch AdamW step in float64 (g already clipped); returns new (theta, m, v)."""
    theta = theta * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    theta = theta - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return theta, m, v


def rel(got, want) -> float:
    """Relative error ||got - want|| / ||want||; NaN anywhere fails."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if np.isnan(got).any():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))
