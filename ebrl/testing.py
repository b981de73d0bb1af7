"""Mock envs, a mock policy and virtual time, for testing schedulers without simulators.

    >>> import ebrl
    >>> from ebrl.testing import Latency, MockEnv, MockPolicy, NoopAlgo, run_virtual
    >>> trainer = ebrl.Trainer(
    ...     env_fn=lambda i: MockEnv(latency=Latency.constant(0.010 if i == 0 else 0.001)),
    ...     policy=MockPolicy(act_dim=4),
    ...     algo=NoopAlgo(),
    ...     config=ebrl.RunConfig(num_envs=4, segment_len=8, total_env_steps=400),
    ... )
    >>> result = run_virtual(trainer)   # exact and fast: the clock is virtual
    >>> result.env_steps, result.accounting_ok()
    (400, True)
    >>> result.steps_per_env[0] < result.steps_per_env[1]   # the slow env holds nobody back
    True
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.policies.base import ActResult
from ebrl.policies.expects import ActionSpec, PolicySpaces
from ebrl.virtual_time import VirtualTimeLoop, virtual_platform
from ebrl.spaces import batch_size

__all__ = ["Latency", "LatencyMode", "MockEnv", "MockPolicy", "NoopAlgo", "RingReach", "VirtualTimeLoop",
           "mock_vector_env", "run_episodes", "run_virtual", "torch_threads", "virtual_platform"]


class LatencyMode(enum.StrEnum):
    SLEEP = "sleep"  # time.sleep: releases the GIL, like a C++ or GPU simulator
    SPIN = "spin"  # a busy Python loop: holds the GIL and burns a core, like a Python env


@dataclass(frozen=True)
class Latency:
    """A step-latency distribution in seconds."""

    kind: str = "constant"
    a: float = 0.0
    b: float = 0.0

    @staticmethod
    def constant(seconds: float) -> "Latency":
        return Latency("constant", seconds)

    @staticmethod
    def uniform(low: float, high: float) -> "Latency":
        return Latency("uniform", low, high)

    @staticmethod
    def lognormal(median: float, sigma: float) -> "Latency":
        """Long-tailed: ``median * exp(sigma * N(0, 1))``."""
        return Latency("lognormal", median, sigma)

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "uniform", "lognormal"):
            raise ValueError(f"Latency.kind={self.kind!r}: must be 'constant', 'uniform' or 'lognormal'")
        if self.a < 0 or self.b < 0 or (self.kind == "uniform" and self.b < self.a):
            raise ValueError(f"Latency({self.kind}, {self.a}, {self.b}): must be non-negative (and low <= high)")

    def sample(self, rng: np.random.Generator) -> float:
        if self.kind == "constant":
            return self.a
        if self.kind == "uniform":
            return float(rng.uniform(self.a, self.b))
        return float(self.a * math.exp(self.b * rng.standard_normal()))

    @property
    def mean(self) -> float:
        if self.kind == "constant":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a * math.exp(self.b**2 / 2)


class MockEnv(gym.Env):
    """A learnable task with a chosen step latency and injectable faults.

    Task: the observation is a target drawn anew each step, uniform in ``[-1, 1]^dim``. With
    ``action="box"`` the reward is ``1 - mean|clip(a) - target|`` (random actions earn about 0.15
    a step, a perfect policy 1.0); with ``action="discrete"`` the observation is a one-hot
    target and the reward is 1 for choosing it. Episodes are truncated after ``episode_len``.

    Latency: each step costs ``latency.sample()`` seconds, slept (``SLEEP``, releases the GIL)
    or spun (``SPIN``, holds it). On a virtual-time loop nothing is slept: the cost is
    declared in ``virtual_step_cost`` and charged by the runtime.

    ``reset_latency`` is slept at every reset (not on a virtual-time loop): the scene rebuild
    of simulators such as LIBERO, whose resets take seconds while steps take milliseconds.

    Faults: ``fail_at_step=k`` raises on this instance's k-th step (counting from 1);
    ``nan_at_step=k`` returns a NaN reward there.
    """

    def __init__(self, dim: int = 4, *, action: str = "box", episode_len: int = 16,
                 latency: Latency = Latency(), latency_mode: LatencyMode | str = LatencyMode.SLEEP,
                 reset_latency: Latency = Latency(), fail_at_step: int | None = None, nan_at_step: int | None = None):
        if action not in ("box", "discrete"):
            raise ValueError(f"MockEnv action={action!r}: must be 'box' or 'discrete'")
        self.dim, self.kind, self.episode_len = dim, action, episode_len
        self.latency, self.latency_mode, self.reset_latency = latency, LatencyMode(latency_mode), reset_latency
        self.fail_at_step, self.nan_at_step = fail_at_step, nan_at_step
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (dim,), np.float32)
        self.action_space = (gym.spaces.Box(-1.0, 1.0, (dim,), np.float32) if action == "box"
                             else gym.spaces.Discrete(dim))
        self.metadata = {"render_modes": [], "ebrl.releases_gil": self.latency_mode is LatencyMode.SLEEP}
        self.steps = 0  # steps of this instance, over all episodes
        self.virtual_step_cost = 0.0
        self._t = 0
        self._rng = np.random.default_rng(0)
        self._lat_rng = np.random.default_rng(1)
        self._target = np.zeros(dim, np.float32)
        self._k = 0

    def _observe(self) -> np.ndarray:
        if self.kind == "box":
            self._target = self._rng.uniform(-1, 1, self.dim).astype(np.float32)
            return self._target.copy()
        self._k = int(self._rng.integers(self.dim))
        obs = np.zeros(self.dim, np.float32)
        obs[self._k] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
            self._lat_rng = np.random.default_rng([seed, 7])
        self._t = 0
        cost = self.reset_latency.sample(self._lat_rng)
        if cost > 0 and not isinstance(asyncio._get_running_loop(), VirtualTimeLoop):
            time.sleep(cost)
        return self._observe(), {}

    def step(self, action: Any):
        self.steps += 1
        cost = self.latency.sample(self._lat_rng)
        self.virtual_step_cost = cost
        if cost > 0 and not isinstance(asyncio._get_running_loop(), VirtualTimeLoop):
            if self.latency_mode is LatencyMode.SLEEP:
                time.sleep(cost)
            else:
                end = time.perf_counter() + cost
                while time.perf_counter() < end:
                    pass
        if self.fail_at_step is not None and self.steps == self.fail_at_step:
            raise RuntimeError(f"MockEnv: injected fault at step {self.steps}")
        if self.kind == "box":
            a = np.clip(np.asarray(action, np.float32), -1.0, 1.0)
            reward = 1.0 - float(np.abs(a - self._target).mean())
        else:
            reward = float(int(action) == self._k)
        if self.nan_at_step is not None and self.steps == self.nan_at_step:
            reward = math.nan
        self._t += 1
        return self._observe(), reward, False, self._t >= self.episode_len, {}


REACH_COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black")


class InstructedReach(gym.Env):
    """A reach task that only the instruction makes solvable: a point in ``[-1, 1]^dim`` must go
    to one of ``tasks`` fixed targets, and which one is said by the ``instruction`` entry
    (a task index, as LIBERO's envs give; :meth:`instructions` has the words). The bring-your-own
    VLA tests and ``ebrl bench vla`` train on it.

    Observation ``{"state": Box(2 * dim) (position, velocity), "instruction": Discrete(tasks)}``;
    action a velocity change in ``[-1, 1]^dim``; reward minus the distance to the target, plus 1
    while within ``0.1`` of it (``info["success"]``); truncated after ``episode_len``. ``latency``
    is slept per step as in :class:`MockEnv` (the simulator's cost).

        >>> env = InstructedReach(tasks=2, dim=2)
        >>> obs, info = env.reset(seed=0)
        >>> sorted(obs), int(obs["instruction"]), env.instructions()
        (['instruction', 'state'], 1, ['reach the red target', 'reach the green target'])
    """

    def __init__(self, tasks: int = 4, dim: int = 2, *, episode_len: int = 32, latency: Latency = Latency(),
                 task: int | None = None):
        if not 1 <= tasks <= len(REACH_COLOURS):
            raise ValueError(f"InstructedReach tasks={tasks!r}: must be 1..{len(REACH_COLOURS)}")
        self.tasks, self.dim, self.episode_len, self.latency, self.fixed_task = tasks, dim, episode_len, latency, task
        angles = 2 * np.pi * np.arange(tasks) / tasks  # targets on a circle (dims past 2 at 0)
        self.targets = np.zeros((tasks, dim), np.float32)
        self.targets[:, 0], self.targets[:, 1 % dim] = 0.7 * np.cos(angles), 0.7 * np.sin(angles)
        self.observation_space = gym.spaces.Dict({
            "state": gym.spaces.Box(-1.0, 1.0, (2 * dim,), np.float32),  # |velocity| stays under 0.2
            "instruction": gym.spaces.Discrete(tasks)})
        self.action_space = gym.spaces.Box(-1.0, 1.0, (dim,), np.float32)
        self.metadata = {"render_modes": [], "ebrl.releases_gil": True}
        self._rng, self._lat_rng = np.random.default_rng(0), np.random.default_rng(1)
        self._pos = np.zeros(dim, np.float32)
        self._vel = np.zeros(dim, np.float32)
        self._task, self._t = 0, 0

    def instructions(self) -> list[str]:
        return [f"reach the {c} target" for c in REACH_COLOURS[:self.tasks]]

    def _obs(self) -> dict:
        return {"state": np.concatenate([self._pos, self._vel]).astype(np.float32), "instruction": self._task}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self._rng, self._lat_rng = np.random.default_rng(seed), np.random.default_rng([seed, 7])
        self._task = int(self._rng.integers(self.tasks)) if self.fixed_task is None else int(self.fixed_task)
        self._pos = self._rng.uniform(-0.3, 0.3, self.dim).astype(np.float32)
        self._vel[:] = 0.0
        self._t = 0
        return self._obs(), {"instruction": self.instructions()[self._task]}

    def step(self, action: Any):
        cost = self.latency.sample(self._lat_rng)
        self.virtual_step_cost = cost
        if cost > 0 and not isinstance(asyncio._get_running_loop(), VirtualTimeLoop):
            time.sleep(cost)
        a = np.clip(np.asarray(action, np.float32), -1.0, 1.0)
        self._vel = 0.5 * self._vel + 0.1 * a
        self._pos = np.clip(self._pos + self._vel, -1.0, 1.0)
        dist = float(np.linalg.norm(self._pos - self.targets[self._task]))
        success = dist < 0.1
        self._t += 1
        return self._obs(), -dist + float(success), False, self._t >= self.episode_len, {"success": success}


class RingReach(gym.Env):
    """A 2-D kinematic reach that small policies learn in seconds: a point in ``[-1, 1]^2`` moved
    by ``p <- clip(p + 0.2 a)``, ``a in [-0.5, 0.5]^2``, from a start uniform in ``[-0.2, 0.2]^2``
    to one of six targets on a ring of radius 0.75; observation ``(p, target)``; reward
    ``-|p - target|`` every step; truncated after ``episode_len`` steps, never terminated.
    ``sparse``: reward 1 at the step that comes within ``tolerance`` of the target, which
    terminates the episode, and 0 at every other step (uniformly random actions get there in about
    one episode of 300 at the default tolerance).

    ``info["success"]``: the point is within ``tolerance`` of the target at this step, or, with
    ``sticky``, at some step of the episode so far (an action chunk's last step reports it then).
    :meth:`expert` is a proportional controller that lands on the target; :meth:`dynamics` and
    :meth:`load` let a planner roll the task forward from an observation; :meth:`expert_demos`
    records its episodes as demonstrations. ``virtual_step_cost``: a step's declared cost on a
    virtual-time loop.

        >>> env = RingReach()
        >>> obs, _ = env.reset(seed=0)
        >>> for _ in range(env.episode_len):
        ...     obs, reward, terminated, truncated, info = env.step(env.expert(obs))
        >>> info["success"], round(abs(reward), 6), truncated  # on the target at the end
        (True, 0.0, True)
    """

    def __init__(self, episode_len: int = 24, *, tolerance: float = 0.05, sticky: bool = False, sparse: bool = False,
                 virtual_step_cost: float = 0.0):
        self.episode_len, self.tolerance, self.sticky, self.sparse = episode_len, tolerance, sticky, sparse
        self.virtual_step_cost = virtual_step_cost
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
        self.action_space = gym.spaces.Box(-0.5, 0.5, (2,), np.float32)
        angles = 2 * np.pi * np.arange(6) / 6 + 0.3
        self.targets = 0.75 * np.stack([np.cos(angles), np.sin(angles)], 1)
        self._rng = np.random.default_rng(0)
        self.pos, self.target, self.t, self.reached = np.zeros(2), self.targets[0], 0, False

    def _obs(self) -> np.ndarray:
        return np.concatenate([self.pos, self.target]).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.pos = self._rng.uniform(-0.2, 0.2, 2)
        self.target, self.t, self.reached = self.targets[self._rng.integers(6)], 0, False
        return self._obs(), {}

    def dynamics(self, action: Any) -> None:
        self.pos = np.clip(self.pos + 0.2 * np.clip(np.asarray(action, np.float64), -0.5, 0.5), -1.0, 1.0)

    def step(self, action: Any):
        self.dynamics(action)
        self.t += 1
        dist = float(np.linalg.norm(self.pos - self.target))
        success = dist < self.tolerance
        self.reached = self.reached or success
        info = {"success": self.reached if self.sticky else success}
        if self.sparse:
            return self._obs(), float(success), success, self.t >= self.episode_len, info
        return self._obs(), -dist, False, self.t >= self.episode_len, info

    @staticmethod
    def expert(obs: np.ndarray) -> np.ndarray:
        """The action towards the target, for one observation or a batch."""
        return np.clip(5.0 * (obs[..., 2:4] - obs[..., :2]), -0.5, 0.5).astype(np.float32)

    def load(self, obs: np.ndarray) -> None:
        """Put the point and the target where ``obs`` says (the step count stays)."""
        self.pos, self.target = obs[:2].astype(np.float64), obs[2:4].astype(np.float64)

    def expert_demos(self, episodes: int, seed: int, noise: float = 0.0):
        """``episodes`` of :meth:`expert` on this env, each from a reset seed drawn from ``seed``, as
        :class:`~ebrl.demos.Demos` (``observation.state``, ``action``, ``next.reward``,
        ``next.done``, ``next.success``). ``noise``: Gaussian noise of that std on each action,
        clipped to the bounds.

            >>> demos = RingReach(sparse=True).expert_demos(3, seed=0)
            >>> demos.num_episodes, bool(demos.frames["next.done"][-1]), float(demos.frames["next.reward"].sum())
            (3, True, 3.0)
        """
        from ebrl.demos.lerobot import Demos

        rng = np.random.default_rng(seed)
        keys = ("observation.state", "action", "next.reward", "next.done", "next.success")
        frames, spans = {k: [] for k in keys}, []
        for _ in range(episodes):
            obs, _ = self.reset(seed=int(rng.integers(1 << 30)))
            start, done = len(frames["action"]), False
            while not done:
                action = self.expert(obs)
                if noise:
                    action = np.clip(action + rng.normal(0.0, noise, 2), -0.5, 0.5).astype(np.float32)
                nxt, reward, terminated, truncated, info = self.step(action)
                done = terminated or truncated
                for k, v in zip(keys, (obs, action, reward, done, info["success"])):
                    frames[k].append(v)
                obs = nxt
            spans.append((start, len(frames["action"])))
        arrays = {k: np.asarray(v, bool if k in ("next.done", "next.success") else np.float32) for k, v in frames.items()}
        return Demos(arrays, spans, ["reach"], fps=10.0)


class MockPolicy:
    """A policy with no network: zero (or seeded random) actions, and a declared virtual cost.

    ``virtual_cost(batch) = base_cost_s + per_item_cost_s * batch`` is charged on a
    virtual-time loop for each generation batch.
    """

    def __init__(self, act_dim: int | None = 4, *, n_actions: int | None = None, random: bool = False,
                 base_cost_s: float = 0.0, per_item_cost_s: float = 0.0, seed: int = 0):
        self.act_dim, self.n_actions, self.random = act_dim, n_actions, random
        self.base_cost_s, self.per_item_cost_s = base_cost_s, per_item_cost_s
        self._rng = np.random.default_rng(seed)
        self.weights_version = 0
        self.batches: list[int] = []

    def act(self, obs: Any) -> ActResult:
        n = batch_size(obs)
        self.batches.append(n)
        if self.n_actions is not None:
            a = self._rng.integers(self.n_actions, size=n) if self.random else np.zeros(n, np.int64)
        elif self.random:
            a = self._rng.uniform(-1, 1, (n, self.act_dim)).astype(np.float32)
        else:
            a = np.zeros((n, self.act_dim), np.float32)
        zeros = np.zeros(n, np.float32)
        return ActResult(actions=a, env_actions=a, logprobs=zeros, values=zeros)

    def virtual_cost(self, batch: int) -> float:
        return self.base_cost_s + self.per_item_cost_s * batch

    def expected_spaces(self) -> PolicySpaces:
        """Its actions, ``Discrete(n_actions)`` or ``Box(act_dim,)``; any observation."""
        if self.n_actions is not None:
            return PolicySpaces(action=ActionSpec(discrete=self.n_actions))
        return PolicySpaces(action=None if self.act_dim is None else ActionSpec(shape=(self.act_dim,)))

    def state_dict(self) -> dict:
        return {"weights_version": self.weights_version}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        self.weights_version = state["weights_version"]


class NoopAlgo:
    """An algorithm that trains nothing but records what it was given.

    ``virtual_cost(steps) = base_cost_s + per_step_cost_s * steps`` is charged per update on a
    virtual-time loop; ``sleep_s`` is slept for real in each update otherwise.
    """

    def __init__(self, *, base_cost_s: float = 0.0, per_step_cost_s: float = 0.0, sleep_s: float = 0.0):
        self.base_cost_s, self.per_step_cost_s, self.sleep_s = base_cost_s, per_step_cost_s, sleep_s
        self.batches: list[Any] = []

    def update(self, policy: Any, batch: Any) -> dict[str, float]:
        self.batches.append(batch)
        if hasattr(policy, "weights_version"):
            policy.weights_version += 1
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return {"num_steps": float(batch.num_steps)}

    def virtual_cost(self, steps: int) -> float:
        return self.base_cost_s + self.per_step_cost_s * steps


def mock_vector_env(num_envs: int, *, autoreset: str = "same_step", **kwargs) -> gym.vector.SyncVectorEnv:
    """``num_envs`` MockEnvs as one vector env (``sim.vector_size = num_envs``), standing in for
    a GPU simulator; under virtual time a step costs what its slowest env declares.

        >>> import ebrl
        >>> from ebrl.testing import MockPolicy, NoopAlgo, mock_vector_env, run_virtual
        >>> cfg = ebrl.RunConfig(num_envs=8, segment_len=4, total_env_steps=160, sim={"vector_size": 4})
        >>> res = run_virtual(ebrl.Trainer(lambda k: mock_vector_env(4), MockPolicy(act_dim=4), NoopAlgo(), cfg))
        >>> res.env_steps, res.accounting_ok()
        (160, True)
    """
    mode = gym.vector.AutoresetMode[autoreset.upper()]  # "same_step" or "disabled"
    return gym.vector.SyncVectorEnv([lambda: MockEnv(**kwargs)] * num_envs, autoreset_mode=mode)


def run_episodes(policy, envs: list[gym.Env], seeds, *, deterministic: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One episode of each of ``envs``, reset on its seed of ``seeds`` and acted in by ``policy``
    (its mode with ``deterministic``, else its samples), side by side: one batched ``act`` a step
    until every episode has ended. Per episode: the return, and whether ``info["success"]`` was set
    at some step."""
    obs = np.stack([env.reset(seed=s)[0] for env, s in zip(envs, seeds)])
    returns, success, done = np.zeros(len(envs)), np.zeros(len(envs), bool), np.zeros(len(envs), bool)
    before, policy.deterministic = policy.deterministic, deterministic
    try:
        while not done.all():
            actions = policy.act(obs).env_actions
            for i, env in enumerate(envs):
                if not done[i]:
                    obs[i], reward, terminated, truncated, info = env.step(actions[i])
                    returns[i] += reward
                    success[i] = success[i] or bool(info.get("success", False))
                    done[i] = terminated or truncated
    finally:
        policy.deterministic = before
    return returns, success


def run_virtual(trainer, **kwargs):
    """``ebrl.run(trainer)`` on a :class:`VirtualTimeLoop` with :func:`virtual_platform`: every
    stage runs inline and charges its declared cost (``MockEnv`` latency, ``virtual_cost`` of
    policy and algorithm) in virtual seconds, on a machine of 2 cores that starts no processes.
    Deterministic, and as fast as the Python code itself."""
    from ebrl.runtime.run import run_sync

    return run_sync(trainer, platform=virtual_platform(), **kwargs)


@contextlib.contextmanager
def torch_threads(n: int = 1):
    """torch on ``n`` intra-op threads inside the block, the caller's count back after it.

    A run under :func:`run_virtual` repeats bit for bit on one machine, but torch's kernels round
    differently on another thread count (a matrix product's sums split across threads), and RL
    carries a last-bit difference into a different policy: a learning test trains and evaluates
    on one thread, whatever the machine's cores (``RunConfig.torch_threads`` only covers the run).

        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with torch_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def save_random_hf_model(path, *, kind: str = "llama", hidden: int = 32, layers: int = 2, heads: int = 4,
                         kv_heads: int = 2, intermediate: int = 64, vocab: int = 512,
                         sentences: tuple[str, ...] = (), initializer_range: float = 0.02, seed: int = 0):
    """Write a randomly initialised Hugging Face model to ``path``, built from a config (nothing is
    downloaded): a Llama causal LM (``kind="llama"``) or a LLaVA image-text model with a tiny CLIP
    vision tower and image processor (``kind="llava"``), with a word-level tokenizer trained on
    OpenVLA's prompt and ``sentences``. For tests and ``ebrl bench vla``; ``path`` then loads as a
    user's own model would (``policy.kind=hf-token``, ``policy.path=...``). Returns the model.
    Needs the ``vla`` extra (transformers)."""
    from pathlib import Path

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if kind not in ("llama", "llava"):
        raise ValueError(f"save_random_hf_model kind={kind!r}: must be 'llama' or 'llava'")
    from ebrl.policies.hf_token import OPENVLA_PROMPT

    path = Path(path)
    words = [OPENVLA_PROMPT.replace("{instruction}", s) for s in sentences] + ["reach the goal", "Out: done"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<image>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    text = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                       initializer_range=initializer_range, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(text)
    else:
        from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

        vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=16, patch_size=8, projection_dim=16)
        model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=4))
        CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


PI0_SENTENCES = ("pick up the red block", "open the drawer and reach the target", "reach the goal",
                 *(f"reach the {c} target" for c in REACH_COLOURS))


def save_random_pi0(path, *, kind: str = "pi0", state_dim: int = 4, action_dim: int = 3, chunk_size: int = 4,
                    cameras: int = 1, image_size: int = 16, patch_size: int = 8, max_dim: int = 8,
                    hidden: int = 32, expert_hidden: int = 24, layers: int = 2, heads: int = 2, head_dim: int = 16,
                    num_steps: int = 3, sentences: tuple[str, ...] = PI0_SENTENCES, state_mean: Any = 0.0,
                    state_std: Any = 1.0, action_mean: Any = 0.0, action_std: Any = 0.5, quantile_stats: bool = False,
                    initializer_range: float = 0.02, seed: int = 0, full_size: bool = False,
                    device: str = "cpu", dtype: Any = None, layout: str = "transformers", tokenizer_dir: Any = None,
                    norm_modes: Any = None, camera_names: Any = None, empty_cameras: int = 0):
    """Write a tiny random π0 (``kind="pi0"``) or π0.5 (``"pi05"``) to ``path`` as transformers
    saves one, built from configs (nothing is downloaded): ``config.json`` and the weights of a
    ``PI0ForConditionalGeneration`` / ``PI05ForConditionalGeneration`` with a Gemma language model
    of ``layers`` layers and width ``hidden``, a SigLIP vision tower of one layer reading
    ``image_size`` pixels square in patches of ``patch_size`` (``(image_size / patch_size)**2``
    tokens per camera), and a Gemma action expert of width ``expert_hidden`` sharing the
    attention layout; a word-level tokenizer trained on the prompts the processor builds from
    ``sentences`` (π0.5's state bins 0..255 included); and the processor's
    ``processor_config.json`` (``PI0Processor`` / ``PI05Processor.save_pretrained``): state and
    action statistics of ``state_dim`` / ``action_dim`` entries (``*_mean``/``*_std``, scalars
    broadcast; π0.5 with ``quantile_stats`` writes ``*_q01``/``*_q99`` = mean -/+ 2 std instead),
    ``max_dim`` (``max_state_dim``), ``chunk_size``, and the image processor's settings (resize to
    fit ``image_size``, pad to it). ``full_size=True`` takes the published architecture instead of
    the tiny one (``PI0Config()``'s defaults: PaliGemma's Gemma 2B and SigLIP So400m at 224 pixels,
    a Gemma 300M expert, chunks of 50 actions of 32 dims, 10 steps; only the vocabulary is the
    small tokenizer's), built on ``device`` in ``dtype``: what ``bench/gpu_pi0.py`` times on a GPU
    when no real checkpoint is at hand. ``cameras`` is only checked: π0 reads any number of cameras,
    which nothing in the directory records. Build and one sample take well under a second.

    ``layout="lerobot"`` writes the same model as a LeRobot policy folder instead
    (:mod:`ebrl.policies.pi0.lerobot`), its tokenizer in ``tokenizer_dir`` (a LeRobot folder holds
    none): features ``observation.images.<name>`` for ``camera_names`` (default ``image``, then
    ``image1``, ...) at ``image_size``, ``observation.state`` and ``action``; ``norm_modes``
    (``{"STATE": mode, "ACTION": mode}``, LeRobot's defaults for the kind otherwise) with every
    statistic LeRobot's datasets keep (``min``/``max`` and ``q01``/``q99`` = mean -/+ 2 std,
    ``q10``/``q90`` = mean -/+ 1.28 std); ``empty_cameras``; the Gemma variants only at full size.
    Returns the model. Needs transformers and PIL."""
    from pathlib import Path

    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ebrl.policies.hf_backbone import pil_pi0_image_processor

    if kind not in ("pi0", "pi05"):
        raise ValueError(f"save_random_pi0 kind={kind!r}: must be 'pi0' or 'pi05'")
    if layout not in ("transformers", "lerobot") or (layout == "lerobot") != (tokenizer_dir is not None):
        raise ValueError(f"save_random_pi0 layout={layout!r}: 'transformers', or 'lerobot' with tokenizer_dir")
    if not (1 <= state_dim <= max_dim and 1 <= action_dim <= max_dim and chunk_size >= 1
            and (cameras >= 1 or camera_names is not None)):
        raise ValueError(f"save_random_pi0: need 1 <= state_dim, action_dim <= max_dim={max_dim}, chunk_size >= 1 "
                         f"and cameras >= 1, got {state_dim}, {action_dim}, {chunk_size}, {cameras}")
    if image_size % patch_size:
        raise ValueError(f"save_random_pi0: image_size={image_size} must be a multiple of patch_size={patch_size}")
    path = Path(path)
    words = [f"Task: {s}, State: ;\nAction: " for s in sentences] + [" ".join(str(i) for i in range(256))]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>")

    def stats(value: Any, n: int) -> list[float]:
        return np.broadcast_to(np.asarray(value, np.float64), (n,)).astype(float).tolist()

    statistics: dict[str, list[float]] = {}
    for name, mean, std, n in (("state", state_mean, state_std, state_dim), ("actions", action_mean, action_std,
                                                                             action_dim)):
        m, s = np.asarray(stats(mean, n)), np.asarray(stats(std, n))
        if kind == "pi05" and quantile_stats:
            statistics.update({f"{name}_q01": (m - 2 * s).tolist(), f"{name}_q99": (m + 2 * s).tolist()})
        else:
            statistics.update({f"{name}_mean": m.tolist(), f"{name}_std": s.tolist()})
    prefix = "PI0" if kind == "pi0" else "PI05"
    if full_size:
        published = getattr(transformers, prefix + "Config")()
        vision_cfg = published.vlm_config.vision_config
        image_size, patch_size = vision_cfg.image_size, vision_cfg.patch_size
        chunk_size, max_dim, num_steps = published.chunk_size, published.max_action_dim, published.num_inference_steps
    tokens = (image_size // patch_size) ** 2
    images = pil_pi0_image_processor(size={"max_height": image_size, "max_width": image_size},
                                     pad_size={"height": image_size, "width": image_size}, image_seq_length=tokens)
    Config, Model, Processor = (getattr(transformers, prefix + name) for name in (
        "Config", "ForConditionalGeneration", "Processor"))
    # the processor adds its image token (and PaliGemma's <loc>/<seg> tokens) to the tokenizer: build it first
    processor = Processor(image_processor=images, tokenizer=tokenizer, max_state_dim=max_dim, chunk_size=chunk_size,
                          **statistics)
    vocab = len(processor.tokenizer)
    text = {"model_type": "gemma", "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 1, "head_dim": head_dim, "vocab_size": vocab,
            "initializer_range": initializer_range}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              # LeRobot's π0 always builds SigLIP So400m's 16 heads: a LeRobot folder records no head count
              "num_attention_heads": 16 if layout == "lerobot" else 2, "image_size": image_size,
              "patch_size": patch_size, "vision_use_head": False}
    vlm = {"model_type": "paligemma", "text_config": text, "vision_config": vision, "projection_dim": hidden,
           "image_token_id": processor.image_token_id, "vocab_size": vocab}
    # the expert shares the language model's attention (its keys and values): same layers, heads, head_dim
    expert = {"model_type": "gemma", "hidden_size": expert_hidden, "intermediate_size": 2 * expert_hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 1, "head_dim": head_dim,
              "initializer_range": initializer_range}
    if full_size:
        vlm = published.vlm_config.to_dict()
        vlm.update(image_token_id=processor.image_token_id, vocab_size=vocab)
        vlm["text_config"]["vocab_size"] = vocab
        expert = published.dit_config.to_dict()
    extra = {"max_state_dim": max_dim} if kind == "pi0" else {}
    config = Config(vlm_config=vlm, dit_config=expert, chunk_size=chunk_size, max_action_dim=max_dim,
                    num_inference_steps=num_steps, **extra)
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if dtype is not None and dtype.is_floating_point:  # built in dtype: a full-size float32 copy is 11 GB
            torch.set_default_dtype(dtype)
        try:
            model = Model(config)
        finally:
            torch.set_default_dtype(default_dtype)
        if dtype is not None:
            model = model.to(dtype)
        if kind == "pi05":  # π0.5 zero-initialises its expert's adaptive norms: every gate shut, the prefix unread
            for module in model.modules():
                if type(module).__name__ == "PI05AdaptiveRMSNorm":
                    torch.nn.init.normal_(module.dense.weight, 0.0, 0.3)
    if layout == "lerobot":
        _save_lerobot_pi0(path, kind, model, processor.tokenizer, tokenizer_dir, state_dim=state_dim,
                          action_dim=action_dim, image_size=image_size, stats=(state_mean, state_std, action_mean,
                                                                               action_std),
                          norm_modes=norm_modes,
                          camera_names=([f"image{i or ''}" for i in range(cameras)] if camera_names is None
                                        else camera_names),
                          empty_cameras=empty_cameras, max_dim=max_dim)
        return model
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model


def _save_lerobot_pi0(path, kind, model, tokenizer, tokenizer_dir, *, state_dim, action_dim, image_size, stats,
                      norm_modes, camera_names, empty_cameras, max_dim):
    """``save_random_pi0(layout="lerobot")``'s folder."""
    from pathlib import Path

    import torch

    from ebrl.policies.pi0.lerobot import (ACTION, DEFAULT_NORMALIZATION, OBS_IMAGES, OBS_STATE, lerobot_config,
                                           write_folder)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    modes = {**DEFAULT_NORMALIZATION[kind], **(norm_modes or {})}

    def all_stats(mean, std, n):
        m = torch.as_tensor(np.broadcast_to(np.asarray(mean, np.float32), (n,)).copy())
        s = torch.as_tensor(np.broadcast_to(np.asarray(std, np.float32), (n,)).copy())
        return {"mean": m, "std": s, "min": m - 2 * s, "max": m + 2 * s, "q01": m - 2 * s, "q99": m + 2 * s,
                "q10": m - 1.28 * s, "q90": m + 1.28 * s}

    state_mean, state_std, action_mean, action_std = stats
    inputs = {f"{OBS_IMAGES}.{name}": {"type": "VISUAL", "shape": [3, image_size, image_size]} for name in camera_names}
    inputs.update({f"{OBS_IMAGES}.empty_camera_{i}": {"type": "VISUAL", "shape": [3, image_size, image_size]}
                   for i in range(empty_cameras)})
    inputs[OBS_STATE] = {"type": "STATE", "shape": [state_dim]}
    config = lerobot_config(kind, model.config, inputs, {ACTION: {"type": "ACTION", "shape": [action_dim]}},
                            state_mode=modes["STATE"], action_mode=modes["ACTION"], max_state_dim=max_dim)
    config["empty_cameras"] = int(empty_cameras)
    write_folder(path, config, model.state_dict(), {OBS_STATE: all_stats(state_mean, state_std, state_dim),
                                                    ACTION: all_stats(action_mean, action_std, action_dim)})
    tokenizer.save_pretrained(str(tokenizer_dir))
