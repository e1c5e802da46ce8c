"""Your own data as a federated data set: :class:`DatasetDataModule` (``FederatedDataModule.from_datasets``).

``DatasetDataModule(train, test=None, partition=..., num_clients=..., ...)`` wraps any map-style torch ``Dataset``
(samples of any structure: ``(x, y)``, longer tuples, dicts, nested) or Hugging Face ``datasets.Dataset`` (dict
samples) in the machinery of the bundled modules: the validation split, the partitioner, per-client loaders and,
when ``(x, y)`` samples fit in memory, the batched :class:`~fedlightning.datamodules.ArrayDataset` fast path. Every
batch it serves is what the user's own DataLoader (their ``collate_fn``) would build from the client's samples.
:func:`from_datamodule` federates an existing ``LightningDataModule``.

The rules (all decisions ours unless a source is named) are in the docstring of :class:`DatasetDataModule`.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils._pytree import tree_flatten
from torch.utils.data import BatchSampler, Dataset, IterableDataset, RandomSampler, SequentialSampler, TensorDataset
from torch.utils.data._utils.collate import default_collate

from fedlightning._lightning_compat import BATCH_TRANSFER_HOOKS, transfer_hook_owners
from fedlightning._reference import reference_mode
from fedlightning._validation import flag, integer, one_of
from fedlightning.datamodules.base import (
    DEFAULT_VAL_FRACTION,
    ArrayDataset,
    FederatedDataModule,
    preserved_random_states,
    random_states_moved,
)
from fedlightning.datamodules.checks import as_label_array
from fedlightning.datamodules.partition import IID, Partitioner

__all__ = [
    "DatasetDataModule",
    "SampleView",
    "WrappedDataModule",
    "from_datamodule",
    "LABEL_KEYS",
    "DEFAULT_MAX_IN_MEMORY_BYTES",
    "TARGET_SPOT_CHECKS",
]

#: Dict keys tried, in order, for the label when ``label_key`` is not given (after a Hugging Face ``ClassLabel``
#: column). Ours: the names torchvision, Hugging Face and scikit-learn-style code use most.
LABEL_KEYS = ("label", "labels", "y", "target", "targets")
#: ``in_memory="auto"`` materialises a data set only below this size (ours: 1 GiB holds CIFAR-10's 50,000 float32
#: training images, 614 MB, and stays well inside the memory of a laptop).
DEFAULT_MAX_IN_MEMORY_BYTES = 1 << 30
#: Samples read to check a ``targets`` attribute against the labels the samples serve when there is no in-memory
#: copy to compare it with (ours: evenly spaced over the set; a ``target_transform`` changes nearly every label, and
#: 16 reads cost milliseconds even for image sets with transforms).
TARGET_SPOT_CHECKS = 16
_TARGETS = "the train.targets attribute"


def _is_hf(dataset: Any) -> bool:
    """True for a Hugging Face ``datasets.Dataset`` (only checked when ``datasets`` is already imported)."""
    mod = sys.modules.get("datasets")
    return mod is not None and isinstance(dataset, getattr(mod, "Dataset", ()))


def _torch_formatted(dataset: Any) -> Any:
    """A Hugging Face data set as :class:`DatasetDataModule` reads it: with ``with_format("torch")`` when it has no
    format of its own (its numbers then arrive as tensors), keeping the columns it selects (``set_format(columns=...)``
    with no type) and ``output_all_columns``; a data set with a format type (``"torch"``, ``"numpy"``, ...) or a
    transform (``with_transform`` / ``set_transform``, format type ``"custom"``) is read as it is, so its samples are
    what ``dataset[i]`` returns to the user."""
    fmt = dataset.format
    if fmt["type"] is not None:
        return dataset
    return dataset.with_format("torch", columns=fmt["columns"], output_all_columns=fmt["output_all_columns"])


def _float64_columns(features: Any, columns: list[str] | None) -> list[str]:
    """The columns of a Hugging Face ``features`` mapping (those in ``columns`` when given) that hold float64 values,
    also inside lists, dicts and arrays."""

    def holds(feature: Any) -> bool:
        if isinstance(feature, dict):
            return any(holds(f) for f in feature.values())
        if isinstance(feature, (list, tuple)):
            return any(holds(f) for f in feature)
        inner = getattr(feature, "feature", None)
        if inner is not None:
            return holds(inner)
        return getattr(feature, "dtype", None) in ("float64", "double")

    return [k for k, f in (features or {}).items() if (columns is None or k in columns) and holds(f)]


def _say_float64_columns(dataset: Any, name: str) -> None:
    """One info line when the ``with_format("torch")`` that :func:`_torch_formatted` applied serves float64 columns:
    Hugging Face's torch format casts floating values to float32 (so does its numpy format for lists). Decision
    (ours): keep that convention, which a float32 model needs for data stored as float64 (``from_pandas``,
    ``from_dict`` of NumPy arrays), and say so, with the way to keep float64."""
    columns = _float64_columns(getattr(dataset, "features", None), dataset.format.get("columns"))
    if columns:
        rank_zero_info(
            f"{name}: Hugging Face's torch format serves the float64 column(s) {', '.join(map(repr, columns))} as "
            "float32 tensors; to keep float64, give the data set a transform that builds the tensors "
            '(e.g. dataset.with_transform(lambda b: {"x": torch.tensor(b["x"], dtype=torch.float64), ...})), which '
            "is read as it is"
        )


def _hf_label_column(dataset: Any, reader: _Reader) -> bool:
    """Whether the labels ``dataset`` serves are its Hugging Face column ``reader.label_key`` (read in one go, without
    a pass over the samples): a Hugging Face data set without a transform, whose dict samples hold the label under
    a column's name. A transform may change or rename the labels, so its labels are read through it."""
    return (
        _is_hf(dataset)
        and reader.kind == "dict"
        and dataset.format["type"] != "custom"
        and reader.label_key in dataset.column_names
    )


def _is_hf_dict(dataset: Any) -> bool:
    """A Hugging Face ``DatasetDict`` / ``IterableDatasetDict`` (a dict of splits, indexed by split name)."""
    mod = sys.modules.get("datasets")
    kinds = tuple(getattr(mod, k) for k in ("DatasetDict", "IterableDatasetDict") if hasattr(mod, k)) if mod else ()
    return bool(kinds) and isinstance(dataset, kinds)


def _is_hf_iterable(dataset: Any) -> bool:
    mod = sys.modules.get("datasets")
    return mod is not None and isinstance(dataset, getattr(mod, "IterableDataset", ()))


def _describe(value: Any) -> str:
    if isinstance(value, (Tensor, np.ndarray)):
        return f"a {type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} elements"
    return (
        f"a {type(value).__name__} ({value!r})"
        if isinstance(value, (int, float, str, bool))
        else f"a {type(value).__name__}"
    )


class _Reader:
    """Reads the label of one sample, for label partitions and label checks only (batches are the samples as they
    are): ``kind`` is ``"tuple"`` (position ``label_key``), ``"dict"`` (key ``label_key``) or ``"none"`` (no label
    found in the samples). ``pair``: the samples are ``(x, y)`` pairs (the in-memory fast path can hold them)."""

    def __init__(self, kind: str, label_key: Any = None, pair: bool = False):
        self.kind, self.label_key, self.pair = kind, label_key, pair
        #: the label of sample 0 (read once, at construction)
        self.label0: Any = None

    def __call__(self, sample: Any) -> Any:
        return None if self.kind == "none" else sample[self.label_key]

    def describe(self) -> str:
        if self.kind == "tuple":
            return "position 1 of the (x, y) samples" if self.pair else f"position {self.label_key} of the samples"
        if self.kind == "dict":
            return f"key {self.label_key!r} of the dict samples"
        return "a label in the samples (none found; pass label_key=)"

    def where(self, name: str, i: int) -> str:
        """Python syntax for sample ``i``'s label in data set ``name``: ``train[0][1]`` / ``train[0]['label']``."""
        return f"{name}[{i}][{self.label_key!r}]"


class SampleView(Dataset):
    """``dataset[i]`` exactly as the data set returns it (the per-sample path of :class:`DatasetDataModule`; the
    DataLoader's ``collate_fn`` batches the samples).

    ``cast_labels`` (set by :class:`DatasetDataModule` for class labels stored as floats) serves the label that
    ``reader`` finds as an ``int64`` class id (in a copy of the tuple / dict; every other element untouched); a label
    that is not a whole number then raises a ValueError naming the sample (``name`` is the data set's name in that
    message)."""

    def __init__(self, dataset: Any, reader: _Reader, cast_labels: bool = False, name: str = "train"):
        self.dataset, self.reader = dataset, reader
        self.cast_labels, self.name = bool(cast_labels), name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        sample = self.dataset[int(i)]
        if not self.cast_labels or self.reader.kind == "none":
            return sample
        key = self.reader.label_key
        y = _class_id(sample[key], f"{self.name}[{int(i)}]")
        if isinstance(sample, Mapping):
            return {**sample, key: y}
        out = list(sample)
        out[key] = y
        if isinstance(sample, list):
            return out
        return tuple(out) if type(sample) is tuple else type(sample)(*out)  # a namedtuple keeps its type


class DatasetDataModule(FederatedDataModule):
    """A federated data set over your own ``train`` (and optional ``test``) data set.

    ``FederatedDataModule.from_datasets(train, test, ...)`` returns one; from YAML it is
    ``data: {class_path: fedlightning.datamodules.DatasetDataModule, init_args: {train: {class_path: ...}}}``.

    Args:
        train: the training set: a map-style torch ``Dataset`` (``len`` and ``dataset[i]``) or a Hugging Face
            ``datasets.Dataset``. The validation split is held out of it and the clients split the rest.
        test: the global test set (same sample structure rules), or None for no test set: then
            :meth:`test_dataloader` raises and ``python train.py fit`` skips its test after fit with a warning.
        labels: one class label per training sample (overrides every automatic source; see "Labels").
        num_classes: the number of classes of the served labels (the model's classes); labels outside
            ``0 … num_classes − 1`` are then an error at setup. Default: the size of the training set's Hugging Face
            ``ClassLabel`` label feature, else unknown. See "Label checks".
        check_labels: check the served labels as class ids and serve float class labels as int64 (default
            True); False serves the labels exactly as the data set returns them, unchecked. See "Label checks".
        label_key: where the label of a sample is: a dict key (Hugging Face column) or a tuple position (int);
            default: see "Labels". Used to find labels, never to reshape the batches.
        client_key: where a sample's client is (a natural split, such as a ``writer_id`` or ``user`` column): a dict
            key (Hugging Face column) or a tuple position, read from the training samples and, when there is one, the
            test samples. See "Natural clients".
        client_ids: one client id per training sample (in place of ``client_key`` for the training set); see
            "Natural clients".
        test_client_ids: one client id per test sample (in place of ``client_key`` for the test set).
        val: a separate validation set (e.g. a LightningDataModule's validation data): it is served by
            :meth:`val_dataloader` and nothing is held out of ``train`` (``val_fraction`` then defaults to 0; a
            positive ``val_fraction`` with ``val`` is a ValueError). Its labels are served and checked as the test
            set's (see "Label checks").
        train_eval: the training samples as evaluation reads them: the same samples in the same order as ``train``,
            without random augmentation (e.g. the same torchvision data set built with the evaluation transform).
            The validation hold-out, :meth:`train_eval_dataloader` and the evaluation callbacks read it
            (:meth:`evaluation_view`), as the bundled CIFAR module reads its un-augmented view; clients train on
            ``train``. Decision (ours): without it, a ``val_fraction`` hold-out of a ``train`` that reads its
            samples at random (a ``transform`` attribute, or two reads of a sample that differ) is validated on
            augmented samples, with a warning saying so. A length other than ``train``'s is a ValueError.
        collate_fn: your DataLoader's ``collate_fn``; it builds every client, validation and test batch (None:
            torch's ``default_collate``).
        drop_last: drop every client epoch's last partial batch (see "DataLoader options").
        pin_memory, persistent_workers, prefetch_factor, worker_init_fn: passed to every per-sample DataLoader
            (see "DataLoader options").
        in_memory: ``"auto"`` (default), ``True`` or ``False``; see "In memory".
        max_in_memory_bytes: the size limit of ``in_memory="auto"``; default ``DEFAULT_MAX_IN_MEMORY_BYTES``
            (1 GiB, ours).
        num_clients, batch_size, partition, seed, eval_batch_size, num_workers, rounds_per_epoch, val_fraction:
            as :class:`~fedlightning.datamodules.FederatedDataModule` (partition default IID, val_fraction
            default 0.1).

    Batches. A client's batch is ``collate_fn([dataset[i] for i in batch_indices])``: exactly what your DataLoader
    would hand ``training_step`` (tuples, 3-tuples, dicts, nested structures, padded sequences from a pad collate).
    The framework only chooses which samples each client owns (partition) and in what order (seeded by ``(seed,
    round, client)``). Two exceptions, both documented policies: the in-memory fast path (below) serves ``(x, y)``
    pair samples as a tuple ``(x, y)`` of stacked tensors where ``default_collate`` gives a list ``[x, y]`` of the
    same tensors; and with ``check_labels`` a float class label is served as ``int64`` (see "Label checks"). A
    Hugging Face data set without a format of its own is read with ``with_format("torch")`` (its numbers arrive as
    tensors), keeping the columns selected by ``set_format(columns=...)``; one with a format type
    (``with_format("numpy")``, ``with_format("torch", columns=[...])``) or a transform (``with_transform`` /
    ``set_transform``) is read as it is: ``dataset[i]`` exactly as you get it. Sample 0 of each data set is read at
    construction, so an empty data set or a ``label_key`` that is not in the samples fails there.

    Random states (decision, ours). Construction and :meth:`setup` read samples (sample 0 of each set, the
    in-memory copy, the reread probe of "In memory", the label pass of a label partition) under the process's
    random states and put torch's CPU generator, Python's ``random`` and numpy's global generator back as they
    were afterwards, so a data set that draws random numbers in ``__getitem__`` leaves the process's random streams
    (the model's initialisation, for one) as they would be without the data module.

    DataLoader options (decisions, ours). ``collate_fn`` builds client and evaluation batches. ``num_workers``,
    ``pin_memory``, ``worker_init_fn``, ``persistent_workers`` and ``prefetch_factor`` go to every per-sample
    DataLoader (a client's loader is built per round, so ``persistent_workers`` keeps workers across that client's
    epochs within a round); the last two need ``num_workers > 0`` (else a ValueError). The workers' base seed is
    drawn from a generator seeded by ``(seed, "workers", round, client)``, so random transforms in workers are
    reproducible. ``drop_last=True`` drops every client epoch's last partial batch, as ``DataLoader`` does, except
    that a client smaller than one batch serves all its samples as one batch (so a sampled client always has a batch
    for its local steps); local steps cycle through epochs as before, each epoch of ``floor(n_i / b)`` batches.
    Evaluation loaders never drop samples. The in-memory fast path has no workers and no pinning (its batches are
    views of tensors already in memory).

    Labels. Label-based partitions (every partitioner except :class:`~fedlightning.datamodules.IID`) need one
    class label per training sample; the first source that gives one is used, in this order: ``labels=``; the
    second tensor of a two-tensor ``TensorDataset``; the label column of a Hugging Face data set; a ``targets``
    attribute of the training set's length (torchvision's convention) when it agrees with the labels the samples
    serve (all of them against the in-memory copy, else :data:`TARGET_SPOT_CHECKS` samples read; a
    ``target_transform`` makes them differ, and the next source is used, with a warning); the labels of the in-memory
    copy; and, for a label-based partition only, one pass reading the label of every sample. The label of a sample is at
    ``label_key`` (a dict key or a tuple position); without it: position 1 of a two-element tuple / list, else for a
    dict the first ``ClassLabel`` column of a Hugging Face data set, else the first of :data:`LABEL_KEYS`
    (``label``, ``labels``, ``y``, ``target``, ``targets``) present; other samples (3-tuples, bare tensors) have
    no label unless ``label_key`` or ``labels=`` says where. A label must be an integer, a bool, a
    string or an integer-valued float (a 0-d tensor / array of those counts); anything else (a vector, a
    continuous regression target) cannot drive a label partition, and a label-based partition without labels is a
    ValueError naming every source tried and how to pass ``labels=``. The label column of a Hugging Face data set is
    a source only without a transform (which may change or rename the labels): with one, a label partition reads
    every sample's label through it (``labels=`` saves that pass). The validation split is stratified by these
    labels exactly as for the bundled modules; with IID and no cheap source (no pass is made for IID) it is a
    seeded uniform draw, the stratified split of a single class.

    Natural clients (``client_key`` or ``client_ids``; decisions, ours, as Flower's ``NaturalIdPartitioner``
    groups a column's values). Every distinct id of the training samples is one client; the clients are ordered by
    id (``numpy.unique``'s order: numbers ascending, strings lexicographically), ``client_names`` holds the ids as
    strings, and each client's rows are its samples in data-set order. ``partition`` does not apply (giving one is a
    ValueError) and ``num_clients`` is ignored, as for the bundled natural splits (LEAF). The validation split is
    per client (``floor(val_fraction · n_i)`` of each client's samples, seeded; :class:`FederatedDataModule`).
    The test samples with a client's id are its own test data (``client_test_indices``: what
    :class:`~fedlightning.callbacks.ClientEvaluation` evaluates); test samples whose id no training sample has stay
    in the global test set only, with a warning that counts them. An id must be a scalar (integer, string, bool, a
    whole float, or a 0-d tensor / array of one); anything else is a ValueError naming the sample. The ids are read
    from a Hugging Face column directly (a data set without a transform), else by one pass over the samples at
    setup.

    In memory. The bundled modules' fast path (one tensor indexing per batch, no per-sample fetch or collate)
    needs the whole set as two tensors: it applies only to ``(x, y)`` pair samples (a plain tuple or list; a
    namedtuple keeps per-sample loading, so that batches keep its type) without a ``collate_fn``
    (``in_memory=True`` with other samples, or with a ``collate_fn``, is a ValueError). ``in_memory=True``
    materialises every pair data set: ``x`` and ``y`` are the
    default collate of all samples (the tensors a DataLoader batch of them would hold, so both paths serve equal
    batches); samples whose ``x`` or ``y`` differ in shape or dtype, or are not numbers / arrays / tensors, are a
    ValueError. ``in_memory=False`` keeps per-sample loading (a DataLoader over :class:`SampleView`, with
    ``num_workers`` workers). ``in_memory="auto"`` materialises when it is free or safe: an
    :class:`~fedlightning.datamodules.ArrayDataset` or a two-tensor ``TensorDataset`` is used as it is (no copy);
    any other pair data set is
    read sample by sample, but only when it has no ``transform`` / ``transforms`` attribute set, nor a data set it
    wraps (``Subset``, ``random_split``, ``ConcatDataset``) (torchvision's
    convention: a random augmentation would be frozen into one draw; pass ``in_memory=True`` for a deterministic
    transform such as ``ToTensor``), when reading each of up to :data:`REREAD_SAMPLES` samples twice gives the same
    values (a random augmentation written into ``__getitem__``, which no attribute announces, would be frozen too;
    a random flip of probability ½ goes unseen by all 8 with probability 1/256), and only when
    ``len × (bytes of sample 0's x and y)`` is at most
    ``max_in_memory_bytes``, and all samples have sample 0's shapes and dtypes; otherwise it stays per-sample.
    ``dm.in_memory`` tells, after :meth:`setup`, whether the training set took the fast path.

    Label checks (decisions, ours; ``check_labels=False`` turns all of them off). These concern the labels *served*
    to the model (``y`` of every batch), not the partition labels of ``labels=``.

    * A string label in sample 0 is a ValueError at construction that says how to make class ids (a Hugging Face
      data set: ``class_encode_column``; a ``ClassLabel`` column already serves integer ids).
    * A train and a test ``ClassLabel`` with different names is a ValueError (one id would mean two classes).
    * Float labels are class ids only when the arguments say so: ``num_classes`` is known (given, or a
      ``ClassLabel`` feature), or the partition is label-based and splits by the samples' own labels (not by
      ``labels=``). Their values never decide it, so the in-memory and the per-sample paths serve the same dtype
      (only the in-memory path sees every value at setup) and a regression target that holds whole numbers (counts)
      stays float. Float labels that are not class ids are served as they are, in every set.
    * Float class ids are served as ``int64`` in the training, test and separate validation (``val=``) sets, with a
      warning naming what makes them class ids (``BCEWithLogitsLoss`` wants float targets). Known labels are cast
      at setup, where one that is not a whole number is a ValueError; labels not known in advance are cast per
      sample, and a fractional one raises a ValueError naming the sample when it is read.
    * The labels are known without another pass when the set is in memory, is a Hugging Face data set without a
      transform (its label column), or (the training set) had its labels read for a label partition.
    * At setup (:class:`~fedlightning.datamodules.FederatedDataModule`, "Data checks"), the known labels of the
      training, test and separate validation sets are checked: not finite, negative, not a whole number or
      ``>= num_classes`` (the last two when ``num_classes`` is known) is a ValueError naming the split, the client,
      the sample and the value. Labels that are not known (per-sample data sets without a label source) are not
      scanned: reading every sample costs a pass over the data, which the per-sample path exists to avoid.
    """

    def __init__(
        self,
        train: Dataset,
        test: Dataset | None = None,
        *,
        labels: Sequence[Any] | None = None,
        num_classes: int | None = None,
        check_labels: bool = True,
        label_key: str | int | None = None,
        client_key: str | int | None = None,
        client_ids: Sequence[Any] | None = None,
        test_client_ids: Sequence[Any] | None = None,
        val: Dataset | None = None,
        train_eval: Dataset | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        in_memory: bool | str = "auto",
        max_in_memory_bytes: int = DEFAULT_MAX_IN_MEMORY_BYTES,
        num_clients: int = 100,
        batch_size: int = 50,
        partition: Partitioner | None = None,
        seed: int = 0,
        eval_batch_size: int = 1024,
        num_workers: int = 0,
        rounds_per_epoch: int = 1000,
        val_fraction: float | None = None,
    ):
        if val is not None and val_fraction:
            raise ValueError(
                f"val_fraction={val_fraction} holds out validation samples of train, but val= gives a validation set; "
                f"pass one of them (val_fraction=0 with val=)"
            )
        if val_fraction is None:
            val_fraction = 0.0 if val is not None else DEFAULT_VAL_FRACTION
        super().__init__(
            num_clients=num_clients,
            batch_size=batch_size,
            partition=partition,
            seed=seed,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
            rounds_per_epoch=rounds_per_epoch,
            val_fraction=val_fraction,
        )
        self.in_memory_option = one_of("in_memory", in_memory, (True, False, "auto"), show_name=True)
        self.max_in_memory_bytes = integer("max_in_memory_bytes", max_in_memory_bytes, 0, show_name=True)
        self.check_labels = flag("check_labels", check_labels)
        num_classes = integer("num_classes", num_classes, 1, allow_none=True, show_name=True)
        self.label_key = label_key
        self._set_loader_options(collate_fn, drop_last, pin_memory, persistent_workers, prefetch_factor, worker_init_fn)
        self._train_source = self._check_source(train, "train")
        self._test_source = None if test is None else self._check_source(test, "test")
        self._val_source = None if val is None else self._check_source(val, "val")
        #: the separate validation set (``val=``) as served (set by setup)
        self.val_dataset: Dataset | None = None
        n = len(self._train_source)
        self._train_eval_source = None if train_eval is None else self._check_source(train_eval, "train_eval")
        if self._train_eval_source is not None and len(self._train_eval_source) != n:
            raise ValueError(
                f"train_eval has {len(self._train_eval_source)} samples but train has {n}: train_eval must be the "
                "training set's samples in the same order, read without augmentation"
            )
        self._train_eval_view: Dataset | None = None  # train_eval as served (set by setup)
        self._random_reads: dict[int, bool] = {}  # id of a data set -> whether it reads its samples at random
        self._client_sources = self._check_client_options(client_key, client_ids, test_client_ids, partition, test)
        #: natural clients: every client's training rows (None: the partition splits the samples; set by load)
        self._natural: list[np.ndarray] | None = None
        #: natural clients: the client ids as strings, in client order (set by load)
        self.client_names: list[str] = []
        if self._client_sources is None and self._num_clients > n:
            raise ValueError(
                f"num_clients={self._num_clients} exceeds the {n} training samples: every client needs at least "
                f"one sample; lower num_clients"
            )
        with preserved_random_states():  # sample 0 of each set is read (class docstring, "Random states")
            self._train_reader = self._reader(self._train_source, "train")
            self._test_reader = None if test is None else self._reader(self._test_source, "test")
            self._val_reader = None if val is None else self._reader(self._val_source, "val")
            self._train_eval_reader = (
                None if train_eval is None else self._reader(self._train_eval_source, "train_eval")
            )
        self._given_labels = None if labels is None else self._given_label_ids(labels, n)
        #: whether the training set took the in-memory ArrayDataset path (set by setup)
        self.in_memory: bool | None = None
        names = self._class_names()
        #: number of classes: ``num_classes=``, else the size of the training set's ``ClassLabel``, else None
        self.num_classes = num_classes if num_classes is not None else (len(names) if names is not None else None)
        self._classes_from = (
            f"num_classes={num_classes}"
            if num_classes is not None
            else f"the ClassLabel feature {self._train_reader.label_key!r} of train"
            if names is not None
            else None
        )
        self._label_arrays: dict = {}
        self._read_pass: np.ndarray | None = None
        self._partition_labels: np.ndarray | None = None  # the labels the partition used (setup)
        self._read_eval_labels: dict[str, np.ndarray | None] = {}  # _labels_by_reading's, by set name

    @property
    def needs_labels(self) -> bool:
        """Whether the partition is label-based: every partitioner except IID (a partitioner may say otherwise
        with a ``needs_labels`` attribute)."""
        if self._client_sources is not None:
            return False  # natural clients: no partition
        return bool(getattr(self.partition, "needs_labels", not isinstance(self.partition, IID)))

    def natural_clients(self) -> list[np.ndarray] | None:
        """The natural clients' training rows (``client_key`` / ``client_ids``), else None (the partition)."""
        return self._natural

    # ------------------------------------------------------------------ natural clients
    def _check_client_options(
        self, client_key: Any, client_ids: Any, test_client_ids: Any, partition: Any, test: Any
    ) -> dict[str, Any] | None:
        """The natural clients' id sources by set name (``"train"``, ``"test"``): an array of ids (given) or a
        key to read; None without natural clients (rules: class docstring, "Natural clients")."""
        if client_key is None and client_ids is None:
            if test_client_ids is not None:
                raise ValueError(
                    "test_client_ids gives the test samples' clients, but the training samples have none; pass "
                    "client_ids= (or client_key=) for the training set too"
                )
            return None
        if client_key is None and test is not None and test_client_ids is None:
            raise ValueError(
                "client_ids gives the training samples' clients, but the test set's samples have none: pass "
                "test_client_ids=[one client id per test sample] (each client's own test data, what ClientEvaluation "
                "evaluates it on)"
            )
        if partition is not None:
            given = "client_key=" + repr(client_key) if client_key is not None else "client_ids="
            raise ValueError(
                f"{given} makes each distinct id a client (a natural split), but partition={partition!r} splits the "
                "samples another way; pass one of them"
            )
        if client_key is not None and (isinstance(client_key, bool) or not isinstance(client_key, (str, int))):
            raise ValueError(f"client_key must be a dict key (str) or a tuple position (int), got {client_key!r}")
        sources: dict[str, Any] = {}
        for name, dataset, given in (
            ("train", self._train_source, client_ids),
            ("test", self._test_source, test_client_ids),
        ):
            if dataset is None:
                if given is not None:
                    raise ValueError("test_client_ids are given, but there is no test set (test=None)")
                continue
            if given is not None:
                arg = "client_ids" if name == "train" else "test_client_ids"
                sources[name] = _client_id_array(given, arg, name)
                if len(sources[name]) != len(dataset):
                    raise ValueError(
                        f"{arg} holds {len(sources[name])} ids for the {len(dataset)} {name} samples; pass one client "
                        f"id per {name} sample, in the data set's order"
                    )
            elif client_key is not None:
                sources[name] = _key_position(dataset[0], client_key, name)
        return sources

    def _client_ids_of(self, name: str) -> np.ndarray | None:
        """The client id of every sample of set ``name`` (given, a Hugging Face column, or one pass)."""
        source = self._client_sources.get(name)
        if source is None or isinstance(source, np.ndarray):
            return source
        dataset = self._train_source if name == "train" else self._test_source
        if isinstance(source, str) and _hf_label_column(dataset, _Reader("dict", source)):  # a column, no transform
            values = list(dataset.with_format(None, columns=[source])[source])
        else:
            values = []
            for i in range(len(dataset)):
                sample = dataset[i]
                try:
                    values.append(sample[source])
                except (KeyError, IndexError, TypeError) as err:
                    raise ValueError(
                        f"client_key={source!r}: {name} sample {i} has no {source!r} ({_describe(sample)}: "
                        f"{type(err).__name__}: {err}); every sample needs its client id there"
                    ) from None
        return _client_id_array(values, f"client_key={source!r} of {name}", name)

    def _natural_clients(self) -> None:
        """``_natural``, ``client_names`` and ``client_test_indices`` from the samples' client ids."""
        ids = self._client_ids_of("train")
        names, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        order = np.argsort(inverse, kind="stable")
        self._natural = [np.sort(rows).astype(np.int64) for rows in np.split(order, np.cumsum(counts)[:-1])]
        self.client_names = [str(v) for v in names.tolist()]
        test_ids = self._client_ids_of("test") if self._test_source is not None else None
        if test_ids is None:
            self.client_test_indices = None
            return
        try:
            position = {v: i for i, v in enumerate(names.tolist())}
            own = [position.get(v, -1) for v in test_ids.tolist()]
        except TypeError as err:  # an id that cannot be compared with the training ids
            raise ValueError(f"the test samples' client ids cannot be matched with the training ids: {err}") from err
        own = np.asarray(own, dtype=np.int64)
        self.client_test_indices = [np.flatnonzero(own == c).astype(np.int64) for c in range(len(names))]
        stray = int((own < 0).sum())
        if stray:
            first = test_ids[int(np.flatnonzero(own < 0)[0])]
            warnings.warn(
                f"{type(self).__name__}: {stray} test sample(s) have a client id that no training sample has (e.g. "
                f"{_scalar(first)!r}); they count in the global test set only, not in any client's own test data",
                UserWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ construction checks
    def _set_loader_options(
        self, collate_fn, drop_last, pin_memory, persistent_workers, prefetch_factor, worker_init_fn
    ) -> None:
        """The DataLoader options (rules: class docstring, "DataLoader options"), checked."""
        for name, fn in (("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be a function, got {fn!r}")
        self.collate_fn, self.worker_init_fn = collate_fn, worker_init_fn
        self.drop_last = flag("drop_last", drop_last)
        self.pin_memory = flag("pin_memory", pin_memory)
        self.persistent_workers = flag("persistent_workers", persistent_workers)
        self.prefetch_factor = integer("prefetch_factor", prefetch_factor, 1, allow_none=True, show_name=True)
        if self.num_workers == 0:
            for name in ("persistent_workers", "prefetch_factor"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} needs worker processes, but num_workers=0; set "
                        f"num_workers > 0 or remove {name}"
                    )

    @staticmethod
    def _check_source(dataset: Any, name: str) -> Any:
        if _is_hf_dict(dataset):
            splits = list(dataset.keys())
            first = splits[0] if splits else "train"
            raise ValueError(
                f"{name} is a Hugging Face {type(dataset).__name__} of the splits {splits} (what load_dataset and "
                f"load_from_disk return for a folder of splits); pass one split, e.g. {name}=dataset[{first!r}]"
            )
        if _is_hf_iterable(dataset):
            raise ValueError(
                f"{name} is a Hugging Face IterableDataset (streaming); DatasetDataModule needs a map-style data set "
                f"with len() and [i]: load it without streaming=True, or materialise it with "
                f"datasets.Dataset.from_generator"
            )
        if _is_hf(dataset):
            formatted = _torch_formatted(dataset)
            if formatted is not dataset:
                _say_float64_columns(formatted, name)
            dataset = formatted
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(
                f"{name} must be a map-style data set (a torch Dataset with __len__ and __getitem__, or a Hugging "
                f"Face datasets.Dataset), got {type(dataset).__name__}"
            )
        if len(dataset) == 0:
            raise ValueError(f"{name} is empty (len 0); pass a data set with at least one sample")
        return dataset

    def _reader(self, dataset: Any, name: str) -> _Reader:
        sample = dataset[0]
        reader = self._structure(dataset, name, sample)
        reader.label0 = reader(sample)
        if self.check_labels and isinstance(reader.label0, (str, bytes)):
            if _is_hf(dataset):
                fix = (
                    f"cast the column with {name} = {name}.class_encode_column({reader.label_key!r}) (a Hugging "
                    f"Face ClassLabel maps each string to a class id)"
                )
            else:
                fix = (
                    "return integer class ids from __getitem__ (e.g. classes.index(label)), or build a Hugging Face "
                    "data set and cast the column with class_encode_column"
                )
            raise ValueError(
                f"{name} labels are strings ({reader.where(name, 0)} is {_scalar(reader.label0)!r}), but a model needs "
                f"integer class ids: {fix}; or pass check_labels=False to serve the strings as they are"
            )
        return reader

    def _structure(self, dataset: Any, name: str, sample: Any) -> _Reader:
        """Where the label of samples shaped like ``sample`` is (rules: class docstring, "Labels")."""
        label_key = self.label_key
        if isinstance(sample, Mapping):
            keys = list(sample)
            if label_key is None:
                found = [k for k in self._class_label_columns(dataset) if k in sample]
                found += [k for k in LABEL_KEYS if k in sample]
                return _Reader("dict", found[0]) if found else _Reader("none")
            if label_key not in sample:
                raise ValueError(f"label_key={label_key!r} is not a key of {name} sample 0 (keys {keys})")
            return _Reader("dict", label_key)
        if isinstance(sample, (tuple, list)):
            n = len(sample)
            # a namedtuple (or other tuple type) is not a pair: its batches keep its type (default_collate's), which
            # the in-memory path's plain tuples would lose (batch.x)
            plain = type(sample) in (tuple, list)
            if label_key is None:
                return _Reader("tuple", 1, pair=plain) if n == 2 else _Reader("none")
            if isinstance(label_key, bool) or not isinstance(label_key, int) or not -n <= label_key < n:
                raise ValueError(
                    f"label_key={label_key!r} is not a position of {name} sample 0 ({_describe(sample)}); pass an "
                    f"integer position from 0 to {n - 1}"
                )
            return _Reader("tuple", label_key % n, pair=plain and n == 2 and label_key % n == 1)
        if label_key is not None:
            raise ValueError(
                f"label_key={label_key!r} names a key or position, but {name} sample 0 is {_describe(sample)}; pass "
                f"labels=[one class per training sample] instead"
            )
        return _Reader("none")

    @staticmethod
    def _class_label_columns(dataset: Any) -> list[str]:
        features = getattr(dataset, "features", None) if _is_hf(dataset) else None
        if not features:
            return []
        mod = sys.modules["datasets"]
        return [k for k, f in features.items() if isinstance(f, mod.ClassLabel)]

    def _class_names(self) -> list[str] | None:
        """The names of the training set's ``ClassLabel`` label feature (None when it is not one). A test set whose
        label is a ``ClassLabel`` of other names is a ValueError: one class id would mean two classes."""
        train = _label_feature(self._train_source, self._train_reader)
        if train is None:
            return None
        names = list(train.names)
        test = None if self._test_source is None else _label_feature(self._test_source, self._test_reader)
        if test is not None and list(test.names) != names:
            other = list(test.names)
            i = next((i for i, (a, b) in enumerate(zip(names, other)) if a != b), min(len(names), len(other)))
            differ = (
                f"class {i} is {names[i]!r} in train but {other[i]!r} in test"
                if i < min(len(names), len(other))
                else f"train has {len(names)} names, test {len(other)}"
            )
            key = self._train_reader.label_key
            raise ValueError(
                f"the ClassLabel names of train and test differ ({differ}), so one class id would mean two classes; "
                f"align them: test = test.align_labels_with_mapping({{name: i for i, name in "
                f"enumerate(train.features[{key!r}].names)}}, {key!r})"
            )
        return names

    @staticmethod
    def _given_label_ids(labels: Any, n: int) -> np.ndarray:
        if isinstance(labels, Tensor):
            labels = labels.detach().cpu().numpy()
        arr = np.asarray(labels)
        if arr.ndim != 1 or len(arr) != n:
            raise ValueError(
                f"labels must hold one class label per training sample ({n}), got shape {arr.shape}; pass "
                f"labels=[label of train[0], label of train[1], ...]"
            )
        ids, why = _class_ids(arr)
        if ids is None:
            raise ValueError(f"labels cannot be class labels: {why}; pass integer (or string) class labels")
        return ids

    # ------------------------------------------------------------------ load
    def load(self) -> tuple[Dataset, Dataset | None, np.ndarray]:
        """The training and test sets (in memory or per sample) and the training labels; an unlabelled IID split
        gets one class for every sample (its validation split is then a seeded uniform draw). Also checks that
        ``num_clients`` training samples remain after the validation hold-out (the base class's rounding)."""
        with preserved_random_states():  # samples are read (class docstring, "Random states")
            train = self._materialise(self._train_source, self._train_reader, "train")
            self.in_memory = isinstance(train, ArrayDataset)
            test = None
            if self._test_source is not None:
                test = self._materialise(self._test_source, self._test_reader, "test")
            if self._val_source is not None:
                self.val_dataset = self._materialise(self._val_source, self._val_reader, "val")
            labels = self._labels(train)
            #: whether the training labels were found (False: an IID split without labels)
            self.has_labels = labels is not None
            self._partition_labels = labels
            read = train
            train, test, self.val_dataset = self._settle_labels(train, test, self.val_dataset)
            if self._train_eval_source is not None:
                view = self._materialise(self._train_eval_source, self._train_eval_reader, "train_eval")
                self._train_eval_view = view if train is read else _with_class_ids(view)  # labels served as train's
            elif self.val_fraction > 0 and self._reads_at_random(self._train_source):
                warnings.warn(
                    f"{type(self).__name__}: the validation split holds out samples of train, and train reads them "
                    "through a random transform, so validation sees augmented samples that change from one "
                    "evaluation to the next; pass train_eval= the same samples read without augmentation (e.g. the "
                    "same data set built with the evaluation transform), or val= a validation set",
                    UserWarning,
                    stacklevel=2,
                )
            n = len(train)
            n_val = int(math.ceil(self.val_fraction * n - 1e-9))
            if self._client_sources is not None:
                self._natural_clients()
            elif self._num_clients > n - n_val:
                raise ValueError(
                    f"num_clients={self._num_clients} exceeds the {n - n_val} training samples left for the clients "
                    f"({n} in train, {n_val} held out for validation by val_fraction={self.val_fraction}); lower "
                    f"num_clients or val_fraction"
                )
            return train, test, labels if labels is not None else np.zeros(n, dtype=np.int64)

    def _reads_at_random(self, dataset: Any) -> bool:
        """:func:`_random_samples` of ``dataset``, probed once per data set (setup asks for the training set twice:
        the in-memory decision and the validation warning)."""
        key = id(dataset)
        if key not in self._random_reads:
            self._random_reads[key] = _random_samples(dataset)
        return self._random_reads[key]

    def _materialise(self, dataset: Any, reader: _Reader, name: str) -> Dataset:
        """The data set as an :class:`ArrayDataset` or a :class:`SampleView` (rules: class docstring, "In memory")."""
        option = self.in_memory_option
        if option is False or (option == "auto" and reference_mode()):
            return SampleView(dataset, reader, name=name)
        if not reader.pair or self.collate_fn is not None:
            if option is True:
                why = (
                    "collate_fn is given (it builds the batches)"
                    if self.collate_fn is not None
                    else f"{name} sample 0 is {_describe(dataset[0])}"
                )
                raise ValueError(
                    f"in_memory=True holds (x, y) pair samples batched by the default collate, but {why}; use "
                    f"in_memory=False or 'auto'"
                )
            return SampleView(dataset, reader, name=name)
        if isinstance(dataset, ArrayDataset):
            return dataset
        if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
            return ArrayDataset(dataset.tensors[0], dataset.tensors[1])
        x0, y0 = _pair(dataset[0])
        x_bytes, y_bytes = _nbytes(x0), _nbytes(y0)
        size = None if x_bytes is None or y_bytes is None else x_bytes + y_bytes
        if option == "auto":
            if size is None or size * len(dataset) > self.max_in_memory_bytes:
                return SampleView(dataset, reader, name=name)
            if self._reads_at_random(dataset):  # a random augmentation would be frozen into one draw
                return SampleView(dataset, reader, name=name)
        return self._stack(dataset, reader, name, x0, y0)

    def _stack(self, dataset: Any, reader: _Reader, name: str, x0: Any, y0: Any) -> Dataset:
        pairs = [(x0, y0)]
        sig = (_signature(x0), _signature(y0))
        strict = self.in_memory_option is True
        if sig[0] is None or sig[1] is None:
            bad, what = (x0, "input") if sig[0] is None else (y0, "label")
            raise ValueError(
                f"in_memory=True cannot store {name} sample 0: its {what} is {_describe(bad)}, not a number, array or "
                f"tensor; use in_memory=False"
            )
        for i in range(1, len(dataset)):
            x, y = _pair(dataset[i])
            got = (_signature(x), _signature(y))
            if got != sig:
                if not strict:
                    return SampleView(dataset, reader, name=name)
                raise ValueError(
                    f"in_memory=True needs every {name} sample to have sample 0's shapes and types {sig}, but sample "
                    f"{i} has {got}; use in_memory=False, or make the samples one shape"
                )
            pairs.append((x, y))
        x, y = default_collate(pairs)
        return ArrayDataset(x, y)

    def _labels(self, train: Dataset) -> np.ndarray | None:
        """The training labels (rules: class docstring, "Labels"); None when IID has no cheap source."""
        if self._given_labels is not None:
            return self._given_labels
        source, reader, n = self._train_source, self._train_reader, len(self._train_source)
        tried: list[str] = ["labels= (not given)"]
        candidates: list[tuple[str, Callable[[], Any]]] = []
        if isinstance(source, TensorDataset) and len(source.tensors) == 2:
            candidates.append(("the second tensor of the TensorDataset", lambda: source.tensors[1]))
        if _hf_label_column(source, reader):
            candidates.append(
                (
                    f"the Hugging Face column {reader.label_key!r}",
                    lambda: source.with_format("numpy", columns=[reader.label_key])[:][reader.label_key],
                )
            )
        targets = getattr(source, "targets", None)
        if targets is not None:
            candidates.append((_TARGETS, lambda: targets))
        else:
            tried.append("a train.targets attribute (none)")
        if isinstance(train, ArrayDataset):
            candidates.append((f"{reader.describe()}, in-memory copy", lambda: train.y))
        elif reader.kind == "none":
            tried.append(f"{reader.describe()}")
        elif self.needs_labels:
            candidates.append(
                (f"{reader.describe()}, every sample read", lambda: self._remember(_read_labels(source, reader)))
            )
        for what, get in candidates:
            try:
                arr = get()
            except _NotALabel as err:
                tried.append(f"{what} ({err})")
                continue
            if isinstance(arr, Tensor):
                arr = arr.detach().cpu().numpy()
            arr = np.asarray(arr)
            if arr.ndim != 1 or len(arr) != n:
                tried.append(f"{what} (shape {arr.shape}, not one label per sample)")
                continue
            ids, why = _class_ids(arr)
            if ids is None:
                tried.append(f"{what} ({why})")
                continue
            if what == _TARGETS and not self._targets_agree(arr, train, source, reader):
                tried.append(f"{what} (differs from the labels the samples serve)")
                continue
            return ids
        if not self.needs_labels:
            return None
        raise ValueError(
            f"partition={self.partition!r} splits by class label, but no class label could be read for the {n} "
            f"training samples; tried: {'; '.join(tried)}. Pass labels=[one integer class per training sample], or "
            f"use partition=IID()"
        )

    def _targets_agree(self, targets: np.ndarray, train: Dataset, source: Any, reader: _Reader) -> bool:
        """Whether the ``targets`` attribute holds the labels the training samples serve: all of them against the
        in-memory copy, else :data:`TARGET_SPOT_CHECKS` evenly spaced samples read through the label reader (none
        when the samples hold no label). A ``target_transform`` (torchvision's: a binary task made of CIFAR-10's
        classes) serves other labels than ``targets`` holds; a partition by ``targets`` would then skew the classes
        the model does not train on. Where they differ, a warning names the first such sample and the labels
        are taken from the next source (the in-memory copy, or one pass over the samples)."""
        if isinstance(train, ArrayDataset):
            rows = np.arange(len(targets))
            served = train.y.detach().cpu().numpy() if isinstance(train.y, Tensor) else np.asarray(train.y)
        elif reader.kind != "none":
            rows = np.unique(np.linspace(0, len(targets) - 1, num=min(TARGET_SPOT_CHECKS, len(targets))).astype(int))
            try:
                with preserved_random_states():  # a sample read may draw random numbers (an augmentation)
                    served = np.asarray([_scalar_label(reader(source[int(i)]), int(i)) for i in rows])
            except _NotALabel:
                return True  # the samples' labels are not class ids: nothing to compare
        else:
            return True
        if served.shape != (len(rows),):
            return True
        differ = np.flatnonzero(np.asarray(targets[rows] != served).reshape(-1))
        if not len(differ):
            return True
        i = int(rows[differ[0]])
        raw, got = (v.item() if isinstance(v, np.generic) else v for v in (targets[i], served[differ[0]]))
        warnings.warn(
            f"the training set's targets attribute differs from the labels its samples serve (sample {i}: targets "
            f"{raw!r}, served {got!r}; a target_transform?): the partition and the validation "
            "split use the served labels. Pass labels= to split by other labels",
            UserWarning,
            stacklevel=2,
        )
        return False

    def _remember(self, labels: np.ndarray) -> np.ndarray:
        """Keeps the labels of the one pass over the samples (the label checks reuse them)."""
        self._read_pass = labels
        return labels

    # ------------------------------------------------------------------ label checks
    def _settle_labels(
        self, train: Dataset, test: Dataset | None, val: Dataset | None
    ) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """Serves class labels stored as floats as int64 class ids, in the training, test and separate validation
        sets alike, and records the labels that the base class checks (rules: class docstring, "Label checks").
        Whether float labels are class ids is decided by the arguments alone (:meth:`_classes_reason`), never by
        the values, so that the in-memory and the per-sample paths serve the same dtype."""
        self._label_arrays = {}
        if not self.check_labels:
            return train, test, val
        classes = self._classes_reason() is not None
        y = _served_labels(train, self._train_source, self._train_reader, self._read_pass)
        if y is not None:
            if classes and y.dtype.kind == "f" and bool(_whole(y).all()):  # a fractional one: the base class's check
                y = y.astype(np.int64)
                train = _with_class_ids(train)
                self._warn_cast(self._train_reader, "train")
        elif classes and _is_float_label(self._train_reader.label0):  # not scanned: cast (and check) per sample
            train = _with_class_ids(train)
            self._warn_cast(self._train_reader, "train", scanned=False)
        self._label_arrays["train"] = y
        test = self._settle_eval_labels(test, self._test_source, self._test_reader, "test", classes)
        val = self._settle_eval_labels(val, self._val_source, self._val_reader, "val", classes)
        return train, test, val

    def _settle_eval_labels(
        self, data: Dataset | None, source: Any, reader: _Reader | None, name: str, classes: bool
    ) -> Dataset | None:
        """The test or separate validation set (``name``) serving its labels as the training set's: float class ids
        as int64 when the labels are class ids (``classes``); a known label that is not a whole number is then a
        ValueError (with ``num_classes``, the base class's check names it)."""
        if data is None:
            return None
        y = _served_labels(data, source, reader, None)
        if classes and y is not None and y.dtype.kind == "f":
            bad = np.flatnonzero(~_whole(y))
            if len(bad) and self.num_classes is None:
                r = int(bad[0])
                split = {"test": "test", "val": "validation"}[name]
                raise ValueError(
                    f"{type(self).__name__}: bad label in the {split} split: sample {r} of the {split} set has label "
                    f"{y[r].item()!r}, not a whole number, but the training labels are class ids{self._label_hint()}"
                )
            if not len(bad):
                y = y.astype(np.int64)
                data = _with_class_ids(data)
        elif classes and y is None and _is_float_label(reader.label0):
            data = _with_class_ids(data)
        self._label_arrays[name] = y
        return data

    def _classes_reason(self) -> str | None:
        """What makes the served labels class ids, for messages: ``num_classes`` (given, or a ``ClassLabel``
        feature's size), else a label-based partition over the labels the samples hold (not over ``labels=``); None:
        nothing does, so float labels are served as they are (a regression target may hold whole numbers)."""
        if self._classes_from is not None:
            return self._classes_from
        if self.needs_labels and self._given_labels is None:
            return f"the label-based partition={self.partition!r}"
        return None

    def _checked_sets(self) -> list[tuple[str, Dataset | None]]:
        """The base class's sets, and the separate validation set (``val=``)."""
        return super()._checked_sets() + [("val", self.val_dataset)]

    def _warn_cast(self, reader: _Reader, name: str, scanned: bool = True) -> None:
        what = "whole-number floats" if scanned else "floats"
        then = "" if scanned else " (a label that is not a whole number raises a ValueError when it is read)"
        warnings.warn(
            f"{type(self).__name__}: the {name} labels are {what} and {self._classes_reason()} makes them class ids "
            f"({reader.where(name, 0)} is {_scalar(reader.label0)!r}); they are served as int64 class ids{then}. "
            f"Pass check_labels=False to serve them unchanged (e.g. float targets of BCEWithLogitsLoss)",
            stacklevel=5,
        )

    def _label_array(self, set_name: str) -> np.ndarray | None:
        """The labels ``set_name`` serves when known (read or given); for ``"train"`` without served labels (samples
        not read, ``check_labels=False``), the labels the partition used (``labels=`` first), which is what a
        client's training labels are (``client_eval_indices``)."""
        known = self._label_arrays.get(set_name)
        if known is None and set_name == "train":
            known = as_label_array(self._partition_labels)
        return known

    def _labels_by_reading(self, set_name: str) -> np.ndarray | None:
        """The labels of a set (training, test, separate validation) read from every sample once (its reader: a dict
        key, a tuple position), kept for the run; None when the samples hold no scalar label. Called by
        :meth:`client_eval_indices` (``assignment="labels"``) only, so that setup never reads these sets whole."""
        cache = self._read_eval_labels
        if set_name not in cache:
            source, reader = {
                "train": (self._train_source, self._train_reader),
                "test": (self._test_source, self._test_reader),
                "val": (self._val_source, self._val_reader),
            }.get(set_name, (None, None))
            labels = None
            if source is not None and reader is not None and reader.kind != "none":
                try:
                    with preserved_random_states():  # a sample read may draw random numbers (an augmentation)
                        labels = as_label_array(_read_labels(source, reader))
                except _NotALabel:
                    labels = None
            cache[set_name] = labels
        return cache[set_name]

    def _num_classes_source(self) -> str:
        return self._classes_from or super()._num_classes_source()

    def _label_hint(self) -> str:
        return "; pass check_labels=False if the labels are targets of your own loss, not class ids"

    # ------------------------------------------------------------------ evaluation
    def evaluation_view(self) -> Dataset:
        """``train_eval`` (the training samples read without augmentation) when given, else the training set:
        what the validation hold-out, :meth:`train_eval_dataloader` and evaluation callbacks read."""
        self._require_setup()
        return self._train_eval_view if self._train_eval_view is not None else super().evaluation_view()

    def evaluation_rows(self, split: str) -> tuple[Dataset | None, np.ndarray]:
        """:meth:`FederatedDataModule.evaluation_rows`; ``"val"`` with a separate validation set (``val=``) is every
        row of that set."""
        self._require_setup()
        if split == "val" and self.val_dataset is not None:
            return self.val_dataset, np.arange(len(self.val_dataset), dtype=np.int64)
        return super().evaluation_rows(split)

    def val_dataloader(self):
        """The separate validation set (``val=``), sequential; without one, the ``val_fraction`` hold-out of the
        training set (:meth:`FederatedDataModule.val_dataloader`)."""
        self._require_setup()
        if self.val_dataset is None:
            return super().val_dataloader()
        return self._eval_loader(self.val_dataset)

    def test_dataloader(self):
        """The test set, sequential; with ``test=None`` a RuntimeError (``python train.py fit`` skips its test
        after fit with a warning instead)."""
        self._require_setup()
        if self.test_dataset is None:
            raise RuntimeError(
                "DatasetDataModule has no test set (test=None); pass test=<a data set> to "
                "FederatedDataModule.from_datasets / DatasetDataModule"
            )
        return super().test_dataloader()


class _NotALabel(ValueError):
    pass


def _key_position(sample: Any, key: str | int, name: str) -> str | int:
    """``key`` checked against ``name`` sample 0: a key of a dict sample, or a position of a tuple sample."""
    if isinstance(sample, Mapping):
        if key not in sample:
            raise ValueError(f"client_key={key!r} is not a key of {name} sample 0 (keys {list(sample)})")
        return key
    if isinstance(sample, (tuple, list)):
        n = len(sample)
        if isinstance(key, bool) or not isinstance(key, int) or not -n <= key < n:
            raise ValueError(
                f"client_key={key!r} is not a position of {name} sample 0 ({_describe(sample)}); pass an integer "
                f"position from 0 to {n - 1}"
            )
        return key % n
    raise ValueError(
        f"client_key={key!r} names a key or position, but {name} sample 0 is {_describe(sample)}; pass "
        f"client_ids=[one client id per {name} sample] instead"
    )


def _client_id_array(values: Any, what: str, name: str = "train") -> np.ndarray:
    """Client ids as a 1-D numpy array of scalars (rules: :class:`DatasetDataModule`, "Natural clients"); a value
    that is not one is a ValueError naming ``what`` and the sample."""
    if isinstance(values, Tensor):
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise ValueError(f"{what} must be one id per sample (1-D), got shape {values.shape}")
    out: list[Any] = []
    for i, v in enumerate(values.tolist() if isinstance(values, np.ndarray) else values):
        if isinstance(v, (Tensor, np.ndarray)):
            if v.ndim != 0:
                raise ValueError(f"{what}: {name} sample {i}'s client id is {_describe(v)}, not a scalar")
            v = v.item()
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float):
            if not _is_whole(v):
                raise ValueError(
                    f"{what}: {name} sample {i}'s client id is {v!r}, not an integer, string or whole float"
                )
            v = int(v)
        if not isinstance(v, (int, str, bool)):
            raise ValueError(f"{what}: {name} sample {i}'s client id is {_describe(v)}, not a scalar (int or str)")
        out.append(v)
    kinds = [str if isinstance(v, str) else bool if isinstance(v, bool) else int for v in out]
    if len(set(kinds)) > 1:  # numpy would turn them into one kind: 1 and "1", True and 1, one client
        named = " and ".join(sorted({str: "strings", bool: "bools", int: "numbers"}[k] for k in set(kinds)))
        i = next(i for i, k in enumerate(kinds) if k is not kinds[0])
        raise ValueError(
            f"{what} mixes {named} ({name} sample 0's id is {out[0]!r}, {name} sample {i}'s {out[i]!r}); give every "
            f"{name} sample an id of one kind"
        )
    return np.asarray(out) if out else np.empty(0, dtype=np.int64)


def _label_feature(dataset: Any, reader: _Reader) -> Any:
    """The Hugging Face ``ClassLabel`` feature of the label column of ``dataset``, or None."""
    if not _is_hf(dataset) or reader.kind != "dict":
        return None
    feature = dataset.features.get(reader.label_key)
    return feature if isinstance(feature, sys.modules["datasets"].ClassLabel) else None


def _scalar(value: Any) -> Any:
    """A 0-d tensor / array or NumPy scalar as the Python value (for messages)."""
    return value.item() if isinstance(value, (Tensor, np.ndarray, np.generic)) and np.ndim(value) == 0 else value


def _whole(labels: np.ndarray) -> np.ndarray:
    """Mask of the finite whole numbers of a float array."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(labels) & (labels == np.round(labels))


def _is_float_label(y: Any) -> bool:
    if isinstance(y, Tensor):
        return y.is_floating_point() and y.dim() == 0
    return isinstance(y, (float, np.floating)) or (isinstance(y, np.ndarray) and y.ndim == 0 and y.dtype.kind == "f")


def _served_labels(data: Dataset, source: Any, reader: _Reader, read_pass: np.ndarray | None) -> np.ndarray | None:
    """The 1-D labels ``data`` serves, when known without another pass over the samples: the in-memory ``y``, a
    Hugging Face label column, or the labels of the pass made for a label partition; None: not scanned."""
    if isinstance(data, ArrayDataset):
        return as_label_array(data.y)
    if _hf_label_column(source, reader):
        column = source.with_format("numpy", columns=[reader.label_key])[:][reader.label_key]
        return as_label_array(column) if isinstance(column, np.ndarray) else None
    return None if read_pass is None else as_label_array(read_pass)


def _with_class_ids(data: Dataset) -> Dataset:
    """``data`` serving its float labels as int64 class ids."""
    if isinstance(data, ArrayDataset):
        y = data.y
        return ArrayDataset(data.x, y.long() if isinstance(y, Tensor) else np.asarray(y).astype(np.int64))
    return SampleView(data.dataset, data.reader, cast_labels=True, name=data.name)


def _is_whole(value: float) -> bool:
    return math.isfinite(value) and float(value).is_integer()


def _class_id(y: Any, where: str) -> Any:
    """A scalar float class label as an int64 class id (0-d tensor: ``.long()``; Python / NumPy float: ``int``);
    other labels unchanged. A float that is not a whole number is a ValueError naming ``where``."""
    if not _is_float_label(y):
        return y
    value = float(y.item() if isinstance(y, Tensor) else y)
    if not _is_whole(value):
        raise ValueError(f"{where}: label {value!r} is not a whole number, but the training labels are class ids")
    return y.long() if isinstance(y, Tensor) else int(value)


def _scalar_label(y: Any, i: int) -> Any:
    """Sample ``i``'s label ``y`` as a Python or numpy scalar; a label that is not a scalar raises
    :class:`_NotALabel`."""
    if isinstance(y, (Tensor, np.ndarray)):
        if y.ndim != 0:
            raise _NotALabel(f"sample {i}'s label is {_describe(y)}, not a scalar")
        return y.item()
    if not isinstance(y, (int, float, str, bool, np.generic)):
        raise _NotALabel(f"sample {i}'s label is {_describe(y)}, not a scalar")
    return y


def _read_labels(dataset: Any, reader: _Reader) -> np.ndarray:
    """The label of every sample (one pass); a sample whose label is not a scalar raises :class:`_NotALabel`."""
    return np.asarray([_scalar_label(reader(dataset[i]), i) for i in range(len(dataset))])


def _class_ids(arr: np.ndarray) -> tuple[np.ndarray | None, str]:
    """``(labels, "")`` when ``arr`` holds class labels (integers, bools, strings or integer-valued floats; floats
    become int64), else ``(None, why)``."""
    kind = arr.dtype.kind
    if kind in "iub":
        return arr, ""
    if kind in "US":
        return arr, ""
    if kind == "f":
        finite = np.isfinite(arr)
        if not finite.all():
            i = int(np.flatnonzero(~finite)[0])
            return None, f"a label that is not finite (sample {i}: {float(arr[i])!r})"
        if not np.all(arr == np.round(arr)):
            return None, "float values that are not whole numbers (a regression target?)"
        return arr.astype(np.int64), ""
    if kind == "O" and all(isinstance(v, (int, str, bool, np.integer)) for v in arr.tolist()):
        return arr, ""
    return None, f"values of dtype {arr.dtype}"


#: Samples that ``in_memory="auto"`` reads twice to find a random augmentation in ``__getitem__`` (ours: spread over
#: the data set; a flip of probability ½ differs on at least one of 8 with probability 255/256).
REREAD_SAMPLES = 8


def _reads_repeat(dataset: Any) -> bool:
    """Whether reading each of up to :data:`REREAD_SAMPLES` samples (spread over ``dataset``) twice gives equal
    values, leaf by leaf of the samples' structure, NaN equal to NaN, and draws from none of the process's global
    random states (torch, ``random``, numpy): an augmentation applied with a small probability (``if torch.rand(())
    < 0.1``) leaves most samples unchanged, so 8 samples alone would miss it a third of the time, but it draws on
    every read. The states are put back afterwards."""
    n = len(dataset)
    rows = sorted({(i * (n - 1)) // max(REREAD_SAMPLES - 1, 1) for i in range(min(REREAD_SAMPLES, n))})
    with preserved_random_states(), random_states_moved() as moved:
        for i in rows:
            (first, spec), (second, spec2) = tree_flatten(dataset[i]), tree_flatten(dataset[i])
            if moved() or spec != spec2 or not all(_same_values(a, b) for a, b in zip(first, second)):
                return False
    return True


def _random_samples(dataset: Any) -> bool:
    """Whether ``dataset`` reads its samples at random: a ``transform`` / ``transforms`` attribute is set
    (torchvision's convention) on it or on a data set it wraps (a ``Subset`` / ``random_split`` part, a
    ``ConcatDataset``: :func:`_wrapped_sets`), or reading samples twice gives other values (:func:`_reads_repeat`)."""
    if any(getattr(d, a, None) is not None for d in _wrapped_sets(dataset) for a in ("transform", "transforms")):
        return True
    try:
        return not _reads_repeat(dataset)
    except Exception:  # noqa: BLE001 - a sample this probe cannot read: assumed fixed (training reads it again)
        return False


def _wrapped_sets(dataset: Any, depth: int = 0) -> list[Any]:
    """``dataset`` and the data sets it wraps through torch's wrappers (``Subset``'s ``dataset``,
    ``ConcatDataset``'s ``datasets``), depth first, at most 8 levels deep."""
    out = [dataset]
    if depth >= 8:
        return out
    if isinstance(dataset, torch.utils.data.Subset):
        out += _wrapped_sets(dataset.dataset, depth + 1)
    elif isinstance(dataset, torch.utils.data.ConcatDataset):
        for d in dataset.datasets:
            out += _wrapped_sets(d, depth + 1)
    return out


def _same_values(a: Any, b: Any) -> bool:
    """Equal values (tensors, arrays, numbers; NaN equal to NaN), else ``==`` (an image, a string); False for values
    that cannot be compared."""
    try:
        ta, tb = torch.as_tensor(a), torch.as_tensor(b)
    except (TypeError, ValueError, RuntimeError):
        try:
            return bool(np.all(a == b))
        except Exception:  # noqa: BLE001 - values without a usable ==: not shown equal
            return False
    if ta.shape != tb.shape or ta.dtype != tb.dtype:
        return False
    if ta.is_floating_point() or ta.is_complex():
        return bool(((ta == tb) | (ta.isnan() & tb.isnan())).all())
    return bool((ta == tb).all())


def _pair(sample: Any) -> tuple[Any, Any]:
    """``(x, y)`` of a two-element tuple / list sample (the in-memory path only)."""
    return sample[0], sample[1]


def _nbytes(value: Any) -> int | None:
    """Bytes ``value`` takes in a tensor (None when it cannot be stored in one)."""
    if isinstance(value, Tensor):
        return value.element_size() * value.numel()
    if isinstance(value, np.ndarray):
        return int(value.nbytes) if value.dtype.kind in "biuf" else None
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        return 8
    return None


def _signature(value: Any) -> tuple[Any, ...] | None:
    """``(type, shape, dtype)`` of a value the default collate stacks into a tensor, else None."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.shape, value.dtype) if value.dtype.kind in "biuf" else None
    if isinstance(value, (bool, np.bool_)):
        return ("bool",)
    if isinstance(value, (int, float, np.number)):
        return (type(value).__name__,)
    return None


def from_datamodule(datamodule: Any, **kwargs: Any) -> DatasetDataModule:
    """A :class:`DatasetDataModule` over an existing ``LightningDataModule`` (``FederatedDataModule.from_datamodule``).

    Decisions (ours):

    * ``datamodule.prepare_data()`` and ``datamodule.setup("fit")`` are called (and ``setup("test")`` when it defines
      ``test_dataloader``), as a Trainer would before fitting and testing.
    * ``train_dataloader()`` must return one torch ``DataLoader``: its ``dataset`` is the training set the clients
      split, and its ``collate_fn`` (unless it is torch's ``default_collate``), ``batch_size`` (or its batch
      sampler's), ``drop_last``, ``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor`` and
      ``worker_init_fn`` become the client loaders' options. Its sampler and shuffling are not used: each client's
      order is the seeded ``(seed, round, client)`` order (a warning names a sampler that does more than shuffle or
      read in order: a weighted or bucketing sampler). Every argument given in ``kwargs`` wins; ``num_workers=0``
      also drops the loader's ``persistent_workers`` and ``prefetch_factor``, which need worker processes.
    * A ``train_dataloader()`` with ``batch_size=None`` (automatic batching off: it yields single samples) is a
      ValueError: clients take batches of samples, and that loader names neither a batch size nor a function that
      collates a list of samples.
    * Validation: when the module defines ``val_dataloader`` and it returns a DataLoader, its data set is the global
      validation set and nothing is held out of the training set (``val=``; ``val_fraction`` defaults to 0). When it
      defines none (or returns an empty list), the ``val_fraction`` hold-out of the training set validates
      (default 0.1), as for ``from_datasets``.
    * Test: the data set of ``test_dataloader()`` when defined, else no test set (``test_dataloader`` then raises
      and ``python train.py fit`` skips its test after fit with a warning).
    * Evaluation batches are built with the training loader's ``collate_fn`` and ``eval_batch_size`` (a warning
      names a validation or test loader with another ``collate_fn``).
    * The batch-transfer hooks the module overrides (``on_before_batch_transfer``, ``transfer_batch_to_device``,
      ``on_after_batch_transfer``) become the federated data module's: client, validation and test batches go through
      them, in place of the model's where both override one (Lightning's rule), with the Trainer as the module's
      ``trainer``.
    """
    train, test, options = _datamodule_parts(datamodule, kwargs)
    federated = DatasetDataModule(train, test, **options)
    _adopt_transfer_hooks(federated, datamodule)
    return federated


def _datamodule_parts(datamodule: Any, kwargs: dict) -> tuple[Any, Any, dict]:
    """``(train, test, options)`` of :class:`DatasetDataModule` for ``datamodule`` (rules: :func:`from_datamodule`),
    ``kwargs`` winning over what the loaders give."""
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from torch.utils.data import DataLoader

    if not isinstance(datamodule, pl.LightningDataModule):
        raise TypeError(f"from_datamodule needs a LightningDataModule, got {type(datamodule).__name__}")
    name = type(datamodule).__name__
    datamodule.prepare_data()
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    if not isinstance(loader, DataLoader):
        raise ValueError(
            f"{name}.train_dataloader() returned {_describe(loader)}, not one torch DataLoader; from_datamodule takes "
            f"its dataset and collate_fn. Use FederatedDataModule.from_datasets(train, test, collate_fn=...) instead"
        )
    if loader.batch_sampler is None and not isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"{name}.train_dataloader() has batch_size=None (automatic batching off: it yields its data set's samples "
            f"one at a time, each passed through collate_fn {_callable_name(loader.collate_fn)}), but federated "
            f"clients take batches of samples; return DataLoader(dataset, batch_size=<samples per batch>, "
            f"collate_fn=<a function of a list of samples>) from train_dataloader(), or use "
            f"FederatedDataModule.from_datasets(dataset, batch_size=..., collate_fn=...)"
        )
    _warn_unused_sampler(name, loader)
    options: dict = {}
    if loader.collate_fn is not default_collate:
        options["collate_fn"] = loader.collate_fn
    batch_size = (
        loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    )
    if batch_size is not None:
        options["batch_size"] = int(batch_size)
    options["drop_last"] = bool(loader.drop_last or getattr(loader.batch_sampler, "drop_last", False))
    options.update(num_workers=loader.num_workers, pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn)
    if loader.num_workers > 0 and kwargs.get("num_workers", loader.num_workers) != 0:
        # worker-only options; a num_workers=0 override drops them (the loader's values need workers)
        options.update(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor)
    val = None
    if is_overridden("val_dataloader", datamodule, pl.LightningDataModule):
        val_loader = datamodule.val_dataloader()
        if isinstance(val_loader, DataLoader):
            val = val_loader.dataset
            _warn_other_collate(name, "val_dataloader", val_loader, loader)
        elif val_loader not in (None, []):
            raise ValueError(
                f"{name}.val_dataloader() returned {_describe(val_loader)}; from_datamodule takes the dataset of one "
                f"DataLoader (or none: the val_fraction hold-out of the training set validates)"
            )
    test = None
    if is_overridden("test_dataloader", datamodule, pl.LightningDataModule):
        datamodule.setup("test")
        test_loader = datamodule.test_dataloader()
        if not isinstance(test_loader, DataLoader):
            raise ValueError(
                f"{name}.test_dataloader() returned {_describe(test_loader)}; from_datamodule takes the dataset of "
                f"one DataLoader"
            )
        test = test_loader.dataset
        _warn_other_collate(name, "test_dataloader", test_loader, loader)
    if val is not None and "val" not in kwargs and not kwargs.get("val_fraction"):
        options["val"] = val
    options.update(kwargs)
    return loader.dataset, test, options


class WrappedDataModule(DatasetDataModule):
    """Your existing ``LightningDataModule`` as a federated data set, for configs: what
    :func:`from_datamodule` builds, with its arguments as ``init_args``::

        data:
          class_path: fedlightning.datamodules.WrappedDataModule
          init_args:
            datamodule:
              class_path: my_package.MyDataModule
              init_args: {data_dir: data}
            partition: {class_path: fedlightning.datamodules.Dirichlet, init_args: {alpha: 0.3}}
            num_clients: 100
            seed: 0

    The wrapped module is built first (by the config), then its ``prepare_data()`` and ``setup("fit")`` (and
    ``setup("test")``) run here, at construction, in every process, as :func:`from_datamodule` runs them. Its
    ``train_dataloader()``'s data set is split among the clients, with that loader's ``collate_fn``,
    ``batch_size``, ``drop_last``, ``num_workers`` and other options; its ``val_dataloader()`` and
    ``test_dataloader()`` data sets validate and test. Arguments left at None take the loader's value
    (``batch_size``, ``drop_last``, ``num_workers``) or :class:`DatasetDataModule`'s rule (``val_fraction``: 0 with
    the module's own validation set, else 0.1); the others are :class:`DatasetDataModule`'s and override the
    loader's (``client_key: writer_id`` makes each distinct value of that key of the samples a client, in place of
    ``partition``). ``num_workers: 0`` also drops the loader's ``persistent_workers`` and ``prefetch_factor`` (they need
    worker processes). The wrapped module stays available as :attr:`datamodule`.
    """

    def __init__(
        self,
        datamodule: pl.LightningDataModule,
        *,
        partition: Partitioner | None = None,
        num_clients: int = 100,
        batch_size: int | None = None,
        seed: int = 0,
        val_fraction: float | None = None,
        drop_last: bool | None = None,
        num_workers: int | None = None,
        eval_batch_size: int = 1024,
        num_classes: int | None = None,
        check_labels: bool = True,
        label_key: str | int | None = None,
        client_key: str | int | None = None,
        in_memory: bool | str = "auto",
        max_in_memory_bytes: int = DEFAULT_MAX_IN_MEMORY_BYTES,
        rounds_per_epoch: int = 1000,
        train_eval: Dataset | None = None,
    ):
        given = dict(batch_size=batch_size, val_fraction=val_fraction, drop_last=drop_last, num_workers=num_workers)
        kwargs = {k: v for k, v in given.items() if v is not None}
        kwargs.update(
            partition=partition,
            num_clients=num_clients,
            seed=seed,
            eval_batch_size=eval_batch_size,
            num_classes=num_classes,
            check_labels=check_labels,
            label_key=label_key,
            client_key=client_key,
            in_memory=in_memory,
            max_in_memory_bytes=max_in_memory_bytes,
            rounds_per_epoch=rounds_per_epoch,
            train_eval=train_eval,
        )
        train, test, options = _datamodule_parts(datamodule, kwargs)
        super().__init__(train, test, **options)
        #: the wrapped LightningDataModule
        self.datamodule = datamodule
        _adopt_transfer_hooks(self, datamodule)


class _WrappedHook:
    """A batch-transfer hook of a wrapped ``LightningDataModule``, called as the federated data module's own
    (:func:`_adopt_transfer_hooks`); the wrapped module's ``self.trainer`` is the federated one's Trainer when it
    runs, as if the Trainer ran the wrapped module. ``__wrapped__`` keeps Lightning's ``is_overridden`` true."""

    def __init__(self, federated: Any, datamodule: pl.LightningDataModule, name: str):
        self.federated, self.datamodule = federated, datamodule
        self.__wrapped__ = getattr(datamodule, name)

    def __call__(self, *args: Any) -> Any:
        trainer = self.federated.trainer
        if self.datamodule.trainer is not trainer:
            self.datamodule.trainer = trainer
        return self.__wrapped__(*args)


def _adopt_transfer_hooks(federated: Any, datamodule: pl.LightningDataModule) -> None:
    """The batch-transfer hooks that ``datamodule``'s class overrides (``on_before_batch_transfer``,
    ``transfer_batch_to_device``, ``on_after_batch_transfer``) become ``federated``'s: client, validation and test
    batches go through them, each preferred to the model's as Lightning prefers a data module's hook."""
    owners = transfer_hook_owners(None, datamodule)
    for name in BATCH_TRANSFER_HOOKS:
        if owners[name] is datamodule:
            federated.__dict__[name] = _WrappedHook(federated, datamodule, name)


def _warn_unused_sampler(name: str, loader: Any) -> None:
    """A warning naming the training loader's sampler when it is more than shuffling (a weighted or bucketing
    sampler): federated clients draw their batches in the seeded client order, so it is not used."""
    if isinstance(loader.dataset, IterableDataset):  # no sampler; DatasetDataModule names what it needs instead
        return
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        what = f"batch_sampler {type(batch_sampler).__name__}"
    elif type(loader.sampler) not in (RandomSampler, SequentialSampler):
        what = f"sampler {type(loader.sampler).__name__}"
    else:
        return
    warnings.warn(
        f"from_datamodule: {name}.train_dataloader() has the {what}, which federated training does not use: each "
        f"client's batches are its own samples in the seeded (seed, round, client) order, batch_size at a time; "
        f"weight or bucket the samples in the data set or the partition instead",
        stacklevel=3,
    )


def _same_callable(a: Any, b: Any) -> bool:
    """``a`` and ``b`` call the same thing: equal (bound methods of one object compare equal), or partials of the
    same callable with equal arguments (each ``*_dataloader`` method typically makes its own)."""
    try:
        if a is b or a == b:
            return True
        if isinstance(a, functools.partial) and isinstance(b, functools.partial):
            return _same_callable(a.func, b.func) and a.args == b.args and a.keywords == b.keywords
    except Exception:  # arguments whose comparison fails or is ambiguous (tensors): not provably the same
        return False
    return False


def _warn_other_collate(name: str, method: str, loader: Any, train_loader: Any) -> None:
    """A warning when an evaluation loader collates otherwise than the training loader (its collate is not used)."""
    if not _same_callable(loader.collate_fn, train_loader.collate_fn):
        warnings.warn(
            f"from_datamodule: {name}.{method}() has another collate_fn than train_dataloader(); every loader of the "
            f"federated data module collates with train_dataloader()'s ({_callable_name(train_loader.collate_fn)}), "
            f"not {_callable_name(loader.collate_fn)}",
            stacklevel=3,
        )


def _callable_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _from_datasets(cls, train: Any, test: Any = None, **kwargs: Any) -> DatasetDataModule:
    """A federated data set over your own ``train`` (and optional ``test``) data set: a map-style torch
    ``Dataset`` with samples of any structure, or a Hugging Face ``datasets.Dataset``. Returns a
    :class:`~fedlightning.datamodules.DatasetDataModule` (whichever class it is called on); ``kwargs`` are its
    arguments (``partition``, ``num_clients``, ``batch_size``, ``seed``, ``val_fraction``, ``labels``,
    ``label_key``, ``collate_fn``, ``drop_last``, ``in_memory``, ...), and its docstring gives the rules.

    This replaces Lightning's ``LightningDataModule.from_datasets(train_dataset=..., ...)`` (ours): its plain
    DataLoaders have no clients, so they could not feed a FederatedLoop."""
    return DatasetDataModule(train, test, **kwargs)


def _from_datamodule(cls, datamodule: Any, **kwargs: Any) -> DatasetDataModule:
    """Your existing ``LightningDataModule`` federated in one call: a
    :class:`~fedlightning.datamodules.DatasetDataModule` over the data set, ``collate_fn`` and DataLoader
    options of its ``train_dataloader()``, evaluated on the data sets of its ``val_dataloader()`` /
    ``test_dataloader()``. ``kwargs`` (``partition``, ``num_clients``, ``batch_size``, ``seed``, ...) override
    what is taken from the loaders. Rules: :func:`fedlightning.datamodules.generic.from_datamodule`."""
    return from_datamodule(datamodule, **kwargs)


# The base class's factories build this module's subclass, so they are defined here and attached to it (base.py
# importing this module would close an import cycle); see FederatedDataModule's docstring.
_from_datasets.__name__, _from_datasets.__qualname__ = "from_datasets", "FederatedDataModule.from_datasets"
_from_datamodule.__name__, _from_datamodule.__qualname__ = "from_datamodule", "FederatedDataModule.from_datamodule"
FederatedDataModule.from_datasets = classmethod(_from_datasets)
FederatedDataModule.from_datamodule = classmethod(_from_datamodule)
