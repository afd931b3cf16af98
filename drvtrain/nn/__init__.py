"""The network and optimizer engine: flat parameters, fused MLP kernels, clip and AdamW, metrics."""
from .layout import FlatBuffer, ParamLayout
from .metrics import Metrics, StepMetrics
from .mlp import MLP
from .optim import AdamW
from .regression import RegressionStep

__all__ = ["AdamW", "FlatBuffer", "MLP", "Metrics", "ParamLayout", "RegressionStep", "StepMetrics"]
