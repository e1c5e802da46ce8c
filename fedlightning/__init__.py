"""fedlightning: federated-learning research on PyTorch Lightning."""

from fedlightning.loop import FederatedLoop
from fedlightning.state import ClientStateStore, ClientUpdate, RoundPlan, RoundResult

__version__ = "0.1.0"
__all__ = ["FederatedLoop", "RoundPlan", "ClientUpdate", "RoundResult", "ClientStateStore", "__version__"]
