"""SmolVLA's inputs, prepared as LeRobot prepares them (pure functions, torch only).

- Cameras (``SmolVLAPolicy.prepare_images``): float frames in ``[0, 1]``, ``[B, 3, H, W]``, each
  resized to fit ``resize_imgs_with_padding`` (``(width, height)``) keeping its aspect ratio
  (bilinear, no antialiasing) and padded on the left and top with 0 (:func:`resize_with_pad`), then
  mapped to ``[-1, 1]``. The cameras present come first in the features' order; then, for the
  features missing from the batch (``empty_camera_<i>`` among them), up to ``empty_cameras`` empty
  images (-1 everywhere, masked out).
- State: padded with zeros to ``max_state_dim`` (:func:`pad_vector`); actions likewise to
  ``max_action_dim``.
- Prompt (``SmolVLANewLineProcessor`` then ``TokenizerProcessorStep``): the task with a newline
  appended where it has none, tokenized with padding on the right to ``pad_language_to``
  (``"longest"`` or ``"max_length"``) and truncation at ``tokenizer_max_length``.

    >>> import torch
    >>> resize_with_pad(torch.zeros(1, 3, 240, 320), 512, 512, pad_value=0).shape  # 384 x 512, 128 rows on top
    torch.Size([1, 3, 512, 512])
    >>> task_prompt(["pick up the cube", "done\\n"])
    ['pick up the cube\\n', 'done\\n']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def resize_with_pad(img: Tensor, width: int, height: int, pad_value: float = -1.0) -> Tensor:
    """``[B, C, H, W]`` resized to fit ``height`` x ``width`` (both sides scaled by the larger of
    ``W / width``, ``H / height``, truncated to ints; bilinear, ``align_corners=False``), then
    padded with ``pad_value`` on the left and top to exactly that size."""
    if img.ndim != 4:
        raise ValueError(f"resize_with_pad takes [B, C, H, W], got {tuple(img.shape)}")
    cur_height, cur_width = img.shape[2:]
    ratio = max(cur_width / width, cur_height / height)
    new_height, new_width = int(cur_height / ratio), int(cur_width / ratio)
    resized = F.interpolate(img, size=(new_height, new_width), mode="bilinear", align_corners=False)
    pad_height, pad_width = max(0, int(height - new_height)), max(0, int(width - new_width))
    return F.pad(resized, (pad_width, 0, pad_height, 0), value=pad_value)


def frames_to_unit(frames: Tensor) -> Tensor:
    """``uint8`` frames to float in ``[0, 1]`` (float frames pass as they are)."""
    return frames.float() / 255.0 if frames.dtype == torch.uint8 else frames


def prepare_images(batch: Mapping[str, Tensor], image_features: Sequence[str], *,
                   resize: Sequence[int] | None, empty_cameras: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    """``(images, masks)``: one ``[B, 3, h, w]`` in ``[-1, 1]`` and one ``[B]`` bool per camera the
    model reads. ``batch`` maps feature names to frames in ``[0, 1]`` (``[B, 3, H, W]``, or
    ``[B, T, 3, H, W]`` of which the last step is read) and may hold ``<feature>_padding_mask``;
    ``image_features`` are the config's camera features in order; ``resize`` is
    ``resize_imgs_with_padding`` (``(width, height)``, None: as they are)."""
    present = [k for k in image_features if k in batch]
    missing = [k for k in image_features if k not in batch]
    if not present:
        raise ValueError(f"none of the camera features {list(image_features)} is in the batch (it has "
                         f"{sorted(batch)}): at least one is needed")
    images, masks = [], []
    for key in present:
        img = batch[key][:, -1] if batch[key].ndim == 5 else batch[key]
        if resize is not None:
            img = resize_with_pad(img, *resize, pad_value=0)
        img = img * 2.0 - 1.0
        mask = batch.get(f"{key}_padding_mask")
        mask = (torch.ones(img.shape[0], dtype=torch.bool, device=img.device) if mask is None else mask.bool())
        images.append(img)
        masks.append(mask)
    for _ in range(min(len(missing), int(empty_cameras))):  # as images the model attends to none of
        images.append(torch.ones_like(images[-1]) * -1)
        masks.append(torch.zeros_like(masks[-1]))
    return images, masks


def pad_vector(vector: Tensor, new_dim: int) -> Tensor:
    """``vector`` with zeros appended on its last dim up to ``new_dim``."""
    if vector.shape[-1] == new_dim:
        return vector
    out = vector.new_zeros((*vector.shape[:-1], new_dim))
    out[..., : vector.shape[-1]] = vector
    return out


def task_prompt(task: str | Sequence[str]) -> str | list[str]:
    """The task ending with a newline (each of a list's)."""
    if isinstance(task, str):
        return task if task.endswith("\n") else f"{task}\n"
    return [t if t.endswith("\n") else f"{t}\n" for t in task]


def tokenize_prompts(tokenizer, tasks: str | Sequence[str], *, max_length: int,
                     padding: str = "longest") -> tuple[Tensor, Tensor]:
    """``(tokens [B, L], masks [B, L] bool)`` of the tasks' prompts, padded on the right."""
    prompts = task_prompt([tasks] if isinstance(tasks, str) else list(tasks))
    out = tokenizer(prompts, max_length=max_length, truncation=True, padding=padding, padding_side="right",
                    return_tensors="pt")
    return out["input_ids"], out["attention_mask"].to(torch.bool)


__all__ = ["frames_to_unit", "pad_vector", "prepare_images", "resize_with_pad", "task_prompt", "tokenize_prompts"]
