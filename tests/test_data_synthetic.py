"""SyntheticDataModule: draw-for-draw agreement with a transcription of the FedProx/FedDANE generator (legacy RNG),
the covariance j^-1.2, labels = argmax of each user's model, Synthetic(0,0) vs Synthetic-IID, seeding, splits."""

import numpy as np
import pytest
import torch

from fedlightning.datamodules import SyntheticDataModule
from fedlightning.datamodules.synthetic import synthetic_covariance_diagonal


def reference_generate_synthetic(alpha, beta, seed, num_users=30, dimension=60, num_class=10):
    """The non-IID generator of the FedProx/FedDANE reference ``generate_synthetic.py``, numpy's global RNG seeded."""
    np.random.seed(seed)
    samples_per_user = np.random.lognormal(4, 2, (num_users)).astype(int) + 50
    mean_W = np.random.normal(0, alpha, num_users)
    mean_b = mean_W
    B = np.random.normal(0, beta, num_users)
    mean_x = np.zeros((num_users, dimension))
    diagonal = np.zeros(dimension)
    for j in range(dimension):
        diagonal[j] = np.power((j + 1), -1.2)
    cov_x = np.diag(diagonal)
    for i in range(num_users):
        mean_x[i] = np.random.normal(B[i], 1, dimension)
    X, Y = [], []
    for i in range(num_users):
        W = np.random.normal(mean_W[i], 1, (dimension, num_class))
        b = np.random.normal(mean_b[i], 1, num_class)
        xx = np.random.multivariate_normal(mean_x[i], cov_x, samples_per_user[i])
        yy = np.zeros(samples_per_user[i])
        for j in range(samples_per_user[i]):
            tmp = np.dot(xx[j], W) + b
            yy[j] = np.argmax(np.exp(tmp) / np.sum(np.exp(tmp)))
        X.append(xx)
        Y.append(yy)
    return samples_per_user, mean_x, X, Y


def _user_data(dm, k):
    x = torch.cat([dm.train_dataset.x[dm.client_indices[k]], dm.test_dataset.x[dm.client_test_indices[k]]])
    y = torch.cat([dm.train_dataset.y[dm.client_indices[k]], dm.test_dataset.y[dm.client_test_indices[k]]])
    return x.numpy(), y.numpy()


def test_legacy_rng_matches_reference_script_draw_for_draw():
    from threadpoolctl import threadpool_limits

    seed = 7
    with threadpool_limits(limits=1, user_api="blas"):  # tiny BLAS calls: threads only slow them down
        n, mean_x, X, Y = reference_generate_synthetic(0.5, 0.5, seed, num_users=8)
    dm = SyntheticDataModule(alpha=0.5, beta=0.5, num_clients=8, rng="legacy", seed=seed, val_fraction=0)
    dm.setup()
    np.testing.assert_array_equal(dm.params["n"], n)
    np.testing.assert_array_equal(dm.params["v"], mean_x)
    for k in range(8):
        x, y = _user_data(dm, k)
        # same samples (the split permutes them): compare as sorted rows
        order_ref = np.lexsort(X[k].astype(np.float32).T[::-1])
        order_got = np.lexsort(x.T[::-1])
        np.testing.assert_array_equal(x[order_got], X[k].astype(np.float32)[order_ref])
        np.testing.assert_array_equal(y[order_got], Y[k][order_ref].astype(np.int64))


def test_shapes_and_per_user_90_10_split():
    dm = SyntheticDataModule(alpha=1.0, beta=1.0, seed=1, val_fraction=0)  # small seeds keep the data small
    dm.setup()
    n = dm.params["n"]
    assert dm.num_clients == 30 and len(n) == 30 and (n >= 50).all()
    assert [len(i) for i in dm.client_indices] == [int(0.9 * m) for m in n]
    assert [len(i) for i in dm.client_test_indices] == [m - int(0.9 * m) for m in n]
    assert dm.train_dataset.x.shape == (int(sum(int(0.9 * m) for m in n)), 60)
    assert dm.train_dataset.x.dtype == torch.float32 and dm.train_dataset.y.dtype == torch.int64
    assert int(dm.train_dataset.y.max()) < 10


def test_labels_are_argmax_of_each_users_model():
    dm = SyntheticDataModule(alpha=0.5, beta=0.5, seed=2, num_clients=10)
    dm.setup()
    for k in range(10):
        x, y = _user_data(dm, k)
        logits = x.astype(np.float64) @ dm.params["W"][k] + dm.params["b"][k]
        # x was stored as float32: allow the (rare) near-ties to flip
        assert (np.argmax(logits, axis=1) == y).mean() > 0.99


def test_covariance_diagonal_is_j_to_the_minus_1_2():
    np.testing.assert_allclose(synthetic_covariance_diagonal(3), [1.0, 2**-1.2, 3**-1.2])
    dm = SyntheticDataModule(alpha=0.0, beta=0.0, seed=6)  # seed 6: 12,264 samples, the largest user 2,043
    dm.setup()
    centred = np.concatenate([_user_data(dm, k)[0] - dm.params["v"][k] for k in range(30)])
    assert len(centred) > 5000
    var = centred.var(axis=0)
    np.testing.assert_allclose(var, synthetic_covariance_diagonal(60), rtol=0.1)
    corr = np.corrcoef(centred.T)
    assert np.abs(corr - np.eye(60)).max() < 0.1  # diagonal covariance


def test_synthetic_0_0_is_not_iid_and_iid_shares_one_model():
    het = SyntheticDataModule(alpha=0.0, beta=0.0, seed=8)
    het.setup()
    iid = SyntheticDataModule(iid=True, seed=8)
    iid.setup()
    # (0, 0): every user draws its own W_k, b_k ~ N(0, 1) and v_k ~ N(0, 1); u_k = B_k = 0
    assert np.all(het.params["u"] == 0) and np.all(het.params["B"] == 0)
    assert not np.allclose(het.params["W"][0], het.params["W"][1])
    assert 0.7 < het.params["v"].std() < 1.3
    # IID: one shared W, b and v_k = 0
    assert all(np.array_equal(iid.params["W"][0], W) for W in iid.params["W"])
    assert all(np.array_equal(iid.params["b"][0], b) for b in iid.params["b"])
    assert np.all(iid.params["v"] == 0)
    # consequence: under IID every user's labels follow the same model; under (0,0) user 0's model mislabels
    # most of user 1's data
    x1, y1 = _user_data(het, 1)
    agree_het = (np.argmax(x1 @ het.params["W"][0] + het.params["b"][0], axis=1) == y1).mean()
    x1, y1 = _user_data(iid, 1)
    agree_iid = (np.argmax(x1 @ iid.params["W"][0] + iid.params["b"][0], axis=1) == y1).mean()
    assert agree_iid > 0.99 and agree_het < 0.6


def test_seeded():
    a = SyntheticDataModule(alpha=1, beta=1, seed=10)
    b = SyntheticDataModule(alpha=1, beta=1, seed=10)
    c = SyntheticDataModule(alpha=1, beta=1, seed=7)
    for dm in (a, b, c):
        dm.setup()
    assert torch.equal(a.train_dataset.x, b.train_dataset.x) and torch.equal(a.test_dataset.y, b.test_dataset.y)
    assert not np.array_equal(a.params["n"], c.params["n"])


def test_bad_input():
    for kw, match in (
        ({"alpha": -1.0}, "alpha"),
        ({"beta": float("nan")}, "beta"),
        ({"dim": 0}, "dim"),
        ({"classes": 1}, "classes"),
        ({"train_fraction": 1.0}, "train_fraction"),
        ({"rng": "mt19937"}, "rng"),
        ({"num_clients": 0}, "num_clients"),
    ):
        with pytest.raises(ValueError, match=match):
            SyntheticDataModule(**kw)
