"""A token policy around your own Hugging Face model, in the style of OpenVLA, loaded from a local directory.

:class:`~ebrl.policies.token.TokenPolicy` is a small transformer learned from scratch;
:class:`HFTokenPolicy` is the same contract (``act``/``evaluate``/``value``, token ids as actions,
bin centres as env actions) around a pretrained causal language model or image-text model that
you downloaded yourself. EBRL never downloads anything: every load passes
``local_files_only=True``, and a directory missing ``config.json``, the weights or the tokenizer
files is one :class:`FileNotFoundError` naming the path and the file.

**Actions** are OpenVLA's: each action dimension is one of 256 uniform bins between the Box
bounds (or between the ``q01``/``q99`` of ``action_stats``, OpenVLA's normalisation statistics,
stored with the policy), and bin ``b`` is token ``vocab_size - 1 - b``, the last 256 ids of the
vocabulary. ``vocab_size`` is the tokenizer's base vocabulary (``tokenizer.vocab_size``, as
OpenVLA, whose embedding is padded past it) when that has at least 256 tokens, else the
model's embedding rows. The logits of a dimension are the language-model head's logits of those
256 ids only, plus a learned **bin head** (``bin_basis``, below), and an action's log-prob is the
sum of its tokens' log-probs.

**The bin head.** Under LoRA the language-model head and the final norm are frozen, so the
action logits are ``w_b . h`` with fixed rows ``w_b`` and ``|h|`` fixed by the final RMSNorm: how
far the policy can move from uniform over the bins is capped by the norms of those 256 rows,
whatever the adapters learn. For rows that pretraining left small (a random model's; a VLA that
never learned these ids) that cap is a nearly uniform policy: on a tiny random Llama
(``initializer_range=0.02``, rows of norm 0.11, ``|h| = sqrt(32)``) no logit could move by more
than 0.6, PPO's entropy stayed at ``2 * log(256)`` and ``approx_kl`` near 0 for 30 updates, and
the return did not move. The bin head adds ``c_j(h) @ B`` to dimension ``j``'s logits: ``c_j`` a
linear map of the RMS-normalised ``h`` (zero-initialised: the policy starts as exactly the
model's), ``B`` the damped cosines of :class:`~ebrl.policies.token.TokenPolicy` (``bin_basis`` of
them, 32 by default), so that a step raising a sampled bin raises its neighbours too, which RL
needs (see :meth:`TokenPolicy.bin_logits <ebrl.policies.token.TokenPolicy.bin_logits>`). Each
action dimension has its own map ``c_j``: the hidden state that predicts dimension ``j > 0`` sits
on the previous action token, whose (pretrained or random) embedding it mostly carries, and one
map shared by every dimension must also tell them apart. On a 3-D point-mass reach (three
seeds, 15k decisions) per-dimension maps raised the share of the gap to a scripted expert that
the sampled policy closed from 0.06-0.14 to 0.23-0.31. The head trains with the adapters and is
saved with them; ``bin_basis=0`` leaves the model's own logits alone.

**The prefix** the model reads before the first action token, as ``inputs_embeds``::

    [BOS] [camera tokens ...] [state tokens] "In: What action should the robot take to {instruction}?\\nOut:"

- cameras (uint8 Boxes of three dimensions, found by :class:`~ebrl.policies.encoders.ObsLayout`)
  go through the model's own image processor and vision tower (``get_image_features``: the
  vision encoder and projector of a LLaVA-style model). A causal LM has no vision tower: each
  camera is then read by a small learned patch projection (average-pooled to ``8 * camera_grid``
  pixels square, ``8 x 8`` patches, ``camera_grid**2`` tokens), trained with the adapters;
- the other entries (Box vectors, normalised by a running mean and variance; Discrete one-hot)
  go through a learned linear projection into ``state_tokens`` embeddings;
- the instruction is ``prompt`` (OpenVLA's by default) with ``{instruction}`` replaced, tokenised
  by the model's tokenizer once, when the policy is built. ``instruction`` is one string, or a
  list of strings chosen per row by a Discrete ``instruction`` entry of the observation (a task
  index, as LIBERO gives). Prompts of different lengths are left-padded, masked, and their
  positions count from the first real token, so a row reads as it would alone.

**Decoding.** ``act`` runs the prefix once with the model's KV cache (``use_cache=True``), then
one single-token step per further action dimension, batched; ``evaluate`` is one teacher-forced
pass over the prefix and the action tokens. A value head (``nn.Linear``) reads the last hidden
state at the prefix's final position (the one that predicts the first action token);
``value_head=False`` (GRPO, which has no critic) makes values zeros, with no parameters.

**LoRA.** ``lora_rank=r`` wraps the model with ``peft.get_peft_model`` (``lora_alpha`` defaults
to ``min(r, 16)`` as OpenVLA's fine-tuning; ``lora_targets`` to those of ``q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj`` the model has, vision tower included). The base
weights are frozen; the adapters, the state and camera projections and the value head train.
Without LoRA the whole model trains. :meth:`HFTokenPolicy.trainable_state_dict` holds what
changes in training (trainable parameters and the observation statistics), under the names
``state_dict`` gives them: what weight publication needs to carry. ``state_dict()`` is still the
whole module, frozen base included, so the runtime's ``state_dict``/``load_state_dict`` work
unchanged (at the cost of copying the base each time). :meth:`HFTokenPolicy.save_adapters`
writes the trainable tensors (``adapters.safetensors``) and how to rebuild the policy
(``ebrl_policy.json``); :meth:`HFTokenPolicy.load_adapters` rebuilds it from the base directory.

**Precision.** ``dtype="auto"`` loads the weights in float32 whatever the checkpoint's dtype:
correctness first, since PPO's ratio divides two log-probs computed by two different passes (the
KV-cache decoder and the teacher-forced pass), and bf16 matmuls on a CPU are slow as well as
rounded. ``dtype="bfloat16"`` loads the (frozen) base in bf16; ``autocast_bf16=True`` runs the
model's passes under bf16 autocast. The trainable tensors EBRL adds stay float32 either way, and
peft keeps the adapters float32.

**Training mode.** The model runs without dropout, in ``train()`` mode too: acting and training
must be one function for the log-prob ratio to mean anything. ``gradient_checkpointing=True``
recomputes the decoder layers in the backward pass of ``evaluate``/``value``.

**Limits.** Models load through transformers' own classes: checkpoints that need
``trust_remote_code`` (OpenVLA's Prismatic release among them) are not run, since that would
execute code from the model directory. Vision towers are called once per camera through
``get_image_features``; tiled ("anyres") towers get the processor's ``image_sizes`` but are
untested. The instruction is used as given (OpenVLA lowercases it first).

Example (a model directory of your own; nothing is fetched)::

    >>> import gymnasium as gym, numpy as np
    >>> from ebrl.policies.hf_token import HFTokenPolicy
    >>> obs_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (224, 224, 3), np.uint8),
    ...                              "state": gym.spaces.Box(-np.inf, np.inf, (8,), np.float32)})
    >>> policy = HFTokenPolicy.from_pretrained(  # doctest: +SKIP
    ...     "/models/my-llava", obs_space, gym.spaces.Box(-1.0, 1.0, (7,)),
    ...     lora_rank=16, instruction="pick up the black bowl")
    >>> out = policy.act({"image": np.zeros((4, 224, 224, 3), np.uint8),  # doctest: +SKIP
    ...                   "state": np.zeros((4, 8), np.float32)})
    >>> out.actions.shape, out.env_actions.shape, out.logprobs.shape  # doctest: +SKIP
    ((4, 7), (4, 7), (4,))
    >>> policy.save_adapters("/runs/adapters")  # doctest: +SKIP
    >>> HFTokenPolicy.from_pretrained("/models/not-there", obs_space, gym.spaces.Box(-1.0, 1.0, (7,)),
    ...                               instruction="pick up the black bowl")
    Traceback (most recent call last):
    ...
    FileNotFoundError: HFTokenPolicy: model directory '/models/not-there' does not exist (EBRL loads local ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.base import ActResult
from ebrl.policies.hf_backbone import OPENVLA_PROMPT, HFBackbonePolicy, action_bounds
from ebrl.policies.token import choose_token, cosine_bin_basis, forced_logp_entropy

BINS = 256  # OpenVLA's bins per action dimension


class HFTokenPolicy(HFBackbonePolicy):
    """OpenVLA-style action tokens from a Hugging Face model (see the module's docstring).

    Build it with :meth:`from_pretrained` (a local directory and the env's spaces), or from a
    model already in memory: ``model`` (a causal LM or image-text model), its ``tokenizer``, its
    ``image_processor`` (image-text models reading cameras), ``obs_layout`` (the full layout,
    cameras included; a Discrete ``instruction`` entry left out), ``action_low``/``action_high``
    (the Box, ``(A,)`` or a chunk ``(K, A)`` emitted row-major) and ``instruction_classes``
    (``(n, start)`` of the Discrete ``instruction`` entry when ``instruction`` is a list).
    ``seed`` fixes the added layers' initial weights, the LoRA initialisation and the sampling
    stream.
    """

    SAVED_OPTIONS = ("action_stats", "vocab_size", "bin_basis")

    def __init__(self, model: nn.Module, tokenizer: Any, *, action_low, action_high,
                 action_stats: Mapping[str, Any] | None = None, vocab_size: int | None = None,
                 bin_basis: int = 32, **backbone: Any):
        """``backbone``: :class:`~ebrl.policies.hf_backbone.HFBackbonePolicy`'s keywords
        (``obs_layout``, ``instruction``, ``lora_rank``, ``value_head``, ``seed``, ...).
        ``bin_basis``: the cosines of the bin head (0: none; see the module's docstring)."""
        if not isinstance(bin_basis, int) or isinstance(bin_basis, bool) or not 0 <= bin_basis <= BINS:
            raise ValueError(f"bin_basis={bin_basis!r} must be an int in [0, {BINS}] (0: no bin head)")
        box_low, box_high = action_bounds(action_low, action_high, "HFTokenPolicy")
        bin_low, bin_high, stats = _bin_bounds(box_low, box_high, action_stats)
        super().__init__(model, tokenizer, action_low=box_low, action_high=box_high, **backbone)
        self.config["action_stats"] = stats
        self.num_tokens = box_low.size  # D: tokens per action
        self.bins = BINS

        # OpenVLA's action tokens: bin b is id vocab_size - 1 - b
        hf = self.hf_model
        embed_rows = int(hf.get_input_embeddings().weight.shape[0])
        rows = int(hf.get_output_embeddings().weight.shape[0])
        if vocab_size is None:
            base_vocab = int(getattr(tokenizer, "vocab_size", 0) or 0)
            vocab_size = base_vocab if BINS <= base_vocab <= rows else rows
        if not BINS <= vocab_size <= min(rows, embed_rows):
            raise ValueError(f"vocab_size={vocab_size}: the action tokens are its last {BINS} ids, so it must lie in "
                             f"[{BINS}, {min(rows, embed_rows)}] (the model's embedding rows)")
        self.vocab_size = self.config["vocab_size"] = int(vocab_size)
        # constants, not weights: they move with .to(device) and stay out of state_dict
        self.register_buffer("action_token_ids", vocab_size - 1 - torch.arange(BINS), persistent=False)
        self.register_buffer("bin_low", torch.from_numpy(bin_low.reshape(-1).copy()), persistent=False)
        self.register_buffer("bin_width", torch.from_numpy((bin_high - bin_low).reshape(-1) / BINS),
                             persistent=False)
        self.register_buffer("clip_low", torch.from_numpy(np.where(np.isfinite(box_low), box_low, -np.inf)),
                             persistent=False)
        self.register_buffer("clip_high", torch.from_numpy(np.where(np.isfinite(box_high), box_high, np.inf)),
                             persistent=False)
        # the bin head (module docstring): zero-initialised, so the policy starts as the model's own
        self.config["bin_basis"] = int(bin_basis)
        if bin_basis:
            self.register_buffer("bin_basis_matrix", cosine_bin_basis(BINS, bin_basis), persistent=False)
            self.bin_head = nn.Linear(self.hidden, self.num_tokens * bin_basis)  # one readout per action dimension
            nn.init.zeros_(self.bin_head.weight)
            nn.init.zeros_(self.bin_head.bias)
        else:
            self.bin_head = None

    # ---- building ----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, observation_space, action_space, *, lora_rank: int | None = None,
                        lora_alpha: float | None = None, lora_targets: Sequence[str] | None = None,
                        instruction: str | Sequence[str] | None = None, prompt: str | None = None,
                        dtype: str | torch.dtype = "auto", seed: int = 0, gradient_checkpointing: bool = False,
                        action_stats: Mapping[str, Any] | None = None, image_keys: Sequence[str] | None = None,
                        state_keys: Sequence[str] | None = None, **kw) -> HFTokenPolicy:
        """Load the model in the local directory ``path`` and build the policy for these gymnasium
        spaces: any observation :mod:`ebrl.policies.encoders` reads (``image_keys``/``state_keys``
        choose the entries; with a list of instructions, the Discrete ``instruction`` entry picks
        one per row); a Box action space, ``(A,)`` or ``(K, A)``, with finite bounds unless
        ``action_stats`` gives ``q01``/``q99``. Further keywords go to the constructor
        (``value_head``, ``state_tokens``, ``camera_grid``, ``autocast_bf16``, ``vocab_size``, ...)."""
        return cls._load_for_spaces(path, observation_space, action_space, instruction=instruction,
                                    image_keys=image_keys, state_keys=state_keys, prompt=prompt, lora_rank=lora_rank,
                                    lora_alpha=lora_alpha, lora_targets=lora_targets, dtype=dtype, seed=seed,
                                    gradient_checkpointing=gradient_checkpointing, action_stats=action_stats, **kw)

    # ---- tokenisation ------------------------------------------------------------------------

    def tokenize(self, actions: np.ndarray) -> np.ndarray:
        """Bin ids ``[..., *action_shape]`` (int64) of continuous actions, clipped to the bins' range."""
        low = self.bin_low.cpu().numpy().reshape(self.action_shape)
        width = self.bin_width.cpu().numpy().reshape(self.action_shape)
        scaled = (np.asarray(actions, np.float64) - low) / np.where(width > 0, width, 1.0)
        return np.clip(np.floor(scaled), 0, BINS - 1).astype(np.int64)

    def detokenize(self, bins: np.ndarray) -> np.ndarray:
        """Bin centres (float32) of bin ids ``[..., *action_shape]``."""
        low = self.bin_low.cpu().numpy().reshape(self.action_shape)
        width = self.bin_width.cpu().numpy().reshape(self.action_shape)
        return (low + (np.asarray(bins) + 0.5) * width).astype(np.float32)

    def token_ids(self, bins: np.ndarray | Tensor) -> Tensor:
        """The vocabulary ids (``vocab_size - 1 - bin``) of bin ids."""
        return self.action_token_ids[torch.as_tensor(bins, device=self.action_token_ids.device).long()]

    def _bin_ids(self, actions: Any) -> Tensor:
        """``[N, D]`` int64 bins from ``[N, *action_shape]`` bins (integers, or floats holding integers)."""
        ids = torch.as_tensor(actions, device=self.bin_low.device)
        ids = (ids if not ids.is_floating_point() else ids.round()).long().reshape(-1, self.num_tokens)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= BINS):
            raise ValueError(f"action token ids must lie in [0, {BINS}), got [{int(ids.min())}, {int(ids.max())}]")
        return ids

    # ---- the action tokens ---------------------------------------------------------------------------

    def bin_logits(self, h: Tensor, dim: int | None = None) -> Tensor:
        """Float32 logits over the bins from hidden states: of every action dimension from
        ``h [N, D, hidden]`` (``dim`` None; ``[N, D, 256]``), or of dimension ``dim`` from
        ``h [N, hidden]`` (``[N, 256]``). The language-model head restricted to the action tokens
        (bin order), plus the bin head's smooth logits (zero until trained; see the module's
        docstring), which has a readout of its own for each action dimension."""
        head = self.hf_model.get_output_embeddings()
        with self._autocast():
            if type(head) is nn.Linear:  # only the 256 rows: not the whole vocabulary
                bias = None if head.bias is None else head.bias[self.action_token_ids]
                logits = nn.functional.linear(h.to(head.weight.dtype), head.weight[self.action_token_ids], bias)
            else:  # a wrapped head (LoRA on lm_head): the whole vocabulary, then the action tokens
                logits = head(h)[..., self.action_token_ids]
        logits = logits.float()
        if self.bin_head is not None:
            # RMS-normalised (float32, outside autocast): its speed does not depend on the final norm's scale
            x = h.float()
            x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
            m = self.bin_basis_matrix.shape[0]
            w = self.bin_head.weight.view(self.num_tokens, m, self.hidden)
            b = self.bin_head.bias.view(self.num_tokens, m)
            if dim is None and h.dim() == 2:  # [N, hidden]: only one dimension it can be
                if self.num_tokens != 1:
                    raise ValueError(f"bin_logits of hidden states [N, hidden] needs dim= (one of {self.num_tokens} "
                                     "action dimensions), or states [N, D, hidden]")
                dim = 0
            if dim is None:  # [N, D, hidden]: position j is read by dimension j's readout
                coef = torch.einsum("ndh,dmh->ndm", x, w) + b
            else:
                coef = x @ w[dim].T + b[dim]
            logits = logits + coef @ self.bin_basis_matrix
        return logits

    def _logits(self, obs: Any, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The teacher-forced pass behind :meth:`evaluate`: logits ``[N, D, 256]`` of every action
        dimension given the earlier bins ``ids [N, D]``, and values ``[N]``, with gradients."""
        embeds, mask, positions = self._prefix(obs)
        prefix_len = embeds.shape[1]
        if self.num_tokens > 1:
            steps = torch.arange(1, self.num_tokens, device=positions.device)
            embeds = torch.cat([embeds, self._embed(self.token_ids(ids[:, :-1])).to(embeds.dtype)], 1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], self.num_tokens - 1)], 1)
            positions = torch.cat([positions, positions[:, -1:] + steps], 1)
        h, _ = self._hidden(embeds, mask, positions)
        h = h[:, prefix_len - 1:]  # the prefix's last position predicts dimension 0, and so on
        return self.bin_logits(h), self._head_values(h[:, 0])

    @torch.no_grad()
    def decode(self, obs: Any, tokens: Any = None) -> tuple[Tensor, Tensor, Tensor]:
        """The KV-cache decoder behind :meth:`act`: ``(bins [B, D], logits [B, D, 256], values [B])``.

        One pass over the prefix fills the model's cache; each further dimension is one
        single-token step. Bins are sampled from the policy's generator, or teacher-forced when
        ``tokens`` is given (the logits then equal the teacher-forced pass's, :meth:`evaluate`'s).
        """
        forced = None if tokens is None else self._bin_ids(tokens)
        embeds, mask, positions = self._prefix(obs)
        gen = self._generator(embeds.device)
        h, cache = self._hidden(embeds, mask, positions, use_cache=True)
        h = h[:, -1]
        values = self._head_values(h)
        last = positions[:, -1:]
        chosen, all_logits = [], []
        for j in range(self.num_tokens):
            all_logits.append(self.bin_logits(h, j))
            chosen.append(choose_token(all_logits[-1], forced, j, self.deterministic, gen))
            if j + 1 < self.num_tokens:
                token = chosen[-1]
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
                step = self._embed(self.token_ids(token))[:, None].to(embeds.dtype)
                h, cache = self._hidden(step, mask, last + 1 + j, cache, use_cache=True)
                h = h[:, -1]
        return torch.stack(chosen, 1), torch.stack(all_logits, 1), values

    # ---- acting (runtime) --------------------------------------------------------------------

    @torch.no_grad()
    def act(self, obs: Any) -> ActResult:
        """Sample bins for ``obs [B, ...]`` (numpy, or a dict of numpy arrays); numpy out.

        ``actions`` are the bin ids ``[B, *action_shape]`` (what the log-probs refer to; the
        vocabulary ids are :meth:`token_ids` of them), ``env_actions`` their bin centres, clipped
        to the Box (bins between ``action_stats`` quantiles may reach past it).
        """
        bins, logits, values = self.decode(obs)
        logp = logits.log_softmax(-1).gather(-1, bins[..., None]).squeeze(-1).sum(-1)
        ids = bins.reshape(-1, *self.action_shape).cpu().numpy()
        env = np.clip(self.detokenize(ids), self.clip_low.cpu().numpy(), self.clip_high.cpu().numpy())
        return ActResult(actions=ids, env_actions=env.astype(np.float32), logprobs=logp.float().cpu().numpy(),
                         values=values.float().cpu().numpy())

    # ---- training (algorithm) ----------------------------------------------------------------

    def evaluate(self, obs: Any, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logprob [N], entropy [N], value [N])`` of bins ``actions [N, *action_shape]``: the
        sums over dimensions of the teacher-forced log-probs and conditional entropies."""
        ids = self._bin_ids(actions)
        logits, value = self._logits(obs, ids)
        return (*forced_logp_entropy(logits, ids), value)


# ---- helpers ---------------------------------------------------------------------------------

def _bin_bounds(box_low: np.ndarray, box_high: np.ndarray, action_stats: Mapping[str, Any] | None):
    """The bins' range: ``action_stats``' ``q01``/``q99`` (OpenVLA's ``dataset_statistics``,
    ``{"q01": [...], "q99": [...]}`` or under an ``"action"`` key), else the Box bounds."""
    if action_stats is None:
        low, high = box_low, box_high
        stats = None
    else:
        source = action_stats.get("action", action_stats)
        if "q01" not in source or "q99" not in source:
            raise ValueError(f"action_stats must give 'q01' and 'q99' (OpenVLA's dataset statistics), got keys "
                             f"{sorted(source)}")
        low = np.asarray(source["q01"], np.float32).reshape(-1)
        high = np.asarray(source["q99"], np.float32).reshape(-1)
        width = box_low.shape[-1]
        if low.size not in (width, box_low.size) or high.size != low.size:
            raise ValueError(f"action_stats q01/q99 have {low.size} and {high.size} values; the actions have "
                             f"{width} dimensions per step")
        low = np.broadcast_to(low.reshape(-1)[-box_low.size:] if low.size == box_low.size else low,
                              box_low.shape).astype(np.float32)
        high = np.broadcast_to(high.reshape(-1)[-box_high.size:] if high.size == box_high.size else high,
                               box_high.shape).astype(np.float32)
        stats = {"q01": low.tolist(), "q99": high.tolist()}
    if not (np.isfinite(low).all() and np.isfinite(high).all()) or (high < low).any():
        raise ValueError("HFTokenPolicy bins each action dimension between finite bounds low <= high: the Box's, or "
                         f"action_stats' q01/q99; got low={low.tolist()}, high={high.tolist()}")
    return low.astype(np.float32), high.astype(np.float32), stats


__all__ = ["OPENVLA_PROMPT", "HFTokenPolicy"]
