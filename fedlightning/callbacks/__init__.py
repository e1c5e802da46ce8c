"""Server-side callbacks: strategies (aggregation + server step), schedules and telemetry."""

from fedlightning.callbacks.adaptive import FedAdagrad, FedAdam, FedAMS, FedAvgM, FedYogi
from fedlightning.callbacks.base import FederatedCallback, RoundStatistics, ServerStep, ServerStrategy
from fedlightning.callbacks.client_eval import ClientEvaluation
from fedlightning.callbacks.dp import DPFedAvg
from fedlightning.callbacks.fedavg import FedAvg
from fedlightning.callbacks.feddane import FedDANE
from fedlightning.callbacks.fedexp import FedExP
from fedlightning.callbacks.fedexprox import FedExProx
from fedlightning.callbacks.fedli import FedLiLS, FedLiLU
from fedlightning.callbacks.kdecay import KDecay, RuntimeModel
from fedlightning.callbacks.local_adaptive import LocalAdaAlter, LocalAMSGrad
from fedlightning.callbacks.mime import Mime, MimeLite
from fedlightning.callbacks.proximal import ProximalTerm
from fedlightning.callbacks.scaffold import Scaffold
from fedlightning.callbacks.sps_variants import FedSPSGlobal, FedSPSNormalized
from fedlightning.callbacks.telemetry import GlobalEvaluation, RoundTimer

__all__ = [
    "FederatedCallback",
    "RoundStatistics",
    "ServerStep",
    "ServerStrategy",
    "FedAvg",
    "FedExP",
    "FedExProx",
    "FedAdam",
    "FedYogi",
    "FedAdagrad",
    "FedAMS",
    "FedAvgM",
    "DPFedAvg",
    "FedLiLS",
    "FedLiLU",
    "Scaffold",
    "FedDANE",
    "Mime",
    "MimeLite",
    "LocalAdaAlter",
    "LocalAMSGrad",
    "ProximalTerm",
    "KDecay",
    "RuntimeModel",
    "FedSPSGlobal",
    "FedSPSNormalized",
    "RoundTimer",
    "GlobalEvaluation",
    "ClientEvaluation",
]
