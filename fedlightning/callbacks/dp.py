r"""Client-level differential privacy: DP-FedAvg (McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private
Recurrent Language Models", ICLR 2018) with a fixed cohort, any server optimizer (DP-FedAdam), optional adaptive
clipping (Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS
2021) and privacy accounting by Opacus's RDP accountant.

.. math::
    \tilde\Delta_i = \Delta_i \cdot \min\Bigl(1, \frac{C}{\lVert\Delta_i\rVert}\Bigr), \qquad
    \Delta_t = \frac{1}{m}\Bigl(\sum_{i\in S_t}\tilde\Delta_i + \mathcal N(0, \sigma_\Delta^2 C^2 I)\Bigr), \qquad
    w_{t+1} = \mathrm{ServerOpt}(w_t, \Delta_t)

with ``m = |S_t|`` the round's cohort size. :class:`DPFedAvg` (its docstring: every decision and its source).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn

from fedlightning._validation import in_range, integer, non_negative, one_of, positive
from fedlightning.callbacks.adaptive import AdaptiveServerOptimizer, _check_betas, _moment_statistics
from fedlightning.callbacks.base import RoundStatistics, ServerStep, ServerStrategy
from fedlightning.datamodules import FederatedDataModule
from fedlightning.state import (
    ClientUpdate,
    RoundPlan,
    averaged_buffer_slices,
    buffer_values,
    derive_seed,
    real_parts,
    squared_norm64,
    sum_dtype,
)

__all__ = ["DPFedAvg", "adaptive_noise_multiplier", "rdp_epsilon"]

_SERVER_OPTIMIZERS = ("sgd", "adam", "adagrad", "yogi")


def adaptive_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
    r"""``σ_Δ = (z^{-2} − (2σ_b)^{-2})^{-1/2}``: the noise multiplier of the clipped sum when the clipped count is
    noised with standard deviation ``σ_b``, so that both releases together spend what one Gaussian mechanism with
    noise multiplier ``z`` spends (Andrew et al. 2021, Theorem 1; TensorFlow Federated's
    ``adaptive_clip_noise_params``). ``z = 0`` gives 0 (no privacy). Raises ``ValueError`` when ``z ≥ 2σ_b`` (the
    count alone would spend the whole budget: ``σ_Δ`` undefined)."""
    if noise_multiplier == 0:
        return 0.0
    if noise_multiplier >= 2 * clipped_count_stddev:
        raise ValueError(
            f"adaptive clipping: noise_multiplier={noise_multiplier:g} >= 2·clipped_count_stddev="
            f"{2 * clipped_count_stddev:g}, so the noised clipped count alone would spend the whole privacy budget and "
            "the noise multiplier of the updates, (z^-2 - (2·σ_b)^-2)^-1/2 (Andrew et al. 2021, Theorem 1), is "
            "undefined: raise clipped_count_stddev (default 0.05 × clients per round) or lower noise_multiplier"
        )
    return (noise_multiplier**-2 - (2.0 * clipped_count_stddev) ** -2) ** -0.5


def rdp_epsilon(history: Sequence[Sequence[float]], delta: float) -> float:
    """ε at ``delta`` after the rounds of ``history`` (``[(noise_multiplier, sample_rate, rounds), ...]``), from
    Opacus's :class:`~opacus.accountants.RDPAccountant` (its ``history`` format); 0 before the first round, ``inf``
    when a round had no noise."""
    if not history:
        return 0.0
    if any(float(z) == 0 for z, _, _ in history):
        return math.inf
    accountant = _rdp_accountant()
    orders = accountant.DEFAULT_ALPHAS
    # RDPAccountant.get_epsilon's computation, with one round's RDP per (z, q) computed once per run: its
    # ``compute_rdp(q, z, n, orders)`` is the one-round array times n, so the floats are the same, and a round's
    # accounting costs an array product instead of ~150 series evaluations (~0.1-0.3 s per round)
    rdp = sum([np.asarray(_rdp_one_round(float(z), float(q), tuple(orders))) * int(n) for z, q, n in history])
    eps, _ = _privacy_analysis().get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=256)
def _rdp_one_round(noise_multiplier: float, sample_rate: float, orders: tuple) -> tuple[float, ...]:
    """Opacus's RDP of one round (``compute_rdp(q, z, steps=1, orders)``), cached: every round of a run has the same
    ``(z, q)``."""
    array = _privacy_analysis().compute_rdp(
        q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(orders)
    )
    return tuple(float(v) for v in np.asarray(array, dtype=np.float64).reshape(-1))


def _privacy_analysis():
    """Opacus's RDP analysis module (what its ``RDPAccountant`` computes with)."""
    from opacus.accountants.analysis import rdp

    return rdp


def _rdp_accountant():
    """A fresh Opacus RDP accountant (imported here: Opacus takes seconds to import, and only DP runs need it)."""
    try:
        from opacus.accountants import RDPAccountant
    except ImportError as err:  # pragma: no cover - opacus is a dependency
        raise ImportError("DPFedAvg's privacy accounting uses Opacus: pip install 'opacus>=1.5'") from err
    return RDPAccountant()


class DPFedAvg(ServerStrategy):
    r"""DP-FedAvg with client-level (user-level) differential privacy; DP-FedAdam with ``server_optimizer="adam"``.

    Each round, every healthy client's update ``Δ_i`` is clipped to norm ``C`` (``Δ_i · min(1, C/‖Δ_i‖)``, ``‖·‖``
    computed in float64), the clipped updates are summed, Gaussian noise ``N(0, σ_Δ² C² I)`` is added to the sum and
    the result divided by the cohort size ``m``; the server optimizer steps on that pseudo-gradient. Privacy is
    accounted per round by Opacus's RDP accountant and logged as ``privacy/epsilon`` at ``privacy/delta``.

    Decisions and their sources:

    * **Fixed denominator** ``m = len(plan.client_ids)``, the cohort the data module sampled, not the number of
      healthy clients: McMahan et al. 2018's fixed-denominator estimator (``Σ w_i Δ̃_i / (qW)``, here ``w_i = 1``
      and ``qW = m``), as TensorFlow Federated's ``DifferentiallyPrivateFactory`` (``NormalizedQuery`` with
      ``denominator=clients_per_round``). Dividing by the surviving count would make the denominator depend on the
      clients' data. With ``noise_multiplier=0`` and ``clip_norm=inf`` the pseudo-gradient is FedAvg's uniform mean
      bit for bit when every sampled client is healthy (``tests/test_dp.py``).
    * **Uniform weights**: ``weighting="samples"`` is refused (a client's weight ``n_i`` is unbounded and data
      dependent, so the sensitivity of the weighted sum is not ``C``).
    * **Clients left out by the failure policy** (non-finite or over-``max_update_norm`` updates, clients whose
      training raised under ``on_client_error="skip"``) contribute the zero vector: still inside the clipping ball,
      and the decision depends on that client's own update only, so the sum keeps sensitivity ``C`` under
      add/remove-one-client adjacency and the fixed denominator is unchanged. With adaptive clipping such a client
      adds ``½`` to the centred count (neutral, see below). Two exceptions the strategy cannot noise, because the
      loop does not call ``server_update`` then: a round with **no** healthy client leaves the model unchanged
      (released without noise), and ``on_client_failure="raise"`` stops the run; both reveal that every / one
      sampled client failed. Use ``on_client_failure="skip"`` and keep failures rare.
    * **A client twice in a round** (a plan whose ``client_ids`` repeat one) is refused before training and again
      before the server step: that client's contribution would be bounded by ``2C``, not ``C``.
    * **Models with float buffers** (BatchNorm running statistics) are refused at fit start: the loop averages
      buffers without clipping or noise. Use GroupNorm / LayerNorm, or ``track_running_stats=False``. Integer and
      bool buffers (position ids, masks) are allowed while client training leaves them as they are; a client that
      changes one (a counter) stops the run, naming it.
    * **Noise** comes from a ``torch.Generator`` on the sum's device seeded with ``derive_seed(loop.seed,
      "dp-noise", round)`` and is drawn in the sum's dtype (``torch.randn``; for a model with complex parameters,
      whose flat sum is complex, N(0, σ²C²) for each real and imaginary part), so a run is reproducible, resumes bit
      for bit, and every DDP process adds the same noise to the same all-reduced sum. These are pseudo-random
      numbers from a seed in the config: for a deployment the seed must be secret (the guarantee assumes noise the
      adversary cannot predict), which a research simulation does not need.
    * **Accounting**: Opacus's ``RDPAccountant`` (``step(noise_multiplier=z, sample_rate=q)`` per round,
      ``get_epsilon(delta)``), ``q = m / N`` with ``N`` the clients that can be sampled (``population_size``, or
      the data module's clients with data). The data module samples a fixed-size cohort uniformly without
      replacement; the accountant analyses Poisson sampling with rate ``q``. Accounting fixed-size sampling as
      Poisson with ``q = m/N`` is the usual approximation (McMahan et al. 2018 analyse Poisson-sampled users with
      the expected cohort ``qN``; TensorFlow Federated's DP aggregators take the expected ``clients_per_round``);
      an exact bound for sampling without replacement holds under replace-one adjacency (Wang, Balle &
      Kasiviswanathan 2019, "Subsampled Rényi Differential Privacy"), which this class does not compute. Every
      completed round is one accountant step (also one without a healthy client). The per-round history ``(z, q,
      rounds)`` is checkpointed (``state_dict``), so a resumed run reports the same ε.
    * **Adaptive clipping** (``target_quantile`` set; Andrew et al. 2021, geometric update, as TensorFlow Privacy's
      ``QuantileEstimatorQuery``): each healthy client reports ``b_i = 1[‖Δ_i‖ ≤ C] − ½`` (centred: sensitivity ½),
      the server computes ``b̄ = clamp((Σ b_i + N(0, σ_b²)) / m + ½, 0, 1)`` (the noised fraction of unclipped
      updates; equal to ``(Σ 1[‖Δ_i‖ ≤ C] + N(0, σ_b²))/m`` when all ``m`` clients are healthy) and sets
      ``C ← C · exp(−η_C (b̄ − γ))`` for the next round. The updates are noised with ``σ_Δ = (z^{-2} −
      (2σ_b)^{-2})^{-1/2}`` (:func:`adaptive_noise_multiplier`), and the accountant is charged ``z``.
      ``σ_b`` defaults to ``0.05 · m`` (Andrew et al.'s ``m/20``; TFF's default); its noise is drawn from a CPU
      generator seeded ``derive_seed(loop.seed, "dp-clip-count", round)``. The clip norm is checkpointed.
    * **Not covered by the guarantee**: what the loop logs from raw client results (``train/loss``,
      ``server/mean_client_delta_sq_norm``, ``round/clients``, ``round/failed_clients``, client step sizes) and
      evaluation metrics. The guarantee covers the sequence of global models and the ``privacy/*`` metrics.

    Logged per round: ``privacy/epsilon`` (ε so far, at ``privacy/delta``), ``privacy/delta``,
    ``privacy/clip_norm`` (``C`` this round's updates were clipped to), ``privacy/noise_multiplier`` (``σ_Δ``),
    ``privacy/noise_std`` (``σ_Δ C / m``: per-coordinate standard deviation of the noise in the pseudo-gradient),
    ``privacy/sample_rate`` (``q``), ``privacy/unclipped_fraction`` (the noised ``b̄``, adaptive clipping only) and
    the server optimizer's moment statistics (as :class:`~fedlightning.callbacks.FedAdam`).

    Args:
        clip_norm: ``C > 0`` (the initial ``C`` with adaptive clipping); ``inf`` (no clipping) only with
            ``noise_multiplier=0``.
        noise_multiplier: ``z ≥ 0``: the noise standard deviation is ``z·C`` on the sum (``σ_Δ·C`` with adaptive
            clipping); 0 adds no noise and ε is ``inf``.
        delta: ``δ ∈ (0, 1)`` at which ε is reported (a warning when ``δ ≥ 1/N``).
        server_lr: the server optimizer's learning rate (default 1.0: DP-FedAvg; set it for Adam).
        server_optimizer: ``"sgd"`` (default; ``server_momentum`` for server momentum), ``"adam"`` (DP-FedAdam),
            ``"adagrad"`` or ``"yogi"``: :class:`~fedlightning.callbacks.adaptive.AdaptiveServerOptimizer` with
            ``betas`` and ``tau``, as :class:`~fedlightning.callbacks.FedAdam` (privacy is unchanged: the server
            optimizer only post-processes the noised pseudo-gradient).
        server_momentum: heavy-ball momentum of ``"sgd"`` (default 0: plain DP-FedAvg).
        betas, tau: ``(β1, β2)`` and ``τ`` of the adaptive server optimizers (defaults as FedAdam).
        target_quantile: ``γ ∈ [0, 1]`` to enable adaptive clipping (None: fixed ``C``).
        clip_learning_rate: ``η_C > 0`` of the geometric clip update (default 0.2: Andrew et al. / TFF).
        clipped_count_stddev: ``σ_b ≥ 0`` (None: ``0.05 · m``).
        population_size: ``N``, the number of clients sampling draws from (None: the data module's clients with
            training data, which its ``sample_clients`` draws from). More than those is refused (the accountant
            would under-report ε); fewer (a data module whose own ``sample_clients`` draws from a subset) is taken
            as given.
        weighting: must be ``"uniform"``.
    """

    def __init__(
        self,
        clip_norm: float,
        noise_multiplier: float,
        delta: float,
        server_lr: float = 1.0,
        server_optimizer: str = "sgd",
        server_momentum: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        tau: float = 1e-2,
        target_quantile: float | None = None,
        clip_learning_rate: float = 0.2,
        clipped_count_stddev: float | None = None,
        population_size: int | None = None,
        weighting: str = "uniform",
    ):
        if weighting == "samples":
            raise ValueError(
                "DPFedAvg refuses weighting='samples': weighting client i by its sample count n_i makes the "
                "sensitivity of the weighted sum n_i·C, unbounded and data dependent, which voids the privacy "
                "guarantee; use weighting='uniform'"
            )
        super().__init__(server_lr=server_lr, weighting=weighting)
        self.clip_norm = in_range("clip_norm", clip_norm, 0.0, low_closed=False, finite=False)
        self.noise_multiplier = non_negative("noise_multiplier", noise_multiplier)
        self.delta = in_range("delta", delta, 0.0, 1.0, low_closed=False, high_closed=False)
        if math.isinf(self.clip_norm) and self.noise_multiplier > 0:
            raise ValueError(
                f"clip_norm=inf with noise_multiplier={self.noise_multiplier:g}: unclipped updates have unbounded "
                "sensitivity, so no amount of noise gives a guarantee (and the noise σ·C would be infinite); set a "
                "finite clip_norm, or noise_multiplier=0 for clipping-free FedAvg"
            )
        self.server_optimizer = one_of("server_optimizer", server_optimizer, _SERVER_OPTIMIZERS)
        self.server_momentum = in_range("server_momentum", server_momentum, 0.0, 1.0)
        if self.server_momentum and self.server_optimizer != "sgd":
            raise ValueError(
                f"server_momentum={self.server_momentum:g} applies to server_optimizer='sgd' only, "
                f"got server_optimizer={self.server_optimizer!r} (it has betas)"
            )
        self.betas = _check_betas(betas, self.server_optimizer)
        self.tau = positive("tau", tau)
        self.target_quantile = in_range("target_quantile", target_quantile, 0.0, 1.0, high_closed=True, allow_none=True)
        self.clip_learning_rate = positive("clip_learning_rate", clip_learning_rate)
        self.clipped_count_stddev = non_negative("clipped_count_stddev", clipped_count_stddev, allow_none=True)
        if self.target_quantile is None and self.clipped_count_stddev is not None:
            raise ValueError(
                "clipped_count_stddev is the noise of adaptive clipping's count; set target_quantile "
                "to enable adaptive clipping, or leave clipped_count_stddev unset"
            )
        if self.target_quantile is not None and math.isinf(self.clip_norm):
            raise ValueError("adaptive clipping (target_quantile) needs a finite initial clip_norm")
        if self.target_quantile is not None and self.noise_multiplier > 0 and self.clipped_count_stddev is not None:
            adaptive_noise_multiplier(self.noise_multiplier, self.clipped_count_stddev)  # refused now if undefined
        self.population_size = integer("population_size", population_size, allow_none=True)
        self.current_clip_norm = self.clip_norm  # C of the next round (checkpointed)
        self.history: list[tuple[float, float, int]] = []  # Opacus RDPAccountant history (checkpointed)
        self._population: int | None = self.population_size
        self._optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ settings of a round
    @property
    def adaptive(self) -> bool:
        return self.target_quantile is not None

    def noise_parameters(self, cohort: int) -> tuple[float, float]:
        """``(σ_Δ, σ_b)`` for a cohort of ``cohort`` clients (``σ_b = 0`` without adaptive clipping)."""
        if not self.adaptive:
            return self.noise_multiplier, 0.0
        stddev = self.clipped_count_stddev
        if stddev is None:
            stddev = 0.05 * cohort if self.noise_multiplier > 0 else 0.0
        return adaptive_noise_multiplier(self.noise_multiplier, stddev), stddev

    def population(self, loop: Any) -> int:
        """``N``: ``population_size``, or the clients of ``loop.datamodule`` with training data (cached)."""
        if self._population is None:
            dm = loop.datamodule
            self._population = len(dm.clients_with_data())
        return self._population

    @staticmethod
    def _check_distinct(plan: RoundPlan) -> None:
        ids = list(plan.client_ids)
        if len(set(ids)) != len(ids):
            repeated = sorted({c for c in ids if ids.count(c) > 1})
            raise ValueError(
                f"round {plan.round}: the plan samples client(s) {repeated} more than once; DPFedAvg bounds each "
                "client's contribution to the round by clip_norm, which a client counted twice exceeds (2·C), so "
                "the privacy guarantee would not hold: sample distinct clients"
            )

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer, pl_module) -> None:
        model = getattr(pl_module, "model", pl_module)
        buffers = [name for name, b in model.named_buffers() if b.is_floating_point()]
        if buffers:
            raise ValueError(
                f"DPFedAvg: the model has float buffers ({', '.join(buffers[:3])}{', ...' if len(buffers) > 3 else ''}"
                "), e.g. BatchNorm running statistics, which the loop averages over clients without clipping or "
                "noise, outside the privacy guarantee; use GroupNorm/LayerNorm or BatchNorm(track_running_stats="
                "False)"
            )
        # integer and bool buffers: the same unless client training leaves them as they are (position ids,
        # constant masks), which accumulate checks; (name, the global buffer, its slice of ClientUpdate.buffers)
        named = list(model.named_buffers())
        self._fixed_buffers = [(*named[i], part) for i, part in averaged_buffer_slices([b for _, b in named])]
        population = self.population(pl_module)
        dm = pl_module.datamodule
        own = [
            m for m in ("sample_clients", "round_plan") if getattr(type(dm), m) is not getattr(FederatedDataModule, m)
        ]
        if own:
            rank_zero_warn(
                f"DPFedAvg: {type(dm).__name__} defines its own {' and '.join(own)}; the accountant takes each round "
                "to sample clients_per_round of the population uniformly (q = clients_per_round / population_size), "
                "and the epsilon it reports holds only for such sampling"
            )
        holding = population if self.population_size is None else len(dm.clients_with_data())
        if population > holding:
            raise ValueError(
                f"DPFedAvg: population_size={population} exceeds the {holding} clients with training data that the "
                "data module samples from: the accountant would take the sampling rate q = clients_per_round / "
                f"{population} where it is clients_per_round / {holding}, and report a smaller epsilon than the "
                f"training has; leave population_size unset (the {holding} clients) or set it to at most {holding}"
            )
        cohort = getattr(pl_module, "clients_per_round", None)
        if cohort is not None and cohort > population:
            raise ValueError(f"DPFedAvg: clients_per_round={cohort} exceeds population_size={population}")
        if cohort is not None:
            self.noise_parameters(int(cohort))  # the adaptive-clipping noise refused before round 0
        if self.delta >= 1.0 / population:
            rank_zero_warn(
                f"DPFedAvg: delta={self.delta:g} >= 1/N (N={population} clients): a mechanism that "
                "publishes one client's data outright meets such a δ; choose delta < 1/N"
            )

    def on_round_start(self, trainer, pl_module, plan: RoundPlan) -> None:
        self._check_distinct(plan)

    def client_weight(self, update: ClientUpdate) -> float:
        return 1.0

    def _check_fixed_buffers(self, update: ClientUpdate) -> None:
        """Refuse a client whose training changed an integer or bool buffer (the loop would average it without
        clipping or noise); one no client changes averages to its own value and reveals nothing."""
        for name, b, part in getattr(self, "_fixed_buffers", ()):
            mine = update.buffers[part]
            if not torch.equal(mine, buffer_values(b.detach()).to(mine.dtype)):
                raise ValueError(
                    f"DPFedAvg: client {update.client_id}'s training changed the buffer {name!r}, which the loop "
                    "averages over clients without clipping or noise, outside the privacy guarantee; keep it "
                    "constant, or keep such state out of the model's buffers"
                )

    def accumulate(self, stats: RoundStatistics, update: ClientUpdate) -> None:
        """``dp_clipped_sum``: ``Δ_i · min(1, C/‖Δ_i‖)`` (a zero norm or ``C = inf``: factor 1, the update
        unchanged); with adaptive clipping ``dp_unclipped_centered``: ``1[‖Δ_i‖ ≤ C] − ½``. No host read."""
        if update.buffers is not None:
            self._check_fixed_buffers(update)
        delta = update.delta
        norm = squared_norm64(delta).sqrt()
        clip = self.current_clip_norm
        factor = torch.clamp(clip / norm, max=1.0)
        wide = delta.to(sum_dtype(delta.dtype))  # float32 for half-precision updates, as FedAvg's sum
        stats.add("dp_clipped_sum", wide * factor.to(wide.dtype))
        if self.adaptive:
            stats.add("dp_unclipped_centered", (norm <= clip).double() - 0.5)

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan) -> ServerStep:
        self._check_distinct(plan)
        if "dp_clipped_sum" not in stats:
            raise RuntimeError(
                "DPFedAvg.server_update: no clipped sum in the round's statistics (the loop adds "
                "DPFedAvg.accumulate's statistics for every healthy client)"
            )
        cohort = len(plan.client_ids)
        sigma, count_stddev = self.noise_parameters(cohort)
        clip = self.current_clip_norm
        total = stats["dp_clipped_sum"]
        if sigma > 0:
            gen = torch.Generator(device=total.device).manual_seed(derive_seed(loop.seed, "dp-noise", plan.round))
            # N(0, 1) per real coordinate (torch's complex normal would give each part of a complex one variance 1/2)
            parts = real_parts(total)
            noise = torch.randn(parts.shape, generator=gen, device=total.device, dtype=parts.dtype)
            if total.is_complex():
                noise = torch.view_as_complex(noise)
            total = total + noise * (sigma * clip)
        # the divisor as FedAvg's mean_delta forms it (a float64 count cast to the sum's dtype): bit-identical to
        # FedAvg(weighting="uniform") without noise and clipping
        pseudo = total / torch.tensor(float(cohort), dtype=torch.float64, device=total.device).to(total.dtype)
        metrics: dict[str, float] = {
            "privacy/clip_norm": clip,
            "privacy/noise_multiplier": sigma,
            "privacy/noise_std": sigma * clip / cohort if sigma > 0 else 0.0,
        }
        if self.adaptive:
            centered = float(stats["dp_unclipped_centered"].item()) if "dp_unclipped_centered" in stats else 0.0
            if count_stddev > 0:
                gen = torch.Generator().manual_seed(derive_seed(loop.seed, "dp-clip-count", plan.round))
                centered += count_stddev * float(torch.randn((), generator=gen, dtype=torch.float64).item())
            unclipped = min(1.0, max(0.0, centered / cohort + 0.5))
            self.current_clip_norm = clip * math.exp(-self.clip_learning_rate * (unclipped - self.target_quantile))
            metrics["privacy/unclipped_fraction"] = unclipped
        return ServerStep(pseudo, None, metrics)

    def on_round_end(self, trainer, pl_module, result) -> None:
        """One accountant step for the round (``z``, ``q = m/N``); ``privacy/epsilon`` and the server optimizer's
        statistics join the round's metrics."""
        cohort = len(result.plan.client_ids)
        rate = cohort / self.population(pl_module)
        z = self.noise_multiplier
        if self.history and self.history[-1][0] == z and self.history[-1][1] == rate:
            self.history[-1] = (z, rate, self.history[-1][2] + 1)  # as RDPAccountant.step merges equal rounds
        else:
            self.history.append((z, rate, 1))
        result.metrics["privacy/epsilon"] = self.epsilon()
        result.metrics["privacy/delta"] = self.delta
        result.metrics["privacy/sample_rate"] = rate
        if self.server_optimizer == "sgd":
            result.metrics.update(_moment_statistics(self._optimizer, None, "momentum_buffer"))
        else:
            result.metrics.update(_moment_statistics(self._optimizer, "exp_avg_sq", "exp_avg"))

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default: the configured δ), from Opacus's RDP accountant."""
        return rdp_epsilon(self.history, self.delta if delta is None else delta)

    # ------------------------------------------------------------------ server optimizer
    def configure_server_optimizer(self, params):
        if self.server_optimizer == "sgd":
            self._optimizer = torch.optim.SGD(params, lr=self.server_lr, momentum=self.server_momentum)
        else:
            self._optimizer = AdaptiveServerOptimizer(
                params, lr=self.server_lr, rule=self.server_optimizer, betas=self.betas, eps=self.tau
            )
        return self._optimizer

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"clip_norm": self.current_clip_norm, "history": [list(h) for h in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.current_clip_norm = float(state_dict["clip_norm"])
        self.history = [(float(z), float(q), int(n)) for z, q, n in state_dict["history"]]

    def __repr__(self) -> str:
        extra = ""
        if self.adaptive:
            extra = (
                f", target_quantile={self.target_quantile}, clip_learning_rate={self.clip_learning_rate}, "
                f"clipped_count_stddev={self.clipped_count_stddev}"
            )
        return (
            f"DPFedAvg(clip_norm={self.clip_norm}, noise_multiplier={self.noise_multiplier}, delta={self.delta}, "
            f"server_lr={self.server_lr}, server_optimizer={self.server_optimizer!r}{extra})"
        )
