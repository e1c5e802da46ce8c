r"""Client-objective terms with a batched form: :class:`AnchoredTerm`, the quadratic-plus-linear term

.. math::
    h(w) = \frac{\mu}{2}\,\lVert w - a\rVert^2 + \langle c,\; w - a\rangle ,
    \qquad \nabla h(w) = \mu\,(w - a) + c ,

that FedProx (Li et al., MLSys 2020: ``a = w_t``, ``c = 0``), SCAFFOLD (Karimireddy et al., ICML 2020:
``μ = 0``, ``c = c − c_i``), FedExProx (Li, Acharya & Richtárik, NeurIPS 2024: as FedProx) and FedDANE (Li et al.,
Asilomar 2019: ``c = g_t − ∇F_k(w_t)``, any ``μ``) add to a client's loss.

One term is written once for one client or a batch of clients, as :mod:`fedlightning.optim.rules` writes each
step-size rule once: a term built for one client (its anchors shaped like the model's trainable parameters) is
called on one client's parameters (a scalar) or on parameters with a leading client dimension ``[C, *shape]`` (one
value per row, ``[C]``; the same term for every row); :meth:`AnchoredTerm.stack` turns the terms of ``C`` clients
into one batched term (anchors shared when the clients' anchors are the same tensors, else ``[C, *shape]``;
``μ`` one number or ``[C]``; directions ``[C, *shape]``), evaluated on ``[C, *shape]`` parameters in one call.

A client-objective hook (``FederatedCallback.client_objective``) may return any callable ``f(params) -> Tensor``;
vectorised training stacks the :class:`AnchoredTerm` ones per engine call and evaluates any other callable client
by client (see :mod:`fedlightning.vectorized.call`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["AnchoredTerm", "real_products", "squared_magnitudes", "term_value"]


def term_value(term, params: Sequence[Tensor]) -> Tensor:
    """``term(params)``, a client-objective term's value for one client: a tensor of one element (returned as a
    scalar) or a number (a constant, in the parameters' dtype); anything else is an error naming the term, raised
    before it reaches the backward pass."""
    value = term(params)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # a constant: no gradient
        return params[0].new_tensor(float(value))
    if not isinstance(value, Tensor) or value.numel() != 1:
        got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        name = getattr(term, "__qualname__", type(term).__qualname__)
        raise ValueError(
            f"the client-objective term {name} returned {got}; a term must return a scalar tensor (one value added "
            "to the client's loss), e.g. a sum over the parameters"
        )
    return value.reshape(())


def _same_tensors(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    """Whether two lists hold the same tensors: identical objects, or views of one memory with one layout (each
    ``global_anchors`` call returns new detached views of the same global parameters)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if (
            x.data_ptr() != y.data_ptr()
            or x.shape != y.shape
            or x.stride() != y.stride()
            or x.dtype != y.dtype
            or x.device != y.device
        ):
            return False
    return True


def _row_dot(x: Tensor, y: Tensor) -> Tensor:
    """``[R]``: the inner products of the rows of ``x`` and ``y`` (``y`` may lack the row dimension)."""
    if x.dim() == 2 and y.dim() <= 2:
        return torch.linalg.vecdot(x, y.expand_as(x)) if y.dim() == 1 else torch.linalg.vecdot(x, y)
    return (x * y).sum(dim=tuple(range(1, x.dim())))


def _row_sq_norm(x: Tensor) -> Tensor:
    """``[R]``: the squared Euclidean norms of the rows of ``x`` (one pass over ``x``)."""
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim()))) ** 2


def squared_magnitudes(d: Tensor) -> Tensor:
    """``d²`` elementwise; ``|d|²`` for a complex ``d`` (a real penalty on complex parameters)."""
    return d.real**2 + d.imag**2 if d.is_complex() else d**2


def real_products(c: Tensor, d: Tensor) -> Tensor:
    """``c·d`` elementwise; ``Re(c̄·d)`` for complex tensors, the real inner product, whose gradient in ``d`` is
    ``c`` (torch's convention for a real loss of complex parameters)."""
    return (c.conj() * d).real if (c.is_complex() or d.is_complex()) else c * d


class AnchoredTerm:
    r"""The client-objective term ``μ/2·‖w − a‖² + ⟨c, w − a⟩`` of one client or of a batch of clients.

    Built for one client from its ``anchors`` ``a`` (detached tensors shaped like the client's trainable
    parameters, in ``model.parameters()`` order: usually the round's global weights ``w_t``), its coefficient
    ``mu`` and its optional ``directions`` ``c`` (shaped like the anchors); the norm and the inner product run
    over all parameters jointly. Calling it on a list of parameter tensors gives

    * one client's parameters (each shaped like its anchor): the scalar ``μ/2 Σ_j ‖p_j − a_j‖² + Σ_j ⟨c_j, p_j −
      a_j⟩``, with the operations of the per-client helpers ``proximal_penalty`` and ``linear_correction``
      (:mod:`fedlightning.callbacks.proximal`), in that order (sequential training computes exactly these);
    * parameters with a leading row dimension ``[R, *shape]``: the ``[R]`` values of every row (for a batched
      term, row ``r`` uses client ``r``'s anchors, ``μ`` and directions).

    :meth:`gradient` gives the closed form ``μ(w − a) + c``, which vectorised training adds to the model's
    gradient instead of differentiating the term (the value still enters the reported loss and the line search's
    tests); it equals what autograd computes from the value (autograd's ``(μ/2)·2(w − a)`` rounds to
    ``μ(w − a)`` exactly), up to the order in which the parts of the gradient are summed.

    Args:
        anchors: the anchor ``a`` (``w_t``), one tensor per trainable parameter (kept as detached views: a
            constant of the term, as the anchors of the papers' terms are).
        mu: ``μ ≥ 0`` (0: no quadratic part).
        directions: ``c``, one tensor per parameter (None: no linear part).
    """

    def __init__(self, anchors: Sequence[Tensor], mu: float = 0.0, directions: Sequence[Tensor] | None = None):
        self.anchors = [a.detach() for a in anchors]  # constants of the term (views: no copy)
        if not self.anchors:
            raise ValueError("AnchoredTerm needs at least one anchor tensor (one per trainable parameter)")
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not mu >= 0.0:
            raise ValueError(f"AnchoredTerm's mu must be a number >= 0, got {mu!r}")
        self.mu: float | Tensor = float(mu)
        self.directions = None if directions is None else [c.detach() for c in directions]
        if self.directions is not None:
            bad = [j for j, (c, a) in enumerate(zip(self.directions, self.anchors)) if tuple(c.shape) != tuple(a.shape)]
            if len(self.directions) != len(self.anchors) or bad:
                raise ValueError(
                    f"AnchoredTerm's directions must match its anchors one for one ({len(self.anchors)} tensors of "
                    f"shapes {[tuple(a.shape) for a in self.anchors]}), got shapes "
                    f"{[tuple(c.shape) for c in self.directions]}"
                )
        self.shapes = [tuple(a.shape) for a in self.anchors]
        #: number of clients of a batched term (its rows), None for one client's term
        self.num_rows: int | None = None
        self.shared_anchors = True  # anchors without a row dimension (one client's, or the same for every row)

    # ------------------------------------------------------------------ batching
    @classmethod
    def stack(cls, terms: Sequence[AnchoredTerm]) -> AnchoredTerm:
        """One batched term whose row ``r`` is ``terms[r]`` (one-client terms over parameters of the same shapes):
        anchors shared when every term's anchors are the same tensors (the round's global weights), else stacked
        ``[C, *shape]``; ``μ`` one number when equal for all, else a ``[C]`` tensor; directions ``[C, *shape]``
        (zeros for a term without them), or None when no term has any."""
        terms = list(terms)
        if not terms:
            raise ValueError("AnchoredTerm.stack needs at least one term")
        first = terms[0]
        for t in terms:
            if not isinstance(t, AnchoredTerm) or t.num_rows is not None:
                raise TypeError(f"AnchoredTerm.stack takes one-client AnchoredTerms, got {t!r}")
            if t.shapes != first.shapes:
                raise ValueError(f"AnchoredTerm.stack: parameter shapes differ, {t.shapes} vs {first.shapes}")
        out = cls.__new__(cls)
        out.shapes = first.shapes
        out.num_rows = len(terms)
        out.shared_anchors = all(_same_tensors(t.anchors, first.anchors) for t in terms[1:])
        if out.shared_anchors:
            out.anchors = list(first.anchors)
        else:
            out.anchors = [torch.stack([t.anchors[j] for t in terms]) for j in range(len(first.shapes))]
        mus = [t.mu for t in terms]
        anchor = first.anchors[0]
        out.mu = (
            mus[0] if all(m == mus[0] for m in mus) else torch.tensor(mus, dtype=anchor.dtype, device=anchor.device)
        )
        if all(t.directions is None for t in terms):
            out.directions = None
        else:
            out.directions = [
                torch.stack(
                    [torch.zeros_like(t.anchors[j]) if t.directions is None else t.directions[j] for t in terms]
                )
                for j in range(len(first.shapes))
            ]
        return out

    def rows(self, index: Tensor) -> AnchoredTerm:
        """The batched term of the rows ``index`` of this batched term (repeats allowed)."""
        if self.num_rows is None:
            raise TypeError("rows() selects rows of a batched term (AnchoredTerm.stack)")
        out = AnchoredTerm.__new__(AnchoredTerm)
        out.shapes, out.num_rows, out.shared_anchors = self.shapes, len(index), self.shared_anchors
        out.anchors = self.anchors if self.shared_anchors else [a.index_select(0, index) for a in self.anchors]
        out.mu = self.mu.index_select(0, index.to(self.mu.device)) if isinstance(self.mu, Tensor) else self.mu
        out.directions = None if self.directions is None else [c.index_select(0, index) for c in self.directions]
        return out

    def to(self, dtype: torch.dtype | None = None, device: torch.device | None = None) -> AnchoredTerm:
        """This term with its tensors in ``dtype`` on ``device`` (itself when they already are)."""
        tensors = [*self.anchors, *(self.directions or []), *([self.mu] if isinstance(self.mu, Tensor) else [])]
        if all((dtype is None or t.dtype == dtype) and (device is None or t.device == device) for t in tensors):
            return self
        out = AnchoredTerm.__new__(AnchoredTerm)
        out.__dict__.update(self.__dict__)
        out.anchors = [a.to(dtype=dtype, device=device) for a in self.anchors]
        if self.directions is not None:
            out.directions = [c.to(dtype=dtype, device=device) for c in self.directions]
        if isinstance(self.mu, Tensor):
            out.mu = self.mu.to(dtype=dtype, device=device)
        return out

    # ------------------------------------------------------------------ evaluation
    def _rowwise(self, params: Sequence[Tensor]) -> bool:
        """Whether ``params`` carry a leading row dimension (checked against the term's parameter shapes)."""
        if len(params) != len(self.shapes):
            raise ValueError(
                f"AnchoredTerm over parameters of shapes {self.shapes} called on {len(params)} tensors of shapes "
                f"{[tuple(p.shape) for p in params]}"
            )
        p, shape = params[0], self.shapes[0]
        if p.dim() == len(shape) + 1 and tuple(p.shape[1:]) == shape:
            if self.num_rows is not None and p.shape[0] != self.num_rows:
                raise ValueError(f"batched AnchoredTerm of {self.num_rows} rows called on {p.shape[0]} rows")
            return True
        if self.num_rows is not None:
            raise ValueError(
                f"batched AnchoredTerm called on a tensor of shape {tuple(p.shape)}; expected ({self.num_rows}, "
                f"*{shape})"
            )
        if tuple(p.shape) != shape:
            raise ValueError(f"AnchoredTerm for parameters of shapes {self.shapes} called on shape {tuple(p.shape)}")
        return False

    def _mu_rows(self, like: Tensor) -> float | Tensor:
        """``μ``, as a number or as a ``[R, 1, ...]`` tensor broadcasting over the rows of ``like``."""
        if isinstance(self.mu, Tensor):
            return self.mu.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))
        return self.mu

    def __call__(self, params: Sequence[Tensor]) -> Tensor:
        if not self._rowwise(params):
            # one client: the per-client helpers' operations, in their order (sequential training's values)
            value = None
            if self.mu != 0.0:
                value = 0.5 * self.mu * sum(squared_magnitudes(p - a).sum() for p, a in zip(params, self.anchors))
            if self.directions is not None:
                lin = sum(real_products(c, p - a).sum() for p, a, c in zip(params, self.anchors, self.directions))
                value = lin if value is None else value + lin
            return params[0].new_zeros(()) if value is None else value
        return self.values_from_differences([p - a for p, a in zip(params, self.anchors)])

    def values_from_differences(self, diffs: Sequence[Tensor]) -> Tensor:
        """The ``[R]`` values ``μ/2‖d‖² + ⟨c, d⟩`` of rows from their differences ``d = w − a`` (one ``[R, *shape]``
        tensor per parameter)."""
        value = diffs[0].new_zeros(diffs[0].shape[0])
        if isinstance(self.mu, Tensor) or self.mu != 0.0:
            sq = sum(_row_sq_norm(d) for d in diffs)
            mu = self.mu.to(sq.dtype) if isinstance(self.mu, Tensor) else self.mu
            value = 0.5 * mu * sq
        if self.directions is not None:
            value = value + sum(_row_dot(d, c) for c, d in zip(self.directions, diffs))
        return value

    def shares_anchors(self, other: AnchoredTerm) -> bool:
        """Whether ``other``'s anchors are this term's (the same tensors, or views of the same memory with the same
        layout: each ``global_anchors`` call returns new views of the global parameters)."""
        return self.shared_anchors == other.shared_anchors and _same_tensors(self.anchors, other.anchors)

    def gradient(self, params: Sequence[Tensor]) -> list[Tensor]:
        """The closed-form gradient ``μ(w − a) + c`` at ``params`` (one tensor per parameter, shaped as
        ``params``)."""
        return self.value_and_gradient(params)[1]

    def value_and_gradient(self, params: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The value (scalar, or ``[R]`` for rows) and the closed-form gradient ``μ(w − a) + c`` at ``params``,
        from one difference ``w − a`` per parameter."""
        rowwise = self._rowwise(params)
        diffs = [p - a for p, a in zip(params, self.anchors)]
        value = self.values_from_differences(diffs) if rowwise else self(params)
        grads = []
        for j, d in enumerate(diffs):
            mu = self._mu_rows(d) if rowwise else self.mu
            g = d * mu if (isinstance(mu, Tensor) or mu != 0.0) else torch.zeros_like(d)
            if self.directions is not None:
                g = g + self.directions[j]
            grads.append(g)
        return value, grads

    def __repr__(self) -> str:
        rows = "" if self.num_rows is None else f", rows={self.num_rows}"
        mu = f"[{self.num_rows} values]" if isinstance(self.mu, Tensor) else self.mu
        return f"AnchoredTerm(mu={mu}, linear={self.directions is not None}{rows})"
