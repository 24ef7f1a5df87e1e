"""Token labeling: crop-aligned score maps, the VOLO loss with MixToken, and learning on digits."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from timm.models.volo import VOLO

from vitpod.trainer.data import DataConfig, create_loader
from vitpod.trainer.data.token_label import TokenLabelError, crop_scores
from vitpod.trainer.model.token_loss import TokenLabelCriterion
from vitpod.trainer.tokenlabels.token_forward import forward_train
from vitpod.trainer.tokenlabels.token_teacher import generate_token_labels


def _tiny_volo(mix_token: bool = False) -> VOLO:
    return VOLO(img_size=32, layers=(1, 1), embed_dims=(32, 64), num_heads=(1, 2), patch_size=8,
                stem_hidden_dim=16, num_classes=10, use_mix_token=mix_token)  # fmt: skip


def test_score_maps_are_cropped_and_flipped_with_the_image():
    dense = torch.zeros(2, 4, 4)
    dense[0, :, :2] = 1.0  # class 0 on the left half, class 1 on the right
    dense[1, :, 2:] = 1.0
    left = crop_scores(dense, (0.0, 0.0, 0.5, 1.0), size=2, flipped=False)
    assert torch.allclose(left, torch.tensor([[1.0, 0.0]] * 4))
    whole_flipped = crop_scores(dense, (0.0, 0.0, 1.0, 1.0), size=2, flipped=True)
    assert whole_flipped.argmax(1).tolist() == [1, 0, 1, 0], "row-major 2x2: left column is class 1"
    assert torch.allclose(whole_flipped.sum(1), torch.ones(4))


def test_forward_train_gives_logits_and_matches_timm_without_mixing():
    torch.manual_seed(0)
    model = _tiny_volo().train()
    images = torch.randn(4, 3, 32, 32)
    cls_logits, token_logits, bbox = forward_train(model, images, mix_token=False)
    features, timm_tokens, _ = model.forward_train(images)
    assert cls_logits.shape == (4, 10) and token_logits.shape == (4, 4, 10) and bbox == (0, 0, 0, 0)
    assert torch.allclose(cls_logits, model.head(features), atol=1e-5)
    assert torch.allclose(token_logits, timm_tokens, atol=1e-5)
    with pytest.raises(TokenLabelError, match="VOLO.forward_train skips the head"):
        TokenLabelCriterion()((features, timm_tokens, bbox), torch.zeros(4, dtype=torch.long))


def test_criterion_mixes_the_class_target_by_the_mixtoken_box():
    target = torch.zeros(2, 2 + 4, 3)
    target[0, :, 0] = 1.0
    target[1, :, 1] = 1.0
    token_logits = torch.zeros(2, 4, 3)
    cls_logits = torch.log(torch.tensor([[0.5, 0.5, 1e-9], [0.5, 0.5, 1e-9]]))
    unmixed = TokenLabelCriterion(dense_weight=0.0)(
        (cls_logits, token_logits, (0, 0, 0, 0)), target
    )
    mixed = TokenLabelCriterion(dense_weight=0.0)((cls_logits, token_logits, (0, 0, 1, 2)), target)
    assert unmixed.item() == pytest.approx(-torch.log(torch.tensor(0.5)).item(), rel=1e-5)
    assert mixed.item() == pytest.approx(unmixed.item(), rel=1e-5), "half-mixed target, same CE"
    confident = torch.log(torch.tensor([[1 - 1e-6, 1e-6, 1e-9], [1e-6, 1 - 1e-6, 1e-9]]))
    sure = TokenLabelCriterion(dense_weight=0.0)
    assert sure((confident, token_logits, (0, 0, 0, 0)), target) < 1e-4
    assert sure((confident, token_logits, (0, 0, 1, 2)), target) > 1.0, "lam = 0.5 must mix"
    with pytest.raises(TokenLabelError, match="set --token-label-size 3"):
        TokenLabelCriterion()((cls_logits, torch.zeros(2, 9, 3), (0, 0, 0, 0)), target)


def test_missing_token_label_entries_are_named_before_training(digits_dir, tmp_path):
    model = _tiny_volo().eval()
    cfg = DataConfig(data_dir=str(digits_dir), img_size=32, batch_size=16, workers=0,
                     token_label=True, token_label_data=str(tmp_path / "none.pt"),
                     token_label_size=2)  # fmt: skip
    with pytest.raises(TokenLabelError, match="none.pt does not exist"):
        create_loader(cfg, "train", 0, 1)
    path = generate_token_labels(model, digits_dir, tmp_path / "tl.pt", img_size=32, topk=3)
    data = torch.load(path, weights_only=True)
    del data["index"]["train/3/0001.jpg"]
    torch.save(data, tmp_path / "partial.pt")
    partial = dataclasses.replace(cfg, token_label_data=str(tmp_path / "partial.pt"))
    with pytest.raises(TokenLabelError, match=r"no token labels for 1 of 1433 .*train/3/0001.jpg"):
        create_loader(partial, "train", 0, 1)


def _accuracy(model, loader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, targets in loader:
            correct += (model(images).argmax(1) == targets).sum().item()
            total += len(targets)
    model.train()
    return 100.0 * correct / total


def _train(model, loader, epochs: int, loss_fn, forward) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, targets in loader:
            loss = loss_fn(forward(model, images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def _no_mixing(model, images):
    return forward_train(model, images, mix_token=False)


@pytest.mark.slow
def test_a_student_learns_digits_from_teacher_token_labels(digits_dir, tmp_path):
    torch.manual_seed(0)
    random.seed(0)
    base = DataConfig(data_dir=str(digits_dir), img_size=32, batch_size=64, workers=0,
                      loader="torch", auto_augment=None, reprob=0.0, scale=(0.5, 1.0))  # fmt: skip
    val = create_loader(base, "val", 0, 1)
    teacher = _tiny_volo()  # plain labels on the class token and on every token
    plain = TokenLabelCriterion()
    _train(teacher, create_loader(base, "train", 0, 1), 4, plain, _no_mixing)
    teacher_acc = _accuracy(teacher, val)
    assert teacher_acc > 50.0
    path = generate_token_labels(teacher, digits_dir, tmp_path / "tl.pt", img_size=32, topk=3)
    cfg = dataclasses.replace(
        base, token_label=True, token_label_data=str(path), token_label_size=2
    )
    train = create_loader(cfg, "train", 0, 1)
    images, targets = next(iter(train))
    assert targets.shape == (64, 2 + 4, 10) and torch.allclose(targets.sum(-1), torch.ones(64, 6))
    student = _tiny_volo(mix_token=True)
    losses = _train(student, train, 5, TokenLabelCriterion(), forward_train)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    student_acc = _accuracy(student, val)
    assert last < first - 0.1, f"token-label loss {first:.3f} -> {last:.3f}"
    assert student_acc > 30.0, (
        f"student {student_acc:.1f}% (teacher {teacher_acc:.1f}%, chance 10%)"
    )
