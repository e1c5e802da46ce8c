"""Client optimizers (torch.optim.Optimizer subclasses) with per-step telemetry."""

__all__: list = []
