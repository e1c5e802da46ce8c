"""The client optimizers and server strategies the shared tests run, each once, by name, with its settings.

The equivalence tests (vectorised vs sequential clients, reference mode, a reused vs a fresh client optimizer), the
resume tests and the vectorised engine's tests take their cases from here, so a new optimizer or strategy joins all
of them by one entry, and one name always means the same settings.

* ``CLIENT_OPTIMIZERS[name](params)`` builds the client optimizer (a ``client_optimizer`` factory);
* ``STRATEGIES[name]()`` builds the server strategy (or client-objective callback);
* ``case.but(**settings)``: the same case with some settings replaced (a test's own variation, spelled out);
* ``params(registry, *names)``: one ``pytest.param`` per name, with the name as its id.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from fedlightning.callbacks import (
    FedAdagrad,
    FedAdam,
    FedAMS,
    FedAvg,
    FedAvgM,
    FedDANE,
    FedExP,
    FedLiLU,
    FedYogi,
    ProximalTerm,
    Scaffold,
)
from fedlightning.optim import SPS, DecSPS, SgdArmijo


@dataclass(frozen=True, eq=False)
class Case:
    """``factory(*args, **settings)``."""

    factory: Callable[..., Any]
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, *args: Any) -> Any:
        return self.factory(*args, **self.settings)

    def but(self, **settings: Any) -> "Case":
        return Case(self.factory, {**self.settings, **settings})

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"{getattr(self.factory, '__name__', self.factory)}({args})"


CLIENT_OPTIMIZERS: dict[str, Case] = {
    "sgd": Case(torch.optim.SGD, {"lr": 0.3}),
    "sgd-lr0.5": Case(torch.optim.SGD, {"lr": 0.5}),
    "sgd+wd": Case(torch.optim.SGD, {"lr": 0.3, "weight_decay": 0.01}),
    "sgd-momentum": Case(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "sgd-momentum+wd": Case(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    "adam": Case(torch.optim.Adam, {"lr": 1e-2}),
    # SgdArmijo: the search grid eta_max·beta^m
    "armijo": Case(SgdArmijo, {"eta_max": 4.0, "beta": 0.7}),
    "armijo-default": Case(SgdArmijo),  # eta_max=1, c=0.1, beta=0.9
    "armijo-eta2": Case(SgdArmijo, {"eta_max": 2.0}),
    "armijo-eta4": Case(SgdArmijo, {"eta_max": 4.0}),
    "armijo-grow-carry": Case(SgdArmijo, {"eta_max": 4.0, "reset": "grow", "carry_step_size": True}),
    "armijo-last-carry": Case(SgdArmijo, {"eta_max": 4.0, "beta": 0.7, "reset": "last", "carry_step_size": True}),
    # searches that run out of grid points (recorded step 0)
    "armijo-exhausted": Case(SgdArmijo, {"eta_max": 1e4, "beta": 0.5, "max_backtracks": 12, "reset": "last"}),
    "sps": Case(SPS, {"polyak_c": 0.5, "gamma_max": 2.0}),
    "sps-default": Case(SPS),
    "sps-smooth": Case(SPS, {"smooth": True}),
    "sps-fixed": Case(SPS, {"fixed_step_size": 0.3}),  # FedSPS-Global's clients: a fixed step, the SPS step reported
    "decsps": Case(DecSPS, {"c0": 0.5, "gamma_max": 2.0}),
    "decsps-gamma1": Case(DecSPS, {"c0": 0.5, "gamma_max": 1.0}),
    "decsps-default": Case(DecSPS),
}

STRATEGIES: dict[str, Case] = {
    "fedavg": Case(FedAvg),
    "fedexp": Case(FedExP, {"eps": 1e-3}),
    "fedexp-average": Case(FedExP, {"evaluate_iterate_average": True}),
    "fedadam": Case(FedAdam, {"server_lr": 0.05}),
    "fedyogi": Case(FedYogi, {"server_lr": 0.05}),
    "fedadagrad": Case(FedAdagrad, {"server_lr": 0.05}),
    "fedams": Case(FedAMS, {"server_lr": 0.05}),
    "fedavgm": Case(FedAvgM),
    "fedlilu": Case(FedLiLU, {"lr": 1.0}),
    "scaffold": Case(Scaffold),
    "feddane": Case(FedDANE, {"mu": 0.1}),
    "proximal": Case(ProximalTerm, {"mu": 0.1}),
}


def params(registry: Mapping[str, Case], *names: str) -> list:
    """``pytest.param(registry[name], id=name)`` for each name."""
    return [pytest.param(registry[name], id=name) for name in names]
