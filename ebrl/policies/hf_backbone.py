"""What EBRL's policies around a local Hugging Face model share: the backbone and its prefix.

:class:`~ebrl.policies.hf_token.HFTokenPolicy` (OpenVLA's action tokens) and
:class:`~ebrl.policies.hf_flow.HFFlowPolicy` (a π0-style flow-matching action expert) read an
observation the same way, as one prefix of ``inputs_embeds`` for a pretrained causal LM or
image-text model from a local directory; they differ in what turns the prefix into actions.
:class:`HFBackbonePolicy` is the part they share:

- **loading** (:func:`check_model_dir`, :func:`load_local_model`): always
  ``local_files_only=True``; a directory missing ``config.json``, the weights or the tokenizer
  files is one :class:`FileNotFoundError` naming the path and the file;
- **the prefix** ``[pads] [BOS] [camera tokens] [state tokens] [prompt]``
  (:meth:`HFBackbonePolicy._prefix`) and the decoder's last hidden states over it
  (:meth:`HFBackbonePolicy._hidden`): cameras through the model's vision tower (or a learned patch
  projection for a causal LM), the other entries through a learned projection, the prompt with
  ``{instruction}`` filled in, left-padded, masked, positions counted from each row's first real
  token;
- **LoRA** through peft, the backbone kept in eval mode (no dropout, so that acting and training
  compute one function), gradient checkpointing, bf16 autocast, and a value head on the prefix's
  last hidden state;
- **weights**: :meth:`HFBackbonePolicy.trainable_state_dict` (what training changes, what
  weight publication moves), :meth:`HFBackbonePolicy.save_adapters` and
  :meth:`HFBackbonePolicy.load_adapters`.

A subclass calls ``HFBackbonePolicy.__init__`` with the options above, adds its own action
layers, and names in ``SAVED_OPTIONS`` the keys of its ``config`` that ``load_adapters`` passes
back to its constructor.

    >>> from ebrl.policies.hf_backbone import check_model_dir
    >>> check_model_dir("/models/not-there", owner="MyPolicy")
    Traceback (most recent call last):
    ...
    FileNotFoundError: MyPolicy: model directory '/models/not-there' does not exist (EBRL loads local ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import SeededSampling
from ebrl.policies.encoders import ObsEncoder, ObsLayout, ReadsObservations, as_tensor, lookup
from ebrl.policies.expects import ActionSpec, DType, ObsSpec, PolicySpaces
from ebrl.policies.precision import fast_low_precision_linears

OPENVLA_PROMPT = "In: What action should the robot take to {instruction}?\nOut:"
INSTRUCTION_KEY = "instruction"  # a Discrete entry of this name chooses one of a list of instructions
PATCH = 8  # a causal LM's camera patches are PATCH x PATCH pixels
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS_NAME, POLICY_JSON = "adapters.safetensors", "ebrl_policy.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
NEVER_DOWNLOADS = "EBRL loads local directories only and never downloads a model: save it there first"


# ---- the model directory ---------------------------------------------------------------------

def check_model_dir(path: str | Path, *, needs_image_processor: bool = False, owner: str | None = None,
                    processor: tuple[Sequence[str], str] | None = None) -> Path:
    """``path`` as a :class:`Path` if it holds a model EBRL can load (``config.json``, weights,
    a processor's file where one is needed, tokenizer files), else one :class:`FileNotFoundError`
    naming the path and what is missing (after ``owner: ``, if given). ``processor`` is
    ``(file names, what they are)``, one of the names needed; ``needs_image_processor`` asks for
    an image processor's config."""
    if needs_image_processor:
        processor = (IMAGE_PROCESSOR_FILES, "the image processor's " + " or ".join(IMAGE_PROCESSOR_FILES)
                     + " (the observation has cameras)")
    path = Path(path).expanduser()
    said = f"{owner}: " if owner else ""
    if not path.is_dir():
        raise FileNotFoundError(f"{said}model directory {str(path)!r} does not exist ({NEVER_DOWNLOADS})")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        missing.append("weights (one of " + ", ".join(WEIGHT_FILES) + ")")
    if processor is not None and not any((path / name).is_file() for name in processor[0]):
        missing.append(processor[1])
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (one of " + ", ".join(TOKENIZER_FILES) + ", with tokenizer_config.json)")
    if missing:
        raise FileNotFoundError(f"{said}model directory {str(path)!r} has no " + "; no ".join(missing)
                                + f" ({NEVER_DOWNLOADS})")
    return path


def torch_dtype(dtype: str | torch.dtype, owner: str = "") -> torch.dtype:
    """The :class:`torch.dtype` a ``dtype`` option names (``"auto"`` is float32: see the policies' "Precision")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"auto": torch.float32, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        said = f"{owner} " if owner else ""
        raise ValueError(f"{said}dtype={dtype!r}: must be one of {list(names)} or a torch.dtype")
    return names[dtype]


def is_image_text(config: Any) -> bool:
    """Whether a transformers config is an image-text model's (LLaVA and the like)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


def load_local_model(path: str | Path, *, dtype: str | torch.dtype = "auto", needs_image_processor: bool = False,
                     owner: str | None = None):
    """``(model, tokenizer, image_processor or None)`` from a local directory: an image-text model
    (``AutoModelForImageTextToText``, e.g. LLaVA) where its config is one, else
    ``AutoModelForCausalLM``; always ``local_files_only=True``."""
    path = check_model_dir(path, owner=owner)  # first: a wrong path is named before transformers is even imported
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    image_text = is_image_text(config)
    if image_text and needs_image_processor:
        check_model_dir(path, needs_image_processor=True, owner=owner)
    cls = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    # an explicit dtype: transformers 5 otherwise loads in the checkpoint's dtype ("auto" there)
    model = cls.from_pretrained(str(path), local_files_only=True, dtype=torch_dtype(dtype, owner or ""))
    fast_low_precision_linears(model)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    processor = None
    if image_text and needs_image_processor:
        from transformers import AutoImageProcessor, AutoProcessor

        try:
            processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError):  # only a combined processor_config.json
            processor = AutoProcessor.from_pretrained(str(path), local_files_only=True).image_processor
    return model, tokenizer, processor


# ---- the shared policy -----------------------------------------------------------------------

class CameraPatches(nn.Module):
    """A causal LM's camera reader: average-pooled to ``PATCH * grid`` pixels square, cut into
    ``PATCH x PATCH`` patches, each projected to one embedding (``[N, C, H, W] -> [N, grid**2, hidden]``)."""

    def __init__(self, channels: int, grid: int, hidden: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(PATCH * grid)
        self.proj = nn.Conv2d(channels, hidden, PATCH, PATCH)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.pool(x * 2.0 - 1.0)).flatten(2).transpose(1, 2)


class FrozenModes(SeededSampling, nn.Module):
    """What a policy around a pretrained model (``self.backbone``) shares: ``hf_model`` (the model
    under its LoRA wrapper); the model staying in eval mode whatever ``train()`` says (no dropout,
    so the acting and the training pass compute the same function, which the PPO ratio needs);
    a sampling stream (:class:`~ebrl.policies.base.SeededSampling`); gradient checkpointing; and
    loading what ``trainable_state_dict()`` gave."""

    backbone: nn.Module
    gradient_checkpointing: bool = False
    has_value_head: bool = False  # with one, ``value_head`` maps features [N, width] to [N, 1]

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model (with its LoRA layers injected, under LoRA)."""
        get_base = getattr(self.backbone, "get_base_model", None)
        return get_base() if callable(get_base) else self.backbone

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()
        return self

    def _enable_checkpointing(self) -> None:
        """Have the model's layers recompute their activations in the backward pass."""
        hf = self.hf_model
        # transformers 5 renames gradient_checkpointing_enable to activation_checkpointing_enable
        if hasattr(hf, "activation_checkpointing_enable"):
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.gradient_checkpointing = True

    @contextlib.contextmanager
    def _checkpointing(self) -> Iterator[None]:
        """transformers checkpoints a layer only in training mode; the model stays in eval mode
        (no dropout), so for a pass with gradients the checkpointed layers themselves are put in
        training mode: the layers only, as a model flagged so too would turn its cache off, and warn."""
        from transformers.modeling_layers import GradientCheckpointingLayer

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

    def _head_values(self, features: Tensor) -> Tensor:
        """The value head on ``features [N, width]``: ``[N]``, float32 (zeros without one)."""
        if not self.has_value_head:
            return features.new_zeros(features.shape[0], dtype=torch.float32)
        return self.value_head(features.float()).squeeze(-1)

    def load_trainable_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load what ``trainable_state_dict()`` gave (every key of it, and nothing else)."""
        want = set(self.trainable_state_dict())
        missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
        if missing or unexpected:
            raise KeyError(f"{type(self).__name__}.load_trainable_state_dict: missing {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                           f"{' ...' if len(unexpected) > 5 else ''}")
        self.load_state_dict(dict(state), strict=False)


class HFBackbonePolicy(ReadsObservations, FrozenModes):
    """The Hugging Face backbone, its prefix, LoRA and weights (see the module's docstring).

    ``model`` is a causal LM or image-text model, ``tokenizer`` its tokenizer, ``image_processor``
    its image processor (image-text models reading cameras); ``obs_layout`` the full layout
    (cameras included; a Discrete ``instruction`` entry left out); ``action_low``/``action_high``
    the action Box's bounds, ``(A,)`` or a chunk ``(K, A)``; ``instruction_classes`` the
    ``(n, start)`` of the Discrete ``instruction`` entry when ``instruction`` is a list. ``seed``
    fixes the added layers' initial weights, the LoRA initialisation and the sampling stream.
    """

    # keys of ``config`` that load_adapters passes back to the constructor, besides the shared ones
    SAVED_OPTIONS: tuple[str, ...] = ()
    _SHARED_OPTIONS = ("instruction", "prompt", "value_head", "state_tokens", "camera_grid", "normalize_obs",
                       "autocast_bf16", "gradient_checkpointing", "seed", "dtype")

    def __init__(self, model: nn.Module, tokenizer: Any, *, obs_layout: ObsLayout | Sequence[Mapping[str, Any]],
                 action_low, action_high, image_processor: Any = None,
                 instruction: str | Sequence[str] | None = None, instruction_classes: tuple[int, int] | None = None,
                 prompt: str | None = None, lora_rank: int | None = None, lora_alpha: float | None = None,
                 lora_targets: Sequence[str] | None = None, value_head: bool = True, state_tokens: int = 1,
                 camera_grid: int = 4, normalize_obs: bool = True, autocast_bf16: bool = False,
                 gradient_checkpointing: bool = False, seed: int = 0, base_path: str | None = None,
                 dtype: str = "auto"):
        super().__init__()
        owner = type(self).__name__
        layout = ObsLayout.from_config(obs_layout)
        box_low, box_high = action_bounds(action_low, action_high, owner)
        prompt = OPENVLA_PROMPT if prompt is None else str(prompt)
        instructions = instruction_list(instruction, instruction_classes, prompt, owner)
        image_text = is_image_text(getattr(model, "config", None))
        if layout.images and image_text and image_processor is None:
            cameras = [e.key for e in layout.images]
            raise ValueError(f"{owner}: {type(model).__name__} reads the cameras {cameras} "
                             "through its vision tower, which needs its image processor (image_processor=...)")
        if state_tokens < 1 or camera_grid < 1:
            raise ValueError(f"state_tokens={state_tokens} and camera_grid={camera_grid} must be >= 1")

        self.config: dict[str, Any] = {  # JSON-ready: ebrl_policy.json, and load_adapters rebuilds from it
            "base_path": base_path, "obs_layout": layout.to_config(), "action_low": box_low.tolist(),
            "action_high": box_high.tolist(), "instruction": instruction if isinstance(instruction, str) or
            instruction is None else list(instruction),
            "instruction_classes": None if instruction_classes is None else list(instruction_classes),
            "prompt": prompt,
            "lora": None if lora_rank is None else {"rank": int(lora_rank), "alpha": float(
                lora_alpha if lora_alpha is not None else min(lora_rank, 16)), "targets": None},
            "value_head": bool(value_head), "state_tokens": int(state_tokens), "camera_grid": int(camera_grid),
            "normalize_obs": bool(normalize_obs), "autocast_bf16": bool(autocast_bf16),
            "gradient_checkpointing": bool(gradient_checkpointing), "seed": int(seed), "dtype": str(dtype)}
        self.action_shape = tuple(box_low.shape)
        self.seed = int(seed)
        self.image_text = image_text
        self.autocast_bf16 = bool(autocast_bf16)
        self.tokenizer, self.image_processor = tokenizer, image_processor  # not modules: not in state_dict
        self._layout = layout
        self.instruction_classes = None if instruction_classes is None else tuple(int(v) for v in instruction_classes)

        # the backbone (LoRA-wrapped or not) is the one submodule holding the pretrained weights
        if lora_rank is not None:
            targets = lora_target_names(model, lora_targets)
            self.config["lora"]["targets"] = list(targets)
            model = wrap_lora(model, int(lora_rank), self.config["lora"]["alpha"], targets, self.seed)
        self.backbone = model
        hf = self.hf_model
        if gradient_checkpointing:
            self._enable_checkpointing()
        embed = hf.get_input_embeddings()
        self.hidden = int(embed.weight.shape[1])
        self._register_prompts(instructions, prompt, tokenizer)

        # what EBRL adds, float32 whatever the backbone's dtype; initialised at the embeddings' scale
        gen = torch.Generator().manual_seed(self.seed)
        embed_std = float(embed.weight.detach()[:4096].float().std())  # a sample of rows: a 7B's is 0.5 GB in fp32
        vectors = dataclasses.replace(layout, images=())
        self.obs_encoder = ObsEncoder(vectors, normalize=normalize_obs, owner=owner)
        self.state_tokens = int(state_tokens) if vectors.flat_dim else 0
        if self.state_tokens:
            self.state_proj = nn.Linear(vectors.flat_dim, self.state_tokens * self.hidden)
            nn.init.normal_(self.state_proj.weight, 0.0, embed_std / math.sqrt(vectors.flat_dim), generator=gen)
            nn.init.zeros_(self.state_proj.bias)
        self.camera_grid = int(camera_grid)
        if layout.images and not image_text:  # a causal LM: a learned patch projection per camera
            self.camera_proj = nn.ModuleList(CameraPatches(e.channels, self.camera_grid, self.hidden)
                                             for e in layout.images)
            for cam in self.camera_proj:
                nn.init.normal_(cam.proj.weight, 0.0, embed_std / math.sqrt(cam.proj.weight[0].numel()), generator=gen)
                nn.init.zeros_(cam.proj.bias)
        self.has_value_head = bool(value_head)
        if self.has_value_head:
            self.value_head = nn.Linear(self.hidden, 1)
            nn.init.zeros_(self.value_head.weight)  # values start at 0: no random critic noise in the first GAE
            nn.init.zeros_(self.value_head.bias)
        decoder = hf.get_decoder()
        params = inspect.signature(decoder.forward).parameters  # transformers 5 renames past_key_values to cache
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._start_sampling()
        self.train(True)

    # ---- building ----------------------------------------------------------------------------

    @classmethod
    def from_spaces(cls, observation_space, action_space, *, path: str | Path, **kw):
        """:meth:`from_pretrained` with the spaces first, as the other policies' ``from_spaces``."""
        return cls.from_pretrained(path, observation_space, action_space, **kw)

    @classmethod
    def _load_for_spaces(cls, path, observation_space, action_space, *, instruction=None, image_keys=None,
                         state_keys=None, **kw):
        """What ``from_pretrained`` shares: a Box action space ``(A,)`` or ``(K, A)``, the
        observation's layout (:func:`read_spaces`), then :meth:`_load`."""
        from gymnasium import spaces

        if not (isinstance(action_space, spaces.Box) and len(action_space.shape) in (1, 2)):
            raise ValueError(f"{cls.__name__} needs a Box action space of shape (A,) or (K, A), got {action_space!r}")
        layout, classes = read_spaces(observation_space, instruction, image_keys, state_keys, cls.__name__)
        return cls._load(path, layout, action_space.low, action_space.high, classes, instruction=instruction, **kw)

    @classmethod
    def _load(cls, path, layout: ObsLayout, low, high, classes, *, dtype="auto", **kw):
        model, tokenizer, processor = load_local_model(path, dtype=dtype, needs_image_processor=bool(layout.images),
                                                       owner=cls.__name__)
        dtype_name = str(dtype).removeprefix("torch.")
        return cls(model, tokenizer, obs_layout=layout, action_low=low, action_high=high, image_processor=processor,
                   instruction_classes=classes, base_path=str(Path(path).expanduser().resolve()), dtype=dtype_name,
                   **kw)

    def _register_prompts(self, instructions: list[str] | None, prompt: str, tokenizer: Any) -> None:
        """Tokenise every prompt once: ``prompt_ids [I, T]`` right-aligned (left-padded with the
        pad id), ``prompt_len [I]``, and the BOS id the tokenizer puts first (or None)."""
        texts = [prompt] if instructions is None else [prompt.replace("{instruction}", s) for s in instructions]
        ids = [list(tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos_id = bos if bos is not None and all(row[:1] == [bos] for row in ids) else None
        if self.bos_id is not None:  # BOS comes first, then the cameras and state, then the text (OpenVLA)
            ids = [row[1:] for row in ids]
        pad = next((t for t in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
                    if t is not None), 0)
        width = max(len(row) for row in ids)
        table = torch.full((len(ids), max(width, 1)), int(pad), dtype=torch.long)
        for i, row in enumerate(ids):
            if row:
                table[i, table.shape[1] - len(row):] = torch.tensor(row)
        self.register_buffer("prompt_ids", table, persistent=False)
        self.register_buffer("prompt_len", torch.tensor([len(row) for row in ids]), persistent=False)

    # ---- what it is --------------------------------------------------------------------------

    @property
    def obs_layout(self) -> ObsLayout:  # ReadsObservations' is the encoder's: this one has the cameras too
        """Every entry read: cameras, vectors, one-hot entries (not the instruction index)."""
        return self._layout

    def expected_spaces(self) -> PolicySpaces:
        """The layout's entries, the Discrete ``instruction`` entry of a list of instructions, and
        Box actions of ``action_shape``."""
        return instructed_spaces(self._layout, self.instruction_classes, self.action_shape)

    def describe_inputs(self) -> list[dict[str, Any]]:
        """The observation entries read, and how (cameras: the vision tower or the patch projection)."""
        cameras = []
        for e in self._layout.images:
            d = e.describe()
            d["features"] = (f"{type(self.hf_model).__name__} vision tower" if self.image_text
                             else f"patch projection, {self.camera_grid**2} tokens")
            cameras.append(d)
        inputs = cameras + self.obs_encoder.describe()
        if self.instruction_classes is not None:
            inputs.append({"key": INSTRUCTION_KEY, "as": "instruction index", "classes": [self.instruction_classes[0]]})
        return inputs

    # ---- the prefix --------------------------------------------------------------------------

    def _embed(self, ids: Tensor) -> Tensor:
        return self.hf_model.get_input_embeddings()(ids)

    def _camera_tokens(self, obs: Any, dtype: torch.dtype) -> list[Tensor]:
        """Each camera's embeddings ``[N, tokens, hidden]``, in layout order."""
        out = []
        device = self.prompt_ids.device
        for i, e in enumerate(self._layout.images):
            frames = lookup(obs, e.path)
            if self.image_text:  # the model's own preprocessing (numpy) and vision tower
                frames = frames.detach().cpu().numpy() if isinstance(frames, Tensor) else np.asarray(frames)
                frames = frames.reshape(-1, *e.shape)
                processed = self.image_processor(images=list(frames), return_tensors="pt", input_data_format=(
                    "channels_first" if e.channels_first else "channels_last"))
                hf = self.hf_model
                pixels = processed["pixel_values"].to(device, hf.get_input_embeddings().weight.dtype)
                cfg = hf.config
                kw = {k: getattr(cfg, k) for k in ("vision_feature_layer", "vision_feature_select_strategy")
                      if getattr(cfg, k, None) is not None}
                takes = inspect.signature(hf.get_image_features).parameters
                # what else the processor gives that the tower reads (image_sizes, for tiled towers)
                kw.update({k: v.to(device) if isinstance(v, Tensor) else v for k, v in processed.items()
                           if k != "pixel_values" and k in takes})
                with self._autocast(), self._checkpointing():
                    features = hf.get_image_features(pixel_values=pixels, **kw)
                features = getattr(features, "pooler_output", features)
                if isinstance(features, (list, tuple)):
                    features = torch.stack(list(features))
                out.append(features.to(dtype))
            else:
                x = as_tensor(frames, device).reshape(-1, *e.shape)
                x = (x if e.channels_first else x.permute(0, 3, 1, 2)).float()
                x = x * (1.0 / 255.0) if e.dtype == "uint8" else x
                out.append(self.camera_proj[i](x).to(dtype))
        return out

    def _prefix(self, obs: Any) -> tuple[Tensor, Tensor, Tensor]:
        """``(inputs_embeds [N, P, hidden], attention_mask [N, P], position_ids [N, P])`` of
        ``[pads] [BOS] [cameras] [state] [prompt]``: a prompt shorter than the longest is
        left-padded (masked), and positions count from each row's first real token."""
        device = self.prompt_ids.device
        dtype = self.hf_model.get_input_embeddings().weight.dtype
        extra = self._camera_tokens(obs, dtype)
        if self.state_tokens:
            state = self.obs_encoder.vector(obs, self.state_proj.weight)
            extra.append(self.state_proj(state).view(-1, self.state_tokens, self.hidden).to(dtype))
        index = instruction_index(obs, self.instruction_classes, self.prompt_ids.shape[0], device,
                                  extra[0].shape[0] if extra else 1)
        n, width = index.shape[0], self.prompt_ids.shape[1]
        parts = [self._embed(self.prompt_ids[index])]
        if self.bos_id is not None:
            parts.append(self._embed(torch.full((n, 1), self.bos_id, dtype=torch.long, device=device)))
        parts += extra
        joined = torch.cat(parts, 1)  # [text (right-aligned), BOS, cameras, state]: reordered below
        length, middle = joined.shape[1], joined.shape[1] - width  # middle: BOS, cameras and state
        pads = (width - self.prompt_len[index])[:, None]  # [N, 1]
        j = torch.arange(length, device=device)[None]
        source = torch.where(j < pads, j, torch.where(j < pads + middle, width + j - pads, j - middle))
        embeds = joined.gather(1, source[..., None].expand(-1, -1, joined.shape[-1]))
        mask = (j >= pads).long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        return embeds, mask, positions

    def _prefix_rows(self, obs: Any) -> Tensor:
        """Zeros ``[N]`` without running the model (a policy without a value head)."""
        key = (INSTRUCTION_KEY,) if self.instruction_classes is not None else self._layout.entries[0].path
        return torch.zeros(len(lookup(obs, key)), device=self.prompt_ids.device)

    # ---- the model ---------------------------------------------------------------------------

    def _autocast(self):
        device = self.prompt_ids.device.type
        return torch.autocast(device, dtype=torch.bfloat16) if self.autocast_bf16 else contextlib.nullcontext()

    def _hidden(self, embeds: Tensor, mask: Tensor, positions: Tensor, cache: Any = None,
                use_cache: bool = False) -> tuple[Tensor, Any]:
        """The decoder's last hidden states ``[N, L, hidden]`` (and its cache) for ``embeds`` at
        ``positions``; ``mask`` covers the cached positions and these."""
        with self._autocast(), self._checkpointing():
            out = self.hf_model.get_decoder()(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                              use_cache=use_cache, **{self._cache_kw: cache})
        new_cache = getattr(out, "cache", None) if self._cache_kw == "cache" else getattr(out, "past_key_values", None)
        return out.last_hidden_state, new_cache

    def value(self, obs: Any) -> Tensor:
        """State values ``[N]``, with gradients: a pass over the prefix only (zeros without a value head)."""
        if not self.has_value_head:
            return self._prefix_rows(obs)
        embeds, mask, positions = self._prefix(obs)
        return self._head_values(self._hidden(embeds, mask, positions)[0][:, -1])

    # ---- weights ------------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """What training changes, named as in ``state_dict()``: the trainable parameters (under
        LoRA the adapters and the layers EBRL adds; without it, everything) and the buffers
        outside the backbone (the observations' running statistics)."""
        out = {}
        for name, t in self.state_dict(keep_vars=True).items():
            if isinstance(t, nn.Parameter) and t.requires_grad:
                out[name] = t.detach()
            elif not isinstance(t, nn.Parameter) and not name.startswith("backbone."):
                out[name] = t.detach()
        return out

    def save_adapters(self, path: str | Path) -> None:
        """Write ``adapters.safetensors`` (:meth:`trainable_state_dict`) and ``ebrl_policy.json``
        (the base model's directory, the spaces, LoRA, instructions, prompt and the policy's options)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        # clone: tied weights (a trainable embedding and head) would share memory, which safetensors refuses
        tensors = {k: v.detach().cpu().clone().contiguous() for k, v in self.trainable_state_dict().items()}
        save_file(tensors, str(path / ADAPTERS_NAME), metadata={"format": "pt", "policy": type(self).__name__})
        description = {"policy": type(self).__name__, **self.config, "inputs": self.describe_inputs(),
                       "action_shape": list(self.action_shape)}
        (path / POLICY_JSON).write_text(json.dumps(description, indent=2) + "\n")

    @classmethod
    def load_adapters(cls, path: str | Path, observation_space=None, action_space=None, *,
                      base_path: str | Path | None = None):
        """Rebuild a policy :meth:`save_adapters` wrote: the base model from its directory (or
        ``base_path``, where it has moved), then the trainable tensors (safetensors only). The
        policy reads and acts as it was saved; spaces, when given, are checked against that (the
        observation entries, and the action Box with its bounds, which the actions depend on)."""
        from safetensors.torch import load_file

        path = Path(path)
        for name in (POLICY_JSON, ADAPTERS_NAME):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{cls.__name__}.load_adapters: {path / name} does not exist")
        config = json.loads((path / POLICY_JSON).read_text())
        if config.get("policy", cls.__name__) != cls.__name__:
            raise ValueError(f"{path / POLICY_JSON} describes a {config['policy']}, not a {cls.__name__}")
        base = base_path if base_path is not None else config["base_path"]
        if base is None:
            raise ValueError(f"{path / POLICY_JSON} names no base model directory: pass base_path=")
        lora = config["lora"] or {}
        kw = dict(lora_rank=lora.get("rank"), lora_alpha=lora.get("alpha"), lora_targets=lora.get("targets"))
        options = (*cls._SHARED_OPTIONS, *cls.SAVED_OPTIONS)
        # an option left out would take the constructor's default, which the adapters may not have been trained with
        missing = [k for k in options if k not in config]
        if missing:
            raise ValueError(f"{path / POLICY_JSON} lacks options {cls.__name__} saves: {missing}")
        kw.update({k: config[k] for k in options})
        layout = ObsLayout.from_config(config["obs_layout"])
        classes = None if config["instruction_classes"] is None else tuple(config["instruction_classes"])
        low, high = config["action_low"], config["action_high"]
        policy = cls._load(base, layout, low, high, classes, **kw)
        if action_space is not None:
            saved = (np.asarray(low, np.float32), np.asarray(high, np.float32))
            given = (np.asarray(getattr(action_space, "low", np.nan), np.float32),
                     np.asarray(getattr(action_space, "high", np.nan), np.float32))
            if not all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(saved, given)):
                raise ValueError(f"{path / POLICY_JSON} was saved for a Box action space with low={saved[0].tolist()}, "
                                 f"high={saved[1].tolist()}, not {action_space}")
        if observation_space is not None:
            from ebrl.policies.expects import check_policy_spaces

            check_policy_spaces(policy, observation_space, action_space if action_space is not None else
                                _box(policy.action_shape))
        policy.load_trainable_state_dict(load_file(str(path / ADAPTERS_NAME)))
        return policy


# ---- helpers ---------------------------------------------------------------------------------

def read_spaces(observation_space, instruction, image_keys=None, state_keys=None, owner: str = "the policy", *,
                index_only: bool = False):
    """``(layout, instruction_classes)`` from a gymnasium observation space: with a list of
    instructions, its Discrete ``instruction`` entry chooses one per row (and is left out of the
    layout). ``index_only``: that entry is never read as state, and needs ``instruction``."""
    from gymnasium import spaces

    entry = observation_space.spaces.get(INSTRUCTION_KEY) if isinstance(observation_space, spaces.Dict) else None
    classes, exclude = None, (INSTRUCTION_KEY,) if index_only and entry is not None else ()
    if instruction is not None and not isinstance(instruction, str):
        if not isinstance(entry, spaces.Discrete):
            raise ValueError(f"{owner}: a list of {len(instruction)} instructions is chosen per row by a "
                             f"Discrete 'instruction' entry of the observation, but the observation space "
                             f"{observation_space} has none (give one instruction string instead)")
        if len(instruction) != int(entry.n):
            raise ValueError(f"{owner}: {len(instruction)} instructions, but the 'instruction' entry is "
                             f"Discrete({entry.n}): give one instruction per value")
        classes, exclude = (int(entry.n), int(entry.start)), (INSTRUCTION_KEY,)
    elif index_only and instruction is None and isinstance(entry, spaces.Discrete):
        raise ValueError(f"{owner}: the observation has an 'instruction' index: give instruction= (the env's "
                         "instructions(), one per value)")
    layout = ObsLayout.from_space(observation_space, image_keys=image_keys, state_keys=state_keys, exclude=exclude)
    return layout, classes


def instructed_spaces(layout: ObsLayout, classes: tuple[int, int] | None, action_shape: Sequence[int]
                      ) -> PolicySpaces:
    """What :func:`read_spaces` read, as the policy expects it: the layout's entries, the Discrete
    ``instruction`` entry of ``classes = (n, start)`` (a list of instructions) and Box actions of
    ``action_shape``."""
    obs = layout.expected()
    if classes is not None:
        obs += (ObsSpec(keys=(INSTRUCTION_KEY,), size=classes[0], dtype=DType.CATEGORICAL),)
    return PolicySpaces(obs, ActionSpec(shape=tuple(action_shape)))


def instruction_index(obs: Any, classes: tuple[int, int] | None, count: int, device: torch.device,
                      rows: int) -> Tensor:
    """Each row's instruction ``[N]``: the observation's Discrete ``instruction`` entry (of
    ``classes = (n, start)``) checked against the ``count`` instructions, or zeros for ``rows`` rows."""
    if classes is None:
        return torch.zeros(rows, dtype=torch.long, device=device)
    index = as_tensor(lookup(obs, (INSTRUCTION_KEY,)), device).reshape(-1).long() - classes[1]
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= count):
        raise ValueError(f"observation entry 'instruction' must index the {count} instructions, got values in "
                         f"[{int(index.min())}, {int(index.max())}]")
    return index


def action_bounds(low, high, owner: str) -> tuple[np.ndarray, np.ndarray]:
    """The action Box's bounds as float32 arrays of one shape, ``(A,)`` or ``(K, A)``."""
    low, high = np.asarray(low, np.float32), np.asarray(high, np.float32)
    if low.shape != high.shape or low.ndim not in (1, 2) or low.size == 0:
        raise ValueError(f"{owner} acts in a Box of shape (A,) or (K, A), got bounds of shapes "
                         f"{low.shape} and {high.shape}")
    return low, high


def _box(shape: tuple[int, ...]):
    from gymnasium import spaces

    return spaces.Box(-1.0, 1.0, shape, np.float32)


def instruction_list(instruction, classes, prompt: str, owner: str = "the policy") -> list[str] | None:
    """The instructions as a list of strings (None without one), checked against the prompt and
    the Discrete ``instruction`` entry's ``classes``."""
    if instruction is None:
        if "{instruction}" in prompt:
            raise ValueError(f"{owner}: the prompt has an {{instruction}} to fill: give instruction= (the task, "
                             "or a list of tasks indexed by a Discrete 'instruction' observation entry)")
        return None
    if "{instruction}" not in prompt:
        raise ValueError(f"{owner}: prompt={prompt!r} has no {{instruction}} for instruction={instruction!r}")
    if isinstance(instruction, str):
        return [instruction]
    instructions = [str(s) for s in instruction]
    if classes is None:
        raise ValueError(f"{owner}: a list of instructions needs instruction_classes (n, start) of the "
                         "Discrete 'instruction' entry that chooses one (from_pretrained finds it in the spaces)")
    if len(instructions) != classes[0]:
        raise ValueError(f"{owner}: {len(instructions)} instructions, but the 'instruction' entry is "
                         f"Discrete({classes[0]}): give one instruction per value")
    return instructions


def lora_target_names(model: nn.Module, targets: Sequence[str] | None) -> tuple[str, ...]:
    """The module names LoRA adapts: ``targets`` (checked), else those of the default ones the model has."""
    linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    if targets is not None:  # any module peft can adapt (GPT-2's Conv1D too): checked by name only
        targets = (targets,) if isinstance(targets, str) else tuple(targets)
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [t for t in targets if t not in names]
        if missing:
            raise ValueError(f"lora_targets {missing} name no module of {type(model).__name__} "
                             f"(its linear layers: {sorted(linear)})")
        return targets
    names = linear
    found = tuple(t for t in DEFAULT_LORA_TARGETS if t in names)
    if not found:
        raise ValueError(f"{type(model).__name__} has none of the default LoRA targets {list(DEFAULT_LORA_TARGETS)}: "
                         f"name its attention and MLP projections in lora_targets (it has {sorted(names)})")
    return found


def wrap_lora(model: nn.Module, rank: int, alpha: float, targets: Sequence[str], seed: int) -> nn.Module:
    """``peft.get_peft_model`` with LoRA on ``targets``; the base weights frozen. The adapters'
    random initialisation draws from ``seed`` (peft draws from torch's global generator)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(seed)
        # peft asks transformers 5 the deprecated is_gradient_checkpointing: not ours to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def pil_pi0_image_processor(**settings: Any):
    """transformers' ``PI0ImageProcessor`` (resize to fit, rescale, normalise, pad) on the PIL
    backend: the image processor's own definition, which runs without torchvision (its torchvision
    backend does not import here). ``settings`` override its defaults (``size``, ``pad_size``,
    ``image_seq_length``, ...): what :func:`~ebrl.policies.pi0.lerobot.save_transformers` saves, and the
    tests' reference. Needs PIL."""
    from transformers.image_processing_backends import PilBackend
    from transformers.models.pi0.image_processing_pi0 import PI0ImageProcessor

    # the class attributes are PI0ImageProcessor's; the name saves as "PI0ImageProcessor" (PilBackend drops "Pil")
    attrs = {k: getattr(PI0ImageProcessor, k) for k in (
        "resample", "image_mean", "image_std", "size", "default_to_square", "do_resize", "do_rescale",
        "do_normalize", "do_convert_rgb", "image_seq_length", "pad_size", "do_pad")}
    cls = type("PI0ImageProcessorPil", (PilBackend,), attrs)
    return cls(**settings)


__all__ = ["HFBackbonePolicy", "OPENVLA_PROMPT", "check_model_dir", "load_local_model", "pil_pi0_image_processor"]
