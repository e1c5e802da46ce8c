"""torchmetrics metrics used in ``training_step`` under client_execution="vectorized": the same round values as
sequential training.

Sequential training (the reference, a separate code path) updates a metric at every gradient evaluation of every
client, undoes a line search's trial evaluations, and the loop logs ``client/<name>`` once per round. Vectorised
training records the metric calls under vmap and replays them per client after the round. Checked on a ragged
Dirichlet digits split (padded steps: clients with fewer samples than the batch size), K > 1, SGD and SgdArmijo
(which backtracks here, so a counted trial evaluation would show), for the usual ways of using a metric: the metric
object logged, ``compute()`` logged inside ``training_step``, the batch value ``metric(...)`` returns, a value passed
to another metric, a ``MetricCollection``; and on the three padded-step paths (loss interception, the per-sample
protocol, one call per sample). Refusals name the metric. The modules and data are float64 (tests/numerics.py); the
metric values are float32, as torchmetrics keeps them.
"""

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP
from fedlightning.optim import SgdArmijo
from fedlightning.vectorized import VectorizationUnsupportedError, VectorizedClientTrainer
from numerics import Float64Inputs, assert_close64, flat, rtol32, to_float64

ROUNDS, CPR, K, BATCH = 3, 6, 4, 16
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.3), "armijo": lambda p: SgdArmijo(p, eta_max=4.0, beta=0.7)}


class Digits64(Float64Inputs, DigitsDataModule):
    """The digits with float64 inputs."""


def digits():
    return Digits64(num_clients=40, batch_size=BATCH, partition=Dirichlet(0.3), seed=0)


class RoundMetrics(pl.Callback):
    """Every round's ``client/*`` metrics, and every ClientUpdate."""

    def __init__(self):
        self.rounds, self.updates = [], []

    def on_client_end(self, trainer, loop, plan, update):
        self.updates.append(update)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rounds.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("client/")})


class MetricNet(pl.LightningModule):
    """A user's MLP with torchmetrics in ``training_step``, used in one of several ways (``variant``)."""

    def __init__(self, variant="object", loss="cross_entropy"):
        super().__init__()
        torch.manual_seed(1)
        self.variant, self.loss_kind = variant, loss
        self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
        self.mean_loss = torchmetrics.MeanMetric()
        self.mean_acc = torchmetrics.MeanMetric()
        self.coll = torchmetrics.MetricCollection(
            {
                "f1": torchmetrics.classification.MulticlassF1Score(num_classes=10, average="macro"),
                "top3": torchmetrics.classification.MulticlassAccuracy(num_classes=10, top_k=3, average="micro"),
            },
            prefix="coll_",
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        if self.loss_kind == "cross_entropy":
            loss = F.cross_entropy(logits, y)
        else:  # a loss the engine does not recognise: padded steps call training_step once per sample
            loss = -(F.log_softmax(logits, 1) * F.one_hot(y, 10)).sum(1).mean()
        if self.variant == "object":  # the metric objects logged: computed once per round by the loop
            self.acc(logits, y)
            self.log("acc", self.acc)
            self.mean_loss.update(loss)
            self.log("mean_loss", self.mean_loss)
        elif self.variant == "compute":  # update, then compute() logged at every step (a running value)
            self.acc.update(logits, y)
            self.log("acc", self.acc.compute())
            self.mean_loss.update(loss.detach())
            self.log("mean_loss", self.mean_loss.compute())
        elif self.variant == "batch_value":  # the batch value forward returns: logged, and averaged by another metric
            batch_acc = self.acc(logits, y)
            self.log("acc_step", batch_acc)
            self.mean_acc.update(batch_acc)
            self.log("mean_acc", self.mean_acc)
        elif self.variant == "collection":
            self.coll.update(logits, y)
            self.log_dict(self.coll)
        elif self.variant == "per_sample_only":  # per-sample tensors only (the one-call-per-sample path)
            self.acc.update(logits, y)
            self.log("acc", self.acc)
        return loss

    def on_train_epoch_end(self):
        if self.variant == "compute":  # metrics the loop does not know of are reset by the module itself
            self.acc.reset()
            self.mean_loss.reset()


def fit(model, optimizer, mode, rounds=ROUNDS):
    """A float64 copy of ``model`` trained on the float64 digits: (weights, RoundMetrics, loop)."""
    model = to_float64(copy.deepcopy(model))
    rec = RoundMetrics()
    loop = FederatedLoop(
        model, client_optimizer=optimizer, local_steps=K, clients_per_round=CPR, seed=3, client_execution=mode
    )
    make_trainer(rounds, callbacks=[FedAvg(), rec]).fit(loop, datamodule=digits())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return weights, rec, loop


#: a round's logged metric is a float32 mean of at most CPR·K float32 values, each at most a float32 mean of CPR·K
#: values (a running ``compute()``): two such values from float64 runs that agree differ by numerics.rtol32 of that
METRIC_RTOL = rtol32(2 * CPR * K + 1)


def assert_same_metrics(seq, vec, names):
    assert_close64(vec[0], seq[0])
    assert len(seq[1].rounds) == len(vec[1].rounds) == ROUNDS
    for r, (a, b) in enumerate(zip(seq[1].rounds, vec[1].rounds)):
        for name in names:
            assert f"client/{name}" in a, (r, name, sorted(a))
            want = pytest.approx(a[f"client/{name}"], rel=METRIC_RTOL, abs=METRIC_RTOL)
            assert b[f"client/{name}"] == want, (r, name)


def test_the_split_is_ragged_and_armijo_backtracks():
    """The data makes padded steps (clients with fewer samples than the batch, unequal partial batches), and the
    line search evaluates trial points (which must not count in the metrics)."""
    dm = digits()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, seed=3)
    sizes = [dm.client_num_samples(c) for r in range(ROUNDS) for c in dm.sample_clients(r)]
    assert min(sizes) < BATCH and len(set(sizes)) > CPR
    _, rec, _ = fit(MetricNet(), OPTIMIZERS["armijo"], "vectorized")
    assert sum(u.backtracks for u in rec.updates) > 0


@pytest.mark.numerics
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "variant,names",
    [
        ("object", ["acc", "mean_loss"]),
        ("compute", ["acc", "mean_loss"]),
        ("batch_value", ["acc_step", "mean_acc"]),
        ("collection", ["coll_f1", "coll_top3"]),
    ],
)
def test_metrics_equal_sequential(opt, variant, names):
    seq = fit(MetricNet(variant), OPTIMIZERS[opt], "sequential")
    vec = fit(MetricNet(variant), OPTIMIZERS[opt], "vectorized")
    assert_same_metrics(seq, vec, names)
    # the metrics moved over the rounds (a constant series would hide a wrong replay)
    assert len({round(r[f"client/{names[0]}"], 6) for r in seq[1].rounds}) == ROUNDS


def test_line_search_in_client_order_equals_sequential(monkeypatch):
    """The line search used for models with random layers (every client at one grid point per trial round, all
    clients' rows in order), forced on this deterministic model: its trials are not counted either."""
    import fedlightning.vectorized.call as call

    monkeypatch.setattr(call, "_has_random_layers", lambda model: True)
    vec = fit(MetricNet("object"), OPTIMIZERS["armijo"], "vectorized")
    assert vec[2].vectorized_engine.deterministic is False
    assert sum(u.backtracks for u in vec[1].updates) > 0
    assert_same_metrics(fit(MetricNet("object"), OPTIMIZERS["armijo"], "sequential"), vec, ["acc", "mean_loss"])


class NaNDigits(Digits64):
    """Digits with some samples' features NaN: a client whose batch holds one stops at that step (SgdArmijo). The
    NaNs are written after setup, whose data checks would refuse them: a client's loss turning non-finite
    mid-round is what is tested here."""

    def setup(self, stage=None):
        checked = self.train_dataset is not None
        super().setup(stage)
        if not checked:
            self.train_dataset.x[::60] = float("nan")


def test_steps_after_a_client_stopped_are_not_replayed():
    def run(mode):
        model = to_float64(copy.deepcopy(MetricNet("object")))
        rec = RoundMetrics()
        loop = FederatedLoop(
            model,
            client_optimizer=OPTIMIZERS["armijo"],
            local_steps=K,
            clients_per_round=CPR,
            seed=3,
            client_execution=mode,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skipped clients
            make_trainer(ROUNDS, callbacks=[FedAvg(), rec]).fit(
                loop, datamodule=NaNDigits(num_clients=40, batch_size=BATCH, partition=Dirichlet(0.3), seed=0)
            )
        return flat(model), rec, loop

    seq, vec = run("sequential"), run("vectorized")
    assert any(u.failed and 0 < u.num_steps < K for u in vec[1].updates)  # stopped before its last step
    assert [u.num_steps for u in vec[1].updates] == [u.num_steps for u in seq[1].updates]
    assert_same_metrics(seq, vec, ["acc", "mean_loss"])


def test_one_call_per_sample_path_equals_sequential():
    """A loss the engine does not intercept: padded steps call training_step on each sample; the metric's
    per-sample arguments are gathered from the client's real samples."""
    vec = fit(MetricNet("per_sample_only", loss="own"), OPTIMIZERS["sgd"], "vectorized")
    assert vec[2].vectorized_engine.call.intercept is False
    assert_same_metrics(fit(MetricNet("per_sample_only", loss="own"), OPTIMIZERS["sgd"], "sequential"), vec, ["acc"])


class ProtocolMLP(MLP):
    """A bundled MLP whose class defines both training_step (with a metric) and training_step_per_sample."""

    def __init__(self):
        torch.manual_seed(2)
        super().__init__(input_dim=64, hidden=[16], num_classes=10)
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

    def training_step(self, batch, batch_idx):
        logits, y = self._logits_targets(batch)
        self.train_acc.update(logits, y)
        self.log("train_acc", self.train_acc)
        return self.loss(logits, y)

    def training_step_per_sample(self, batch, batch_idx):
        return super().training_step_per_sample(batch, batch_idx)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_per_sample_protocol_is_not_used_when_training_step_calls_a_metric(opt):
    vec = fit(ProtocolMLP(), OPTIMIZERS[opt], "vectorized")
    call = vec[2].vectorized_engine.call
    assert call.per_sample_step is None and call.intercept is True
    assert_same_metrics(fit(ProtocolMLP(), OPTIMIZERS[opt], "sequential"), vec, ["train_acc"])


def test_auto_vectorizes_a_module_with_metrics():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = fit(MetricNet("object"), OPTIMIZERS["sgd"], "auto")
    assert not [w for w in caught if "training clients sequentially" in str(w.message)]
    assert isinstance(auto[2].vectorized_engine, VectorizedClientTrainer)
    assert auto[2].client_execution_choice in ("sequential", "vectorized")
    # whichever mode it chose, the measurement left the metrics as they were: the sequential series
    assert_same_metrics(fit(MetricNet("object"), OPTIMIZERS["sgd"], "sequential"), auto, ["acc", "mean_loss"])


class BatchMeanMetric(MetricNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.mean_acc.update((logits.argmax(1) == y).float().mean())  # a statistic of the padded batch
        return F.cross_entropy(logits, y)


class UsesReturnedValue(MetricNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        return loss * (1 + 0 * self.acc(logits, y))  # the batch value in arithmetic


@pytest.mark.parametrize(
    "model,match",
    [
        (
            BatchMeanMetric,
            r"updates the torchmetrics metric 'mean_acc' \(update: argument 0\) with [\d.]+ on a client's batch "
            r"padded to 16 samples but [\d.]+ on its \d+ real ones",
        ),
        (
            UsesReturnedValue,
            r"the value that the torchmetrics metric 'acc' returns in training_step is used in arithmetic",
        ),
    ],
)
def test_what_cannot_be_replayed_is_refused_naming_the_metric(model, match):
    with pytest.raises(VectorizationUnsupportedError, match=match):
        fit(model(), OPTIMIZERS["sgd"], "vectorized", rounds=1)


def test_a_statistic_of_whole_batches_is_replayed():
    """Without padding (every client's batch full) a batch statistic is one value per client: replayed."""
    from fedlightning.datamodules import IID

    def dm():
        return Digits64(num_clients=36, batch_size=7, partition=IID(), seed=0)

    class ReadAtTheEnd(pl.Callback):  # the clients' working copy, as the fit leaves it (rebuilt when read later,
        def on_train_end(self, trainer, loop):  # after Lightning has moved the loop off an accelerator)
            runs.append(copy.deepcopy(loop.client_worker.model.mean_acc).cpu())

    runs = []
    for mode in ("sequential", "vectorized"):
        model = to_float64(BatchMeanMetric())
        loop = FederatedLoop(
            model,
            client_optimizer=OPTIMIZERS["sgd"],
            local_steps=K,
            clients_per_round=CPR,
            seed=3,
            client_execution=mode,
        )
        make_trainer(2, callbacks=[ReadAtTheEnd()]).fit(loop, datamodule=dm())
    # the module never resets it: both hold the mean of the 2 rounds x CPR clients x K batch accuracies
    assert float(runs[0].weight) == float(runs[1].weight) == 2 * CPR * K
    # float32 means of 2·CPR·K float32 batch accuracies (numerics.rtol32)
    assert float(runs[1].compute()) == pytest.approx(float(runs[0].compute()), rel=rtol32(2 * CPR * K + 1))


class CountsSamples(MetricNet):
    """Counts its samples and weights its mean loss by the batch size: metric arguments computed from the batch's
    size (``variant`` ``"weight"``: a Python number; ``"tensor"``: a tensor made from it; ``"ones"``: a tensor of
    that length), or from the batch itself (``"ones_like"``: the count, one 1 per sample), or (``"constant"``) the
    same arguments as constants."""

    def __init__(self, variant="weight", loss="cross_entropy"):
        super().__init__(variant, loss)
        self.seen = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        if self.loss_kind == "cross_entropy":
            loss = F.cross_entropy(logits, y)
        else:  # not intercepted: padded steps call training_step once per sample
            loss = -(F.log_softmax(logits, 1) * F.one_hot(y, 10)).sum(1).mean()
        size = len(y) if self.variant in ("weight", "tensor") else 2
        if self.variant == "ones":
            self.seen.update(torch.ones(len(y), dtype=x.dtype))
        elif self.variant == "ones_like":
            self.seen.update(torch.ones_like(y, dtype=x.dtype))
        else:
            self.seen.update(torch.tensor(float(size)) if self.variant == "tensor" else size)
        self.log("seen", self.seen)
        if self.loss_kind == "cross_entropy":  # (a loss in a metric takes loss interception)
            self.mean_loss.update(loss.detach(), weight=size)
            self.log("mean_loss", self.mean_loss)
        return loss


@pytest.mark.parametrize("variant", ["weight", "tensor"])
@pytest.mark.parametrize("loss", ["cross_entropy", "own"])
def test_a_metric_argument_computed_from_the_batch_size_is_refused(variant, loss):
    """Replayed once per step with the batched call's value, ``len(y)`` would be the padded size (loss
    interception) or 1 (one call per sample) for every client: refused naming the metric, where sequential training
    counts each client's real samples."""
    where = "a client's batch padded to 16 samples but \\d+ on its \\d+ real ones"
    if loss == "own":
        where = "a client's \\d+ real samples but 1 on one of them alone"
    with pytest.raises(VectorizationUnsupportedError, match=rf"'seen' \(update: argument 0\) with [\d.]+ on {where}"):
        fit(CountsSamples(variant, loss), OPTIMIZERS["sgd"], "vectorized", rounds=1)


@pytest.mark.parametrize("loss", ["cross_entropy", "own"])
def test_a_tensor_as_long_as_the_padded_batch_but_not_of_it_is_refused(loss):
    """``torch.ones(len(y))`` is the same for every client under vmap, of the padded length (or 1 on the per-sample
    path): replayed whole, it would count the padding. Refused naming the metric and the way out."""
    with pytest.raises(VectorizationUnsupportedError, match=r"'seen' .*torch\.ones\(len\(y\)\).*torch\.ones_like"):
        fit(CountsSamples("ones", loss), OPTIMIZERS["sgd"], "vectorized", rounds=1)


@pytest.mark.parametrize("loss", ["cross_entropy", "own"])
def test_a_count_computed_from_the_batch_is_replayed_on_the_real_samples(loss):
    vec = fit(CountsSamples("ones_like", loss), OPTIMIZERS["sgd"], "vectorized")
    assert vec[2].vectorized_engine.call.intercept is (loss == "cross_entropy")
    seq = fit(CountsSamples("ones_like", loss), OPTIMIZERS["sgd"], "sequential")
    assert_same_metrics(seq, vec, ["seen"])
    assert [r["client/seen"] for r in vec[1].rounds] == [r["client/seen"] for r in seq[1].rounds]  # counts: exact


def test_auto_counts_the_real_samples_of_ragged_clients():
    """``auto`` trains such a module sequentially: ``client/seen`` is the round's real samples, counted here from
    the clients' updates, and the batch-size-weighted mean loss is sequential training's."""
    seq = fit(CountsSamples("weight"), OPTIMIZERS["sgd"], "sequential")
    auto = fit(CountsSamples("weight"), OPTIMIZERS["sgd"], "auto")
    assert auto[2].client_execution_choice == "sequential"
    assert_same_metrics(seq, auto, ["seen", "mean_loss"])
    dm = digits()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, seed=3)
    for r, logged in enumerate(auto[1].rounds):
        seen = 0
        for c in dm.sample_clients(r):  # the client's K batches, from its own loader
            batches = iter(dm.client_dataloader(c, r))
            for _ in range(K):
                batch = next(batches, None)
                if batch is None:
                    batches = iter(dm.client_dataloader(c, r))
                    batch = next(batches)
                seen += len(batch[1])
        assert seen < CPR * K * BATCH  # ragged: counting the padding would give more
        assert logged["client/seen"] == seen


@pytest.mark.parametrize("loss", ["cross_entropy", "own"])
def test_a_constant_metric_argument_is_replayed(loss):
    """The same arguments as constants (not of the batch): vectorized, and the values sequential training logs."""
    vec = fit(CountsSamples("constant", loss), OPTIMIZERS["sgd"], "vectorized")
    assert vec[2].vectorized_engine.call.intercept is (loss == "cross_entropy")
    names = ["seen", "mean_loss"] if loss == "cross_entropy" else ["seen"]
    assert_same_metrics(fit(CountsSamples("constant", loss), OPTIMIZERS["sgd"], "sequential"), vec, names)


class RunningMean(torchmetrics.Metric):
    """A state reduced by "mean": torchmetrics' forward merges it with a running average, not as update does."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("value", torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, x):
        self.value = 0.5 * self.value + 0.5 * x.float().mean()

    def compute(self):
        return self.value


@pytest.mark.parametrize(
    "make,args,replayed_as_update",
    [
        (lambda: torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro"), "logits", True),
        (lambda: torchmetrics.MeanMetric(), "values", True),
        (lambda: torchmetrics.MaxMetric(), "values", True),
        (lambda: torchmetrics.CatMetric(), "values", True),
        (lambda: torchmetrics.classification.MulticlassF1Score(num_classes=4, average="macro"), "logits", True),
        (lambda: RunningMean(), "values", False),
    ],
    ids=["accuracy", "mean", "max", "cat", "f1", "mean-reduced"],
)
def test_forward_is_replayed_as_update_only_where_the_state_is_the_same(make, args, replayed_as_update):
    """Against torchmetrics' own forward: where the replay uses update, both leave the same state."""
    from fedlightning.vectorized.metrics import _forward_as_update

    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(6, 4, generator=g), torch.randint(0, 4, (6,), generator=g))
        if args == "logits"
        else (torch.randn(5, generator=g),)
        for _ in range(3)
    ]
    by_forward, by_update = make(), make()
    for b in batches:
        by_forward(*b)
        by_update.update(*b)
    assert _forward_as_update(by_forward) is replayed_as_update
    same = all(
        torch.equal(
            torch.as_tensor(torch.cat(a) if isinstance(a, list) else a),
            torch.as_tensor(torch.cat(b) if isinstance(b, list) else b),
        )
        for a, b in ((getattr(by_forward, k), getattr(by_update, k)) for k in by_forward._defaults)
    )
    assert same is replayed_as_update
