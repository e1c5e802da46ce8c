r"""FC-200 DNN of seed 004 (Mills, Hu, Min, "Faster Federated Learning with Decaying Number of Local SGD Steps").

.. math::
    f(x) = W_3\,\mathrm{ReLU}(W_2\,\mathrm{ReLU}(W_1 x + b_1) + b_2) + b_3,
    \qquad x \in \mathbb{R}^{784},\ f(x) \in \mathbb{R}^{62}

Seed 004, Table I / §6: FEMNIST, "FC-200 ReLU, FC-200 ReLU, softmax output", model size 6.71 Mb = 209,662 float32
parameters (784·200+200 + 200·200+200 + 200·62+62). The same 2×200 network is McMahan et al. 2017's "2NN".
"""

from __future__ import annotations

from fedlightning.models.mlp import MLP

__all__ = ["FC200"]


class FC200(MLP):
    """Two fully connected ReLU layers of 200 units and a linear output layer, on flattened inputs.

    Args:
        input_dim: input features (default 784 = a flattened 28×28 FEMNIST image, seed 004).
        num_classes: classes (default 62 = FEMNIST's digits + upper + lower case letters, seed 004).
        lr: learning rate when trained on its own (``Classifier``); federated runs use the client optimizer.
    """

    def __init__(self, input_dim: int = 784, num_classes: int = 62, lr: float = 0.1):
        super().__init__(input_dim=input_dim, num_classes=num_classes, hidden=(200, 200), dropout=0.0, lr=lr)
