r"""Local adaptive methods whose step-size statistics the server synchronises: :class:`LocalAdaAlter` (Xie, Koyejo,
Gupta & Lin 2019, "Local AdaAlter: Communication-Efficient Stochastic Gradient Descent with Adaptive Learning Rates")
and :class:`LocalAMSGrad` (Chen, Li & Li, "Toward Communication Efficient Adaptive Gradient Method", FODS 2020).

Each round the server sends the model and its statistics (AdaAlter's accumulator :math:`B^2`; AMSGrad's
:math:`m, v, \hat v`) through ``configure_client_optimizer``; the round's clients run the local adaptive method
(:class:`fedlightning.optim.AdaAlterClient`, :class:`fedlightning.optim.AMSGradClient`) with those statistics, send
back their model and statistics (``client_report`` → ``update.payload``), and the server averages the models (no
server learning rate: the papers' synchronisation is a plain average) and aggregates the statistics. Formulas and
decisions are in the two classes' docstrings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedlightning._validation import SettingTypeError, non_negative
from fedlightning.callbacks.base import RoundStatistics, ServerStrategy
from fedlightning.callbacks.mime import flat_from_positions, optimizer_positions, position_views
from fedlightning.optim.local_adaptive import AdaAlterClient, AMSGradClient
from fedlightning.state import ClientUpdate, RoundPlan, flat_params

__all__ = ["LocalAdaAlter", "LocalAMSGrad"]


class _SynchronisedStatistics(ServerStrategy):
    """Shared parts: the required client optimizer class, the server's flat statistics (checkpointed), their views
    for each client's optimizer and the client's reported statistics as flat weighted sums."""

    client_class: type = torch.optim.Optimizer
    #: server state names, flat vectors in the global parameters' order
    state_names: tuple[str, ...] = ()
    #: payload key (client_report) -> statistic name summed over the round's clients
    reports: dict[str, str] = {}

    def __init__(self, weighting: str):
        super().__init__(server_lr=1.0, weighting=weighting)
        self.statistics: dict[str, Tensor] = {}
        self._positions: dict[int, list[tuple[int, int]]] = {}  # client -> its optimizer's parameter positions

    def _check_client_optimizer(self, optimizer: Any) -> None:
        if not isinstance(optimizer, self.client_class):
            raise SettingTypeError(
                "model.client_optimizer",
                f"{type(self).__name__} needs model.client_optimizer to be "
                f"fedlightning.optim.{self.client_class.__name__} (the local method whose statistics it "
                f"synchronises), got {type(optimizer).__name__}; set "
                f"model.client_optimizer: {{class_path: fedlightning.optim.{self.client_class.__name__}}}",
            )

    def on_fit_start(self, trainer, pl_module) -> None:
        self._check_client_optimizer(pl_module.client_optimizer_factory(list(pl_module.global_parameters())))

    def initial_statistics(self, like: Tensor) -> dict[str, Tensor]:
        return {name: torch.zeros_like(like) for name in self.state_names}

    def _statistics(self, like: Tensor) -> dict[str, Tensor]:
        """The server statistics on ``like``'s device and dtype (created with :meth:`initial_statistics` when empty,
        ``like`` then being a flat vector of the model's size)."""
        if not self.statistics:
            self.statistics = self.initial_statistics(like)
        for name, value in self.statistics.items():
            if value.device != like.device or value.dtype != like.dtype:
                self.statistics[name] = value.to(device=like.device, dtype=like.dtype)
        return self.statistics

    def client_state(self, statistics: dict[str, Tensor]) -> dict[str, Tensor]:
        """The flat vectors sent to the clients, by the client optimizer's state name."""
        raise NotImplementedError

    def on_round_start(self, trainer, pl_module, plan: RoundPlan) -> None:
        params = pl_module.global_parameters()
        if not self.statistics:
            self.statistics = self.initial_statistics(flat_params(params))
        self._statistics(params[0])

    def configure_client_optimizer(self, trainer, pl_module, plan: RoundPlan, client_id: int, optimizer):
        self._check_client_optimizer(optimizer)
        if not self.statistics:
            raise RuntimeError(f"{type(self).__name__}: on_round_start did not run for round {plan.round}")
        stats = self.statistics
        positions = optimizer_positions(pl_module, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        sent = {key: position_views(vec, positions, params) for key, vec in self.client_state(stats).items()}
        optimizer.set_server_state(sent)
        self._positions[client_id] = positions
        return None

    def on_client_end(self, trainer, pl_module, plan: RoundPlan, update: ClientUpdate) -> None:
        if update.failed or update.delta is None:
            return
        positions = self._positions.get(update.client_id)
        missing = [key for key in self.reports if key not in update.payload]
        if positions is None or missing:
            raise TypeError(
                f"{type(self).__name__} needs the client statistics of fedlightning.optim.{self.client_class.__name__}"
                f" (client_report); client {update.client_id} sent {sorted(update.payload)}"
            )
        size = update.delta.numel()
        for key in self.reports:
            update.payload[key] = flat_from_positions(update.payload[key], positions, size, update.delta)

    def accumulate(self, stats: RoundStatistics, update: ClientUpdate) -> None:
        w = self.client_weight(update)
        for key, name in self.reports.items():
            stats.add(name, update.payload[key] * w)

    def _means(self, stats: RoundStatistics) -> dict[str, Tensor]:
        weight = stats["weight"]
        return {name: stats[name] / weight.to(stats[name].dtype) for name in self.reports.values()}

    def on_round_end(self, trainer, pl_module, result) -> None:
        self._positions = {}

    def state_dict(self) -> dict[str, Any]:
        return {"statistics": {k: v.detach().cpu().clone() for k, v in self.statistics.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.statistics = dict(state_dict.get("statistics") or {})


class LocalAdaAlter(_SynchronisedStatistics):
    r"""Local AdaAlter (Xie et al. 2019): local AdaGrad steps with the accumulator frozen at its synchronised value,
    the accumulators averaged at every synchronisation.

    **Round** (server accumulator :math:`B^2`, clients :math:`S`; :class:`~fedlightning.optim.AdaAlterClient`)::

        client i ∈ S, y ← x, A_i² ← B²;  local step k = 1..K:
            y ← y − η g / √(B² + k ε²)          B² frozen; k ε² the placeholder for the k missing squared gradients
            A_i² ← A_i² + g²
        x  ← Σ_i w_i y_i / Σ_i w_i              (no server learning rate)
        B² ← Σ_i w_i A_i² / Σ_i w_i  = B² + Σ_i w_i (Σ_k g_{i,k}²) / Σ_i w_i

    **Decisions** (ours unless a source is named): the paper's synchronisation every :math:`H` steps of all workers
    becomes a round of :math:`K` local steps of the sampled clients (``local_steps``, :math:`H = K`), and :math:`B^2`
    is averaged over the round's clients only (non-sampled clients hold no state of their own: each round's clients
    start from the server's :math:`B^2`); the clients upload their increment :math:`\sum_k g_k^2` (summable, the same
    average); :math:`B^2` starts at ``initial_accumulator`` (default 0, AdaGrad's usual start); :math:`\eta` and
    :math:`\varepsilon` are the client optimizer's (``model.client_optimizer: fedlightning.optim.AdaAlterClient``,
    refused otherwise at fit start); ``weighting="uniform"`` (default: the paper averages over workers) or
    ``"samples"``. Per round and client: no extra computation (one ``addcmul`` per step); down :math:`x, B^2`, up
    :math:`y_i, \sum_k g_k^2` (two model-sized vectors each way). :math:`B^2` is this strategy's checkpointed state.

    **Execution**: :class:`~fedlightning.optim.AdaAlterClient` has a batched form, so ``client_execution="vectorized"``
    trains the round's clients in lockstep, to the weights and statistics of sequential training (float rounding
    apart; ``tests/test_local_adaptive.py``).

    Logged: ``server/accumulator_mean`` and ``server/accumulator_max`` (of :math:`B^2` after the round).

    Args:
        initial_accumulator: :math:`B^2` before the first round, ``>= 0``. Default 0.0.
        weighting: ``"uniform"`` (default) or ``"samples"``.
    """

    client_class = AdaAlterClient
    state_names = ("accumulator",)
    reports = {"adaalter_accumulator_increment": "adaalter_increment"}

    def __init__(self, initial_accumulator: float = 0.0, weighting: str = "uniform"):
        super().__init__(weighting)
        self.initial_accumulator = non_negative("initial_accumulator", initial_accumulator)

    def initial_statistics(self, like: Tensor) -> dict[str, Tensor]:
        return {"accumulator": torch.full_like(like, self.initial_accumulator)}

    def client_state(self, statistics: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"accumulator": statistics["accumulator"]}

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan):
        delta = self.mean_delta(stats)
        b2 = self._statistics(delta)["accumulator"]
        b2.add_(self._means(stats)["adaalter_increment"])
        metrics = {
            "server/accumulator_mean": float(b2.double().mean().item()),
            "server/accumulator_max": float(b2.double().max().item()),
        }
        return delta, None, metrics

    def __repr__(self) -> str:
        return f"LocalAdaAlter(initial_accumulator={self.initial_accumulator}, weighting={self.weighting!r})"


class LocalAMSGrad(_SynchronisedStatistics):
    r"""Local AMSGrad (Chen, Li & Li 2020): local AMSGrad steps with the max-stabilised second moment :math:`\hat v`
    shared and frozen between synchronisations; the moments averaged and :math:`\hat v` updated at the server.

    **Round** (server :math:`m, v, \hat v`, clients :math:`S`; :class:`~fedlightning.optim.AMSGradClient`)::

        client i ∈ S, y ← x, m_i ← m, v_i ← v;  local steps:
            m_i ← β1 m_i + (1 − β1) g,   v_i ← β2 v_i + (1 − β2) g²
            y ← y − η m_i / √max(v̂, ε)           v̂ frozen: one preconditioner for every client
        x ← Σ_i w_i y_i / Σ_i w_i                 (no server learning rate)
        m ← Σ_i w_i m_i / Σ_i w_i,   v ← Σ_i w_i v_i / Σ_i w_i,   v̂ ← max(v̂, v)

    **Decisions** (ours unless a source is named): a round of :math:`K` local steps of the sampled clients is the
    paper's period between synchronisations; the first and second moments are averaged over the round's clients (the
    state every client of the next round starts from) and :math:`\hat v` is the running element-wise max of the
    averaged :math:`v` (AMSGrad's max, taken at the server so all clients share it); :math:`m, v, \hat v` start at 0,
    so the first round's steps are preconditioned by :math:`\sqrt{\varepsilon}` alone (:math:`\varepsilon`: the client
    optimizer's max-stabilisation floor, as FedAMS's); no bias correction; :math:`\eta, \beta_1, \beta_2,
    \varepsilon` are the client optimizer's (``model.client_optimizer: fedlightning.optim.AMSGradClient``, refused
    otherwise at fit start); ``weighting="uniform"`` (default) or ``"samples"``. Per round and client: no extra
    computation; down :math:`x, m, v, \hat v`, up :math:`y_i, m_i, v_i`. :math:`m, v, \hat v` are this strategy's
    checkpointed state.

    **Execution**: :class:`~fedlightning.optim.AMSGradClient` has a batched form, so ``client_execution="vectorized"``
    trains the round's clients in lockstep, to the weights and statistics of sequential training (float rounding
    apart; ``tests/test_local_adaptive.py``).

    Logged: ``server/first_moment_norm`` (‖m‖), ``server/second_moment_mean`` and ``server/second_moment_max``
    (of :math:`\hat v`), as FedAMS.

    Args:
        weighting: ``"uniform"`` (default) or ``"samples"``.
    """

    client_class = AMSGradClient
    state_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    reports = {"amsgrad_exp_avg": "amsgrad_exp_avg", "amsgrad_exp_avg_sq": "amsgrad_exp_avg_sq"}

    def __init__(self, weighting: str = "uniform"):
        super().__init__(weighting)

    def client_state(self, statistics: dict[str, Tensor]) -> dict[str, Tensor]:
        return dict(statistics)

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan):
        delta = self.mean_delta(stats)
        state = self._statistics(delta)
        means = self._means(stats)
        state["exp_avg"].copy_(means["amsgrad_exp_avg"])
        state["exp_avg_sq"].copy_(means["amsgrad_exp_avg_sq"])
        torch.maximum(state["max_exp_avg_sq"], state["exp_avg_sq"], out=state["max_exp_avg_sq"])
        vhat = state["max_exp_avg_sq"].double()
        metrics = {
            "server/first_moment_norm": float(state["exp_avg"].double().norm().item()),
            "server/second_moment_mean": float(vhat.mean().item()),
            "server/second_moment_max": float(vhat.max().item()),
        }
        return delta, None, metrics

    def __repr__(self) -> str:
        return f"LocalAMSGrad(weighting={self.weighting!r})"
