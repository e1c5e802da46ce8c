"""The end of a :class:`~fedlightning.loop.FederatedLoop` round (a mixin of the loop): the failure policy's stops,
the telemetry sums, the exchange and reduction of round statistics across processes, the server step
(Δ into the global parameters' ``.grad``, then the strategy's server optimizer) and round logging.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from fedlightning.callbacks.base import RoundStatistics
from fedlightning.state import ClientUpdate, RoundPlan, RoundResult


class _RoundEnd:
    """Methods of :class:`~fedlightning.loop.FederatedLoop` that turn the round's client updates into the new
    global model and the round's metrics (mixed into the loop; ``self`` is the loop)."""

    def _check_round_failures(self, plan: RoundPlan, stats: RoundStatistics, first_error: Optional[tuple]) -> None:
        """The failure policy's stops (``on_client_failure="skip"``; identical on every process, from the reduced
        counts): every client raised → the round's first exception, chained; ``max_failed_rounds`` consecutive
        rounds without a healthy client → ``FloatingPointError``."""
        n_healthy = float(stats["clients"].item()) if "clients" in stats else 0.0
        if n_healthy > 0:
            self.rounds_without_healthy_client = 0
            return
        raised = int(stats["raised"].item())
        if raised and raised == len(plan.client_ids):
            if first_error is not None:
                what = f"client {first_error[0]}: {type(first_error[1]).__name__}: {first_error[1]}"
            else:
                what = "the exceptions were raised on another process"
            message = (
                f"round {plan.round}: every client raised an exception ({what}); this is a bug in the model or the "
                "data, not a faulty client, so the run stops"
            )
            raise RuntimeError(message) from (first_error[1] if first_error is not None else None)
        self.rounds_without_healthy_client += 1
        limit = self.max_failed_rounds
        if limit is not None and self.rounds_without_healthy_client >= limit:
            raise FloatingPointError(
                f"round {plan.round}: {self.rounds_without_healthy_client} consecutive rounds without a healthy client "
                f"(max_failed_rounds={limit}); every client's loss or update was NaN/inf or it failed. Lower the "
                "client learning rate, clip client gradients (client_grad_clip) or raise max_failed_rounds"
            )

    @staticmethod
    def _accumulate_telemetry(stats: RoundStatistics, u: ClientUpdate, device) -> None:
        stats.add("loss_sum", u.mean_loss, device)
        stats.add("first_loss_sum", u.first_loss, device)
        steps = max(u.num_steps, 1)
        stats.add("backtracks_per_step_sum", u.backtracks / steps, device)
        stats.add("forwards", float(u.forwards), device)
        stats.add("backwards", float(u.backwards), device)
        stats.add("local_steps_sum", float(u.num_steps), device)
        finite = [s for s in u.step_sizes if math.isfinite(s)]
        if finite:
            stats.add("step_size_sum", float(sum(finite)), device)
            stats.add("step_size_count", float(len(finite)), device)
            stats.maximum("step_size_max", max(finite), device)
            stats.maximum("neg_step_size_min", -min(finite), device)

    def _share_round_state(self, plan: RoundPlan, healthy: List[ClientUpdate]) -> List[tuple]:
        """Per-client scalars of the round's healthy clients, from every process, in sampling order; and, with
        several processes, the client-state entries written this round are exchanged so every process holds the
        whole ClientStateStore."""
        pos = {cid: i for i, cid in enumerate(plan.client_ids)}
        mine = [(pos.get(u.client_id, -1), u.client_id, u.first_loss, u.mean_loss) for u in healthy]
        if self.trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            self.client_state.pop_dirty()
            return mine
        from fedlightning.distributed import all_gather_objects

        dirty = self.client_state.pop_dirty()
        dirty_cpu = {k: {n: (v.detach().cpu() if isinstance(v, Tensor) else v) for n, v in d.items()} for k, d in dirty.items()}
        router = self._worker_trainer().router
        everything = all_gather_objects((mine, dirty_cpu, dict(router.metric_paths)), round=plan.round,
                                        what="client summaries and client state of the round")
        summaries: List[tuple] = []
        for rank, (theirs, entries, metric_paths) in enumerate(everything):
            summaries.extend(theirs)
            if rank != self.trainer.global_rank:
                self.client_state.update_from(entries)
                router.adopt_metrics(metric_paths)  # every process computes (a collective) the same metrics
        return sorted(summaries)

    def _reduce(self, stats: RoundStatistics) -> None:
        """Combine the statistics of all processes (no-op on one process)."""
        if self.trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return
        from fedlightning.distributed import all_reduce_statistics

        all_reduce_statistics(stats, round=self.global_step)  # global_step is the round being trained

    @torch.no_grad()
    def _server_step(self, stats: RoundStatistics, plan: RoundPlan) -> Dict[str, float]:
        opt = self.optimizers()
        params = self._global_params()
        n_clients = float(stats["clients"].item()) if "clients" in stats else 0.0
        metrics: Dict[str, float] = {"round/clients": n_clients, "round/failed_clients": float(stats["failed"].item())}
        metrics["round/local_steps"] = float(plan.local_steps)
        if n_clients == 0:
            rank_zero_warn(f"round {plan.round}: no healthy client; the global model is left unchanged")
            for p in params:
                p.grad = None  # optimizers skip parameters without a gradient: no state change
            opt.step()
            return metrics
        pseudo_grad, lr, extra = self.strategy.server_update(self, stats, plan)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = pseudo_grad[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n
        if lr is not None:
            for g in opt.optimizer.param_groups:
                g["lr"] = lr
        opt.step()
        for p in params:
            p.grad = None
        if "buffers" in stats:
            fbufs = [b for b in self.model.buffers() if b.is_floating_point()]
            avg = stats["buffers"] / stats["weight"].to(stats["buffers"].dtype)
            off = 0
            for b in fbufs:
                b.copy_(avg[off : off + b.numel()].view_as(b))
                off += b.numel()
        metrics.update(extra)
        metrics["train/loss"] = float(stats["loss_sum"].item()) / n_clients
        metrics["train/first_loss"] = float(stats["first_loss_sum"].item()) / n_clients
        metrics["server/lr"] = float(lr if lr is not None else opt.optimizer.param_groups[0].get("lr", float("nan")))
        # η_g of every strategy under one name: strategies that compute it (FedExP, FedExProx, FedLi) report it and
        # its unclipped value; for the others it is the server optimizer's learning rate, which nothing clips.
        metrics.setdefault("server/eta_g", metrics["server/lr"])
        metrics.setdefault("server/eta_g_raw", metrics["server/eta_g"])
        metrics["server/delta_norm"] = float(pseudo_grad.double().norm().item())
        metrics["server/mean_client_delta_sq_norm"] = float(stats["sq_norm_sum"].item()) / n_clients
        metrics["client/backtracks_per_step"] = float(stats["backtracks_per_step_sum"].item()) / n_clients
        metrics["client/forwards"] = float(stats["forwards"].item())
        metrics["client/backwards"] = float(stats["backwards"].item())
        if "step_size_sum" in stats:
            metrics["client/step_size_mean"] = float(stats["step_size_sum"].item() / stats["step_size_count"].item())
            metrics["client/step_size_max"] = float(stats["step_size_max"].item())
            metrics["client/step_size_min"] = -float(stats["neg_step_size_min"].item())
        return metrics

    def _log_round(self, result: RoundResult) -> None:
        """Log the round's metrics.

        ``train/loss`` (the progress bar) goes through ``self.log``. The other round metrics bypass Lightning's
        result collection (its per-call cost:
        docs/benchmarks.md §1): they are put into ``trainer.callback_metrics`` every round (for
        ``ModelCheckpoint(monitor=...)``, ``EarlyStopping``, schedules) and written to the loggers, at the same
        step as ``train/loss``, on the rounds Lightning writes step metrics (every ``log_every_n_steps`` rounds, or
        when the trainer is stopping). A CSV logger therefore has two rows for such a step (ours, then
        Lightning's with ``train/loss``); ``trainer.logged_metrics`` holds only ``train/loss`` of them.
        """
        m = result.metrics
        trainer = self.trainer
        if "train/loss" in m:
            self.log("train/loss", m["train/loss"], prog_bar=True, batch_size=1)
        rest = {k: float(v) for k, v in m.items() if k != "train/loss"}
        if not rest:
            return
        callback_metrics = trainer.callback_metrics
        for k, v in rest.items():
            callback_metrics[k] = torch.tensor(v)
        if self._step_logs_written():
            step = int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))
            for logger in trainer.loggers:
                logger.log_metrics(rest, step=step)

    def _step_logs_written(self) -> bool:
        """Whether Lightning writes this round's step metrics to the loggers: its own rule, as its training loop
        applies it (``update_train_step_metrics``: ``should_update_logs``, i.e. every ``log_every_n_steps`` rounds
        or when the trainer is stopping, unless ``log_every_n_steps=0``; or ``fast_dev_run``)."""
        trainer = self.trainer
        return bool(trainer.loggers) and bool(trainer.fast_dev_run or trainer._logger_connector.should_update_logs)
