"""π0's preprocessing as pure functions: what transformers' ``PI0Processor`` does to an
observation before the model sees it, testable without a model.

- the checkpoint directory's files (:func:`check_pi0_dir`);
- cameras: the image processor's resize / rescale / normalise / pad, in torch on any device
  (:class:`ImageSettings`, :func:`preprocess_images`);
- the processor's settings: statistics, state padding, prompt length (:class:`Processing`);
- the prompt: the tokenizer as the processor leaves it (:func:`processor_tokenizer`), the text
  (:func:`build_prompt`, π0.5's state bins :func:`state_bins`) and its right-padded tokens
  (:func:`tokenize_prompts`); π0's state zero-padded (:func:`pad_state`).

    >>> import torch
    >>> from ebrl.policies.pi0.preprocessing import ImageSettings, build_prompt, preprocess_images, state_bins
    >>> settings = ImageSettings(size={"height": 4, "width": 4})
    >>> preprocess_images(torch.full((2, 3, 8, 8), 255, dtype=torch.uint8), settings).shape
    torch.Size([2, 3, 4, 4])
    >>> build_prompt("pi05", "", "<bos>", "pick_up the bowl", state_bins(torch.tensor([[-1.0, 0.0, 0.999]]))[0])
    '<bos>Task: pick up the bowl, State: 0 128 255;\\nAction: '
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ebrl.policies.hf_backbone import check_model_dir
from ebrl.policies.normalization import FeatureNorm, NormalizationMode
from ebrl.policies.pi0.lerobot import LeRobotImages

OWNER = "PI0Policy"
PROCESSOR_CONFIG = "processor_config.json"
IMAGE_TOKEN = "<image>"
# PIL's resampling filters (PILImageResampling) -> torch's interpolation modes
RESAMPLE = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}


# ---- the checkpoint directory ----------------------------------------------------------------

def check_pi0_dir(path: str | Path) -> Path:
    """``path`` if it holds a π0 / π0.5 checkpoint EBRL can load (the model's files and the
    processor's ``processor_config.json``), else one :class:`FileNotFoundError` naming the
    directory and every missing file."""
    return check_model_dir(path, owner=OWNER, processor=(
        (PROCESSOR_CONFIG,), f"{PROCESSOR_CONFIG} (the PI0Processor's: statistics, image settings)"))


# ---- images: the image processor's resize / rescale / normalise / pad, in torch -------------

@dataclasses.dataclass(frozen=True)
class ImageSettings:
    """What transformers' ``PI0ImageProcessor`` does to a camera frame, read from
    ``processor_config.json``'s ``image_processor`` (its class defaults where a key is absent)."""

    size: dict[str, int]
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_pad: bool = True
    pad_size: dict[str, int] | None = None
    image_seq_length: int = 256

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ImageSettings:
        from transformers.models.pi0.image_processing_pi0 import PI0ImageProcessor as Defaults

        def get(key: str, default: Any = None) -> Any:
            value = config.get(key)
            return getattr(Defaults, key, default) if value is None else value

        if config.get("do_center_crop"):
            raise ValueError(f"{OWNER}: the image processor center-crops (do_center_crop), which π0's does not; "
                             "EBRL's preprocessing does not either")
        mean, std = get("image_mean"), get("image_std")
        return cls(size=dict(get("size")), resample=int(get("resample", 3)), do_resize=bool(get("do_resize", True)),
                   do_rescale=bool(get("do_rescale", True)), rescale_factor=float(get("rescale_factor", 1 / 255)),
                   do_normalize=bool(get("do_normalize", True)),
                   image_mean=tuple(np.broadcast_to(mean, (3,)).tolist()),
                   image_std=tuple(np.broadcast_to(std, (3,)).tolist()), do_pad=bool(get("do_pad", True)),
                   pad_size=None if get("pad_size") is None else dict(get("pad_size")),
                   image_seq_length=int(get("image_seq_length", 256)))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The size a ``height x width`` frame is resized to (transformers' rules, same float arithmetic)."""
        s = self.size
        if not self.do_resize:
            return height, width
        if s.get("max_height") and s.get("max_width"):  # fit inside, aspect kept (get_image_size_for_max_height_width)
            scale = min(s["max_height"] / height, s["max_width"] / width)
            return int(height * scale), int(width * scale)
        if s.get("height") and s.get("width"):
            return int(s["height"]), int(s["width"])
        raise ValueError(f"{OWNER}: image processor size={s} is not one EBRL resizes to (max_height and max_width, "
                         "or height and width)")

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        h, w = self.resized(height, width)
        if self.do_pad and self.pad_size:
            return int(self.pad_size["height"]), int(self.pad_size["width"])
        return h, w

    def preprocess(self, frames: Tensor) -> Tensor:
        return preprocess_images(frames, self)


def preprocess_images(frames: Tensor, settings: ImageSettings) -> Tensor:
    """``uint8`` frames ``[N, C, H, W]`` (C = 3, or 1 for grey) -> ``float32 [N, 3, H', W']``
    as the image processor gives them: resized (antialiased, PIL's bicubic kernel), quantised to
    ``uint8`` as both of transformers' backends do after resizing, rescaled, normalised, padded
    at the bottom and right with zeros. Runs on the frames' device.

    Against the processor's PIL backend (its definition; its torchvision backend follows PIL on
    ``uint8`` too) a resized pixel differs by at most two ``uint8`` levels, i.e. ``4/255`` after
    normalising with std 0.5, and rarely by one (PIL resamples in fixed point, torch in floats,
    so values near ``k + 0.5`` may round apart: about 0.1% of pixels); where nothing is resized
    the result is exactly the processor's.
    """
    if frames.shape[1] == 1:  # grey: PIL's convert("RGB") repeats the channel
        frames = frames.expand(-1, 3, -1, -1)
    if frames.shape[1] != 3:
        raise ValueError(f"{OWNER}: cameras must have 3 channels (or 1), got frames of shape {tuple(frames.shape)}")
    h, w = frames.shape[-2:]
    new = settings.resized(h, w)
    x = frames.float()
    if new != (h, w):
        if settings.resample not in RESAMPLE:
            raise ValueError(f"{OWNER}: image processor resample={settings.resample} is not one EBRL reproduces "
                             f"(PIL's {sorted(RESAMPLE)}: nearest, bilinear, bicubic)")
        mode = RESAMPLE[settings.resample]
        aa = {"antialias": True, "align_corners": False} if mode != "nearest-exact" else {}
        # PIL (and torchvision on uint8) resample the width, then the height, each pass rounded to
        # uint8: an overshoot of the bicubic kernel is clipped between the passes
        if new[1] != w:
            x = F.interpolate(x, size=(h, new[1]), mode=mode, **aa).round_().clamp_(0.0, 255.0)
        if new[0] != h:
            x = F.interpolate(x, size=new, mode=mode, **aa).round_().clamp_(0.0, 255.0)
    if settings.do_rescale:  # in float64, then float32, as the PIL backend rescales (exactly its pixels)
        x = (x.double() * settings.rescale_factor).float() if x.device.type != "mps" else x * settings.rescale_factor
    if settings.do_normalize:
        mean = torch.tensor(settings.image_mean, device=x.device, dtype=x.dtype)[:, None, None]
        std = torch.tensor(settings.image_std, device=x.device, dtype=x.dtype)[:, None, None]
        x = (x - mean) / std
    out_h, out_w = settings.output_size(h, w)
    if (out_h, out_w) != new:
        if out_h < new[0] or out_w < new[1]:
            raise ValueError(f"{OWNER}: a {h}x{w} camera resizes to {new[0]}x{new[1]}, larger than the image "
                             f"processor's pad_size {out_h}x{out_w}")
        x = F.pad(x, (0, out_w - new[1], 0, out_h - new[0]))
    return x


@dataclasses.dataclass
class Processing:
    """What a checkpoint's processor files say: how a camera frame becomes pixels, the state's
    and the actions' normalisation, the size the state is padded to and the prompt's length.
    :meth:`from_transformers` reads transformers' ``processor_config.json``;
    :meth:`ebrl.policies.pi0.lerobot.LeRobotFolder.processing` LeRobot's processor pipelines."""

    images: ImageSettings | LeRobotImages  # the latter: ebrl.policies.pi0.lerobot's
    state: FeatureNorm | None  # None: the files hold no state statistics (an error only where a state is read)
    actions: FeatureNorm
    max_state_dim: int
    max_length: int
    bins_padded: bool = False  # π0.5's prompt bins the state padded to max_state_dim (LeRobot) or as it is

    @classmethod
    def from_transformers(cls, processor_config: Mapping[str, Any], model_config: Any) -> Processing:
        """``PI0Processor`` / ``PI05Processor``'s settings: ``(x - mean) / (std + 1e-8)``, or π0.5's
        quantiles ``2 (x - q01) / (q99 - q01) - 1`` where it has them."""
        from transformers import PI0Processor, PI05Processor

        kind = model_config.model_type
        norms = {}
        for feature in ("state", "actions"):
            get = processor_config.get
            if kind == "pi05" and get(f"{feature}_q01") is not None and get(f"{feature}_q99") is not None:
                norms[feature] = FeatureNorm(NormalizationMode.QUANTILES, {"q01": get(f"{feature}_q01"),
                                                                           "q99": get(f"{feature}_q99")})
            elif get(f"{feature}_mean") is not None and get(f"{feature}_std") is not None:
                norms[feature] = FeatureNorm(NormalizationMode.MEAN_STD, {"mean": get(f"{feature}_mean"),
                                                                          "std": get(f"{feature}_std")})
            elif feature == "state":  # PI0Policy says so if the observation has a state to normalise
                norms[feature] = None
            else:
                raise ValueError(no_statistics(kind, feature))
        max_state_dim = int(processor_config.get("max_state_dim") or getattr(model_config, "max_state_dim", 32))
        if kind == "pi0" and max_state_dim != int(model_config.max_state_dim):
            raise ValueError(f"{OWNER}: {PROCESSOR_CONFIG} pads the state to {max_state_dim}, the model reads "
                             f"{model_config.max_state_dim}")
        processor_cls = PI0Processor if kind == "pi0" else PI05Processor
        return cls(images=ImageSettings.from_config(processor_config.get("image_processor") or {}),
                   state=norms["state"], actions=norms["actions"], max_state_dim=max_state_dim,
                   max_length=int(processor_cls.text_kwargs.get("max_length", 48 if kind == "pi0" else 200)))


def no_statistics(kind: str, feature: str) -> str:
    stats = f"{feature}_mean and {feature}_std" + (f" (or {feature}_q01 and {feature}_q99)" if kind == "pi05" else "")
    return (f"{OWNER}: {PROCESSOR_CONFIG} has no {stats}: the statistics of the dataset the checkpoint was trained "
            f"on, which the {feature} are normalised with")



def processor_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer as ``PI0Processor.__init__`` leaves it: the image token and PaliGemma's
    location/segmentation tokens added (already there in a saved processor's tokenizer), no BOS
    or EOS added by the tokenizer itself (the prompt has its BOS)."""
    from transformers.tokenization_utils_base import AddedToken

    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(IMAGE_TOKEN, normalized=False,
                                                                           special=True)]})
    tokenizer.add_tokens([f"<loc{i:0>4}>" for i in range(1024)] + [f"<seg{i:0>3}>" for i in range(128)])
    tokenizer.add_bos_token = False
    tokenizer.add_eos_token = False
    return tokenizer


# ---- the prompt: PI0Processor's text, tokenised as its tokenizer call does ------------------

def build_prompt(kind: str, image_prefix: str, bos: str, text: str, bins: Sequence[int] | None) -> str:
    """The processor's ``build_prompts`` for one sample: π0's ``[images] <bos> text\\n``, π0.5's
    ``[images] <bos> Task: ..., State: {bins};\\nAction: `` (no state without ``bins``)."""
    if kind == "pi0":
        return f"{image_prefix}{bos}{text}\n"
    task = text.strip().replace("_", " ").replace("\n", " ")
    state = "" if bins is None else f", State: {' '.join(map(str, bins))}"
    return f"{image_prefix}{bos}Task: {task}{state};\nAction: "


def tokenize_prompts(tokenizer: Any, prompts: Sequence[str], max_length: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)`` as the processor's tokenizer call gives them
    (``padding="max_length"``, right): every row padded to ``max_length`` or, where one is
    longer (never truncated), to the longest."""
    rows = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    width = max([max_length, *(len(r) for r in rows)])
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def pad_state(state: Tensor, max_state_dim: int) -> Tensor:
    """A normalised state ``[B, D]`` zero-padded to ``[B, max_state_dim]``."""
    return F.pad(state, (0, max_state_dim - state.shape[1]))


def state_bins(state: Tensor) -> list[list[int]]:
    """π0.5's prompt state: each entry of ``[B, D]`` in one of the processor's 256 bins of ``[-1, 1]``."""
    edges = torch.linspace(-1, 1, 256 + 1)[:-1]
    return (torch.bucketize(state.detach().cpu(), edges, right=True) - 1).tolist()


__all__ = ["ImageSettings", "Processing", "build_prompt", "check_pi0_dir", "pad_state", "preprocess_images",
           "processor_tokenizer", "state_bins", "tokenize_prompts"]
