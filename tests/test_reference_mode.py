"""Reference mode (FEDLIGHTNING_REFERENCE=1 / fedlightning.set_reference_mode): every fast path off, same results.

* a run in reference mode gives the weights of the same run with the fast paths (float64 runs, to numerics.RTOL64)
  for several configurations, and the fast paths really ran in one and not in the other (spies on each);
* the switch is read from the environment variable unless set_reference_mode overrides it; bad values are refused.
"""

import pytest
import torch
from torch.utils.data import TensorDataset

import fedlightning
import fedlightning.client as client_module
from conftest import make_trainer
from fedlightning import FederatedLoop, reference_mode, set_reference_mode
from fedlightning.datamodules import Dirichlet, FederatedDataModule
from fedlightning.datamodules.base import ArrayBatchLoader, ArrayDataset
from fedlightning.models import MLP
from numerics import Digits64, assert_close64, flat, to_float64
from registry import CLIENT_OPTIMIZERS, STRATEGIES


@pytest.fixture(autouse=True)
def _environment_decides(monkeypatch):
    monkeypatch.delenv("FEDLIGHTNING_REFERENCE", raising=False)
    set_reference_mode(None)
    yield
    set_reference_mode(None)


class Spies:
    """Counts the fast paths a run takes."""

    def __init__(self, monkeypatch):
        self.counts = {
            "plain_sgd_step": 0,
            "iter_steps": 0,
            "array_batch_loader": 0,
            "feddane_whole_batches": 0,
            "gather_on_device": 0,
        }
        plain_step = client_module._plain_sgd_step
        iter_steps, loader_init = ArrayBatchLoader.iter_steps, ArrayBatchLoader.__init__
        on_device = ArrayDataset.on_device

        def count(key, fn):
            def wrapped(*args, **kwargs):
                self.counts[key] += 1
                return fn(*args, **kwargs)

            return wrapped

        monkeypatch.setattr(client_module, "_plain_sgd_step", count("plain_sgd_step", plain_step))
        monkeypatch.setattr(ArrayBatchLoader, "iter_steps", count("iter_steps", iter_steps))
        monkeypatch.setattr(ArrayBatchLoader, "__init__", count("array_batch_loader", loader_init))
        monkeypatch.setattr(ArrayDataset, "on_device", count("gather_on_device", on_device))
        full_loader = FederatedDataModule.client_full_dataloader

        def feddane_loader(dm, *args, **kwargs):
            loader = full_loader(dm, *args, **kwargs)
            if type(loader) is ArrayBatchLoader:  # whole batches by tensor indexing
                self.counts["feddane_whole_batches"] += 1
            return loader

        monkeypatch.setattr(FederatedDataModule, "client_full_dataloader", feddane_loader)


def digits():
    return Digits64(num_clients=20, batch_size=16, partition=Dirichlet(0.5), seed=0)


def generic_digits():
    dm = digits()
    dm.setup("fit")
    x, y = dm.train_dataset.x, dm.train_dataset.y
    return FederatedDataModule.from_datasets(
        TensorDataset(x.clone(), y.clone()), num_clients=20, batch_size=16, partition=Dirichlet(0.5), seed=0
    )


OPT, STRAT = CLIENT_OPTIMIZERS, STRATEGIES
CONFIGS = {
    # plain SGD: the one-_foreach_add_ step, dropped gradients, the reused optimizer, the in-memory loader
    "sgd": dict(optimizer=OPT["sgd"], callbacks=[STRAT["fedavg"]]),
    # momentum SGD reused between clients (reset to fresh state), FedExP server
    "sgd-momentum-fedexp": dict(optimizer=OPT["sgd-momentum"], callbacks=[STRAT["fedexp"]]),
    # a line search with a proximal term: the closure path either way
    "armijo-prox": dict(optimizer=OPT["armijo"], callbacks=[STRAT["fedavg"], STRAT["proximal"]]),
    # FedDANE's gradient phase reads whole client data sets
    "feddane": dict(optimizer=OPT["sgd"], callbacks=[STRAT["feddane"]]),
    # the vectorised engine against sequential reference clients
    "vectorized": dict(optimizer=OPT["sgd"], callbacks=[STRAT["fedavg"]], execution="vectorized"),
    # DatasetDataModule, in_memory="auto": materialised, or per-sample in reference mode
    "generic-data": dict(optimizer=OPT["sgd"], callbacks=[STRAT["fedavg"]], dm=generic_digits),
}


def fit(config, reference, rounds=3):
    set_reference_mode(reference)
    try:
        torch.manual_seed(0)
        model = to_float64(MLP(input_dim=64, hidden=[16]))
        loop = FederatedLoop(
            model,
            client_optimizer=config["optimizer"],
            local_steps=4,
            clients_per_round=5,
            seed=1,
            client_execution=config.get("execution", "sequential"),
        )
        dm = config.get("dm", digits)()
        make_trainer(rounds, callbacks=[make() for make in config["callbacks"]]).fit(loop, datamodule=dm)
    finally:
        set_reference_mode(None)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), loop, dm


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_run_equals_the_fast_run(name, monkeypatch):
    config = CONFIGS[name]
    spies = Spies(monkeypatch)
    fast, fast_loop, fast_dm = fit(config, reference=False)
    fast_counts = dict(spies.counts)
    spies.counts = dict.fromkeys(spies.counts, 0)
    ref, ref_loop, ref_dm = fit(config, reference=True)
    torch.manual_seed(0)
    start = flat(to_float64(MLP(input_dim=64, hidden=[16])))
    assert (fast - start).abs().max() > 1e-2  # the runs trained
    assert_close64(ref, fast)

    assert not any(spies.counts.values()), spies.counts  # reference mode took no fast path
    assert ref_loop._runtime.reusable_client_opt is None and ref_loop.vectorized_engine is None
    set_reference_mode(True)
    assert ref_loop.client_execution_choice == fast_loop.client_execution_choice == "sequential"
    set_reference_mode(None)
    # ... which the same run without it did take
    if name == "vectorized":  # in-memory client data gathered by index on the model's device, without loaders
        assert fast_counts["gather_on_device"] > 0 and fast_counts["array_batch_loader"] == 0
    else:
        assert fast_counts["array_batch_loader"] > 0
    if name in ("sgd", "sgd-momentum-fedexp", "feddane", "generic-data"):
        assert fast_loop._runtime.reusable_client_opt is not None
    if name in ("sgd", "feddane", "generic-data"):
        assert fast_counts["plain_sgd_step"] > 0 and fast_counts["iter_steps"] > 0
    if name == "feddane":
        assert fast_counts["feddane_whole_batches"] > 0
    if name == "vectorized":
        assert fast_loop.vectorized_engine is not None and fast_loop.client_execution_choice == "vectorized"
    if name == "generic-data":
        assert fast_dm.in_memory is True and ref_dm.in_memory is False


@pytest.mark.parametrize(
    "value,want", [("1", True), ("true", True), ("On", True), ("0", False), ("", False), ("no", False)]
)
def test_environment_variable(monkeypatch, value, want):
    monkeypatch.setenv("FEDLIGHTNING_REFERENCE", value)
    assert reference_mode() is want
    set_reference_mode(not want)  # the call wins over the variable ...
    assert reference_mode() is (not want)
    set_reference_mode(None)  # ... until reset
    assert reference_mode() is want


def test_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_REFERENCE", "maybe")
    with pytest.raises(ValueError, match="FEDLIGHTNING_REFERENCE=.*'maybe'"):
        reference_mode()
    with pytest.raises(ValueError, match="FEDLIGHTNING_REFERENCE"):  # at construction, before any training
        FederatedLoop(MLP(input_dim=64, hidden=[16]))
    with pytest.raises(TypeError, match="got 1"):
        fedlightning.set_reference_mode(1)
