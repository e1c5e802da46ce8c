"""Client optimizers (torch.optim.Optimizer subclasses) with per-step telemetry.

* :class:`SgdArmijo` — SGD with stochastic Armijo line search (Vaswani et al. 2019; FedSLS/FedExpSLS, seed 000).
* :class:`SPS` — stochastic Polyak step SPS_max, optionally with the smoothed cap (Loizou et al. 2021; FedSPS,
  seed 001).
* :class:`DecSPS` — decreasing SPS (Orvieto et al. 2022; FedDecSPS, seed 001).
* :class:`MimeSGD`, :class:`MimeLiteSGD` — the client steps of Mime / MimeLite (Karimireddy et al. 2021): SGD with
  the server's momentum frozen (and Mime's SVRG correction); built by :class:`fedlightning.callbacks.Mime` /
  :class:`~fedlightning.callbacks.MimeLite` from the user's SGD.
* :class:`AdaAlterClient`, :class:`AMSGradClient` — the client steps of Local AdaAlter (Xie et al. 2019) and Local
  AMSGrad (Chen et al. 2020), whose statistics :class:`fedlightning.callbacks.LocalAdaAlter` /
  :class:`~fedlightning.callbacks.LocalAMSGrad` synchronise (``set_server_state`` / ``client_report``).

SgdArmijo, SPS and DecSPS use the closure convention of the reference Sls code: ``opt.zero_grad();
loss = opt.step(closure)`` (the closure only returns the mini-batch loss), work in any PyTorch loop and in the
:class:`~fedlightning.FederatedLoop`, report ``last_step`` after each step and keep per-client state through
``get_client_state`` / ``set_client_state``.
Their batched forms for ``client_execution="vectorized"`` live in :mod:`fedlightning.vectorized.rules`, which maps
these classes to them (this package never imports the engine, which sits above it); the step-size rules of both
forms are written once, in :mod:`fedlightning.optim.rules`.

:func:`scale_client_step` multiplies a client optimizer's step size by the round's ``client_lr_scale`` (η-decay
schedules, FedSPS-Global): ``scale_step`` of these three optimizers (each applies ``scale`` times its rule's step),
the param groups' ``lr`` of ``torch.optim`` optimizers, and a ValueError naming any other optimizer.
"""

from fedlightning.optim._common import check_client_step_scalable, scale_client_step, step_hooks
from fedlightning.optim.armijo import SgdArmijo
from fedlightning.optim.local_adaptive import AdaAlterClient, AMSGradClient
from fedlightning.optim.mime import MimeLiteSGD, MimeSGD
from fedlightning.optim.sps import SPS, DecSPS

__all__ = [
    "SgdArmijo",
    "SPS",
    "DecSPS",
    "MimeSGD",
    "MimeLiteSGD",
    "AdaAlterClient",
    "AMSGradClient",
    "scale_client_step",
    "check_client_step_scalable",
    "step_hooks",
]
