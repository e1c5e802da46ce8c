"""fedlightning: federated-learning research on PyTorch Lightning.

**W&B offline by default.** Importing ``fedlightning`` sets ``WANDB_MODE=offline`` when the user configured no
W&B mode or account (:func:`fedlightning.logging.default_wandb_offline`, when :func:`fedlightning.logging.wandb_mode`
says "offline": no ``WANDB_MODE``, no ``WANDB_API_KEY``, no ``api.wandb.ai`` entry in ``~/.netrc``), so a
``WandbLogger`` works without network or account from Python as from ``train.py`` (ours; offline runs are uploaded later
with ``wandb sync``). It never overrides a configured choice. To log online from Python without a key in the environment
or ``~/.netrc`` (e.g. ``wandb.login(key=...)`` after the import), set ``WANDB_MODE=online`` as well.
"""

from fedlightning._reference import reference_mode, set_reference_mode
from fedlightning.logging import default_wandb_offline
from fedlightning.loop import FederatedLoop
from fedlightning.state import ClientStateStore, ClientUpdate, RoundPlan, RoundResult
from fedlightning.vectorized import VectorizationUnsupportedError

__version__ = "0.1.0"
__all__ = [
    "FederatedLoop",
    "RoundPlan",
    "ClientUpdate",
    "RoundResult",
    "ClientStateStore",
    "VectorizationUnsupportedError",
    "reference_mode",
    "set_reference_mode",
    "__version__",
]


default_wandb_offline()
