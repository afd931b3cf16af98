"""Reinforcement-learning pieces that live on the device: prioritized replay first."""
from .replay import Batch, ReplayBuffer
from .sumtree import ReplayError, SumTree

__all__ = ["Batch", "ReplayBuffer", "ReplayError", "SumTree"]
