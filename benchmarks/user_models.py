"""Models written as a user writes them (no fedlightning-specific method), shared by the benchmarks.

Every class is a plain ``LightningModule``: ``training_step`` returns a mean loss of ``torch.nn.functional``, logs
with ``self.log`` and ``configure_optimizers`` gives SGD (used when the FederatedLoop gets no ``client_optimizer``).
The digits models read rows of 64 pixel values; :class:`UserCharLSTM` and :class:`UserCharGRU` read LEAF
Shakespeare's windows of character codes.
"""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


class UserMLP(pl.LightningModule):
    """The digits MLP 64-128-10 as a user writes it: ``nn.Sequential``, mean ``F.cross_entropy``, ``self.log`` of the
    loss, its own ``configure_optimizers`` (used when the FederatedLoop gets no ``client_optimizer``)."""

    uses_own_optimizer = True

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class MetricsMLP(UserMLP):
    """:class:`UserMLP` that also updates and logs a torchmetrics accuracy in ``training_step``."""

    def __init__(self, lr: float = 0.1):
        super().__init__(lr)
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc)
        self.log("train_loss", loss)
        return loss


class DropoutMLP(UserMLP):
    """:class:`UserMLP` with dropout 0.2 after the hidden layer (a model with random layers)."""

    def __init__(self, lr: float = 0.1):
        super().__init__(lr)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))


class WideMLP(UserMLP):
    """:class:`UserMLP` with two hidden layers of 1024 units (1.1 M weights: compute-bound steps)."""

    def __init__(self, lr: float = 0.1):
        super().__init__(lr)
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


class UserCNN(UserMLP):
    """A user CNN on the 8x8 digit images: conv 3x3 with 8 channels, ReLU, 2x2 max-pooling, linear 128-10."""

    def __init__(self, lr: float = 0.1):
        super().__init__(lr)
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(128, 10),
        )


class BatchNormCNN(UserMLP):
    """:class:`UserCNN` with BatchNorm2d after the convolution."""

    def __init__(self, lr: float = 0.1):
        super().__init__(lr)
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(128, 10),
        )


class UserCharLSTM(UserMLP):
    """A user's next-character model for LEAF Shakespeare: embedding 80→8, one ``nn.LSTM`` layer of 64 units, a
    linear head on the last time step; SGD lr 0.8 (LEAF's Shakespeare rate)."""

    def __init__(self, lr: float = 0.8, vocab: int = 80, hidden: int = 64):
        super().__init__(lr)
        self.net = None
        self.embed = nn.Embedding(vocab, 8)
        self.lstm = nn.LSTM(8, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        out, _ = self.lstm(self.embed(x.long()))
        return self.head(out[:, -1])


class UserCharGRU(UserMLP):
    """:class:`UserCharLSTM` with one ``nn.GRU`` layer of 64 units in place of the LSTM (a GRU text classifier):
    embedding 80→8, GRU 64, a linear head on the last time step; SGD lr 0.8."""

    def __init__(self, lr: float = 0.8, vocab: int = 80, hidden: int = 64):
        super().__init__(lr)
        self.net = None
        self.embed = nn.Embedding(vocab, 8)
        self.gru = nn.GRU(8, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        out, _ = self.gru(self.embed(x.long()))
        return self.head(out[:, -1])


class UserResNet18(UserMLP):
    """torchvision's ``resnet18(num_classes=10)`` as a user trains it on CIFAR-10: BatchNorm layers (running
    statistics), mean ``F.cross_entropy``, SGD lr 0.01 (the FedExP-SLS CIFAR config's client rate)."""

    def __init__(self, lr: float = 0.01, num_classes: int = 10):
        super().__init__(lr)
        import torchvision

        self.net = torchvision.models.resnet18(num_classes=num_classes)
