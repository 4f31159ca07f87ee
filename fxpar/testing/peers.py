"""Peers' own models, as their tests build them, to compare fxpar with on the peer's ground.

``TransformerWithLoss`` is torch's DTensor test Transformer
(``torch.testing._internal.distributed._tensor.common_dtensor.Transformer``, which has a ``parallelize``
method written with ``parallelize_module``) returning its loss the way fxpar's training step reads it:
a dict with ``"loss"``. Subclassing keeps every parameter's FQN and the peer's ``parallelize``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

# dropout off (rank-independent numerics); no causal flag: DTensor's CPU attention rule takes none
ARGS = dict(n_layers=2, vocab_size=64, max_seq_len=16, dim=64, n_heads=4, dropout_p=0.0, use_attn_mask=False,
            weight_tying=False)

# the peer's parallelize() in fxpar's plan vocabulary: Megatron pairs in every block, embeddings by rows
PLAN = {"tok_embeddings": "vocab_parallel", "pos_embeddings": "vocab_parallel",
        "layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise"}


class TransformerWithLoss(Transformer):
    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None):
        logits = super().forward(tokens)
        if labels is None:
            return {"logits": logits}
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def build(seed: int = 0, **overrides) -> TransformerWithLoss:
    torch.manual_seed(seed)
    return TransformerWithLoss(ModelArgs(**(ARGS | overrides)))


def batch(model: TransformerWithLoss, batch: int = 4, seq: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.model_args.vocab_size, (batch, seq), generator=g)
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}
