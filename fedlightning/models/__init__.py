"""Reference models of the papers, as LightningModules (loss + torchmetrics accuracy)."""

from fedlightning.models.base import Classifier
from fedlightning.models.mlp import MLP, LogisticRegression

__all__ = ["Classifier", "MLP", "LogisticRegression"]
