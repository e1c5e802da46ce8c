"""How the tests compare floating-point results: what is bit-exact, what agrees to rounding, and by how much.

Three kinds of claims, three checks:

* **The same computation twice** (a resumed run and the uninterrupted one, the same seed twice, a reused and a fresh
  optimizer that run the same kernels): bit-exact, ``torch.equal`` / ``atol=0, rtol=0``.
* **Two different computations of the same quantity** (vectorised vs sequential clients, N processes vs one,
  fedlightning vs a hand-written reference loop, a batched kernel vs torch's): they differ by rounding, and rounding
  is not a property of the code alone: the CPU's vector width, the kernels ATen picks (``ATEN_CPU_CAPABILITY``) and
  the number of threads change the order of every sum. In float32 the difference of two such training runs is the
  float32 rounding error (2^-24 = 6e-8 per operation) amplified by the training dynamics: SPS and Armijo steps are
  ratios of losses and squared gradient norms, and a few local steps turn 6e-8 into 1e-5. A float32 tolerance
  chosen by looking at one machine's difference is therefore a guess that another machine breaks. These claims are
  checked in **float64** (:func:`assert_close64`: the model and the data in float64, :class:`Float64Inputs`), where
  the same amplification leaves the difference below 1.5e-13, far below :data:`RTOL64`, and any real disagreement
  (a missing term, another sample, another step size) stays at 1e-3 or more; or, where float32 itself is the
  subject, with a float32 tolerance **derived from a float64 reference** (:func:`assert_rounding_close`).
* **A value against a formula** computed independently in float64 (a step size, a weighted mean of recorded
  updates): :func:`assert_close64` when the value is computed in float64, or a tolerance stated next to the check in
  units of the value's own precision (``k · eps · scale``), never a number read off one run.

The tests that compare two different computations in float carry the ``numerics`` marker (pyproject.toml); CI runs
them a second time under ``ATEN_CPU_CAPABILITY=default`` (ATen's generic kernels), so that a tolerance that holds
only for one CPU's kernels fails before it lands.
"""

from __future__ import annotations

import math

import torch

from fedlightning.datamodules import ArrayDataset, DigitsDataModule

__all__ = [
    "EPS32",
    "EPS64",
    "RTOL64",
    "rtol32",
    "tol64",
    "assert_close64",
    "assert_close32",
    "assert_rounding_close",
    "Float64Inputs",
    "Digits64",
    "float64_data",
    "to_float64",
    "flat",
]

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
EPS64 = torch.finfo(torch.float64).eps  # 2.22e-16

#: Relative tolerance of float64 agreement between two computations of a training run or of one step: 1e-10 is
#: 4.5e5 float64 ulps. The largest float64 difference between two paths of this suite, measured relative to
#: max(1, max|expected|) with the default and the generic (ATEN_CPU_CAPABILITY=default) kernels, is 1.4e-13 (a
#: torchvision ResNet-18 with BatchNorm, vectorised vs sequential); vectorised vs sequential SPS runs, which differ by
#: 5e-6 in float32, differ by 2e-14. The margin covers another CPU's summation orders amplified some 700 times more,
#: while a real disagreement is far above it: zeroing one sample's features moves the weights of test_vectorized's
#: 3-round MLP runs by 4e-3 (SGD) to 0.5 (SPS, Armijo).
RTOL64 = 1e-10


def rtol32(n: int = 1) -> float:
    """Relative tolerance between two float32 values that each round (``n = 1``) or sum / average ``n`` float32
    roundings of (``n > 1``) float64 values agreeing to :data:`RTOL64`: ``n · eps32 + RTOL64``.

    Some results are float32 by design even in a float64 run: logged values (Lightning keeps ``self.log`` values
    in float32; the loop and the vectorised engine report losses as float32 like it). One rounding moves a value by
    at most ``eps32 / 2`` of it, and a float32 sum of ``n`` terms of one sign (losses) by at most ``n · eps32 / 2``
    of it (to first order; Higham's γ_n bound), on each side: two such values are ``n · eps32`` apart at most. The
    values straddle a rounding boundary rarely, but on some machine they do, so the check must allow it.
    """
    return n * EPS32 + RTOL64


def assert_close32(actual, expected, n: int = 1) -> None:
    """Float32 tensors that are ``n``-term float32 sums / means of roundings of float64 values agreeing to
    :data:`RTOL64` (e.g. the float buffers a client reports, which the loop sends as float32, and their average):
    ``|actual − expected| ≤ rtol32(n) · max(1, max|expected|)``, the bound of :func:`rtol32` for terms bounded by
    the result's scale (a weighted mean's terms are)."""
    a, e = torch.as_tensor(actual), torch.as_tensor(expected)
    assert a.dtype == e.dtype == torch.float32, f"float32 comparison of {a.dtype} and {e.dtype}"
    torch.testing.assert_close(a, e, atol=tol64(e, rtol32(n)), rtol=0, equal_nan=True)


def tol64(expected, rtol: float = RTOL64) -> float:
    """``rtol · max(1, max |expected|)``: the absolute float64 tolerance for values of ``expected``'s scale."""
    t = torch.as_tensor(expected)
    scale = float(t.detach().abs().max()) if t.numel() and bool(torch.isfinite(t).any()) else 1.0
    if not math.isfinite(scale):
        scale = float(t.detach()[torch.isfinite(t)].abs().max())
    return rtol * max(1.0, scale)


def assert_close64(actual, expected, rtol: float = RTOL64, msg: str | None = None) -> None:
    """``actual`` and ``expected`` (float64 tensors or numbers) agree to ``rtol · max(1, max|expected|)``.

    Both must be float64: a float32 value here would pass or fail by its own rounding, not by the claim.
    """
    a, e = torch.as_tensor(actual), torch.as_tensor(expected)
    assert a.dtype == e.dtype == torch.float64, f"float64 comparison of {a.dtype} and {e.dtype}"
    kw = {} if msg is None else {"msg": msg}
    torch.testing.assert_close(a, e, atol=tol64(e, rtol), rtol=0, equal_nan=True, **kw)


def assert_rounding_close(
    actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, k: float = 16.0, floor_ulps: float = 64.0
) -> None:
    """Two computations ``actual`` and ``expected`` in a lower precision agree to within ``k`` times the rounding
    error of ``expected``, measured against ``exact`` (the same computation as ``expected`` in float64).

    The claim is that both are the lower-precision image of one exact computation. ``expected`` measures how far
    that precision's rounding, amplified by the computation, takes a result on this machine: ``err =
    max|expected − exact|``. ``actual``'s rounding differs in order but not in kind, so ``max|actual − exact| ≤
    k · err``. ``k = 16`` (ours): on the suite's float32 training runs the vectorised run's error was 0.3–6 times
    the sequential run's (SPS and Armijo steps amplify whichever rounding they get; AVX2 and the generic
    ``ATEN_CPU_CAPABILITY=default`` kernels), so 16 leaves room for another machine's summation orders. A floor of
    ``floor_ulps`` units of the precision at the result's scale keeps the bound meaningful when ``expected`` happens
    to be almost exact; with it, the suite's checks used at most 9 % of their bound. Such a bound (about 1e-4 on
    SPS's weights) is looser than float64's, so the equality itself is checked in float64; a float32 check covers
    what only float32 (or bf16) runs exercise.
    """
    assert exact.dtype == torch.float64, f"the exact reference must be float64, got {exact.dtype}"
    assert actual.dtype == expected.dtype, f"{actual.dtype} vs {expected.dtype}"
    eps = torch.finfo(expected.dtype).eps
    scale = max(1.0, float(exact.abs().max()))
    err = float((expected.double() - exact).abs().max())
    bound = k * max(err, floor_ulps * eps * scale)
    got = float((actual.double() - exact).abs().max())
    assert got <= bound, (
        f"max |actual - exact| = {got:.3g} > {k:g} x max(reference's rounding error {err:.3g}, "
        f"{floor_ulps:g} ulps = {floor_ulps * eps * scale:.3g})"
    )


def _double(dataset):
    if isinstance(dataset, ArrayDataset):
        x = dataset.x.double() if dataset.x.is_floating_point() else dataset.x
        y = dataset.y.double() if dataset.y.is_floating_point() else dataset.y
        return ArrayDataset(x, y)
    return dataset


class Float64Inputs:
    """Mixin for a FederatedDataModule whose ``load()`` returns ``ArrayDataset`` s: floating inputs (and floating
    targets) become float64, for float64 models. ``class Digits64(Float64Inputs, DigitsDataModule)``."""

    def load(self):
        train, test, labels = super().load()
        return _double(train), _double(test), labels


class Digits64(Float64Inputs, DigitsDataModule):
    """scikit-learn's digits (:class:`~fedlightning.datamodules.DigitsDataModule`) with float64 inputs."""


def float64_data(datamodule):
    """``datamodule`` (built elsewhere, e.g. by the CLI from a config) loads float64 inputs: its ``load()`` is
    wrapped on the instance as :class:`Float64Inputs` does for a class. Returns it."""
    load = datamodule.load

    def load64():
        train, test, labels = load()
        return _double(train), _double(test), labels

    datamodule.load = load64
    return datamodule


def to_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its floating parameters and buffers in float64 (the float32 initial values, exactly)."""
    return model.to(torch.float64)


def flat(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters as one detached vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
