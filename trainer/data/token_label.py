"""Token labeling: teacher score maps on shared storage, crop-aligned targets, the VOLO loss.

Stored data: one torch file (zip format, loaded with mmap so ranks and workers share pages)
holding, per training image, the teacher's per-token top-k class probabilities
`values [N, k, H, W]` (float16) and `indices [N, k, H, W]`, computed on the whole image
resized to the teacher's input size, plus `index`: relative image path -> row.
A training sample's target is a float tensor [2 + S*S, C]: row 0 the ground-truth one-hot,
row 1 the class-token target (the mean of the token targets), rows 2.. the per-token targets
for the crop: the dense map is cut with the same box (`roi_align`) and flipped like the image,
then resampled to S x S = token_label_size^2.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torchvision.ops import roi_align

from vitpod.trainer import labelset
from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.sources import DataSourceError, Split, folder_split
from vitpod.trainer.data.transforms import eval_transform
from vitpod.trainer.torchsave import atomic_torch_save

FORMAT = "vitpod-token-labels/1"


class TokenLabelError(DataSourceError):
    """Token-label data is missing, incomplete or does not fit the run; the message says how."""


# --------------------------------------------------------------------------- model outputs
def forward_train(
    model: Any, images: torch.Tensor, mix_token: bool = True, beta: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """VOLO's training forward with MixToken: (class logits [B,C], token logits [B,N,C], bbox).

    timm's `VOLO.forward_train` returns the pooled features instead of class logits (its head
    is not applied), so the trainer calls this. The bbox is on the final token grid; the token
    logits inside it are already swapped back, so only the class target needs mixing.
    """
    from timm.models.volo import rand_bbox

    x = model.patch_embed(images).permute(0, 2, 3, 1)  # B,H,W,C
    bbox = (0, 0, 0, 0)
    scale = model.pooling_scale
    grid_h, grid_w = x.shape[1] // scale, x.shape[2] // scale
    if mix_token and model.training:
        lam: Any = torch.distributions.Beta(beta, beta).sample()  # rand_bbox takes a tensor
        bbox = rand_bbox(x.size(), lam, scale=scale)
        x = _swap_box(x, [c * scale for c in bbox])
    tokens = _final_tokens(model, x)
    cls_logits = model.head(model.head_drop(tokens[:, 0]))
    aux = model.aux_head(tokens[:, 1:]).reshape(len(images), grid_h, grid_w, -1)
    if bbox != (0, 0, 0, 0):
        aux = _swap_box(aux, list(bbox))
    return cls_logits, aux.reshape(len(images), grid_h * grid_w, -1), bbox


def dense_logits(model: Any, images: torch.Tensor) -> torch.Tensor:
    """Per-token class logits [B, C, H, W] of a VOLO (aux head) or ViT-style teacher."""
    if getattr(model, "aux_head", None) is not None:
        x = model.patch_embed(images).permute(0, 2, 3, 1)
        logits = model.aux_head(_final_tokens(model, x)[:, 1:])
    elif hasattr(model, "num_prefix_tokens") and hasattr(model, "head"):
        tokens = model.forward_features(images)[:, model.num_prefix_tokens :]
        logits = model.head(model.fc_norm(tokens))
    else:
        raise TokenLabelError(
            f"teacher {type(model).__name__} has no per-token classifier: use a VOLO (aux head) "
            "or a timm ViT-style model"
        )
    side = int(round(logits.shape[1] ** 0.5))
    if side * side != logits.shape[1]:
        raise TokenLabelError(f"teacher gives {logits.shape[1]} tokens, not a square grid")
    return logits.transpose(1, 2).reshape(len(images), -1, side, side)


def _final_tokens(model: Any, x: torch.Tensor) -> torch.Tensor:
    x = model.forward_tokens(x)
    if model.post_network is not None:
        x = model.forward_cls(x)
    return model.norm(x)


def _swap_box(x: torch.Tensor, box: list[int]) -> torch.Tensor:
    """Replace box [h0, w0, h1, w1] of each sample by that of the batch reversed (MixToken)."""
    h0, w0, h1, w1 = box
    mixed = x.clone()
    mixed[:, h0:h1, w0:w1, :] = x.flip(0)[:, h0:h1, w0:w1, :]
    return mixed


# --------------------------------------------------------------------------- generation
@torch.no_grad()
def generate_token_labels(
    model_or_checkpoint: nn.Module | str | os.PathLike[str],
    data_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    img_size: int,
    topk: int = 5,
    batch_size: int = 64,
) -> Path:
    """Run the teacher over `data_dir/train` and write its top-k token scores to `out_path`.

    The teacher is a module or a file saved with `torch.save(model)`. The file is written
    under a temporary name, fsynced and renamed, so readers never see a partial one.
    """
    teacher = _load_teacher(model_or_checkpoint).eval()
    split = folder_split(Path(data_dir), "train")
    if len(split.classes) != _teacher_classes(teacher):
        raise TokenLabelError(
            f"teacher predicts {_teacher_classes(teacher)} classes, {data_dir} has "
            f"{len(split.classes)}: use a teacher trained on these classes"
        )
    transform = eval_transform(DataConfig(data_dir=str(data_dir), img_size=img_size, crop_pct=1.0))
    values, indices = [], []
    for images in _batches(split, transform, batch_size):
        probs = dense_logits(teacher, images).float().softmax(dim=1)
        top = probs.topk(min(topk, probs.shape[1]), dim=1)
        values.append(top.values.half())
        indices.append(top.indices.to(torch.int16 if probs.shape[1] < 2**15 else torch.int32))
    data = {
        "format": FORMAT,
        "num_classes": len(split.classes),
        "classes": split.classes,
        "img_size": img_size,
        "index": {split.relpath(i): i for i in range(len(split))},
        "values": torch.cat(values),
        "indices": torch.cat(indices),
    }
    atomic_torch_save(data, Path(out_path))
    return Path(out_path)


def _load_teacher(model_or_checkpoint: nn.Module | str | os.PathLike[str]) -> nn.Module:
    if isinstance(model_or_checkpoint, nn.Module):
        return model_or_checkpoint
    loaded = torch.load(model_or_checkpoint, map_location="cpu", weights_only=False)
    if not isinstance(loaded, nn.Module):
        raise TokenLabelError(
            f"{model_or_checkpoint} holds a {type(loaded).__name__}, not a model: pass the teacher "
            "module, or a file written by torch.save(model)"
        )
    return loaded


def _teacher_classes(model: Any) -> int:
    head = getattr(model, "aux_head", None) or model.head
    return int(head.out_features)


def _batches(split: Split, transform: Any, batch_size: int) -> Iterator[torch.Tensor]:
    assert split.files is not None
    for start in range(0, len(split), batch_size):
        images = []
        for path in split.files[start : start + batch_size]:
            with Image.open(path) as img:
                images.append(transform(img.convert("RGB")))
        yield torch.stack(images)


# --------------------------------------------------------------------------- loading
class TokenLabelStore:
    """Reads stored score maps (memory-mapped) and turns them into crop-aligned targets.

    Pickles as its path only, so DataLoader workers map the file themselves.
    """

    def __init__(self, path: Path, num_classes: int, size: int):
        self.path, self.num_classes, self.size = path, num_classes, size
        self._data: dict[str, Any] | None = None

    @classmethod
    def open(cls, cfg: DataConfig, num_classes: int, split: Split | None = None) -> TokenLabelStore:
        """Open and check cfg.token_label_data (one file, or a sharded directory with a manifest
        from `python -m vitpod.trainer.label`); with `split`, every image must have an entry."""
        path = Path(cfg.token_label_data)
        store = cls(path, num_classes, cfg.token_label_size)
        if path.is_dir():
            store._check_manifest(split)
        data = store.data
        if data.get("format") != FORMAT:
            raise TokenLabelError(f"{path} is not token-label data ({FORMAT}): regenerate it")
        if data["num_classes"] != num_classes:
            raise TokenLabelError(
                f"{path} has scores for {data['num_classes']} classes, the data has {num_classes}"
            )
        if split is not None:
            missing = [p for p in map(split.relpath, range(len(split))) if p not in data["index"]]
            if missing:
                raise TokenLabelError(
                    f"{path} has no token labels for {len(missing)} of {len(split)} images "
                    f"(first: {missing[:3]}): regenerate it over {split.root}"
                )
        return store

    def _check_manifest(self, split: Split | None) -> None:
        """A sharded directory: the manifest must fit this data set and this grid."""
        manifest = labelset.read_manifest(self.path)
        names = None
        if split is not None and split.files is not None:
            names = [split.relpath(i) for i in range(len(split))]
        found = labelset.problems(
            manifest, where=f"--token-label-data {self.path}", names=names,
            data_dir=str(split.root) if split is not None else None,
            img_size=self.size * labelset.STRIDE,
        )  # fmt: skip
        if found:
            raise TokenLabelError("; ".join(found))

    @property
    def data(self) -> dict[str, Any]:
        if self._data is None:
            if self.path.is_dir():
                self._data = _load_shards(self.path)
            elif not self.path.is_file():
                raise TokenLabelError(
                    f"--token-label-data {self.path} does not exist: make it with "
                    "`make token-labels` (python -m vitpod.trainer.label)"
                )
            else:
                self._data = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        return self._data

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "num_classes": self.num_classes, "size": self.size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.num_classes, self.size = state["path"], state["num_classes"], state["size"]
        self._data = None

    def target(
        self, relpath: str, label: int, box: tuple[float, float, float, float], flipped: bool
    ) -> torch.Tensor:
        """[2 + S*S, C]: one-hot label, class-token target, token targets of the crop `box`."""
        row = self.data["index"].get(relpath)
        if row is None:
            raise TokenLabelError(f"{self.path} has no token labels for {relpath}: regenerate it")
        dense = self.dense(row)
        tokens = crop_scores(dense, box, self.size, flipped)
        one_hot = F.one_hot(torch.tensor(label), self.num_classes).float()
        return torch.cat([one_hot[None], tokens.mean(0, keepdim=True), tokens])

    def dense(self, row: int) -> torch.Tensor:
        """The stored top-k of image `row` as a dense [C, H, W] distribution."""
        data = self.data
        if "shards" in data:  # row -> (shard, row in shard): shards stay memory-mapped
            shard = data["shard_of"][row]
            part, row = data["shards"][shard], row - data["starts"][shard]
            values, indices = part["values"][row].float(), part["indices"][row].long()
        else:
            values, indices = data["values"][row].float(), data["indices"][row].long()
        dense = torch.zeros(self.num_classes, *values.shape[1:])
        return dense.scatter_(0, indices, values)


def _load_shards(path: Path) -> dict[str, Any]:
    """A sharded label directory as one index over memory-mapped shards (no copy)."""
    manifest = labelset.read_manifest(path)
    if manifest is None:
        raise TokenLabelError(
            f"--token-label-data {path} has no {labelset.MANIFEST}: its labeling job has not "
            "finished; rerun `make token-labels` (finished shards are kept)"
        )
    shards: list[dict[str, Any]] = []
    starts: list[int] = []
    shard_of: list[int] = []
    index: dict[str, int] = {}
    for number in range(manifest["num_shards"]):
        part = torch.load(
            labelset.shard_path(path, number, manifest["num_shards"]),
            map_location="cpu", mmap=True, weights_only=True,
        )  # fmt: skip
        starts.append(len(shard_of))
        for name, row in part["index"].items():
            index[name] = starts[-1] + row
        shard_of.extend([number] * len(part["index"]))
        shards.append(part)
    return {
        "format": FORMAT, "num_classes": manifest["num_classes"], "index": index,
        "shards": shards, "starts": starts, "shard_of": shard_of,
    }  # fmt: skip


def crop_scores(
    dense: torch.Tensor, box: tuple[float, float, float, float], size: int, flipped: bool
) -> torch.Tensor:
    """Cut box (x0, y0, x1, y1 in fractions) out of dense [C, H, W]: [size*size, C], rows sum 1."""
    _, height, width = dense.shape
    x0, y0, x1, y1 = box
    roi = torch.tensor([[0, x0 * width, y0 * height, x1 * width, y1 * height]], dtype=dense.dtype)
    crop = roi_align(dense[None], roi, output_size=size, spatial_scale=1.0, aligned=True)[0]
    if flipped:
        crop = crop.flip(-1)
    tokens = crop.flatten(1).T
    return tokens / tokens.sum(1, keepdim=True).clamp_min(1e-8)


# --------------------------------------------------------------------------- loss
class TokenLabelCriterion(nn.Module):
    """VOLO's token-labeling loss: soft CE on the class token + 0.5 x soft CE on every token.

    `output` is `forward_train`'s (class logits, token logits, bbox) or plain logits;
    `target` is the loader's [B, 2 + N, C] tensor or plain class indices.
    """

    def __init__(
        self, ground_truth: bool = False, dense_weight: float = 0.5, cls_weight: float = 1.0
    ):
        super().__init__()
        self.ground_truth, self.dense_weight, self.cls_weight = (
            ground_truth,
            dense_weight,
            cls_weight,
        )

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        cls_logits, token_logits, bbox = _unpack(output)
        classes = cls_logits.shape[-1]
        if target.dim() == 1:  # plain labels: every token gets the image label
            target = F.one_hot(target, classes).float()[:, None].expand(-1, 2, -1)
        cls_target = target[:, 0] if self.ground_truth else target[:, 1]
        if token_logits is not None:
            h0, w0, h1, w1 = bbox
            lam = 1.0 - (h1 - h0) * (w1 - w0) / token_logits.shape[1]
            if lam < 1.0:
                cls_target = lam * cls_target + (1.0 - lam) * cls_target.flip(0)
        loss = self.cls_weight * _soft_ce(cls_logits, cls_target)
        if token_logits is None:
            return loss
        token_target = target[:, 2:]
        if token_target.shape[1] == 0:
            token_target = target[:, :1].expand(-1, token_logits.shape[1], -1)
        if token_target.shape[1] != token_logits.shape[1]:
            raise TokenLabelError(
                f"token labels have {token_target.shape[1]} tokens, the model gives "
                f"{token_logits.shape[1]}: set --token-label-size "
                f"{int(token_logits.shape[1] ** 0.5)}"
            )
        return loss + self.dense_weight * _soft_ce(
            token_logits.reshape(-1, classes), token_target.reshape(-1, classes)
        )


def _unpack(output: Any) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    if isinstance(output, torch.Tensor):
        return output, None, (0, 0, 0, 0)
    cls_logits, token_logits, *rest = output
    if cls_logits.shape[-1] != token_logits.shape[-1]:
        raise TokenLabelError(
            f"class output has {cls_logits.shape[-1]} features but token logits have "
            f"{token_logits.shape[-1]} classes: timm's VOLO.forward_train skips the head; "
            "use vitpod.trainer.data.token_label.forward_train(model, images)"
        )
    return cls_logits, token_logits, tuple(rest[0]) if rest else (0, 0, 0, 0)


def _soft_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
