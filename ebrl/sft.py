"""Supervised fine-tuning (behaviour cloning) of any EBRL policy on demonstrations.

VLA-RL is "SFT, then RL": the policy first imitates demonstrations, and RL starts from there.
The loss is the one each policy kind's RL already implies:

- action-token kinds (``token``, ``hf-token``): cross-entropy on the demonstration's action
  tokens (its actions binned by the policy's own tokenizer): the negative log-prob
  ``evaluate`` gives, which sums the tokens' log-probs;
- flow kinds (``flow``, ``hf-flow``): the flow-matching loss (``flow_matching_loss``) on chunks
  of ``K`` consecutive demonstration actions (the episode's last action repeats past its end);
- Gaussian kinds (``mlp``, ``cnn``): the negative log-likelihood of the actions under the
  policy's mean, ``log_std`` held still while the mean trains (the NLL would shrink it to the
  training frames' residual, which overfitting drives toward zero). Afterwards ``fit_std`` sets
  each action dimension's ``log_std`` to the log of the mean's RMS error on the held-out
  episodes: the Gaussian's maximum-likelihood std on frames it did not train on. RL from the
  clone then explores about as far as the clone errs; the initial std (1 by default) would
  bury the cloned behaviour in noise (on ManiSkill PickCube, a clone that succeeds in 10% of
  episodes with its mean succeeded in none with a std of 0.6).

Whole episodes are held out for validation (``val_fraction``); both losses go to TensorBoard
under ``sft/``. ``value_pass`` then fits the critic to the demonstrations' discounted returns
(where they have rewards), in the units PPO trains it in: rewards over the std of returns, whose
moments ``sft.json`` keeps and ``ebrl train --set policy.init=DIR`` starts PPO's reward scale
from (:func:`carry_reward_scale`). Observation statistics (where the policy normalises) come from
the training split first.

    >>> import tempfile
    >>> from ebrl.demos import collect, read_lerobot
    >>> from ebrl.sft import SFTConfig, sft
    >>> from ebrl.testing import InstructedReach
    >>> from ebrl.policies import MLPPolicy
    >>> tmp = tempfile.TemporaryDirectory()
    >>> d = tmp.name + "/demos"
    >>> _ = collect("mock/reach", d, episodes=4)
    >>> env = InstructedReach()
    >>> policy = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=0)
    >>> out = sft(policy, read_lerobot(d), env.observation_space, env.action_space, SFTConfig(epochs=3))
    >>> out["train_loss"][-1] < out["train_loss"][0], len(out["val_loss"])
    (True, 3)
    >>> tmp.cleanup()
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ebrl.envs.chunks import policy_chunk
from ebrl.demos.features import ObsFeatures
from ebrl.demos.lerobot import Demos
from ebrl.spaces import tree_map
from ebrl.policies.base import critic_parameters


@dataclass
class SFTConfig:
    lr: float = 3e-4
    # passes over the training split; None: 30, or more on a small dataset, enough passes for
    # min_steps gradient steps (30 passes over 20 Fetch demonstrations are 120 steps: clones
    # that succeeded in 2% of episodes where 200-400 passes reached 14-26%, docs/demos.md)
    epochs: int | None = None
    min_steps: int = 1000
    minibatch_size: int = 256
    val_fraction: float = 0.1  # of the episodes (at least one when there are two or more)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    # fit the value head to the demonstrations' discounted returns afterwards, in PPO's reward
    # scale (carried into RL from policy.init). Off by default: on the π0 recipe it halved the
    # critic's first loss but RL then did worse in 3 of 3 seeds (docs/demos.md)
    value_pass: bool = False
    gamma: float = 0.99  # for the value pass's returns
    value_epochs: int | None = None  # None: as many passes as the actions' (SFTConfig.passes)
    fit_std: bool = True  # Gaussian kinds: log_std from the held-out error (see the module docstring)

    def __post_init__(self) -> None:
        for name, ok in (("lr", self.lr > 0), ("epochs", self.epochs is None or self.epochs >= 1),
                         ("min_steps", self.min_steps >= 0), ("minibatch_size", self.minibatch_size >= 1),
                         ("val_fraction", 0 <= self.val_fraction < 1), ("gamma", 0 <= self.gamma <= 1),
                         ("max_grad_norm", self.max_grad_norm > 0),
                         ("value_epochs", self.value_epochs is None or self.value_epochs >= 1)):
            if not ok:
                raise ValueError(f"sft {name}={getattr(self, name)!r} is out of range")

    def passes(self, train_frames: int) -> int:
        """How many passes over ``train_frames`` frames: ``epochs`` when set, else 30 or enough
        for ``min_steps`` gradient steps, whichever is more.

        >>> SFTConfig().passes(1_000), SFTConfig().passes(100_000), SFTConfig(epochs=5).passes(1_000)
        (250, 30, 5)
        """
        if self.epochs is not None:
            return self.epochs
        steps_per_pass = max(1, math.ceil(train_frames / self.minibatch_size))
        return max(30, math.ceil(self.min_steps / steps_per_pass))


def demo_actions(demos: Demos, action_shape: tuple[int, ...]) -> np.ndarray:
    """The demonstration's actions shaped for the policy: as stored, or chunks ``[N, K, A]`` of
    the next ``K`` actions of each frame's episode (the last repeated) when the policy acts in chunks."""
    actions = np.asarray(demos.frames["action"], np.float32)
    stored = actions.shape[1:]
    if stored == tuple(action_shape):
        return actions
    if len(action_shape) == 2 and stored == tuple(action_shape[1:]):
        k = action_shape[0]
        out = np.empty((len(actions), *action_shape), np.float32)
        for lo, hi in demos.episodes:
            idx = np.minimum(np.arange(lo, hi)[:, None] + np.arange(k)[None, :], hi - 1)
            out[lo:hi] = actions[idx]
        return out
    raise ValueError(f"the dataset's actions are {stored}, the policy acts with {tuple(action_shape)}: "
                     "make the env as the demonstrations were (env_kwargs, chunk=)")


def demo_shape(policy, action_space) -> tuple[int, ...]:
    """What the policy learns from each frame: the env's action, or the next ``K`` actions for a
    policy acting in chunks of ``K`` on a per-step env, or ``demo_chunk_len`` of them for a policy
    that predicts longer chunks than it executes (π0's whole chunk, :class:`~ebrl.policies.pi0.policy.PI0Policy`)."""
    chunk = policy_chunk(policy)
    one = chunk[1] if chunk else tuple(action_space.shape)
    k = getattr(policy, "demo_chunk_len", None) or (chunk[0] if chunk else None)
    return one if k is None else (int(k), *one)


def demo_batch(obs_all: Any, actions_all: np.ndarray, rows: np.ndarray, device) -> tuple[Any, Tensor]:
    """Frames ``rows`` of the demonstrations (observations as :class:`ObsFeatures` gives them,
    actions as :func:`demo_actions` shapes them) as tensors on ``device``."""
    obs = tree_map(lambda x: torch.as_tensor(x[rows], device=device), obs_all)
    return obs, torch.as_tensor(actions_all[rows], device=device)


def bc_loss(policy, obs: Any, actions: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """The behaviour-cloning loss of one minibatch (see the module docstring)."""
    own = getattr(policy, "bc_loss", None)
    if callable(own):
        return own(obs, actions)
    if callable(getattr(policy, "flow_matching_loss", None)):
        return policy.flow_matching_loss(obs, actions, generator)
    if callable(getattr(policy, "tokenize", None)):
        ids = torch.as_tensor(policy.tokenize(actions.cpu().numpy()), device=actions.device)
        logp, _, _ = policy.evaluate(obs, ids)
        return -logp.mean()
    logp, _, _ = policy.evaluate(obs, actions)
    return -logp.mean()


def _split(demos: Demos, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    n = demos.num_episodes
    held = 0 if n < 2 or fraction == 0 else max(1, int(round(fraction * n)))
    order = np.random.default_rng(seed).permutation(n).tolist()
    return sorted(order[held:]), sorted(order[:held])


def demo_returns(demos: Demos, gamma: float) -> tuple[np.ndarray, list[float]]:
    """``(returns, [mean, var, count])``: each frame's discounted return to its episode's end (what
    a critic predicts) and the moments PPO scales rewards by, computed as PPO computes them on a
    batch (returns accumulated forward from each episode's start, see ``PPO._scaled_rewards``)."""
    rewards = np.asarray(demos.frames.get("next.reward", np.zeros(len(demos))), np.float64).reshape(-1)
    out, forward = np.zeros_like(rewards), np.zeros_like(rewards)
    for lo, hi in demos.episodes:
        acc = 0.0
        for t in range(hi - 1, lo - 1, -1):
            acc = rewards[t] + gamma * acc
            out[t] = acc
        acc = 0.0
        for t in range(lo, hi):
            acc = rewards[t] + gamma * acc
            forward[t] = acc
    return out.astype(np.float32), [float(forward.mean()), float(forward.var()), float(len(forward))]


def carry_reward_scale(algo, init: str | Path) -> bool:
    """Start ``algo``'s reward scale (PPO's running moments of returns) from the demonstrations the
    ``ebrl sft`` output ``init`` fitted its critic on, so the critic's first targets are in the units
    it was fitted in. False where there is nothing to carry."""
    import json

    path = Path(init) / "sft.json"
    rms = getattr(algo, "reward_rms", None)
    if rms is None or not getattr(algo.config, "scale_rewards", False) or not path.is_file():
        return False
    saved = json.loads(path.read_text()).get("reward_rms")
    if not saved:
        return False
    rms.mean, rms.var, rms.count = saved
    return True


def sft(policy, demos: Demos, observation_space, action_space, config: SFTConfig | None = None,
        *, metrics=None, progress=None) -> dict[str, Any]:
    """Behaviour-clone ``policy`` on ``demos`` in place; returns the losses per epoch.

    ``metrics``: a :class:`~ebrl.telemetry.metrics.MetricsLog` (open) that gets one row per
    epoch (``sft/train_loss``, ``sft/val_loss``); ``progress(epoch, train, val)`` is called too.
    """
    c = config or SFTConfig()
    if len(demos) == 0:
        raise ValueError("the dataset has no frames")
    torch.manual_seed(c.seed)
    gen = torch.Generator().manual_seed(c.seed)
    feats = ObsFeatures(observation_space)
    obs_all = feats.observations(demos.frames)
    actions_all = demo_actions(demos, demo_shape(policy, action_space))
    train_eps, val_eps = _split(demos, c.val_fraction, c.seed)
    rows_of = demos.episode_of()
    train_rows = np.flatnonzero(np.isin(rows_of, train_eps))
    val_rows = np.flatnonzero(np.isin(rows_of, val_eps))
    device = next(policy.parameters()).device

    def batch(rows: np.ndarray):
        return demo_batch(obs_all, actions_all, rows, device)

    if callable(getattr(policy, "update_obs_stats", None)):
        policy.update_obs_stats(batch(train_rows)[0])
    # log_std stays while the mean trains; fit_std sets it from the held-out error afterwards
    params = [p for n, p in policy.named_parameters() if p.requires_grad and not n.endswith("log_std")
              and not n.startswith("critic")]
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
    history: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    policy.train()
    epochs = c.passes(len(train_rows))
    for epoch in range(epochs):
        perm = train_rows[torch.randperm(len(train_rows), generator=gen).numpy()]
        total, count = 0.0, 0
        for start in range(0, len(perm), c.minibatch_size):
            rows = perm[start:start + c.minibatch_size]
            obs, act = batch(rows)
            loss = bc_loss(policy, obs, act, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm)
            opt.step()
            total += float(loss.detach()) * len(rows)
            count += len(rows)
        train = total / max(count, 1)
        val = _evaluate_loss(policy, batch, val_rows, c.minibatch_size) if len(val_rows) else math.nan
        history["train_loss"].append(train)
        history["val_loss"].append(val)
        if metrics is not None:
            metrics.record_scalars({"sft/train_loss": train, "sft/val_loss": val}, step=epoch + 1)
        if progress is not None:
            progress(epoch + 1, train, val)
    if c.fit_std:
        std = fit_log_std(policy, obs_all, actions_all, val_rows if len(val_rows) else train_rows)
        if std is not None:
            history["log_std"] = std.tolist()
    returns, moments = demo_returns(demos, c.gamma)
    if c.value_pass and np.any(returns) and callable(getattr(policy, "value", None)):
        # in PPO's units: rewards over the std of returns (scale_rewards, on by default)
        scale = math.sqrt(moments[1] + 1e-8)
        history["value_loss"] = _value_pass(policy, batch, train_rows, returns / np.float32(scale), c, gen, metrics,
                                            first_step=epochs + 1)
        history["reward_rms"] = moments
    policy.eval()
    history.update(train_episodes=len(train_eps), val_episodes=len(val_eps), frames=len(demos), epochs=epochs,
                   config=dataclasses.asdict(c))
    return history


@torch.no_grad()
def fit_log_std(policy, obs_all: Any, actions_all: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """Set a Gaussian policy's ``log_std`` to the log of its mean's RMS error per action
    dimension on frames ``rows`` (at least 1e-3); returns it. None for a policy without one."""
    log_std = getattr(policy, "log_std", None)
    if not isinstance(log_std, torch.nn.Parameter) or not hasattr(policy, "deterministic") or not len(rows):
        return None
    was, policy.deterministic = policy.deterministic, True
    try:
        mean = np.asarray(policy.act(tree_map(lambda x: x[rows], obs_all)).actions, np.float64)
    finally:
        policy.deterministic = was
    rms = np.sqrt(np.mean((actions_all[rows].astype(np.float64) - mean) ** 2, axis=0))
    fitted = np.log(np.maximum(rms, 1e-3)).reshape(log_std.shape)
    log_std.copy_(torch.as_tensor(fitted, dtype=log_std.dtype))
    return fitted


@torch.no_grad()
def _evaluate_loss(policy, batch, rows: np.ndarray, size: int) -> float:
    gen = torch.Generator().manual_seed(1234)  # the same noise every epoch: flow losses compare
    total = 0.0
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        obs, act = batch(part)
        total += float(bc_loss(policy, obs, act, gen)) * len(part)
    return total / len(rows)


def _value_pass(policy, batch, rows: np.ndarray, returns: np.ndarray, c: SFTConfig, gen, metrics,
                first_step: int) -> list[float]:
    """The critic's head regressed on the discounted returns of the demonstrations. Only the
    critic's parameters move, so where the policy splits its value into ``value_features(obs)``
    and ``value_from_features(f)`` (a VLA's value head on its backbone's features) the backbone
    runs once per frame, not once per frame and pass."""
    params = critic_parameters(policy)
    if not params:
        return []
    device = next(policy.parameters()).device
    cached = callable(getattr(policy, "value_features", None))
    if cached:
        with torch.no_grad():
            parts = [rows[i:i + c.minibatch_size] for i in range(0, len(rows), c.minibatch_size)]
            feats = torch.cat([policy.value_features(batch(part)[0]) for part in parts])
        where = {int(r): i for i, r in enumerate(np.concatenate(parts))}

    def values(part: np.ndarray) -> Tensor:
        if cached:
            return policy.value_from_features(feats[[where[int(r)] for r in part]])
        return policy.value(batch(part)[0])

    opt = torch.optim.Adam(params, lr=c.lr)
    out = []
    for epoch in range(c.value_epochs or c.passes(len(rows))):
        perm = rows[torch.randperm(len(rows), generator=gen).numpy()]
        total = 0.0
        for start in range(0, len(perm), c.minibatch_size):
            part = perm[start:start + c.minibatch_size]
            target = torch.as_tensor(returns[part], device=device)
            loss = (values(part) - target).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(part)
        out.append(total / len(perm))
        if metrics is not None:
            metrics.record_scalars({"sft/value_loss": out[-1]}, step=first_step + epoch)
    return out


def save_sft(out: str | Path, policy, spec: dict[str, Any], history: dict[str, Any]) -> Path:
    """A policy directory ``ebrl train --set policy.init=DIR`` and ``ebrl eval DIR`` read:
    ``spec.json``, ``checkpoint.pt`` (the policy's weights; only what trains under LoRA) and
    ``sft.json`` (the losses)."""
    import json

    from ebrl.checkpoint import write_checkpoint
    from ebrl.policies.base import published_state

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec, indent=2))
    write_checkpoint(out / "checkpoint.pt", published_state(policy), None, type(policy).__name__, env_steps=0,
                     sft=True)
    (out / "sft.json").write_text(json.dumps(history, indent=2, default=float))
    return out
