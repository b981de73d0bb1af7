"""A π0 / SmolVLA-style flow-matching action expert on your own Hugging Face model, trained with PPO.

:class:`~ebrl.policies.flow.FlowPolicy` turns noise into an action chunk with small MLPs;
:class:`HFFlowPolicy` keeps its contract and its chain exactly (``act``/``evaluate``/``value``,
the whole denoising chain as the stored action, πRL's Flow-Noise sigma learned per step) and
reads the observation with a pretrained causal LM or image-text model from a local directory,
as π0 and SmolVLA read it with a VLM. What it shares with
:class:`~ebrl.policies.hf_token.HFTokenPolicy` (loading without downloads, the prefix, LoRA,
``trainable_state_dict``, ``save_adapters``/``load_adapters``, precision, no dropout) is
:class:`~ebrl.policies.hf_backbone.HFBackbonePolicy`; see HFTokenPolicy's docstring for those.

**The backbone** runs once per ``act``/``evaluate``/``value`` over the prefix alone::

    [BOS] [camera tokens ...] [state tokens] "In: What action should the robot take to {instruction}?\\nOut:"

(left-padded and masked as HFTokenPolicy's) and gives its last hidden states ``h [N, P, hidden]``.
A value head reads ``h`` at the prefix's last position (its last real token).

**The action expert** is a small transformer of its own: ``expert_layers`` pre-norm blocks of
width ``expert_width``, whose ``K`` tokens are the chunk's actions. Token ``j`` is π0's
action-time MLP of ``[W_a x_tau[j], time(tau)]`` (sinusoidal ``time``) plus a learned position;
each block self-attends among the chunk's tokens, cross-attends to ``W_h LayerNorm(h)`` (padding
masked out) and applies an MLP. That is π0's and SmolVLA's layout, an expert attending to the
VLM's prefix, with cross-attention in place of a shared attention: the backbone never sees the
actions, so it runs once however many denoising steps follow. Per token, one linear head gives
the chunk's predicted final actions ``x1_hat`` (``predict="action"``; ``"velocity"`` predicts
the velocity) and a separate MLP head gives the step's noise ``sigma`` in ``[sigma_min, sigma_max]``.

**The chain** is FlowPolicy's (``tau_k = k / N``, ``N = denoise_steps``)::

    x_0 ~ N(0, I)
    x_{k+1} = x_k + (x1_hat(x_k, tau_k, obs) - x_k) / (N - k) + sigma(x_k, tau_k, obs) * eps_k
    log p(chain) = log N(x_0; 0, I) + sum_k log N(x_{k+1}; mean_k, diag(sigma_k^2))

``actions`` is the chain ``[B, N + 1, K * A]``; ``env_actions`` is ``x_N`` mapped from ``[-1, 1]``
onto the Box, ``[B, K, A]`` (or ``[B, A]`` for a Box ``(A,)``). A fresh policy acts like a
Gaussian of std ``init_sigma`` around a prediction near the Box's centre. ``evaluate`` scores
all ``N`` steps of every stored chain in one pass of the expert over the one prefix: a row's
``N`` chunks are ``N`` blocks of tokens that attend within their block. The log-probs come from
float32 layers, whatever the backbone's precision. :meth:`HFFlowPolicy.flow_matching_loss` is the
rectified-flow behaviour-cloning loss ``|x1_hat(x_tau, tau, obs) - target|^2`` for SFT on
demonstrations before RL (the expert, its action head and, through LoRA, the backbone; not the
noise head).

**Training.** Under LoRA the adapters train with the expert, its heads, the state and camera
projections and the value head; the base weights stay frozen. Wrap the env in
:class:`~ebrl.envs.chunks.ActionChunk` to execute a ``K``-action chunk per decision.

Example (a model directory of your own; nothing is fetched)::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies.hf_flow import HFFlowPolicy
    >>> obs_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (224, 224, 3), np.uint8),
    ...                              "state": gym.spaces.Box(-np.inf, np.inf, (8,), np.float32)})
    >>> chunk_space = gym.spaces.Box(-1.0, 1.0, (4, 7))  # K=4 actions of dim 7 (ActionChunk)
    >>> policy = HFFlowPolicy.from_pretrained(  # doctest: +SKIP
    ...     "/models/my-vlm", obs_space, chunk_space, lora_rank=16, denoise_steps=4,
    ...     instruction="pick up the black bowl")
    >>> out = policy.act({"image": np.zeros((2, 224, 224, 3), np.uint8),  # doctest: +SKIP
    ...                   "state": np.zeros((2, 8), np.float32)})
    >>> out.actions.shape, out.env_actions.shape, out.logprobs.shape  # doctest: +SKIP
    ((2, 5, 28), (2, 4, 7), (2,))
    >>> policy.save_adapters("/runs/adapters")  # doctest: +SKIP
    >>> HFFlowPolicy.from_pretrained("/models/not-there", obs_space, chunk_space,
    ...                              instruction="pick up the black bowl")
    Traceback (most recent call last):
    ...
    FileNotFoundError: HFFlowPolicy: model directory '/models/not-there' does not exist (EBRL loads local ...
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult
from ebrl.policies.encoders import as_tensor
from ebrl.policies.flow_chain import ChunkSpace, FlowChain, HasChain, SigmoidSigma, TimeEmbedding, Velocity, chunk_2d
from ebrl.policies.hf_backbone import HFBackbonePolicy, action_bounds


class ActionExpert(nn.Module):
    """π0's action expert, small: noisy chunks ``x [R, S, K, A]`` at times ``tau [R, S]`` ->
    features ``[R, S, K, width]``, reading the prefix ``memory [R, P, width]`` (:meth:`memory`).

    A row's ``S`` chunks (denoising steps, in ``evaluate``) attend only within themselves, and
    all of them read the row's one prefix: ``S`` steps cost one pass, and the prefix is never repeated.
    """

    def __init__(self, action_dim: int, chunk_len: int, prefix_width: int, width: int, layers: int, heads: int):
        super().__init__()
        self.action_in = nn.Linear(action_dim, width)
        self.action_time_in = nn.Linear(2 * width, width)  # π0's action-time MLP
        self.action_time_out = nn.Linear(width, width)
        self.position = nn.Parameter(torch.randn(chunk_len, width) * 0.02)  # attention alone is order-blind
        self.prefix_in = nn.Sequential(nn.LayerNorm(prefix_width), nn.Linear(prefix_width, width))
        self.blocks = nn.ModuleList(
            nn.TransformerDecoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.time = TimeEmbedding(width)

    def memory(self, hidden: Tensor) -> Tensor:
        """The backbone's hidden states ``[R, P, hidden]`` (any dtype) as float32 keys and values ``[R, P, width]``."""
        return self.prefix_in(hidden.float())

    def forward(self, x: Tensor, tau: Tensor, memory: Tensor, padding: Tensor) -> Tensor:
        r, s, k, _ = x.shape
        time = self.time(tau)[:, :, None].expand(r, s, k, -1)
        tokens = self.action_time_in(torch.cat([self.action_in(x), time], -1))
        tokens = (self.action_time_out(nn.functional.silu(tokens)) + self.position).reshape(r, s * k, -1)
        step = torch.arange(s * k, device=x.device) // k
        other_steps = None if s == 1 else step[:, None] != step[None]  # True: may not attend
        for block in self.blocks:
            tokens = block(tokens, memory, tgt_mask=other_steps, memory_key_padding_mask=padding)
        return self.norm(tokens).reshape(r, s, k, -1)


class HFFlowPolicy(HasChain, ChunkSpace, HFBackbonePolicy):
    """Flow-matching chunks from a Hugging Face backbone and a small action expert (see the module's docstring).

    Build it with :meth:`from_pretrained` (a local directory and the env's spaces), or from a
    model in memory with the arguments of
    :class:`~ebrl.policies.hf_backbone.HFBackbonePolicy` (``model``, ``tokenizer``,
    ``obs_layout``, ``action_low``/``action_high``: finite, the Box ``(K, A)`` or ``(A,)``, ...)
    and the flow's: ``denoise_steps`` (N), ``predict``, ``expert_width``/``expert_layers``/
    ``expert_heads``, and ``sigma_min < init_sigma < sigma_max`` (FlowPolicy's, in ``[-1, 1]``
    units). ``seed`` fixes the added layers' initial weights, the LoRA initialisation and the
    sampling stream.
    """

    SAVED_OPTIONS = ("denoise_steps", "predict", "expert_width", "expert_layers", "expert_heads", "sigma_min",
                     "sigma_max", "init_sigma")

    def __init__(self, model: nn.Module, tokenizer: Any, *, action_low, action_high, denoise_steps: int = 4,
                 predict: str = "action", expert_width: int = 128, expert_layers: int = 2, expert_heads: int = 4,
                 sigma_min: float = 0.01, sigma_max: float = 1.0, init_sigma: float = 0.5, **backbone: Any):
        """``backbone``: :class:`~ebrl.policies.hf_backbone.HFBackbonePolicy`'s keywords
        (``obs_layout``, ``instruction``, ``lora_rank``, ``value_head``, ``seed``, ...)."""
        low, high = action_bounds(action_low, action_high, "HFFlowPolicy")
        if not (np.isfinite(low).all() and np.isfinite(high).all() and (high > low).all()):
            raise ValueError("HFFlowPolicy needs finite action bounds with high > low (the flow lives in "
                             f"[-1, 1] and is mapped onto them), got low={low.tolist()}, high={high.tolist()}")
        chain = FlowChain(denoise_steps, chunk_2d(low.shape), predict=predict)
        sigma = SigmoidSigma(sigma_min, init_sigma, sigma_max)
        if expert_layers < 1 or expert_heads < 1 or expert_width % expert_heads or expert_width % 2:
            raise ValueError(f"expert_width={expert_width} must be even (sin and cos pairs) and a multiple of "
                             f"expert_heads={expert_heads}, and expert_layers={expert_layers} >= 1")
        super().__init__(model, tokenizer, action_low=low, action_high=high, **backbone)
        self.chunk_shape = self.action_shape
        self.chunk_len, self.action_dim = chain.shape
        self.chunk_dim = self.chunk_len * self.action_dim
        self.chain = chain
        self.sigma = sigma
        self.action_low, self.action_high = low, high
        self.config.update({"denoise_steps": denoise_steps, "predict": predict, "expert_width": int(expert_width),
                            "expert_layers": int(expert_layers), "expert_heads": int(expert_heads),
                            "sigma_min": sigma.sigma_min, "sigma_max": sigma.sigma_max, "init_sigma": sigma.init_sigma})

        # the expert's initial weights from the seed, without touching torch's global generator
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.expert = ActionExpert(self.action_dim, self.chunk_len, self.hidden, expert_width, expert_layers,
                                       expert_heads)
            self.action_head = nn.Linear(expert_width, self.action_dim)
            # separate from the action head, as in Flow-Noise: RL can grow or shrink exploration
            # per state and step, and behaviour cloning never trains it
            self.noise_head = nn.Sequential(nn.Linear(expert_width, expert_width), nn.SiLU(),
                                            nn.Linear(expert_width, self.action_dim))
        with torch.no_grad():
            self.action_head.weight.mul_(0.01)  # x1_hat starts near 0, the Box's centre
            self.action_head.bias.zero_()
            self.noise_head[-1].weight.mul_(0.01)
        sigma.init_bias(self.noise_head[-1].bias)

    # ---- building ----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, observation_space, action_space, *, lora_rank: int | None = None,
                        lora_alpha: float | None = None, lora_targets: Sequence[str] | None = None,
                        instruction: str | Sequence[str] | None = None, prompt: str | None = None,
                        denoise_steps: int = 4, expert_width: int = 128, expert_layers: int = 2,
                        init_sigma: float = 0.5, dtype: str | torch.dtype = "auto", seed: int = 0,
                        gradient_checkpointing: bool = False, image_keys: Sequence[str] | None = None,
                        state_keys: Sequence[str] | None = None, **kw) -> HFFlowPolicy:
        """Load the model in the local directory ``path`` and build the policy for these gymnasium
        spaces: any observation :mod:`ebrl.policies.encoders` reads (``image_keys``/``state_keys``
        choose the entries; with a list of instructions, the Discrete ``instruction`` entry picks
        one per row); a Box action space with finite bounds, ``(K, A)`` (an
        :class:`~ebrl.envs.chunks.ActionChunk`) or ``(A,)`` (K = 1). Further keywords go to the
        constructor (``predict``, ``expert_heads``, ``sigma_min``, ``sigma_max``, ``value_head``,
        ``state_tokens``, ``camera_grid``, ``autocast_bf16``, ...)."""
        from gymnasium import spaces

        if isinstance(action_space, spaces.Box) and not (np.isfinite(action_space.low).all()
                                                         and np.isfinite(action_space.high).all()):
            raise ValueError(f"HFFlowPolicy needs finite action bounds (actions are mapped from [-1, 1] onto "
                             f"them), got {action_space!r}")
        return cls._load_for_spaces(path, observation_space, action_space, instruction=instruction,
                                    image_keys=image_keys, state_keys=state_keys, prompt=prompt, lora_rank=lora_rank,
                                    lora_alpha=lora_alpha, lora_targets=lora_targets, denoise_steps=denoise_steps,
                                    expert_width=expert_width, expert_layers=expert_layers, init_sigma=init_sigma,
                                    dtype=dtype, seed=seed, gradient_checkpointing=gradient_checkpointing, **kw)

    # ---- the flow ------------------------------------------------------------------------------

    def _read_prefix(self, obs: Any) -> tuple[Tensor, Tensor, Tensor]:
        """The backbone's one pass over the prefix: ``(memory [N, P, width], padding [N, P],
        last [N, hidden])``, the expert's keys and values, where the prefix is padding, and the
        hidden state at the last position (the value head's input)."""
        embeds, mask, positions = self._prefix(obs)
        h, _ = self._hidden(embeds, mask, positions)
        padding = mask == 0
        # masked out of the cross-attention, and zeroed too: a padded query's hidden state is
        # whatever the attention kernel gives a row with nothing to attend to (NaN in some)
        memory = self.expert.memory(h.masked_fill(padding[..., None], 0.0))
        return memory, padding, h[:, -1]

    def _velocity(self, memory: Tensor, padding: Tensor) -> Velocity:
        """The chain's velocity on a prefix (:meth:`_read_prefix`): the expert's action head and
        noise head at ``S`` flow states per row, in one pass of the expert, float32."""

        def velocity(x: Tensor, tau: Tensor) -> tuple[Tensor, Tensor]:
            features = self.expert(x.float(), tau.float(), memory, padding)
            sigma = self.sigma(self.noise_head(features))
            return self.action_head(features), sigma

        return velocity

    # ---- acting (runtime) ----------------------------------------------------------------------

    @torch.no_grad()
    def act(self, obs: Any) -> ActResult:
        """Sample chains for ``obs [B, ...]`` (numpy, or a dict of numpy arrays); numpy out.

        ``actions`` is the chain ``[B, N + 1, K * A]`` (float32) the log-prob refers to;
        ``env_actions`` is ``x_N`` as a ``[B, *chunk_shape]`` chunk inside the Box.
        """
        memory, padding, last = self._read_prefix(obs)
        states, logp = self.chain.sample(self._velocity(memory, padding), memory.shape[0],
                                         self._generator(memory.device), device=memory.device, dtype=memory.dtype,
                                         deterministic=self.deterministic)
        actions = states.cpu().numpy()
        return ActResult(actions=actions, env_actions=self.to_env(actions[:, -1]), logprobs=logp.cpu().numpy(),
                         values=self._head_values(last).cpu().numpy())

    # ---- training (algorithm) ------------------------------------------------------------------

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [M], entropy [M], value [M])`` of stored chains ``actions [M, N + 1, K * A]``.

        One backbone pass over the prefixes, then one expert pass over all ``M * N`` transitions.
        The entropy is the chain's: ``N(0, I)``'s (a constant) plus every step's diagonal
        Gaussian's, given the stored states.
        """
        memory, padding, last = self._read_prefix(obs)
        states = torch.as_tensor(actions, device=memory.device).float()
        logp, entropy = self.chain.score(self._velocity(memory, padding), states)
        return logp, entropy, self._head_values(last)

    def flow_matching_loss(self, obs: Any, chunks: Any, generator: torch.Generator | None = None) -> Tensor:
        """Rectified-flow behaviour cloning on demonstration chunks ``[B, *chunk_shape]`` (env space).

        With ``x_tau = (1 - tau) * noise + tau * target`` (``tau ~ U(0, 1)``, targets normalised
        to ``[-1, 1]``), regress the expert's ``x1_hat(x_tau, tau, obs)`` onto ``target``
        (``predict="action"``), or its velocity onto ``target - noise``. Trains the backbone (its
        adapters under LoRA), the prefix's projections, the expert and the action head; not the
        noise head, which is for RL. Call :meth:`update_obs_stats` on the demonstrations first when
        normalising.
        """
        memory, padding, _ = self._read_prefix(obs)
        target = self.normalize_actions(as_tensor(chunks, memory.device).float())
        return self.chain.flow_matching_loss(self._velocity(memory, padding), target.reshape(-1, *self.chain.shape),
                                             generator or self._generator(memory.device))


__all__ = ["HFFlowPolicy"]
