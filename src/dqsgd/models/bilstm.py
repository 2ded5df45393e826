"""The DQSGD paper's AG-News model: embedding → 2-layer BiLSTM → self-attention pooling → MLP.

Paper (Appendix F.2): 300-d GloVe embeddings, "two layers bidirectional LSTM", "the
self-attention mechanism to obtain the sentence embedding", then "two fully connected layers of
size 128 and 4". Details it leaves open, and what we chose:

* LSTM hidden size 128 per direction (so token states are 256-d);
* attention pooling with one head (Lin et al., ICLR 2017, r = 1):
  ``a = softmax_t(w₂ᵀ tanh(W₁ h_t))``, ``s = Σ_t a_t h_t``, with ``W₁`` of size 64 × 256;
* embeddings trained from a random init unless a pretrained matrix is given (GloVe is not
  installable offline here).

Padding (token id 0, at the end of each row) is invisible to the output. The backward direction
runs on each row reversed *within its length*, so both directions read the real tokens before any
padding; padded positions then get attention weight exactly 0. An all-padding row pools to zero.
(This is what ``pack_padded_sequence`` achieves too, but packing ragged batches made a CPU
forward+backward 2.5× slower; one unidirectional ``nn.LSTM`` per layer and direction costs the
same as a fused bidirectional one.)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BiLSTMAttention"]

PAD = 0


class BiLSTMAttention(nn.Module):
    """Text classifier over int64 token ids ``(N, L)`` (PAD = 0) → logits ``(N, classes)``."""

    def __init__(self, vocab_size: int, num_classes: int, *, embed_dim: int = 300, hidden_size: int = 128,
                 num_layers: int = 2, attention_dim: int = 64, fc_dim: int = 128,
                 pretrained_embeddings: torch.Tensor | None = None, freeze_embeddings: bool = False) -> None:
        super().__init__()
        if pretrained_embeddings is not None:
            if pretrained_embeddings.dim() != 2 or pretrained_embeddings.shape[0] != vocab_size:
                raise ValueError(f"pretrained embeddings must be ({vocab_size}, dim), "
                                 f"got {tuple(pretrained_embeddings.shape)}")
            embed_dim = pretrained_embeddings.shape[1]
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD)
        if pretrained_embeddings is not None:
            with torch.no_grad():
                self.embedding.weight.copy_(pretrained_embeddings)
            self.embedding.weight.requires_grad_(not freeze_embeddings)
        self.forward_lstms = nn.ModuleList()
        self.backward_lstms = nn.ModuleList()
        for layer in range(num_layers):
            width = embed_dim if layer == 0 else 2 * hidden_size
            self.forward_lstms.append(nn.LSTM(width, hidden_size, batch_first=True))
            self.backward_lstms.append(nn.LSTM(width, hidden_size, batch_first=True))
        self.attention = nn.Sequential(nn.Linear(2 * hidden_size, attention_dim), nn.Tanh(),
                                       nn.Linear(attention_dim, 1, bias=False))
        self.classifier = nn.Sequential(nn.Linear(2 * hidden_size, fc_dim), nn.ReLU(), nn.Linear(fc_dim, num_classes))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states, mask = self.contextual(tokens)
        return self.classifier(self.pool(states, mask))

    def contextual(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """BiLSTM token states ``(N, L, 2·hidden)`` (forward ‖ backward) and the non-PAD mask ``(N, L)``.

        At real positions these equal a packed ``nn.LSTM(bidirectional=True)``; at padded positions
        they are unspecified (and pooled with weight 0).
        """
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"expected integer token ids (N, L), got {tokens.dtype} {tuple(tokens.shape)}")
        mask = tokens != PAD
        states = self.embedding(tokens)
        flip = _reversal_index(mask)
        for forward_lstm, backward_lstm in zip(self.forward_lstms, self.backward_lstms):
            ahead = forward_lstm(states)[0]
            behind = _gather_time(backward_lstm(_gather_time(states, flip))[0], flip)
            states = torch.cat([ahead, behind], dim=-1)
        return states, mask

    @staticmethod
    def pool_weights(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax of ``scores`` (N, L) over the positions where ``mask`` is True; rows sum to 1 or 0.

        Masked scores are set to the dtype's minimum, so after the max-shifted softmax their weight
        underflows to exactly 0; multiplying by the mask and renormalising also makes all-masked
        rows give zero weights (instead of NaN) with finite gradients.
        """
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=1) * mask
        return weights / weights.sum(dim=1, keepdim=True).clamp_min(1e-12)

    def pool(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention-weighted sum of ``states`` (N, L, D) over positions where ``mask`` is True."""
        weights = self.pool_weights(self.attention(states).squeeze(-1), mask)
        return torch.bmm(weights.unsqueeze(1), states).squeeze(1)


def _reversal_index(mask: torch.Tensor) -> torch.Tensor:
    """(N, L) time index that reverses each row's first ``length`` positions and keeps the rest.

    ``length`` is the position of the last non-PAD token + 1, so any PAD inside a row is read as
    a token by the LSTMs (it is still masked out of the attention).
    """
    steps = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    lengths = ((steps + 1) * mask).amax(dim=1, keepdim=True)
    return torch.where(steps < lengths, lengths - 1 - steps, steps)


def _gather_time(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[n, t] = x[n, index[n, t]]`` for ``x`` of shape (N, L, D)."""
    return x.gather(1, index.unsqueeze(-1).expand_as(x))
