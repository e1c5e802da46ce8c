"""Server-side callbacks: strategies (aggregation + server step), schedules and telemetry."""

from fedlightning.callbacks.base import RoundStatistics, ServerStrategy
from fedlightning.callbacks.fedavg import FedAvg

__all__ = ["RoundStatistics", "ServerStrategy", "FedAvg"]
