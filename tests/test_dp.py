"""DPFedAvg (client-level differential privacy): clipping and noise against hand computations, the noise scale
statistically, adaptive clipping against its formula, ε against Opacus's accountant called directly, FedAvg bit for
bit without noise and clipping, refused settings, and resume with the same ε, clip norm and weights."""

import math
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import DPFedAvg, FedAvg, FederatedCallback
from fedlightning.callbacks.base import RoundStatistics, accumulate_core
from fedlightning.checkpoint import AtomicCheckpointIO
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP
from fedlightning.state import ClientUpdate, RoundPlan, derive_seed


def _round_stats(strategy, deltas):
    """The round's statistics as the loop forms them for healthy clients with these deltas (accumulate_core, then
    the strategy's extras merged)."""
    stats = RoundStatistics()
    for i, d in enumerate(deltas):
        update = ClientUpdate(client_id=i, delta=d, num_samples=10 + i)
        extras = RoundStatistics()
        strategy.accumulate(extras, update)
        accumulate_core(strategy, stats, update)
        stats.merge(extras)
    return stats


def _clip(d, c):
    """Δ · min(1, C/‖Δ‖), in float64 Python arithmetic for the factor."""
    norm = math.sqrt(float((d.double() ** 2).sum()))
    return d * (min(1.0, c / norm) if norm > 0 else 1.0)


def test_clipping_against_hand_computation_with_fixed_denominator():
    dp = DPFedAvg(clip_norm=2.0, noise_multiplier=0.0, delta=1e-5)
    a = torch.tensor([3.0, 4.0], dtype=torch.float64)  # norm 5: scaled by 2/5
    b = torch.tensor([0.6, 0.8], dtype=torch.float64)  # norm 1: unchanged
    stats = _round_stats(dp, [a, b])
    torch.testing.assert_close(stats["dp_clipped_sum"], torch.tensor([1.2 + 0.6, 1.6 + 0.8], dtype=torch.float64))
    loop = SimpleNamespace(seed=0)
    step = dp.server_update(loop, stats, RoundPlan(round=0, client_ids=[0, 1], local_steps=1))
    torch.testing.assert_close(step.pseudo_gradient, torch.tensor([0.9, 1.2], dtype=torch.float64))
    assert step.metrics["privacy/clip_norm"] == 2.0
    # a third sampled client left out by the failure policy: the denominator stays the cohort size m = 3
    step = dp.server_update(loop, stats, RoundPlan(round=0, client_ids=[0, 1, 2], local_steps=1))
    torch.testing.assert_close(step.pseudo_gradient, torch.tensor([0.6, 0.8], dtype=torch.float64))


def test_noise_equals_seeded_draw_times_sigma_clip():
    torch.manual_seed(0)
    deltas = [torch.randn(50, dtype=torch.float64) * s for s in (0.1, 1.0, 3.0)]
    clip, sigma, seed, rnd = 0.5, 1.3, 7, 4
    dp = DPFedAvg(clip_norm=clip, noise_multiplier=sigma, delta=1e-5)
    step = dp.server_update(
        SimpleNamespace(seed=seed), _round_stats(dp, deltas), RoundPlan(round=rnd, client_ids=[0, 1, 2], local_steps=1)
    )
    gen = torch.Generator().manual_seed(derive_seed(seed, "dp-noise", rnd))
    draw = torch.randn(50, generator=gen, dtype=torch.float64)
    expected = (sum(_clip(d, clip) for d in deltas) + sigma * clip * draw) / 3
    torch.testing.assert_close(step.pseudo_gradient, expected)
    assert step.metrics["privacy/noise_std"] == pytest.approx(sigma * clip / 3, rel=1e-15)


def test_noise_std_over_many_rounds_is_sigma_clip_over_m():
    """Zero updates: the pseudo-gradient is the noise alone; over 200 rounds × 1000 coordinates its standard
    deviation is σC/m (relative standard error of the estimate ≈ 1/√(2·200000) ≈ 0.16%; tolerance 1.5%)."""
    clip, sigma, m, dim = 2.0, 1.0, 4, 1000
    dp = DPFedAvg(clip_norm=clip, noise_multiplier=sigma, delta=1e-5)
    zeros = [torch.zeros(dim, dtype=torch.float64) for _ in range(m)]
    draws = torch.stack(
        [
            dp.server_update(
                SimpleNamespace(seed=3),
                _round_stats(dp, zeros),
                RoundPlan(round=r, client_ids=list(range(m)), local_steps=1),
            ).pseudo_gradient
            for r in range(200)
        ]
    )
    target = sigma * clip / m
    assert float(draws.std()) == pytest.approx(target, rel=0.015)
    assert abs(float(draws.mean())) < 5 * target / math.sqrt(draws.numel())
    # rounds draw independent noise: neighbouring rounds are uncorrelated
    corr = float((draws[1:] * draws[:-1]).mean()) / target**2
    assert abs(corr) < 0.02


def test_adaptive_clipping_update_against_formula():
    norms = [0.5, 1.5, 2.0, 4.0]
    deltas = [torch.tensor([n, 0.0], dtype=torch.float64) for n in norms]  # norms exactly n
    c0, gamma, eta = 1.5, 0.2, 0.3
    # noise-free count: b̄ = 2/4 unclipped (‖Δ‖ = C counts as unclipped)
    dp = DPFedAvg(
        clip_norm=c0,
        noise_multiplier=0.0,
        delta=1e-5,
        target_quantile=gamma,
        clip_learning_rate=eta,
        clipped_count_stddev=0.0,
    )
    loop = SimpleNamespace(seed=1)
    step = dp.server_update(loop, _round_stats(dp, deltas), RoundPlan(round=0, client_ids=[0, 1, 2, 3], local_steps=1))
    assert step.metrics["privacy/unclipped_fraction"] == 0.5
    c1 = c0 * math.exp(-eta * (0.5 - gamma))
    assert dp.current_clip_norm == pytest.approx(c1, rel=1e-15)
    # the next round clips to the new C
    stats = _round_stats(dp, deltas)
    torch.testing.assert_close(stats["dp_clipped_sum"], sum(_clip(d, c1) for d in deltas))

    # noised count and the updates' noise multiplier σ_Δ = (z^-2 - (2σ_b)^-2)^-1/2 (Andrew et al. 2021, Theorem 1)
    z, sb, seed, rnd = 1.0, 2.0, 5, 3
    dp = DPFedAvg(
        clip_norm=c0,
        noise_multiplier=z,
        delta=1e-5,
        target_quantile=gamma,
        clip_learning_rate=eta,
        clipped_count_stddev=sb,
    )
    step = dp.server_update(
        SimpleNamespace(seed=seed),
        _round_stats(dp, deltas),
        RoundPlan(round=rnd, client_ids=[0, 1, 2, 3], local_steps=1),
    )
    g = float(
        torch.randn(
            (), generator=torch.Generator().manual_seed(derive_seed(seed, "dp-clip-count", rnd)), dtype=torch.float64
        )
    )
    centered = sum((1.0 if n <= c0 else 0.0) - 0.5 for n in norms)
    unclipped = min(1.0, max(0.0, (centered + sb * g) / 4 + 0.5))
    assert step.metrics["privacy/unclipped_fraction"] == pytest.approx(unclipped, rel=1e-15, abs=1e-15)
    assert dp.current_clip_norm == pytest.approx(c0 * math.exp(-eta * (unclipped - gamma)), rel=1e-15)
    sigma_delta = 1.0 / math.sqrt(z**-2 - (2 * sb) ** -2)
    assert step.metrics["privacy/noise_multiplier"] == pytest.approx(sigma_delta, rel=1e-15)
    draw = torch.randn(
        2, generator=torch.Generator().manual_seed(derive_seed(seed, "dp-noise", rnd)), dtype=torch.float64
    )
    expected = (sum(_clip(d, c0) for d in deltas) + sigma_delta * c0 * draw) / 4
    torch.testing.assert_close(step.pseudo_gradient, expected)


class _Recorder(FederatedCallback):
    def __init__(self):
        self.metrics = []

    def on_round_end(self, trainer, pl_module, result):
        self.metrics.append(dict(result.metrics))


def _setup(model_seed=0, client_execution="sequential"):
    pl.seed_everything(model_seed, verbose=False)
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[16], dropout=0.3),
        local_steps=3,
        clients_per_round=4,
        seed=2,
        client_execution=client_execution,
    )
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    return loop, dm


def _fit(strategy, rounds=3, client_execution="sequential", **trainer_kw):
    loop, dm = _setup(client_execution=client_execution)
    rec = _Recorder()
    make_trainer(rounds, callbacks=[strategy, rec] + trainer_kw.pop("callbacks", []), **trainer_kw).fit(
        loop, datamodule=dm
    )
    return loop, dm, rec


def _weights(loop):
    return torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach().clone()


@pytest.mark.parametrize(
    "client_execution,precision",
    [("sequential", "32-true"), ("vectorized", "32-true"), ("sequential", "bf16-true"), ("sequential", "16-true")],
)
def test_no_noise_unbounded_clip_equals_uniform_fedavg_bit_for_bit(client_execution, precision):
    """Also in half precision, where both sum the clients' updates in float32 (state.sum_dtype; DPFedAvg summed in
    bfloat16 / float16, 206 of 1210 weights off after 4 bf16-true rounds)."""
    kw = dict(rounds=4, client_execution=client_execution, precision=precision)
    fedavg, _, _ = _fit(FedAvg(weighting="uniform"), **kw)
    dp, _, rec = _fit(DPFedAvg(clip_norm=math.inf, noise_multiplier=0.0, delta=1e-5), **kw)
    assert torch.equal(_weights(fedavg), _weights(dp))
    assert all(m["round/clients"] == 4 for m in rec.metrics)  # every sampled client healthy: m = survivors
    assert rec.metrics[-1]["privacy/epsilon"] == math.inf


def test_epsilon_equals_opacus_accountant_for_the_same_schedule():
    from opacus.accountants import RDPAccountant

    sigma, delta, rounds = 1.1, 1e-4, 4
    loop, dm, rec = _fit(DPFedAvg(clip_norm=1.0, noise_multiplier=sigma, delta=delta), rounds=rounds)
    population = sum(1 for idx in dm.client_indices if len(idx) > 0)
    q = 4 / population
    accountant = RDPAccountant()
    for r in range(rounds):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
        assert rec.metrics[r]["privacy/epsilon"] == accountant.get_epsilon(delta)
        assert rec.metrics[r]["privacy/sample_rate"] == q
        assert rec.metrics[r]["privacy/delta"] == delta
    assert 0 < rec.metrics[0]["privacy/epsilon"] < rec.metrics[-1]["privacy/epsilon"]
    assert float(loop.trainer.callback_metrics["privacy/epsilon"]) == pytest.approx(accountant.get_epsilon(delta))

    # population_size overrides N (a sampler drawing from a subset): q = m / population_size
    subset = population - 3
    _, _, rec = _fit(DPFedAvg(clip_norm=1.0, noise_multiplier=sigma, delta=delta, population_size=subset), rounds=2)
    accountant = RDPAccountant()
    for _ in range(2):
        accountant.step(noise_multiplier=sigma, sample_rate=4 / subset)
    assert rec.metrics[-1]["privacy/epsilon"] == accountant.get_epsilon(delta)


def test_a_data_module_with_its_own_sampler_is_warned_that_epsilon_assumes_uniform_sampling():
    from fedlightning.datamodules import DigitsDataModule

    class Importance(DigitsDataModule):  # a sampler favouring large clients: q = m / N no longer describes it
        def sample_clients(self, round):
            sizes = [self.client_num_samples(c) for c in range(self.num_clients)]
            return sorted(range(self.num_clients), key=lambda c: -sizes[c])[: self.clients_per_round]

    loop, _ = _setup()
    dm = Importance(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    dp = DPFedAvg(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5)
    with pytest.warns(UserWarning, match=r"Importance defines its own sample_clients; the accountant takes"):
        make_trainer(1, callbacks=[dp]).fit(loop, datamodule=dm)
    loop, dm = _setup()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="DPFedAvg: .* defines its own")
        make_trainer(1, callbacks=[DPFedAvg(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5)]).fit(loop, datamodule=dm)


def test_a_population_larger_than_the_clients_sampled_from_is_refused():
    """q = m / N with N above the clients the data module samples from would under-report epsilon."""
    loop, dm = _setup()
    dm.setup("fit")
    holding = sum(1 for idx in dm.client_indices if len(idx) > 0)
    assert holding > 4
    dp = DPFedAvg(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5, population_size=holding + 1)
    with pytest.raises(ValueError, match=rf"population_size={holding + 1} exceeds the {holding} clients with training"):
        make_trainer(1, callbacks=[dp]).fit(loop, datamodule=dm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(weighting="samples"), "weighting='samples'"),
        (dict(clip_norm=0.0), "clip_norm"),
        (dict(clip_norm=-1.0), "clip_norm"),
        (dict(noise_multiplier=-0.1), "noise_multiplier"),
        (dict(delta=0.0), "delta"),
        (dict(delta=1.0), "delta"),
        (dict(clip_norm=math.inf), "clip_norm=inf"),
        (dict(target_quantile=0.5, clipped_count_stddev=0.4), "2·clipped_count_stddev"),
        (dict(clipped_count_stddev=1.0), "target_quantile"),
        (dict(server_optimizer="adam", server_momentum=0.9), "server_momentum"),
    ],
    ids=[
        "samples",
        "clip0",
        "clip-neg",
        "noise-neg",
        "delta0",
        "delta1",
        "inf-clip-with-noise",
        "count-noise-low",
        "count-noise-no-adaptive",
        "momentum-adam",
    ],
)
def test_settings_that_void_the_guarantee_are_refused(kwargs, message):
    settings = dict(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        DPFedAvg(**settings)


def test_a_client_twice_in_a_round_is_refused():
    dp = DPFedAvg(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5)
    plan = RoundPlan(round=2, client_ids=[3, 5, 3], local_steps=1)
    with pytest.raises(ValueError, match=r"client\(s\) \[3\] more than once"):
        dp.on_round_start(None, None, plan)
    stats = _round_stats(dp, [torch.ones(3)])
    with pytest.raises(ValueError, match="more than once"):
        dp.server_update(SimpleNamespace(seed=0), stats, plan)


def test_float_buffers_and_default_count_noise_refused_at_fit_start():
    dp = DPFedAvg(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5, population_size=100)
    with pytest.raises(ValueError, match="the model has float buffers"):
        dp.on_fit_start(None, SimpleNamespace(model=torch.nn.BatchNorm1d(3), clients_per_round=4))
    # adaptive clipping with the default σ_b = 0.05 · 4 = 0.2: z = 1 ≥ 2σ_b, refused before round 0
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        _fit(DPFedAvg(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5, target_quantile=0.5), rounds=1)


def test_resume_gives_the_same_epsilon_clip_norm_and_weights(tmp_path):
    def strategy():
        return DPFedAvg(
            clip_norm=0.3,
            noise_multiplier=0.8,
            delta=1e-3,
            server_optimizer="adam",
            server_lr=0.05,
            target_quantile=0.5,
            clipped_count_stddev=1.0,
        )

    total, cut = 6, 3
    full_loop, _, full_rec = _fit(strategy(), rounds=total)
    full = _weights(full_loop)

    ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _fit(
        strategy(),
        rounds=cut,
        callbacks=[ck],
        enable_checkpointing=True,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=str(tmp_path),
    )
    loop, dm = _setup(model_seed=99)  # a different initialisation, overwritten by the checkpoint
    resumed_strategy, rec = strategy(), _Recorder()
    trainer = make_trainer(total, callbacks=[resumed_strategy, rec], plugins=[AtomicCheckpointIO()])
    trainer.fit(loop, datamodule=dm, ckpt_path=str(tmp_path / "ck" / f"step={cut}.ckpt"), weights_only=True)
    assert trainer.global_step == total
    assert torch.equal(_weights(loop), full)
    assert [m["privacy/epsilon"] for m in rec.metrics] == [m["privacy/epsilon"] for m in full_rec.metrics[cut:]]
    assert [m["privacy/clip_norm"] for m in rec.metrics] == [m["privacy/clip_norm"] for m in full_rec.metrics[cut:]]
    assert len({m["privacy/clip_norm"] for m in full_rec.metrics}) > 1  # the clip norm adapted


def test_config_runs_through_the_cli_and_logs_epsilon(tmp_path):
    """configs/dpfedavg.yaml (3 rounds, 2 local steps): DPFedAvg with adaptive clipping, ε logged every round as the
    accountant computes it for q = 50/N."""
    import os

    from opacus.accountants import RDPAccountant

    from fedlightning.cli import main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cli = main(
        [
            "fit",
            "--config",
            os.path.join(root, "configs", "dpfedavg.yaml"),
            "--trainer.max_steps",
            "3",
            "--trainer.logger",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--model.local_steps",
            "2",
        ]
    )
    strategy = cli.model.strategy
    assert isinstance(strategy, DPFedAvg) and strategy.adaptive
    dm = cli.datamodule
    population = sum(1 for idx in dm.client_indices if len(idx) > 0)
    accountant = RDPAccountant()
    for _ in range(3):
        accountant.step(noise_multiplier=strategy.noise_multiplier, sample_rate=50 / population)
    metrics = cli.trainer.callback_metrics
    assert float(metrics["privacy/epsilon"]) == pytest.approx(accountant.get_epsilon(strategy.delta), rel=1e-6)
    assert float(metrics["privacy/clip_norm"]) != strategy.clip_norm  # adapted after rounds 0 and 1


@pytest.mark.parametrize(
    "history",
    [
        [(1.0, 0.2, 50)],
        [(1.1, 0.05, 3), (0.8, 0.2, 7), (1.1, 0.05, 4)],  # changing noise (adaptive clipping) and sample rates
        [(2.3, 1.0, 10)],  # every client every round
    ],
)
@pytest.mark.parametrize("delta", [1e-3, 1e-5])
def test_rdp_epsilon_is_the_accountants_epsilon_for_any_history(history, delta):
    """rdp_epsilon caches one round's RDP per (z, q); the ε it gives is Opacus's RDPAccountant.get_epsilon, float
    for float, for merged and alternating histories, and again when the cache is warm."""
    from opacus.accountants import RDPAccountant

    from fedlightning.callbacks.dp import rdp_epsilon

    accountant = RDPAccountant()
    accountant.history = list(history)
    expected = accountant.get_epsilon(delta)
    assert rdp_epsilon(history, delta) == expected
    assert rdp_epsilon(history, delta) == expected  # cached


class _Counted(MLP):
    """Position ids as a constant integer buffer (as Hugging Face models register them) and, with ``counts``, a
    step counter that training_step advances."""

    def __init__(self, counts: bool):
        super().__init__(input_dim=64, hidden=[16])
        self.counts = counts
        self.register_buffer("position_ids", torch.arange(64).expand(1, -1))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def training_step(self, batch, batch_idx):
        if self.counts:
            self.steps += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("counts", [False, True])
def test_integer_buffers_are_allowed_while_no_client_changes_them(counts):
    """A constant integer buffer averages to itself and reveals nothing: the run trains as without it; a counter
    that clients advance would be averaged without noise, and stops the run naming it."""
    pl.seed_everything(0, verbose=False)
    loop = FederatedLoop(_Counted(counts), local_steps=3, clients_per_round=4, seed=2)
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    trainer = make_trainer(2, callbacks=[DPFedAvg(clip_norm=1.0, noise_multiplier=1.0, delta=1e-3)])
    if counts:
        with pytest.raises(ValueError, match=r"DPFedAvg: client \d+'s training changed the buffer 'steps'"):
            trainer.fit(loop, datamodule=dm)
    else:
        trainer.fit(loop, datamodule=dm)
        assert loop.global_step == 2 and torch.equal(loop.model.position_ids, torch.arange(64).expand(1, -1))
