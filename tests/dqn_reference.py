"""Float64 numpy references for the dueling Double-DQN step (docs/step-spec.md, stages 3-11).

Sampling and the importance weights (stages 1-2) are in ``per_reference``; the
MLP, clipping and AdamW pieces come from ``nn_reference``.
"""
import math

import numpy as np

from nn_reference import adamw, clip_scale, mlp_backward, mlp_forward

PRIORITY_EPS = 1e-6
NORMALIZE_FLOOR = 1e-12


def dueling_q(out: np.ndarray) -> np.ndarray:
    """Q [B, A] from the last layer's output [B, 1 + A]: V + A - mean(A)."""
    out = np.asarray(out, np.float64)
    value, adv = out[:, :1], out[:, 1:]
    return value + (adv - adv.mean(axis=1, keepdims=True))


def huber(x, delta=1.0):
    x = np.asarray(x, np.float64)
    ax = np.abs(x)
    return np.where(ax < delta, 0.5 * x * x, delta * (ax - 0.5 * delta))


def huber_grad(x, delta=1.0):
    x = np.asarray(x, np.float64)
    return np.where(np.abs(x) < delta, x, delta * np.sign(x))


def beta_at(k: int, start: float, end: float, steps: int) -> float:
    """The importance exponent for the sample drawn after ``k`` earlier ones."""
    if steps <= 0:
        return float(end)
    return float(start + (end - start) * min(1.0, k / steps))


def _normalize(x: np.ndarray) -> np.ndarray:
    return x / max(float(np.linalg.norm(x)), NORMALIZE_FLOOR)


def spectral_project(w: np.ndarray, u: np.ndarray, c=1.0):
    """One power iteration from ``u``, then ``W * min(1, c / sigma)``; returns (w_new, u_new, sigma)."""
    w = np.asarray(w, np.float64)
    v = _normalize(w.T @ np.asarray(u, np.float64))
    wv = w @ v
    u_new = _normalize(wv)
    sigma = float(u_new @ wv)
    w_new = w * (c / sigma) if sigma > c else w.copy()
    return w_new, u_new, sigma


def dqn_loss(q_s_out, q_next_online_out, q_next_target_out, action, reward, done, weights,
             gamma, delta=1.0, a_star=None) -> dict:
    """Loss, TD errors and the gradient by the online output on ``s`` (stages 4-6).

    ``a_star`` replaces the argmax when given: a trajectory test feeds the
    device's choice, as it feeds the sampled indices, because a near tie that
    float32 and float64 break differently would otherwise fork the two runs."""
    q = dueling_q(q_s_out)
    batch, n_actions = q.shape
    rows = np.arange(batch)
    action = np.asarray(action, np.int64)
    reward, done, weights = (np.asarray(a, np.float64) for a in (reward, done, weights))
    if a_star is None:
        a_star = np.argmax(dueling_q(q_next_online_out), axis=1)  # argmax keeps the first maximum
    a_star = np.asarray(a_star, np.int64)
    q_next = dueling_q(q_next_target_out)[rows, a_star]
    y = reward + gamma * (1.0 - done) * q_next
    q_taken = q[rows, action]
    td = y - q_taken
    loss = float(np.mean(weights * huber(td, delta)))
    g = -weights * huber_grad(td, delta) / batch
    dout = np.empty((batch, 1 + n_actions))
    dout[:, 0] = g
    onehot = np.zeros((batch, n_actions))
    onehot[rows, action] = 1.0
    dout[:, 1:] = g[:, None] * (onehot - 1.0 / n_actions)
    return {"q": q, "a_star": a_star, "y": y, "td": td, "loss": loss, "dout": dout,
            "priorities": np.abs(td) + PRIORITY_EPS, "mean_q": float(q_taken.mean()),
            "mean_abs_q": float(np.abs(q_taken).mean()), "mean_abs_td": float(np.abs(td).mean())}


def _named(layout, flat: np.ndarray) -> dict:
    return {s.name: flat[s.offset: s.offset + s.size].reshape(s.shape) for s in layout.slots}


def _flat(layout, named: dict) -> np.ndarray:
    flat = np.zeros(layout.size)
    for s in layout.slots:
        flat[s.offset: s.offset + s.size] = named[s.name].reshape(-1)
    return flat


def _check_config(layout, cfg) -> list:
    out_features = layout.layers[-1][0]
    if out_features < 2:
        raise ValueError(f"the output layer needs 1 + n_actions >= 2 outputs, got {out_features}")
    if (cfg.get("tau") is None) == (cfg.get("target_period") is None):
        raise ValueError("set exactly one of tau (Polyak) and target_period (hard copy)")
    if cfg.get("target_period") is not None and int(cfg["target_period"]) < 1:
        raise ValueError(f"target_period must be at least 1, got {cfg['target_period']}")
    layers = len(layout.layers)
    chosen = cfg.get("spectral_layers")
    chosen = list(range(layers - 1)) if chosen is None else [int(k) for k in chosen]
    bad = [k for k in chosen if not 0 <= k < layers]
    if bad:
        raise ValueError(f"spectral_layers {bad} are not layers of a {layers}-layer network")
    return chosen


def dqn_step(layout, state: dict, batch: dict, cfg: dict) -> dict:
    """One learning step after sampling (stages 3-11); the inputs are not modified.

    Returns the new state (params, target, m, v, t, u) with the step's outputs:
    priorities (None on a skipped step: nothing is written), loss, grad_norm,
    clip_scale, mean_q, mean_abs_td, sigma {layer: sigma}, sigma_max, skipped.
    """
    spectral_layers = _check_config(layout, cfg)
    missing = [k for k in spectral_layers if k not in state["u"]]
    if missing:
        raise ValueError(f"no spectral u vector for layers {missing}")
    nlayers = len(layout.layers)
    params, target, m, v = (np.array(state[k], np.float64) for k in ("params", "target", "m", "v"))
    t = int(state["t"])
    u = {k: np.array(vec, np.float64) for k, vec in state["u"].items()}

    online, target_named = _named(layout, params), _named(layout, target)
    acts = mlp_forward(online, batch["obs"], nlayers)
    next_online = mlp_forward(online, batch["next_obs"], nlayers)[-1]
    next_target = mlp_forward(target_named, batch["next_obs"], nlayers)[-1]
    res = dqn_loss(acts[-1], next_online, next_target, batch["action"], batch["reward"],
                   batch["done"], batch["weights"], cfg["gamma"], cfg.get("huber_delta", 1.0),
                   batch.get("a_star"))
    grad = _flat(layout, mlp_backward(online, acts, res["dout"], batch.get("masks")))
    grad_norm, scale = clip_scale(grad, cfg["max_norm"])

    out = {"loss": res["loss"], "grad_norm": grad_norm, "mean_q": res["mean_q"], "mean_abs_q": res["mean_abs_q"],
           "mean_abs_td": res["mean_abs_td"]}
    if not (math.isfinite(res["loss"]) and math.isfinite(grad_norm)):
        return {**out, "params": params, "target": target, "m": m, "v": v, "t": t, "u": u,
                "priorities": None, "clip_scale": 0.0, "sigma": {}, "sigma_max": 0.0, "skipped": True}

    t += 1
    b1, b2 = cfg["betas"]
    params, m, v = adamw(params, m, v, scale * grad, t, cfg["lr"], b1, b2, cfg["eps"], cfg["weight_decay"])

    sigma = {}
    c = cfg.get("spectral_c", 1.0)
    for k in spectral_layers:
        slot = layout.weight(k)
        w = params[slot.offset: slot.offset + slot.size].reshape(slot.shape)
        w_new, u[k], sigma[k] = spectral_project(w, u[k], c)
        params[slot.offset: slot.offset + slot.size] = w_new.reshape(-1)

    if cfg.get("tau") is not None:
        target = target + cfg["tau"] * (params - target)
    elif t % int(cfg["target_period"]) == 0:
        target = params.copy()

    return {**out, "params": params, "target": target, "m": m, "v": v, "t": t, "u": u,
            "priorities": res["priorities"], "clip_scale": scale, "sigma": sigma,
            "sigma_max": max(sigma.values(), default=0.0), "skipped": False}
