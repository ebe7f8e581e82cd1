"""Contrastive loss: hand computation, alignment, same-image masking."""
import math

import pytest
import torch
import torch.nn.functional as F

from clip_mini.loss import ClipLoss, clip_loss


def _xent(row, target):
    return -(row[target] - math.log(sum(math.exp(v) for v in row)))


def test_loss_matches_hand_computation_3x3():
    img = F.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), dim=-1)
    txt = F.normalize(torch.tensor([[1.0, 0.2], [0.1, 1.0], [-1.0, 1.0]]), dim=-1)
    scale = 2.0
    sim = [[scale * float(img[i] @ txt[j]) for j in range(3)] for i in range(3)]
    i2t = sum(_xent(sim[i], i) for i in range(3)) / 3
    t2i = sum(_xent([sim[i][j] for i in range(3)], j) for j in range(3)) / 3
    got = clip_loss(img, txt, torch.tensor(scale))
    assert got.item() == pytest.approx((i2t + t2i) / 2, rel=1e-6)
    assert ClipLoss()(img, txt, torch.tensor(scale)).item() == pytest.approx(got.item())


def test_aligned_pairs_have_lower_loss_than_shuffled():
    torch.manual_seed(0)
    img = F.normalize(torch.randn(16, 8), dim=-1)
    txt = F.normalize(img + 0.1 * torch.randn(16, 8), dim=-1)
    aligned = clip_loss(img, txt, torch.tensor(10.0))
    shuffled = clip_loss(img, txt[torch.randperm(16)], torch.tensor(10.0))
    assert aligned < shuffled


def test_same_image_pairs_are_not_negatives():
    torch.manual_seed(0)
    img = F.normalize(torch.randn(4, 8), dim=-1)
    txt = F.normalize(torch.randn(4, 8), dim=-1)
    img[1] = img[0]  # two captions of one photo
    ids = torch.tensor([0, 0, 1, 2])
    masked = clip_loss(img, txt, torch.tensor(5.0), ids)
    # Hand version: drop entry (0,1) and (1,0) from both softmaxes.
    logits = 5.0 * img @ txt.T
    rows = []
    for i in range(4):
        keep = [j for j in range(4) if not (ids[j] == ids[i] and j != i)]
        rows.append(-(logits[i, i] - torch.logsumexp(logits[i, keep], 0)))
    cols = []
    for j in range(4):
        keep = [i for i in range(4) if not (ids[i] == ids[j] and i != j)]
        cols.append(-(logits[j, j] - torch.logsumexp(logits[keep, j], 0)))
    want = 0.5 * (torch.stack(rows).mean() + torch.stack(cols).mean())
    assert masked.item() == pytest.approx(want.item(), rel=1e-6)
    assert masked.item() != pytest.approx(clip_loss(img, txt, torch.tensor(5.0)).item(), rel=1e-3)
    # with distinct ids nothing is masked: the plain loss (so the difference above is the masking alone)
    distinct = clip_loss(img, txt, torch.tensor(5.0), torch.arange(4))
    assert distinct.item() == pytest.approx(clip_loss(img, txt, torch.tensor(5.0)).item(), rel=1e-6)
