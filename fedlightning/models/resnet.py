"""ResNet-18 and ResNet-50 (He et al. 2016) for 32×32 inputs, with GroupNorm by default.

Used by "Painless Federated Learning" (seed 000; ResNet-18, CIFAR-10/100), "Locally Adaptive Federated Learning"
(seed 001; ResNet-18 on CIFAR-10, ResNet-50 on CIFAR-100) and "Towards Hyper-parameter-free Federated Learning"
(seed 002; ResNet-18 with GroupNorm). The architecture and the normalisation decision are in :class:`ResNet`'s
docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from fedlightning._validation import integer, one_of
from fedlightning.models.base import Classifier

__all__ = ["ResNet", "ResNet18", "ResNet50"]


def _norm(kind: str, channels: int, num_groups: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(num_groups, channels)
    return nn.BatchNorm2d(channels)


class _BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int, norm: str, num_groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, planes, num_groups)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = _norm(norm, planes, num_groups)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), _norm(norm, planes, num_groups)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int, norm: str, num_groups: int):
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = _norm(norm, planes, num_groups)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = _norm(norm, planes, num_groups)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = _norm(norm, out_planes, num_groups)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != out_planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False), _norm(norm, out_planes, num_groups)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet(Classifier):
    """A CIFAR-style ResNet.

    CIFAR form of the network (the standard adaptation for 32×32 images): a 3×3 stride-1 stem convolution with no
    max-pool, four stages of residual blocks with 64/128/256/512 base widths and strides 1/2/2/2, global average
    pooling, one linear layer. ResNet-18 uses basic blocks ``[2, 2, 2, 2]``, ResNet-50 bottleneck blocks
    ``[3, 4, 6, 3]`` with expansion 4. Seed 002's reference ``resnet_gn`` keeps ImageNet's stem (3×3 convolution,
    norm, ReLU, then a 3×3 stride-2 max-pool); this network has no max-pool there (ours: one stem for every paper's
    CIFAR setup, at 4× the first stage's spatial size).

    Normalisation (decision, documented): ``norm="group"`` (default) uses ``GroupNorm(num_groups, C)`` everywhere a
    BatchNorm would be. Default ``num_groups=2``, the FedExP reference code's ``GroupNorm(2, C)`` (seed 000 follows that
    code's setup); seed 002 asks for GroupNorm without a group count. GroupNorm keeps no running statistics, so client
    models have no buffers to average and line-search trial forwards cannot corrupt any (the reason seed 002,
    "Towards Hyper-parameter-free Federated Learning", gives for GroupNorm).
    ``norm="batch"`` gives the usual BatchNorm network (its running statistics are buffers, averaged by the loop).
    The head is adaptive average pooling over the whole 4×4 map (not the FedExP code's ``avg_pool2d(out, 3)`` quirk,
    which pools only the top-left 3×3 window).

    Args:
        block: ``"basic"`` (ResNet-18/34) or ``"bottleneck"`` (ResNet-50/101).
        num_blocks: blocks per stage, four entries.
        num_classes: output classes.
        norm: ``"group"`` (default, GroupNorm) or ``"batch"`` (BatchNorm).
        num_groups: GroupNorm groups (default 2, the FedExP reference code); must divide every channel count.
        width: base width of the first stage (default 64, He et al.); tests use small widths.
        in_channels: input channels (3 for CIFAR).
    """

    def __init__(
        self,
        block: str = "basic",
        num_blocks: Sequence[int] = (2, 2, 2, 2),
        num_classes: int = 10,
        norm: str = "group",
        num_groups: int = 2,
        width: int = 64,
        in_channels: int = 3,
        lr: float = 0.1,
    ):
        super().__init__(num_classes=num_classes, lr=lr)
        one_of("block", block, ("basic", "bottleneck"))
        one_of("norm", norm, ("group", "batch"))
        blocks = [int(b) for b in num_blocks]
        if len(blocks) != 4 or any(b < 1 for b in blocks):
            raise ValueError(f"num_blocks must be four positive integers, got {list(num_blocks)}")
        width, num_groups = integer("width", width), integer("num_groups", num_groups)
        if norm == "group" and width % num_groups != 0:
            raise ValueError(f"num_groups={num_groups} must divide the base width {width}")
        cls: type[nn.Module] = _BasicBlock if block == "basic" else _Bottleneck
        layers: list[nn.Module] = [
            nn.Conv2d(int(in_channels), width, 3, stride=1, padding=1, bias=False),
            _norm(norm, width, num_groups),
            nn.ReLU(),
        ]
        in_planes = width
        for stage, (count, stride) in enumerate(zip(blocks, (1, 2, 2, 2))):
            planes = width * 2**stage
            for i in range(count):
                layers.append(cls(in_planes, planes, stride if i == 0 else 1, norm, num_groups))
                in_planes = planes * cls.expansion  # type: ignore[attr-defined]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_planes, self.num_classes)]
        self.net = nn.Sequential(*layers)
        self.norm, self.num_groups = norm, num_groups

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.float())


class ResNet18(ResNet):
    """ResNet-18 for 32×32 images (basic blocks [2, 2, 2, 2]); 11,173,962 parameters for 10 classes."""

    def __init__(
        self, num_classes: int = 10, norm: str = "group", num_groups: int = 2, width: int = 64, lr: float = 0.1
    ):
        super().__init__("basic", (2, 2, 2, 2), num_classes, norm, num_groups, width, 3, lr)


class ResNet50(ResNet):
    """ResNet-50 for 32×32 images (bottleneck blocks [3, 4, 6, 3]); 23,705,252 parameters for 100 classes."""

    def __init__(
        self, num_classes: int = 100, norm: str = "group", num_groups: int = 2, width: int = 64, lr: float = 0.1
    ):
        super().__init__("bottleneck", (3, 4, 6, 3), num_classes, norm, num_groups, width, 3, lr)
