r"""Character-level recurrent models for next-character prediction (LEAF Shakespeare).

.. math::
    h_{1:T} = \mathrm{RNN}_2(\mathrm{RNN}_1(E\,x_{1:T})), \qquad \hat y = W h_T + b

Inputs are ``(N, T)`` integer character codes (any integer dtype; LEAF uses ``T = 80``); the output is the logits of
the character that follows the window (one target per sample, as in LEAF and seeds 000/003/004).

* :class:`CharLSTM`: LEAF's reference model (Caldas et al. 2018; also the FedDANE code, seed 003): embedding 8,
  two stacked LSTM layers of 256 units, linear output. Seed 000 runs "an LSTM" on Shakespeare.
* :class:`CharGRU`: seed 004 (Table I): embedding 79→8, two stacked GRU layers of 128 units, softmax output;
  162,887 parameters with PyTorch's GRU (two bias vectors per gate) and a 79-symbol vocabulary, the paper's 5.21 Mb.

The ``lr`` and ``vocab_size`` defaults are in the classes' docstrings.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedlightning._validation import integer
from fedlightning.models.base import Classifier

__all__ = ["CharLSTM", "CharGRU"]


class _CharRNN(Classifier):
    cell: type = nn.LSTM

    def __init__(self, vocab_size: int, embedding_dim: int, hidden_size: int, num_layers: int, lr: float):
        vocab_size = integer("vocab_size", vocab_size, 2)
        embedding_dim, hidden_size = integer("embedding_dim", embedding_dim), integer("hidden_size", hidden_size)
        num_layers = integer("num_layers", num_layers)
        super().__init__(num_classes=vocab_size, lr=lr)
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(self.vocab_size, embedding_dim)
        self.rnn = self.cell(embedding_dim, hidden_size, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden_size, self.vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(self.embedding(x.long()))
        return self.head(out[:, -1, :])


class CharLSTM(_CharRNN):
    """LEAF's Shakespeare LSTM: embedding 8, 2×LSTM(256), linear head (819,920 parameters for 80 symbols).

    ``lr`` (used only when a model is trained on its own) defaults to FedProx's tuned Shakespeare rate 0.8 for the LSTM
    and seed 004's η₀ = 0.1 for the GRU. ``vocab_size`` defaults to 80, LEAF's ``ALL_LETTERS`` (see
    :mod:`fedlightning.datamodules.shakespeare`); seed 004's 79 is one symbol fewer (its vocabulary is not listed), so
    ``CharGRU(vocab_size=79)`` reproduces its size exactly.
    """

    cell = nn.LSTM

    def __init__(
        self, vocab_size: int = 80, embedding_dim: int = 8, hidden_size: int = 256, num_layers: int = 2, lr: float = 0.8
    ):
        super().__init__(vocab_size, embedding_dim, hidden_size, num_layers, lr)


class CharGRU(_CharRNN):
    """Seed 004's Shakespeare GRU: embedding 8, 2×GRU(128), linear head (162,887 parameters for 79 symbols).

    ``lr`` (used only when a model is trained on its own) defaults to FedProx's tuned Shakespeare rate 0.8 for the LSTM
    and seed 004's η₀ = 0.1 for the GRU. ``vocab_size`` defaults to 80, LEAF's ``ALL_LETTERS`` (see
    :mod:`fedlightning.datamodules.shakespeare`); seed 004's 79 is one symbol fewer (its vocabulary is not listed), so
    ``CharGRU(vocab_size=79)`` reproduces its size exactly.
    """

    cell = nn.GRU

    def __init__(
        self, vocab_size: int = 80, embedding_dim: int = 8, hidden_size: int = 128, num_layers: int = 2, lr: float = 0.1
    ):
        super().__init__(vocab_size, embedding_dim, hidden_size, num_layers, lr)
