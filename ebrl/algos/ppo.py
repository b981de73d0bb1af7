"""PPO (clipped surrogate, CleanRL style) on padded segment batches, correct under policy lag.

The importance ratio uses the *behaviour* log-probs stored in the batch (of whichever policy
version acted), and value clipping is against the behaviour values, so stale samples are
handled by the same clipping that bounds each update.

Example::

    >>> import torch
    >>> from ebrl.algos import PPO, Batch
    >>> from ebrl.policies import MLPPolicy
    >>> policy = MLPPolicy(3, 2, seed=0)
    >>> S, T = 2, 5
    >>> obs = torch.randn(S, T, 3); acts = torch.randn(S, T, 2)
    >>> with torch.no_grad():
    ...     logp, _, v = policy.evaluate(obs.reshape(-1, 3), acts.reshape(-1, 2))
    >>> no = torch.zeros(S, T, dtype=torch.bool)
    >>> batch = Batch(obs, acts, logp.reshape(S, T), v.reshape(S, T), torch.randn(S, T), no, no,
    ...               torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long),
    ...               torch.randn(S, 3), torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.long))
    >>> metrics = PPO(lr=1e-3, minibatch_size=4).update(policy, batch)
    >>> metrics["num_steps"]
    10.0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ebrl import distributed
from ebrl.algos.advantages import build_next_values, chunk_discounting, gae
from ebrl.algos.batch import Batch
from ebrl.algos.minibatch import MinibatchAlgo, _evaluate_valid, _index, refuse_unknown
from ebrl.policies.base import critic_parameters
from ebrl.policies.heads import merge_moments

LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor | float]]]


class Checks:
    """Validation for an algorithm's config dataclass; each error names the class and the field."""

    def __init__(self, config):
        self.config, self.cls = config, type(config).__name__

    def check(self, name: str, ok: bool, allowed: str) -> None:
        if not ok:
            raise ValueError(f"{self.cls}.{name}={getattr(self.config, name)!r} is invalid: must be {allowed}")

    def num(self, name: str) -> float:
        v = getattr(self.config, name)
        self.check(name, isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v), "a number")
        return v

    def integer(self, name: str) -> int:
        v = getattr(self.config, name)
        self.check(name, isinstance(v, int) and not isinstance(v, bool), "an int")
        return v


@dataclass
class PPOConfig:
    lr: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5  # math.inf disables clipping
    update_epochs: int = 4
    minibatch_size: int = 512
    norm_adv: bool = True
    scale_rewards: bool = True
    # the first updates train the critic alone (the policy held, as verl's critic_warmup and
    # DPPO's n_critic_warmup_itr): RL from pretrained weights starts its advantages from a critic
    # fitted to the policy's own returns, in the units PPO trains it on, not from a fresh or
    # demonstration-fitted one that would move a good policy the wrong way
    critic_warmup_updates: int = 0
    # the learning rate follows the policy's measured change (rsl_rl's "adaptive" schedule): after
    # an update whose mean approx_kl exceeded 2 * desired_kl the lr is divided by 1.5, after one
    # under desired_kl / 2 multiplied by 1.5, within [lr / 100, 10 * lr]; ``lr`` is where it
    # starts, 0 keeps it fixed. One fixed lr is too slow for some policies and too fast for
    # others (tests/test_learning_reach.py; PPO's docstring has the numbers)
    desired_kl: float = 0.01
    # an update stops at the first minibatch whose approx_kl (to the behaviour policy, before its
    # step) exceeds max_kl, the rest of its epochs skipped (Stable-Baselines3's target_kl), and the
    # next update's lr is divided by 1.5: the adaptive lr moves the next update's lr, this bounds
    # the update itself, the first included. 0: never. Single-process updates only (a
    # data-parallel job's ranks step together)
    max_kl: float = 0.0
    # the value head's own learning rate (its Adam group; the adaptive lr moves the rest). None: lr
    critic_lr: float | None = None
    # a batch holding samples of an older policy version than the learner's (policy lag, the
    # async schedule): clip around the weights at the update's start, not the behaviour policy,
    # and weight each sample by pi_prox / mu truncated at max_is_weight (decoupled PPO, Hilton et
    # al. 2021; ebrl.algos.dppo). False: clip around the behaviour policy, as at lag 0
    lag_correction: bool = True
    # the truncation of pi_prox / mu (math.inf: none); >= 1, the weight of on-policy data
    max_is_weight: float = 2.0
    seed: int = 0

    def __post_init__(self):
        c = Checks(self)  # messages name the subclass (VTraceConfig, ...) where one is validated
        check, num, integer = c.check, c.num, c.integer
        check("lr", 0 < num("lr") < math.inf, "a finite float > 0")
        check("gamma", 0 <= num("gamma") <= 1, "in [0, 1]")
        check("gae_lambda", 0 <= num("gae_lambda") <= 1, "in [0, 1]")
        check("clip_coef", 0 < num("clip_coef") < math.inf, "a finite float > 0")
        check("ent_coef", 0 <= num("ent_coef") < math.inf, "a finite float >= 0")
        check("vf_coef", 0 <= num("vf_coef") < math.inf, "a finite float >= 0")
        check("max_grad_norm", num("max_grad_norm") > 0, "> 0 (math.inf disables clipping)")
        check("update_epochs", integer("update_epochs") >= 1, "an int >= 1")
        check("minibatch_size", integer("minibatch_size") >= 1, "an int >= 1")
        check("critic_warmup_updates", integer("critic_warmup_updates") >= 0, "an int >= 0")
        check("desired_kl", 0 <= num("desired_kl") < math.inf, "a finite float >= 0 (0: a fixed lr)")
        check("max_kl", 0 <= num("max_kl") < math.inf, "a finite float >= 0 (0: never stop an update early)")
        if self.critic_lr is not None:
            check("critic_lr", 0 < num("critic_lr") < math.inf, "a finite float > 0, or None (lr)")
        check("max_is_weight", num("max_is_weight") >= 1, "a float >= 1 (math.inf disables truncation)")
        integer("seed")
        for name in ("clip_vloss", "norm_adv", "scale_rewards", "lag_correction"):
            check(name, isinstance(getattr(self, name), bool), "a bool")


class _RunningVar:
    """Running mean/variance of a stream of scalars: :func:`~ebrl.policies.heads.merge_moments`
    (parallel Welford in float64, every rank's batch in a data-parallel update) on one column."""

    def __init__(self):
        self._mean = torch.zeros(1, dtype=torch.float64)
        self._var = torch.ones(1, dtype=torch.float64)
        self._count = torch.full((), 1e-4, dtype=torch.float64)

    mean = property(lambda self: float(self._mean), lambda self, v: self._mean.fill_(v))
    var = property(lambda self: float(self._var), lambda self, v: self._var.fill_(v))
    count = property(lambda self: float(self._count), lambda self, v: self._count.fill_(v))

    def update(self, x: Tensor) -> None:
        merge_moments(self._mean, self._var, self._count, x.detach().double().reshape(-1, 1).cpu())


class PPO(MinibatchAlgo):
    """Proximal policy optimisation. ``PPO(lr=1e-3)`` overrides fields of :class:`PPOConfig`.

    Subclass and override :meth:`loss`, or pass ``loss_fn(policy, mb) -> (loss, metrics)``, to
    change the objective; :meth:`update` does everything around it (advantages, minibatching,
    optimiser step).

    **Adaptive learning rate** (``desired_kl``, on by default). The clipped ratio bounds each
    sample's probability ratio, not how far one update moves the policy, and how far a given lr
    moves it depends on the policy far more than on the task (tests/test_learning_reach.py,
    15k decisions, the share of the gap between the untrained policy's mode and a scripted
    expert that the trained mode closed):

    - a chunked :class:`~ebrl.policies.flow.FlowPolicy` scores its whole chain, ``N * K * A``
      Gaussian dimensions (48 for N = 4 steps of a K = 4 chunk of 3-D actions), all summed in
      one log-ratio, so a step moves it far: on a heavy 3-D point mass at lr 3e-3 (batches of
      8 envs x 16 decisions) approx_kl ran at 0.5-9 with 64-83% of the samples clipped, the
      noise grew (entropy 51 -> 59) and the policy closed 15% of its gap. Dividing the
      log-ratio by the dimensions instead (ReinFlow's ``normalize_act_space_dimension``) makes
      the clip that much looser: on a point mass like that one, divided by 16 at lr 3e-4, the
      policy drifted to saturated chunks and ended worse than untrained (-92%);
    - an :class:`~ebrl.policies.hf_token.HFTokenPolicy` under LoRA moves its log-probs only
      through rank-4 adapters on frozen layers and zero-initialised heads: at lr 3e-4 approx_kl
      stayed near 1e-4, and it closed 1% (3-D point mass) and 35% (2-D reach) with its samples
      not better than before (-1% and +1% of their gap).

    After each update the lr moves by 1.5x towards a mean approx_kl in
    ``[desired_kl / 2, 2 * desired_kl]`` (rsl_rl's schedule for legged robots, and its
    desired_kl, 0.01), within ``[lr / 100, 10 * lr]``: the flow above closed 81% (its lr settling
    at 1-3e-4), the LoRA policy 44% and 59% (its lr rising to 2-3e-3; samples 23% and 48%).
    Where a fixed lr already suited the policy it costs little: the same FlowPolicy at lr 3e-4
    on 16 x 32 batches closed 70% and 75% fixed, 65% and 65% adaptive. ``approx_kl`` is measured
    against the behaviour log-probs, so under policy lag it also counts the lag's drift and the
    lr settles lower. It is the KL of the whole action (for a flow, of the whole chain): a policy
    whose log-prob sums many more dimensions than these sees a larger KL for the same step and
    gets a lower lr (at most 100x lower); set ``desired_kl`` for it, or 0 to keep ``lr`` fixed.
    A custom ``loss_fn`` that reports no ``approx_kl`` keeps the lr fixed. Metrics: ``lr`` (the
    update's).
    """

    def __init__(self, config: PPOConfig | None = None, *, loss_fn: LossFn | None = None, demos=None, **overrides):
        refuse_unknown("PPO", PPOConfig, overrides, ("loss_fn", "demos"))
        self.config = dataclasses.replace(config or PPOConfig(), **overrides)
        self.loss_fn = loss_fn
        self.demos = demos  # a DemoLoss: the demonstrations' decaying BC term (ebrl.algos.demo_loss)
        self.reward_rms = _RunningVar()
        self.optimizer: torch.optim.Optimizer | None = None
        self._policy: nn.Module | None = None
        self._gen = torch.Generator().manual_seed(self.config.seed)  # minibatch permutations
        self._pending_optimizer_state: dict | None = None
        self.updates = 0

    # ---- state (checkpoints, and the learner process handing its state back) -------------

    def state_dict(self) -> dict:
        """Optimiser state, reward-scaling statistics, the minibatch RNG and the update count."""
        # a state loaded but not yet applied (no update since: e.g. handed back by the learner
        # process) is still the optimiser's state
        return {"optimizer": self.optimizer.state_dict() if self.optimizer is not None else self._pending_optimizer_state,
                "reward_rms": (self.reward_rms.mean, self.reward_rms.var, self.reward_rms.count),
                "rng": self._gen.get_state(), "updates": self.updates, "lr": self.lr_now}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the optimiser state applies to the next policy updated."""
        self.reward_rms.mean, self.reward_rms.var, self.reward_rms.count = state["reward_rms"]
        self._gen.set_state(state["rng"])
        self.updates, self.lr_now = state["updates"], state["lr"]
        self._pending_optimizer_state = state["optimizer"]
        self.optimizer = None

    # ---- the objective -------------------------------------------------------------------

    def loss(self, policy: nn.Module, mb: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor | float]]:
        """Clipped PPO loss on one minibatch.

        ``mb`` holds flat ``[M]`` tensors (``obs``/``actions`` with their trailing shapes):
        ``obs, actions, logprobs`` (behaviour), ``values`` (behaviour), ``advantages`` (already
        normalised when ``norm_adv``), ``returns``. For dict observations ``mb["obs"]`` is a
        dict of ``[M, ...]`` tensors (as are ``Batch.obs``, ``bootstrap_obs`` and ``final_obs``).
        """
        c = self.config
        new_logp, entropy, new_value = policy.evaluate(mb["obs"], mb["actions"])
        logratio = new_logp - mb["logprobs"]
        ratio = logratio.exp()
        # decoupled (:meth:`proximal`): as w > 0, w * min(r A, clip(r) A) == min(r (w A), clip(r) (w A))
        adv = mb["advantages"] if "is_weights" not in mb else mb["is_weights"] * mb["advantages"]
        pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - c.clip_coef, 1 + c.clip_coef)).mean()

        if c.clip_vloss:
            v_clipped = mb["values"] + (new_value - mb["values"]).clamp(-c.clip_coef, c.clip_coef)
            v_loss = 0.5 * torch.max((new_value - mb["returns"]).square(),
                                     (v_clipped - mb["returns"]).square()).mean()
        else:
            v_loss = 0.5 * (new_value - mb["returns"]).square().mean()
        ent = entropy.mean()
        loss = pg_loss - c.ent_coef * ent + c.vf_coef * v_loss

        with torch.no_grad():  # CleanRL's low-variance KL estimator, http://joschu.net/blog/kl-approx.html
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfrac = ((ratio - 1).abs() > c.clip_coef).float().mean()
        metrics = {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(),
                   "entropy": ent.detach(), "approx_kl": approx_kl, "clipfrac": clipfrac}
        if "is_weights" in mb:
            metrics["is_weight_mean"] = mb["is_weights"].mean()
        if "lag_kl" in mb:
            metrics["lag_kl"] = mb["lag_kl"].mean()
        return loss, metrics

    # ---- one update ----------------------------------------------------------------------

    def _adapt_lr(self, kl_sum, steps: int) -> None:
        """The adaptive lr (:attr:`PPOConfig.desired_kl`; the class docstring says why): this
        update's mean ``approx_kl`` (``kl_sum`` over its ``steps`` minibatches) moves the next
        update's lr by 1.5x towards ``[desired_kl / 2, 2 * desired_kl]``. Once an update, not
        after every minibatch as rsl_rl: within an update the KL to the behaviour policy grows
        epoch by epoch, and a per-minibatch rule cut the lr by 25x in one update and raised it
        back in the next (a tiny Llama's lr swung between 1.2e-4 and 3e-3). As one rank of a
        data-parallel job, the mean is every rank's, so that every rank keeps the same lr."""
        c = self.config
        if not c.desired_kl:
            return
        have = kl_sum is not None and steps > 0
        total = torch.tensor([float(kl_sum) if have else 0.0, float(steps) if have else 0.0], dtype=torch.float64)
        dp = distributed.active()
        if dp is not None:
            total = dp.all_sum(total, "the approx_kl behind the adaptive lr")
        if total[1] <= 0 or not math.isfinite(float(total[0])):  # a custom loss without approx_kl: lr fixed
            return
        kl = float(total[0] / total[1])
        lr = self.current_lr
        if kl > 2.0 * c.desired_kl:
            self.set_lr(max(c.lr / 100.0, lr / 1.5))
        elif kl < c.desired_kl / 2.0:
            self.set_lr(min(c.lr * 10.0, lr * 1.5))

    @torch.no_grad()
    def _scaled_rewards(self, batch: Batch, rewards: Tensor, discounts: Tensor | None) -> Tensor:
        """``rewards`` divided by the running std of discounted returns.

        Like gymnasium's ``NormalizeReward`` but stateless across batches and envs: the
        discounted return ``G_t = r_t + gamma * G_{t-1}`` is accumulated within each segment
        in time order, restarting at 0 at the segment start and after every episode end. The
        variance of all valid ``G_t`` feeds a running variance updated every batch. Returns
        restarted at segment starts are shorter than the true ones, so the scale is somewhat
        underestimated for short segments; it stays deterministic and needs no per-env state.
        """
        if not self.config.scale_rewards:
            return rewards
        r = rewards.double()
        end = (batch.terminated | batch.truncated).double()
        g = torch.zeros_like(r[:, 0])
        rets = torch.empty_like(r)
        for t in range(r.shape[1]):
            g = r[:, t] + (self.config.gamma if discounts is None else discounts[:, t].double()) * g
            rets[:, t] = g
            g = g * (1.0 - end[:, t])
        self.reward_rms.update(rets[batch.mask.bool()])
        return (rewards / math.sqrt(self.reward_rms.var + 1e-8)).to(batch.values.dtype)

    def _next_values(self, policy: nn.Module, b: Batch, values: Tensor) -> Tensor:
        """``[S, T]`` next-state values: ``values`` inside segments, the current critic at bootstraps."""
        boot = policy.value(b.bootstrap_obs)
        final = policy.value(b.final_obs) if b.final_index.numel() else values.new_zeros(0)
        return build_next_values(values, boot, final, b.final_index, b.truncated & ~b.terminated, b.mask.bool())

    def train_data(self, policy: nn.Module, b: Batch, obs, rewards: Tensor,
                   discounts: Tensor | None = None) -> dict[str, Tensor]:
        """The flat ``[N]`` tensors the minibatch loop trains on (PPO's: GAE on the behaviour
        values, and the proximal policy's where :meth:`decouples`). V-trace overrides this one step.

        ``b`` is on the policy's device, observation statistics are already updated, ``obs`` is
        ``b.obs`` at the valid steps and ``rewards`` the scaled ``[S, T]`` rewards;
        ``discounts`` the ``[S, T]`` per-step discounts of action chunks (``gamma ** steps``,
        see :func:`~ebrl.algos.advantages.chunk_discounting`), None for ``gamma`` at every step. Must return
        ``obs, actions, logprobs, values, advantages, returns`` (what :meth:`loss` reads; extra
        keys are minibatched too); ``values`` and ``returns`` also give ``explained_variance``.
        """
        c = self.config
        mask = b.mask.bool()
        with torch.no_grad():
            next_values = self._next_values(policy, b, b.values)
            adv, ret = gae(rewards, b.values, next_values, b.terminated, b.terminated | b.truncated,
                           mask, c.gamma if discounts is None else discounts, c.gae_lambda)
        flat = {"obs": obs, "actions": b.actions[mask], "logprobs": b.logprobs[mask],
                "values": b.values[mask], "advantages": adv[mask], "returns": ret[mask]}
        return self.proximal(policy, obs, flat) if self.decouples(b) else flat

    def decouples(self, batch: Batch) -> bool:
        """Whether this update clips around the proximal policy (:meth:`proximal`): with
        ``lag_correction``, when some valid sample was chosen by an older version than the learner's."""
        return self.config.lag_correction and bool((batch.lags > 0).any())

    @torch.no_grad()
    def proximal(self, policy: nn.Module, obs, flat: dict[str, Tensor]) -> dict[str, Tensor]:
        """``flat`` with the weights at the update's start as the proximal policy: their log-probs
        replace the behaviour ones (the clip's centre), their values the centre of value
        clipping, and ``is_weights`` ``w = min(max_is_weight, pi_prox / mu)`` weight each
        sample's policy term (:meth:`loss`). ``lag_kl`` holds each sample's k3 term of KL(mu ||
        pi_prox) (its mean: how far the lag moved the policy before this update)."""
        prox_logp, prox_values = _evaluate_valid(policy, obs, flat["actions"], self.config.minibatch_size)
        prox_logp = prox_logp.to(flat["logprobs"].dtype)
        log_w = prox_logp - flat["logprobs"]  # in log space: a very stale mu can make pi_prox / mu overflow
        w = log_w.clamp(max=math.log(self.config.max_is_weight)).exp()
        return {**flat, "logprobs": prox_logp, "values": prox_values.to(flat["values"].dtype), "is_weights": w,
                "lag_kl": log_w.exp() - 1 - log_w}

    def update(self, policy: nn.Module, batch: Batch) -> dict[str, float]:
        """One PPO update (``update_epochs`` passes over the valid steps) and its metrics."""
        c = self.config
        self._optimizer_for(policy)
        device = next(policy.parameters()).device
        b = self._batch_to(batch, device)
        mask = b.mask.bool()
        n = int(mask.sum())
        lags = b.lags.double()
        base = {"num_steps": float(n),
                "lag_mean": float(lags.mean()) if n else 0.0,
                "lag_max": float(lags.max()) if n else 0.0}
        empty = {**base, **dict.fromkeys(
            ["policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance"],
            math.nan), "reward_scale": math.sqrt(self.reward_rms.var + 1e-8)}
        joint = distributed.active() is not None  # one rank of a data-parallel job: takes part even with no rows
        if n == 0 and not joint:
            return empty

        # Stats first, so bootstrap values below see the same normalisation training will.
        obs = _index(b.obs, mask)  # once: for pixel observations this is the big copy
        if hasattr(policy, "update_obs_stats"):
            policy.update_obs_stats(obs)
        rewards, discounts = b.rewards, None
        if b.chunk_steps is not None:  # action chunks: discount inside each chunk, and by its length
            rewards, discounts = chunk_discounting(b.rewards, b.chunk_rewards, b.chunk_steps, c.gamma)
        rewards = self._scaled_rewards(b, rewards, discounts)

        flat = self.train_data(policy, b, obs, rewards, discounts) if n else None
        warmup = self.updates < c.critic_warmup_updates
        lr = self.current_lr
        sums, count, nonfinite = self._epochs(policy, flat, n, device, norm_adv=c.norm_adv,
                                              only=critic_parameters(policy) if warmup else None)
        self.updates += 1
        if self.kl_stopped:  # the KL that stopped it was past max_kl: the next update steps smaller
            self.set_lr(max(c.lr / 100.0, lr / 1.5))
        elif not warmup and not nonfinite:  # the warm-up holds the policy: its KL says nothing of the lr
            self._adapt_lr(sums.get("approx_kl"), count)
        if n == 0:
            return {**empty, "nonfinite_loss": float(nonfinite), "minibatches": 0.0, "lr": lr}

        # Explained variance of the behaviour values w.r.t. the GAE returns (as CleanRL).
        var_ret = flat["returns"].var(unbiased=False)
        ev = 1.0 - (flat["returns"] - flat["values"]).var(unbiased=False) / var_ret
        out = {k: float(v) / count for k, v in sums.items()} if count else dict.fromkeys(
            ["policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac"], math.nan)
        # the runtime reads this: a loss that was NaN/inf stopped the update (faults.nonfinite)
        out["nonfinite_loss"] = float(nonfinite)
        out["minibatches"] = float(count)
        out["critic_warmup"] = float(warmup)
        out["kl_stopped"] = float(self.kl_stopped)
        out["lr"] = lr  # the lr this update stepped with (desired_kl adapts the next one's)
        out.update(base, explained_variance=float(ev) if float(var_ret) > 0 else math.nan,
                   reward_scale=math.sqrt(self.reward_rms.var + 1e-8) if c.scale_rewards else 1.0)
        return out
