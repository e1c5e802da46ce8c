"""Federated data modules and partitioners."""

from fedlightning.datamodules.base import (
    ArrayDataset,
    ClientBatchSampler,
    ClientDataLoader,
    FederatedDataModule,
    RoundPlanLoader,
)
from fedlightning.datamodules.cifar import Cifar10DataModule, Cifar100DataModule, CifarImages, PachinkoPartition
from fedlightning.datamodules.digits import DigitsDataModule
from fedlightning.datamodules.generic import DatasetDataModule, WrappedDataModule
from fedlightning.datamodules.leaf import LeafDataModule
from fedlightning.datamodules.libsvm import LibsvmDataModule
from fedlightning.datamodules.mnist import MnistDataModule
from fedlightning.datamodules.partition import (
    IID,
    ClassShards,
    Dirichlet,
    DirichletEqualSizes,
    Partitioner,
    Shards,
    check_partition,
)
from fedlightning.datamodules.shakespeare import ShakespeareDataModule, SlidingWindows
from fedlightning.datamodules.synthetic import SyntheticDataModule

__all__ = [
    "ArrayDataset",
    "ClientBatchSampler",
    "ClientDataLoader",
    "FederatedDataModule",
    "RoundPlanLoader",
    "DigitsDataModule",
    "DatasetDataModule",
    "WrappedDataModule",
    "IID",
    "Dirichlet",
    "DirichletEqualSizes",
    "Partitioner",
    "Shards",
    "ClassShards",
    "check_partition",
    "LeafDataModule",
    "ShakespeareDataModule",
    "SlidingWindows",
    "SyntheticDataModule",
    "Cifar10DataModule",
    "Cifar100DataModule",
    "CifarImages",
    "PachinkoPartition",
    "MnistDataModule",
    "LibsvmDataModule",
]
