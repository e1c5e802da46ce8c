r"""FedSPS-Normalized and FedSPS-Global: the two alternatives to FedSPS of Mukherjee, Loizou, Stich, "Locally Adaptive
Federated Learning" (seed 001, App. D.1 Algorithm 2 and App. D.2 Algorithm 3). Plain FedSPS / FedDecSPS need no
strategy of their own: they are :class:`~fedlightning.optim.SPS` / :class:`~fedlightning.optim.DecSPS` clients with
``FedAvg(weighting="uniform")`` (``configs/fedsps.yaml``, ``configs/feddecsps.yaml``).

:class:`FedSPSNormalized` aggregates with the clients' normalization factors :math:`\nu^j = \sum_k \gamma^j_k`
(two readings of Algorithm 2); :class:`FedSPSGlobal` shares one SPS step size per round across all clients. The
formulas and decisions are in the two classes' docstrings.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedlightning._logging_route import discard, routed_logging
from fedlightning._validation import SettingTypeError, number, one_of, positive
from fedlightning.callbacks.base import RoundStatistics, ServerStrategy
from fedlightning.client import extract_loss
from fedlightning.optim import SPS
from fedlightning.state import ClientUpdate, RoundPlan, derive_seed, squared_norm64

__all__ = ["FedSPSNormalized", "FedSPSGlobal"]

READINGS = ("weighted_models", "fednova")
AGGREGATIONS = ("mean_of_steps", "ratio_of_means")


def normalization_factor(update: ClientUpdate) -> float:
    """:math:`\\nu^j`: the sum of the client's finite local step sizes of the round."""
    return float(math.fsum(s for s in update.step_sizes if math.isfinite(s)))


class FedSPSNormalized(ServerStrategy):
    r"""FedSPS-Normalized (seed 001, App. D.1): aggregation normalized by the clients' summed step sizes.

    **FedSPS-Normalized** (App. D.1). Clients run FedSPS (local SPS steps); client :math:`j` keeps the normalization
    factor :math:`\nu^j = \sum_k \gamma^j_k`, the sum of its local step sizes in the round, and the server aggregates
    with the factors. Two readings of Algorithm 2, ``reading=``:

    * ``"weighted_models"`` (default; Algorithm 2 as written): a weighted average of the client models with weights
      :math:`1/\nu^j`,

      .. math:: x_{t+1} = \frac{\sum_j x^j/\nu^j}{\sum_j 1/\nu^j}
                \iff \Delta = \frac{\sum_j \Delta_j/\nu^j}{\sum_j 1/\nu^j} \quad (\Delta_j = x_t - x^j);

    * ``"fednova"`` (the prose: "pseudo-gradients normalized by the client and server normalization factors", the
      FedNova form of Wang et al. 2020): :math:`\Delta = \big(\tfrac1n\sum_j \nu^j\big)\cdot\tfrac1n\sum_j
      \Delta_j/\nu^j`.

    Decisions (ours): :math:`\nu^j` includes the step size of the round's last local step (Algorithm 2 as typeset
    adds :math:`\gamma_t^j` only on non-communication steps, which would make :math:`\nu^j = 0` for :math:`\tau = 1`)
    and starts at 0 each round; it is the sum of the finite ``ClientUpdate.step_sizes``. A client whose factor is not
    positive (it did not move in the whole round) has no direction to normalize: it is marked failed (the loop leaves it
    out with a warning). Float buffers (BatchNorm statistics) are averaged with the same weights :math:`1/\nu^j`. The
    paper finds no practical advantage over FedSPS (Fig. 6).

    Args:
        reading: ``"weighted_models"`` (Algorithm 2 as written, default) or ``"fednova"`` (see above).
    """

    def __init__(self, reading: str = "weighted_models"):
        super().__init__(server_lr=1.0, weighting="uniform")  # seed 001: no server learning rate
        self.reading = one_of("reading", reading, READINGS)

    def on_client_end(self, trainer, pl_module, plan: RoundPlan, update: ClientUpdate) -> None:
        if update.failed:
            return
        if update.param_step_size_sums is not None:
            raise ValueError(
                f"round {plan.round}: FedSPS-Normalized normalizes by the sum of a client's step sizes, but the client "
                "optimizer's parameter groups took different learning rates (sums per parameter "
                f"{sorted(set(update.param_step_size_sums))}): give its parameter groups one learning rate"
            )
        nu = normalization_factor(update)
        if not (nu > 0 and math.isfinite(nu)):
            update.failed = True
            update.failure = f"FedSPS-Normalized needs a positive sum of local step sizes, got {update.step_sizes!r}"

    def client_weight(self, update: ClientUpdate) -> float:
        return 1.0 / normalization_factor(update)

    def accumulate(self, stats: RoundStatistics, update: ClientUpdate) -> None:
        # the core sums (accumulate_core) are weighted by client_weight = 1/ν_j: Σ Δ_j/ν_j, Σ 1/ν_j, n, buffers
        stats.add("normalization_sum", normalization_factor(update), update.delta.device)

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan):
        n = stats["clients"]
        mean_nu = stats["normalization_sum"] / n
        if self.reading == "weighted_models":
            delta = self.mean_delta(stats)
        else:
            delta = stats["delta"] * (mean_nu / n).to(stats["delta"].dtype)
        return delta, None, {"server/mean_normalization": float(mean_nu)}

    def __repr__(self) -> str:
        return f"FedSPSNormalized(reading={self.reading!r})"


class FedSPSGlobal(ServerStrategy):
    r"""FedSPS-Global (seed 001, App. D.2): one SPS step size per round shared by all clients.

    **FedSPS-Global** (App. D.2, Algorithm 3). One step size :math:`\gamma` is shared by all clients and all local steps
    of a round (plain SGD steps :math:`x \leftarrow x - \gamma g`); at each communication step it is recomputed from the
    clients' last local step (loss :math:`F_j` and gradient :math:`g_j` at the point where that step was taken) and used
    in the NEXT round:

    * ``aggregation="mean_of_steps"`` (default; Eq. 41, the paper's choice (a)):
      :math:`\gamma \leftarrow \frac1n\sum_j \min\{(F_j - \ell^*)/(c\|g_j\|^2),\ \gamma_b\}`;
    * ``aggregation="ratio_of_means"`` (choice (b)):
      :math:`\gamma \leftarrow \min\{\frac1n\sum_j (F_j - \ell^*) / (c\cdot\frac1n\sum_j\|g_j\|^2),\ \gamma_b\}`.

    (Choice (c), with the norm of the averaged gradient, "explodes in practice" per the paper and needs model-sized
    uploads; it is not offered.) The initial :math:`\gamma_0` is, as in the paper, client 0's local SPS step at
    iteration 0: the first client of the first round's sample, evaluated at the global model on its first mini-batch
    (the same batch and dropout seed its first local step uses), unless ``initial_step_size`` is given. Clients must use
    ``SPS(fixed_step_size=1.0)``: SPS in fixed-step mode applies ``fixed_step_size × client_lr_scale``
    (:meth:`~fedlightning.optim.SPS.scale_step`) and measures the SPS quantities of every step; this strategy multiplies
    the round's ``plan.client_lr_scale`` by :math:`\gamma` in ``on_round_start`` and reads the last step's loss and
    :math:`\|g\|^2` from ``update.payload`` (``SPS.client_report``). :math:`c`, :math:`\gamma_b`, :math:`\ell^*` are
    this strategy's arguments (the client optimizer's own values only affect its telemetry). :math:`\gamma` is
    checkpointed with the strategy. Clients weigh uniformly and the server has no learning rate (Algorithm 3).
    Degenerate client values: :math:`\max(F_j-\ell^*, 0)` in the numerator, and a zero gradient counts as
    :math:`\gamma_b` in (a) (the limit of the min).

    Args:
        c: SPS constant :math:`c`. Default 0.5 (seed 001).
        gamma_max: cap :math:`\gamma_b`. Default 1.0 (seed 001).
        f_star: lower bound :math:`\ell^*`. Default 0.0 (seed 001).
        aggregation: ``"mean_of_steps"`` (seed 001's choice (a), default) or ``"ratio_of_means"`` (choice (b)).
        initial_step_size: :math:`\gamma_0`; None (default) measures client 0's SPS step at iteration 0 (seed 001).
    """

    def __init__(
        self,
        c: float = 0.5,
        gamma_max: float = 1.0,
        f_star: float = 0.0,
        aggregation: str = "mean_of_steps",
        initial_step_size: float | None = None,
    ):
        super().__init__(server_lr=1.0, weighting="uniform")  # seed 001: uniform average, no server learning rate
        self.c = positive("c", c)
        self.gamma_max = positive("gamma_max", gamma_max)
        self.f_star = number("f_star", f_star)
        self.aggregation = one_of("aggregation", aggregation, AGGREGATIONS)
        self.initial_step_size = positive("initial_step_size", initial_step_size, allow_none=True)
        self.step_size: float | None = self.initial_step_size  # γ of the next round

    # ------------------------------------------------------------------ the SPS value of one (loss, ‖g‖²)
    def sps_value(self, loss: float, grad_sq: float) -> float:
        """:math:`\\min\\{\\max(F-\\ell^*, 0)/(c\\|g\\|^2), \\gamma_b\\}` (0/0 := 0, x/0 := ∞ for x > 0)."""
        return self._capped_ratio(max(loss - self.f_star, 0.0), grad_sq)

    def _capped_ratio(self, gap: float, grad_sq: float) -> float:
        if grad_sq <= 0.0:
            return self.gamma_max if gap > 0 else 0.0
        return min(gap / (self.c * grad_sq), self.gamma_max)

    def _probe_first_client(self, trainer, loop, plan: RoundPlan) -> float:
        """Client ``plan.client_ids[0]``'s SPS step at the global model on its first mini-batch of this round (the
        batch and dropout seed its first local step uses); model buffers, RNG and logging are left untouched."""
        dm = trainer.datamodule
        client_id = plan.client_ids[0]
        batch = next(iter(dm.client_dataloader(client_id, plan.round, seed=loop.seed)))
        batch = loop.client_worker.prepare_batch(batch)  # as the client's first local step gets it
        model = loop.model
        params = [p for p in model.parameters() if p.requires_grad]
        buffers = list(model.buffers())
        saved = [b.detach().clone() for b in buffers]
        devices = [loop.device] if loop.device.type == "cuda" else []
        was_training = model.training
        try:
            model.train()
            with routed_logging(model, discard, discard), torch.random.fork_rng(devices=devices), torch.enable_grad():
                seed = derive_seed(loop.seed, "model", plan.round, client_id)
                torch.default_generator.manual_seed(seed)
                for dev in devices:
                    torch.cuda.default_generators[dev.index if dev.index is not None else 0].manual_seed(seed)
                loss = extract_loss(model.training_step(batch, 0), type(model).__name__)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
        finally:
            model.train(was_training)
            with torch.no_grad():
                for b, s in zip(buffers, saved):
                    b.copy_(s)
        grad_sq = math.fsum(float(squared_norm64(g)) for g in grads if g is not None)
        return self.sps_value(float(loss.detach()), grad_sq)

    # ------------------------------------------------------------------ hooks
    def _check_client_optimizer(self, loop) -> None:
        """At fit start (before any client trains), refuse a client optimizer other than SPS in fixed-step mode: the
        shared step reaches the clients as ``client_lr_scale``, which would otherwise multiply an adaptive rule's own
        steps (adaptive SPS: ``γ × γ_i``) or be refused later by :func:`~fedlightning.optim.scale_client_step`."""
        opt = loop.client_optimizer_factory(list(loop.global_parameters()))
        if not (isinstance(opt, SPS) and opt.hyper.get("fixed_step_size") is not None):
            raise SettingTypeError(
                "model.client_optimizer",
                "FedSPSGlobal needs client_optimizer fedlightning.optim.SPS with fixed_step_size=1.0 (fixed-step "
                f"mode: the clients apply the server's shared step), got {type(opt).__name__}"
                + (" without fixed_step_size (adaptive SPS)" if isinstance(opt, SPS) else ""),
            )

    def on_fit_start(self, trainer, pl_module) -> None:
        self._check_client_optimizer(pl_module)

    def on_round_start(self, trainer, pl_module, plan: RoundPlan) -> None:
        if self.step_size is None:
            self.step_size = self._probe_first_client(trainer, pl_module, plan)
            if not self.step_size > 0:
                raise ValueError(
                    f"FedSPS-Global: the initial SPS step of client {plan.client_ids[0]} is {self.step_size} (zero "
                    "gradient or loss <= f_star at the initial model); pass initial_step_size"
                )
        plan.client_lr_scale = plan.client_lr_scale * self.step_size
        plan.extras["sps_global_step_size"] = self.step_size

    def on_client_end(self, trainer, pl_module, plan: RoundPlan, update: ClientUpdate) -> None:
        if update.failed:
            return
        if "sps_last_loss" not in update.payload or "sps_last_grad_sq" not in update.payload:
            raise TypeError(
                "FedSPSGlobal needs client_optimizer fedlightning.optim.SPS with fixed_step_size=1.0 (fixed-step "
                f"mode), whose client_report gives the last step's loss and gradient norm; client {update.client_id} "
                f"sent {sorted(update.payload)}"
            )

    def accumulate(self, stats: RoundStatistics, update: ClientUpdate) -> None:
        super().accumulate(stats, update)
        loss, grad_sq = float(update.payload["sps_last_loss"]), float(update.payload["sps_last_grad_sq"])
        device = update.delta.device
        stats.add("sps_value_sum", self.sps_value(loss, grad_sq), device)
        stats.add("sps_gap_sum", max(loss - self.f_star, 0.0), device)
        stats.add("sps_grad_sq_sum", grad_sq, device)

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan):
        n = float(stats["clients"])
        used = self.step_size
        if self.aggregation == "mean_of_steps":
            new = float(stats["sps_value_sum"]) / n
        else:
            new = self._capped_ratio(float(stats["sps_gap_sum"]) / n, float(stats["sps_grad_sq_sum"]) / n)
        if new > 0 and math.isfinite(new):  # a round of all-degenerate clients keeps the previous step
            self.step_size = new
        metrics = {
            "server/sps_global_step_size": float(used),
            "server/sps_global_next_step_size": float(self.step_size),
        }
        return self.mean_delta(stats), None, metrics

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"step_size": self.step_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step_size = state_dict.get("step_size")

    def __repr__(self) -> str:
        return (
            f"FedSPSGlobal(c={self.c}, gamma_max={self.gamma_max}, f_star={self.f_star}, "
            f"aggregation={self.aggregation!r}, initial_step_size={self.initial_step_size})"
        )
