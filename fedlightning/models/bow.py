r"""Linear classifier on a normalised bag-of-words (Sent140, seed 004).

.. math::
    f(x) = W\,\frac{\mathrm{counts}(x)}{\lVert \mathrm{counts}(x) \rVert_1} + b
         = \frac{1}{|x|}\sum_{t \in x} W_{:,t} + b

Seed 004 (Table I): "a normalised bag-of-words vector of size 5k, built from the 5k most frequent tokens", a linear
binary classifier of 0.32 Mb = 10,002 parameters (5000·2 + 2: two logits with softmax cross-entropy).

Decision (ours): "normalised" is read as L1 normalisation (token frequencies), which makes the linear layer the mean
of the weight columns of the tweet's in-vocabulary tokens. The model therefore takes the token ids directly — an
``(N, L)`` integer tensor padded with ``-1`` (tokens outside the vocabulary are also ``-1``) — and never builds the
5,000-wide dense vector (336k tweets × 5k floats would be 6.7 GB). A tweet with no in-vocabulary token gets
``f(x) = b``. The result equals ``nn.Linear(vocab_size, num_classes)`` applied to the L1-normalised count vector.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedlightning._validation import integer
from fedlightning.models.base import Classifier

__all__ = ["BagOfWordsLinear"]


class BagOfWordsLinear(Classifier):
    """Linear model on L1-normalised bag-of-words features given as padded token ids (see the module docstring).

    Args:
        vocab_size: vocabulary size ``V`` (seed 004: 5000). Token ids must lie in ``[0, V)``, padding is ``-1``.
        num_classes: classes (Sent140: 2).
        lr: learning rate when trained on its own; default seed 004's η₀ = 3.0 for Sent140.
    """

    def __init__(self, vocab_size: int = 5000, num_classes: int = 2, lr: float = 3.0):
        super().__init__(num_classes=num_classes, lr=lr)
        self.vocab_size = integer("vocab_size", vocab_size)
        self.linear = nn.Linear(self.vocab_size, self.num_classes)
        self.net = self.linear

    def forward(self, token_ids: Tensor) -> Tensor:
        ids = token_ids.long()
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        # checked on CPU only: on an accelerator the check would synchronise every step (an out-of-range index
        # raises a device-side assertion there anyway)
        if ids.device.type == "cpu" and ids.numel() and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(ids.max())} is outside the vocabulary [0, {self.vocab_size})")
        mask = (ids >= 0).to(self.linear.weight.dtype)  # (N, L)
        columns = self.linear.weight.t()[ids.clamp(min=0)]  # (N, L, C): W[:, t] for every token
        summed = (columns * mask.unsqueeze(-1)).sum(dim=1)
        counts = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        return summed / counts + self.linear.bias
