"""How far rounding carries in a user's torchvision ResNet-18 trained on tiny BatchNorm batches (CPU, ~1 min).

    python benchmarks/bn_conditioning.py

One FedAvg round (SGD lr 0.01, the CIFAR configs' client rate, K = 2, all 4 clients) of torchvision's
``resnet18(num_classes=10)`` in a plain ``LightningModule`` on random 3x16x16 images (1x1 feature maps from
``layer3`` on), for two splits: clients of 1, 3, 5 and 6 samples with batch 4 (last batches of 1-3 samples) and of 1, 9,
17 and 25 samples with batch 8 (real batches of 8; the one-sample clients fail in both modes). Printed per split, as the
largest difference of the global weights after the round: sequential float32 vs sequential float64 (rounding of a whole
run), sequential float64 vs the same run from initial weights scaled by 1 + 1e-15 (how much the training amplifies a
last-bit change), and sequential vs vectorized in float64 (the modes' arithmetic). docs/benchmarks.md §8 reads these
numbers: the vectorized-vs-sequential difference of such a run in float32 says nothing about the modes when the first
two rows are of its size.
"""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
import torchvision

from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import ArrayDataset, FederatedDataModule


class Images(FederatedDataModule):
    """One client per size, holding random 3x16x16 images of 10 classes."""

    def __init__(self, sizes, batch_size):
        super().__init__(num_clients=len(sizes), batch_size=batch_size, seed=0, val_fraction=0.0)
        self.sizes = list(sizes)

    def load(self):
        g = torch.Generator().manual_seed(1)
        n = sum(self.sizes)
        data = ArrayDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))
        return data, data, data.y.numpy()

    def natural_clients(self):
        ends = np.cumsum(self.sizes)
        return [np.arange(e - s, e) for e, s in zip(ends, self.sizes)]


class ResNet(pl.LightningModule):
    def __init__(self, dtype, scale=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.net = torchvision.models.resnet18(num_classes=10).to(dtype)
        with torch.no_grad():
            for p in self.net.parameters():
                p.mul_(scale)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x.to(next(self.parameters()).dtype)), y)


def run(sizes, batch, mode="sequential", dtype=torch.float64, scale=1.0):
    model = ResNet(dtype, scale)
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        local_steps=2,
        clients_per_round=len(sizes),
        seed=0,
        client_execution=mode,
        on_client_error="skip",
    )  # the one-sample clients raise (BatchNorm) and are left out
    pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[FedAvg()],
    ).fit(loop, datamodule=Images(sizes, batch))
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def main():
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "fedlightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    print(f"{'split':34s} {'seq f32 vs f64':>15s} {'f64 vs f64*(1+1e-15)':>21s} {'seq vs vec f64':>15s}")
    for sizes, batch in (([1, 3, 5, 6], 4), ([1, 9, 17, 25], 8)):
        ref = run(sizes, batch)
        rows = [
            run(sizes, batch, dtype=torch.float32),
            run(sizes, batch, scale=1 + 1e-15),
            run(sizes, batch, mode="vectorized"),
        ]
        diffs = [float((ref - r).abs().max()) for r in rows]
        print(f"{f'clients {sizes}, batch {batch}':34s} {diffs[0]:15.1e} {diffs[1]:21.1e} {diffs[2]:15.1e}", flush=True)


if __name__ == "__main__":
    main()
