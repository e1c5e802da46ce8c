"""The algorithm author's contract, held to hand computations in float64: what a strategy's ``server_update`` may
return (checked, named errors), a round's ``lr`` applying to that round only, ``RoundResult.pseudo_gradient``, the
client losses of a ``64-true`` run, ``configure_client_optimizer`` / ``client_objective`` results checked, a strategy
whose ``accumulate`` changes the delta refused in every mode, and ``"auto"``'s measurement leaving no trace in the
callbacks that the loop's per-client hooks belong to."""

import collections
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, FederatedCallback, ServerStep, ServerStrategy
from fedlightning.datamodules import Dirichlet, FederatedDataModule

D_IN, N_CLS, K, LR = 5, 3, 2, 0.5


class Lin(pl.LightningModule):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(123)
        self.net = torch.nn.Linear(D_IN, N_CLS)
        with torch.no_grad():
            self.net.weight.copy_(torch.randn(N_CLS, D_IN, generator=g) * 0.3)
            self.net.bias.copy_(torch.randn(N_CLS, generator=g) * 0.1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(240, D_IN, generator=g)
    y = (x @ torch.randn(N_CLS, D_IN, generator=g).t() + 0.5 * torch.randn(240, N_CLS, generator=g)).argmax(1)
    return FederatedDataModule.from_datasets(
        TensorDataset(x, y), None, partition=Dirichlet(alpha=0.5), num_clients=6, batch_size=1000, seed=0,
        val_fraction=0.0,
    )  # fmt: skip


def _fit(callbacks, mode="sequential", rounds=2, clients=3, module=None, **loop_args):
    model = module or Lin()
    loop = FederatedLoop(model, local_steps=K, clients_per_round=clients, seed=0, client_execution=mode, **loop_args)
    trainer = pl.Trainer(
        max_steps=rounds, precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", callbacks=callbacks,
    )  # fmt: skip
    dm = _data()
    trainer.fit(loop, datamodule=dm)
    return loop, dm


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _client_xy(dm, cid):
    idx = [int(i) for i in dm.client_indices[cid]]
    return (
        torch.stack([dm.train_dataset[i][0] for i in idx]).double(),
        torch.stack([torch.as_tensor(dm.train_dataset[i][1]) for i in idx]).long(),
    )


def _loss(w, x, y):
    return F.cross_entropy(x @ w[: N_CLS * D_IN].view(N_CLS, D_IN).t() + w[N_CLS * D_IN :], y)


def _local(w0, x, y, extra=None):
    """K full-batch gradient steps of lr LR, the client's losses along the way."""
    w, losses = w0.clone(), []
    for _ in range(K):
        w = w.detach().requires_grad_(True)
        loss = _loss(w, x, y) + (extra(w) if extra is not None else 0.0)
        losses.append(float(loss))
        (g,) = torch.autograd.grad(loss, w)
        w = w.detach() - LR * g
    return w.detach(), losses


class _Record(FederatedCallback):
    """Records each round's clients, weights before the round, updates and result."""

    def __init__(self):
        self.rounds = []

    def on_round_start(self, trainer, loop, plan):
        self.rounds.append({"plan": plan, "w0": _flat(loop.model).clone(), "updates": []})

    def on_client_end(self, trainer, loop, plan, update):
        self.rounds[-1]["updates"].append((update.client_id, update.num_samples, update.first_loss, update.mean_loss))

    def on_round_end(self, trainer, loop, result):
        self.rounds[-1]["result"] = result
        self.rounds[-1]["w1"] = _flat(loop.model).clone()


def _fedavg_delta(dm, w0, client_ids):
    """FedAvg's Δ = Σ n_i (w0 − w_i) / Σ n_i from the hand computation."""
    total, acc = 0, torch.zeros_like(w0)
    for cid in client_ids:
        x, y = _client_xy(dm, cid)
        w, _ = _local(w0, x, y)
        acc += len(y) * (w0 - w)
        total += len(y)
    return acc / total


# ---------------------------------------------------------------- server_update's result


class _Returns(ServerStrategy):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def server_update(self, loop, stats, plan):
        return self.make(self, stats)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda s, st: ServerStep(torch.cat([s.mean_delta(st), torch.ones(7, dtype=torch.float64)])), ValueError,
         r"_Returns.server_update \(round 0\) returned a pseudo-gradient of shape \(25,\).*shape \(18,\)"),
        (lambda s, st: ServerStep(s.mean_delta(st)[:-1]), ValueError, r"pseudo-gradient of shape \(17,\)"),
        (lambda s, st: ServerStep(s.mean_delta(st)[None, :]), ValueError, r"pseudo-gradient of shape \(1, 18\)"),
        (lambda s, st: s.mean_delta(st), TypeError, r"_Returns.server_update \(round 0\) returned Tensor; it must"),
        (lambda s, st: (s.mean_delta(st), None), TypeError, r"returned a tuple of 2"),
        (lambda s, st: None, TypeError, r"returned NoneType"),
        (lambda s, st: ServerStep(s.mean_delta(st), "big"), TypeError, r"server learning rate 'big'"),
        (lambda s, st: ServerStep(s.mean_delta(st), None, {"server/x": "hi"}), TypeError, r"metric 'server/x' = 'hi'"),
        (lambda s, st: ServerStep(s.mean_delta(st).round().long()), TypeError,
         r"pseudo-gradient of dtype torch.int64; it must be a floating-point tensor"),
        (lambda s, st: ServerStep(s.mean_delta(st), -0.5), ValueError, r"server learning rate -0.5; it must be >= 0"),
    ],
)  # fmt: skip
def test_server_update_result_is_checked_and_names_the_strategy(make, error, match):
    with pytest.raises(error, match=match):
        _fit([_Returns(make)], rounds=1)


def test_a_failed_server_step_puts_the_strategys_state_back_with_the_model():
    """A strategy that keeps state (here a counter in its state_dict, as an adaptive clipping norm) and whose round-1
    step overflows: the run stops with the model and the server optimizer as before round 1, and the strategy's state
    too, so that a checkpoint written then resumes like a run that never failed."""

    class Counts(FedAvg):
        def __init__(self):
            super().__init__()
            self.updates = 0

        def server_update(self, loop, stats, plan):
            self.updates += 1
            delta = self.mean_delta(stats)
            return ServerStep(delta * (math.inf if plan.round == 1 else 1.0))

        def state_dict(self):
            return {"updates": self.updates}

        def load_state_dict(self, state):
            self.updates = state["updates"]

    strategy = Counts()
    with pytest.raises(FloatingPointError, match=r"round 1: the server step of Counts would make the global model"):
        _fit([strategy], rounds=3)
    assert strategy.updates == 1  # round 0's update only


def test_server_step_lr_applies_to_its_round_only():
    """``ServerStep(Δ, lr=0.25)`` in round 0 and ``lr=None`` after: rounds 1 and 2 step with the optimizer's own
    ``server_lr`` (1.0), as the hand computation does."""

    class QuarterFirst(FedAvg):
        def server_update(self, loop, stats, plan):
            return ServerStep(self.mean_delta(stats), 0.25 if plan.round == 0 else None)

    record = _Record()
    loop, dm = _fit([QuarterFirst(server_lr=1.0), record], rounds=3)
    for r, entry in enumerate(record.rounds):
        lr = 0.25 if r == 0 else 1.0
        assert entry["result"].metrics["server/lr"] == lr
        expected = entry["w0"] - lr * _fedavg_delta(dm, entry["w0"], entry["plan"].client_ids)
        torch.testing.assert_close(entry["w1"], expected, rtol=0, atol=1e-12)
    assert loop.optimizers().optimizer.param_groups[0]["lr"] == 1.0


def test_server_step_metrics_default_is_not_shared():
    a = ServerStep(torch.zeros(2))
    a.metrics["server/x"] = 1.0
    assert ServerStep(torch.zeros(2)).metrics == {}
    assert ServerStep(torch.zeros(2), 0.5, None).metrics == {}
    delta, lr, metrics = ServerStep(torch.ones(1), 0.1, {"m": 2.0})  # still a tuple of three
    assert (float(delta), lr, metrics) == (1.0, 0.1, {"m": 2.0})


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_round_result_has_the_applied_pseudo_gradient_and_float64_losses(mode):
    """``RoundResult.pseudo_gradient`` is the Δ the server applied (FedAvg, server_lr 1: w1 = w0 − Δ, and the hand
    computation's Δ); a ``64-true`` run's client losses are float64 values (the hand computation's, not rounded to
    float32)."""
    record = _Record()
    _, dm = _fit([FedAvg(), record], mode=mode)
    for entry in record.rounds:
        result = entry["result"]
        assert result.pseudo_gradient is not None and result.pseudo_gradient.dtype == torch.float64
        torch.testing.assert_close(entry["w0"] - result.pseudo_gradient, entry["w1"], rtol=0, atol=1e-15)
        hand = _fedavg_delta(dm, entry["w0"], entry["plan"].client_ids)
        torch.testing.assert_close(result.pseudo_gradient, hand, rtol=0, atol=1e-12)
        for cid, _, first, mean in entry["updates"]:
            x, y = _client_xy(dm, cid)
            _, losses = _local(entry["w0"], x, y)
            assert abs(first - losses[0]) <= 1e-14 * abs(losses[0])  # float32 rounding would be ~1e-8
            assert abs(mean - sum(losses) / K) <= 1e-14 * abs(losses[0])


# ---------------------------------------------------------------- per-client hooks' results


class _Optimizer(FederatedCallback):
    def __init__(self, make):
        self.make = make

    def configure_client_optimizer(self, trainer, loop, plan, client_id, optimizer):
        return self.make(optimizer)


class _Objective(FederatedCallback):
    def __init__(self, result):
        self.result = result

    def client_objective(self, trainer, loop, plan, client_id):
        return self.result


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
@pytest.mark.parametrize(
    "callback, error, match",
    [
        (_Optimizer(lambda o: torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)), TypeError,
         r"_Optimizer.configure_client_optimizer returned a SGD over 1 tensor\(s\) that are not the client model's"),
        (_Optimizer(lambda o: 3), TypeError, r"_Optimizer.configure_client_optimizer returned int, not an optimizer"),
        (_Objective(lambda params: params[0].sum()), TypeError,
         r"_Objective.client_objective returned function; it must return a list of terms"),
        (_Objective([torch.tensor(1.0)]), TypeError, r"_Objective.client_objective returned a list holding Tensor"),
        (_Objective([lambda params: params[0].reshape(-1)]), ValueError,
         r"client-objective term .* returned shape \(15,\); a term must return a scalar tensor"),
    ],
)  # fmt: skip
def test_per_client_hook_results_are_checked(callback, error, match, mode):
    with pytest.raises((error, RuntimeError), match=match):  # sequential: the client's exception, chained
        _fit([FedAvg(), callback], mode=mode, rounds=1)


@pytest.mark.parametrize("mode", ["sequential", "vectorized", "auto"])
@pytest.mark.parametrize("term", [lambda params: 0.5, lambda params: torch.tensor(0.5, dtype=torch.float64)])
def test_a_constant_term_adds_to_the_loss_only(mode, term):
    """A term returning a number, or a tensor of no parameter, adds to the client's losses and leaves its gradient
    (the update) as it is, in every mode (vectorized clients once stopped: nothing to differentiate)."""
    record_plain, record_const = _Record(), _Record()
    plain, _ = _fit([FedAvg(), record_plain], mode=mode)
    const, _ = _fit([FedAvg(), _Objective([term]), record_const], mode=mode)
    torch.testing.assert_close(_flat(const.model), _flat(plain.model), rtol=0, atol=0)
    first_plain = record_plain.rounds[0]["updates"][0][2]
    assert record_const.rounds[0]["updates"][0][2] == pytest.approx(first_plain + 0.5, abs=1e-15)


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_accumulate_that_changes_the_delta_is_refused_in_every_mode(mode):
    """Both modes once disagreed silently (sequential summed the changed delta, vectorized the original)."""

    class ClipInAccumulate(FedAvg):
        def accumulate(self, stats, update):
            update.delta.mul_(0.5)

    with pytest.raises(
        RuntimeError, match=r"ClipInAccumulate.accumulate changed client \d+'s update.delta.*on_client_end"
    ):
        _fit([ClipInAccumulate()], mode=mode, rounds=1)


# ---------------------------------------------------------------- "auto"'s measurement leaves no trace


class _ParticipationProx(FederatedCallback):
    """A proximal term whose μ grows with the client's participation count, kept in a Counter attribute and in
    ``loop.client_state``."""

    def __init__(self):
        self.count = collections.Counter()
        self.watched = None

    def on_round_start(self, trainer, loop, plan):
        if self.watched is None:  # set before auto's measurement, shared with the model: must stay the model's own
            self.watched = list(loop.global_parameters())

    def client_objective(self, trainer, loop, plan, client_id):
        self.count[client_id] += 1
        seen = (loop.client_state.get("participation", client_id) or {"n": 0})["n"] + 1
        loop.client_state.set("participation", client_id, {"n": seen})
        assert seen == self.count[client_id]
        mu = 0.5 * self.count[client_id]
        anchor = _flat(loop.model).clone()

        def term(params):
            return 0.5 * mu * (torch.cat([p.reshape(-1) for p in params]) - anchor).pow(2).sum()

        return [term]


def test_auto_measurement_leaves_stateful_hooks_as_sequential_training_does():
    """``auto`` times clients (calling their hooks) before its first real round; the callback's counts, the loop's
    client state and the weights then equal sequential training's and the hand computation's."""
    results = {}
    for mode in ("sequential", "auto"):
        hook, record = _ParticipationProx(), _Record()
        loop, dm = _fit([FedAvg(), hook, record], mode=mode, rounds=3, clients=4)
        participations = collections.Counter(c for e in record.rounds for c in e["plan"].client_ids)
        assert dict(hook.count) == dict(participations)
        assert {c: loop.client_state.get("participation", c)["n"] for c in participations} == dict(participations)
        assert all(a is b for a, b in zip(hook.watched, loop.global_parameters(), strict=True))
        results[mode] = _flat(loop.model)
    torch.testing.assert_close(results["auto"], results["sequential"], rtol=0, atol=1e-12)
    # the hand computation of the same three rounds
    seen, w = collections.Counter(), record.rounds[0]["w0"]
    for entry in record.rounds:
        total, acc = 0, torch.zeros_like(w)
        for cid in entry["plan"].client_ids:
            seen[cid] += 1
            mu, anchor = 0.5 * seen[cid], w.clone()
            x, y = _client_xy(dm, cid)
            wi, _ = _local(w, x, y, extra=lambda v, mu=mu, a=anchor: 0.5 * mu * (v - a).pow(2).sum())
            acc += len(y) * (w - wi)
            total += len(y)
        w = w - acc / total
    torch.testing.assert_close(results["auto"], w, rtol=0, atol=1e-12)


def test_a_group_retried_after_running_out_of_memory_leaves_stateful_hooks_as_sequential_training_does(monkeypatch):
    """A vectorized group of 4 runs out of accelerator memory (simulated: the engine call raises CUDA's error after
    training) and is retried as two groups of 2, calling its clients' hooks again; the callback's counts, the loop's
    client state and the weights then equal sequential training's."""
    import fedlightning.vectorized.auto as auto
    from fedlightning.vectorized import VectorizedClientTrainer

    run, sizes = VectorizedClientTrainer.run, []

    def out_of_memory_above_two(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        sizes.append(len(kwargs["client_ids"]))
        if sizes[-1] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB.")
        return out

    results = {}
    for mode in ("sequential", "vectorized"):
        if mode == "vectorized":
            monkeypatch.setattr(VectorizedClientTrainer, "run", out_of_memory_above_two)
            monkeypatch.setattr(auto, "_may_run_out_of_memory", lambda device: True)  # as on an accelerator
        hook, record = _ParticipationProx(), _Record()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"max_parallel_clients: a group of 4")
            loop, _ = _fit([FedAvg(), hook, record], mode=mode, rounds=3, clients=4)
        participations = collections.Counter(c for e in record.rounds for c in e["plan"].client_ids)
        assert dict(hook.count) == dict(participations)
        assert {c: loop.client_state.get("participation", c)["n"] for c in participations} == dict(participations)
        results[mode] = _flat(loop.model)
    assert sizes == [4, 2, 2] + [2, 2] * 2
    torch.testing.assert_close(results["vectorized"], results["sequential"], rtol=0, atol=1e-12)


def test_a_client_marked_failed_without_a_reason_is_named_so():
    class DropFirst(FederatedCallback):
        def on_client_end(self, trainer, loop, plan, update):
            if update.client_id == plan.client_ids[0]:
                update.failed = True

    with pytest.warns(UserWarning, match=r"round 0: client \d+ skipped \(marked failed, no reason given\)"):
        _fit([FedAvg(), DropFirst()], rounds=1)


def test_auto_measurement_leaves_attributes_it_cannot_copy_as_they_are():
    """An attribute deepcopy refuses (a tensor with autograd history) is not copied, and auto still runs."""

    class KeepsAGraph(FederatedCallback):
        def __init__(self):
            w = torch.ones(3, requires_grad=True)
            self.scaled = w * 2  # not a graph leaf: deepcopy raises

        def client_objective(self, trainer, loop, plan, client_id):
            return None

    hook = KeepsAGraph()
    kept = hook.scaled
    loop, _ = _fit([FedAvg(), hook], mode="auto")
    assert hook.scaled is kept and loop.trainer.global_step == 2


class _NoSuper(ServerStrategy):
    """A strategy whose ``__init__`` forgets ``super().__init__()``."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def server_update(self, loop, stats, plan):
        return ServerStep(self.scale * self.mean_delta(stats))


def test_a_strategy_that_does_not_call_super_init_runs_with_the_base_defaults():
    """It gets FedAvg's server_lr and weighting (it once failed inside pl.Trainer(...), whose debug message reprs
    the callbacks, with an AttributeError from ServerStrategy.__repr__)."""
    assert repr(_NoSuper()) == "_NoSuper(server_lr=1.0, weighting='samples')"
    mine, _ = _fit([_NoSuper()])
    fedavg, _ = _fit([FedAvg()])
    torch.testing.assert_close(_flat(mine.model), _flat(fedavg.model), rtol=0, atol=0)


class _RaggedStatistic(ServerStrategy):
    """Adds a statistic whose length depends on the client (an author's slip)."""

    def accumulate(self, stats, update):
        stats.add("head", update.delta[: 3 + update.client_id])


def test_a_statistic_of_another_shape_per_client_is_refused_naming_it():
    """Shapes that do not match once failed in torch's addition naming nothing, and shapes that broadcast were
    summed silently."""
    with pytest.raises(ValueError, match=r"round statistic 'head': a client adds a value of shape \(\d+,\) to one of "):
        _fit([_RaggedStatistic()], rounds=1)


def test_the_client_state_store_saves_copies_of_tensors_in_lists():
    """A list of tensors (one per parameter, as a per-parameter optimizer state) is saved as copies on the CPU, as a
    tensor or a dict of tensors is: the saved values do not move with the live ones."""
    from fedlightning.state import ClientStateStore

    store = ClientStateStore()
    live = [torch.zeros(2), torch.ones(3)]
    store.set("adagrad", 4, {"sums": live, "pair": (torch.zeros(1), 2.0)})
    saved = store.state_dict()
    live[0].add_(5.0)
    assert saved["adagrad"][4]["sums"][0].tolist() == [0.0, 0.0] and saved["adagrad"][4]["pair"][1] == 2.0
    assert isinstance(saved["adagrad"][4]["pair"], tuple)
    Pair = collections.namedtuple("Pair", "a b")
    store.set("named", 1, {"pair": Pair(torch.ones(1), 3)})
    assert store.state_dict()["named"][1]["pair"] == Pair(torch.ones(1), 3)


class _LogsPerClient(FederatedCallback):
    def __init__(self):
        self.values = collections.defaultdict(list)  # round -> the logged values

    def on_client_end(self, trainer, pl_module, plan, update):
        value = float(update.delta.norm())
        self.values[plan.round].append(value)
        pl_module.log("delta_norm", value)
        pl_module.log("delta_norm_max", value, reduce_fx="max")

    def client_objective(self, trainer, pl_module, plan, client_id):
        pl_module.log("delta_objectives", 1.0, reduce_fx="sum")  # one per client and round
        return []


@pytest.mark.parametrize("mode", ["sequential", "vectorized", "auto"])
def test_pl_module_log_in_a_per_client_hook_is_reduced_over_the_rounds_clients(mode):
    """One value per client, reduced over the round as training_step's values are (client/<name>); it was the last
    client's value (the last one of each process with several). auto's measurement of the first round calls the
    hooks for the clients it times too: what they log there is not counted."""
    hook, seen = _LogsPerClient(), []

    class Seen(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("client/delta")})

    _fit([FedAvg(), hook, Seen()], mode=mode, rounds=2)
    for r, logged in enumerate(seen):
        values = hook.values[r]
        assert len(values) == 3
        assert logged["client/delta_norm"] == pytest.approx(sum(values) / 3, rel=2**-22)  # logged in float32
        assert logged["client/delta_norm_max"] == pytest.approx(max(values), rel=2**-23)
        assert logged["client/delta_objectives"] == 3.0


class _ZeroWeights(ServerStrategy):
    def client_weight(self, update):
        return 0.0


def test_every_client_at_weight_zero_is_refused_naming_client_weight():
    """It ended in a message about a non-finite Δ (the mean 0/0)."""
    with pytest.raises(ValueError, match=r"round 0: _ZeroWeights.client_weight gave each of the round's 3 healthy"):
        _fit([_ZeroWeights()], rounds=1)


class _LossMinusConstant(ServerStrategy):
    """A loss-based weight ``f_i − c`` (q-FFL written by hand) that goes negative for a client with a low loss."""

    def client_weight(self, update):
        return update.first_loss - 2.0 if update.client_id % 2 else update.first_loss


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_negative_client_weight_is_refused_naming_the_client_and_value(mode):
    """It was taken as it came: with weights w_1 > 0 > w_2 the round's 'mean' Σ w_i Δ_i / Σ w_i extrapolates past
    the first update, the more so the closer Σ w_i comes to 0, with no message. Sequential clients are admitted one
    by one, vectorized ones in a chunk (``_round.py``'s two paths)."""
    with pytest.raises(ValueError, match=r"round 0: _LossMinusConstant.client_weight gave client \d+ the weight "
                       r"-\d\.\d+; a client's aggregation weight must be >= 0") as info:  # fmt: skip
        _fit([_LossMinusConstant()], mode=mode, rounds=1, clients=4)
    assert "gave client" in str(info.value)


class _PersonalStart(FederatedCallback):
    """Personal weights written where the optimizer's parameters are: the client's working copy."""

    def __init__(self, how):
        self.how, self.calls = how, 0

    def configure_client_optimizer(self, trainer, pl_module, plan, client_id, optimizer):
        self.calls += 1
        if self.how == "none":
            optimizer.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]  # touches the optimizer only
            return None
        p = optimizer.param_groups[0]["params"][-1]
        if self.how == "no_grad":
            with torch.no_grad():
                p.fill_(0.0)
        else:  # the older idiom, which no version counter sees
            p.data.copy_(torch.zeros_like(p))
        return None


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
@pytest.mark.parametrize("how", ["no_grad", "data"])
def test_personal_weights_written_in_configure_client_optimizer_are_refused(mode, how):
    """The write was overwritten by the global weights without a trace: every client trained from w_t. (Sequential
    training reports it as the client's error, ``round 0: client c raised ValueError: ...``.)"""
    refused = r"_PersonalStart.configure_client_optimizer changed client \d+'s parameters \(1 of the optimizer's "
    with pytest.raises((ValueError, RuntimeError), match=refused + r"parameter tensors\): a client starts"):
        _fit([FedAvg(), _PersonalStart(how)], mode=mode, rounds=1)


def test_a_configure_client_optimizer_that_leaves_the_parameters_trains_as_without_it():
    hook = _PersonalStart("none")
    loop, _ = _fit([FedAvg(), hook], rounds=2)
    plain, _ = _fit([FedAvg()], rounds=2)
    assert hook.calls == 6 and torch.equal(_flat(loop.model), _flat(plain.model))


def test_a_callback_state_a_checkpoint_cannot_give_back_is_named():
    """A checkpoint whose state for a callback lacks a key or holds a value of another type (edited, or written by
    another version): one ValueError naming the callback and the cause, once also through super(), where the
    callback's own load_state_dict raised a bare KeyError / TypeError; a state it can restore is restored."""
    from fedlightning.callbacks import DPFedAvg

    dp = DPFedAvg(clip_norm=2.0, noise_multiplier=0.0, delta=1e-5)
    with pytest.raises(ValueError, match=r"^DPFedAvg: the checkpoint's state for this callback cannot be restored "
                       r"\(KeyError: 'clip_norm'\)") as info:  # fmt: skip
        dp.load_state_dict({"history": []})
    assert info.value.config_key == "ckpt_path"  # train.py's one line names the checkpoint, not clip_norm's argument
    with pytest.raises(ValueError, match=r"^DPFedAvg: .*\(TypeError: "):
        dp.load_state_dict({"clip_norm": 1.0, "history": [3]})

    class Counting(FederatedCallback):
        def __init__(self):
            self.rounds = 0

        def state_dict(self):
            return {"rounds": self.rounds}

        def load_state_dict(self, state_dict):
            self.rounds = int(state_dict["rounds"])

    class Derived(Counting):
        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)

    with pytest.raises(ValueError) as info:
        Derived().load_state_dict({})
    assert str(info.value).startswith("Derived: the checkpoint's state") and str(info.value).count("cannot") == 1
    restored = Derived()
    restored.load_state_dict({"rounds": 7})
    assert restored.rounds == 7


class _ScaledLin(Lin):
    """A module's own Parameter next to a submodule's, and a frozen one: registration order is not name order."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.ones(N_CLS))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x.double()) * self.scale, y)


class _KeepsOut(ServerStrategy):
    """Leaves the parameters ``names`` out of the server step (FedBN-like), through ``loop.parameter_slices()``."""

    def __init__(self, names):
        super().__init__()
        self.names, self.seen = names, []

    def server_update(self, loop, stats, plan):
        step = self.mean_delta(stats).clone()
        slices = loop.parameter_slices()
        self.seen.append(slices)
        for name in self.names:
            step[slices[name]] = 0
        return ServerStep(step, None, {})


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_parameter_slices_locate_each_trainable_parameter_in_the_flat_update(mode):
    """The slices follow the flat layout (``scale`` first, ``frozen`` absent), so a strategy that zeroes the
    pseudo-gradient of ``net.bias`` and ``scale`` leaves exactly those parameters at their initial values while the
    weight trains."""
    module = _ScaledLin()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    strategy = _KeepsOut(["net.bias", "scale"])
    loop, _ = _fit([strategy], mode=mode, rounds=2, module=module)
    n_w = N_CLS * D_IN
    assert strategy.seen[0] == {
        "scale": slice(0, N_CLS),
        "net.weight": slice(N_CLS, N_CLS + n_w),
        "net.bias": slice(N_CLS + n_w, 2 * N_CLS + n_w),
    }
    assert torch.equal(module.net.bias, start["net.bias"]) and torch.equal(module.scale, start["scale"])
    assert not torch.equal(module.net.weight, start["net.weight"])
