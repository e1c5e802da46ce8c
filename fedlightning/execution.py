"""How a round's clients are trained: one executor per run, chosen once from ``FederatedLoop(client_execution=...)``.

Every executor implements :class:`ClientExecutor`: ``updates(loop, plan, client_ids, global_flat)`` yields
``(client_id, outcome)`` for this process's clients in order, ``outcome`` the client's
:class:`~fedlightning.state.ClientUpdate` or the exception its training raised (the loop's failure policy decides what
happens to it), and ``update_groups`` yields the same pairs as lists, the clients trained together (one for
sequential training, a group of vectorised clients), which the loop admits into the round together. The loop stops
iterating when the policy stops the run, so a sequential executor trains no further client.
:class:`SequentialExecutor` trains one client after the other (``loop.train_client``); :class:`VectorizedExecutor`
trains them in lockstep, in groups of at most ``FederatedLoop(max_parallel_clients=...)``
clients (:func:`fedlightning.vectorized.run_vectorized_round`, which for ``"auto"`` decides at the first round, once,
whether vectorising pays, falls back for good when the model cannot be vectorised, and halves a group that runs out of
accelerator memory) and hands over to sequential training for a round, or the rest of a round, it declines. Reference
mode (:mod:`fedlightning._reference`) trains sequentially whatever the executor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from torch import Tensor

from fedlightning._reference import reference_mode
from fedlightning.state import ClientUpdate, RoundPlan
from fedlightning.vectorized import VectorizedClientTrainer, VectorizedRun, run_vectorized_round

__all__ = ["CLIENT_EXECUTION_MODES", "ClientExecutor", "SequentialExecutor", "VectorizedExecutor", "make_executor"]

#: Values of ``FederatedLoop(client_execution=...)``.
CLIENT_EXECUTION_MODES = ("sequential", "vectorized", "auto")

Outcome = tuple[int, ClientUpdate | Exception]


class ClientExecutor(Protocol):
    """Trains a round's clients from the global weights ``global_flat`` (see the module docstring); ``choice`` is
    how it trains them (``"sequential"`` or ``"vectorized"``; None while ``"auto"`` has not decided), ``reason`` why
    (``"auto"``), ``engine`` its vectorised engine (None for none)."""

    choice: str | None
    reason: str | None
    engine: VectorizedClientTrainer | None

    def updates(self, loop, plan: RoundPlan, client_ids: list[int], global_flat: Tensor) -> Iterator[Outcome]: ...

    def update_groups(
        self, loop, plan: RoundPlan, client_ids: list[int], global_flat: Tensor
    ) -> Iterator[list[Outcome]]: ...


class SequentialExecutor:
    """One client after the other on the loop's working copy (``loop.train_client``)."""

    choice = "sequential"
    reason = None
    engine = None

    def updates(self, loop, plan: RoundPlan, client_ids: list[int], global_flat: Tensor) -> Iterator[Outcome]:
        for cid in client_ids:
            try:
                outcome: ClientUpdate | Exception = loop.train_client(plan, cid, global_flat)
            except Exception as err:  # noqa: BLE001 - the loop's failure policy decides
                outcome = err
            yield cid, outcome

    def update_groups(
        self, loop, plan: RoundPlan, client_ids: list[int], global_flat: Tensor
    ) -> Iterator[list[Outcome]]:
        for pair in self.updates(loop, plan, client_ids, global_flat):
            yield [pair]


class VectorizedExecutor:
    """The round's clients in lockstep (``client_execution`` ``"vectorized"`` or ``"auto"``), group after group
    (``loop.max_parallel_clients``; each group is trained when the loop asks for its first client, so a loop that
    stops early trains no further group); a round the vectorised entry declines (``"auto"`` chose sequential or fell
    back, or reference mode) is trained by :class:`SequentialExecutor`, and so are the clients of a round it stopped
    short of (``"auto"`` fell back after some groups). An exception of the batched computation that concerns every
    client of a group is raised. The run's vectorised state (engine, ``"auto"``'s choice and reason, the group size
    in force) is :attr:`run`."""

    def __init__(self, mode: str) -> None:
        self.run = VectorizedRun(mode)
        self.sequential = SequentialExecutor()

    @property
    def choice(self) -> str | None:
        """``"vectorized"`` or ``"sequential"``; for ``"auto"`` None until its first round decided."""
        if self.run.mode != "auto":
            return self.run.mode
        return "sequential" if self.run.fallback else self.run.choice

    @property
    def reason(self) -> str | None:
        """Why ``"auto"`` chose its mode (None otherwise, and before it chose)."""
        return self.run.reason

    @property
    def engine(self) -> VectorizedClientTrainer | None:
        """The vectorised engine of the loop's working copy (None until a vectorised round built it)."""
        return self.run.engine

    def updates(self, loop, plan: RoundPlan, client_ids: list[int], global_flat: Tensor) -> Iterator[Outcome]:
        for group in self.update_groups(loop, plan, client_ids, global_flat):
            yield from group

    def update_groups(
        self, loop, plan: RoundPlan, client_ids: list[int], global_flat: Tensor
    ) -> Iterator[list[Outcome]]:
        outcomes = None if reference_mode() else run_vectorized_round(loop, plan, client_ids, global_flat, self.run)
        if outcomes is None:
            yield from self.sequential.update_groups(loop, plan, client_ids, global_flat)
            return
        # a vectorised entry without groups (another version's, in benchmarks/engine_ab.py): one client at a time
        groups = outcomes.groups() if hasattr(outcomes, "groups") else ([outcome] for outcome in outcomes)
        done = 0
        for group in groups:
            yield list(zip(client_ids[done : done + len(group)], group))
            done += len(group)
        if done < len(client_ids):  # "auto" fell back in the middle of the round
            yield from self.sequential.update_groups(loop, plan, client_ids[done:], global_flat)


def make_executor(client_execution: str) -> ClientExecutor:
    """The executor of ``client_execution`` (one of :data:`CLIENT_EXECUTION_MODES`)."""
    if client_execution == "sequential":
        return SequentialExecutor()
    if client_execution in ("vectorized", "auto"):
        return VectorizedExecutor(client_execution)
    raise ValueError(f"client_execution must be one of {CLIENT_EXECUTION_MODES}, got {client_execution!r}")
