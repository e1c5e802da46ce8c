"""Vectorised client execution: ``FederatedLoop(client_execution="vectorized")`` trains a round's clients in lockstep.

The clients' weights are one ``[C, D]`` tensor and their losses one ``torch.func.vmap`` call of the model's own
``training_step``, on the same batches as sequential training, giving the same updates, BatchNorm running statistics and
torchmetrics values (float rounding apart; dropout masks differ, reproducibly). It applies to models without per-step
hook overrides or ``SyncBatchNorm``, with ``torch.optim.SGD`` (momentum included), ``Adam`` or ``AdamW`` clients, or
clients whose optimizer class names a batched form (:class:`BatchedRule`: SgdArmijo, SPS, DecSPS, AMSGradClient,
AdaAlterClient, MimeSGD, MimeLiteSGD, and user optimizers that opt in); anything else raises
:class:`VectorizationUnsupportedError` naming the layer, metric, optimizer or setting. ``client_execution="auto"`` times
one round both ways and trains vectorised only when that is :data:`AUTO_MARGIN` times faster, falling back to sequential
on anything unsupported. Modules on padded steps (clients' batches of unequal size) are fastest with
``training_step_per_sample`` or a standard mean loss (:mod:`fedlightning.vectorized.losses`). Client-objective terms
written as :class:`fedlightning.objectives.AnchoredTerm` (FedProx, FedExProx, SCAFFOLD, FedDANE) are stacked over the
clients and their gradients added in closed form; any other term callable is evaluated client by client, said once. The
README's "Vectorised clients" paragraph is the user guide; docs/benchmarks.md §3 has the speed-ups and their commands;
the engine's decisions are in the docstrings of :mod:`~fedlightning.vectorized.engine` and the modules beside it.
"""

# Relative imports inside this package let benchmarks/engine_ab.py load another version of it beside this one. Each
# module's __all__ lists the names the engine's other modules import from it; underscored names are the engine's
# internals, not fedlightning's API (the public names are the ones below).
from .auto import AUTO_MARGIN, VectorizedRun, auto_choice, run_vectorized_round
from .engine import VectorizedClientTrainer
from .rules import BatchedRule, StepRecord, make_batched_rule
from .support import VectorizationUnsupportedError, check_model_vectorizable

__all__ = [
    "AUTO_MARGIN",
    "BatchedRule",
    "VectorizationUnsupportedError",
    "VectorizedClientTrainer",
    "VectorizedRun",
    "auto_choice",
    "check_model_vectorizable",
    "make_batched_rule",
    "run_vectorized_round",
    "StepRecord",
]
