import os
import warnings

import lightning.pytorch as pl
import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One thread by default (CI has 2 cores shared by everything). Kernels may sum in another order with more threads;
# the suite's float comparisons must hold either way (tests/numerics.py): FEDLIGHTNING_TEST_THREADS=2 checks that.
TEST_THREADS = int(os.environ.get("FEDLIGHTNING_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(autouse=True)
def _test_threads():
    """Every test starts with the suite's thread count: Lightning's DDP strategy on a CPU sets the process's torch
    threads to cores / processes and leaves them so, which made a later test compare a run in a subprocess (the
    suite's count) with one in this process (one thread) and differ in the last bits."""
    if torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)
    yield


warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def make_trainer(max_steps: int, callbacks=None, **kwargs) -> pl.Trainer:
    """A quiet trainer for federated tests: one step = one round. On the CPU unless ``FEDLIGHTNING_TEST_ACCELERATOR``
    names another accelerator (``gpu``: the tests built on this trainer then check the CUDA path, e.g. vectorized
    training equal to sequential training in float64 on the device; CI has no GPU and keeps the default)."""
    opts = dict(
        max_steps=max_steps,
        accelerator=os.environ.get("FEDLIGHTNING_TEST_ACCELERATOR", "cpu"),
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks or [],
    )
    opts.update(kwargs)
    return pl.Trainer(**opts)


@pytest.fixture
def trainer_factory():
    return make_trainer
