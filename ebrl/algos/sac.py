"""SAC (soft actor-critic) and RLPD as EBRL algorithms: ``update(policy, batch) -> metrics``.

Each :meth:`SAC.update` first adds the batch's valid steps to the algorithm's own
:class:`~ebrl.algos.replay.ReplayBuffer` as n-step transitions (:mod:`ebrl.algos.transitions`:
correct at terminations, truncations and segment ends, action chunks included), then takes
``utd_ratio`` gradient steps per new transition (SAC's and RLPD's update-to-data ratio; a
fraction carries over to the next update) once ``learning_starts`` transitions are stored, each
on ``batch_size`` transitions drawn from the replay (and, with demonstrations, ``demo_ratio`` of
them from those). SAC declares ``RunNeeds(stream=True)``: under the async schedule the runtime
streams (``segment_cut="stream"``), handing it every step recorded since its last update as soon
as it is ready, at least one step per env, so transitions reach the replay while their segments
are still open and the learner updates at its own pace; the policy's weights are published
after each update as for PPO, on the thread and the process learner alike.

The actor is the policy's squashed Gaussian head (``action_head="squashed"`` on
:class:`~ebrl.policies.MLPPolicy` or :class:`~ebrl.policies.CNNPolicy`): SAC calls
``policy.features(obs)`` and ``policy.rsample(features)``. The critics
(:class:`~ebrl.algos.critics.QEnsemble`, ``num_critics`` of them, two for SAC) read the
policy's features and the action scaled to ``[-1, 1]``. Where the features have weights of
their own (a CNN's encoders and trunk) the critics' loss trains them and the actor's reads them
detached, with DrQ's random shift on the cameras and a Polyak-averaged target encoder (DrQ,
Kostrikov et al. 2020); the policy's value head is not used. The temperature ``alpha`` follows
the entropy target ``-|A|`` (Haarnoja et al. 2018b).

RLPD (Ball et al. 2023) is SAC with LayerNorm critics, an ensemble of 10 whose target takes the
minimum of a random 2, a high update-to-data ratio and each minibatch half demonstrations:
:class:`RLPD` sets those defaults (``demos`` loaded by :meth:`SAC.load_demos`).

    >>> import gymnasium as gym, torch
    >>> from ebrl.algos import SAC, Batch
    >>> from ebrl.policies import MLPPolicy
    >>> policy = MLPPolicy(3, 2, action_head="squashed", action_low=-1.0, action_high=1.0, seed=0)
    >>> S, T = 4, 8
    >>> no = torch.zeros(S, T, dtype=torch.bool)
    >>> batch = Batch(torch.randn(S, T, 3), torch.rand(S, T, 2) * 2 - 1, torch.zeros(S, T), torch.zeros(S, T),
    ...               torch.randn(S, T), no, no, torch.ones(S, T, dtype=torch.bool),
    ...               torch.zeros(S, T, dtype=torch.long), torch.randn(S, 3), torch.zeros(0, 3),
    ...               torch.zeros(0, 2, dtype=torch.long))
    >>> sac = SAC(batch_size=16, learning_starts=16, critic_hidden=(32, 32))
    >>> m = sac.update(policy, batch)
    >>> m["replay_size"], m["gradient_steps"], m["num_steps"]
    (32.0, 32.0, 32.0)
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.algos.batch import Batch
from ebrl.algos.critics import QEnsemble, augment_images
from ebrl.algos.minibatch import refuse_unknown
from ebrl.algos.needs import RunNeeds
from ebrl.algos.ppo import Checks
from ebrl.algos.replay import ReplayBuffer, load_demos, sample_mixed
from ebrl.algos.transitions import batch_transitions
from ebrl.spaces import tree_map


@dataclass
class SACConfig:
    lr: float = 3e-4  # the actor's Adam
    critic_lr: float | None = None  # None: lr
    alpha_lr: float | None = None  # the temperature's; None: lr
    gamma: float = 0.99
    tau: float = 0.005  # Polyak rate of the target critics (and target encoder)
    n_step: int = 1  # rewards summed per transition before bootstrapping
    batch_size: int = 256
    utd_ratio: float = 1.0  # gradient steps per new transition (RLPD: 20)
    learning_starts: int = 1000  # transitions stored before the first gradient step
    buffer_size: int = 1_000_000
    buffer_dir: str | None = None  # keep the replay as memory maps in this directory
    actor_update_every: int = 1  # the actor and temperature step once per this many critic steps
    init_alpha: float = 1.0
    autotune_alpha: bool = True  # False: alpha stays init_alpha
    target_entropy: float | None = None  # None: -(action dims)
    critic_hidden: tuple[int, ...] = (256, 256)
    num_critics: int = 2
    critic_subset: int = 2  # the target's min is over a random subset of this many critics
    critic_layernorm: bool = False
    actor_q: str = "min"  # the actor maximises the critics' "min" (SAC) or "mean" (RLPD)
    backup_entropy: bool = True  # the target subtracts alpha * log-prob of the next action
    max_grad_norm: float = math.inf
    image_pad: int = 4  # DrQ's random shift of camera frames, in pixels; 0: none
    demo_ratio: float = 0.5  # of each minibatch, when there are demonstrations
    seed: int = 0

    def __post_init__(self) -> None:
        self.critic_hidden = tuple(self.critic_hidden)
        ck = Checks(self)
        for name in ("lr", "gamma", "tau", "utd_ratio", "init_alpha"):
            ck.check(name, ck.num(name) > 0, "> 0")
        for name in ("critic_lr", "alpha_lr"):
            if getattr(self, name) is not None:
                ck.check(name, ck.num(name) > 0, "> 0 (or None: lr)")
        ck.check("gamma", self.gamma <= 1, "in (0, 1]")
        ck.check("tau", self.tau <= 1, "in (0, 1]")
        for name, low in (("n_step", 1), ("batch_size", 1), ("learning_starts", 0), ("buffer_size", 1),
                          ("actor_update_every", 1), ("num_critics", 1), ("critic_subset", 1), ("image_pad", 0),
                          ("seed", 0)):
            ck.check(name, ck.integer(name) >= low, f"an int >= {low}")
        ck.check("critic_subset", self.critic_subset <= self.num_critics, f"at most num_critics ({self.num_critics})")
        ck.check("critic_hidden", len(self.critic_hidden) > 0 and all(
            isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in self.critic_hidden), "positive ints")
        ck.check("actor_q", self.actor_q in ("min", "mean"), "'min' or 'mean'")
        ck.check("demo_ratio", 0 <= ck.num("demo_ratio") < 1, "in [0, 1)")
        ck.check("max_grad_norm", ck.num("max_grad_norm") > 0, "> 0 (math.inf: no clipping)")
        if self.target_entropy is not None:
            ck.num("target_entropy")
        for name in ("autotune_alpha", "backup_entropy", "critic_layernorm"):
            ck.check(name, isinstance(getattr(self, name), bool), "true or false")


@dataclass
class RLPDConfig(SACConfig):
    """RLPD's settings (Ball et al. 2023, their locomotion and manipulation runs)."""

    utd_ratio: float = 20.0
    num_critics: int = 10
    critic_subset: int = 2
    critic_layernorm: bool = True
    actor_q: str = "mean"
    learning_starts: int = 5000


class SAC:
    """Soft actor-critic on the runtime's batches (module docstring). ``demos``: a
    :class:`~ebrl.algos.replay.ReplayBuffer` of demonstrations (:meth:`load_demos` makes one
    with this algorithm's ``gamma`` and ``n_step``)."""

    config_class = SACConfig
    # every step reaches the replay at the learner's next update, not when its segment is full
    run_needs = RunNeeds(stream=True, why="it stores each step as it arrives")

    def __init__(self, config: SACConfig | None = None, *, demos: ReplayBuffer | None = None, **overrides):
        name = type(self).__name__
        refuse_unknown(name, self.config_class, overrides, ("demos",))
        self.config = dataclasses.replace(config or self.config_class(), **overrides)
        c = self.config
        self.replay = ReplayBuffer(c.buffer_size, directory=c.buffer_dir)
        self.demos = demos
        self.critic: QEnsemble | None = None
        self.critic_target: QEnsemble | None = None
        self.log_alpha = torch.tensor(math.log(c.init_alpha))
        self.updates = 0  # calls of update()
        self.grad_steps = 0  # critic steps taken
        self._owed = 0.0  # gradient steps earned by data and not yet taken (a fraction)
        self._rng = np.random.default_rng(c.seed)  # minibatch draws
        self._gen = torch.Generator().manual_seed(c.seed)  # augmentation, critic subsets
        self._noise = self._gen  # the actions' noise (a generator on the policy's device, from _setup)
        self._policy: nn.Module | None = None
        self._pending: dict | None = None  # a state loaded before the critics were built
        self._target_policy: nn.Module | None = None  # the target encoder (features with weights)
        self._optimizers: dict[str, torch.optim.Optimizer] = {}

    # ---- demonstrations ----------------------------------------------------------------------

    def load_demos(self, demos: Any, observation_space, action_shape: tuple[int, ...],
                   time_limit: int | None = None) -> ReplayBuffer:
        """Load ``demos`` (a LeRobot dataset directory, or :class:`~ebrl.demos.Demos`) for an env of
        ``observation_space`` into :attr:`demos`, as n-step transitions of this ``gamma``
        (``time_limit``: the env's, to tell a time limit from a termination at an episode's end)."""
        c = self.config
        self.demos = load_demos(demos, observation_space, action_shape, gamma=c.gamma, n_step=c.n_step,
                                time_limit=time_limit)
        return self.demos

    # ---- building what trains ----------------------------------------------------------------

    def _setup(self, policy: nn.Module, device: torch.device) -> None:
        """Bind to ``policy``: the critics (built once, on the first data), the target encoder,
        fresh optimisers (a restored state's where one is pending)."""
        name = type(self).__name__
        if not callable(getattr(policy, "rsample", None)) or not getattr(policy, "squashed", False):
            raise ValueError(f"{name} needs a policy with a squashed Gaussian head: MLPPolicy or CNNPolicy with "
                             "action_head='squashed' (ebrl train: --set policy.action_head='\"squashed\"')")
        c = self.config
        probe = self.replay.gather(np.arange(min(2, len(self.replay))), device)
        feats = policy.features(probe["obs"])
        act_dims = int(np.prod(probe["actions"].shape[1:]))
        if act_dims != policy.act_dim:
            raise ValueError(f"{name}: the batch's actions have {tuple(probe['actions'].shape[1:])} numbers, the "
                             f"policy's head {policy.act_dim}")
        params = [p for p in policy.parameters() if p.requires_grad]
        used = torch.autograd.grad(feats.sum(), params, allow_unused=True) if feats.requires_grad else [None] * len(params)
        encoder = [p for p, g in zip(params, used) if g is not None]
        action, logp = policy.rsample(feats.detach())
        used = torch.autograd.grad(action.sum() + logp.sum(), params, allow_unused=True)
        actor = [p for p, g in zip(params, used) if g is not None]
        if self.critic is None:
            gen = torch.Generator().manual_seed(c.seed + 1)
            self.critic = QEnsemble(feats.shape[1] + act_dims, hidden=c.critic_hidden, members=c.num_critics,
                                    layer_norm=c.critic_layernorm, generator=gen)
            self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
            self.target_entropy = -float(act_dims) if c.target_entropy is None else float(c.target_entropy)
        self.critic.to(device)
        self.critic_target.to(device)
        self.log_alpha = nn.Parameter(self.log_alpha.detach().to(device))
        self._encoder_names = {n for n, p in policy.named_parameters() if any(p is q for q in encoder)}
        self._target_policy = copy.deepcopy(policy).requires_grad_(False) if encoder else None
        self._optimizers = {
            "critic": torch.optim.Adam([*self.critic.parameters(), *encoder], lr=c.critic_lr or c.lr, foreach=True),
            "actor": torch.optim.Adam(actor, lr=c.lr, foreach=True),
            "alpha": torch.optim.Adam([self.log_alpha], lr=c.alpha_lr or c.lr)}
        # the actions' noise on the policy's device (a restored stream where one was saved there)
        self._noise = torch.Generator(device).manual_seed(c.seed * 1_000_003 + self.grad_steps + 2)
        if (saved := (self._pending or {}).get("noise")) is not None and saved[0] == device.type:
            self._noise.set_state(saved[1])
        self._policy = policy
        if self._pending is not None:
            self._apply(self._pending, device)
            self._pending = None

    def _apply(self, state: dict, device: torch.device) -> None:
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"].to(device))
        if self._target_policy is not None and state.get("target_encoder") is not None:
            self._target_policy.load_state_dict(state["target_encoder"], strict=False)
        for k, opt in self._optimizers.items():
            if state["optimizers"].get(k) is not None:
                opt.load_state_dict(state["optimizers"][k])

    # ---- state (checkpoints, and the learner process handing its state back) -----------------

    def state_dict(self) -> dict:
        """The critics, their targets, the temperature, the optimisers, the counters and RNGs;
        not the replay (a resumed run refills it)."""
        counters = {"updates": self.updates, "grad_steps": self.grad_steps, "owed": self._owed,
                    "rng": self._rng.bit_generator.state, "gen": self._gen.get_state()}
        if self._pending is not None:  # loaded, not yet applied: still what the next update starts from
            return {**self._pending, **counters}
        modules = {n.split(".")[0] for n in self._encoder_names} if self._target_policy is not None else ()
        return {"critic": None if self.critic is None else self.critic.state_dict(),
                "critic_target": None if self.critic_target is None else self.critic_target.state_dict(),
                "log_alpha": self.log_alpha.detach().cpu().clone(), **counters,
                "target_encoder": {k: v for k, v in self._target_policy.state_dict().items()
                                   if k.split(".")[0] in modules} if modules else None,
                "optimizers": {k: o.state_dict() for k, o in self._optimizers.items()},
                "noise": None if self._noise is self._gen else (self._noise.device.type, self._noise.get_state())}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; critics and optimisers apply at the next update."""
        self.updates, self.grad_steps, self._owed = state["updates"], state["grad_steps"], state["owed"]
        self._rng.bit_generator.state = state["rng"]
        self._gen.set_state(state["gen"])
        self.log_alpha = state["log_alpha"].detach().clone()
        self._pending = state if state["critic"] is not None else None
        self._policy = None

    def reset_optimizer(self) -> None:
        """Fresh optimisers at the next update (after an update undone for NaN/inf)."""
        if self._pending is not None:
            self._pending = {**self._pending, "optimizers": {}}
        self._policy = None

    # ---- the losses --------------------------------------------------------------------------

    @property
    def alpha(self) -> float:
        return float(self.log_alpha.detach().exp())

    def _critic_action(self, policy: nn.Module, actions: Tensor) -> Tensor:
        """Actions scaled to ``[-1, 1]`` by the head's own bounds, flattened."""
        a = actions.reshape(len(actions), -1).to(torch.float32)
        return (a - policy.action_bias) / policy.action_scale

    def critic_loss(self, policy: nn.Module, mb: dict[str, Any]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """The ensemble's TD loss on one minibatch: ``(loss, features, metrics)`` (``features``, of
        the augmented observations, for the actor's step)."""
        c = self.config
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_feats = policy.features(mb["next_obs"])
            next_a, next_logp = policy.rsample(next_feats, generator=self._noise)
            target_feats = next_feats if self._target_policy is None else self._target_policy.features(mb["next_obs"])
            q_next = self.critic_target(target_feats, self._critic_action(policy, next_a))
            if c.critic_subset < c.num_critics:
                q_next = q_next[torch.randperm(c.num_critics, generator=self._gen)[:c.critic_subset].to(q_next.device)]
            v_next = q_next.min(0).values - (alpha * next_logp if c.backup_entropy else 0.0)
            target = mb["rewards"] + mb["discounts"] * v_next
        feats = policy.features(mb["obs"])
        q = self.critic(feats, self._critic_action(policy, mb["actions"]))
        loss = 0.5 * (q - target).square().mean(1).sum()
        return loss, feats, {"critic_loss": loss.detach(), "q_mean": q.detach().mean(), "target_q": target.mean()}

    def actor_loss(self, policy: nn.Module, feats: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``alpha * log pi(a|s) - Q(s, a)`` on the critics' features (detached): ``(loss, logp, metrics)``."""
        feats = feats.detach()
        a, logp = policy.rsample(feats, generator=self._noise)
        self.critic.requires_grad_(False)  # the actor's gradient flows through the critics, not into them
        try:
            q = self.critic(feats, self._critic_action(policy, a))
        finally:
            self.critic.requires_grad_(True)
        q = q.min(0).values if self.config.actor_q == "min" else q.mean(0)
        loss = (self.log_alpha.detach().exp() * logp - q).mean()
        return loss, logp, {"actor_loss": loss.detach(), "entropy": -logp.detach().mean()}

    # ---- one update --------------------------------------------------------------------------

    def _step(self, name: str, loss: Tensor) -> None:
        opt = self._optimizers[name]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if math.isfinite(self.config.max_grad_norm):
            nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], self.config.max_grad_norm)
        opt.step()

    @torch.no_grad()
    def _polyak(self, policy: nn.Module) -> None:
        tau = self.config.tau
        torch._foreach_lerp_(list(self.critic_target.parameters()), list(self.critic.parameters()), tau)
        if self._target_policy is not None:
            mine = dict(policy.named_parameters())
            for n, t in self._target_policy.named_parameters():
                if n in self._encoder_names:
                    t.lerp_(mine[n], tau)
            for t, b in zip(self._target_policy.buffers(), policy.buffers()):
                t.copy_(b)

    def _augment(self, policy: nn.Module, obs: Any) -> Any:
        return augment_images(obs, getattr(getattr(policy, "obs_layout", None), "images", ()), self.config.image_pad,
                              self._gen)

    def gradient_step(self, policy: nn.Module, device: torch.device) -> dict[str, Any] | None:
        """One critic step (and, every ``actor_update_every``, an actor and temperature step) on a
        fresh minibatch; its metrics, or None where a loss was NaN/inf (nothing stepped)."""
        c = self.config
        mb, from_demos = sample_mixed(self.replay, self.demos, c.batch_size, c.demo_ratio, self._rng, device)
        mb = {**mb, "obs": self._augment(policy, mb["obs"]), "next_obs": self._augment(policy, mb["next_obs"])}
        loss, feats, metrics = self.critic_loss(policy, mb)
        if not bool(torch.isfinite(loss)):
            return None
        self._step("critic", loss)
        self.grad_steps += 1
        metrics["demo_fraction"] = from_demos / c.batch_size
        if self.grad_steps % c.actor_update_every == 0:
            loss, logp, more = self.actor_loss(policy, feats)
            if not bool(torch.isfinite(loss)):
                return None
            self._step("actor", loss)
            metrics.update(more)
            if c.autotune_alpha:
                self._step("alpha", -(self.log_alpha * (logp.detach() + self.target_entropy)).mean())
        self._polyak(policy)
        return metrics

    def update(self, policy: nn.Module, batch: Batch) -> dict[str, float]:
        """Add the batch's transitions to the replay, then take the gradient steps they earn."""
        from ebrl import distributed

        if distributed.active() is not None:
            raise ValueError(f"{type(self).__name__} does not run data-parallel: run one learner")
        c = self.config
        device = next(policy.parameters()).device
        transitions = batch_transitions(batch, c.gamma, c.n_step)
        new = self.replay.add(transitions)
        if new and callable(getattr(policy, "update_obs_stats", None)):  # normalisation statistics, as PPO's
            policy.update_obs_stats(tree_map(lambda x: x.to(device), transitions["obs"]))
        self.updates += 1
        self._owed += c.utd_ratio * new
        if len(self.replay) < c.learning_starts:
            self._owed, steps = 0.0, 0
        else:
            steps = int(self._owed)  # the fraction carries over: small stream updates keep the ratio
            self._owed -= steps
        if steps and self._policy is not policy:
            self._setup(policy, device)
        sums, counts, done = {}, {}, 0  # summed as tensors: a GPU syncs once an update, not per metric and step
        while done < steps and (metrics := self.gradient_step(policy, device)) is not None:
            done += 1
            for k, v in metrics.items():
                sums[k], counts[k] = sums.get(k, 0.0) + v, counts.get(k, 0) + 1
        nonfinite = done < steps  # a NaN/inf loss stopped the update there
        out = {k: float(sums[k]) / counts[k] for k in sums}
        for k in ("critic_loss", "actor_loss", "entropy", "q_mean", "target_q", "demo_fraction"):
            out.setdefault(k, math.nan)
        out.update({k: float(v) for k, v in self.replay.counters().items()})
        out.update(num_steps=float(batch.num_steps), transitions=float(new), gradient_steps=float(done),
                   minibatches=float(done), alpha=self.alpha, nonfinite_loss=float(nonfinite),
                   demo_size=float(len(self.demos)) if self.demos is not None else 0.0)
        return out


class RLPD(SAC):
    """SAC with RLPD's defaults (:class:`RLPDConfig`): LayerNorm critics, an ensemble of 10 with a
    random 2 in the target, 20 gradient steps per transition, the actor on the ensemble's mean,
    half of each minibatch from ``demos`` (:meth:`SAC.load_demos`)."""

    config_class = RLPDConfig
