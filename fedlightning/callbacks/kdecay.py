"""Decaying the number of local steps (or the client learning rate) over rounds, and the simulated runtime model
(Mills, Hu & Min, "Faster Federated Learning with Decaying Number of Local SGD Steps", seed 004, Table III and
Sec. 3.2).

:class:`KDecay`: ``K_r = ⌈K_0 · r^{−1/3}⌉`` (``rounds``), ``⌈K_0 · (F_r/F_0)^{1/3}⌉`` (``error``) or a one-time
step decay once converged; with ``decay="client_lr"`` the client learning rate instead (exponent 1/2). The table,
dSGD / Kη-fixed and the decisions (exact ceilings, ``F_r``, ``F_0``, the plateau rule) are in its docstring; the
schedule functions (:func:`rounds_local_steps`, :func:`error_local_steps`, ...) compute one value each.
:class:`RuntimeModel`: the simulated wall-clock ``W_r = |x|/D + K_r·β + |x|/U`` per round.
"""

from __future__ import annotations

import math
from collections import deque
from fractions import Fraction
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from fedlightning._validation import in_range, integer, non_negative, one_of, positive
from fedlightning.callbacks.base import FederatedCallback
from fedlightning.optim import check_client_step_scalable

__all__ = [
    "KDecay",
    "RuntimeModel",
    "PlateauDetector",
    "ceil_cube_root",
    "rounds_local_steps",
    "error_local_steps",
    "step_local_steps",
    "rounds_lr_scale",
    "error_lr_scale",
    "simulated_round_seconds",
]

SCHEDULES = ("rounds", "error", "step")
LOSS_RATIO_TOLERANCE = Fraction(1, 10**12)  # relative slack of the error schedule's ceiling (KDecay docstring)
DECAYS = ("local_steps", "client_lr")


# ====================================================================== exact integer arithmetic
def ceil_cube_root(numerator: int, denominator: int = 1) -> int:
    """The smallest integer ``k ≥ 0`` with ``k³ · denominator ≥ numerator`` (``⌈∛(numerator/denominator)⌉``)."""
    if denominator <= 0 or numerator < 0:
        raise ValueError(f"need numerator >= 0 and denominator > 0, got {numerator}/{denominator}")
    if numerator == 0:
        return 0
    try:
        k = max(0, math.ceil((numerator / denominator) ** (1.0 / 3.0)))
    except OverflowError:  # beyond float range: bisection on exact integers
        lo, hi = 0, 1 << ((numerator.bit_length() - denominator.bit_length()) // 3 + 2)
        while lo < hi:
            mid = (lo + hi) // 2
            if mid**3 * denominator >= numerator:
                hi = mid
            else:
                lo = mid + 1
        return lo
    while k > 0 and (k - 1) ** 3 * denominator >= numerator:
        k -= 1
    while k**3 * denominator < numerator:
        k += 1
    return k


def _check_k0(k0: int) -> int:
    return integer("k0", k0)


def _check_round(round_number: int) -> int:
    """A 1-based round number."""
    return integer("round_number", round_number)


def _check_losses(loss: float, reference_loss: float) -> None:
    non_negative("loss", loss, label="loss estimate")
    positive("reference_loss", reference_loss, label="reference loss F_0")


def rounds_local_steps(k0: int, round_number: int) -> int:
    """K_r-rounds: ``⌈K_0 · r^{−1/3}⌉`` (exact)."""
    k0, r = _check_k0(k0), _check_round(round_number)
    return max(1, ceil_cube_root(k0**3, r))


def error_local_steps(k0: int, loss: float, reference_loss: float) -> int:
    """K_r-error: ``⌈K_0 · (F_r/F_0)^{1/3}⌉`` (exact rational cubes, relative tolerance 1e-12), at least 1."""
    k0 = _check_k0(k0)
    _check_losses(loss, reference_loss)
    target = Fraction(k0) ** 3 * Fraction(loss) / Fraction(reference_loss) * (1 - LOSS_RATIO_TOLERANCE)
    return max(1, ceil_cube_root(target.numerator, target.denominator))


def step_local_steps(k0: int, factor: float) -> int:
    """K_r-step after the decay: ``⌈K_0 / factor⌉`` (exact), at least 1."""
    k0 = _check_k0(k0)
    q = Fraction(k0) / Fraction(factor)
    return max(1, -((-q.numerator) // q.denominator))


def rounds_lr_scale(round_number: int) -> float:
    """η_r-rounds multiplier ``r^{−1/2}``."""
    return 1.0 / math.sqrt(_check_round(round_number))


def error_lr_scale(loss: float, reference_loss: float) -> float:
    """η_r-error multiplier ``(F_r/F_0)^{1/2}`` (no rounding)."""
    _check_losses(loss, reference_loss)
    return math.sqrt(loss / reference_loss)


#: Relative slack of the runtime budget: the sum of ``n`` equal round times may round below ``n`` times one.
_BUDGET_RTOL = 1e-9


def simulated_round_seconds(
    model_megabits: float,
    local_steps: int,
    seconds_per_batch: float,
    download_mbps: float = 20.0,
    upload_mbps: float = 5.0,
) -> float:
    """Seed 004 Eq. 4 for one (homogeneous) round: ``|x|/D + K·β + |x|/U`` seconds."""
    return model_megabits / download_mbps + local_steps * seconds_per_batch + model_megabits / upload_mbps


# ====================================================================== plateau detection
class PlateauDetector:
    """``True`` once ``patience`` consecutive values failed to improve on the best by more than ``tolerance``
    (relative): an improvement means ``value < best · (1 − tolerance)``."""

    def __init__(self, patience: int, tolerance: float):
        self.patience = int(patience)
        self.tolerance = float(tolerance)
        self.best = math.inf
        self.wait = 0

    def update(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if value < self.best * (1.0 - self.tolerance) or self.best == math.inf:
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        return self.wait >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait = float(state["best"]), int(state["wait"])


# ====================================================================== the schedule callback
class KDecay(FederatedCallback):
    """Seed 004's decay schedules for the local steps ``K_r`` or the client learning rate ``η_r``.

    Round index ``r = 1, 2, …`` (``plan.round + 1``); ``K_0`` and ``η_0`` are the configured local steps and client
    learning rate. Table III:

    ============  ==============================================  ==============================================
    schedule      ``decay="local_steps"`` (``K_r``; ``η_0``)      ``decay="client_lr"`` (``η_r``; ``K_0``)
    ============  ==============================================  ==============================================
    ``rounds``    ``⌈K_0 · r^{−1/3}⌉``                            ``η_0 · r^{−1/2}``
    ``error``     ``⌈K_0 · (F_r/F_0)^{1/3}⌉``                     ``η_0 · (F_r/F_0)^{1/2}``
    ``step``      ``K_0``, then ``⌈K_0/10⌉`` once converged       ``η_0``, then ``η_0/10`` once converged
    ============  ==============================================  ==============================================

    dSGD is ``K ≡ 1`` (``model.local_steps: 1``, ``configs/dsgd.yaml``); Kη-fixed is no schedule at all. The
    η-decay schedules act through ``plan.client_lr_scale``: the FederatedLoop hands it to
    :func:`fedlightning.optim.scale_client_step`, which multiplies ``lr`` of ``torch.optim`` optimizers and every step
    :class:`~fedlightning.optim.SgdArmijo`, :class:`~fedlightning.optim.SPS` and :class:`~fedlightning.optim.DecSPS`
    apply (their docstrings give what is scaled and why). With ``decay="client_lr"`` fit start checks, before any client
    trains, that the configured client optimizer has such a step size and otherwise raises a ValueError naming
    it, so ``schedule/client_lr_scale`` is only logged when it is applied.

    Decisions (the gaps of Mills et al.'s Sec. 3.5 and Table III):

    * **Exact ceilings.** ``⌈K_0 r^{−1/3}⌉`` is the smallest integer ``k`` with ``k³·r ≥ K_0³`` and is computed in
      integer arithmetic (a float guess corrected by exact cube comparisons), so ``K_0 = 60, r = 1000`` gives 6, not
      the 7 of a naive ``ceil(60 * 1000 ** (-1/3))``. The error schedule compares cubes in exact rationals of the
      two float losses (:class:`fractions.Fraction`) after shrinking the target by a relative ``1e-12``
      (``LOSS_RATIO_TOLERANCE``): the losses are floats, and a ratio such as 0.001 is stored as
      0.0010000000000000000208, which would otherwise still turn ``60·∛0.001`` into 7. ``K_r ≥ 1`` always.
    * **F_r** (error schedule) is the mean of the clients' first-batch losses at the received global model
      (``train/first_loss`` of the round, reduced over all processes) over the ``window = s`` *previous* rounds
      ``r−s … r−1`` (the paper's Eq. 15 includes round ``r`` itself, whose losses do not exist before it runs),
      divided by the number of losses actually received. During the first ``s`` rounds (warm-up) ``K_r = K_0``.
    * **F_0** (``reference_loss``): ``"first_window"`` (default, ours) is the first full-window estimate, the mean
      over rounds ``1 … s``, so that ``K_{s+1} = K_0`` and the schedule is continuous at the end of the warm-up;
      ``"first_round"`` is round 1's mean first-batch loss (an estimate of ``F(x_0)``). ``F* = 0`` (the paper). No
      clamp when ``F_r > F_0`` (the paper states none), so ``K_r`` may exceed ``K_0``.
    * **Step plateau rule** (the paper decays once, "if converged", when the validation error plateaus, without
      saying how it detects that): with ``step_round`` set, decay from that round on (a fixed switch round, what the
      paper's figures show); otherwise a plateau detector watches ``monitor`` (a logged metric such as
      ``"val/loss"``, read after every validation run) or, when ``monitor`` is None, the windowed first-batch loss
      estimate ``F_r`` (read after every round once the window is full). It declares a plateau after ``patience``
      consecutive observations without a relative improvement of more than ``plateau_tolerance`` over the best
      value so far (ReduceLROnPlateau's "rel" rule); the decay applies from the next round on and happens once.
      Defaults (ours): ``patience = 100`` observations, ``plateau_tolerance = 0.01``. The step decay factor 10 and
      the window ``s = 100`` are the paper's. ``⌈K_0/10⌉`` is exact for the paper's ``K_0`` (all multiples of 10).

    Args:
        schedule: ``"rounds"``, ``"error"`` or ``"step"`` (Table III).
        decay: ``"local_steps"`` (default: the K-decay schedules) or ``"client_lr"`` (the η-decay counterparts).
        k0: ``K_0`` (None: the FederatedLoop's ``local_steps``). Table I uses 60 / 80 / 50 / 80.
        window: ``s``, rounds in the loss window of the error schedule and of the default plateau rule (100, the
            paper).
        reference_loss: ``"first_window"`` (default) or ``"first_round"``: the definition of ``F_0``.
        step_round: step schedule: 1-based round from which the decayed value applies (None: plateau rule).
        step_factor: step schedule decay factor (10, the paper).
        monitor: step schedule: metric watched by the plateau rule (None: the windowed first-batch loss).
        patience: plateau rule patience in observations (100, ours).
        plateau_tolerance: plateau rule relative improvement threshold (0.01, ours).
    """

    def __init__(
        self,
        schedule: str = "rounds",
        decay: str = "local_steps",
        k0: int | None = None,
        window: int = 100,
        reference_loss: str = "first_window",
        step_round: int | None = None,
        step_factor: float = 10.0,
        monitor: str | None = None,
        patience: int = 100,
        plateau_tolerance: float = 0.01,
    ):
        self.schedule = one_of("schedule", schedule, SCHEDULES)
        self.decay = one_of("decay", decay, DECAYS)
        self.reference_loss = one_of("reference_loss", reference_loss, ("first_window", "first_round"))
        self.k0 = integer("k0", k0, allow_none=True)
        self.window = integer("window", window)
        self.patience = integer("patience", patience)
        self.step_round = integer("step_round", step_round, allow_none=True)
        self.step_factor = in_range("step_factor", step_factor, 1.0, low_closed=False)
        self.plateau_tolerance = in_range("plateau_tolerance", plateau_tolerance, 0.0, 1.0)
        self.monitor = monitor
        # state (checkpointed)
        self._history: deque[tuple[float, float]] = deque(maxlen=self.window)  # (sum, count) of first losses
        self._reference: float | None = None  # F_0
        self._decay_round: int | None = step_round  # 1-based round from which the step decay applies
        self._detector = PlateauDetector(self.patience, self.plateau_tolerance)
        self._last: dict[str, float] = {}

    # ------------------------------------------------------------------ statistics
    def loss_estimate(self) -> float | None:
        """``F_r``: mean first-batch loss over the last ``window`` rounds (None during the warm-up)."""
        if len(self._history) < self.window:
            return None
        total = sum(s for s, _ in self._history)
        count = sum(c for _, c in self._history)
        return total / count if count > 0 else None

    @property
    def reference(self) -> float | None:
        """``F_0`` (None until defined)."""
        return self._reference

    def decayed(self, round_number: int) -> bool:
        """Step schedule: is the decay in force in 1-based round ``round_number``?"""
        return self._decay_round is not None and round_number >= self._decay_round

    def value(self, round_number: int, k0: int) -> tuple[int, float]:
        """``(K_r, lr scale)`` for 1-based round ``round_number`` given the current statistics."""
        r = _check_round(round_number)
        k, scale = k0, 1.0
        if self.schedule == "rounds":
            k, scale = rounds_local_steps(k0, r), rounds_lr_scale(r)
        elif self.schedule == "error":
            est, ref = self.loss_estimate(), self._reference
            if est is not None and ref is not None and ref > 0:
                k, scale = error_local_steps(k0, est, ref), error_lr_scale(est, ref)
        elif self.decayed(r):
            k, scale = step_local_steps(k0, self.step_factor), 1.0 / self.step_factor
        if self.decay == "local_steps":
            return k, 1.0
        return k0, scale

    # ------------------------------------------------------------------ federated hooks
    def on_fit_start(self, trainer, pl_module) -> None:
        """``decay="client_lr"``: refuse, before any client trains, a client optimizer whose step size the scale
        cannot reach (:func:`fedlightning.optim.check_client_step_scalable`, a ValueError naming it).
        ``decay="local_steps"`` with the loop's ``local_epochs``: refused (the schedules decay a step count ``K_r``
        from ``K_0``, and epochs give every client its own count; ``decay="client_lr"`` keeps the epochs and decays
        the client step size, the paper's η-decay counterpart)."""
        epochs = getattr(pl_module, "local_epochs", None)
        if self.decay == "local_steps" and epochs is not None:
            raise ValueError(
                f"KDecay(decay='local_steps') schedules a number of local steps K_r from K_0, but the loop trains "
                f"model.local_epochs={epochs} (each client's own step count); set KDecay(decay='client_lr') to decay "
                "the client step size with the epochs kept, or model.local_steps instead of model.local_epochs"
            )
        if self.decay == "client_lr":
            check_client_step_scalable(pl_module.client_optimizer_factory(list(pl_module.global_parameters())))

    def on_round_start(self, trainer, pl_module, plan) -> None:
        epochs = plan.client_steps is not None  # local_epochs: decay="client_lr" only (on_fit_start), K untouched
        if epochs and self.decay == "local_steps":  # per-client counts of the data module's own round_plan
            raise ValueError(
                f"round {plan.round}: KDecay(decay='local_steps') schedules one number of local steps K_r, but the "
                "round's plan gives each client its own count (plan.client_steps, from the data module's round_plan "
                "or an earlier on_round_start), which decide the clients' steps; set KDecay(decay='client_lr') to "
                "decay the client step size with those counts kept"
            )
        k0 = self.k0 if self.k0 is not None else (plan.local_steps if epochs else int(pl_module.local_steps))
        k, scale = self.value(plan.round + 1, k0)
        if not epochs:
            plan.local_steps = k
        plan.client_lr_scale = plan.client_lr_scale * scale
        est = self.loss_estimate()
        self._last = {"schedule/local_steps": float(k), "schedule/client_lr_scale": float(scale)}
        if est is not None:
            self._last["schedule/loss_estimate"] = est
        if self._reference is not None:
            self._last["schedule/reference_loss"] = self._reference
        if self.schedule == "step":
            self._last["schedule/decayed"] = float(self.decayed(plan.round + 1))

    def observe(self, round_number: int, first_loss_sum: float, first_loss_count: float) -> None:
        """Record round ``round_number``'s first-batch losses (sum and count) and update F_0 / the plateau rule."""
        if not (first_loss_count > 0 and math.isfinite(first_loss_sum)):
            first_loss_sum, first_loss_count = 0.0, 0.0
        self._history.append((float(first_loss_sum), float(first_loss_count)))
        if self._reference is None:
            if self.reference_loss == "first_round":
                if first_loss_count > 0:
                    self._reference = first_loss_sum / first_loss_count
            else:
                est = self.loss_estimate()
                if est is not None and est > 0:
                    self._reference = est
        if self.schedule == "step" and self._decay_round is None and self.monitor is None:
            est = self.loss_estimate()
            if est is not None and self._detector.update(est):
                self._decay_round = round_number + 1

    def on_round_end(self, trainer, pl_module, result) -> None:
        m = result.metrics
        if "round/clients" in m and "train/first_loss" in m:
            count = float(m["round/clients"])
            total = float(m["train/first_loss"]) * count if count > 0 else 0.0
        else:
            losses = [x for x in result.first_losses if math.isfinite(x)]
            total, count = float(sum(losses)), float(len(losses))
        self.observe(result.plan.round + 1, total, count)
        m.update(self._last)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.schedule != "step" or self.monitor is None or self._decay_round is not None or trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        if self._detector.update(float(value)):
            self._decay_round = int(trainer.global_step) + 1  # rounds done = global_step; the next is +1 (1-based)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self._history),
            "reference": self._reference,
            "decay_round": self._decay_round,
            "detector": self._detector.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._history = deque((tuple(x) for x in state_dict["history"]), maxlen=self.window)
        self._reference = state_dict["reference"]
        self._decay_round = state_dict["decay_round"]
        self._detector.load_state_dict(state_dict["detector"])

    @property
    def state_key(self) -> str:
        return f"KDecay[schedule={self.schedule},decay={self.decay}]"

    def __repr__(self) -> str:
        return f"KDecay(schedule={self.schedule!r}, decay={self.decay!r}, k0={self.k0}, window={self.window})"


# ====================================================================== runtime simulation
class RuntimeModel(FederatedCallback):
    """Simulated wall-clock of seed 004 (Sec. 3.2): ``W_r = |x|/D + K_r·β + |x|/U`` per round.

    Args:
        seconds_per_batch: ``β``, compute time of one local mini-batch step in seconds (required; seed 004 Table II
            measured 5.2e-3 / 0.017 / 0.31 / 1.5 s on a Raspberry Pi 3B+ for Sent140 / FEMNIST / CIFAR100 /
            Shakespeare).
        model_megabits: ``|x|`` in megabits (None: the global model's trainable parameters × their bit width / 1e6,
            e.g. float32 parameters × 32 — how Table I's sizes come out).
        download_mbps: ``D`` (20 Mbps, the paper's UK 4G figure).
        upload_mbps: ``U`` (5 Mbps, the paper).
        budget_rounds: stop the run (``trainer.should_stop``, as ``EarlyStopping`` does) after the first round whose
            cumulative ``W`` reaches the simulated runtime of ``budget_rounds`` rounds of ``budget_local_steps``
            local steps each (None: no budget; ``max_steps`` alone ends the run). Seed 004's Table IV compares its
            schedules at equal simulated runtime, Kη-fixed's 10k rounds of ``K_0`` (derived in the digest of seed
            004, §7.3: the only protocol under which K_r-rounds' Table IV entries come out), so its configs set
            ``budget_rounds: 10000`` with ``budget_local_steps: K_0`` and a ``max_steps`` above any schedule's round
            count. A run whose ``max_steps`` ends it first warns, naming both.
        budget_local_steps: ``K`` of the budget's rounds (None: the loop's ``local_steps``).

    Logged per round: ``runtime/round_seconds`` (W_r), ``runtime/wall_clock_seconds`` and
    ``runtime/wall_clock_minutes`` (cumulative), ``runtime/sgd_steps`` (cumulative ``Σ_r K_r`` per client) and
    ``runtime/client_sgd_steps`` (cumulative local steps summed over the participating clients).

    With per-client step counts (``local_epochs``; decisions, ours): ``K_r`` in ``runtime/sgd_steps`` is the mean
    of the round's clients' counts (``round/local_steps``), ``runtime/client_sgd_steps`` adds each healthy client's
    own count, and ``W_r`` takes the largest count, the slowest client, which the round waits for.

    :class:`RuntimeModel` simulates the wall-clock of seed 004 Sec. 3.2 (homogeneous clients, so the straggler
    ``max`` is void): ``W_r = |x|/D + K_r·β + |x|/U`` seconds per round, and logs its cumulative sum with the
    cumulative local SGD steps ``Σ_r K_r`` (per client, as Table IV counts), so Table IV can be recomputed from a run.
    """

    def __init__(
        self,
        seconds_per_batch: float,
        model_megabits: float | None = None,
        download_mbps: float = 20.0,
        upload_mbps: float = 5.0,
        budget_rounds: int | None = None,
        budget_local_steps: int | None = None,
    ):
        self.seconds_per_batch = non_negative("seconds_per_batch", seconds_per_batch)
        self.budget_rounds = integer("budget_rounds", budget_rounds, 1, allow_none=True)
        self.budget_local_steps = integer("budget_local_steps", budget_local_steps, 1, allow_none=True)
        if self.budget_local_steps is not None and self.budget_rounds is None:
            raise ValueError(
                f"RuntimeModel: budget_local_steps={budget_local_steps!r} needs budget_rounds (the budget is "
                "budget_rounds rounds of budget_local_steps local steps)"
            )
        self.model_megabits = positive("model_megabits", model_megabits, allow_none=True)
        self.download_mbps = positive("download_mbps", download_mbps)
        self.upload_mbps = positive("upload_mbps", upload_mbps)
        self.wall_clock_seconds = 0.0
        self.sgd_steps = 0
        self.client_sgd_steps = 0.0

    @staticmethod
    def megabits_of(loop) -> float:
        """Size of the global model's trainable parameters in megabits."""
        return sum(p.numel() * p.element_size() * 8 for p in loop.global_parameters()) / 1e6

    def on_round_end(self, trainer, pl_module, result) -> None:
        megabits = self.model_megabits if self.model_megabits is not None else self.megabits_of(pl_module)
        plan = result.plan
        k = int(plan.local_steps)  # every client's K_r; with per-client counts (local_epochs) the largest
        w = simulated_round_seconds(megabits, k, self.seconds_per_batch, self.download_mbps, self.upload_mbps)
        self.wall_clock_seconds += w
        self.sgd_steps += k if plan.client_steps is None else plan.mean_local_steps()
        self.client_sgd_steps += result.healthy_local_steps()
        budget = self.budget_seconds(pl_module, megabits)
        if self._reached(budget):
            trainer.should_stop = True
            result.metrics["runtime/budget_seconds"] = budget
        result.metrics.update(
            {
                "runtime/round_seconds": w,
                "runtime/wall_clock_seconds": self.wall_clock_seconds,
                "runtime/wall_clock_minutes": self.wall_clock_seconds / 60.0,
                "runtime/sgd_steps": float(self.sgd_steps),
                "runtime/client_sgd_steps": self.client_sgd_steps,
                "runtime/model_megabits": megabits,
            }
        )

    def budget_seconds(self, loop, megabits: float | None = None) -> float | None:
        """The simulated runtime of ``budget_rounds`` rounds of ``budget_local_steps`` (else the loop's
        ``local_steps``) local steps; None without a budget."""
        if self.budget_rounds is None:
            return None
        if megabits is None:
            megabits = self.model_megabits if self.model_megabits is not None else self.megabits_of(loop)
        k = self.budget_local_steps if self.budget_local_steps is not None else getattr(loop, "local_steps", None)
        if k is None:
            raise ValueError(
                "RuntimeModel: budget_rounds needs budget_local_steps when the loop has no fixed local_steps "
                "(local_epochs)"
            )
        w = simulated_round_seconds(megabits, int(k), self.seconds_per_batch, self.download_mbps, self.upload_mbps)
        return self.budget_rounds * w

    def _reached(self, budget: float | None) -> bool:
        """Whether the simulated runtime has reached ``budget`` (None: no budget)."""
        return budget is not None and self.wall_clock_seconds >= budget * (1 - _BUDGET_RTOL)

    def on_train_start(self, trainer, pl_module) -> None:
        """A run resumed from a checkpoint whose simulated runtime had reached the budget trains no further round
        (the run it resumes had stopped there)."""
        budget = self.budget_seconds(pl_module)
        if self._reached(budget):
            trainer.should_stop = True
            rank_zero_info(
                f"RuntimeModel: the simulated runtime {self.wall_clock_seconds:.6g} s has reached the budget of "
                f"{budget:.6g} s (budget_rounds={self.budget_rounds}); no further round is trained"
            )

    def on_train_end(self, trainer, pl_module) -> None:
        budget = self.budget_seconds(pl_module)
        if budget is not None and not self._reached(budget) and not trainer.interrupted:
            rank_zero_warn(
                f"RuntimeModel: the run ended at simulated {self.wall_clock_seconds:.6g} s, before its budget of "
                f"{budget:.6g} s (budget_rounds={self.budget_rounds}): trainer.max_steps={trainer.max_steps} or "
                "another stop came first; raise max_steps to run the whole budget"
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "wall_clock_seconds": self.wall_clock_seconds,
            "sgd_steps": self.sgd_steps,
            "client_sgd_steps": self.client_sgd_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wall_clock_seconds = float(state_dict["wall_clock_seconds"])
        self.sgd_steps = float(state_dict["sgd_steps"])  # fractional with local_epochs (a mean over clients)
        self.client_sgd_steps = float(state_dict["client_sgd_steps"])

    def __repr__(self) -> str:
        return (
            f"RuntimeModel(seconds_per_batch={self.seconds_per_batch}, model_megabits={self.model_megabits}, "
            f"download_mbps={self.download_mbps}, upload_mbps={self.upload_mbps}, budget_rounds={self.budget_rounds}, "
            f"budget_local_steps={self.budget_local_steps})"
        )
