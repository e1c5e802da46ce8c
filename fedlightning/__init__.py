"""fedlightning: federated-learning research on PyTorch Lightning."""

from fedlightning.loop import FederatedLoop
from fedlightning.state import ClientStateStore, ClientUpdate, RoundPlan, RoundResult
from fedlightning.vectorized import VectorizationUnsupportedError

__version__ = "0.1.0"
__all__ = ["FederatedLoop", "RoundPlan", "ClientUpdate", "RoundResult", "ClientStateStore",
           "VectorizationUnsupportedError", "__version__"]
