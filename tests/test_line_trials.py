"""A line search's trial rows through linear layers that read the batch (``vectorized/trials.py``).

The batched Armijo search hands ``_StepEvaluator.trial`` the line its points lie on; a linear layer whose input is
the batch (or a view of it) then computes its trial rows as ``A_c − η B_c`` from two products per client and step.
Checked in float64 against the same trial call without the line (every layer through its batched product), call by
call, and the whole run against sequential training, for models where it applies (a flatten in front), where it must
not (a transformed input, a layer applied twice: only its first use reads the batch) and where something else reads
the same weights (a penalty in ``training_step``: the points are still there for it).
"""

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedlightning.vectorized.layout as layout_module
import fedlightning.vectorized.step as step_module
import fedlightning.vectorized.trials as trials_module
from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import ArrayDataset, FederatedDataModule
from fedlightning.optim import SgdArmijo

SIZES = [9, 14, 6, 11]


class Clients(FederatedDataModule):
    """Four clients of 8×8 float64 inputs with 3 classes: the default IID split of 36 training samples (9 per client,
    batches of 5 then 4, every client's batch of one size at each step)."""

    def __init__(self):
        super().__init__(num_clients=len(SIZES), batch_size=5)

    def load(self):
        g = torch.Generator().manual_seed(0)
        n = sum(SIZES)
        x = torch.randn(n, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (n,), generator=g)
        data = ArrayDataset(x, y)
        return data, data, np.repeat(np.arange(len(SIZES)), SIZES)


class Net(pl.LightningModule):
    """Flatten, Linear(64, 12), ReLU, Linear(12, 3) in float64; ``variant`` changes what reads the batch or the
    first layer's weights."""

    def __init__(self, variant: str):
        super().__init__()
        torch.manual_seed(1)
        self.variant = variant
        self.first = nn.Linear(64, 12 if variant != "tied" else 64)
        self.twice = nn.Linear(64, 64) if variant == "tied" else None
        self.head = nn.Linear(12 if variant != "tied" else 64, 3)
        self.double()

    def forward(self, x):
        h = x.flatten(1)  # a view of the batch
        if self.variant == "scaled":
            h = h * 0.5  # a new tensor: the first layer no longer reads the batch
        h = F.relu(self.first(h))
        if self.variant == "tied":
            h = F.relu(self.first(h))  # the same layer on an input that is not the batch
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.variant == "penalty":  # reads the first layer's weights outside the layer
            loss = loss + 0.05 * (self.first.weight**2).sum()
        if self.variant == "mask":  # reads them through a comparison, which turns NaN into False
            loss = loss + 0.1 * (self.first.weight > 0).to(loss.dtype).mean()
        if self.variant == "readx":  # reads the batch outside the first layer
            loss = loss + 0.01 * x.square().mean()
        if self.variant == "xmask":  # reads the batch through a comparison
            loss = loss + 0.1 * (x > 0).to(loss.dtype).mean() * loss
        return loss


def fit(variant: str, mode: str, spy=None, monkeypatch=None, accelerator="cpu"):
    if spy is not None:
        monkeypatch.setattr(step_module._StepEvaluator, "trial", spy)
    model = Net(variant)
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: SgdArmijo(p, eta_max=4.0, beta=0.7, c=0.3, max_backtracks=12),
        local_steps=3,
        clients_per_round=len(SIZES),
        seed=0,
        client_execution=mode,
    )
    make_trainer(2, callbacks=[FedAvg()], accelerator=accelerator).fit(loop, datamodule=Clients())
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


@pytest.mark.parametrize(
    "variant, served, blocks, skips, blanks",
    [
        ("plain", True, True, True, True),
        ("plain", True, False, True, True),
        ("penalty", True, True, False, False),
        ("mask", True, True, False, False),
        ("readx", True, True, True, False),
        ("xmask", True, True, True, False),
        ("scaled", False, True, False, False),
        ("tied", True, True, False, False),
    ],
)
def test_trial_rows_on_lines_equal_the_batched_products(variant, served, blocks, skips, blanks, monkeypatch):
    """``blocks=False``: the rows gathered (the accelerators' path), on this CPU. ``skips``: whether trial calls go on
    leaving out the points of the first layer, which only the rows computed from A and B need: "tied" reads its
    weights in another layer (never left out); "penalty" and "mask" read them in ``training_step``, which the check
    of the round's first such call finds (the loss differs), and the engine writes every point from then on.
    ``blanks``: whether they go on passing NaN rows for the batch, which only the first layer reads: "readx" reads it
    in another layer (the loss turns NaN) and "xmask" through a comparison (the loss differs); the check switches
    that off, and the points stay left out."""
    if not blocks:
        monkeypatch.setattr(trials_module, "_BLOCK_DEVICES", ())
    trial = step_module._StepEvaluator.trial
    seen = {"calls": 0, "served": 0, "skipped": 0, "skipping": [], "blanking": [], "gathered": 0}
    rows = layout_module._Layout.rows

    def gathering(self, clients, scratch, blank=frozenset()):
        seen["gathered"] += 0 not in blank  # leaf 0: the inputs
        return rows(self, clients, scratch, blank)

    monkeypatch.setattr(layout_module._Layout, "rows", gathering)

    def spy(self, points, clients=None, line=None):
        assert line is not None  # the batched Armijo search always hands the line
        full = torch.addcmul(line.W[clients], line.g[clients], line.neg_eta.unsqueeze(1))  # every point written
        expected = trial(self, full, clients)  # every layer through its products
        # the gradient evaluation kept the outputs of the layers that read the batch (A), none of the others
        assert len(self.line_trials._A) == (1 if served else 0)
        before = self.line_trials.served
        got = trial(self, points, clients, line)
        seen["calls"] += 1
        seen["served"] += self.line_trials.served - before
        seen["skipped"] += bool(line.skipped)
        seen["skipping"].append(self.engine.skip_line_points)
        seen["blanking"].append(self.engine.skip_line_leaves)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        return got

    vectorized = fit(variant, "vectorized", spy, monkeypatch)
    assert seen["calls"] > 0
    # one served layer call per trial call where the first layer reads the batch ("tied": its first use only); a
    # checked call is evaluated twice
    assert seen["served"] >= (seen["calls"] if served else 0)
    if skips:
        assert seen["skipped"] == seen["calls"] and all(seen["skipping"])
    elif variant in ("penalty", "mask"):
        assert seen["skipping"][0] is False and seen["skipped"] == 1  # the first call's check switched it off
    else:
        assert seen["skipped"] == 0
    # the spy's reference evaluations gather every leaf (no line); the engine's own calls gather the inputs only
    # where they are not left out, and the first checked call gathers them for its check
    if blanks:
        assert all(seen["blanking"]) and seen["gathered"] == seen["calls"] + 2  # the check of each of the 2 rounds
    else:
        assert seen["gathered"] >= 2 * seen["calls"]
    if variant in ("readx", "xmask"):
        assert seen["blanking"][0] is False  # the first call's check switched it off
    monkeypatch.undo()
    torch.testing.assert_close(vectorized, fit(variant, "sequential"), rtol=0, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["plain", "penalty", "tied"])
def test_trial_rows_on_cuda_equal_sequential(variant):
    """On a GPU the trial rows are gathered (no per-client blocks) and the points' leaving-out and its check run on
    the device: float64 vectorized equals float64 sequential on the same GPU, and both equal the CPU run."""
    on_gpu = fit(variant, "vectorized", accelerator="gpu")
    torch.testing.assert_close(on_gpu, fit(variant, "sequential", accelerator="gpu"), rtol=0, atol=1e-10)
    torch.testing.assert_close(on_gpu, fit(variant, "sequential"), rtol=0, atol=1e-10)


def test_blank_rows_stay_nan_whatever_writes_into_them():
    """The NaN rows that trial calls pass for a left-out batch leaf come from a reusable buffer filled once: a write
    into it (a model changing its input in place) is undone before the next call, and a grown buffer is NaN too."""
    from types import SimpleNamespace

    from fedlightning.vectorized import VectorizedClientTrainer

    engine = SimpleNamespace(_scratch={}, _filled={})

    def blank(rows):
        return VectorizedClientTrainer.scratch(engine, "blank", (rows, 4), torch.float64, torch.device("cpu"), 0.5)

    first = blank(3)
    assert (first == 0.5).all()
    first[1, 2] = 7.0
    first.zero_()
    assert (blank(2) == 0.5).all() and (first == 0.5).all()  # the same buffer, filled again
    assert (blank(9) == 0.5).all()  # grown: a new buffer
    plain = VectorizedClientTrainer.scratch(engine, "blank", (2, 4), torch.float64, torch.device("cpu"))
    plain.fill_(1.0)  # a caller without fill: the buffer as it is
    assert (blank(2) == 0.5).all()


class SmallClients(Clients):
    """A natural split of SIZES samples (9, 13, 6 and 10 after the validation hold-out) in batches of 16: a step's
    padded batch is as large as the round's largest sampled client, which changes from round to round."""

    def __init__(self):
        FederatedDataModule.__init__(self, num_clients=len(SIZES), batch_size=16)

    def natural_clients(self):
        return np.split(np.arange(sum(SIZES)), np.cumsum(SIZES)[:-1])


def test_trial_rows_reuse_one_buffer_whatever_the_padded_batch_size(monkeypatch):
    """The trial rows of the layer that reads the batch live in one reusable buffer however many padded batch sizes
    the run meets (one per size stayed allocated before: memory that grew with every new size), with the weights
    still those of sequential training."""
    sizes = set()
    linear = trials_module._LineTrials._linear

    def spy(self, x, W, b):
        sizes.add(tuple(x.shape[1:]))
        return linear(self, x, W, b)

    monkeypatch.setattr(trials_module._LineTrials, "_linear", spy)

    def run(mode):
        model = Net("plain")
        loop = FederatedLoop(
            model,
            client_optimizer=lambda p: SgdArmijo(p, eta_max=4.0, beta=0.7, c=0.3, max_backtracks=12),
            local_steps=2,
            clients_per_round=2,
            seed=3,
            client_execution=mode,
        )
        make_trainer(8, callbacks=[FedAvg()]).fit(loop, datamodule=SmallClients())
        return loop, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    loop, vectorized = run("vectorized")
    assert len(sizes) >= 3  # padded batches of several sizes met the layer
    keys = [k for k in loop.vectorized_engine._scratch if k[0] in ("line rows", "line B rows")]
    assert len(keys) <= 2 and len({k[0] for k in keys}) == len(keys)
    torch.testing.assert_close(vectorized, run("sequential")[1], rtol=0, atol=1e-10)
