"""A token policy in the style of OpenVLA: a small transformer that emits each action dimension
as a discrete token, autoregressively.

OpenVLA's scheme: every action dimension is discretised into 256 uniform bins between its bounds,
and a causal language model predicts the bin tokens one dimension at a time after the prompt
(the image and instruction tokens); detokenising maps each token back to its bin centre.

Here the "prompt" is a few prefix tokens built from the observation, read by
:class:`~ebrl.policies.encoders.ObsEncoder` whatever its entries are called: the vector entries,
normalised and joined (one or a few linear tokens), each camera (a small conv patchifier, a
handful of tokens per camera) and an ``instruction`` embedding the env precomputes (a Box entry
of that name: one linear token; there is no tokenizer and nothing is ever downloaded). The
transformer reads ``[prefix, BOS, a_1 .. a_{D-1}]``; the output before dimension ``j`` gives its
logits, and the BOS output also feeds the value head. The prefix attends to itself both ways (a
prefix-LM, as PaliGemma); everything after it is causal. ``act`` samples with an explicit KV
cache: one pass over prefix + BOS (which gives the first token's logits), then one
single-position step per further token, batched over B. ``evaluate`` is a single teacher-forced
pass.

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

from ebrl.policies.base import ActResult, SeededSampling
from ebrl.policies.encoders import (
    ObsEncoder,
    ObsEntry,
    ObsLayout,
    Read,
    ReadsObservations,
    as_tensor,
    lookup,
)
from ebrl.policies.expects import ActionSpec, ObsSpec, PolicySpaces
from ebrl.policies.pretrained import Pretrained

INSTRUCTION_KEY = "instruction"  # a Box entry of this name is one token of its own, not normalised

KVCache = list[tuple[Tensor, Tensor]]  # per layer: keys and values [B, heads, max_len, head_dim]



def choose_token(logits: Tensor, forced: Tensor | None, j: int, deterministic: bool, gen: torch.Generator) -> Tensor:
    """Decoding step ``j``'s token ``[B]`` from its ``logits [B, bins]``: the forced one (``forced
    [B, D]``, teacher forcing), the mode, or a draw from ``gen``."""
    if forced is not None:
        return forced[:, j]
    if deterministic:
        return logits.argmax(-1)
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)


def forced_logp_entropy(logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(logp [N], entropy [N])`` of tokens ``ids [N, D]`` under teacher-forced ``logits [N, D,
    bins]``: the sums over the ``D`` tokens of their log-probs and conditional entropies."""
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, ids[..., None]).squeeze(-1).sum(-1)
    return logp, -(logp_all.exp() * logp_all).sum((-1, -2))

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


class _Patchify(nn.Module):
    """One camera's tokens: two stride-2 convs, average-pooled to a ``grid x grid`` grid (any
    image size gives ``grid**2`` tokens), each cell projected to ``d_model``."""

    def __init__(self, channels: int, grid: int, d_model: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(channels, 32, 3, 2, padding=1), nn.GELU(),
                                  nn.Conv2d(32, 64, 3, 2, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(grid))
        self.proj = nn.Linear(64, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """``[N, C, H, W] -> [N, grid**2, d_model]``."""
        return self.proj(self.conv(x).flatten(2).transpose(1, 2))


class TokenPolicy(ReadsObservations, SeededSampling, Pretrained, nn.Module):
    """Autoregressive action tokens over a prefix built from the observation's vectors, cameras and instruction.

    ``action_low``/``action_high`` give the action shape (``(A,)`` or a chunk ``(K, A)``, whose
    ``K*A`` tokens are emitted in row-major order) and the finite bounds of the ``bins`` uniform
    bins per dimension. ``obs_layout`` (an :class:`~ebrl.policies.encoders.ObsLayout`, which
    ``from_spaces`` builds) says which entries are read; without it ``dict_obs=False`` reads a
    flat Box observation as the state and ``dict_obs=True`` dicts of ``state`` (``state_dim``) and
    ``pixels`` (``pixels_shape`` ``(H, W, C)`` uint8).
    ``instruction_dim`` is the size of an ``instruction`` entry. The vectors become
    ``state_tokens`` tokens, each camera ``pixel_grid**2`` tokens, the instruction one. ``seed``
    fixes the initial weights and the sampling stream: two policies built alike act identically
    on identical inputs.
    """

    def __init__(self, action_low, action_high, *, obs_layout: ObsLayout | Sequence[dict[str, Any]] | None = None,
                 state_dim: int = 0, pixels_shape: Sequence[int] | None = None,
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
        if obs_layout is not None:
            if state_dim or pixels_shape is not None or dict_obs:
                raise ValueError("give obs_layout, or state_dim/pixels_shape/dict_obs , not both")
            layout = ObsLayout.from_config(obs_layout)
        else:
            if pixels_shape is not None and len(pixels_shape) != 3:
                raise ValueError(f"pixels_shape must be (H, W, C), got {tuple(pixels_shape)}")
            if not dict_obs and (pixels_shape is not None or instruction_dim):
                raise ValueError("pixels and instruction inputs need dict observations (dict_obs=True)")
            layout = _plain_layout(int(state_dim), pixels_shape, bool(dict_obs))
        if instruction_dim and any(not e.path for e in layout.entries):
            raise ValueError("an instruction input needs dict observations (an 'instruction' entry)")
        # constructor arguments, JSON-ready: save_pretrained writes them, from_pretrained reads them
        self.config: dict[str, Any] = {
            "action_low": low.tolist(), "action_high": high.tolist(), "obs_layout": layout.to_config(),
            "instruction_dim": int(instruction_dim), "d_model": int(d_model),
            "layers": int(layers), "heads": int(heads), "mlp_ratio": int(mlp_ratio), "bins": int(bins),
            "state_tokens": int(state_tokens), "pixel_grid": int(pixel_grid), "bin_basis": int(bin_basis),
            "normalize_obs": bool(normalize_obs), "seed": int(seed)}
        self.action_shape = tuple(low.shape)
        self.num_tokens = low.size  # D: tokens per action
        self.bins, self.seed = int(bins), int(seed)
        self.state_dim, self.instruction_dim = layout.flat_dim, int(instruction_dim)
        self.state_tokens, self.pixel_grid = int(state_tokens), int(pixel_grid)
        self.d_model = int(d_model)

        # tokenisation constants travel with .to(device) but stay out of state_dict (they are config)
        self.register_buffer("bin_low", torch.from_numpy(low.reshape(-1).copy()), persistent=False)
        self.register_buffer("bin_width", torch.from_numpy((high - low).reshape(-1) / bins), persistent=False)

        # registered in this order (vectors, cameras, instruction), which is the order _init_weights draws them in
        num_prefix = 0
        if self.state_dim:
            self.state_proj = nn.Linear(self.state_dim, self.state_tokens * d_model)
            num_prefix += self.state_tokens
        self.obs_encoder = ObsEncoder(layout, image_net=lambda e: _Patchify(e.channels, self.pixel_grid, d_model),
                                      normalize=normalize_obs, owner="TokenPolicy")
        self.normalize_obs = self.obs_encoder.normalize
        num_prefix += len(layout.images) * self.pixel_grid**2
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
            self.register_buffer("bin_basis_matrix", cosine_bin_basis(bins, bin_basis), persistent=False)
            self.token_head = nn.Linear(d_model, bin_basis)
            self.token_embed = nn.Linear(bin_basis, d_model, bias=False)  # a token's input: its bin's cosines
        else:
            self.bin_basis_matrix = None
            self.token_head = nn.Linear(d_model, bins)
            self.token_embed = nn.Embedding(bins, d_model)
        self.value_head = nn.Linear(d_model, 1)

        # causal after the prefix, bidirectional within it; sliced for every pass
        pos = torch.arange(num_prefix + self.num_tokens)
        self.register_buffer("attn_mask", (pos[None, :] <= pos[:, None]) | (pos[None, :] < num_prefix),
                             persistent=False)
        self._init_weights(torch.Generator().manual_seed(self.seed))
        self._start_sampling()

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
    def from_spaces(cls, observation_space, action_space, *, image_keys: Sequence[str] | None = None,
                    state_keys: Sequence[str] | None = None, **kw) -> TokenPolicy:
        """Build from gymnasium spaces: any observation space :mod:`ebrl.policies.encoders` reads
        (``image_keys``/``state_keys`` choose the entries; an ``instruction`` Box is a token of its
        own unless ``state_keys`` names it); a Box action space with finite bounds, ``(A,)`` or
        ``(K, A)``."""
        from gymnasium import spaces

        if not (isinstance(action_space, spaces.Box) and len(action_space.shape) in (1, 2)
                and np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
            raise ValueError(f"TokenPolicy needs a Box action space of shape (A,) or (K, A) with finite bounds "
                             f"(its tokens are bins of [low, high]), got {action_space!r}")
        instruction = (observation_space.spaces.get(INSTRUCTION_KEY) if isinstance(observation_space, spaces.Dict)
                       else None)
        if not isinstance(instruction, spaces.Box) or INSTRUCTION_KEY in (state_keys or ()):
            instruction = None
        layout = ObsLayout.from_space(observation_space, image_keys=image_keys, state_keys=state_keys,
                                      exclude=(INSTRUCTION_KEY,) if instruction is not None else ())
        return cls(action_space.low, action_space.high, obs_layout=layout,
                   instruction_dim=math.prod(instruction.shape) if instruction is not None else 0, **kw)

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
        """What this policy was built for (``ebrl.run`` checks env 0's spaces against it): the
        entries of its layout (uint8 images of their shapes, vectors of their sizes) and the
        instruction; Box actions of ``action_shape``, ``(A,)`` or ``(K, A)``."""
        obs = self.obs_layout.expected()
        if self.instruction_dim:
            obs += (ObsSpec(keys=(INSTRUCTION_KEY,), size=self.instruction_dim),)
        return PolicySpaces(obs, ActionSpec(shape=self.action_shape))

    def describe_inputs(self) -> list[dict[str, Any]]:
        """The observation entries this policy reads, and how (see :class:`ReadsObservations`)."""
        inputs = self.obs_encoder.describe()
        if self.instruction_dim:
            inputs.append({"key": INSTRUCTION_KEY, "as": "instruction token", "shape": [self.instruction_dim]})
        return inputs

    # ---- observations ----------------------------------------------------------------------

    def _prefix(self, obs: Any) -> Tensor:
        """``[N, P, d]`` prefix tokens: the vectors, then each camera's patches, then the instruction."""
        tokens = []
        if self.state_dim:
            state = self.obs_encoder.vector(obs, self.bos)
            tokens.append(self.state_proj(state).view(-1, self.state_tokens, self.d_model))
        tokens += self.obs_encoder.image_features(obs, self.bos)
        if self.instruction_dim:
            instruction = as_tensor(lookup(obs, (INSTRUCTION_KEY,)), self.bos.device)
            instruction = instruction.reshape(-1, self.instruction_dim).to(self.bos.dtype)
            tokens.append(self.instruction_proj(instruction)[:, None])
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
        prefix = self._prefix(obs)
        bos = (self.bos + self.action_pos[0]).expand(prefix.shape[0], 1, -1)
        return torch.cat([prefix, bos], 1)

    def _logits(self, obs: Any, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The teacher-forced pass behind :meth:`evaluate`: logits ``[N, D, bins]`` of every action
        dimension given the earlier checked ids ``[N, D]``, and values ``[N]``, with gradients."""
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
        ``tokens`` is given, teacher-forced (the logits then equal the full pass's, :meth:`evaluate`'s).
        """
        forced = None if tokens is None else self._token_ids(tokens)
        inputs = self._prefix_and_bos(obs)
        batch, device = inputs.shape[0], inputs.device
        gen = self._generator(device)
        first = self.blocks[0].attn
        shape = (batch, first.heads, self.num_prefix + self.num_tokens, first.head_dim)
        cache = [(inputs.new_empty(shape), inputs.new_empty(shape)) for _ in self.blocks]
        h = self._transform(inputs, 0, cache)[:, -1]
        values = self.value_head(h).squeeze(-1)
        chosen, all_logits = [], []
        for j in range(self.num_tokens):
            all_logits.append(self.bin_logits(h))
            chosen.append(choose_token(all_logits[-1], forced, j, self.deterministic, gen))
            if j + 1 < self.num_tokens:
                token = chosen[-1]
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
        return (*forced_logp_entropy(logits, ids), value)

    def value(self, obs: Any) -> Tensor:
        """State values ``[N]``, with gradients: a pass over the prefix and BOS only."""
        return self.value_head(self._transform(self._prefix_and_bos(obs))[:, -1]).squeeze(-1)


def cosine_bin_basis(bins: int, size: int) -> Tensor:
    """``[size, bins]``: row ``k - 1`` is ``cos(pi k u) / k^2`` over the bins' places ``u`` in
    ``(0, 1)``, ``k = 1..size``. Logits ``c @ basis`` are a smooth function of the bin's value,
    damped so that Adam, which steps every coefficient alike, keeps them smooth (see
    :meth:`TokenPolicy.bin_logits`; :class:`~ebrl.policies.hf_token.HFTokenPolicy`'s bin head)."""
    place = (torch.arange(bins, dtype=torch.float32) + 0.5) / bins
    freq = torch.arange(1, size + 1, dtype=torch.float32)[:, None]
    return torch.cos(math.pi * freq * place) / freq.square()


def _plain_layout(state_dim: int, pixels_shape: Sequence[int] | None, dict_obs: bool) -> ObsLayout:
    """The layout ``state_dim``/``pixels_shape``/``dict_obs`` describe: a flat Box, or ``state`` and ``pixels``."""
    if not dict_obs:
        return ObsLayout.vector((state_dim,)) if state_dim else ObsLayout()
    images = (ObsEntry(("pixels",), Read.IMAGE, tuple(int(d) for d in pixels_shape), "uint8"),) if pixels_shape else ()
    vectors = (ObsEntry(("state",), Read.VECTOR, (state_dim,)),) if state_dim else ()
    return ObsLayout(images, vectors)
