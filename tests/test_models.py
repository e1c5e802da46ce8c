"""Reference models: parameter counts against the papers' stated sizes (seed 004 Table I) and hand-derived
formulas, forward shapes on tiny instances, GroupNorm vs BatchNorm, the bag-of-words equivalence, bad input."""

import pytest
import torch
from torch import nn

from fedlightning.models import (
    FC200,
    BagOfWordsLinear,
    CharGRU,
    CharLSTM,
    Cifar100CNN,
    FemnistCNN,
    LeNet5,
    ResNet,
    ResNet18,
    ResNet50,
)
from numerics import assert_close64


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def megabits(model: nn.Module) -> float:
    """Seed 004's model size: float32 parameters x 32 bits / 1e6."""
    return count(model) * 32 / 1e6


# ------------------------------------------------------------------ sizes the papers state (seed 004, Table I)
def test_seed004_model_sizes_match_table_1():
    assert count(FC200()) == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 62 + 62 == 209_662
    assert round(megabits(FC200()), 2) == 6.71
    cnn = Cifar100CNN()
    assert count(cnn) == (3 * 9 * 32 + 32) + (32 * 9 * 64 + 64) + (2304 * 512 + 512) + (512 * 100 + 100) == 1_250_852
    assert round(megabits(cnn), 1) == 40.0
    gru = CharGRU(vocab_size=79)

    def gru_layer(i, h):  # PyTorch GRU: 3 gates, two bias vectors each
        return 3 * (h * i + h * h + 2 * h)

    assert count(gru) == 79 * 8 + gru_layer(8, 128) + gru_layer(128, 128) + 128 * 79 + 79 == 162_887
    assert round(megabits(gru), 2) == 5.21
    bow = BagOfWordsLinear(vocab_size=5000, num_classes=2)
    assert count(bow) == 10_002 and round(megabits(bow), 2) == 0.32


# ------------------------------------------------------------------ other sizes, from the architectures
def test_other_parameter_counts():
    assert count(LeNet5()) == (
        (1 * 25 * 6 + 6) + (6 * 25 * 16 + 16) + (400 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10)
    )
    reddi = (1 * 9 * 32 + 32) + (32 * 9 * 64 + 64) + (12 * 12 * 64 * 128 + 128) + (128 * 62 + 62)
    assert count(FemnistCNN()) == reddi == 1_206_590
    leaf = (25 * 32 + 32) + (25 * 32 * 64 + 64) + (7 * 7 * 64 * 2048 + 2048) + (2048 * 62 + 62)
    assert count(FemnistCNN(variant="leaf")) == leaf

    def lstm_layer(i, h):  # PyTorch LSTM: 4 gates, two bias vectors each
        return 4 * (h * i + h * h + 2 * h)

    assert count(CharLSTM()) == 80 * 8 + lstm_layer(8, 256) + lstm_layer(256, 256) + 256 * 80 + 80
    # the widely quoted size of the CIFAR ResNet-18 (10 classes); GroupNorm has the same affine parameters as BN
    assert count(ResNet18(num_classes=10)) == count(ResNet18(num_classes=10, norm="batch")) == 11_173_962


def _resnet50_count(num_classes: int) -> int:
    """Parameters of the CIFAR bottleneck ResNet-50, summed block by block."""

    def conv(i, o, k):
        return i * o * k * k

    def norm(c):
        return 2 * c

    total = conv(3, 64, 3) + norm(64)
    in_planes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out = planes * 4
            total += conv(in_planes, planes, 1) + norm(planes) + conv(planes, planes, 3) + norm(planes)
            total += conv(planes, out, 1) + norm(out)
            if b == 0:  # projection shortcut (channels change in every stage's first block)
                total += conv(in_planes, out, 1) + norm(out)
            in_planes = out
    return total + 2048 * num_classes + num_classes


def test_resnet50_count():
    assert count(ResNet50(num_classes=100)) == _resnet50_count(100) == 23_705_252


# ------------------------------------------------------------------ behaviour on tiny instances
def test_tiny_resnets_forward_and_norm_choice():
    x = torch.randn(2, 3, 32, 32)
    for block, blocks in (("basic", (1, 1, 1, 1)), ("bottleneck", (1, 1, 1, 1))):
        gn = ResNet(block, blocks, num_classes=7, width=4, num_groups=2)
        assert gn(x).shape == (2, 7)
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gn.modules())
        assert all(m.num_groups == 2 for m in gn.modules() if isinstance(m, nn.GroupNorm))
        assert len(list(gn.buffers())) == 0  # nothing to average besides parameters
        bn = ResNet(block, blocks, num_classes=7, width=4, norm="batch")
        assert bn(x).shape == (2, 7)
        assert not any(isinstance(m, nn.GroupNorm) for m in bn.modules())
        assert len(list(bn.buffers())) > 0


def test_image_models_accept_flat_rows():
    x = torch.rand(3, 784)
    assert FemnistCNN()(x).shape == (3, 62)
    assert FemnistCNN(variant="leaf")(x).shape == (3, 62)
    assert LeNet5()(x).shape == (3, 10)
    m = LeNet5()
    assert torch.equal(m(x), m(x.reshape(3, 1, 28, 28)))  # the same computation on a view
    assert FC200()(x).shape == (3, 62)
    assert Cifar100CNN()(torch.rand(2, 3, 32, 32)).shape == (2, 100)


@pytest.mark.filterwarnings("ignore:.*self.log.*")
def test_char_rnn_predicts_the_next_character_from_the_last_step():
    torch.manual_seed(0)
    m = CharGRU(vocab_size=80, hidden_size=8)
    x = torch.randint(0, 80, (4, 80), dtype=torch.uint8)  # the data modules store codes as uint8
    y = torch.randint(0, 80, (4,))
    logits = m(x)
    out, _ = m.rnn(m.embedding(x.long()))
    assert torch.equal(logits, m.head(out[:, -1]))  # the same operations
    loss = m.training_step((x, y), 0)
    assert torch.equal(loss, nn.functional.cross_entropy(logits, y))
    assert CharLSTM(hidden_size=8)(x).shape == (4, 80)


@pytest.mark.numerics
def test_bag_of_words_equals_linear_on_l1_normalised_counts():
    torch.manual_seed(0)
    m = BagOfWordsLinear(vocab_size=6, num_classes=2).double()  # float64: the bag sums in another order
    ids = torch.tensor([[0, 0, 3, -1, -1], [5, 1, 2, 2, 4], [-1, -1, -1, -1, -1]], dtype=torch.int32)
    dense = torch.zeros(3, 6, dtype=torch.float64)
    for i, row in enumerate(ids.tolist()):
        toks = [t for t in row if t >= 0]
        for t in toks:
            dense[i, t] += 1 / len(toks)
    assert_close64(m(ids), m.linear(dense))


def test_bad_input():
    with pytest.raises(ValueError, match="num_groups=3 must divide"):
        ResNet18(num_groups=3)
    with pytest.raises(ValueError, match="norm"):
        ResNet18(norm="layer")
    with pytest.raises(ValueError, match="variant"):
        FemnistCNN(variant="tff")
    with pytest.raises(ValueError, match="vocab_size"):
        CharLSTM(vocab_size=1)
    with pytest.raises(ValueError, match="hidden_size"):
        CharGRU(hidden_size=0)
    with pytest.raises(ValueError, match="token id 9 is outside the vocabulary"):
        BagOfWordsLinear(vocab_size=5)(torch.tensor([[1, 9]]))
    with pytest.raises(ValueError, match="num_classes"):
        FC200(num_classes=1)
