"""The second peer: PPO written as CleanRL writes it (``ppo_continuous_action.py``), called as a function.

What a user would otherwise run: a gymnasium ``SyncVectorEnv`` stepped in this process, CleanRL's own
torch ``Agent`` (separate 64-64 tanh MLP actor and critic, orthogonal init, state-independent log std),
CleanRL's own PPO loop (GAE, per-minibatch advantage normalisation, clipped surrogate, clipped value
loss, Adam with ``eps=1e-5``, linear learning-rate annealing, gradient-norm clipping), and torch's
thread count left where CleanRL leaves it: untouched, i.e. torch's default of one thread per core.
Nothing of EBRL is imported.

How it differs from ``gym_vector.py``'s peer: that one is a *same-policy control* that steps the same
``SyncVectorEnv``/``AsyncVectorEnv`` but acts with EBRL's ``MLPPolicy`` (NumPy fast path, observation
normalisation) and trains with EBRL's ``PPO`` under ``torch.set_num_threads(1)``, so the difference to
EBRL measures scheduling alone. This peer measures the whole stack a user would run instead: torch
forward passes for every action, CleanRL's tensor handling and torch's default threading.

Choices, each kept as close to CleanRL as the benchmark allows:

- Autoreset: ``AutoresetMode.SAME_STEP``. CleanRL's loop was written for gymnasium 0.29, whose vector
  envs reset in the same step; under gymnasium 1.x's default ``NEXT_STEP`` the same loop would store a
  bogus transition (the reset step) after every episode end. A time-limit end (truncated, not
  terminated) bootstraps as CleanRL's gymnasium-1.x derivatives do: ``gamma * V(info["final_obs"])``
  is added to that step's reward, and the step still ends the episode for GAE. EBRL's segments and
  ``gym_vector.py`` bootstrap the same way.
- Wrappers: CleanRL's ``NormalizeObservation``/``NormalizeReward`` (and their clipping) are *off* by
  default (``Args.normalize = False``). EBRL's PPO scales rewards and its MLP normalises observations
  inside the batched computation, whereas these are per-env Python wrappers whose per-step cost the
  benchmark would attribute to the peer; ``normalize=True`` adds them exactly as CleanRL does
  (with ``RecordEpisodeStatistics`` beneath them, so ``mean_return`` stays in raw reward).
  ``FlattenObservation`` and ``ClipAction`` are applied once to the whole batch (a reshape and an
  ``np.clip`` to the action-space bounds before ``envs.step``): the same result as the per-env
  wrappers, without a Python call per env per step. The stored action, its log-probability and the
  PPO ratio use the unclipped sample, as in CleanRL.
- Global state: ``torch.manual_seed(seed)`` and ``torch.backends.cudnn.deterministic`` as CleanRL;
  ``torch.set_num_threads`` is never called. Minibatch shuffling uses a local NumPy generator seeded
  with ``seed`` instead of CleanRL's ``np.random.seed`` (which would reseed everyone's global NumPy
  RNG in a shared benchmark process).
- Device: ``Args.cuda = False`` (CleanRL's default is ``True``) so the peer runs where the
  benchmark's EBRL runners run; pass ``cuda=True`` for CleanRL's behaviour.
- Observations must be ``Box`` (flattened); a ``Dict`` observation space raises ``ValueError``.
  ``Box`` actions use CleanRL's Normal agent, ``Discrete`` actions CleanRL's ``ppo.py`` Categorical one.

Example (``bench/`` is not a package: load this file by path, or run from ``bench/peers/``)::

    from ebrl.testing import MockEnv
    from cleanrl_ppo import run_cleanrl

    out = run_cleanrl(lambda i: MockEnv(dim=3, episode_len=12), num_envs=4, segment_len=8,
                      total_env_steps=96, minibatch_size=16)
    print(out["env_steps"], out["updates"], round(out["steps_per_s"]))   # 96 3 ...
"""

# No `from __future__ import annotations`: the file is loaded by path without a sys.modules entry, and
# dataclasses then cannot resolve string annotations.
import math
import time
from collections import deque
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from torch import nn, optim
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal


@dataclass
class Args:
    seed: int = 0
    """seed of the experiment (env ``i`` is reset with ``seed + i``)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """if toggled (and CUDA is available), the agent runs on the GPU; CleanRL's default is True"""

    # Algorithm specific arguments
    total_timesteps: int = 1000000
    """total env steps; training stops after the first iteration that reaches it"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments"""
    num_steps: int = 2048
    """the number of steps to run in each environment per policy rollout (EBRL's segment_len)"""
    anneal_lr: bool = True
    """Toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    minibatch_size: int = 512
    """the mini-batch size (CleanRL derives num_minibatches = batch_size // minibatch_size from it)"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """Toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """Toggles whether or not to use a clipped loss for the value function, as per the paper."""
    ent_coef: float = 0.0
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold"""
    normalize: bool = False
    """CleanRL's per-env NormalizeObservation/NormalizeReward wrappers (with clipping to [-10, 10]);
    off by default: see the module docstring"""

    # to be filled in runtime
    batch_size: int = 0
    """the batch size (computed in runtime)"""
    num_minibatches: int = 0
    """the number of mini-batches (computed in runtime)"""
    num_iterations: int = 0
    """the number of iterations (computed in runtime)"""


def make_env(env_fn, idx: int, args: Args):
    def thunk():
        env = env_fn(idx)
        if args.normalize:  # CleanRL's wrappers, in CleanRL's order (Flatten/ClipAction are done batched)
            env = gym.wrappers.RecordEpisodeStatistics(env)
            env = gym.wrappers.NormalizeObservation(env)
            env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
            env = gym.wrappers.NormalizeReward(env, gamma=args.gamma)
            env = gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))
        return env

    return thunk


def layer_init(layer, std=2**0.5, bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """CleanRL's ``ppo_continuous_action.py`` agent: Normal policy with a state-independent log std."""

    def __init__(self, obs_dim: int, act_dim: int):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, act_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        action_mean = self.actor_mean(x)
        action_logstd = self.actor_logstd.expand_as(action_mean)
        action_std = torch.exp(action_logstd)
        probs = Normal(action_mean, action_std)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


class DiscreteAgent(nn.Module):
    """CleanRL's ``ppo.py`` agent: Categorical policy over ``n`` actions."""

    def __init__(self, obs_dim: int, n: int):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def run_cleanrl(env_fn, *, num_envs: int, segment_len: int, total_env_steps: int, seed: int = 0,
                lr: float = 3e-4, update_epochs: int = 4, minibatch_size: int = 512, gamma: float = 0.99,
                gae_lambda: float = 0.95, on_update=None, **overrides) -> dict:
    """Train CleanRL's PPO on ``num_envs`` copies of ``env_fn(i)`` (EBRL's convention: ``env_fn``
    takes the env index), ``segment_len`` steps per env per iteration, until at least
    ``total_env_steps`` env steps (whole iterations of ``num_envs * segment_len``).

    ``overrides`` sets any other :class:`Args` field (``clip_coef``, ``ent_coef``, ``anneal_lr``,
    ``normalize``, ``cuda``, ...); an unknown name raises ``TypeError``. Returns the keys
    ``gym_vector.run_peer`` returns: ``wall_s`` runs from building the vector env to closing it
    (training included), ``rollout_s`` is acting plus stepping plus GAE, ``train_s`` the PPO epochs,
    ``mean_return`` the mean over the last 100 finished episodes (NaN if none finished).

    ``on_update(row)``, if given, is called after every update with ``time`` (seconds since the
    start), ``env_steps``, ``mean_return`` and ``success_once`` (of the last 100 episodes, from
    ``info["is_success"]``; None without it), as EBRL's history rows; returning True stops the
    training there (benchmarks cap a run's wall time this way).
    """
    N, T = int(num_envs), int(segment_len)
    if N < 1 or T < 1 or total_env_steps < 1:
        raise ValueError(f"num_envs={num_envs}, segment_len={segment_len} and total_env_steps={total_env_steps} "
                         f"must be >= 1")
    args = Args(seed=seed, total_timesteps=int(total_env_steps), learning_rate=lr, num_envs=N, num_steps=T,
                gamma=gamma, gae_lambda=gae_lambda, minibatch_size=int(minibatch_size),
                update_epochs=int(update_epochs), **overrides)
    args.batch_size = int(args.num_envs * args.num_steps)
    args.num_minibatches = max(1, args.batch_size // args.minibatch_size)
    args.minibatch_size = int(args.batch_size // args.num_minibatches)
    args.num_iterations = -(-args.total_timesteps // args.batch_size)  # ceil: the first iteration reaching it

    # TRY NOT TO MODIFY: seeding
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    episode_returns: deque[float] = deque(maxlen=100)  # the last 100 finished episodes
    global_step = updates = 0
    rollout_s = train_s = 0.0
    first_step = first_update = math.nan  # start-up, as EBRL reports it (RunResult.first_step_s)
    steps_at_first_update = 0
    t_start = time.perf_counter()
    envs = None
    try:
        # env setup
        envs = gym.vector.SyncVectorEnv([make_env(env_fn, i, args) for i in range(args.num_envs)],
                                        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
        obs_space, act_space = envs.single_observation_space, envs.single_action_space
        if not isinstance(obs_space, gym.spaces.Box):
            msg = f"the CleanRL peer takes Box observations (flattened), not {type(obs_space).__name__}: {obs_space}"
            raise ValueError(msg)  # noqa: TRY004
        obs_shape = (int(np.prod(obs_space.shape)),)
        if isinstance(act_space, gym.spaces.Box):
            act_shape = (int(np.prod(act_space.shape)),)
            agent = Agent(obs_shape[0], act_shape[0]).to(device)
            low, high = act_space.low.reshape(-1), act_space.high.reshape(-1)
        elif isinstance(act_space, gym.spaces.Discrete):
            act_shape = ()
            agent = DiscreteAgent(obs_shape[0], int(act_space.n)).to(device)
        else:
            raise ValueError(f"the CleanRL peer takes Box or Discrete actions, not {act_space}")  # noqa: TRY004
        optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

        # ALGO Logic: Storage setup
        obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape).to(device)
        actions = torch.zeros((args.num_steps, args.num_envs) + act_shape).to(device)
        logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
        rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
        dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
        values = torch.zeros((args.num_steps, args.num_envs)).to(device)
        ep_ret = np.zeros(args.num_envs)
        ep_success = np.zeros(args.num_envs, bool)  # for on_update: succeeded at any step of the episode
        episode_success: deque[float] = deque(maxlen=100)
        has_success = False

        # TRY NOT TO MODIFY: start the game
        next_obs, _ = envs.reset(seed=[args.seed + i for i in range(args.num_envs)])
        next_obs = torch.Tensor(next_obs.reshape(args.num_envs, -1)).to(device)
        next_done = torch.zeros(args.num_envs).to(device)

        for iteration in range(1, args.num_iterations + 1):
            t0 = time.perf_counter()
            # Annealing the rate if instructed to do so.
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / args.num_iterations
                lrnow = frac * args.learning_rate
                optimizer.param_groups[0]["lr"] = lrnow

            for step in range(args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done

                # ALGO LOGIC: action logic
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                    values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob

                # TRY NOT TO MODIFY: execute the game and log data.
                env_action = action.cpu().numpy()
                if act_shape:  # ClipAction, batched
                    env_action = np.clip(env_action, low, high).reshape((args.num_envs, *act_space.shape))
                next_obs, reward, terminations, truncations, infos = envs.step(env_action)
                if first_step != first_step:  # NaN: this is the first
                    first_step = time.perf_counter() - t_start
                next_done = np.logical_or(terminations, truncations)
                step_reward = torch.tensor(reward, dtype=torch.float32).to(device).view(-1)
                # time-limit ends bootstrap from the final observation (same-step autoreset)
                trunc_only = np.flatnonzero(truncations & ~terminations)
                if len(trunc_only):
                    final_obs = np.stack([infos["final_obs"][i] for i in trunc_only]).reshape(len(trunc_only), -1)
                    with torch.no_grad():
                        final_value = agent.get_value(torch.Tensor(final_obs).to(device)).flatten()
                    step_reward[torch.as_tensor(trunc_only)] += args.gamma * final_value
                rewards[step] = step_reward
                next_obs = torch.Tensor(next_obs.reshape(args.num_envs, -1)).to(device)

                # episode returns in raw reward (RecordEpisodeStatistics' when the reward is normalised)
                if args.normalize:
                    final_info = infos.get("final_info", {})
                    if "episode" in final_info:
                        for i in np.flatnonzero(final_info["_episode"]):
                            episode_returns.append(float(final_info["episode"]["r"][i]))
                else:
                    ep_ret += reward
                    for i in np.flatnonzero(next_done):
                        episode_returns.append(float(ep_ret[i]))
                        ep_ret[i] = 0.0
                if on_update is not None:  # not CleanRL's: the benchmark's success curve
                    ok = infos.get("is_success")
                    if ok is None and "final_info" in infos:
                        ok = infos["final_info"].get("is_success")
                    if ok is not None:
                        has_success = True
                        ep_success |= np.asarray(ok, bool)
                    for i in np.flatnonzero(next_done):
                        episode_success.append(float(ep_success[i]))
                        ep_success[i] = False
                next_done = torch.Tensor(next_done).to(device)

            # bootstrap value if not done
            with torch.no_grad():
                next_value = agent.get_value(next_obs).reshape(1, -1)
                advantages = torch.zeros_like(rewards).to(device)
                lastgaelam = 0
                for t in reversed(range(args.num_steps)):
                    if t == args.num_steps - 1:
                        nextnonterminal = 1.0 - next_done
                        nextvalues = next_value
                    else:
                        nextnonterminal = 1.0 - dones[t + 1]
                        nextvalues = values[t + 1]
                    delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                    advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                returns = advantages + values

            # flatten the batch
            b_obs = obs.reshape((-1,) + obs_shape)
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape((-1,) + act_shape)
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values.reshape(-1)
            t1 = time.perf_counter()

            # Optimizing the policy and value network
            b_inds = np.arange(args.batch_size)
            for epoch in range(args.update_epochs):
                rng.shuffle(b_inds)
                for start in range(0, args.batch_size, args.minibatch_size):
                    end = start + args.minibatch_size
                    mb_inds = b_inds[start:end]

                    mb_actions = b_actions[mb_inds] if act_shape else b_actions.long()[mb_inds]  # ppo.py: .long()
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], mb_actions)
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()

                    with torch.no_grad():
                        # calculate approx_kl http://joschu.net/blog/kl-approx.html
                        approx_kl = ((ratio - 1) - logratio).mean()

                    mb_advantages = b_advantages[mb_inds]
                    if args.norm_adv:
                        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

                    # Policy loss
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                    # Value loss
                    newvalue = newvalue.view(-1)
                    if args.clip_vloss:
                        v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                        v_clipped = b_values[mb_inds] + torch.clamp(
                            newvalue - b_values[mb_inds],
                            -args.clip_coef,
                            args.clip_coef,
                        )
                        v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                        v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
                        v_loss = 0.5 * v_loss_max.mean()
                    else:
                        v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

                    entropy_loss = entropy.mean()
                    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()

                if args.target_kl is not None and approx_kl > args.target_kl:
                    break
            updates += 1
            if updates == 1:
                first_update, steps_at_first_update = time.perf_counter() - t_start, global_step
            rollout_s += t1 - t0
            train_s += time.perf_counter() - t1
            if on_update is not None and on_update({
                    "time": time.perf_counter() - t_start, "env_steps": global_step, "update": updates,
                    "mean_return": float(np.mean(episode_returns)) if episode_returns else math.nan,
                    "success_once": (float(np.mean(episode_success)) if has_success and episode_success else None)}):
                break
    finally:
        if envs is not None:
            envs.close()
    wall_s = time.perf_counter() - t_start
    steady_s = wall_s - first_update
    startup = {"first_step_s": first_step, "first_update_s": first_update,
               "steady_steps_per_s": (global_step - steps_at_first_update) / steady_s if steady_s > 0 else math.nan}
    return {"peer": "cleanrl", "env_steps": global_step, "wall_s": wall_s,
            "steps_per_s": global_step / wall_s, "rollout_s": rollout_s, "train_s": train_s,
            "rollout_steps_per_s": global_step / rollout_s if rollout_s > 0 else math.nan,
            "updates": updates, **startup,
            "mean_return": float(np.mean(episode_returns)) if episode_returns else math.nan}
