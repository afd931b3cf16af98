"""The dueling Double-DQN training step with prioritized replay, written plainly in PyTorch.

The comparison point for drvtrain's resident step in the benchmarks: the same
arithmetic as the step specification, on the same random replay, as an eager step
or as one ``torch.cuda.CUDAGraph`` per step. PyTorch is imported inside the
functions, so this module imports on a machine without it.

What one step does, in order:

1. Stratified PER sample. The "sum tree" is the flat fp32 array of leaves
   ``p_i = priority_i ** alpha`` with a float64 inclusive cumulative sum taken each
   step; ``torch.searchsorted(cumsum, (j + U_j) * total / B, right=True)`` returns
   the first leaf whose prefix sum exceeds the mass, which is the leaf the tree
   walk of the specification returns. A mass rounded up to ``total`` is clamped to
   the last leaf; every priority here is positive, so that leaf is non-zero.
   ``U_j`` comes from a CUDA generator, so every graph replay draws fresh samples.
2. IS weights ``(N p_j / total) ** -beta`` divided by the batch maximum.
3. Forward passes (TF32 matmuls unless ``tf32=False``): online on ``s`` with
   autograd, online and target on ``s'`` without.
4. Dueling ``Q = V + A - mean A`` from one last layer of ``1 + n_actions`` outputs;
   Double-DQN target with ``argmax`` (first maximum on ties).
5. Loss ``mean(w * huber(td))`` with delta 1; backward in FP32.
6. Global gradient-norm clip, ``min(1, max_norm / (norm + 1e-6))``.
7. ``torch.optim.AdamW(lr, betas, eps, weight_decay, capturable=True)``.
8. Spectral projection of each hidden layer's weight: one power iteration from a
   persistent ``u``, then ``W *= min(1, c / sigma)``, in place, without autograd.
9. New priorities ``(|td| + 1e-6) ** alpha`` written into the leaves.
10. Polyak target update ``theta_t += tau (theta - theta_t)``.
11. Metrics into a pinned host tensor with one non-blocking copy (``METRICS``).

Not included: the non-finite guard that skips a step, and inserting new
transitions (the benchmark's replay is full and nothing is inserted).
"""
from __future__ import annotations

import contextlib
import copy
import math
import statistics

__all__ = ["METRICS", "TorchDQNStep"]

# The order of the values in TorchDQNStep.metrics.
METRICS = ("loss", "grad_norm", "clip_scale", "mean_q", "mean_abs_td", "sigma_max", "beta", "step")

PRIORITY_EPS = 1e-6
NORMALIZE_FLOOR = 1e-12


def _dueling(out):
    """Q [B, A] from the last layer's output [B, 1 + A]."""
    value, advantage = out[:, :1], out[:, 1:]
    return value + advantage - advantage.mean(dim=1, keepdim=True)


@contextlib.contextmanager
def _tf32_matmuls(enabled: bool):
    """TF32 for the matmuls issued inside the block; the previous setting afterwards."""
    import torch

    if not enabled:
        yield
        return
    flags = torch.backends.cuda.matmul
    previous = flags.allow_tf32
    flags.allow_tf32 = True
    try:
        yield
    finally:
        flags.allow_tf32 = previous


class TorchDQNStep:
    """One DQN learning step over a full random replay, eager (``step``) or graphed (``capture``).

    ``metrics`` is a pinned host tensor of float64 in the order of ``METRICS``;
    it holds the last finished step's values once that step's work is done (record
    a ``torch.cuda.Event`` after the step and query it before reading).
    """

    def __init__(self, obs_dim, hidden, n_actions, batch, capacity, *, gamma, alpha, beta, tau, max_norm, lr,
                 weight_decay, seed, device="cuda", betas=(0.9, 0.999), eps=1e-8, spectral_c=1.0, tf32=True):
        import torch

        if n_actions < 1:
            raise ValueError(f"n_actions must be at least 1, got {n_actions}")
        if batch < 1 or capacity < 1:
            raise ValueError(f"batch and capacity must be positive, got {batch} and {capacity}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"TorchDQNStep runs on a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.obs_dim, self.hidden, self.n_actions = obs_dim, list(hidden), n_actions
        self.batch, self.capacity = batch, capacity
        self.gamma, self.alpha, self.beta, self.tau = gamma, alpha, beta, tau
        self.max_norm, self.spectral_c, self.tf32 = max_norm, spectral_c, tf32
        dev = self.device

        # Every random number of the step comes from this generator on the device.
        self.generator = torch.Generator(device=dev)
        self.generator.manual_seed(seed)
        self._sample_generator = self.generator
        gen = self.generator

        # Networks: Linear + ReLU per hidden layer, then one layer of 1 + n_actions
        # outputs (column 0 is V). PyTorch's default init distribution, drawn from
        # the seeded generator: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for W and b.
        widths = [obs_dim] + self.hidden + [1 + n_actions]
        layers = []
        for k, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
            linear = torch.nn.Linear(fan_in, fan_out, device=dev)
            bound = 1.0 / math.sqrt(fan_in)
            with torch.no_grad():
                linear.weight.uniform_(-bound, bound, generator=gen)
                linear.bias.uniform_(-bound, bound, generator=gen)
            layers.append(linear)
            if k < len(widths) - 2:
                layers.append(torch.nn.ReLU())
        self.online = torch.nn.Sequential(*layers)
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        self._params = list(self.online.parameters())
        self._target_params = list(self.target.parameters())
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, betas=tuple(betas), eps=eps,
                                           weight_decay=weight_decay, capturable=True)

        # Spectral projection: every hidden layer's weight, each with a persistent u.
        self._hidden_weights = [m.weight for m in self.online if isinstance(m, torch.nn.Linear)][:-1]
        self._u = []
        for w in self._hidden_weights:
            u = torch.randn(w.shape[0], device=dev, generator=gen)
            self._u.append(u / u.norm().clamp_min(NORMALIZE_FLOOR))

        # The replay, full of random data: normal observations and rewards, 5% done,
        # priorities uniform in [0.1, 1.1). Leaves hold priority ** alpha.
        c = capacity
        self.obs = torch.randn(c, obs_dim, device=dev, generator=gen)
        self.next_obs = torch.randn(c, obs_dim, device=dev, generator=gen)
        self.action = torch.randint(0, n_actions, (c,), device=dev, generator=gen, dtype=torch.int32)
        self.reward = torch.randn(c, device=dev, generator=gen)
        self.done = (torch.rand(c, device=dev, generator=gen) < 0.05).float()
        priority = torch.rand(c, device=dev, generator=gen) + 0.1
        self.leaves = priority.pow(alpha)
        self.stored = c  # N of the IS weights: the replay is full

        self._strata = torch.arange(batch, device=dev, dtype=torch.float64)
        self._beta = torch.full((1,), float(beta), device=dev, dtype=torch.float32)
        self._step_count = torch.zeros(1, device=dev, dtype=torch.float64)
        self.metrics = torch.zeros(len(METRICS), dtype=torch.float64, pin_memory=True)
        self._replay = self._graph = None
        torch.cuda.synchronize(dev)

    # ------------------------------------------------------------------ the step
    def _sample(self):
        """Stratified indices [B] (int64) and IS weights [B] (fp32); no host sync."""
        import torch

        cumsum = torch.cumsum(self.leaves, 0, dtype=torch.float64)
        total = cumsum[-1]
        u = torch.rand(self.batch, device=self.device, dtype=torch.float64, generator=self._sample_generator)
        mass = (self._strata + u) * (total / self.batch)
        idx = torch.searchsorted(cumsum, mass, right=True).clamp_(max=self.capacity - 1)
        p = self.leaves[idx].double()
        w = (self.stored * p / total).pow(-self.beta)
        return idx, (w / w.max()).float()

    def _spectral_project(self):
        """One power iteration per hidden weight, then ``W *= min(1, c / sigma)``; returns max sigma."""
        import torch

        sigmas = []
        with torch.no_grad():
            for w, u in zip(self._hidden_weights, self._u):
                v = w.t().mv(u)
                v = v / v.norm().clamp_min(NORMALIZE_FLOOR)
                wv = w.mv(v)
                u.copy_(wv / wv.norm().clamp_min(NORMALIZE_FLOOR))
                sigma = torch.dot(u, wv)
                w.mul_(torch.clamp(self.spectral_c / sigma, max=1.0))
                sigmas.append(sigma)
        if not sigmas:
            return torch.zeros((), device=self.device)
        return torch.stack(sigmas).max()

    def _body(self):
        """Stages 1-11 with the gradients already set to None; the order of the specification."""
        import torch
        import torch.nn.functional as F

        idx, weights = self._sample()
        obs, next_obs = self.obs[idx], self.next_obs[idx]
        action = self.action[idx].long()
        reward, done = self.reward[idx], self.done[idx]

        with _tf32_matmuls(self.tf32):
            out = self.online(obs)
            with torch.no_grad():
                next_online = self.online(next_obs)
                next_target = self.target(next_obs)
        with torch.no_grad():
            a_star = _dueling(next_online).argmax(dim=1, keepdim=True)  # first maximum on ties
            q_next = _dueling(next_target).gather(1, a_star).squeeze(1)
            y = reward + self.gamma * (1.0 - done) * q_next
        q_taken = _dueling(out).gather(1, action.unsqueeze(1)).squeeze(1)
        loss = (weights * F.huber_loss(q_taken, y, reduction="none", delta=1.0)).mean()
        loss.backward()  # FP32: the TF32 setting applied to the forward matmuls only

        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, self.max_norm)
        self.optimizer.step()
        sigma_max = self._spectral_project()

        with torch.no_grad():
            td = y - q_taken.detach()
            abs_td = td.abs()
            self.leaves.index_put_((idx,), (abs_td + PRIORITY_EPS).pow(self.alpha))
            if hasattr(torch, "_foreach_lerp_"):
                torch._foreach_lerp_(self._target_params, self._params, self.tau)
            else:
                for t, p in zip(self._target_params, self._params):
                    t.lerp_(p, self.tau)
            self._step_count += 1
            clip_scale = torch.clamp(self.max_norm / (grad_norm + 1e-6), max=1.0)
            scalars = torch.stack([loss.detach(), grad_norm.float(), clip_scale.float(), q_taken.detach().mean(),
                                   abs_td.mean(), sigma_max.float(), self._beta[0]])
            self.metrics.copy_(torch.cat([scalars.double(), self._step_count]), non_blocking=True)

    def step(self) -> None:
        """One eager step on the current stream."""
        import torch

        with torch.cuda.device(self.device):
            self.optimizer.zero_grad(set_to_none=True)
            self._body()

    def capture(self, warmup: int = 3):
        """Capture one step into a ``torch.cuda.CUDAGraph``; returns its ``replay``.

        Warms up on a side stream first (AdamW creates its state there); the
        gradients the capture allocates stay the graph's own. Each replay draws
        fresh samples: the generator is registered with the graph where PyTorch
        supports that, else the sampler falls back to the device's default CUDA
        generator, the one every PyTorch version advances on each replay.
        """
        import torch

        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if hasattr(graph, "register_generator_state"):
                graph.register_generator_state(self.generator)
            else:
                self._sample_generator = None
            self.optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                self._body()
        self._replay = graph.replay
        self._graph = graph  # keeps the graph and its memory pool alive
        return graph.replay

    def time_us(self, replays: int = 500, repeats: int = 5, graph: bool = True, warmup: int = 10) -> float:
        """Median over ``repeats`` of the device time of ``replays`` back-to-back steps, / ``replays``, in us.

        ``graph=True`` replays the captured step (captured on first use);
        ``graph=False`` runs eager steps.
        """
        import torch

        if graph:
            if self._replay is None:
                self.capture()
            run = self._replay
        else:
            run = self.step
        with torch.cuda.device(self.device):
            for _ in range(warmup):
                run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            samples = []
            for _ in range(repeats):
                start.record()
                for _ in range(replays):
                    run()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / replays)
        return statistics.median(samples)

    def read_metrics(self) -> dict:
        """The last step's metrics by name; waits for the device's queued work first."""
        import torch

        torch.cuda.synchronize(self.device)
        return dict(zip(METRICS, self.metrics.tolist()))
