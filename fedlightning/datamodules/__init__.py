"""Federated data modules and partitioners."""

from fedlightning.datamodules.base import ArrayDataset, ClientBatchSampler, FederatedDataModule, RoundPlanLoader
from fedlightning.datamodules.digits import DigitsDataModule
from fedlightning.datamodules.partition import IID, Dirichlet, Partitioner, Shards, check_partition

__all__ = [
    "ArrayDataset",
    "ClientBatchSampler",
    "FederatedDataModule",
    "RoundPlanLoader",
    "DigitsDataModule",
    "IID",
    "Dirichlet",
    "Partitioner",
    "Shards",
    "check_partition",
]
