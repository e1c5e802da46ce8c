"""Models written as a user writes them (no fedlightning-specific method), shared by the benchmarks."""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
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
