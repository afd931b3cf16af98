"""Reinforcement learning on the device: prioritized replay and the Double-DQN step."""
from .dqn import DQNConfig, DQNStep, TrainingError
from .replay import Batch, ReplayBuffer
from .sumtree import ReplayError, SumTree

__all__ = ["Batch", "DQNConfig", "DQNStep", "ReplayBuffer", "ReplayError", "SumTree", "TrainingError"]
