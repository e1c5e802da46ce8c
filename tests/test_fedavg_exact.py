"""FedAvg + SGD through the FederatedLoop equals a hand-written PyTorch reference loop (same clients, same batches),
in float64: the two sum in different orders (tests/numerics.py)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP, LogisticRegression
from numerics import Digits64, assert_close64, to_float64


def reference_fedavg(model, dm, rounds, clients_per_round, local_steps, lr, seed, server_lr=1.0, weighting="samples"):
    """Plain-PyTorch FedAvg: explicit SGD updates with torch.autograd.grad, explicit weighted averaging."""
    dm.setup("fit")
    dm.configure_rounds(clients_per_round, local_steps, seed)
    net = copy.deepcopy(model.net)
    glob = [p.detach().clone() for p in net.parameters()]
    for r in range(rounds):
        clients = dm.sample_clients(r)
        sums = [torch.zeros_like(g) for g in glob]
        total = 0.0
        for cid in clients:
            w = [g.clone().requires_grad_(True) for g in glob]
            loader = dm.client_dataloader(cid, r, seed=seed)
            it = iter(loader)
            for _ in range(local_steps):
                try:
                    x, y = next(it)
                except StopIteration:
                    it = iter(loader)
                    x, y = next(it)
                out = torch.func.functional_call(net, dict(zip([n for n, _ in net.named_parameters()], w)), (x,))
                loss = F.cross_entropy(out, y)
                grads = torch.autograd.grad(loss, w)
                w = [(wi - lr * gi).detach().requires_grad_(True) for wi, gi in zip(w, grads)]
            p = float(dm.client_num_samples(cid)) if weighting == "samples" else 1.0
            total += p
            for s, g, wi in zip(sums, glob, w):
                s += p * (g - wi.detach())
        glob = [g - server_lr * s / total for g, s in zip(glob, sums)]
    return glob


@pytest.mark.numerics
@pytest.mark.parametrize(
    "model_fn,weighting,server_lr",
    [
        (lambda: LogisticRegression(input_dim=64, num_classes=10), "samples", 1.0),
        (lambda: MLP(input_dim=64, hidden=[16], num_classes=10), "uniform", 0.7),
    ],
)
def test_fedavg_matches_reference_loop(model_fn, weighting, server_lr):
    torch.manual_seed(1)
    model = to_float64(model_fn())
    init = copy.deepcopy(model)
    rounds, cpr, k, lr, seed = 4, 5, 7, 0.2, 3
    dm = Digits64(num_clients=12, batch_size=16, partition=Dirichlet(0.5), seed=2)
    loop = FederatedLoop(
        model, client_optimizer=lambda p: torch.optim.SGD(p, lr=lr), local_steps=k, clients_per_round=cpr, seed=seed
    )
    trainer = make_trainer(rounds, callbacks=[FedAvg(server_lr=server_lr, weighting=weighting)])
    trainer.fit(loop, datamodule=dm)
    assert trainer.global_step == rounds
    dm_ref = Digits64(num_clients=12, batch_size=16, partition=Dirichlet(0.5), seed=2)
    ref = reference_fedavg(init, dm_ref, rounds, cpr, k, lr, seed, server_lr=server_lr, weighting=weighting)
    got = list(loop.model.net.parameters())
    assert len(got) == len(ref)
    moved = sum(float((g.detach() - p0.detach()).abs().sum()) for g, p0 in zip(got, init.net.parameters()))
    assert moved > 1e-2  # training really changed the model
    for g, r in zip(got, ref):
        assert_close64(g.detach(), r)


def test_clients_cycle_their_loader_and_keep_partial_batches():
    """A client with fewer samples than needed for K steps cycles through new shuffled epochs."""
    dm = DigitsDataModule(num_clients=100, batch_size=50, partition=Dirichlet(0.3), seed=0)
    dm.setup("fit")
    dm.configure_rounds(5, 3, seed=0)
    small = int(np.argmin([dm.client_num_samples(i) for i in range(dm.num_clients)]))
    n = dm.client_num_samples(small)
    assert n < 50
    loader = dm.client_dataloader(small, round=0, seed=0)
    epoch1 = [b[1] for b in loader]
    epoch2 = [b[1] for b in loader]
    assert len(epoch1) == 1 and len(epoch1[0]) == n  # the last partial batch is kept
    assert sorted(epoch1[0].tolist()) == sorted(epoch2[0].tolist())
    # same (seed, round, client) -> same order; another round -> (almost surely) another order
    again = [b[0] for b in dm.client_dataloader(small, round=0, seed=0)]
    assert torch.equal(again[0], next(iter(dm.client_dataloader(small, round=0, seed=0)))[0])
    big = int(np.argmax([dm.client_num_samples(i) for i in range(dm.num_clients)]))
    b0 = next(iter(dm.client_dataloader(big, round=0, seed=0)))[0]
    b1 = next(iter(dm.client_dataloader(big, round=1, seed=0)))[0]
    assert not torch.equal(b0, b1)
