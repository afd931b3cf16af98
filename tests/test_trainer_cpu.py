"""TrainConfig validation and its JSON round trip (CPU)."""
import json

import pytest

from drvtrain.rl.trainer import ENV_DEFAULTS, TrainConfig


def test_cartpole_defaults_are_valid_and_round_trip_through_json():
    cfg = TrainConfig.for_env("cartpole")
    assert cfg.n_envs == ENV_DEFAULTS["cartpole"]["n_envs"]
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    tweaked = TrainConfig.for_env("cartpole", seed=7, dqn=dict(lr=1e-3))
    assert tweaked.dqn["lr"] == 1e-3 and tweaked.dqn["hidden"] == ENV_DEFAULTS["cartpole"]["dqn"]["hidden"]


@pytest.mark.parametrize("overrides, match", [
    (dict(env="pong"), "unknown environment 'pong'"),
    (dict(n_envs=0), "n_envs"),
    (dict(total_steps=0), "total_steps"),
    (dict(train_every=5, n_envs=10), "train_every"),
    (dict(eps_start=1.5), "eps_start"),
    (dict(eval_episodes=0), "eval_episodes"),
    (dict(dqn=dict(lr=-1.0)), "lr"),
    (dict(dqn=dict(obs_dim=3)), "set by the trainer"),
    (dict(dqn=dict(no_such_field=1)), "not DQNConfig's"),
])
def test_bad_settings_name_the_field(overrides, match):
    env = overrides.pop("env", "cartpole")
    with pytest.raises(ValueError, match=match):
        if env != "cartpole":
            TrainConfig(env=env)
        else:
            TrainConfig.for_env(env, **overrides)


def test_unknown_settings_in_a_dict_are_refused():
    data = TrainConfig.for_env("cartpole").to_dict()
    data["learning_rate"] = 0.1
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig.from_dict(data)


def test_epsilon_schedule_spans_a_fraction_of_the_run_and_at_least_one_step():
    cfg = TrainConfig(total_steps=10_000, eps_start=0.9, eps_end=0.1, eps_fraction=0.25)
    assert cfg.epsilon_schedule == (0.9, 0.1, 2500)
    assert TrainConfig(total_steps=10_000, eps_fraction=0.0).epsilon_schedule[2] == 1
