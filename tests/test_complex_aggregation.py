"""Complex parameters and buffers through the server side: adaptive server optimizers, DP noise, buffer averaging.

Independent reference: the same model with its complex tensor stored as real pairs (``torch.view_as_complex`` in
``training_step``), which computes the same function and the same client updates with real tensors only; a server
rule that treats a complex number as two real ones (as ``torch.optim.Adam`` does) gives it the same result. DP's
noise is checked against its calibration, ``noise_multiplier · clip_norm / cohort`` per real coordinate."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import DPFedAvg, FedAdagrad, FedAdam, FedAMS, FedAvg, FedYogi
from fedlightning.datamodules import Dirichlet
from numerics import Digits64, assert_close64


class PairsNet(pl.LightningModule):
    """A complex first layer into a real head; ``pairs``: the layer's weight stored as real pairs. ``trace``: a buffer
    that training_step overwrites with a complex statistic of the batch (complex, or real pairs)."""

    def __init__(self, pairs: bool, trace: bool = False, lr: float = 0.05, width: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        w = 0.1 * torch.randn(64, width, dtype=torch.complex128, generator=g)
        self.pairs, self.trace, self.lr = pairs, trace, lr
        self.w = nn.Parameter(torch.view_as_real(w).clone() if pairs else w)
        torch.manual_seed(0)
        self.head = nn.Linear(width, 10, dtype=torch.float64)
        if trace:
            z = torch.zeros(width, dtype=torch.complex128)
            self.register_buffer("feature_mean", torch.view_as_real(z).clone() if pairs else z)

    def weight(self):
        return torch.view_as_complex(self.w) if self.pairs else self.w

    def feature(self):
        return torch.view_as_complex(self.feature_mean) if self.pairs else self.feature_mean

    def training_step(self, batch, batch_idx):
        x, y = batch
        z = x.to(torch.complex128) @ self.weight()
        if self.trace:
            with torch.no_grad():
                self.feature().copy_(z.mean(0))
        return F.cross_entropy(self.head(z.abs()), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _fit(model, strategy, rounds=3, cohort=4, local_steps=3):
    loop = FederatedLoop(model, local_steps=local_steps, clients_per_round=cohort, seed=5)
    dm = Digits64(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1)
    make_trainer(rounds, callbacks=[strategy]).fit(loop, datamodule=dm)
    return model


@pytest.mark.numerics
@pytest.mark.parametrize(
    "strategy",
    [
        lambda: FedAdam(server_lr=0.01, tau=1e-4),
        lambda: FedAdagrad(server_lr=0.01, tau=1e-4),
        lambda: FedYogi(server_lr=0.01),
        lambda: FedAMS(server_lr=0.01),
    ],
    ids=["FedAdam", "FedAdagrad", "FedYogi", "FedAMS"],
)
def test_adaptive_server_optimizers_treat_a_complex_parameter_as_two_real_ones(strategy):
    """The second moment of a complex parameter is of its parts' squares: the complex model's weights equal the
    real-pair model's (Adam and Adagrad gave other weights, 4e-2 off; Yogi's sign and AMS's max raised)."""
    start = PairsNet(pairs=True).weight().detach().clone()
    complex_model = _fit(PairsNet(pairs=False), strategy())
    pairs_model = _fit(PairsNet(pairs=True), strategy())
    assert (pairs_model.weight().detach() - start).abs().max() > 1e-3  # the server moved it
    assert_close64(
        torch.view_as_real(complex_model.weight().detach()), torch.view_as_real(pairs_model.weight().detach())
    )
    assert_close64(complex_model.head.weight.detach(), pairs_model.head.weight.detach())


def test_dp_noise_has_its_calibrated_deviation_on_every_real_coordinate_of_a_model_with_complex_parameters():
    """Clients that do not move (lr 0): the round's update is the noise alone, N(0, (σC/m)²) per real coordinate, on
    the complex parameter's real and imaginary parts and on the real head alike (torch's complex normal had given
    every coordinate a deviation 1/√2 too small, the real parameters' too)."""
    sigma, clip, cohort = 1.0, 1.0, 4
    model = PairsNet(pairs=False, lr=0.0, width=64)
    with torch.no_grad():
        model.w.zero_()
        model.head.weight.zero_()
    _fit(model, DPFedAvg(clip_norm=clip, noise_multiplier=sigma, delta=1e-5), rounds=1, cohort=cohort, local_steps=1)
    expected = sigma * clip / cohort
    parts = torch.view_as_real(model.w.detach())
    # 4096 values each: a sample deviation within 6 % of the true one (over 5 standard errors)
    for name, values in [("real", parts[..., 0]), ("imaginary", parts[..., 1]), ("head", model.head.weight)]:
        assert float(values.detach().std()) == pytest.approx(expected, rel=0.06), name


def test_a_complex_buffer_training_step_writes_is_averaged_over_the_clients():
    """The round averages a complex buffer as it averages real ones (weighted by samples): its parts equal those of
    the same buffer kept as real pairs (it kept its global value, and the clients' values were dropped)."""
    complex_model = _fit(PairsNet(pairs=False, trace=True), FedAvg(), rounds=2)
    pairs_model = _fit(PairsNet(pairs=True, trace=True), FedAvg(), rounds=2)
    got = torch.view_as_real(complex_model.feature_mean)
    assert got.abs().max() > 1e-2  # the clients' values arrived
    assert_close64(got, pairs_model.feature_mean)
    assert_close64(
        torch.view_as_real(complex_model.weight().detach()), torch.view_as_real(pairs_model.weight().detach())
    )
