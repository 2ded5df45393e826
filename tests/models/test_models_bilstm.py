"""The BiLSTM text model: padding is invisible, and it is a real (packed) bidirectional LSTM."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dqsgd.models import BiLSTMAttention, DatasetInfo, build_model

SMALL = {"embed_dim": 12, "hidden_size": 10, "attention_dim": 6, "fc_dim": 8}


def _model(seed: int = 0, **options: int) -> BiLSTMAttention:
    torch.manual_seed(seed)
    return BiLSTMAttention(vocab_size=40, num_classes=3, **{**SMALL, **options}).eval()


def _tokens() -> torch.Tensor:
    x = torch.randint(2, 40, (4, 15), generator=torch.Generator().manual_seed(1))
    for row, length in enumerate([15, 9, 3, 1]):
        x[row, length:] = 0
    return x


def test_more_padding_does_not_change_the_output() -> None:
    model, x = _model(), _tokens()
    longer = torch.cat([x, torch.zeros(4, 11, dtype=torch.int64)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(longer), model(x), rtol=0, atol=1e-6)


def test_what_sits_in_padded_positions_does_not_change_the_output() -> None:
    model, x = _model(), _tokens()
    with torch.no_grad():
        before = model(x)
        model.embedding.weight[0] = torch.randn(12) * 100  # the PAD vector fed to the LSTMs
        after = model(x)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_padded_positions_get_exactly_zero_attention() -> None:
    model, x = _model(), _tokens()
    with torch.no_grad():
        states, mask = model.contextual(x)
        weights = model.pool_weights(model.attention(states).squeeze(-1), mask)
    assert torch.equal(weights[~mask], torch.zeros_like(weights[~mask]))
    torch.testing.assert_close(weights.sum(1), torch.ones(4))


def test_an_all_padding_row_is_finite_and_has_finite_gradients() -> None:
    model = _model().train()
    x = _tokens()
    x[3] = 0
    loss = nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0]))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_states_equal_a_packed_bidirectional_nn_lstm() -> None:
    """Copy our per-direction weights into nn.LSTM(bidirectional=True) and run it on packed input."""
    model, x = _model(), _tokens()
    ref = nn.LSTM(12, 10, num_layers=2, batch_first=True, bidirectional=True)
    with torch.no_grad():
        for layer, (fwd, bwd) in enumerate(zip(model.forward_lstms, model.backward_lstms)):
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(ref, f"{kind}_l{layer}").copy_(getattr(fwd, f"{kind}_l0"))
                getattr(ref, f"{kind}_l{layer}_reverse").copy_(getattr(bwd, f"{kind}_l0"))
        states, mask = model.contextual(x)
        lengths = mask.sum(1)
        packed = pack_padded_sequence(model.embedding(x), lengths, batch_first=True, enforce_sorted=False)
        expected, _ = pad_packed_sequence(ref(packed)[0], batch_first=True, total_length=x.shape[1])
    torch.testing.assert_close(states[mask], expected[mask], rtol=1e-5, atol=1e-6)


def test_pretrained_embeddings_are_used_and_can_be_frozen() -> None:
    table = torch.randn(40, 7)
    model = BiLSTMAttention(40, 3, pretrained_embeddings=table, freeze_embeddings=True, hidden_size=5)
    assert torch.equal(model.embedding.weight, table) and not model.embedding.weight.requires_grad
    info = DatasetInfo(num_classes=4, input_shape=(15,), kind="text", vocab_size=40)
    built = build_model("bilstm", info, pretrained_embeddings=table, hidden_size=5)
    assert built.embedding.weight.shape == (40, 7) and built.embedding.weight.requires_grad
    assert built(_tokens()).shape == (4, 4)


def test_default_size_follows_the_paper() -> None:
    torch.manual_seed(0)
    model = build_model("bilstm", DatasetInfo(num_classes=4, input_shape=(20,), kind="text", vocab_size=100))
    assert model.embedding.embedding_dim == 300 and len(model.forward_lstms) == 2
    assert model.classifier[0].out_features == 128 and model.classifier[-1].out_features == 4
    with torch.no_grad():
        assert model(torch.randint(0, 100, (2, 20))).shape == (2, 4)
