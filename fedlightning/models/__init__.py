"""Reference models of the papers, as LightningModules (loss + torchmetrics accuracy)."""

from fedlightning.models.base import Classifier
from fedlightning.models.bow import BagOfWordsLinear
from fedlightning.models.cnn import Cifar100CNN, FemnistCNN, LeNet5
from fedlightning.models.dnn import FC200
from fedlightning.models.mlp import MLP, LogisticRegression
from fedlightning.models.resnet import ResNet, ResNet18, ResNet50
from fedlightning.models.rnn import CharGRU, CharLSTM

__all__ = [
    "Classifier",
    "MLP",
    "LogisticRegression",
    "FC200",
    "LeNet5",
    "FemnistCNN",
    "Cifar100CNN",
    "ResNet",
    "ResNet18",
    "ResNet50",
    "CharLSTM",
    "CharGRU",
    "BagOfWordsLinear",
]
