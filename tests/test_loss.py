"""Contrastive losses: hand computation, alignment, same-image masking, label smoothing, SigLIP."""
import math

import pytest
import torch
import torch.nn.functional as F

from clip_mini.model.loss import ClipLoss, clip_loss, siglip_loss


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


def test_label_smoothing_matches_cross_entropy_and_stays_finite_under_masking():
    torch.manual_seed(0)
    img, txt = F.normalize(torch.randn(6, 8), dim=-1), F.normalize(torch.randn(6, 8), dim=-1)
    logits = 5.0 * img @ txt.T
    labels = torch.arange(6)
    want = 0.5 * (F.cross_entropy(logits, labels, label_smoothing=0.1)
                  + F.cross_entropy(logits.T, labels, label_smoothing=0.1))
    got = clip_loss(img, txt, torch.tensor(5.0), label_smoothing=0.1)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert got > clip_loss(img, txt, torch.tensor(5.0))   # smoothing moves the target off the argmax's
    ids = torch.tensor([0, 0, 1, 2, 3, 3])
    masked = clip_loss(img, txt, torch.tensor(5.0), ids, label_smoothing=0.1)
    assert torch.isfinite(masked)
    # hand version: masked entries leave each softmax, the smoothing mass goes to the entries left
    same = (ids[:, None] == ids[None, :]) & ~torch.eye(6, dtype=torch.bool)

    def side(lg):
        total = 0.0
        for i in range(6):
            keep = [j for j in range(6) if not same[i, j]]
            row = lg[i, keep].log_softmax(0)
            total += -(0.9 * row[keep.index(i)] + 0.1 * row.mean())
        return total / 6

    assert masked.item() == pytest.approx(0.5 * (side(logits) + side(logits.T)).item(), rel=1e-5)

def test_siglip_loss_matches_hand_computation_and_counts_same_image_captions_as_positives():
    img = F.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), dim=-1)
    txt = F.normalize(torch.tensor([[1.0, 0.2], [0.1, 1.0], [-1.0, 1.0]]), dim=-1)
    scale, bias = torch.tensor(10.0), torch.tensor(-5.0)

    def hand(positive):
        total = 0.0
        for i in range(3):
            for j in range(3):
                z = float(scale * (img[i] @ txt[j]) + bias)
                total += math.log1p(math.exp(-z if positive(i, j) else z))
        return total / 3

    assert siglip_loss(img, txt, scale, bias).item() == pytest.approx(hand(lambda i, j: i == j), rel=1e-5)
    ids = torch.tensor([0, 0, 1])
    assert siglip_loss(img, txt, scale, bias, ids).item() == pytest.approx(
        hand(lambda i, j: ids[i] == ids[j]), rel=1e-5)
    torch.manual_seed(0)
    a = F.normalize(torch.randn(16, 8), dim=-1)
    b = F.normalize(a + 0.1 * torch.randn(16, 8), dim=-1)
    assert siglip_loss(a, b, scale, bias) < siglip_loss(a, b[torch.randperm(16)], scale, bias)
