"""The README's code examples run and do what the README says (compared with built-in equivalents)."""

import os
import re

import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, ProximalTerm
from fedlightning.datamodules import Dirichlet
from numerics import RTOL64, Digits64, assert_close64, rtol32, to_float64

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _block(marker: str) -> dict:
    blocks = re.findall(r"```python\n(.*?)```", open(README, encoding="utf-8").read(), flags=re.S)
    code = next(b for b in blocks if marker in b)
    namespace: dict = {}
    exec(compile(code, README, "exec"), namespace)  # noqa: S102 - the repository's own README
    return namespace


def _fit(model, callbacks, rounds=2, optimizer=None):
    """Train ``model`` in float64 (converted in place; float64 data): different code paths are compared to
    numerics.RTOL64."""
    loop = FederatedLoop(to_float64(model), optimizer, local_steps=3, clients_per_round=3, seed=2)
    trainer = make_trainer(rounds, callbacks=callbacks)
    trainer.fit(loop, datamodule=Digits64(num_clients=8, batch_size=16, partition=Dirichlet(0.5), seed=0))
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), trainer


def test_readme_user_module_trains_with_its_own_optimizer():
    ns = _block("class MyModule")
    torch.manual_seed(0)
    a, b = ns["MyModule"](lr=0.05), ns["MyModule"](lr=0.05)
    b.load_state_dict(a.state_dict())
    wa, trainer = _fit(a, [FedAvg()])
    wb, _ = _fit(b, [FedAvg()], optimizer=lambda p: torch.optim.SGD(p, lr=0.05))  # StepLR(50): constant here
    torch.testing.assert_close(wa, wb, atol=0, rtol=0)
    assert 0.0 <= float(trainer.callback_metrics["client/train_acc"]) <= 1.0
    # its test_step: test/acc is the global model's accuracy on the test set, averaged over batches by their size
    loop = trainer.lightning_module
    dm = Digits64(num_clients=8, batch_size=16, partition=Dirichlet(0.5), seed=0)
    trainer.test(loop, datamodule=dm)
    x, y = dm.test_dataset[:]
    expected = (a.net(x).argmax(1) == y).double().mean()
    # Lightning keeps a logged mean in float32 (a few roundings of the batches' means, their sum and quotient)
    assert float(trainer.callback_metrics["test/acc"]) == pytest.approx(float(expected), rel=rtol32(8))


def test_readme_extension_examples_match_the_builtins():
    ns = _block("class TrimmedNormFedAvg")
    from fedlightning.models import MLP

    def model():
        torch.manual_seed(0)
        return MLP(input_dim=64, hidden=[8])

    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    ref, _ = _fit(model(), [FedAvg(weighting="uniform"), ProximalTerm(mu=0.3)], optimizer=sgd)
    got, trainer = _fit(
        model(), [ns["TrimmedNormFedAvg"](max_norm=1e9, weighting="uniform"), ns["L2ToGlobal"](mu=0.3)], optimizer=sgd
    )
    assert_close64(got, ref)
    assert float(trainer.callback_metrics["server/max_client_norm"]) > 0
    capped, _ = _fit(model(), [ns["TrimmedNormFedAvg"](max_norm=1e-3)], optimizer=sgd, rounds=1)
    start = torch.nn.utils.parameters_to_vector(to_float64(model()).parameters()).detach()
    assert float((capped - start).norm()) <= 1e-3 * (1 + RTOL64)
