#!/usr/bin/env python3
"""Train CartPole-v1 on the device for several seeds, with 10 envs and with 1 env, and time it.

For each run: wall time of the whole run (graphs launched by the host, the
replay, acting and learning on the device; evaluations included), the final
greedy evaluation (mean return of 100 episodes), and a breakdown measured on
the run's own captured graphs: device time of one acting iteration (forward,
epsilon-greedy, env step, replay insert) against one learning step. Goal:
500k env steps in <= 1 s with 10 envs and <= 3 s with 1 env; solved means a
mean evaluation return >= 475.
"""
import sys

import _common
from drvtrain import capture
from drvtrain.rl.trainer import TrainConfig, Trainer
from drvtrain.timing import time_graph


def breakdown(trainer, replays=200):
    """us of one acting iteration and of one learning step, from graphs of each alone."""
    s = trainer.stream
    with capture(s) as g:
        trainer.actor.enqueue(trainer.learner, stream=s, greedy=True)
    with g, g.instantiate() as act:  # closed before the trainer: its envs' close waits for them
        act_us = time_graph(act, s, replays=replays, repeats=3)
    with capture(s) as g:
        trainer.learner.enqueue(stream=s)
    with g, g.instantiate() as learn:
        learn_us = time_graph(learn, s, replays=replays, repeats=3)
    return act_us, learn_us


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds to run (default 0 1 2)")
    parser.add_argument("--envs", type=int, nargs="+", default=[10, 1], help="env counts to run (default 10 1)")
    parser.add_argument("--steps", type=int, default=500_000, help="env steps per run (default 500000)")
    args = parser.parse_args(argv)
    if args.steps < 1 or any(n < 1 for n in args.envs) or any(s < 0 for s in args.seeds):
        parser.error("--steps and --envs must be at least 1, --seeds at least 0")
    rows = []
    for n_envs in args.envs:
        for seed in args.seeds:
            # CartPole's defaults learn once per 10 env steps; an iteration of more envs learns once.
            overrides = dict(n_envs=n_envs, total_steps=args.steps, seed=seed, eval_every=args.steps,
                             train_every=max(10, n_envs))
            if n_envs == 1:
                overrides["unroll"] = 200
            cfg = TrainConfig.for_env("cartpole", **overrides)
            trainer = Trainer(cfg)
            summary = trainer.run(callback=lambda p: print(
                f"  envs {n_envs} seed {seed}: {p['env_steps']:>7} steps, {p['steps_per_s']:9.0f} steps/s, "
                f"return(100) {p['mean_return_100']:6.1f}, loss {p['loss']:.4f}, eps {p['epsilon']:.3f}"
                + (f", eval {p['eval_return']:.1f}" if p["eval_return"] is not None else ""), flush=True))
            act_us, learn_us = breakdown(trainer)
            iterations = trainer.iterations
            learns = summary["learning_steps"]
            rows.append((n_envs, seed, summary["wall_s"], summary["final_eval_return"], iterations * act_us / 1e6,
                         learns * learn_us / 1e6, act_us, learn_us))
            trainer.close()
    print("\n| envs | seed | wall s | eval return (100 ep) | solved | acting s (device) | learning s (device) | "
          "us/act iteration | us/learn step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n_envs, seed, wall, ret, act_s, learn_s, act_us, learn_us in rows:
        print(f"| {n_envs} | {seed} | {wall:.2f} | {ret:.1f} | {'yes' if ret >= 475 else 'no'} | {act_s:.2f} | "
              f"{learn_s:.2f} | {act_us:.1f} | {learn_us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
