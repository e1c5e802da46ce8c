"""Synthetic(α, β) of FedProx (Li et al. 2020) and FedDANE (seed 003): heterogeneous multinomial-logistic data.

For users ``k = 1..N``: ``u_k ~ N(0, α²)``, ``B_k ~ N(0, β²)``, a local model ``W_k, b_k ~ N(u_k, 1)``, inputs
``x ~ N(v_k, Σ)`` with ``v_k ~ N(B_k, 1)`` and ``Σ = diag(j^{-1.2})``, labels ``y = argmax(x^T W_k + b_k)``.
:func:`generate_synthetic` draws the data (the full formulas, the IID variant, the draw order and the RNG
decisions: its docstring); :class:`SyntheticDataModule` is the data module (the validation rule: its docstring).
"""

from __future__ import annotations

import numpy as np
import torch

from fedlightning._validation import in_range, integer, non_negative, one_of
from fedlightning.datamodules.base import DEFAULT_VAL_FRACTION, ArrayDataset, FederatedDataModule

__all__ = ["SyntheticDataModule", "synthetic_covariance_diagonal", "generate_synthetic"]


def _single_blas_thread():
    """Run the many tiny (60×60) BLAS/LAPACK calls of the generator on one thread: on a busy machine OpenBLAS's
    thread pool makes them 20-100x slower (measured), and the results do not depend on the thread count."""
    try:
        from threadpoolctl import threadpool_limits

        return threadpool_limits(limits=1, user_api="blas")
    except ImportError:  # pragma: no cover - threadpoolctl ships with scikit-learn
        import contextlib

        return contextlib.nullcontext()


def synthetic_covariance_diagonal(dim: int) -> np.ndarray:
    """``Σ_jj = j^{-1.2}`` for ``j = 1..dim`` (FedProx's Synthetic covariance)."""
    return np.power(np.arange(1, int(dim) + 1, dtype=np.float64), -1.2)


def generate_synthetic(
    alpha: float,
    beta: float,
    iid: bool,
    num_clients: int,
    dim: int,
    classes: int,
    rng,
) -> dict:
    r"""Draw Synthetic(α, β) (or Synthetic-IID) in the documented order. Returns a dict with per-user lists
    ``x`` (float64 ``(n_k, dim)``), ``y`` (int64), and the parameters ``W``, ``b``, ``v``, ``u``, ``B`` and
    the sample counts ``n``.

    For users ``k = 1..N`` (N = 30), inputs in ``R^d`` (d = 60), ``C = 10`` classes:

    .. math::
        n_k &= \lfloor \mathrm{LogNormal}(4, 2) \rfloor + 50 \\
        u_k &\sim \mathcal N(0, \alpha^2), \qquad B_k \sim \mathcal N(0, \beta^2), \qquad
        v_k \sim \mathcal N(B_k, 1)^{d} \\
        W_k &\sim \mathcal N(u_k, 1)^{d \times C}, \qquad b_k \sim \mathcal N(u_k, 1)^{C} \\
        x &\sim \mathcal N(v_k, \Sigma), \quad \Sigma = \mathrm{diag}(j^{-1.2})_{j=1..d}, \qquad
        y = \arg\max_c\, (x^\top W_k + b_k)_c

    (numpy's ``normal(loc, scale)`` takes the standard deviation, so α and β are standard deviations.) α controls how
    much the local models differ, β how much the local input distributions differ; Synthetic(0, 0) is *not* IID (every
    user still draws its own ``W_k, b_k, v_k``).

    ``iid=True`` is FedProx's Synthetic-IID: one ``W ~ N(0, 1)^{d×C}`` and ``b ~ N(0, 1)^C`` shared by all users and
    ``v_k = 0``, so every user samples ``x ~ N(0, Σ)`` and labels it with the same model.

    Draw order (the FedProx/FedDANE reference ``generate_synthetic.py``), all from ONE seeded
    generator: the N sample counts; the N ``u_k``; the N ``B_k``; for each user its ``v_k`` (d draws); then for each
    user ``W_k`` (d×C), ``b_k`` (C) and its ``n_k`` inputs. IID draws the N counts, then the shared ``W``, ``b``, then
    each user's inputs (this order is ours: the reference IID script was not available).

    RNG API (decision): the reference scripts call numpy's legacy global ``np.random`` functions unseeded. Here
    ``rng="generator"`` (default) uses ``np.random.default_rng(seed)`` (numpy's recommended Generator; same calls, same
    order, different bit stream), and ``rng="legacy"`` uses ``np.random.RandomState(seed)``, which reproduces the
    reference script draw-for-draw when that script is run after ``np.random.seed(seed)`` (the integer cast of the
    log-normal sizes, ``normal`` and ``multivariate_normal`` with the SVD factorisation are the same calls).
    Per-user split: the reference shuffles each user's samples with Python's ``random.shuffle`` and keeps the first
    ``int(0.9 n_k)`` for training; here the shuffle is a permutation from the same generator, drawn for each user in
    order after all data are generated (ours). The global test set is the union of the users' test parts.
    """
    n = rng.lognormal(4, 2, num_clients).astype(int) + 50
    cov = np.diag(synthetic_covariance_diagonal(dim))
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    Ws: list[np.ndarray] = []
    bs: list[np.ndarray] = []
    if iid:
        W = rng.normal(0, 1, (dim, classes))
        b = rng.normal(0, 1, classes)
        v = np.zeros((num_clients, dim))
        u = np.zeros(num_clients)
        B = np.zeros(num_clients)
        for k in range(num_clients):
            x = rng.multivariate_normal(v[k], cov, int(n[k]))
            xs.append(x)
            ys.append(np.argmax(x @ W + b, axis=1))
            Ws.append(W)
            bs.append(b)
    else:
        u = rng.normal(0, alpha, num_clients)
        B = rng.normal(0, beta, num_clients)
        v = np.zeros((num_clients, dim))
        for k in range(num_clients):
            v[k] = rng.normal(B[k], 1, dim)
        for k in range(num_clients):
            W = rng.normal(u[k], 1, (dim, classes))
            b = rng.normal(u[k], 1, classes)
            x = rng.multivariate_normal(v[k], cov, int(n[k]))
            xs.append(x)
            ys.append(np.argmax(x @ W + b, axis=1))  # argmax of softmax = argmax of the logits
            Ws.append(W)
            bs.append(b)
    return {"x": xs, "y": [y.astype(np.int64) for y in ys], "W": Ws, "b": bs, "v": v, "u": u, "B": B, "n": n}


class SyntheticDataModule(FederatedDataModule):
    """Synthetic(α, β) / Synthetic-IID as a federated data set with natural per-user clients and test splits.

    Validation (ours): every user holds out ``floor(val_fraction · n_train_k)`` of its training samples (default
    ``val_fraction`` 0.1, seeded by ``(seed, "val")``, independent of the generator above; users with fewer than
    ``1 / val_fraction`` training samples keep all), so the validation split has the same user population as training
    and the test set (see :class:`~fedlightning.datamodules.FederatedDataModule`). ``val_fraction=0`` gives every
    client its whole training part, as the reference.

    Args:
        alpha: α ≥ 0, spread of the users' models (FedProx/FedDANE use 0, 0.5, 1).
        beta: β ≥ 0, spread of the users' input means.
        iid: Synthetic-IID (α and β are then unused).
        num_clients: users N (default 30, the reference ``NUM_USER``).
        dim: input dimension d (default 60).
        classes: classes C (default 10).
        train_fraction: per-user train fraction (reference: 0.9).
        rng: ``"generator"`` (numpy Generator, default) or ``"legacy"`` (RandomState; see :func:`generate_synthetic`).
        batch_size: client batch size (FedDANE/FedProx: 10).
        seed: seed of the data generation and of the per-user split.
        val_fraction: per-user fraction of the training samples held out for validation (default 0.1, ours; see
            above).

    Attributes after ``setup()``: ``params`` (the generated ``W``, ``b``, ``v``, ``u``, ``B``, ``n``),
    ``client_test_indices``, ``client_val_indices``.
    """

    def __init__(
        self,
        alpha: float = 0.0,
        beta: float = 0.0,
        iid: bool = False,
        num_clients: int = 30,
        dim: int = 60,
        classes: int = 10,
        train_fraction: float = 0.9,
        rng: str = "generator",
        batch_size: int = 10,
        seed: int = 0,
        eval_batch_size: int = 1024,
        rounds_per_epoch: int = 1000,
        val_fraction: float = DEFAULT_VAL_FRACTION,
    ):
        super().__init__(
            num_clients=num_clients,
            batch_size=batch_size,
            seed=seed,
            eval_batch_size=eval_batch_size,
            rounds_per_epoch=rounds_per_epoch,
            val_fraction=val_fraction,
        )
        self.alpha, self.beta, self.iid = non_negative("alpha", alpha), non_negative("beta", beta), bool(iid)
        self.dim, self.classes = integer("dim", dim), integer("classes", classes, 2)
        self.num_classes = self.classes
        self.train_fraction = in_range("train_fraction", train_fraction, 0.0, 1.0, low_closed=False)
        self.rng = one_of("rng", rng, ("generator", "legacy"))
        self.params: dict | None = None
        self._natural: list[np.ndarray] = []

    def _generator(self):
        return np.random.default_rng(self.seed) if self.rng == "generator" else np.random.RandomState(self.seed)

    def load(self):
        rng = self._generator()
        with _single_blas_thread():
            data = generate_synthetic(self.alpha, self.beta, self.iid, self._num_clients, self.dim, self.classes, rng)
        self.params = {k: data[k] for k in ("W", "b", "v", "u", "B", "n")}
        tr_x, tr_y, te_x, te_y = [], [], [], []
        natural, test_idx = [], []
        n_tr = n_te = 0
        for k in range(self._num_clients):
            perm = rng.permutation(len(data["y"][k]))
            cut = int(self.train_fraction * len(perm))
            tr, te = perm[:cut], perm[cut:]
            tr_x.append(data["x"][k][tr])
            tr_y.append(data["y"][k][tr])
            te_x.append(data["x"][k][te])
            te_y.append(data["y"][k][te])
            natural.append(np.arange(n_tr, n_tr + len(tr), dtype=np.int64))
            test_idx.append(np.arange(n_te, n_te + len(te), dtype=np.int64))
            n_tr, n_te = n_tr + len(tr), n_te + len(te)
        self._natural = natural
        self.client_test_indices = test_idx
        ytr = np.concatenate(tr_y)
        train = ArrayDataset(torch.from_numpy(np.concatenate(tr_x).astype(np.float32)), torch.from_numpy(ytr))
        test = ArrayDataset(
            torch.from_numpy(np.concatenate(te_x).astype(np.float32)), torch.from_numpy(np.concatenate(te_y))
        )
        return train, test, ytr

    def natural_clients(self) -> list[np.ndarray]:
        return self._natural
