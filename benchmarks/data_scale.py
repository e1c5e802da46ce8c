"""Scale of the client index: a 100,000-client Dirichlet split and a 3,550-user (FEMNIST-sized) LEAF index.

    python benchmarks/data_scale.py                      # defaults: 1,000,000 labels -> 100,000 clients; 3,550 users
    python benchmarks/data_scale.py --clients 10000 --samples 100000 --leaf-users 500   # quick

What is measured (numpy and Python allocations through ``tracemalloc``; torch tensors built with ``from_numpy``
share numpy's memory and are counted there):

* **Dirichlet split** — ``FederatedDataModule.setup()`` with ``Dirichlet(alpha=0.3)`` over ``--samples`` labels of 10
  classes and ``--clients`` clients: wall time (the validation holdout, the split, ``check_partition`` and the
  per-client bookkeeping; a setup without ``tracemalloc``), and in a second, traced setup the peak traced memory
  and the memory the module *retains* per client beyond the client's index array (array headers, list slots, the
  per-client sample counts). Run with the default ``max_retries=10`` and with ``max_retries=0`` (a single draw,
  then the repair).
* **Dirichlet repair** — ``Dirichlet(alpha=0.005, min_samples=1, max_retries=0).split`` (one draw, then the
  repair) of 10 labels per client, at ``--clients / 8``, ``/ 4``, ``/ 2`` and ``--clients`` clients (at this α the
  draw leaves most clients empty, and the repair fills each): time per repaired client and the time ratio of each
  doubling of the clients (2 for a cost linear in the moves; 4 for a scan of all clients per move).
* **LEAF index** — ``LeafDataModule(name="femnist")`` on LEAF JSON files written here with ``--leaf-users`` users of
  ``--leaf-samples`` samples each (binary pixels keep the files small; the per-user overhead does not depend on the
  sample count): wall time of the first load (JSON parse + Arrow cache write) and of a second, cached load, peak
  traced memory, and retained bytes per user beyond its train and test index arrays and the data tensors.

Both setups run once at a small size first, so the modules they import on first use are not counted as memory
retained per client.

Target (docs/benchmarks.md): < 1 KB per unsampled client beyond its index array.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import tempfile
import time
import tracemalloc

import numpy as np
import torch

from fedlightning.datamodules import ArrayDataset, Dirichlet, FederatedDataModule, LeafDataModule


class _LabelsOnly(FederatedDataModule):
    """A data module over a label vector with one feature per sample (the split is what is measured)."""

    def __init__(self, labels: np.ndarray, **kw):
        super().__init__(**kw)
        self.labels = labels

    def load(self):
        x = torch.from_numpy(np.zeros((len(self.labels), 1), dtype=np.float32))
        ds = ArrayDataset(x, torch.from_numpy(self.labels))
        return ds, None, self.labels


def _index_bytes(arrays) -> int:
    return int(sum(a.nbytes for a in arrays))


def bench_dirichlet(num_samples: int, num_clients: int, max_retries: int, seed: int = 0) -> dict:
    labels = np.random.default_rng(seed).integers(0, 10, num_samples).astype(np.int64)
    partition = Dirichlet(alpha=0.3, max_retries=max_retries)
    dm = _LabelsOnly(labels, num_clients=num_clients, partition=partition, seed=seed)
    gc.collect()
    t = time.perf_counter()
    dm.setup("fit")  # timed without tracemalloc, which slows every allocation
    seconds = time.perf_counter() - t
    dm = _LabelsOnly(labels, num_clients=num_clients, partition=partition, seed=seed)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    dm.setup("fit")
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    data_bytes = dm.train_dataset.x.numel() * 4  # the zeros features (labels existed before)
    idx = _index_bytes(dm.client_indices)
    retained = current - base - data_bytes - idx
    return {
        "clients": num_clients,
        "samples": num_samples,
        "max_retries": max_retries,
        "seconds": seconds,
        "peak_MB": (peak - base) / 1e6,
        "index_MB": idx / 1e6,
        "retained_bytes_per_client_beyond_index": retained / num_clients,
        "min_client_samples": int(min(len(a) for a in dm.client_indices)),
    }


def bench_repair(num_clients: int, seed: int = 0) -> dict:
    """Time of ``Dirichlet(alpha=0.005, min_samples=1, max_retries=0).split`` (one draw, then the repair) of 10 labels
    per client over ``num_clients`` clients, and how many clients the draw left empty (repaired)."""
    labels = np.random.default_rng(seed).integers(0, 10, size=10 * num_clients)
    part = Dirichlet(alpha=0.005, min_samples=0, max_retries=0)
    empty = sum(len(p) == 0 for p in part.split(labels, num_clients, np.random.default_rng(seed)))
    part = Dirichlet(alpha=0.005, min_samples=1, max_retries=0)
    start = time.perf_counter()
    part.split(labels, num_clients, np.random.default_rng(seed))  # the same draw, then the repair
    seconds = time.perf_counter() - start
    return {"clients": num_clients, "repaired": empty, "seconds": seconds}


def _write_leaf(root: str, users: int, per_user: int, seed: int = 0, users_per_file: int = 100) -> None:
    rng = np.random.default_rng(seed)
    for split, n in (("train", per_user), ("test", max(1, per_user // 4))):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        for f, start in enumerate(range(0, users, users_per_file)):
            names = [f"f{u:05d}_{u % 100:02d}" for u in range(start, min(users, start + users_per_file))]
            data = {"users": names, "num_samples": [n] * len(names), "user_data": {}}
            for name in names:
                x = rng.integers(0, 2, (n, 784)).tolist()  # binary pixels: valid LEAF values, short JSON
                data["user_data"][name] = {"x": x, "y": rng.integers(0, 62, n).tolist()}
            with open(os.path.join(root, split, f"all_data_{f}_niid_{split}.json"), "w") as fh:
                json.dump(data, fh)


def bench_leaf(users: int, per_user: int) -> dict:
    import datasets  # noqa: F401  (imported before measuring: the library's import is not the index's cost)
    import pyarrow.compute  # noqa: F401

    tmp = tempfile.mkdtemp(prefix="leaf_scale_")
    try:
        root, cache = os.path.join(tmp, "femnist"), os.path.join(tmp, "hf_cache")
        t = time.perf_counter()
        _write_leaf(root, users, per_user)
        write_s = time.perf_counter() - t
        out = {"users": users, "samples_per_user": per_user, "write_json_seconds": write_s}
        for run in ("first", "cached"):
            dm = LeafDataModule(name="femnist", data_dir=root, cache_dir=cache)
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            t = time.perf_counter()
            dm.setup("fit")
            seconds = time.perf_counter() - t
            current, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            data = sum(t.numel() * t.element_size() for ds in (dm.train_dataset, dm.test_dataset) for t in (ds.x, ds.y))
            idx = _index_bytes(dm.client_indices) + _index_bytes(dm.client_test_indices)
            retained = current - base - data - idx
            out[f"{run}_load_seconds"] = seconds
            out[f"{run}_peak_MB"] = (peak - base) / 1e6
            out[f"{run}_retained_bytes_per_user_beyond_index"] = retained / dm.num_clients
            out["clients"] = dm.num_clients
            del dm
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--clients", type=int, default=100_000)
    ap.add_argument("--leaf-users", type=int, default=3_550)
    ap.add_argument("--leaf-samples", type=int, default=4)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu = platform.processor() or platform.machine()
    results = {"machine": f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}"}
    bench_dirichlet(10_000, 100, 10)  # modules that setup imports on first use: not counted as retained per client
    results["dirichlet"] = [bench_dirichlet(args.samples, args.clients, r) for r in (10, 0)]
    bench_leaf(20, 1)  # the same for the LEAF reader's modules (Hugging Face datasets, Arrow)
    results["leaf"] = bench_leaf(args.leaf_users, args.leaf_samples)
    results["repair"] = [bench_repair(args.clients // d) for d in (8, 4, 2, 1)]
    print(f"machine: {results['machine']}")
    print("\nDirichlet(alpha=0.3) split, FederatedDataModule.setup()")
    print(
        "| clients | samples | max_retries | time (s) | peak traced (MB) | index arrays (MB) "
        "| retained B/client beyond index |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["dirichlet"]:
        print(
            f"| {r['clients']:,} | {r['samples']:,} | {r['max_retries']} | {r['seconds']:.2f} | {r['peak_MB']:.1f} | "
            f"{r['index_MB']:.1f} | {r['retained_bytes_per_client_beyond_index']:.0f} |"
        )
    r = results["leaf"]
    print("\nLEAF FEMNIST-layout index, LeafDataModule.setup()")
    print("| users | samples/user | load | time (s) | peak traced (MB) | retained B/user beyond index + data |")
    print("|---:|---:|---|---:|---:|---:|")
    for run in ("first", "cached"):
        print(
            f"| {r['clients']:,} | {r['samples_per_user']} | {run} | {r[f'{run}_load_seconds']:.2f} | "
            f"{r[f'{run}_peak_MB']:.1f} | {r[f'{run}_retained_bytes_per_user_beyond_index']:.0f} |"
        )
    print("\nDirichlet(alpha=0.005, min_samples=1, max_retries=0) repair, 10 labels per client")
    print("| clients | repaired clients | time (s) | µs per repaired client | time / time at half the clients |")
    print("|---:|---:|---:|---:|---:|")
    for i, r in enumerate(results["repair"]):
        ratio = f"{r['seconds'] / results['repair'][i - 1]['seconds']:.2f}" if i else "-"
        print(
            f"| {r['clients']:,} | {r['repaired']:,} | {r['seconds']:.2f} | "
            f"{1e6 * r['seconds'] / max(1, r['repaired']):.1f} | {ratio} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
