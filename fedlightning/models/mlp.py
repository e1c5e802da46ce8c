"""Fully connected models: multinomial logistic regression and an MLP."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fedlightning._validation import in_range, integer
from fedlightning.models.base import Classifier

__all__ = ["LogisticRegression", "MLP"]


class LogisticRegression(Classifier):
    """Multinomial logistic regression ``softmax(Wx + b)`` with cross-entropy (convex).

    Seed 000 uses it on FEMNIST; seed 001 on LIBSVM data and MNIST; the FedDANE paper (seed 003, "mclr") on
    Synthetic(α, β) with 60 inputs and 10 classes. Inputs are flattened.
    """

    def __init__(self, input_dim: int = 64, num_classes: int = 10, lr: float = 0.1):
        super().__init__(num_classes=num_classes, lr=lr)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(integer("input_dim", input_dim), self.num_classes))


class MLP(Classifier):
    """Multi-layer perceptron with ReLU activations (and optional dropout) on flattened inputs.

    Default ``hidden=(200, 200)``: the 2-hidden-layer 200-unit network of McMahan et al. 2017 (also seed 004's
    "FC-200"-style DNN); the quickstart uses ``hidden=[128]`` on the 64 digits features (ours).
    """

    def __init__(
        self,
        input_dim: int = 64,
        num_classes: int = 10,
        hidden: Sequence[int] = (200, 200),
        dropout: float = 0.0,
        lr: float = 0.1,
    ):
        super().__init__(num_classes=num_classes, lr=lr)
        prev = integer("input_dim", input_dim)
        sizes = [integer(f"hidden[{i}]", h) for i, h in enumerate(hidden)]
        dropout = in_range("dropout", dropout, 0.0, 1.0)
        layers: list = [nn.Flatten()]
        for h in sizes:
            layers += [nn.Linear(prev, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            prev = h
        layers.append(nn.Linear(prev, self.num_classes))
        self.net = nn.Sequential(*layers)
