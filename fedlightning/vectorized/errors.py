"""The error of the vectorised engine: what it cannot train (:class:`VectorizationUnsupportedError`).

Every module of the engine raises it, :mod:`fedlightning.vectorized.torch_internals` included, so it has a module
of its own below them all; :mod:`fedlightning.vectorized.support` (which says what the engine refuses) and the
package re-export it.
"""

__all__ = ["VectorizationUnsupportedError"]


class VectorizationUnsupportedError(ValueError):
    """The model, optimizer or data cannot be trained with ``client_execution="vectorized"``."""
