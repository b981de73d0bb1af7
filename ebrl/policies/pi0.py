"""Your own π0 / π0.5 checkpoint as an EBRL policy, fine-tuned with PPO or GRPO as πRL does.

:class:`PI0Policy` wraps transformers' native ``PI0ForConditionalGeneration`` or
``PI05ForConditionalGeneration`` (``model_type`` ``pi0`` / ``pi05`` in ``config.json`` picks
it), loaded from a local directory with ``local_files_only=True``: ``config.json``, the
weights, the tokenizer and the processor's ``processor_config.json`` (what
``PI0Processor.save_pretrained`` writes). The policy feeds the model exactly what the processor
would: the prompt ``[<image> x tokens per camera] <bos> text`` (π0: ``text + "\\n"``; π0.5:
``"Task: {task}, State: {256 bins of the state};\\nAction: "``) right-padded to the processor's
``max_length`` (48 / 200), the cameras resized to fit the image processor's ``size``,
rescaled, normalised and padded, in torch on the model's device (transformers' own
``PI0ImageProcessor`` needs torchvision; its PIL backend is the definition the tests compare
with), and π0's state normalised with the checkpoint's statistics and zero-padded to
``max_state_dim``. The model's actions are un-normalised with the checkpoint's action
statistics, cropped to the env's action dims and clipped to its Box.

**Cameras, state, instruction.** The observation's images (``uint8`` Boxes ``HxWx3``, found by
their spaces as :mod:`ebrl.policies.encoders` finds them, or ``image_keys=``, in that order)
are the cameras, any number and any sizes (transformers' π0 has no fixed camera slots: a
sample's prompt has image tokens for the cameras it has); the other Box entries (or
``state_keys=``) are the state. ``instruction=`` is the task: one string, or a list indexed by
the observation's Discrete ``instruction`` entry (``ebrl train`` passes the env's
``instructions()``).

**The chain.** transformers' flow runs from noise at ``t = 1`` to actions at ``t = 0`` with
velocity ``v = noise - actions``: ``x_{k+1} = x_k + dt * v(x_k, t_k)``, ``t_k = 1 - k / N``,
``dt = -1 / N``. πRL (Chen et al. 2025, "πRL: Online RL Fine-tuning for Flow-based
Vision-Language-Action Models") makes every step a Gaussian transition, so that the chain
``[x_0 .. x_N]`` (normalised model space, ``[B, N + 1, chunk_size * max_action_dim]``) is the
stored "action" with a tractable log-prob::

    x_0 ~ N(0, I)
    x_{k+1} = mean_k(x_k) + sigma_k * eps_k       (on the executed block S; elsewhere the ODE mean)
    log p(chain) = log N(x_0[S]; 0, I) + sum_k log N(x_{k+1}[S]; mean_k[S], sigma_k[S]^2)

``S`` is the block the env executes: the first ``execute`` actions of the chunk and the env's
``A`` action dims. The rest of the chunk (later actions, padded dims) follows the ODE: noise
there would only add variance to the ratios (πRL scores the same block). ``method`` picks
``mean_k`` and ``sigma_k``:

- ``"flow-noise"`` (πRL's Flow-Noise, the default): the ODE mean ``x + dt * v``, and a learned
  noise head, a small MLP on the action expert's hidden state per action token, giving
  ``sigma`` per step, token and dim in ``[sigma_min, sigma_max]`` (πRL's ``ExploreNoiseNet``:
  ``log sigma^2`` interpolated by a ``tanh``; defaults πRL's 0.08 and 0.16);
- ``"flow-sde"`` (πRL's Flow-SDE, from Flow-GRPO, Liu et al. 2025): the ODE turned into the SDE
  with the same marginals, ``sigma_t = a * sqrt(t / (1 - t))`` (``a = noise_level``, and at
  ``t = 1`` the next time in the denominator, as RLinf's ``sample_mean_var_val``)::

      mean_k = x - delta * [v + sigma_t^2 / (2 t) * (x + (1 - t) v)],   std_k = sqrt(delta) * sigma_t

  with ``delta = 1 / N`` (``x + (1 - t) v`` is the predicted noise, ``-1/t`` times it the score;
  the correction is per coordinate, so noising the block ``S`` alone keeps the marginals too);
- ``"ode"``: no injected noise (``act`` is then ``sample_actions`` itself; nothing to train).

``act`` returns the chain as ``actions``, its log-prob and the value (``act(obs, noise=x_0)``
starts from given noise, as ``sample_actions(noise=...)``; ``model_inputs(obs)`` is what the
model is fed); ``evaluate(obs, chain)`` recomputes every step's Gaussian with gradients: the VLM
prefix once (its keys and values cached), then ``N`` action-expert passes that read that cache,
each over all the rows.

**Value head** (as RLinf places it): π0's reads the action expert (the mean of its hidden
states over the chunk's tokens; here from one extra expert pass at ``t = 1`` on the zero chunk,
so that the value depends on the observation alone); π0.5's reads the VLM (the mean of the
prefix's last hidden states over its real tokens). A small MLP, zero at the start.
``detach_value_input`` (default: True for π0, False for π0.5, as RLinf's PPO configurations)
keeps the value's gradient out of the model. GRPO ignores the value: ``value_head=False`` then
spares π0 its extra expert pass.

**Training.** With ``lora_rank`` the language model's and the action expert's projections get
LoRA adapters (peft); the action/time projections (``embed_action_time``, with π0's
``state_proj``, and ``action_out_proj``), the noise head and the value head train; every other
weight of the checkpoint stays frozen, and :meth:`trainable_state_dict` is what trains (what
weight publication moves; :func:`~ebrl.policies.base.acting_copy` shares the rest). Without
LoRA everything trains. The model stays in eval mode (no dropout: acting and training compute
one function). ``dtype="bfloat16"`` loads the checkpoint in bfloat16 but keeps the action/time
projections and the heads in float32 and computes log-probs in float32;
``gradient_checkpointing=True`` recomputes the VLM's and the expert's layers in the backward
pass. :meth:`flow_matching_loss` is the model's own flow-matching loss for SFT
(:func:`ebrl.sft.sft`) on demonstration chunks.

Example (a checkpoint directory of your own; nothing is fetched)::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies.pi0 import PI0Policy
    >>> obs_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (224, 224, 3), np.uint8),
    ...                              "wrist": gym.spaces.Box(0, 255, (128, 128, 3), np.uint8),
    ...                              "state": gym.spaces.Box(-np.inf, np.inf, (8,), np.float32)})
    >>> chunk = gym.spaces.Box(-1.0, 1.0, (5, 7))  # execute 5 actions of the chunk per decision
    >>> policy = PI0Policy.from_pretrained(  # doctest: +SKIP
    ...     "/models/pi0-libero", obs_space, chunk, instruction="put the bowl on the plate",
    ...     method="flow-noise", denoise_steps=4, lora_rank=32, dtype="bfloat16")
    >>> out = policy.act({"image": np.zeros((2, 224, 224, 3), np.uint8),  # doctest: +SKIP
    ...                   "wrist": np.zeros((2, 128, 128, 3), np.uint8), "state": np.zeros((2, 8), np.float32)})
    >>> out.actions.shape, out.env_actions.shape  # doctest: +SKIP
    ((2, 5, 1600), (2, 5, 7))
    >>> PI0Policy.from_pretrained("/models/not-there", obs_space, chunk)
    Traceback (most recent call last):
    ...
    FileNotFoundError: PI0Policy: model directory '/models/not-there' does not exist (EBRL loads local ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ebrl.policies.base import ActResult
from ebrl.policies.encoders import ObsEncoder, ObsLayout, as_tensor, lookup
from ebrl.policies.expects import ActionSpec, DType, ObsSpec, PolicySpaces
from ebrl.policies.flow_chain import gauss_logp
from ebrl.policies.heads import LOG_SQRT_2PI
from ebrl.policies.hf_backbone import (
    DEFAULT_LORA_TARGETS,
    INSTRUCTION_KEY,
    FrozenModes,
    NEVER_DOWNLOADS,
    TOKENIZER_FILES,
    WEIGHT_FILES,
    torch_dtype,
    wrap_lora,
)
from ebrl.policies.lerobot_pi0 import LeRobotFolder, LeRobotImages, is_lerobot_policy
from ebrl.policies.mlp import _mlp
from ebrl.policies.normalization import FeatureNorm, NormalizationMode

OWNER = "PI0Policy"
PROCESSOR_CONFIG = "processor_config.json"
METHODS = ("flow-noise", "flow-sde", "ode")
IMAGE_TOKEN = "<image>"
# PIL's resampling filters (PILImageResampling) -> torch's interpolation modes
RESAMPLE = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}


# ---- the checkpoint directory ----------------------------------------------------------------

def check_pi0_dir(path: str | Path) -> Path:
    """``path`` if it holds a π0 / π0.5 checkpoint EBRL can load, else one
    :class:`FileNotFoundError` naming the directory and every missing file."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{OWNER}: model directory {str(path)!r} does not exist ({NEVER_DOWNLOADS})")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        missing.append("weights (one of " + ", ".join(WEIGHT_FILES) + ")")
    if not (path / PROCESSOR_CONFIG).is_file():
        missing.append(f"{PROCESSOR_CONFIG} (the PI0Processor's: statistics, image settings)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (one of " + ", ".join(TOKENIZER_FILES) + ", with tokenizer_config.json)")
    if missing:
        raise FileNotFoundError(f"{OWNER}: model directory {str(path)!r} has no " + "; no ".join(missing)
                                + f" ({NEVER_DOWNLOADS})")
    return path


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
    :meth:`ebrl.policies.lerobot_pi0.LeRobotFolder.processing` LeRobot's processor pipelines."""

    images: ImageSettings | LeRobotImages  # the latter: ebrl.policies.lerobot_pi0's
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
                raise ValueError(_no_statistics(kind, feature))
        max_state_dim = int(processor_config.get("max_state_dim") or getattr(model_config, "max_state_dim", 32))
        if kind == "pi0" and max_state_dim != int(model_config.max_state_dim):
            raise ValueError(f"{OWNER}: {PROCESSOR_CONFIG} pads the state to {max_state_dim}, the model reads "
                             f"{model_config.max_state_dim}")
        processor_cls = PI0Processor if kind == "pi0" else PI05Processor
        return cls(images=ImageSettings.from_config(processor_config.get("image_processor") or {}),
                   state=norms["state"], actions=norms["actions"], max_state_dim=max_state_dim,
                   max_length=int(processor_cls.text_kwargs.get("max_length", 48 if kind == "pi0" else 200)))


def _no_statistics(kind: str, feature: str) -> str:
    stats = f"{feature}_mean and {feature}_std" + (f" (or {feature}_q01 and {feature}_q99)" if kind == "pi05" else "")
    return (f"{OWNER}: {PROCESSOR_CONFIG} has no {stats}: the statistics of the dataset the checkpoint was trained "
            f"on, which the {feature} are normalised with")


# ---- the prefix cache: keys and values of the VLM, read by every expert pass -----------------

class PrefixLayer(DynamicLayer):
    """One layer's prefix keys and values. Written once (by the VLM's pass; a gradient
    checkpoint's recompute writes again, which is ignored), then read without growing: every
    expert pass attends to the prefix and its own tokens and no pass sees another's, so nothing
    needs cropping, and the recompute of a checkpointed layer reads what its forward read."""

    def __init__(self, keys: Tensor | None = None, values: Tensor | None = None):
        super().__init__()
        self.read_only = keys is not None
        if keys is not None:
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if self.read_only:
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class PrefixCache(DynamicCache):
    """The VLM's cache of the prefix (a :class:`PrefixLayer` per layer); :meth:`reader` is the
    view an action-expert pass reads."""

    def __init__(self, layers: list | None = None):
        Cache.__init__(self, layers=layers, layer_class_to_replicate=None if layers else PrefixLayer)

    def reader(self) -> PrefixCache:
        return PrefixCache([PrefixLayer(layer.keys, layer.values) for layer in self.layers])


@dataclasses.dataclass
class Prefix:
    """One pass of the VLM over a batch's prefix."""

    cache: PrefixCache
    mask: Tensor  # [B, L] attention mask (right-padded prompts)
    hidden: Tensor  # [B, L, width] the VLM's last hidden states
    state: Tensor | None  # [B, max_state_dim] π0's normalised, padded state; None for π0.5


# ---- the policy --------------------------------------------------------------------------------

class PI0Policy(FrozenModes):
    """A π0 / π0.5 checkpoint's policy (see the module's docstring). Build it with :meth:`from_pretrained`."""

    deterministic: bool = False  # True: act() gives the mode (the ODE from zero noise)
    # PPO's settings for RL from a pretrained or SFT-tuned π0 (ebrl.runs.build_algo applies them under
    # the run's own [ppo] table); docs/policies.md says where they come from
    RL_DEFAULTS: dict[str, Any] = {"lr": 2e-5, "critic_lr": 3e-4, "critic_warmup_updates": 10, "max_kl": 0.02}

    def __init__(self, model: nn.Module, tokenizer: Any, processing: Processing, *,
                 obs_layout: ObsLayout, action_low, action_high, execute: int,
                 instruction: str | Sequence[str] | None = None, instruction_classes: tuple[int, int] | None = None,
                 method: str = "flow-noise", denoise_steps: int | None = None, noise_level: float = 0.5,
                 sigma_min: float = 0.08, sigma_max: float = 0.16, noise_hidden: Sequence[int] = (128, 64),
                 value_head: bool = True, value_hidden: Sequence[int] = (512, 256, 128),
                 detach_value_input: bool | None = None, lora_rank: int | None = None,
                 lora_alpha: float | None = None, lora_targets: Sequence[str] | None = None,
                 gradient_checkpointing: bool = False, dtype: str = "float32", seed: int = 0,
                 base_path: str | None = None):
        super().__init__()
        cfg = model.config
        self.kind = cfg.model_type
        if self.kind not in ("pi0", "pi05"):
            raise ValueError(f"{OWNER}: {type(model).__name__} (model_type {self.kind!r}) is not a π0 or π0.5")
        if method not in METHODS:
            raise ValueError(f"{OWNER}: method={method!r} must be one of {list(METHODS)}")
        n = int(denoise_steps if denoise_steps is not None else cfg.num_inference_steps)
        if n < 1:
            raise ValueError(f"{OWNER}: denoise_steps={denoise_steps!r} must be an int >= 1")
        if method == "flow-sde" and not noise_level > 0:
            raise ValueError(f"{OWNER}: flow-sde needs noise_level > 0 (method='ode' injects no noise), "
                             f"got {noise_level!r}")
        if method == "flow-noise" and not 0 < sigma_min < sigma_max:
            raise ValueError(f"{OWNER}: flow-noise needs 0 < sigma_min < sigma_max, got {sigma_min!r}, {sigma_max!r}")

        low, high = np.asarray(action_low, np.float32), np.asarray(action_high, np.float32)
        self.action_shape = tuple(low.shape)
        self.chunk_size, self.max_action_dim = int(cfg.chunk_size), int(cfg.max_action_dim)
        self.action_dim = int(self.action_shape[-1])
        self.execute = int(execute)
        self.demo_chunk_len = self.chunk_size  # SFT learns whole chunks (ebrl.sft.demo_shape), RL executes `execute`
        if not 1 <= self.execute <= self.chunk_size:
            raise ValueError(f"{OWNER}: execute={execute} actions per decision, but the model's chunks are "
                             f"{self.chunk_size} long")
        if self.action_dim > self.max_action_dim:
            raise ValueError(f"{OWNER}: the env's actions have {self.action_dim} dims, the model's at most "
                             f"{self.max_action_dim}")
        self.action_low, self.action_high = low, high
        self.method, self.denoise_steps = method, n
        self.noise_level, self.sigma_min, self.sigma_max = float(noise_level), float(sigma_min), float(sigma_max)
        self.seed = int(seed)
        self._layout = obs_layout
        self.instruction_classes = None if instruction_classes is None else tuple(int(v) for v in instruction_classes)
        self.config: dict[str, Any] = {
            "base_path": base_path, "kind": self.kind, "obs_layout": obs_layout.to_config(),
            "action_low": low.tolist(), "action_high": high.tolist(), "execute": self.execute,
            "instruction": instruction if isinstance(instruction, str) or instruction is None else list(instruction),
            "instruction_classes": None if instruction_classes is None else list(instruction_classes),
            "method": method, "denoise_steps": n, "noise_level": self.noise_level, "sigma_min": self.sigma_min,
            "sigma_max": self.sigma_max, "noise_hidden": list(noise_hidden), "value_head": bool(value_head),
            "value_hidden": list(value_hidden), "lora": None, "gradient_checkpointing": bool(gradient_checkpointing),
            "dtype": str(dtype), "seed": self.seed}

        # ---- the processor's settings: statistics, prompt, images
        self.images = processing.images
        vision = cfg.vlm_config.vision_config
        tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2
        if self.images.image_seq_length != tokens:
            raise ValueError(f"{OWNER}: the image processor's image_seq_length is {self.images.image_seq_length}, but "
                             f"the vision tower gives {tokens} tokens per image")
        for e in obs_layout.images:
            _, h, w = e.chw
            out = self.images.output_size(h, w)
            if out != (int(vision.image_size), int(vision.image_size)):
                raise ValueError(f"{OWNER}: camera {e.key!r} ({h}x{w}) becomes {out[0]}x{out[1]} through the image "
                                 f"processor, but the vision tower reads {vision.image_size}x{vision.image_size}")
        state = dataclasses.replace(obs_layout, images=())
        self.state_reader = ObsEncoder(state, normalize=False, owner=OWNER)  # no parameters, no buffers
        self.state_dim = state.flat_dim
        self.max_state_dim, self.bins_padded = int(processing.max_state_dim), bool(processing.bins_padded)
        if self.state_dim > self.max_state_dim:
            raise ValueError(f"{OWNER}: the observation's state has {self.state_dim} elements "
                             f"({[e.key for e in state.entries]}), the model at most {self.max_state_dim}: "
                             "choose the entries with state_keys")
        self._set_norms(processing.state, processing.actions)

        # ---- the tokenizer as the processor leaves it, and the prompts
        self.tokenizer = _processor_tokenizer(tokenizer)
        image_id = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if image_id != cfg.vlm_config.image_token_id:
            raise ValueError(f"{OWNER}: the tokenizer's {IMAGE_TOKEN} is id {image_id}, the model's image_token_id "
                             f"{cfg.vlm_config.image_token_id}")
        self.max_length = int(processing.max_length)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.image_prefix = IMAGE_TOKEN * self.images.image_seq_length * len(obs_layout.images)
        self.texts = [""] if instruction is None else [instruction] if isinstance(instruction, str) else [
            str(s) for s in instruction]
        if self.kind == "pi0":  # the prompt does not change with the state: tokenised once per instruction
            ids, mask = self._tokenize([self._prompt(t, None) for t in self.texts])
            self.register_buffer("prompt_ids", ids, persistent=False)
            self.register_buffer("prompt_mask", mask, persistent=False)
        self.register_buffer("score_mask", torch.zeros(self.chunk_size, self.max_action_dim, dtype=torch.bool),
                             persistent=False)
        self.score_mask[:self.execute, :self.action_dim] = True  # S: what the env executes

        # ---- the model: dtype, LoRA, checkpointing
        projections = (model.embed_action_time, model.action_out_proj)
        for module in projections:  # they train: float32 whatever the checkpoint's dtype
            module.float()
        if lora_rank is not None:
            targets = tuple(lora_targets) if lora_targets is not None else DEFAULT_LORA_TARGETS
            names = _lora_modules(model, targets)
            alpha = float(lora_alpha if lora_alpha is not None else min(lora_rank, 16))
            self.config["lora"] = {"rank": int(lora_rank), "alpha": alpha, "targets": list(targets)}
            model = wrap_lora(model, int(lora_rank), alpha, names, self.seed)
            for module in projections:
                module.requires_grad_(True)
        self.backbone = model
        self.gradient_checkpointing = bool(gradient_checkpointing)
        if self.gradient_checkpointing:
            hf = self.hf_model
            kw = {"use_reentrant": False}
            if hasattr(hf, "activation_checkpointing_enable"):
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
            # the layers only write the prefix cache once and read it after: safe to recompute with it
            for layer in (*hf.model.vlm.language_model.layers, *hf.model.dit.layers):
                layer._can_checkpoint_with_cache = True

        # ---- what EBRL adds: the noise head (Flow-Noise) and the value head, float32
        gen = torch.Generator().manual_seed(self.seed)
        width = int(cfg.dit_config.hidden_size)
        if method == "flow-noise":  # small last layer: sigma starts near sqrt(sigma_min * sigma_max)
            self.noise_head = _mlp(width, noise_hidden, self.max_action_dim, nn.Tanh, 0.01, gen)
        self.has_value_head = bool(value_head)
        self.detach_value_input = bool(self.kind == "pi0" if detach_value_input is None else detach_value_input)
        self.config["detach_value_input"] = self.detach_value_input
        if self.has_value_head:  # π0: on the action expert; π0.5: on the VLM (RLinf's value_after_vlm)
            value_in = width if self.kind == "pi0" else int(cfg.vlm_config.text_config.hidden_size)
            self.value_head = _mlp(value_in, value_hidden, 1, nn.ReLU, 0.0, gen)  # values start at 0
        self._start_sampling()
        self.train(True)

    # ---- building ------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, observation_space, action_space, *,
                        instruction: str | Sequence[str] | None = None, instructions: Sequence[str] | None = None,
                        execute: int | None = None, dtype: str | torch.dtype = "float32",
                        image_keys: Sequence[str] | None = None, state_keys: Sequence[str] | None = None,
                        feature_map: Mapping[str, str] | None = None, tokenizer: str | Path | None = None,
                        **options: Any) -> PI0Policy:
        """Load the π0 / π0.5 checkpoint in the local directory ``path`` for these gymnasium spaces:
        transformers' layout (``config.json`` with ``model_type``, ``processor_config.json``, the
        tokenizer) or a LeRobot policy folder (``config.json`` with ``type``, the processor
        pipelines; :mod:`ebrl.policies.lerobot_pi0`).

        ``observation_space``: cameras (``uint8`` Boxes, ``image_keys`` chooses and orders
        them), state (the other Box entries, or ``state_keys``) and, with a list of
        instructions, the Discrete ``instruction`` entry that picks one per row. A LeRobot
        folder's features name the entries (``observation.images.front`` reads ``front``,
        ``observation.state`` reads ``state``); ``feature_map`` (``{feature: env key}``) says
        otherwise. ``tokenizer``: a local tokenizer directory (a LeRobot folder has none; the
        checkpoint's own otherwise).
        ``action_space``: a Box ``(A,)`` (one action per decision; ``execute=K`` makes it
        ``(K, A)``, which ``ebrl.run`` executes with :class:`~ebrl.envs.chunks.ActionChunk`) or
        ``(K, A)`` with ``K <= chunk_size``: the first ``K`` actions of each chunk are executed
        (πRL's replanning). ``instruction``: the task, or a list of tasks (``instructions`` is
        the same list). ``options``: ``method`` (``"flow-noise"``, ``"flow-sde"``, ``"ode"``),
        ``denoise_steps`` (default the checkpoint's ``num_inference_steps``), ``noise_level``
        (flow-sde, 0.5), ``sigma_min``/``sigma_max`` (flow-noise, 0.08/0.16), ``noise_hidden``,
        ``value_head``, ``value_hidden``, ``detach_value_input``, ``lora_rank``/``lora_alpha``/
        ``lora_targets``, ``gradient_checkpointing``, ``seed``. Local files only: a missing
        file is one :class:`FileNotFoundError` naming it.
        """
        from gymnasium import spaces

        lerobot = is_lerobot_policy(path)
        # first: a wrong path is named before transformers is imported
        folder = LeRobotFolder.read(path) if lerobot else None
        path = folder.path if lerobot else check_pi0_dir(path)
        if feature_map is not None and not lerobot:
            raise ValueError(f"{OWNER}: feature_map renames a LeRobot policy folder's features; {str(path)!r} is in "
                             "transformers' layout: choose the entries with image_keys and state_keys")
        if instructions is not None:
            if instruction is not None:
                raise ValueError(f"{OWNER}: give instruction= or instructions=, not both")
            instruction = list(instructions)
        if not (isinstance(action_space, spaces.Box) and len(action_space.shape) in (1, 2)):
            raise ValueError(f"{OWNER} needs a Box action space of shape (A,) or (K, A), got {action_space!r}")
        low, high = np.asarray(action_space.low, np.float32), np.asarray(action_space.high, np.float32)
        if low.ndim == 2:
            if execute is not None and execute != low.shape[0]:
                raise ValueError(f"{OWNER}: the action space executes chunks of {low.shape[0]} actions, not "
                                 f"execute={execute}")
            execute = low.shape[0]
        elif execute is not None and execute != 1:  # chunks of `execute` actions of this Box (ActionChunk)
            low, high = np.broadcast_to(low, (execute, *low.shape)).copy(), np.broadcast_to(high, (execute,
                                                                                                 *high.shape)).copy()
        if folder is not None:
            image_keys, state_keys = folder.env_keys(observation_space, low.shape[-1], feature_map=feature_map,
                                                     image_keys=image_keys, state_keys=state_keys)
        layout, classes = _read_spaces(observation_space, instruction, image_keys, state_keys)

        from transformers import AutoConfig, AutoTokenizer, PI0ForConditionalGeneration, PI05ForConditionalGeneration

        torch_type = torch_dtype(dtype, OWNER)
        if folder is not None:
            tok = _processor_tokenizer(folder.tokenizer(tokenizer))
            model = folder.load(torch_type, tok.convert_tokens_to_ids(IMAGE_TOKEN))
            processing = Processing(**folder.processing(model.config))
        else:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
            model_cls = {"pi0": PI0ForConditionalGeneration, "pi05": PI05ForConditionalGeneration}.get(
                config.model_type)
            if model_cls is None:
                raise ValueError(f"{OWNER}: {str(path)!r} holds a {config.model_type!r} model, not a π0 (pi0) or "
                                 "π0.5 (pi05)")
            model = model_cls.from_pretrained(str(path), local_files_only=True, dtype=torch_type)
            tok = AutoTokenizer.from_pretrained(str(tokenizer or path), local_files_only=True)
            processor_config = json.loads((path / PROCESSOR_CONFIG).read_text())
            if "image_processor" not in processor_config and (path / "preprocessor_config.json").is_file():
                # an older layout: the image processor's settings in a file of their own
                processor_config["image_processor"] = json.loads((path / "preprocessor_config.json").read_text())
            processing = Processing.from_transformers(processor_config, model.config)
        return cls(model, tok, processing, obs_layout=layout, action_low=low, action_high=high,
                   execute=int(execute or 1), instruction=instruction, instruction_classes=classes,
                   dtype=str(dtype).removeprefix("torch."), base_path=str(path.resolve()), **options)

    @classmethod
    def from_spaces(cls, observation_space, action_space, *, path: str | Path, **options: Any) -> PI0Policy:
        """:meth:`from_pretrained` with the spaces first, as the other policies' ``from_spaces``."""
        return cls.from_pretrained(path, observation_space, action_space, **options)

    def _set_norms(self, state: FeatureNorm | None, actions: FeatureNorm) -> None:
        """The checkpoint's state and action normalisation (submodules: they move with the policy)."""
        if state is None:  # no statistics: nothing to normalise, unless the observation has a state
            if self.state_dim:
                raise ValueError(_no_statistics(self.kind, "state"))
            state = FeatureNorm(NormalizationMode.IDENTITY)
        if self.state_dim and state.size is not None and state.size != self.state_dim:
            raise ValueError(f"{OWNER}: the checkpoint's state statistics have {state.size} entries, the "
                             f"observation's state {self.state_dim} "
                             f"({[e.key for e in self.state_reader.layout.entries]}): choose the entries with "
                             "state_keys")
        if actions.size is not None and actions.size < self.action_dim:
            raise ValueError(f"{OWNER}: the checkpoint's action statistics have {actions.size} entries, "
                             f"fewer than the env's {self.action_dim} action dims")
        self.state_norm, self.action_norm = state, actions

    # ---- what it is -----------------------------------------------------------------------------

    @property
    def obs_layout(self) -> ObsLayout:
        return self._layout

    @property
    def chain_dim(self) -> int:
        return self.chunk_size * self.max_action_dim

    def expected_spaces(self) -> PolicySpaces:
        """The cameras and state entries read, the Discrete ``instruction`` entry of a list of
        instructions, and Box actions of ``action_shape``."""
        obs = self._layout.expected()
        if self.instruction_classes is not None:
            obs += (ObsSpec(keys=(INSTRUCTION_KEY,), size=self.instruction_classes[0], dtype=DType.CATEGORICAL),)
        return PolicySpaces(obs, ActionSpec(shape=self.action_shape))

    def describe_inputs(self) -> list[dict[str, Any]]:
        """The observation entries read, and how."""
        vision = self.hf_model.config.vlm_config.vision_config.image_size
        out = []
        for e in self._layout.images:
            d = e.describe()
            d["features"] = (f"{type(self.hf_model).__name__} vision tower ({vision}x{vision} after the image "
                             f"processor, {self.images.image_seq_length} tokens)")
            out.append(d)
        for d in self.state_reader.describe():
            if d.get("as") == "ignored" and d["key"] == INSTRUCTION_KEY and self.instruction_classes is not None:
                continue  # read as the instruction index, below
            if d.get("as") != "ignored":
                d["normalised"] = "with the checkpoint's statistics" + (", in the prompt as 256 bins"
                                                                        if self.kind == "pi05" else "")
            out.append(d)
        if self.instruction_classes is not None:
            out.append({"key": INSTRUCTION_KEY, "as": "instruction index", "classes": [self.instruction_classes[0]]})
        return out

    @property
    def _device(self) -> torch.device:
        return self.score_mask.device

    # ---- the prompt -----------------------------------------------------------------------------

    def _prompt(self, text: str, bins: list[int] | None) -> str:
        """The processor's ``build_prompts`` for one sample."""
        bos = self.tokenizer.bos_token or ""
        if self.kind == "pi0":
            return f"{self.image_prefix}{bos}{text}\n"
        task = text.strip().replace("_", " ").replace("\n", " ")
        state = "" if bins is None else f", State: {' '.join(map(str, bins))}"
        return f"{self.image_prefix}{bos}Task: {task}{state};\nAction: "

    def _tokenize(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """``(input_ids, attention_mask)`` as the processor's tokenizer call gives them
        (``padding="max_length"``, right): every row padded to ``max_length`` or, where one is
        longer (never truncated), to the longest."""
        rows = self.tokenizer(prompts, add_special_tokens=True)["input_ids"]
        width = max([self.max_length, *(len(r) for r in rows)])
        ids = torch.full((len(rows), width), int(self.pad_id), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
        return ids, mask

    def _instruction_index(self, obs: Any, rows: int) -> Tensor:
        device = self._device
        if self.instruction_classes is None:
            return torch.zeros(rows, dtype=torch.long, device=device)
        index = as_tensor(lookup(obs, (INSTRUCTION_KEY,)), device).reshape(-1).long() - self.instruction_classes[1]
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(self.texts)):
            raise ValueError(f"observation entry 'instruction' must index the {len(self.texts)} instructions, got "
                             f"values in [{int(index.min())}, {int(index.max())}]")
        return index

    def _rows(self, obs: Any) -> int:
        """The batch size of ``obs``, from its first entry read (or the instruction index)."""
        entry = self._layout.entries[0] if self._layout.entries else None
        value = lookup(obs, entry.path if entry is not None else (INSTRUCTION_KEY,))
        return int(np.prod(np.shape(value))) // max(1, math.prod(entry.shape) if entry is not None else 1)

    # ---- the prefix -----------------------------------------------------------------------------

    def normalized_state(self, obs: Any) -> Tensor | None:
        """The state as the processor normalises it, ``[B, state_dim]`` float32 (None without one)."""
        if not self.state_dim:
            return None
        return self.state_norm.normalize(self.state_reader.vector(obs, self.score_mask.float()))

    def model_inputs(self, obs: Any) -> dict[str, Tensor]:
        """What the processor would give the model for ``obs``: ``input_ids``, ``attention_mask``,
        ``pixel_values [B, cameras, 3, H, W]``, ``pixel_attention_mask`` and π0's ``state``
        ``[B, max_state_dim]`` (π0.5's is in the prompt), on the policy's device."""
        device = self._device
        state = self.normalized_state(obs)
        rows = state.shape[0] if state is not None else self._rows(obs)
        index = self._instruction_index(obs, rows)
        if self.kind == "pi0":
            ids, mask = self.prompt_ids[index], self.prompt_mask[index]
            if state is None:
                state = torch.zeros(rows, 0, device=device)
            out = {"state": F.pad(state, (0, self.max_state_dim - state.shape[1]))}
        else:
            bins = None
            if state is not None:  # the processor's 256 bins of [-1, 1]
                edges = torch.linspace(-1, 1, 256 + 1)[:-1]
                binned = F.pad(state, (0, self.max_state_dim - state.shape[1])) if self.bins_padded else state
                bins = (torch.bucketize(binned.detach().cpu(), edges, right=True) - 1).tolist()
            prompts = [self._prompt(self.texts[int(i)], None if bins is None else bins[r])
                       for r, i in enumerate(index.tolist())]
            ids, mask = (t.to(device) for t in self._tokenize(prompts))
            out = {}
        pixels = []
        for e in self._layout.images:
            x = as_tensor(lookup(obs, e.path), device).reshape(-1, *e.shape)
            pixels.append(self.images.preprocess(x if e.channels_first else x.permute(0, 3, 1, 2)))
        if pixels:
            pixel_values = torch.stack(pixels, 1)
        else:  # no camera: one masked slot, which gives no image token
            size = int(self.hf_model.config.vlm_config.vision_config.image_size)
            pixel_values = torch.zeros(rows, 1, 3, size, size, device=device)
        pam = torch.full(pixel_values.shape[:2], bool(pixels), dtype=torch.bool, device=device)
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixel_values, "pixel_attention_mask": pam,
                **out}

    @contextlib.contextmanager
    def _checkpointing(self) -> Iterator[None]:
        """transformers checkpoints a layer only in training mode; the model stays in eval mode
        (no dropout), so the layers themselves (not their children) are flagged for the pass."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        # the layers only: a model flagged so too would turn its use_cache off, and warn
        layers = ([m for m in self.backbone.modules() if isinstance(m, GradientCheckpointingLayer)
                   and m.gradient_checkpointing is True] if self.gradient_checkpointing and torch.is_grad_enabled()
                  else [])
        was = [m.training for m in layers]
        for m in layers:
            m.training = True
        try:
            yield
        finally:
            for m, mode in zip(layers, was):
                m.training = mode

    def _prefix(self, obs: Any) -> Prefix:
        """The VLM's one pass over the prefix (as ``sample_actions`` runs it), its cache kept."""
        inputs = self.model_inputs(obs)
        hf = self.hf_model
        mask = inputs["attention_mask"]
        vision_dtype = next(hf.model.vlm.vision_tower.parameters()).dtype
        # our cache, filled by the layers (use_cache=False only keeps a checkpointed layer from warning)
        cache = PrefixCache()
        with self._checkpointing():
            embeds = hf.model.embed_prefix(inputs["input_ids"], inputs["pixel_values"].to(vision_dtype),
                                           inputs["pixel_attention_mask"])
            out = hf.model.vlm(inputs_embeds=embeds, attention_mask=mask, position_ids=mask.cumsum(-1) - 1,
                               token_type_ids=torch.zeros_like(mask), use_cache=False, cache=cache)
        return Prefix(cache, mask, out.last_hidden_state, inputs.get("state"))

    # ---- the action expert and the chain --------------------------------------------------------

    def _expert(self, prefix: Prefix, x: Tensor, time: Tensor) -> tuple[Tensor, Tensor]:
        """One action-expert pass (``PI0/PI05ForConditionalGeneration.forward`` on a cached prefix):
        noisy chunks ``x [B, chunk, max_action_dim]`` at times ``time [B]`` -> the velocity and the
        expert's last hidden states over the chunk's tokens, both float32."""
        hf = self.hf_model
        embed = hf.embed_action_time
        expert_dtype = hf.model.dit.layers[0].self_attn.q_proj.weight.dtype
        extra = {}
        if self.kind == "pi0":
            suffix = embed(prefix.state.float(), x.float(), time)
        else:
            suffix, time_embeds = embed(x.float(), time)
            extra["timestep_embeds"] = time_embeds.to(expert_dtype)
        with self._checkpointing():
            out = hf.model(action_embeds=suffix.to(expert_dtype), attention_mask=prefix.mask,
                           cache=prefix.cache.reader(), use_cache=False, **extra)
        hidden = out.last_hidden_state[:, -self.chunk_size:].float()
        return hf.action_out_proj(hidden).float(), hidden

    def _times(self, k: int, rows: int) -> tuple[float, Tensor]:
        t = 1.0 + k * (-1.0 / self.denoise_steps)  # sample_actions' arithmetic
        return t, torch.full((rows,), t, dtype=torch.float32, device=self._device)

    def _step(self, prefix: Prefix, x: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
        """Step ``k``'s Gaussian from ``x = x_k [B, chunk, max_action_dim]``: the mean (every entry)
        and ``sigma`` on the executed block ``[B, execute, A]`` (None for the ODE)."""
        t, time = self._times(k, x.shape[0])
        v, hidden = self._expert(prefix, x, time)
        dt = -1.0 / self.denoise_steps
        mean = x + dt * v  # the ODE's Euler step, as sample_actions takes it
        ke, a = self.execute, self.action_dim
        if self.method == "ode":
            return mean, None
        if self.method == "flow-noise":
            unit = torch.tanh(self.noise_head(hidden[:, :ke]))[..., :a]  # πRL's ExploreNoiseNet
            lo, hi = 2 * math.log(self.sigma_min), 2 * math.log(self.sigma_max)
            return mean, torch.exp(0.5 * (lo + (hi - lo) * (unit + 1) / 2))
        # flow-sde: sigma_t = a sqrt(t / (1 - t)), at t = 1 with the next time in the denominator
        # (RLinf's sample_mean_var_val); std = sqrt(delta) sigma_t
        delta = 1.0 / self.denoise_steps
        sigma_t = self.noise_level * math.sqrt(t / (1.0 - (1.0 + dt if k == 0 else t)))
        block = (slice(None), slice(0, ke), slice(0, a))
        predicted_noise = x[block] + (1.0 - t) * v[block]
        mean = mean.clone()
        mean[block] = mean[block] - (sigma_t ** 2 * delta / (2.0 * t)) * predicted_noise
        return mean, torch.full_like(predicted_noise, math.sqrt(delta) * sigma_t)

    def step_params(self, obs: Any, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``(mean_k [B, chunk * max_action_dim], sigma_k [B, execute * A])`` of the transition
        from ``x = x_k [B, chunk * max_action_dim]`` at step ``k``, with gradients: the density
        the chain's log-prob is made of (``sigma`` covers the executed block only)."""
        prefix = self._prefix(obs)
        x = torch.as_tensor(x, device=self._device).float().reshape(-1, self.chunk_size, self.max_action_dim)
        mean, sigma = self._step(prefix, x, k)
        if sigma is None:
            sigma = mean.new_zeros(mean.shape[0], self.execute, self.action_dim)
        return mean.reshape(mean.shape[0], -1), sigma.reshape(sigma.shape[0], -1)

    def _values(self, prefix: Prefix) -> Tensor:
        """The value head ``[B]`` (zeros without one), float32."""
        rows = prefix.mask.shape[0]
        if not self.has_value_head:
            return torch.zeros(rows, device=self._device)
        with torch.no_grad() if self.detach_value_input else contextlib.nullcontext():
            if self.kind == "pi0":  # the action expert's tokens at t = 1 on the zero chunk
                x = torch.zeros(rows, self.chunk_size, self.max_action_dim, device=self._device)
                features = self._expert(prefix, x, self._times(0, rows)[1])[1].mean(1)
            else:  # the VLM's prefix, its real tokens
                m = prefix.mask[..., None].float()
                features = (prefix.hidden.float() * m).sum(1) / m.sum(1).clamp(min=1)
        return self.value_head(features).squeeze(-1)

    # ---- acting (runtime) -------------------------------------------------------------------------

    def _block(self, x: Tensor) -> Tensor:
        """The executed block ``[B, execute * A]`` of chunks ``[B, chunk, max_action_dim]``."""
        return x[:, :self.execute, :self.action_dim].reshape(x.shape[0], -1)

    def to_env(self, x: np.ndarray) -> np.ndarray:
        """Final chunks ``[B, chunk * max_action_dim]`` (normalised) -> env actions ``[B, *action_shape]``:
        the first ``execute`` actions un-normalised with the checkpoint's statistics, cropped to
        the env's dims, clipped to the Box."""
        x = torch.as_tensor(np.asarray(x, np.float32)).reshape(-1, self.chunk_size, self.max_action_dim)
        actions = self.action_norm.unnormalize(x[:, :self.execute].to(self._device))[..., :self.action_dim]
        actions = actions.cpu().numpy().reshape(-1, *self.action_shape)
        return np.clip(actions, self.action_low, self.action_high).astype(np.float32)

    @torch.no_grad()
    def act(self, obs: Any, noise: Tensor | np.ndarray | None = None) -> ActResult:
        """Sample chains for ``obs [B, ...]`` (numpy, or a dict of numpy arrays); numpy out.

        ``actions`` is the chain ``[B, N + 1, chunk * max_action_dim]`` (float32, normalised
        model space) the log-prob refers to; ``env_actions`` its last state's executed actions,
        ``[B, *action_shape]`` inside the Box. ``noise`` (``[B, chunk, max_action_dim]``) is
        ``x_0``, ``sample_actions``' ``noise`` (drawn from the policy's stream when None).
        """
        prefix = self._prefix(obs)
        rows, device = prefix.mask.shape[0], self._device
        shape = (rows, self.chunk_size, self.max_action_dim)
        gen = self._generator(device)
        if noise is not None:
            x = torch.as_tensor(noise, device=device).float().reshape(shape)
        else:
            x = torch.randn(shape, generator=gen, device=device)
            if self.deterministic:  # the mode: from zero noise, no noise on the way
                x = torch.zeros_like(x)
        logp = (-0.5 * self._block(x).square() - LOG_SQRT_2PI).sum(-1)
        chain = [x]
        for k in range(self.denoise_steps):
            mean, sigma = self._step(prefix, x, k)
            x = mean
            if sigma is not None:
                eps = torch.randn(sigma.shape, generator=gen, device=device)
                if not self.deterministic:
                    x = mean.clone()
                    x[:, :self.execute, :self.action_dim] += sigma * eps
                # as evaluate() computes it, not from eps
                logp = logp + gauss_logp(self._block(x), self._block(mean), sigma.reshape(rows, -1))
            chain.append(x)
        actions = torch.stack(chain, 1).reshape(rows, self.denoise_steps + 1, -1).cpu().numpy()
        return ActResult(actions=actions, env_actions=self.to_env(actions[:, -1]), logprobs=logp.cpu().numpy(),
                         values=self._values(prefix).float().cpu().numpy())

    # ---- training (algorithm) ---------------------------------------------------------------------

    def value(self, obs: Any) -> Tensor:
        """State values ``[N]``, with gradients (unless ``detach_value_input``)."""
        if not self.has_value_head:
            return torch.zeros(self._rows(obs), device=self._device)
        return self._values(self._prefix(obs))

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [M], entropy [M], value [M])`` of stored chains ``actions [M, N + 1, chunk * max_action_dim]``.

        The VLM's prefix once, then ``N`` action-expert passes over all ``M`` rows, reading its
        cache. The entropy is the chain's: ``N(0, I)``'s on the executed block (a constant) plus
        every step's Gaussian's there, given the stored states (constant for flow-sde and the ODE).
        """
        prefix = self._prefix(obs)
        m, n = prefix.mask.shape[0], self.denoise_steps
        chain = torch.as_tensor(actions, device=self._device).float().reshape(m, n + 1, self.chunk_size,
                                                                               self.max_action_dim)
        size = self.execute * self.action_dim
        logp = (-0.5 * self._block(chain[:, 0]).square() - LOG_SQRT_2PI).sum(-1)
        entropy = torch.full((m,), size * (0.5 + LOG_SQRT_2PI), device=self._device)
        for k in range(n):
            mean, sigma = self._step(prefix, chain[:, k], k)
            if sigma is None:
                continue
            sigma = sigma.reshape(m, -1)
            logp = logp + gauss_logp(self._block(chain[:, k + 1]), self._block(mean), sigma)
            entropy = entropy + (0.5 + LOG_SQRT_2PI + sigma.log()).sum(-1)
        return logp, entropy, self._values(prefix)

    def flow_matching_loss(self, obs: Any, chunks: Any, generator: torch.Generator | None = None) -> Tensor:
        """The model's own flow-matching loss on demonstration chunks ``[B, K, A]`` (or actions
        ``[B, A]``, K = 1) in env space: the chunks normalised with the checkpoint's statistics
        and zero-padded as the processor does (and, when ``K < chunk_size``, lengthened by
        repeating the last action, as :mod:`ebrl.sft` repeats an episode's last action), time
        ``t`` from the model's Beta distribution, ``x_t = t noise + (1 - t) actions`` and the
        squared error of the predicted velocity against ``noise - actions``, as the model's
        ``forward(actions=...)`` computes it, averaged over the demonstrated entries (the first
        ``K`` actions, the env's ``A`` dims). Trains the model (its adapters under LoRA) and the
        action/time projections; not the noise or value heads.
        """
        prefix = self._prefix(obs)
        device, rows = self._device, prefix.mask.shape[0]
        a = as_tensor(chunks, device).float()
        a = a.reshape(rows, -1, a.shape[-1])
        k, dims = a.shape[1], a.shape[2]
        if k > self.chunk_size or dims != self.action_dim:
            raise ValueError(f"{OWNER}.flow_matching_loss: chunks of {k} actions of {dims} dims, but the model's "
                             f"chunks are {self.chunk_size} long and the env's actions {self.action_dim} dims")
        target = torch.zeros(rows, self.chunk_size, self.max_action_dim, device=device)
        normalised = self.action_norm.normalize(a)
        target[:, :k, :dims] = normalised
        target[:, k:, :dims] = normalised[:, -1:]
        gen = generator if generator is not None else self._generator(device)
        noise = torch.randn(target.shape, generator=gen, device=gen.device).to(device)  # sft's generator: CPU
        time = self._sample_time(rows, gen)
        mixed = time[:, None, None] * noise + (1 - time[:, None, None]) * target
        v, _ = self._expert(prefix, mixed, time)
        return (v - (noise - target))[:, :k, :dims].square().mean()

    def _sample_time(self, rows: int, gen: torch.Generator) -> Tensor:
        """The model's training times, ``Beta(alpha, beta) * scale + offset``, drawn from ``gen``."""
        cfg = self.hf_model.config
        alpha, beta = float(cfg.time_sampling_beta_alpha), float(cfg.time_sampling_beta_beta)
        u = torch.rand(rows, generator=gen, device=gen.device).to(self._device)
        if beta == 1.0:  # Beta(alpha, 1): u ** (1 / alpha), by the inverse CDF
            draw = u.pow(1.0 / alpha)
        elif alpha == 1.0:
            draw = 1.0 - u.pow(1.0 / beta)
        else:  # no generator-driven Beta in torch: seed its global stream from the generator
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(u[0].item() * 2**31))
                draw = torch.distributions.Beta(alpha, beta).sample((rows,)).to(self._device)
        return (draw * float(cfg.time_sampling_scale) + float(cfg.time_sampling_offset)).float()

    # ---- weights ----------------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """What training changes, named as in ``state_dict()``: the trainable parameters (under
        LoRA the adapters, the action/time projections and the heads; without it, everything)."""
        return {name: t.detach() for name, t in self.state_dict(keep_vars=True).items()
                if isinstance(t, nn.Parameter) and t.requires_grad}

    def load_trainable_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load what :meth:`trainable_state_dict` gave (every key of it, and nothing else)."""
        want = set(self.trainable_state_dict())
        missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
        if missing or unexpected:
            raise KeyError(f"{OWNER}.load_trainable_state_dict: missing {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                           f"{' ...' if len(unexpected) > 5 else ''}")
        self.load_state_dict(dict(state), strict=False)


# ---- helpers -----------------------------------------------------------------------------------

def _read_spaces(observation_space, instruction, image_keys, state_keys) -> tuple[ObsLayout, tuple[int, int] | None]:
    """``(layout, instruction_classes)``: the Discrete ``instruction`` entry is never state; with a
    list of instructions it picks one per row."""
    from gymnasium import spaces

    entry = observation_space.spaces.get(INSTRUCTION_KEY) if isinstance(observation_space, spaces.Dict) else None
    classes = None
    if instruction is not None and not isinstance(instruction, str):
        if not isinstance(entry, spaces.Discrete):
            raise ValueError(f"{OWNER}: a list of {len(instruction)} instructions is chosen per row by a Discrete "
                             f"'instruction' entry of the observation, but the observation space "
                             f"{observation_space} has none (give one instruction string instead)")
        if len(instruction) != int(entry.n):
            raise ValueError(f"{OWNER}: {len(instruction)} instructions, but the 'instruction' entry is "
                             f"Discrete({entry.n}): give one instruction per value")
        classes = (int(entry.n), int(entry.start))
    elif instruction is None and isinstance(entry, spaces.Discrete):
        raise ValueError(f"{OWNER}: the observation has an 'instruction' index: give instruction= (the env's "
                         "instructions(), one per value)")
    elif instruction is None:
        warnings.warn(f"{OWNER}: no instruction given: the prompt's task is empty (as PI0Processor without text)",
                      stacklevel=3)
    exclude = (INSTRUCTION_KEY,) if entry is not None else ()
    layout = ObsLayout.from_space(observation_space, image_keys=image_keys, state_keys=state_keys, exclude=exclude)
    return layout, classes


def _processor_tokenizer(tokenizer: Any) -> Any:
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


def _lora_modules(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """The full names of the language model's and the action expert's linear layers named in
    ``targets`` (the vision tower keeps its weights)."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)
             and name.startswith(("model.vlm.language_model.", "model.dit.")) and name.rsplit(".", 1)[-1] in targets]
    if not names:
        raise ValueError(f"{OWNER}: lora_targets {list(targets)} name no linear layer of the language model or the "
                         "action expert")
    return names


__all__ = ["ImageSettings", "PI0Policy", "Processing", "check_pi0_dir", "preprocess_images"]
