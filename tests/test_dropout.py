"""clip_mini.model.layers.dropout: torch's dropout in distribution with a cheaper CPU mask, and the text tower using it."""
import pytest
import torch

from clip_mini.config import TextConfig
from clip_mini.model.layers.dropout import fast_dropout, keep_mask
from clip_mini.model.text import TextEncoder


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_and_expectation(p):
    torch.manual_seed(0)
    keep, q = keep_mask(torch.Size([1000, 1000]), p)
    assert abs(q - (1 - p)) < 1e-4
    # at p=0.5 a field with a stuck sign bit (int64 random_ leaves the top bit 0) would keep 2/3 of the elements
    assert abs(keep.float().mean().item() - q) < 0.003
    y = fast_dropout(torch.ones(1000, 1000), p)
    values = torch.unique(y)
    assert abs(y.mean().item() - 1.0) < 0.01 and len(values) == 2 and values[0] == 0
    assert values[1].item() == pytest.approx(1 / q)


def test_identity_when_off_and_gradient_is_the_mask():
    x = torch.randn(64, 32, requires_grad=True)
    assert fast_dropout(x, 0.1, training=False) is x and fast_dropout(x, 0.0) is x
    assert not fast_dropout(x, 0.999999).any() and not fast_dropout(x, 1.0).any()   # rounds to "drop everything"
    y = fast_dropout(x, 0.25)
    y.sum().backward()
    kept = y != 0
    _, q = keep_mask(torch.Size([1]), 0.25)
    assert torch.equal(x.grad, kept.float() / q) and torch.allclose(y[kept], x[kept] / q)


def test_masks_replay_under_the_seed_and_differ_otherwise():
    x = torch.ones(256, 64, dtype=torch.bfloat16)
    torch.manual_seed(3)
    a, b = fast_dropout(x, 0.1), fast_dropout(x, 0.1)
    torch.manual_seed(3)
    assert torch.equal(fast_dropout(x, 0.1), a) and not torch.equal(a, b)


def test_text_tower_trains_with_it_and_never_calls_bernoulli():
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    enc = TextEncoder(TextConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.1, max_length=16),
                      vocab_size=100)
    ids, mask = torch.randint(5, 100, (8, 12)), torch.ones(8, 12, dtype=torch.long)
    enc.train()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = enc(ids, mask)
        out.sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert "aten::bernoulli_" not in names and "aten::random_" in names
    assert enc.bert.config._attn_implementation == "clip_mini_eager"
    enc.eval()
    with torch.no_grad():
        a, b = enc(ids, mask), enc(ids, mask)
    assert torch.equal(a, b) and not torch.allclose(out, a)   # dropout only while training
