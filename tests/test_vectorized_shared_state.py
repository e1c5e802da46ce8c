"""What the vectorized engine shares between the clients in lockstep, and sequential training does not.

Parameters the loss does not reach: the sequential optimizer skips a parameter whose ``.grad`` is None, the
batched step gives it a zero gradient. Where the two steps agree (no weight decay, no momentum or moments built from
an earlier gradient) vectorized training equals sequential training in float64; where the zero gradient would move
the parameter or its state, vectorized refuses by name (``BatchedRule.check_missing_gradients``) and ``"auto"``
trains sequentially. Buffers that ``training_step`` writes in place: each sequential client writes its own, the
clients in lockstep would share one, so vectorized refuses by name. Independent reference: sequential training."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.datamodules import Dirichlet, FederatedDataModule
from fedlightning.optim import SPS, SgdArmijo
from fedlightning.vectorized import VectorizationUnsupportedError

g = torch.Generator().manual_seed(0)
X = torch.randn(160, 6, dtype=torch.float64, generator=g)
Y = (X[:, 0] + X[:, 1] > 0).long()

OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "SGD weight decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "Adam weight decay": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "SgdArmijo": lambda p: SgdArmijo(p),
    "SPS": lambda p: SPS(p),
}
# (optimizer, the auxiliary layer is used at local step 0 only): the batched step would move it
REFUSED = {
    ("SGD weight decay", False),
    ("SGD weight decay", True),
    ("SGD momentum", True),
    ("Adam", True),
    ("Adam weight decay", False),
    ("Adam weight decay", True),
    ("AdamW", False),
    ("AdamW", True),
}


class Net(pl.LightningModule):
    """A head the loss always reads and an auxiliary layer it reads at local step 0 only, or never."""

    def __init__(self, optimizer, aux_at_first_step):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(6, 2, dtype=torch.float64)
        self.aux = torch.nn.Linear(6, 2, dtype=torch.float64)
        self.optimizer, self.aux_at_first_step = optimizer, aux_at_first_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.head(x)
        if self.aux_at_first_step and batch_idx == 0:
            out = out + self.aux(x)
        return F.cross_entropy(out, y)

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer](self.parameters())


def _train(net, mode, inputs=X):
    """``net``'s state dict after 2 rounds of 4 of 8 Dirichlet clients (samples ``inputs`` with labels ``Y``), 3 local
    steps each."""
    dm = FederatedDataModule.from_datasets(
        TensorDataset(inputs, Y), partition=Dirichlet(alpha=0.5), num_clients=8, batch_size=6, seed=0, val_fraction=0
    )
    loop = FederatedLoop(net, local_steps=3, clients_per_round=4, seed=0, client_execution=mode)
    make_trainer(2).fit(loop, datamodule=dm)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _fit(optimizer, aux_at_first_step, mode):
    return _train(Net(optimizer, aux_at_first_step), mode)


@pytest.mark.parametrize("aux_at_first_step", [False, True], ids=["never used", "used at step 0"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_vectorized_equals_sequential_or_refuses_by_name(optimizer, aux_at_first_step):
    seq = _fit(optimizer, aux_at_first_step, "sequential")
    start = Net(optimizer, aux_at_first_step).state_dict()
    if not aux_at_first_step:
        assert torch.equal(seq["aux.weight"], start["aux.weight"])  # sequential training leaves it alone
    if (optimizer, aux_at_first_step) in REFUSED:
        with pytest.raises(VectorizationUnsupportedError, match=r"does not depend on aux\.weight, aux\.bias"):
            _fit(optimizer, aux_at_first_step, "vectorized")
    else:
        vec = _fit(optimizer, aux_at_first_step, "vectorized")
        for k in seq:
            torch.testing.assert_close(vec[k], seq[k], rtol=1e-10, atol=1e-12, msg=k)
    auto = _fit(optimizer, aux_at_first_step, "auto")
    for k in seq:
        torch.testing.assert_close(auto[k], seq[k], rtol=1e-10, atol=1e-12, msg=k)


class Counting(pl.LightningModule):
    """Counts the samples it has seen in a buffer, in place in ``training_step``: sequential clients each count
    their own (and FedAvg averages the counts); vectorized clients would share one buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(6, 2, dtype=torch.float64)
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += len(y)
        return F.cross_entropy(self.head(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_buffer_written_in_training_step_is_refused_by_name_and_auto_trains_sequentially():
    def fit(mode):
        return _train(Counting(), mode)

    seq = fit("sequential")
    assert float(seq["seen"]) > 0  # each client counted its own samples; the server averaged the counts
    with pytest.raises(VectorizationUnsupportedError, match=r"writes its buffer 'seen' in place"):
        fit("vectorized")
    auto = fit("auto")
    assert all(torch.equal(auto[k], seq[k]) for k in seq)


class Checkpointed(pl.LightningModule):
    """Activation checkpointing (``torch.utils.checkpoint``): its recomputation in the backward pass does not run
    under vmap."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 8, dtype=torch.float64)
        self.head = torch.nn.Linear(8, 2, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        from torch.utils.checkpoint import checkpoint

        x, y = batch
        h = checkpoint(lambda t: torch.tanh(self.body(t)), x, use_reentrant=False)
        return F.cross_entropy(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_backward_pass_vmap_cannot_run_is_refused_and_auto_trains_sequentially():
    """Refused by name wherever vmap stops: in the first gradient evaluation (torch 2.14), or already in the forward
    pass (torch 2.11, whose vmap refuses checkpoint's saved-inputs function)."""

    def fit(mode):
        return _train(Checkpointed(), mode)

    stopped = r"failed in the first gradient evaluation|failed in the model \(Checkpointed\) while running the clients"
    with pytest.raises(VectorizationUnsupportedError, match=stopped):
        fit("vectorized")
    seq, auto = fit("sequential"), fit("auto")
    assert all(torch.equal(auto[k], seq[k]) for k in seq)


TOKENS = torch.randint(1, 9, (160, 5), generator=g)
TOKENS[torch.arange(5).expand(160, 5) >= torch.randint(1, 6, (160, 1), generator=g)] = 0  # sequences padded with 0


class Tokens(pl.LightningModule):
    """Token ids padded with 0 into an embedding with ``padding_idx=0`` (the NLP idiom), mean-pooled into a head."""

    def __init__(self, **embedding):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(9, 4, padding_idx=0, dtype=torch.float64, **embedding)
        with torch.no_grad():
            self.emb.weight[0] = 0.5  # a padding row that is not zero: its value is read, never trained
        self.head = torch.nn.Linear(4, 2, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        tokens, y = batch
        return F.cross_entropy(self.head(self.emb(tokens).mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.5)


def _train_tokens(net, mode):
    return _train(net, mode, TOKENS)


def test_an_embedding_padding_row_gets_no_gradient_in_any_client():
    """``padding_idx``: the padding row is read, never trained. Under vmap torch's embedding backward kept the padding
    row's gradient at zero for the first client only; the engine's embedding leaves it out for every client, and
    vectorized training equals sequential training."""
    seq = _train_tokens(Tokens(), "sequential")
    vec = _train_tokens(Tokens(), "vectorized")
    assert torch.equal(seq["emb.weight"][0], torch.full((4,), 0.5, dtype=torch.float64))
    for k in seq:
        torch.testing.assert_close(vec[k], seq[k], rtol=1e-10, atol=1e-12, msg=k)


@pytest.mark.parametrize(
    "setting,named",
    [(dict(scale_grad_by_freq=True), "scale_grad_by_freq=True"), (dict(max_norm=1.0), "max_norm=1.0")],
)
def test_an_embedding_setting_vectorized_cannot_train_is_refused_and_auto_trains_sequentially(setting, named):
    """``scale_grad_by_freq`` divides each row's gradient by its count in the batch, which padded cells change;
    ``max_norm`` renormalises the looked-up rows in place in the weight every client shares (a later step's backward
    pass then failed with autograd's in-place error)."""
    with pytest.raises(VectorizationUnsupportedError, match=rf"layer 'emb' \(Embedding\) with {named}"):
        _train_tokens(Tokens(**setting), "vectorized")
    seq = _train_tokens(Tokens(**setting), "sequential")
    auto = _train_tokens(Tokens(**setting), "auto")
    for k in seq:
        assert torch.equal(auto[k], seq[k]), k


class ScaledEmbedding(torch.nn.Embedding):
    """An embedding subclass with its own ``forward`` (the transformer idiom: rows scaled by sqrt(d))."""

    def forward(self, tokens):
        return super().forward(tokens) * 2.0


class FunctionalTokens(Tokens):
    """The same lookups made another way than through ``nn.Embedding``'s own ``forward``: ``F.embedding`` in
    ``training_step`` (``how="functional"``), or a subclass with its own ``forward`` (``how="subclass"``)."""

    def __init__(self, how, max_norm=None):
        super().__init__()
        self.how, self.max_norm = how, max_norm
        if how == "subclass":
            weight = self.emb.weight.detach().clone()
            self.emb = ScaledEmbedding(9, 4, padding_idx=0, dtype=torch.float64)
            with torch.no_grad():
                self.emb.weight.copy_(weight)

    def training_step(self, batch, batch_idx):
        tokens, y = batch
        if self.how == "functional":
            rows = F.embedding(tokens, self.emb.weight, padding_idx=0, max_norm=self.max_norm)
        else:
            rows = self.emb(tokens)
        return F.cross_entropy(self.head(rows.mean(1)), y)


@pytest.mark.parametrize("how", ["functional", "subclass"])
def test_a_padding_row_looked_up_another_way_gets_no_gradient_either(how):
    """``F.embedding(..., padding_idx=0)`` in the module's code and an ``nn.Embedding`` subclass with its own
    ``forward`` reach torch's batching rule, which trained every client's padding row but the first's: the engine
    computes them as it computes the layers' own lookups, and vectorized training equals sequential training."""
    seq = _train_tokens(FunctionalTokens(how), "sequential")
    vec = _train_tokens(FunctionalTokens(how), "vectorized")
    assert torch.equal(seq["emb.weight"][0], torch.full((4,), 0.5, dtype=torch.float64))
    for k in seq:
        torch.testing.assert_close(vec[k], seq[k], rtol=1e-10, atol=1e-12, msg=k)


def test_a_functional_lookup_with_max_norm_is_refused_and_auto_trains_sequentially():
    """``F.embedding(..., max_norm=...)`` renormalises rows in place in the shared weight: refused by name (it
    ended in autograd's in-place error, which ``auto`` could not fall back from)."""
    with pytest.raises(VectorizationUnsupportedError, match=r"embedding looked up with max_norm=0\.5"):
        _train_tokens(FunctionalTokens("functional", max_norm=0.5), "vectorized")
    seq = _train_tokens(FunctionalTokens("functional", max_norm=0.5), "sequential")
    auto = _train_tokens(FunctionalTokens("functional", max_norm=0.5), "auto")
    for k in seq:
        assert torch.equal(auto[k], seq[k]), k


class Smoothed(pl.LightningModule):
    """Keeps a running average of its loss on ``self`` (a tensor attribute, not a buffer) and logs it."""

    def __init__(self, history=False):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(6, 2, dtype=torch.float64)
        self.ema, self.history = None, [] if history else None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(x), y)
        if self.history is not None:
            self.history.append(loss.detach())
        else:
            self.ema = loss.detach() if self.ema is None else 0.9 * self.ema + 0.1 * loss.detach()
            self.log("ema", self.ema)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("history", [False, True], ids=["self.ema = ...", "self.history.append(...)"])
def test_a_tensor_kept_on_the_module_is_refused_by_name_and_auto_trains_sequentially(history):
    """Each sequential client reads and writes its own value of the attribute; the clients in lockstep would leave
    one batched value there. The first batched call finds the write, puts the attribute back and refuses by name,
    so "auto" trains the module sequentially from the attribute as it was (its weights are sequential training's)."""
    name = "history" if history else "ema"
    with pytest.raises(VectorizationUnsupportedError, match=rf"stores tensors in the module's attributes \('{name}'\)"):
        _train(Smoothed(history), "vectorized")
    seq = _train(Smoothed(history), "sequential")
    auto = _train(Smoothed(history), "auto")
    for k in seq:
        assert torch.equal(auto[k], seq[k]), k


class CallCounter(pl.LightningModule):
    """Counts its training_step calls on ``self`` (a Python int) and anneals its loss with the count; or, with
    ``flag``, only sets a bool once (a one-time action), which leaves the same value in either mode."""

    def __init__(self, flag=False):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(6, 2, dtype=torch.float64)
        self.flag, self.calls, self.started, self.best = flag, 0, False, float("nan")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(x), y)
        if self.flag:
            self.started, self.best = True, float("nan")  # a flag, and a NaN set again: no change either
            return loss
        self.calls += 1
        return min(1.0, self.calls / 20) * loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_a_number_changed_on_the_module_is_refused_by_name_and_auto_trains_sequentially(partition):
    """Sequential clients call training_step once per local step; the clients in lockstep call it
    once per step for all of them, so a counter on the module would count other calls and anneal another loss.
    The first batched call finds the change, puts the counter back and refuses by name (with padded Dirichlet
    clients too, where the loss's dependence on the call count would otherwise be blamed on the loss not being a
    mean); "auto" trains sequentially, equal to sequential training bit for bit. A bool set once is not refused."""

    def train(net, mode):
        dm = FederatedDataModule.from_datasets(
            TensorDataset(X, Y),
            partition=Dirichlet(alpha=0.5) if partition == "dirichlet" else None,
            num_clients=8,
            batch_size=6,
            seed=0,
            val_fraction=0,
        )
        loop = FederatedLoop(net, local_steps=3, clients_per_round=4, seed=0, client_execution=mode)
        make_trainer(2).fit(loop, datamodule=dm)
        return {k: v.detach().clone() for k, v in net.state_dict().items()}

    with pytest.raises(VectorizationUnsupportedError, match=r"changes the number attributes 'calls' \(0 -> \d+\)"):
        train(CallCounter(), "vectorized")
    seq, got = train(CallCounter(), "sequential"), train(CallCounter(), "auto")
    for k in seq:
        assert torch.equal(got[k], seq[k]), k
    flagged_seq, flagged_vec = train(CallCounter(flag=True), "sequential"), train(CallCounter(flag=True), "vectorized")
    for k in flagged_seq:
        torch.testing.assert_close(flagged_vec[k], flagged_seq[k], rtol=1e-12, atol=1e-14)


class ReadsItsOptimizer(pl.LightningModule):
    """Scales its loss by the learning rate its client optimizer holds (``self.trainer.optimizers``), or reads the
    client schedulers (``self.trainer.lr_scheduler_configs``)."""

    def __init__(self, what="optimizers"):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(6, 2, dtype=torch.float64)
        self.what = what

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(x), y)
        if self.what == "optimizers":
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        else:
            lr = 0.5 if len(self.trainer.lr_scheduler_configs) == 1 else 1.0
        self.log("lr_seen", lr)
        return 10 * lr * loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}


@pytest.mark.parametrize("what", ["optimizers", "lr_scheduler_configs"])
def test_reading_the_trainers_optimizers_is_refused_by_name_and_auto_trains_sequentially(what):
    """A sequential client's training_step finds its own optimizer (lr 0.1, then 0.05 after the round's scheduler
    step) and schedulers on the trainer; the clients in lockstep have no single one to show (the server's SGD with lr
    1.0 was there), so the read refuses by name and "auto" trains sequentially, equal to sequential bit for bit."""
    with pytest.raises(
        VectorizationUnsupportedError, match=rf"training_step of ReadsItsOptimizer reads self\.trainer\.{what}"
    ):
        _train(ReadsItsOptimizer(what), "vectorized")
    seq, auto = _train(ReadsItsOptimizer(what), "sequential"), _train(ReadsItsOptimizer(what), "auto")
    for k in seq:
        assert torch.equal(auto[k], seq[k]), k


class WritesShared(pl.LightningModule):
    """Writes values that differ by client into a tensor every client shares: an EMA of the loss (a buffer of shape
    []), class counts (a buffer of shape [2]) or an EMA copy of its weights (parameters without gradient)."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(6, 2, dtype=torch.float64)
        self.kind = kind
        self.register_buffer("loss_ema", torch.zeros((), dtype=torch.float64))
        self.register_buffer("class_counts", torch.zeros(2, dtype=torch.float64))
        self.teacher = torch.nn.Linear(6, 2, dtype=torch.float64).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.head(x), y)
        if self.kind == "loss_ema":
            self.loss_ema.mul_(0.9).add_(0.1 * loss.detach())
        elif self.kind == "class_counts":
            self.class_counts += F.one_hot(y, 2).sum(0)
        else:
            self.teacher.weight.mul_(0.9).add_(0.1 * self.head.weight.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "kind,named",
    [
        ("loss_ema", r"'loss_ema' of shape \[\]"),
        ("class_counts", r"'class_counts'.* of shape \[2\]"),
        ("teacher", r"'teacher\.weight' of shape \[2, 6\]"),
    ],
)
def test_a_per_client_write_into_a_shared_tensor_names_it(kind, named):
    """Such a write fails under vmap with torch's "output with shape [...] doesn't match the broadcast shape";
    the refusal names the shared tensors of that shape and says what the write is, and "auto" trains sequentially,
    equal to sequential bit for bit."""
    with pytest.raises(VectorizationUnsupportedError, match=rf"in place into a tensor all clients share .*{named}"):
        _train(WritesShared(kind), "vectorized")
    seq, auto = _train(WritesShared(kind), "sequential"), _train(WritesShared(kind), "auto")
    for k in seq:
        assert torch.equal(auto[k], seq[k]), k
