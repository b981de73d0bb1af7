"""A token policy in the style of OpenVLA: a small transformer that emits each action dimension
as a discrete token, autoregressively.

OpenVLA's scheme: every action dimension is discretised into 256 uniform bins between its bounds,
and a causal language model predicts the bin tokens one dimension at a time after the prompt
(the image and instruction tokens); detokenising maps each token back to its bin centre.

Here the "prompt" is a few prefix tokens built from the observation: a normalised ``state``
vector (one or a few linear tokens), ``pixels`` (a small conv patchifier, a handful of tokens)
and an ``instruction`` embedding the env precomputes (one linear token; there is no tokenizer
and nothing is ever downloaded). The transformer reads ``[prefix, BOS, a_1 .. a_{D-1}]``; the
output before dimension ``j`` gives its logits, and the BOS output also feeds the value head.
The prefix attends to itself both ways (a prefix-LM, as PaliGemma); everything after it is
causal. ``act`` samples with an explicit KV cache: one pass over prefix + BOS (which gives the
first token's logits), then one single-position step per further token, batched over B.
``evaluate`` is a single teacher-forced pass.

The tokens are OpenVLA's 256 bins, but by default the head does not give each bin a free logit:
it predicts the coefficients of 32 cosines over the bins, damped as ``1 / k^2`` (``bin_basis``,
see :meth:`TokenPolicy.bin_logits`), and a token's input embedding reads the same cosines. A
policy learning by RL from scratch then moves probability between nearby bins together. On
FetchReachDense-v4 (PPO, 100 s) success_once reached 0.2 with free logits, 0.4 with undamped
cosines and 0.57 with damped ones. ``bin_basis=0`` restores one free logit and embedding per bin,
as a pretrained VLA's language-model head has.

Example::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies.token import TokenPolicy
    >>> policy = TokenPolicy.from_spaces(gym.spaces.Box(-1.0, 1.0, (3,)), gym.spaces.Box(-2.0, 2.0, (2,)),
    ...                                  d_model=32, layers=1, seed=0)
    >>> out = policy.act(np.zeros((4, 3), np.float32))
    >>> out.actions.dtype, out.actions.shape, out.logprobs.shape
    (dtype('int64'), (4, 2), (4,))
    >>> bool(np.all(out.env_actions == policy.detokenize(out.actions)))  # bin centres
    True
    >>> policy.tokenize(np.array([-2.0, 2.0])).tolist()  # the bounds land in the end bins
    [0, 255]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult
from ebrl.policies.expects import ActionSpec, DType, ObsSpec, PolicySpaces
from ebrl.policies.heads import merge_moments, register_moments
from ebrl.policies.mlp import _EPS, _OBS_CLIP
from ebrl.policies.pretrained import Pretrained

OBS_KEYS = ("pixels", "state", "instruction")

KVCache = list[tuple[Tensor, Tensor]]  # per layer: keys and values [B, heads, max_len, head_dim]


class _SelfAttention(nn.Module):
    """Multi-head attention written out, so that :meth:`forward` can read and extend a KV cache."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, mask: Tensor, cache: tuple[Tensor, Tensor] | None, start: int) -> Tensor:
        """``x [B, L, d]`` at absolute positions ``start .. start+L-1``; ``mask [L, start+L]`` says
        which keys each query may see. With a cache the new keys/values are written into it and
        the queries attend to every cached position before theirs as well."""
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is not None:
            cache_k, cache_v = cache
            cache_k[:, :, start:start + n] = k
            cache_v[:, :, start:start + n] = v
            k, v = cache_k[:, :, :start + n], cache_v[:, :, :start + n]
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, d))


class _Block(nn.Module):
    """A pre-LayerNorm transformer block (GPT-2 style)."""

    def __init__(self, d_model: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = _SelfAttention(d_model, heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x: Tensor, mask: Tensor, cache: tuple[Tensor, Tensor] | None, start: int) -> Tensor:
        x = x + self.attn(self.norm1(x), mask, cache, start)
        return x + self.mlp(self.norm2(x))


class TokenPolicy(Pretrained, nn.Module):
    """Autoregressive action tokens over a prefix built from ``state``/``pixels``/``instruction``.

    ``action_low``/``action_high`` give the action shape (``(A,)`` or a chunk ``(K, A)``, whose
    ``K*A`` tokens are emitted in row-major order) and the finite bounds of the ``bins`` uniform
    bins per dimension. ``dict_obs=False`` reads a flat Box observation as the state; otherwise
    observations are dicts with the keys whose sizes are given (``state_dim``, ``pixels_shape``
    ``(H, W, C)`` uint8, ``instruction_dim``). The state becomes ``state_tokens`` tokens, the
    pixels ``pixel_grid**2`` tokens, the instruction one. ``seed`` fixes the initial weights and
    the sampling stream: two policies built alike act identically on identical inputs.
    """

    CONFIG_BEFORE_KEY = {"bin_basis": 0}  # weights saved before the bin basis had a free logit per bin

    def __init__(self, action_low, action_high, *, state_dim: int = 0, pixels_shape: Sequence[int] | None = None,
                 instruction_dim: int = 0, dict_obs: bool = False, d_model: int = 128, layers: int = 4,
                 heads: int = 4, mlp_ratio: int = 4, bins: int = 256, state_tokens: int = 1,
                 pixel_grid: int = 2, bin_basis: int = 32, normalize_obs: bool = True, seed: int = 0):
        super().__init__()
        low, high = np.asarray(action_low, np.float32), np.asarray(action_high, np.float32)
        if low.shape != high.shape or low.ndim not in (1, 2) or low.size == 0:
            raise ValueError(f"action_low/action_high must share a shape (A,) or (K, A), got {low.shape} and {high.shape}")
        if not (np.isfinite(low).all() and np.isfinite(high).all()) or (high < low).any():
            raise ValueError("TokenPolicy needs finite action bounds with low <= high "
                             f"(it bins [low, high]), got low={low.tolist()}, high={high.tolist()}")
        if d_model % heads:
            raise ValueError(f"d_model={d_model} must be divisible by heads={heads}")
        if bins < 2:
            raise ValueError(f"bins={bins} must be at least 2")
        if not 0 <= bin_basis <= bins:
            raise ValueError(f"bin_basis={bin_basis} must lie in [0, bins={bins}] (0: one free logit per bin)")
        if pixels_shape is not None and len(pixels_shape) != 3:
            raise ValueError(f"pixels_shape must be (H, W, C), got {tuple(pixels_shape)}")
        if not dict_obs and (pixels_shape is not None or instruction_dim):
            raise ValueError("pixels and instruction inputs need dict observations (dict_obs=True)")
        # constructor arguments, JSON-ready: save_pretrained writes them, from_pretrained reads them
        self.config: dict[str, Any] = {
            "action_low": low.tolist(), "action_high": high.tolist(), "state_dim": int(state_dim),
            "pixels_shape": None if pixels_shape is None else [int(s) for s in pixels_shape],
            "instruction_dim": int(instruction_dim), "dict_obs": bool(dict_obs), "d_model": int(d_model),
            "layers": int(layers), "heads": int(heads), "mlp_ratio": int(mlp_ratio), "bins": int(bins),
            "state_tokens": int(state_tokens), "pixel_grid": int(pixel_grid), "bin_basis": int(bin_basis),
            "normalize_obs": bool(normalize_obs), "seed": int(seed)}
        self.action_shape = tuple(low.shape)
        self.num_tokens = low.size  # D: tokens per action
        self.bins, self.seed, self.dict_obs = int(bins), int(seed), bool(dict_obs)
        self.state_dim, self.instruction_dim = int(state_dim), int(instruction_dim)
        self.pixels_shape = None if pixels_shape is None else tuple(int(s) for s in pixels_shape)
        self.state_tokens, self.pixel_grid = int(state_tokens), int(pixel_grid)
        self.normalize_obs = bool(normalize_obs) and self.state_dim > 0
        self.d_model = int(d_model)

        # tokenisation constants travel with .to(device) but stay out of state_dict (they are config)
        self.register_buffer("bin_low", torch.from_numpy(low.reshape(-1).copy()), persistent=False)
        self.register_buffer("bin_width", torch.from_numpy((high - low).reshape(-1) / bins), persistent=False)

        num_prefix = 0
        if self.state_dim:
            self.state_proj = nn.Linear(self.state_dim, self.state_tokens * d_model)
            num_prefix += self.state_tokens
        if self.pixels_shape is not None:
            channels = self.pixels_shape[2]
            # two stride-2 convs, then average-pooled to a grid: any image size gives grid**2 tokens
            self.patchify = nn.Sequential(nn.Conv2d(channels, 32, 3, 2, padding=1), nn.GELU(),
                                          nn.Conv2d(32, 64, 3, 2, padding=1), nn.GELU(),
                                          nn.AdaptiveAvgPool2d(self.pixel_grid))
            self.pixel_proj = nn.Linear(64, d_model)
            num_prefix += self.pixel_grid**2
        if self.instruction_dim:
            self.instruction_proj = nn.Linear(self.instruction_dim, d_model)
            num_prefix += 1
        if num_prefix == 0:
            raise ValueError("TokenPolicy needs at least one input: state_dim, pixels_shape or instruction_dim")
        self.num_prefix = num_prefix  # P
        self.prefix_pos = nn.Parameter(torch.zeros(num_prefix, d_model))
        self.bos = nn.Parameter(torch.zeros(d_model))
        self.action_pos = nn.Parameter(torch.zeros(self.num_tokens, d_model))  # input position j predicts dim j
        self.blocks = nn.ModuleList(_Block(d_model, heads, mlp_ratio) for _ in range(layers))
        self.final_norm = nn.LayerNorm(d_model)
        if bin_basis:
            # logits are a smooth function of the bin's place in [low, high]: the head predicts the
            # coefficients of the lowest cosine frequencies over the bins, damped (why: see bin_logits)
            place = (torch.arange(bins, dtype=torch.float32) + 0.5) / bins
            freq = torch.arange(1, bin_basis + 1, dtype=torch.float32)[:, None]
            basis = torch.cos(math.pi * freq * place) / freq.square()
            self.register_buffer("bin_basis_matrix", basis, persistent=False)  # [bin_basis, bins]
            self.token_head = nn.Linear(d_model, bin_basis)
            self.token_embed = nn.Linear(bin_basis, d_model, bias=False)  # a token's input: its bin's cosines
        else:
            self.bin_basis_matrix = None
            self.token_head = nn.Linear(d_model, bins)
            self.token_embed = nn.Embedding(bins, d_model)
        self.value_head = nn.Linear(d_model, 1)
        if self.normalize_obs:
            register_moments(self, self.state_dim)

        # causal after the prefix, bidirectional within it; sliced for every pass
        pos = torch.arange(num_prefix + self.num_tokens)
        self.register_buffer("attn_mask", (pos[None, :] <= pos[:, None]) | (pos[None, :] < num_prefix),
                             persistent=False)
        self._init_weights(torch.Generator().manual_seed(self.seed))
        self._gen = torch.Generator().manual_seed(self.seed)  # not a buffer: never in state_dict

    def _init_weights(self, gen: torch.Generator) -> None:
        """GPT-2 initialisation from ``gen`` (so weights depend on ``seed`` only). The token head
        starts at zero: the first policy is uniform over the bins, i.e. uniform over the Box."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.02, generator=gen)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu", generator=gen)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02, generator=gen)
        for block in self.blocks:  # residual projections scaled down with depth
            for proj in (block.attn.out, block.mlp[2]):
                nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * len(self.blocks)), generator=gen)
        for param in (self.prefix_pos, self.bos, self.action_pos):
            nn.init.normal_(param, 0.0, 0.02, generator=gen)
        nn.init.zeros_(self.token_head.weight)

    @classmethod
    def from_spaces(cls, observation_space, action_space, **kw) -> TokenPolicy:
        """Build from gymnasium spaces: a Box observation (the state) or a Dict of ``"pixels"``
        (uint8 ``[H, W, C]``), ``"state"`` and ``"instruction"`` Boxes; a Box action space with
        finite bounds, ``(A,)`` or ``(K, A)``."""
        from gymnasium import spaces

        if not (isinstance(action_space, spaces.Box) and len(action_space.shape) in (1, 2)
                and np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
            raise ValueError(f"TokenPolicy needs a Box action space of shape (A,) or (K, A) with finite bounds "
                             f"(its tokens are bins of [low, high]), got {action_space!r}")
        if isinstance(observation_space, spaces.Box):
            return cls(action_space.low, action_space.high, state_dim=math.prod(observation_space.shape), **kw)
        if not isinstance(observation_space, spaces.Dict):
            raise ValueError(f"TokenPolicy needs a Box or Dict observation space, got {observation_space!r}")  # noqa: TRY004
        entries = observation_space.spaces
        extra = set(entries) - set(OBS_KEYS)
        if extra or not entries:
            raise ValueError(f"TokenPolicy reads {list(OBS_KEYS)} from a Dict observation space; "
                             f"got keys {sorted(entries)}")
        for key, space in entries.items():
            if not isinstance(space, spaces.Box):
                raise ValueError(f"TokenPolicy needs observation {key!r} to be a Box, got {space!r}")  # noqa: TRY004
        pixels = entries.get("pixels")
        if pixels is not None and (len(pixels.shape) != 3 or pixels.dtype != np.uint8):
            raise ValueError(f"TokenPolicy needs 'pixels' as a uint8 Box (H, W, C), got {pixels!r}")
        return cls(action_space.low, action_space.high, dict_obs=True,
                   state_dim=math.prod(entries["state"].shape) if "state" in entries else 0,
                   pixels_shape=None if pixels is None else tuple(pixels.shape),
                   instruction_dim=math.prod(entries["instruction"].shape) if "instruction" in entries else 0,
                   **kw)

    # ---- tokenisation ----------------------------------------------------------------------

    def tokenize(self, actions: np.ndarray) -> np.ndarray:
        """Bin ids (int64, same shape) of continuous ``actions [..., *action_shape]``, clipped to the bounds."""
        low = self.bin_low.cpu().numpy().reshape(self.action_shape)
        width = self.bin_width.cpu().numpy().reshape(self.action_shape)
        scaled = (np.asarray(actions, np.float64) - low) / np.where(width > 0, width, 1.0)
        return np.clip(np.floor(scaled), 0, self.bins - 1).astype(np.int64)

    def detokenize(self, tokens: np.ndarray) -> np.ndarray:
        """Bin centres (float32) of token ids ``[..., *action_shape]``."""
        low = self.bin_low.cpu().numpy().reshape(self.action_shape)
        width = self.bin_width.cpu().numpy().reshape(self.action_shape)
        return (low + (np.asarray(tokens) + 0.5) * width).astype(np.float32)

    def _token_ids(self, actions: Tensor) -> Tensor:
        """``[N, D]`` int64 ids from ``[N, *action_shape]`` ids (integer or float holding integers)."""
        ids = torch.as_tensor(actions, device=self.bos.device)
        ids = (ids if not ids.is_floating_point() else ids.round()).long().reshape(-1, self.num_tokens)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.bins):
            raise ValueError(f"action token ids must lie in [0, {self.bins}), got [{int(ids.min())}, {int(ids.max())}]")
        return ids

    def expected_spaces(self) -> PolicySpaces:
        """What this policy was built for (``ebrl.run`` checks env 0's spaces against it): a Box
        of ``state_dim`` elements, or with ``dict_obs`` the Dict entries it has inputs for
        (uint8 ``pixels`` of ``pixels_shape``); Box actions of ``action_shape``, ``(A,)`` or
        ``(K, A)``."""
        if not self.dict_obs:
            obs = [ObsSpec(size=self.state_dim)]
        else:
            obs = [ObsSpec(keys=("state",), size=self.state_dim)] if self.state_dim else []
            if self.pixels_shape is not None:
                obs.append(ObsSpec(keys=("pixels",), shape=self.pixels_shape, dtype=DType.UINT8))
            if self.instruction_dim:
                obs.append(ObsSpec(keys=("instruction",), size=self.instruction_dim))
        return PolicySpaces(tuple(obs), ActionSpec(shape=self.action_shape))

    # ---- observations ----------------------------------------------------------------------

    def _obs_dict(self, obs: Any) -> dict[str, Tensor]:
        """Tensors on the policy's device, keyed as a dict observation (a flat Box is the state)."""
        if not self.dict_obs:
            obs = {"state": obs}
        out = {}
        for key in OBS_KEYS:
            if key in obs:
                value = obs[key]
                if isinstance(value, np.ndarray):
                    value = np.ascontiguousarray(value)
                    value = torch.from_numpy(value if value.flags.writeable else value.copy())
                out[key] = torch.as_tensor(value).to(self.bos.device, non_blocking=True)
        return out

    @torch.no_grad()
    def update_obs_stats(self, obs: Any) -> None:
        """Merge a batch of states (``obs``, or ``obs["state"]`` for dicts) into the running mean/var."""
        if not self.normalize_obs:
            return
        state = obs["state"] if self.dict_obs else obs
        merge_moments(self.obs_mean, self.obs_var, self.obs_count,
                      torch.as_tensor(state, device=self.obs_mean.device).reshape(-1, self.state_dim))

    def _prefix(self, obs: dict[str, Tensor]) -> Tensor:
        """``[N, P, d]`` prefix tokens: state, then pixel patches, then the instruction."""
        dtype = self.bos.dtype
        tokens = []
        if self.state_dim:
            state = obs["state"].reshape(-1, self.state_dim).to(dtype)
            if self.normalize_obs:
                state = ((state - self.obs_mean) / torch.sqrt(self.obs_var + _EPS)).clamp(-_OBS_CLIP, _OBS_CLIP)
            tokens.append(self.state_proj(state).view(-1, self.state_tokens, self.d_model))
        if self.pixels_shape is not None:
            pixels = obs["pixels"].reshape(-1, *self.pixels_shape).permute(0, 3, 1, 2).to(dtype) * (1.0 / 255.0)
            tokens.append(self.pixel_proj(self.patchify(pixels).flatten(2).transpose(1, 2)))
        if self.instruction_dim:
            tokens.append(self.instruction_proj(obs["instruction"].reshape(-1, self.instruction_dim).to(dtype))[:, None])
        return torch.cat(tokens, 1) + self.prefix_pos

    # ---- the transformer ---------------------------------------------------------------------

    def _transform(self, x: Tensor, start: int = 0, cache: KVCache | None = None) -> Tensor:
        """Run the blocks on ``x [B, L, d]`` at absolute positions ``start..start+L-1`` (earlier
        positions must be in ``cache``); returns final-normed outputs ``[B, L, d]``."""
        mask = self.attn_mask[start:start + x.shape[1], :start + x.shape[1]]
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None if cache is None else cache[i], start)
        return self.final_norm(x)

    def _prefix_and_bos(self, obs: Any) -> Tensor:
        """``[N, P + 1, d]``: the prefix tokens and BOS (at the position predicting dimension 0)."""
        prefix = self._prefix(self._obs_dict(obs))
        bos = (self.bos + self.action_pos[0]).expand(prefix.shape[0], 1, -1)
        return torch.cat([prefix, bos], 1)

    def token_logits(self, obs: Any, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher-forced logits ``[N, D, bins]`` of every action dimension given the earlier
        ``tokens [N, *action_shape]``, and values ``[N]``: one full pass, with gradients."""
        return self._logits(obs, self._token_ids(tokens))

    def _logits(self, obs: Any, ids: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`token_logits` on checked ids ``[N, D]``."""
        inputs = self._prefix_and_bos(obs)
        if self.num_tokens > 1:
            inputs = torch.cat([inputs, self.embed_tokens(ids[:, :-1]) + self.action_pos[1:]], 1)
        h = self._transform(inputs)[:, self.num_prefix:]  # from BOS on: the output before each dimension
        return self.bin_logits(h), self.value_head(h[:, 0]).squeeze(-1)

    def bin_logits(self, h: Tensor) -> Tensor:
        """Logits ``[..., bins]`` over one dimension's bins from the transformer output ``h [..., d]``.

        With ``bin_basis = m > 0`` (the default, 32) the logits are ``c(h) @ B``, where row ``k``
        of ``B`` is ``cos(pi k u) / k^2`` over the bins' places ``u`` in ``(0, 1)``, ``k = 1..m``.
        The logit is then a smooth function of the bin's value, so a gradient step that raises a
        sampled bin's probability raises its neighbours' as well (a smooth tilt towards it). The
        damping keeps Adam, which steps every coefficient alike, from making the logits rough.
        RL from scratch needs this: with one free logit per bin (``bin_basis=0``, the
        language-model head OpenVLA fine-tunes) each of the 256 bins is sampled a few times per
        update and the policy stays near uniform for tens of updates. The input embedding of a
        token (:meth:`embed_tokens`) reads the same cosines. The tokens stay 256 bins.
        """
        out = self.token_head(h)
        return out if self.bin_basis_matrix is None else out @ self.bin_basis_matrix

    def embed_tokens(self, ids: Tensor) -> Tensor:
        """Input embeddings ``[..., d]`` of token ids: with a bin basis, a linear map of the bin's
        cosines, so that nearby bins condition the later dimensions alike."""
        if self.bin_basis_matrix is None:
            return self.token_embed(ids)
        return self.token_embed(self.bin_basis_matrix.T[ids])

    @torch.no_grad()
    def decode(self, obs: Any, tokens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The KV-cache decoder behind :meth:`act`: ``(tokens [B, D], logits [B, D, bins], values [B])``.

        One pass over prefix + BOS fills the cache; then each further token is one
        single-position step. Tokens are sampled from the policy's generator, or, when
        ``tokens`` is given, teacher-forced (the logits then equal :meth:`token_logits`').
        """
        forced = None if tokens is None else self._token_ids(tokens)
        inputs = self._prefix_and_bos(obs)
        batch, device = inputs.shape[0], inputs.device
        if self._gen.device != device:  # moved to another device: restart the stream there
            self._gen = torch.Generator(device).manual_seed(self.seed)
        first = self.blocks[0].attn
        shape = (batch, first.heads, self.num_prefix + self.num_tokens, first.head_dim)
        cache = [(inputs.new_empty(shape), inputs.new_empty(shape)) for _ in self.blocks]
        h = self._transform(inputs, 0, cache)[:, -1]
        values = self.value_head(h).squeeze(-1)
        chosen, all_logits = [], []
        for j in range(self.num_tokens):
            logits = self.bin_logits(h)
            all_logits.append(logits)
            if forced is None:
                token = torch.multinomial(logits.softmax(-1), 1, generator=self._gen).squeeze(-1)
            else:
                token = forced[:, j]
            chosen.append(token)
            if j + 1 < self.num_tokens:
                step = (self.embed_tokens(token) + self.action_pos[j + 1])[:, None]
                h = self._transform(step, self.num_prefix + 1 + j, cache)[:, -1]
        return torch.stack(chosen, 1), torch.stack(all_logits, 1), values

    # ---- acting (runtime) --------------------------------------------------------------------

    @torch.no_grad()
    def act(self, obs: Any) -> ActResult:
        """Sample token ids for ``obs [B, ...]`` (numpy, or a dict of numpy arrays); numpy out.

        ``actions`` are the ids ``[B, *action_shape]`` (what the log-probs refer to),
        ``env_actions`` their bin centres.
        """
        tokens, logits, values = self.decode(obs)
        logp = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1).sum(-1)
        ids = tokens.reshape(-1, *self.action_shape).cpu().numpy()
        return ActResult(actions=ids, env_actions=self.detokenize(ids),
                         logprobs=logp.float().cpu().numpy(), values=values.float().cpu().numpy())

    # ---- training (algorithm) ----------------------------------------------------------------

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [N], entropy [N], value [N])`` of token ids ``actions [N, *action_shape]``.

        The log-prob is the sum over dimensions of the teacher-forced token log-probs; the
        entropy is the sum of each dimension's conditional entropy given the earlier tokens of
        ``actions`` (in expectation over the policy's own tokens, the joint entropy).
        """
        ids = self._token_ids(actions)
        logits, value = self._logits(obs, ids)
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(-1, ids[..., None]).squeeze(-1).sum(-1)
        entropy = -(logp_all.exp() * logp_all).sum((-1, -2))
        return logp, entropy, value

    def value(self, obs: Any) -> Tensor:
        """State values ``[N]``, with gradients: a pass over the prefix and BOS only."""
        return self.value_head(self._transform(self._prefix_and_bos(obs))[:, -1]).squeeze(-1)
