"""What the VLA flow policies share (:class:`~ebrl.policies.pi0.policy.PI0Policy`,
:class:`~ebrl.policies.smolvla.policy.SmolVLAPolicy`): a pretrained VLM with an action expert whose
chunks run on :mod:`ebrl.policies.flow_chain`'s chain in π0's time (noise at ``t = 1``).

:class:`VLAFlowPolicy` holds everything but the model: the action space and ``execute`` (a Box
``(A,)``, or chunks ``(K, A)`` of which the env executes ``K``), the chain and its settings, the
observation's state reader and the instructions, the checkpoint's dtype and LoRA on the linear
layers under :attr:`~VLAFlowPolicy.LORA_SCOPE`, the two float32 heads EBRL adds (Flow-Noise's noise
head, ``sigma`` by :func:`~ebrl.policies.flow_chain.tanh_sigma`; the value head, zero at the start,
its input detached with ``detach_value_input``), ``act``/``evaluate``/``value``, the
flow-matching SFT loss's targets, the env actions from a final chunk and the weights that train.
A subclass supplies its model's parts:

- ``_prefix(obs, last_hidden=...)``: the VLM's one pass over the observation (a prefix with
  ``rows``), which every expert pass reads;
- ``_expert(prefix, x, time)``: one action-expert pass, ``(velocity, hidden)``, float32;
- ``_features(prefix)``: what the value head reads;
- ``_sample_time(rows, generator)``: the model's training times;
- ``_describe_camera(i)``: how camera ``i`` is read (``describe_inputs``).

Its constructor calls ``super().__init__`` with the chunk's shape and the common options, reads its
processor's settings, then :meth:`~VLAFlowPolicy._adopt_model` (dtype, LoRA) and
:meth:`~VLAFlowPolicy._add_heads`. The action space is parsed once for both:

    >>> import gymnasium as gym
    >>> from ebrl.policies.vla_flow import VLAFlowPolicy
    >>> low, high, execute = VLAFlowPolicy.action_bounds(gym.spaces.Box(-1, 1, (7,)), execute=5)
    >>> low.shape, execute  # the env's decisions: chunks of 5 actions (ActionChunk executes them)
    ((5, 7), 5)
    >>> VLAFlowPolicy.action_bounds(gym.spaces.Box(-1, 1, (4, 7)), execute=2)
    Traceback (most recent call last):
    ...
    ValueError: VLAFlowPolicy: the action space executes chunks of 4 actions, not execute=2
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult
from ebrl.policies.encoders import ObsEncoder, ObsLayout, as_tensor, lookup
from ebrl.policies.expects import PolicySpaces
from ebrl.policies.flow_chain import FlowChain, HasChain, Velocity, tanh_sigma
from ebrl.policies.hf_backbone import (
    DEFAULT_LORA_TARGETS,
    INSTRUCTION_KEY,
    FrozenModes,
    instructed_spaces,
    wrap_lora,
)
from ebrl.policies.mlp import _mlp
from ebrl.policies.precision import fast_low_precision_linears


class VLAFlowPolicy(HasChain, FrozenModes):
    """A VLA's flow policy on the shared chain (see the module's docstring); subclasses build it."""

    OWNER: ClassVar[str] = "VLAFlowPolicy"  # the name errors give
    # the linear layers LoRA may adapt (their names' prefixes) and, for errors, what they are
    LORA_SCOPE: ClassVar[tuple[str, ...]] = ()
    LORA_SCOPE_NAME: ClassVar[str] = ""
    deterministic: bool = False  # True: act() gives the mode (the ODE from zero noise)
    # PPO's settings for RL from a pretrained or SFT-tuned VLA (ebrl.runs.build_algo applies them under
    # the run's own [ppo] table); docs/policies.md says where they come from
    RL_DEFAULTS: ClassVar[dict[str, Any]] = {"lr": 2e-5, "critic_lr": 3e-4, "critic_warmup_updates": 10,
                                             "max_kl": 0.02}

    def __init__(self, *, chunk: tuple[int, int], default_steps: int, obs_layout: ObsLayout, action_low,
                 action_high, execute: int, instruction: str | Sequence[str] | None = None,
                 instruction_classes: tuple[int, int] | None = None, method: str = "flow-noise",
                 denoise_steps: int | None = None, noise_level: float = 0.5, sigma_min: float = 0.08,
                 sigma_max: float = 0.16, noise_hidden: Sequence[int] = (128, 64), value_head: bool = True,
                 value_hidden: Sequence[int] = (512, 256, 128), gradient_checkpointing: bool = False,
                 dtype: str = "float32", seed: int = 0, base_path: str | None = None, **config: Any):
        """The chain, the action space, the state reader and the instructions; ``config``: the
        subclass's own entries of ``self.config``."""
        super().__init__()
        owner = self.OWNER
        n = int(denoise_steps if denoise_steps is not None else default_steps)
        if method == "flow-noise" and not 0 < sigma_min < sigma_max:
            raise ValueError(f"{owner}: flow-noise needs 0 < sigma_min < sigma_max, got {sigma_min!r}, {sigma_max!r}")
        low, high = np.asarray(action_low, np.float32), np.asarray(action_high, np.float32)
        self.action_shape = tuple(low.shape)
        self.chunk_size, self.max_action_dim = int(chunk[0]), int(chunk[1])
        self.action_dim, self.execute = int(self.action_shape[-1]), int(execute)
        self.demo_chunk_len = self.chunk_size  # SFT learns whole chunks (ebrl.sft.demo_shape), RL executes `execute`
        if not 1 <= self.execute <= self.chunk_size:
            raise ValueError(f"{owner}: execute={execute} actions per decision, but the model's chunks are "
                             f"{self.chunk_size} long")
        if self.action_dim > self.max_action_dim:
            raise ValueError(f"{owner}: the env's actions have {self.action_dim} dims, the model's at most "
                             f"{self.max_action_dim}")
        self.action_low, self.action_high = low, high
        try:  # the model's velocity over the whole chunk; noise on the block the env executes
            self.chain = FlowChain(n, (self.chunk_size, self.max_action_dim), (self.execute, self.action_dim),
                                   method=method, noise_level=noise_level, noise_at=1)
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None
        self.noise_level, self.sigma_min, self.sigma_max = float(noise_level), float(sigma_min), float(sigma_max)
        self.seed = int(seed)
        self._layout = obs_layout
        self.instruction_classes = None if instruction_classes is None else tuple(int(v) for v in instruction_classes)
        self.texts = [""] if instruction is None else [instruction] if isinstance(instruction, str) else [
            str(s) for s in instruction]
        self.config: dict[str, Any] = {
            "base_path": base_path, **config, "obs_layout": obs_layout.to_config(),
            "action_low": low.tolist(), "action_high": high.tolist(), "execute": self.execute,
            "instruction": instruction if isinstance(instruction, str) or instruction is None else list(instruction),
            "instruction_classes": None if instruction_classes is None else list(instruction_classes),
            "method": method, "denoise_steps": n, "noise_level": self.noise_level, "sigma_min": self.sigma_min,
            "sigma_max": self.sigma_max, "noise_hidden": list(noise_hidden), "value_head": bool(value_head),
            "value_hidden": list(value_hidden), "lora": None, "gradient_checkpointing": bool(gradient_checkpointing),
            "dtype": str(dtype), "seed": self.seed}
        state = dataclasses.replace(obs_layout, images=())
        self.state_reader = ObsEncoder(state, normalize=False, owner=owner)  # no parameters, no buffers
        self.state_dim = state.flat_dim
        # where the policy lives (a bool: no dtype cast moves it; not in state_dict)
        self.register_buffer("device_anchor", torch.zeros(0, dtype=torch.bool), persistent=False)

    # ---- building ------------------------------------------------------------------------------

    @classmethod
    def action_bounds(cls, action_space, execute: int | None) -> tuple[np.ndarray, np.ndarray, int]:
        """``(low, high, execute)`` of a Box action space ``(A,)`` (``execute=K`` makes the
        decisions chunks ``(K, A)``, which ``ebrl.run`` executes with
        :class:`~ebrl.envs.chunks.ActionChunk`) or ``(K, A)`` (``K`` executed per decision)."""
        from gymnasium import spaces

        if not (isinstance(action_space, spaces.Box) and len(action_space.shape) in (1, 2)):
            raise ValueError(f"{cls.OWNER} needs a Box action space of shape (A,) or (K, A), got {action_space!r}")
        low, high = np.asarray(action_space.low, np.float32), np.asarray(action_space.high, np.float32)
        if low.ndim == 2:
            if execute is not None and execute != low.shape[0]:
                raise ValueError(f"{cls.OWNER}: the action space executes chunks of {low.shape[0]} actions, not "
                                 f"execute={execute}")
            execute = low.shape[0]
        elif execute is not None and execute != 1:  # chunks of `execute` actions of this Box (ActionChunk)
            low = np.broadcast_to(low, (execute, *low.shape)).copy()
            high = np.broadcast_to(high, (execute, *high.shape)).copy()
        return low, high, int(execute or 1)

    @classmethod
    def instruction_option(cls, instruction: str | Sequence[str] | None, instructions: Sequence[str] | None
                             ) -> str | list[str] | None:
        """``instruction=`` or ``instructions=`` (the same list), not both."""
        if instructions is None:
            return instruction
        if instruction is not None:
            raise ValueError(f"{cls.OWNER}: give instruction= or instructions=, not both")
        return list(instructions)

    @classmethod
    def from_spaces(cls, observation_space, action_space, *, path, **options: Any):
        """:meth:`from_pretrained` with the spaces first, as the other policies' ``from_spaces``."""
        return cls.from_pretrained(path, observation_space, action_space, **options)

    def _adopt_model(self, model: nn.Module, projections: Sequence[nn.Module], lora_rank: int | None,
                     lora_alpha: float | None, lora_targets: Sequence[str] | None) -> nn.Module:
        """The checkpoint's ``projections`` (around the two stacks: they train) in float32 whatever
        its dtype, low-precision linears made fast, and, with ``lora_rank``, LoRA on the
        :attr:`LORA_SCOPE`'s linear layers named in ``lora_targets``; the model under its wrapper."""
        for module in projections:
            module.float()
        fast_low_precision_linears(model)
        if lora_rank is not None:
            targets = tuple(lora_targets) if lora_targets is not None else DEFAULT_LORA_TARGETS
            names = self._lora_modules(model, targets)
            alpha = float(lora_alpha if lora_alpha is not None else min(lora_rank, 16))
            self.config["lora"] = {"rank": int(lora_rank), "alpha": alpha, "targets": list(targets)}
            model = wrap_lora(model, int(lora_rank), alpha, names, self.seed)
            for module in projections:
                module.requires_grad_(True)
        return model

    def _lora_modules(self, model: nn.Module, targets: Sequence[str]) -> list[str]:
        """The full names of the linear layers under :attr:`LORA_SCOPE` named in ``targets`` (the
        vision tower keeps its weights)."""
        names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)
                 and name.startswith(self.LORA_SCOPE) and name.rsplit(".", 1)[-1] in targets]
        if not names:
            raise ValueError(f"{self.OWNER}: lora_targets {list(targets)} name no linear layer of "
                             f"{self.LORA_SCOPE_NAME}")
        return names

    def _add_heads(self, noise_width: int, value_width: int, detach_value_input: bool) -> None:
        """What EBRL adds, float32: Flow-Noise's noise head on the expert's hidden states (a small
        last layer: sigma starts near ``sqrt(sigma_min * sigma_max)``) and the value head on
        features of ``value_width`` (values start at 0); then sampling starts."""
        gen = torch.Generator().manual_seed(self.seed)
        if self.method == "flow-noise":
            self.noise_head = _mlp(noise_width, self.config["noise_hidden"], self.max_action_dim, nn.Tanh, 0.01, gen)
        self.feature_width = int(value_width)  # what value_features gives
        self.has_value_head, self.detach_value_input = bool(self.config["value_head"]), bool(detach_value_input)
        self.config["detach_value_input"] = self.detach_value_input
        if self.has_value_head:
            self.value_head = _mlp(value_width, self.config["value_hidden"], 1, nn.ReLU, 0.0, gen)
        self._start_sampling()
        self.train(True)

    # ---- what it is -----------------------------------------------------------------------------

    @property
    def obs_layout(self) -> ObsLayout:
        return self._layout

    @property
    def _device(self) -> torch.device:
        return self.device_anchor.device

    def expected_spaces(self) -> PolicySpaces:
        """The cameras and state entries read, the Discrete ``instruction`` entry of a list of
        instructions, and Box actions of ``action_shape``."""
        return instructed_spaces(self._layout, self.instruction_classes, self.action_shape)

    def describe_inputs(self) -> list[dict[str, Any]]:
        """The observation entries read, and how."""
        out = []
        for i, e in enumerate(self._layout.images):
            d = e.describe()
            d["features"] = self._describe_camera(i)
            out.append(d)
        for d in self.state_reader.describe():
            if d.get("as") == "ignored" and d["key"] == INSTRUCTION_KEY and self.instruction_classes is not None:
                continue  # read as the instruction index, below
            if d.get("as") != "ignored":
                d["normalised"] = self._describe_state()
            out.append(d)
        if self.instruction_classes is not None:
            out.append({"key": INSTRUCTION_KEY, "as": "instruction index", "classes": [self.instruction_classes[0]]})
        return out

    def _describe_camera(self, i: int) -> str:
        """How the model reads camera ``i`` of the layout."""
        raise NotImplementedError

    def _describe_state(self) -> str:
        return "with the checkpoint's statistics"

    def _rows(self, obs: Any) -> int:
        """The batch size of ``obs``, from its first entry read (or the instruction index)."""
        entry = self._layout.entries[0] if self._layout.entries else None
        value = lookup(obs, entry.path if entry is not None else (INSTRUCTION_KEY,))
        return int(np.prod(np.shape(value))) // max(1, math.prod(entry.shape) if entry is not None else 1)

    # ---- the model's parts (the subclass's) --------------------------------------------------------

    def _prefix(self, obs: Any, *, last_hidden: bool | None = None) -> Any:
        """The VLM's one pass over ``obs`` (an object with ``rows``), read by every expert pass;
        ``last_hidden``: whether the value's features are wanted (default: with a value head)."""
        raise NotImplementedError

    def _expert(self, prefix: Any, x: Tensor, time: Tensor) -> tuple[Tensor, Tensor]:
        """One action-expert pass on noisy chunks ``x [B, chunk, max_action_dim]`` at ``time [B]``:
        the velocity and the expert's last hidden states over the chunk's tokens, float32."""
        raise NotImplementedError

    def _features(self, prefix: Any) -> Tensor:
        """What the value head reads, ``[B, width]``."""
        raise NotImplementedError

    def _sample_time(self, rows: int, gen: torch.Generator) -> Tensor:
        """The model's training times ``[rows]``, drawn from ``gen``."""
        raise NotImplementedError

    # ---- the chain --------------------------------------------------------------------------------

    def _noise_std(self, hidden: Tensor) -> Tensor:
        """Flow-Noise's sigma on the executed block ``[B, execute, A]`` from the expert's hidden
        states: πRL's ExploreNoiseNet, ``log sigma^2`` interpolated by a ``tanh``."""
        raw = self.noise_head(hidden[:, :self.execute])[..., :self.action_dim]
        return tanh_sigma(raw, self.sigma_min, self.sigma_max)

    def _velocity(self, prefix: Any) -> Velocity:
        """The chain's velocity on a cached prefix (noise at ``t = 1``): an action-expert pass per
        flow state, each reading the prefix, and Flow-Noise's sigma from the same hidden states."""

        def velocity(x: Tensor, t: Tensor) -> tuple[Tensor, Tensor | None]:
            out, sigma = [], []
            for s in range(x.shape[1]):
                v, hidden = self._expert(prefix, x[:, s], t[:, s])
                out.append(v)
                if self.method == "flow-noise":
                    sigma.append(self._noise_std(hidden))
            return torch.stack(out, 1), torch.stack(sigma, 1) if sigma else None

        return velocity

    # ---- the value ------------------------------------------------------------------------------

    def _value_features(self, prefix: Any) -> Tensor:
        """:meth:`_features`, without gradients under ``detach_value_input``."""
        with torch.no_grad() if self.detach_value_input else contextlib.nullcontext():
            return self._features(prefix)

    def _values(self, prefix: Any) -> Tensor:
        """The value head ``[B]`` (zeros without one), float32."""
        if not self.has_value_head:
            return torch.zeros(prefix.rows, device=self._device)
        return self.value_from_features(self._value_features(prefix))

    def value_features(self, obs: Any) -> Tensor:
        """What the value head reads for ``obs``, ``[N, width]`` (SFT's value pass computes it once per frame)."""
        return self._value_features(self._prefix(obs, last_hidden=True))

    def value_from_features(self, features: Tensor) -> Tensor:
        """The value head on :meth:`value_features`' output: ``[N]`` (zeros without one)."""
        return self._head_values(features)

    def value(self, obs: Any) -> Tensor:
        """State values ``[N]``, with gradients (unless ``detach_value_input``)."""
        if not self.has_value_head:
            return torch.zeros(self._rows(obs), device=self._device)
        return self._values(self._prefix(obs))

    # ---- acting (runtime) -------------------------------------------------------------------------

    def to_env(self, x: np.ndarray) -> np.ndarray:
        """Final chunks ``[B, chunk * max_action_dim]`` (normalised) -> env actions ``[B, *action_shape]``:
        the first ``execute`` actions, cropped to the env's dims, un-normalised with the
        checkpoint's statistics, clipped to the Box."""
        x = torch.as_tensor(np.asarray(x, np.float32)).reshape(-1, self.chunk_size, self.max_action_dim)
        actions = self.action_norm.unnormalize(x[:, :self.execute, :self.action_dim].to(self._device))
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
        states, logp = self.chain.sample(self._velocity(prefix), prefix.rows, self._generator(self._device),
                                         device=self._device, x0=noise, deterministic=self.deterministic)
        actions = states.cpu().numpy()
        return ActResult(actions=actions, env_actions=self.to_env(actions[:, -1]), logprobs=logp.cpu().numpy(),
                         values=self._values(prefix).float().cpu().numpy())

    # ---- training (algorithm) ---------------------------------------------------------------------

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [M], entropy [M], value [M])`` of stored chains ``actions [M, N + 1, chunk * max_action_dim]``.

        The VLM's prefix once, then ``N`` action-expert passes over all ``M`` rows, reading it.
        The entropy is the chain's: ``N(0, I)``'s on the executed block (a constant) plus every
        step's Gaussian's there, given the stored states (constant for flow-sde and the ODE).
        """
        prefix = self._prefix(obs)
        logp, entropy = self.chain.score(self._velocity(prefix), torch.as_tensor(actions, device=self._device).float())
        return logp, entropy, self._values(prefix)

    def flow_matching_loss(self, obs: Any, chunks: Any, generator: torch.Generator | None = None) -> Tensor:
        """The model's own flow-matching loss on demonstration chunks ``[B, K, A]`` (or actions
        ``[B, A]``, K = 1) in env space: the chunks normalised with the checkpoint's statistics
        and zero-padded to ``max_action_dim`` (and, when ``K < chunk_size``, lengthened by
        repeating the last action, as :mod:`ebrl.sft` repeats an episode's last action), times
        from :meth:`_sample_time`, ``x_t = t noise + (1 - t) actions`` and the squared error of the
        predicted velocity against ``noise - actions``, averaged over the demonstrated entries
        (the first ``K`` actions, the env's ``A`` dims). Trains the model (its adapters under
        LoRA) and the projections; not the noise or value heads.
        """
        prefix = self._prefix(obs, last_hidden=False)
        device, rows = self._device, prefix.rows
        a = as_tensor(chunks, device).float()
        a = a.reshape(rows, -1, a.shape[-1])
        k, dims = a.shape[1], a.shape[2]
        if k > self.chunk_size or dims != self.action_dim:
            raise ValueError(f"{self.OWNER}.flow_matching_loss: chunks of {k} actions of {dims} dims, but the "
                             f"model's chunks are {self.chunk_size} long and the env's actions {self.action_dim} dims")
        target = torch.zeros(rows, self.chunk_size, self.max_action_dim, device=device)
        normalised = self.action_norm.normalize(a)
        target[:, :k, :dims] = normalised
        target[:, k:, :dims] = normalised[:, -1:]
        gen = generator if generator is not None else self._generator(device)
        return self.chain.flow_matching_loss(self._velocity(prefix), target, gen, scored=(k, dims),
                                             sample_time=self._sample_time)

    # ---- weights ----------------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """What training changes, named as in ``state_dict()``: the trainable parameters (under
        LoRA the adapters, the projections and the heads; without it, everything)."""
        return {name: t.detach() for name, t in self.state_dict(keep_vars=True).items()
                if isinstance(t, nn.Parameter) and t.requires_grad}


def masked_mean(hidden: Tensor, mask: Tensor) -> Tensor:
    """``hidden [B, L, width]`` averaged over the real tokens of ``mask [B, L]``, float32 (a
    value head's input on the VLM's prefix, as RLinf's ``value_after_vlm``).

        >>> masked_mean(torch.tensor([[[1.0], [3.0], [100.0]]]), torch.tensor([[True, True, False]]))
        tensor([[2.]])
    """
    m = mask[..., None].float()
    return (hidden.float() * m).sum(1) / m.sum(1).clamp(min=1)


__all__ = ["VLAFlowPolicy", "masked_mean"]
