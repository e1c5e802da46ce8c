r"""Seed 000's Fig. 1 toy problem ("Painless Federated Learning", §1; after Jhunjhunwala et al. 2023): two clients

.. math::
    F_1(w) = (w_1 + w_2 - 3)^2, \qquad F_2(w) = (w_1 + 2 w_2 - 3)^2, \qquad F = (F_1 + F_2)/2,

both minimised at :math:`w^* = (3, 0)` (client-wise interpolation holds), trained with FedAvg, FedExP, FedSLS and
FedExpSLS. The paper's claim: the combination of extrapolation and line search (FedExpSLS) converges fastest.

Every algorithm runs through the framework itself — :class:`~fedlightning.FederatedLoop`, the
:class:`~fedlightning.callbacks.FedAvg` / :class:`~fedlightning.callbacks.FedExP` strategies and the
``torch.optim.SGD`` / :class:`~fedlightning.optim.SgdArmijo` client optimizers — on a data set of two one-example
clients (client ``i`` holds the row ``a_i`` and target 3, so its mini-batch loss is ``(a_i·w − 3)² = F_i(w)``:
full-batch, deterministic gradients). A plain-NumPy implementation of the paper's formulas (Alg. 2–5) runs
alongside, and the script reports the largest difference between the two trajectories.

The paper gives no start point, step sizes, ``K``, ``c`` or ``ε`` for the toy; the values here are ours:
``w_0 = (0, 0)``, ``K = 10`` local steps, client SGD learning rate 0.05 (below ``1/L_2 = 0.1``), SgdArmijo with its
defaults (``η_max = 1``, ``c = 0.1``, ``β = 0.9``, reset to ``η_max`` at every step: seed 000 opt 1), FedExP
``ε = 1e-8`` (tiny, so that it does not switch off the extrapolation near the optimum), FedSLS ``η_g = 1``.

    python benchmarks/toy_fig1.py [--rounds 50] [--out docs/figures]

writes ``toy_fig1.png`` (trajectories over the contours of F, and F(w_t) per round) and ``toy_fig1.json`` (the
numbers printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

A = np.array([[1.0, 1.0], [1.0, 2.0]])  # client i's row a_i
B = np.array([3.0, 3.0])
W_STAR = np.array([3.0, 0.0])
W0 = np.array([0.0, 0.0])  # ours
LOCAL_STEPS = 10  # ours
CLIENT_LR = 0.05  # ours (L_1 = 4, L_2 = 10)
ARMIJO = dict(eta_max=1.0, c=0.1, beta=0.9)  # SgdArmijo's defaults (reference Sls / Vaswani et al. 2019)
EPS = 1e-8  # ours
ALGORITHMS = ("FedAvg", "FedExP", "FedSLS", "FedExpSLS")


def global_loss(w: np.ndarray) -> float:
    r = A @ w - B
    return float(np.mean(r**2))


# ====================================================================== NumPy reference (the paper's formulas)
def _client_loss(i: int, w: np.ndarray) -> float:
    return float((A[i] @ w - B[i]) ** 2)


def _client_grad(i: int, w: np.ndarray) -> np.ndarray:
    return 2.0 * (A[i] @ w - B[i]) * A[i]


def reference_run(algorithm: str, rounds: int) -> dict[str, list]:
    """Seed 000 Alg. 2–5 on the toy, in float64 NumPy."""
    w = W0.copy()
    traj, etas, backtracks = [w.copy()], [], []
    line_search = algorithm in ("FedSLS", "FedExpSLS")
    for _ in range(rounds):
        deltas, bts = [], 0
        for i in range(2):
            v = w.copy()
            for _ in range(LOCAL_STEPS):
                g = _client_grad(i, v)
                if line_search:
                    f, gg = _client_loss(i, v), float(g @ g)
                    if gg < 1e-16:
                        continue
                    m = 0
                    while True:  # largest eta_max * beta^m with f(v - eta g) <= f(v) - c eta ||g||^2
                        eta = ARMIJO["eta_max"] * ARMIJO["beta"] ** m
                        if _client_loss(i, v - eta * g) <= f - ARMIJO["c"] * eta * gg:
                            break
                        m += 1
                    bts += m
                    v = v - eta * g
                else:
                    v = v - CLIENT_LR * g
            deltas.append(w - v)
        delta = np.mean(deltas, axis=0)
        if algorithm in ("FedExP", "FedExpSLS"):
            eta_g = max(1.0, sum(float(d @ d) for d in deltas) / (2 * len(deltas) * (float(delta @ delta) + EPS)))
        else:
            eta_g = 1.0
        w = w - eta_g * delta
        traj.append(w.copy())
        etas.append(eta_g)
        backtracks.append(bts / (2 * LOCAL_STEPS))
    return {"trajectory": traj, "eta_g": etas, "backtracks_per_step": backtracks}


# ====================================================================== the framework
def framework_run(algorithm: str, rounds: int) -> dict[str, list]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from fedlightning import FederatedLoop
    from fedlightning.callbacks import FedAvg, FedExP
    from fedlightning.datamodules.base import ArrayDataset, FederatedDataModule
    from fedlightning.optim import SgdArmijo

    class TwoQuadratics(FederatedDataModule):
        """Two clients with one example each: (a_i, 3)."""

        def __init__(self):
            super().__init__(num_clients=2, batch_size=1, eval_batch_size=2)

        def load(self):
            data = ArrayDataset(torch.tensor(A, dtype=torch.float64), torch.tensor(B, dtype=torch.float64))
            return data, data, np.zeros(2, dtype=np.int64)

        def natural_clients(self):
            return [np.array([0]), np.array([1])]

    class SquaredResidual(pl.LightningModule):
        """``(a·w − b)²`` averaged over the batch (one example per client here)."""

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(W0, dtype=torch.float64))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((x @ self.w - y) ** 2).mean()

    class Record(Callback):
        def __init__(self):
            self.trajectory = [W0.copy()]
            self.eta_g, self.backtracks = [], []

        def on_round_end(self, trainer, loop, result):
            self.trajectory.append(loop.model.w.detach().numpy().copy())
            self.eta_g.append(float(result.metrics.get("server/lr", float("nan"))))
            self.backtracks.append(float(result.metrics.get("client/backtracks_per_step", 0.0)))

    line_search = algorithm in ("FedSLS", "FedExpSLS")
    if line_search:
        client_optimizer = lambda p: SgdArmijo(p, **ARMIJO)  # noqa: E731
    else:
        client_optimizer = lambda p: torch.optim.SGD(p, lr=CLIENT_LR)  # noqa: E731
    strategy = FedExP(eps=EPS) if algorithm in ("FedExP", "FedExpSLS") else FedAvg(server_lr=1.0, weighting="uniform")
    loop = FederatedLoop(
        SquaredResidual(), client_optimizer=client_optimizer, local_steps=LOCAL_STEPS, clients_per_round=2
    )
    record = Record()
    for name in ("lightning.pytorch", "lightning.fabric"):  # no per-run banners
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            max_steps=rounds,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[strategy, record],
        )
        trainer.fit(loop, datamodule=TwoQuadratics())
    return {"trajectory": record.trajectory, "eta_g": record.eta_g, "backtracks_per_step": record.backtracks}


# ====================================================================== summary and plot
def rounds_to(losses: list[float], target: float):
    for r, f in enumerate(losses):
        if f <= target:
            return r
    return None


def summarize(runs: dict[str, dict[str, list]], refs: dict[str, dict[str, list]], rounds: int) -> dict[str, dict]:
    out = {}
    for name, run in runs.items():
        traj = np.array(run["trajectory"])
        losses = [global_loss(w) for w in traj]
        ref = np.array(refs[name]["trajectory"])
        out[name] = {
            "final_loss": losses[-1],
            "final_distance": float(np.linalg.norm(traj[-1] - W_STAR)),
            "rounds_to_1e-4": rounds_to(losses, 1e-4),
            "rounds_to_1e-8": rounds_to(losses, 1e-8),
            "mean_eta_g": float(np.mean(run["eta_g"])),
            "mean_backtracks_per_step": float(np.mean(run["backtracks_per_step"])),
            "max_deviation_from_numpy_reference": float(np.max(np.abs(traj - ref))),
            "losses": losses,
            "trajectory": traj.tolist(),
        }
    return out


def plot(summary: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    g1, g2 = np.meshgrid(np.linspace(-0.5, 3.8, 200), np.linspace(-1.2, 2.2, 200))
    f = ((g1 + g2 - 3) ** 2 + (g1 + 2 * g2 - 3) ** 2) / 2
    ax1.contour(g1, g2, np.log10(f + 1e-12), levels=15, cmap="Greys", linewidths=0.6)
    xs = np.linspace(-0.5, 3.8, 2)
    ax1.plot(xs, 3 - xs, "k--", lw=0.8, label="$F_1 = 0$")
    ax1.plot(xs, (3 - xs) / 2, "k:", lw=0.8, label="$F_2 = 0$")
    for name, s in summary.items():
        t = np.array(s["trajectory"])
        ax1.plot(t[:, 0], t[:, 1], ".-", ms=3, lw=1, label=name)
        ax2.semilogy(np.maximum(s["losses"], 1e-16), label=name)
    ax1.plot(*W_STAR, "r*", ms=10, label="$w^*$")
    ax1.set_xlabel("$w_1$")
    ax1.set_ylabel("$w_2$")
    ax1.set_title("global iterates $w_t$")
    ax1.legend(fontsize=7, loc="upper right")
    ax2.set_xlabel("round")
    ax2.set_ylabel("$F(w_t) = (F_1 + F_2)/2$")
    ax2.set_title("global objective")
    ax2.legend(fontsize=8)
    fig.suptitle(f"Seed 000 Fig. 1 toy: K={LOCAL_STEPS}, client lr {CLIENT_LR}, SgdArmijo(eta_max=1, c=0.1, beta=0.9)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(rounds: int = 50, out_dir: str = os.path.join(ROOT, "docs", "figures")) -> dict[str, dict]:
    if isinstance(rounds, bool) or int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    runs = {name: framework_run(name, int(rounds)) for name in ALGORITHMS}
    refs = {name: reference_run(name, int(rounds)) for name in ALGORITHMS}
    summary = summarize(runs, refs, int(rounds))
    plot(summary, os.path.join(out_dir, "toy_fig1.png"))
    with open(os.path.join(out_dir, "toy_fig1.json"), "w") as f:
        json.dump(
            {
                "rounds": rounds,
                "w0": W0.tolist(),
                "local_steps": LOCAL_STEPS,
                "client_lr": CLIENT_LR,
                "armijo": ARMIJO,
                "eps": EPS,
                "results": summary,
            },
            f,
            indent=1,
        )
    return summary


def format_table(summary: dict[str, dict]) -> str:
    lines = [
        "| algorithm | F(w_R) | ‖w_R − w*‖ | rounds to F ≤ 1e-4 | rounds to F ≤ 1e-8 | mean η_g | backtracks/step "
        "| max dev. from NumPy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        never = f"> {len(s['losses']) - 1}"
        r4 = never if s["rounds_to_1e-4"] is None else s["rounds_to_1e-4"]
        r8 = never if s["rounds_to_1e-8"] is None else s["rounds_to_1e-8"]
        lines.append(
            f"| {name} | {s['final_loss']:.3g} | {s['final_distance']:.3g} | {r4} | "
            f"{r8} | {s['mean_eta_g']:.3g} | {s['mean_backtracks_per_step']:.2f} | "
            f"{s['max_deviation_from_numpy_reference']:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "figures"))
    ns = p.parse_args(argv)
    summary = run(ns.rounds, ns.out)
    print(format_table(summary))
    print(f"\nwrote {os.path.join(ns.out, 'toy_fig1.png')} and toy_fig1.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
