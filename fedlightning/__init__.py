"""fedlightning: federated-learning research on PyTorch Lightning.

**W&B offline by default.** Importing ``fedlightning`` sets ``WANDB_MODE=offline`` when the user configured no
W&B mode or account (:func:`fedlightning.logging.wandb_mode` says "offline": no ``WANDB_MODE``, no
``WANDB_API_KEY``, no ``api.wandb.ai`` entry in ``~/.netrc``), so a ``WandbLogger`` works without network or
account from Python as from ``train.py`` (ours; offline runs are uploaded later with ``wandb sync``). It never
overrides a configured choice. To log online from Python without a key in the environment or ``~/.netrc`` (e.g.
``wandb.login(key=...)`` after the import), set ``WANDB_MODE=online`` as well.
"""

import os as _os

from fedlightning._reference import reference_mode, set_reference_mode
from fedlightning.loop import FederatedLoop
from fedlightning.state import ClientStateStore, ClientUpdate, RoundPlan, RoundResult
from fedlightning.vectorized import VectorizationUnsupportedError

__version__ = "0.1.0"
__all__ = ["FederatedLoop", "RoundPlan", "ClientUpdate", "RoundResult", "ClientStateStore",
           "VectorizationUnsupportedError", "reference_mode", "set_reference_mode", "__version__"]


def _default_wandb_offline(environ=None, netrc_path=None) -> bool:
    """Set ``WANDB_MODE=offline`` in ``environ`` (default ``os.environ``) when nothing is configured; True if set."""
    from fedlightning.logging import wandb_mode

    env = _os.environ if environ is None else environ
    if env.get("WANDB_MODE") or wandb_mode(env, netrc_path=netrc_path)["mode"] != "offline":
        return False
    env["WANDB_MODE"] = "offline"
    return True


_default_wandb_offline()
