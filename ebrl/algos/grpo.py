"""GRPO (group relative policy optimisation) on padded segment batches: no critic, the baseline of
an episode is the other episodes that started from the same state.

The idea (Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300; for VLA policies
with sparse success rewards SimpleVLA-RL, https://arxiv.org/abs/2509.09674, and RLinf,
https://arxiv.org/abs/2509.15965): roll out a *group* of episodes from one initial state, score
each by its return ``R`` and give every step of episode ``i`` the advantage
``A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-6)`` (``norm_std=False``: ``R_i - mean``).
The policy is then trained with PPO's clipped ratio against the behaviour log-probs, averaged over
all steps of the used episodes (step level, as DAPO's token-level mean; ``loss_agg="episode"``:
over each episode's steps, then over episodes, as the GRPO paper), optionally with a KL
penalty to a frozen reference policy (the k3 estimator
``exp(ref - logp) - (ref - logp) - 1`` of DeepSeekMath). The value head is neither used nor
trained; there is no discounting.

What the runtime must provide (``RunConfig(segment_cut="episode", reset_group=k)``; GRPO
declares it in :attr:`GRPO.run_needs`, and ``ebrl.run`` applies it to a RunConfig that leaves
these fields ``auto``/``None``, see :mod:`ebrl.algos.needs`):

* ``segment_cut="episode"``: every segment is one episode from its reset, cut at its end, so a
  segment's valid rewards are its episode's rewards. An episode split across segments (longer
  than ``segment_len``, or cut to bound policy lag) goes on in segments with ``group == -1`` and
  is *not used* at all: choose ``segment_len`` >= the episode time limit, and prefer a lockstep
  schedule (``"sync"``), where no segment is cut for lag.
* Envs in *reset groups* (``reset_group=k``): the ``k`` envs of a group reset with a shared seed,
  which the runtime stores in :attr:`Batch.group` for the segment starting at that reset.
  Episodes with equal keys are compared with each other, so a key must not be reused by a
  different start state within a batch.
* All members of a group in the same batch: only the complete members present in the batch form
  the group; a group with fewer than ``min_group`` of them is not used (counted in the
  ``segments_unused`` metric, as are the segments above). Batches holding whole groups waste
  nothing.

The group std is the sample std (``n - 1``, as ``torch.std`` in TRL and verl). An update whose
used steps all have advantage 0 (every group uniform: on sparse success, all failures) and no
entropy or KL term takes no optimizer step (metric ``no_signal``): its loss has no gradient, and
stepping Adam on it would move the policy by the momentum of the last informative update.

Example::

    >>> import torch
    >>> from ebrl.algos import Batch
    >>> from ebrl.algos.grpo import GRPO, group_advantages
    >>> from ebrl.policies import MLPPolicy
    >>> S, T = 3, 2  # two episodes from reset seed 7 (returns 1 and 0), one continuation (-1)
    >>> obs, acts = torch.zeros(S, T, 3), torch.zeros(S, T, 2)
    >>> rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [5.0, 5.0]])
    >>> end = torch.tensor([[False, True], [False, True], [False, True]])
    >>> no = torch.zeros(S, T, dtype=torch.bool); mask = torch.ones(S, T, dtype=torch.bool)
    >>> batch = Batch(obs, acts, torch.zeros(S, T), torch.zeros(S, T), rewards, end, no, mask,
    ...               torch.zeros(S, T, dtype=torch.long), torch.zeros(S, 3), torch.zeros(0, 3),
    ...               torch.zeros(0, 2, dtype=torch.long), group=torch.tensor([7, 7, -1]))
    >>> adv, used = group_advantages(batch)
    >>> adv.round(decimals=4), used
    (tensor([[ 0.7071,  0.7071],
            [-0.7071, -0.7071],
            [ 0.0000,  0.0000]]), tensor([ True,  True, False]))
    >>> m = GRPO(lr=1e-3).update(MLPPolicy(3, 2, seed=0), batch)
    >>> m["num_steps"], m["steps_used"], m["segments_used"], m["segments_unused"]
    (6.0, 4.0, 2.0, 1.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ebrl import distributed
from ebrl.algos.advantages import _last_valid
from ebrl.algos.batch import Batch, concat_segments, select_segments
from ebrl.algos.needs import RunNeeds
from ebrl.algos.minibatch import MinibatchAlgo, _index, refuse_unknown
from ebrl.algos.ppo import Checks
from ebrl.config import Schedule, SegmentCut
from ebrl.policies.base import acting_copy, load_published
from ebrl.spaces import tree_map

LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor | float]]]

GROUP_EPS = 1e-6  # added to the group std (verl's and SimpleVLA-RL's epsilon)
DEFAULT_RESET_GROUP = 4  # envs per reset group when the run sets none
LOSS_AGGS = ("step", "episode")  # GRPOConfig.loss_agg


@dataclass
class GRPOConfig:
    lr: float = 3e-4
    clip_coef: float = 0.2
    update_epochs: int = 4
    minibatch_size: int = 512
    ent_coef: float = 0.0
    kl_coef: float = 0.0  # 0: no KL term (and no reference policy)
    max_grad_norm: float = 0.5  # math.inf disables clipping
    norm_std: bool = True  # divide by the group's std (Dr. GRPO: False)
    # "step": the loss is a mean over steps (DAPO's token-level mean), so an episode weighs as its
    # length; "episode": a mean over each episode's steps, then over episodes (the GRPO paper's
    # 1/|o_i| sum_t), so an early success weighs as much as a failure run to the time limit
    loss_agg: str = "step"
    min_group: int = 2  # complete episodes a group needs in the batch to be used
    # DAPO's dynamic sampling: drop groups whose members all scored alike (no gradient) and hold
    # the others until an update has as many groups as one batch brings, gathering at most
    # ``resample_cap`` batches (then it trains on what it holds; the metric ``resample_capped``)
    dynamic_sampling: bool = False
    resample_cap: int = 16
    seed: int = 0

    def __post_init__(self):
        c = Checks(self)
        check, num, integer = c.check, c.num, c.integer

        check("lr", 0 < num("lr") < math.inf, "a finite float > 0")
        check("clip_coef", 0 < num("clip_coef") < math.inf, "a finite float > 0")
        check("ent_coef", 0 <= num("ent_coef") < math.inf, "a finite float >= 0")
        check("kl_coef", 0 <= num("kl_coef") < math.inf, "a finite float >= 0 (0 disables the KL term)")
        check("max_grad_norm", num("max_grad_norm") > 0, "> 0 (math.inf disables clipping)")
        check("update_epochs", integer("update_epochs") >= 1, "an int >= 1")
        check("minibatch_size", integer("minibatch_size") >= 1, "an int >= 1")
        check("min_group", integer("min_group") >= 2,
              "an int >= 2 (a lone episode has no baseline: its advantage would be 0)")
        integer("seed")
        check("resample_cap", integer("resample_cap") >= 1, "an int >= 1 (batches one update may gather)")
        check("dynamic_sampling", isinstance(self.dynamic_sampling, bool), "a bool")
        check("norm_std", isinstance(self.norm_std, bool), "a bool")
        check("loss_agg", self.loss_agg in LOSS_AGGS, f"one of {list(LOSS_AGGS)}")


def _group_advantages(batch: Batch, norm_std: bool, min_group: int) -> tuple[Tensor, Tensor, Tensor, dict[str, float]]:
    """:func:`group_advantages`, the used segments of the groups whose returns differ (``[S]``
    bool: a group whose members all scored alike has no gradient), and the counts (for the
    metrics)."""
    if batch.group is None:
        raise ValueError(
            "GRPO needs Batch.group (the reset seed each episode segment starts from), but it is None: "
            "run with RunConfig(segment_cut='episode') and envs in reset groups that share a seed")
    mask = batch.mask.bool()
    S = mask.shape[0]
    group = torch.as_tensor(batch.group).to(device=mask.device, dtype=torch.long)
    if group.shape != (S,):
        raise ValueError(f"Batch.group has shape {tuple(group.shape)}, expected ({S},): one key per segment")
    end = (batch.terminated.bool() | batch.truncated.bool()) & mask
    last = _last_valid(mask)
    early = (end & ~last).any(1)
    if bool(early.any()):
        raise ValueError(
            f"segments {early.nonzero().flatten().tolist()[:5]} hold an episode end before their last valid "
            "step: GRPO needs one episode per segment, RunConfig(segment_cut='episode')")
    complete = (group >= 0) & (end & last).any(1)

    r = torch.where(mask, batch.rewards.double(), torch.zeros((), dtype=torch.float64, device=mask.device))
    ret = torch.where(complete, r.sum(1), torch.zeros((), dtype=torch.float64, device=mask.device))  # [S] returns
    keys, inv = torch.unique(torch.where(complete, group, torch.full_like(group, -1)), return_inverse=True)
    G = keys.numel()
    c = complete.double()
    count = torch.zeros(G, dtype=torch.float64, device=mask.device).index_add_(0, inv, c)
    total = torch.zeros_like(count).index_add_(0, inv, ret * c)
    mean = total / count.clamp(min=1)
    dev = (ret - mean[inv]) * c
    sq = torch.zeros_like(count).index_add_(0, inv, dev.square())
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    used = complete & (count[inv] >= min_group)
    seg_adv = dev / (std[inv] + GROUP_EPS) if norm_std else dev
    seg_adv = torch.where(used, seg_adv, torch.zeros_like(seg_adv))
    adv = torch.where(mask & used.unsqueeze(1), seg_adv.unsqueeze(1), torch.zeros_like(r)).to(batch.rewards.dtype)

    big = (keys >= 0) & (count >= min_group)  # the groups used
    hi = torch.full_like(count, -math.inf).index_reduce_(0, inv, ret, "amax")
    lo = torch.full_like(count, math.inf).index_reduce_(0, inv, ret, "amin")
    varied = big & (hi > lo)  # compared exactly: a mean of equal returns may round away from them
    info = {"segments_used": float(used.sum()),
            "segments_unused": float(S - int(used.sum())),
            "segments_no_reset": float((group < 0).sum()),
            "segments_incomplete": float(((group >= 0) & ~complete).sum()),
            "groups": float(big.sum()),
            "groups_too_small": float(((keys >= 0) & ~big).sum()),
            # groups whose members all scored alike: zero advantage, no policy gradient
            "groups_uniform": float((big & ~varied).sum()),
            "return_mean": float(ret[used].mean()) if bool(used.any()) else math.nan}
    return adv, used, used & varied[inv], info


def group_advantages(batch: Batch, *, norm_std: bool = True, min_group: int = 2) -> tuple[Tensor, Tensor]:
    """``(adv [S, T], used [S] bool)``: every valid step of a used segment gets its episode's
    group-relative advantage; other slots are 0.

    A segment is used when it starts at a reset (``batch.group[s] >= 0``), ends with an episode end
    (terminated or truncated at its last valid step) and at least ``min_group`` such segments of
    the batch share its group key. Its return ``R`` is the sum of its valid rewards, and
    ``A = (R - mean) / (std + 1e-6)`` over its group (sample std; ``norm_std=False``: ``R - mean``).
    """
    adv, used, _, _ = _group_advantages(batch, norm_std, min_group)
    return adv, used


class GRPO(MinibatchAlgo):
    """Group relative policy optimisation. ``GRPO(lr=1e-3)`` overrides fields of :class:`GRPOConfig`.

    ``reference``: the policy the KL term (``kl_coef > 0``) pulls towards, evaluated without
    gradients and as given (put it in eval mode yourself if it has dropout; it is not saved in
    :meth:`state_dict`); left ``None``, a frozen deep copy of the policy taken at the start of the
    first update (saved in :meth:`state_dict`). Subclass and override :meth:`loss`, or pass ``loss_fn``, as with PPO.
    """

    def __init__(self, config: GRPOConfig | None = None, *, reference: nn.Module | None = None,
                 loss_fn: LossFn | None = None, demos=None, **overrides):
        refuse_unknown("GRPO", GRPOConfig, overrides, ("reference", "loss_fn", "demos"))
        self.config = dataclasses.replace(config or GRPOConfig(), **overrides)
        self.loss_fn = loss_fn
        self.demos = demos  # a DemoLoss: the demonstrations' decaying BC term (ebrl.algos.demo_loss)
        self.updates = 0
        self.reference = reference
        self._own_reference = False  # True: the deep copy taken here (saved with state_dict)
        self._pending_reference: dict | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._policy: nn.Module | None = None
        self._gen = torch.Generator().manual_seed(self.config.seed)  # minibatch permutations
        self._pending_optimizer_state: dict | None = None
        self._held: list[Batch] = []  # dynamic sampling: segments of informative groups not yet trained on
        self._held_groups = 0
        self._gathered = 0  # batches gathered since the last update that trained

    @property
    def run_needs(self) -> RunNeeds:
        """Whole episodes from shared resets: segments cut at episode ends and at least the
        time limit long, envs in reset groups of at least ``min_group``; sync preferred, where
        no episode is cut to bound policy lag and every update sees whole groups."""
        return RunNeeds(segment_cut=SegmentCut.EPISODE, reset_group=max(DEFAULT_RESET_GROUP, self.config.min_group),
                        min_reset_group=self.config.min_group, whole_episodes=True, schedule=Schedule.SYNC,
                        why="it compares whole episodes from their resets")

    # ---- state (checkpoints, and the learner process handing its state back) -------------

    def state_dict(self) -> dict:
        """Optimiser state, the minibatch RNG, the update count, and the reference weights when taken here."""
        ref = None
        if self._own_reference and self.reference is not None:
            state = self.reference.state_dict()
            named = getattr(self._policy, "trainable_state_dict", None)
            if callable(named):  # the frozen base is the policy's own (shared): only what trains differs
                state = {k: state[k] for k in named()}
            ref = {k: v.detach().cpu().clone() for k, v in state.items()}
        elif self._pending_reference is not None:
            ref = self._pending_reference
        return {"optimizer": self.optimizer.state_dict() if self.optimizer is not None else self._pending_optimizer_state,
                "rng": self._gen.get_state(), "updates": self.updates,
                "reference": ref}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the optimiser state (and a saved reference) apply at the next update."""
        self._gen.set_state(state["rng"])
        self.updates = state["updates"]
        self._pending_optimizer_state = state["optimizer"]
        self.optimizer = None
        ref = state["reference"]
        if ref is not None:
            if self._own_reference and self.reference is not None:
                self.reference.load_state_dict(ref)
            elif self.reference is None:
                self._pending_reference = ref

    # ---- the objective -------------------------------------------------------------------

    def loss(self, policy: nn.Module, mb: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor | float]]:
        """Clipped GRPO loss on one minibatch of used steps, a (weighted) mean over its steps.

        ``mb`` holds flat ``[M]`` tensors: ``obs, actions, logprobs`` (behaviour), ``advantages``
        (group-relative), ``weights`` (each step's share of the mean, absent: 1; under
        ``loss_agg="episode"`` inversely proportional to its episode's length, 1 on average over
        the update's steps) and, when ``kl_coef > 0``, ``ref_logprobs`` (the reference policy's).
        """
        c = self.config
        new_logp, entropy, _ = policy.evaluate(mb["obs"], mb["actions"])  # the value head is ignored
        logratio = new_logp - mb["logprobs"]
        ratio = logratio.exp()
        adv, w = mb["advantages"], mb.get("weights")

        def mean(x: Tensor) -> Tensor:
            return x.mean() if w is None else (w * x).mean()

        pg_loss = mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - c.clip_coef, 1 + c.clip_coef)))
        ent = mean(entropy)
        loss = pg_loss - c.ent_coef * ent
        metrics: dict[str, Tensor | float] = {}
        if c.kl_coef > 0:
            d = mb["ref_logprobs"] - new_logp
            kl = mean(d.exp() - d - 1)  # k3: unbiased, >= 0 (DeepSeekMath eq. 4)
            loss = loss + c.kl_coef * kl
            metrics["kl_ref"] = kl.detach()
        with torch.no_grad():
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfrac = ((ratio - 1).abs() > c.clip_coef).float().mean()
        metrics.update(policy_loss=pg_loss.detach(), entropy=ent.detach(), approx_kl=approx_kl, clipfrac=clipfrac)
        return loss, metrics

    # ---- one update ----------------------------------------------------------------------

    def _take_reference(self, policy: nn.Module) -> None:
        if self.config.kl_coef == 0 or self.reference is not None:
            return
        # a copy sharing the policy's frozen parameters (a LoRA-tuned backbone is not copied)
        ref = acting_copy(policy)
        if self._pending_reference is not None:  # restored from a checkpoint
            load_published(ref, self._pending_reference)
            self._pending_reference = None
        self.reference = _freeze(ref)
        self._own_reference = True

    @torch.no_grad()
    def _ref_logprobs(self, obs, actions: Tensor, n: int) -> Tensor:
        """The reference's log-probs of the used steps, in chunks of ``minibatch_size``."""
        ref = self.reference
        p = next(iter(ref.parameters()), None)
        ref_device = p.device if p is not None else actions.device
        out = []
        for start in range(0, n, self.config.minibatch_size):
            idx = torch.arange(start, min(start + self.config.minibatch_size, n), device=actions.device)
            o = tree_map(lambda x: x.to(ref_device), _index(obs, idx))
            logp, _, _ = ref.evaluate(o, actions[idx].to(ref_device))
            out.append(logp.to(actions.device))
        return torch.cat(out)

    def update(self, policy: nn.Module, batch: Batch) -> dict[str, float]:
        """One GRPO update (``update_epochs`` passes over the used steps) and its metrics; with
        ``dynamic_sampling``, on the informative groups gathered from this batch and the ones before."""
        if self.config.dynamic_sampling:
            return self._update_dynamic(policy, batch)
        return self._update(policy, batch)

    def _update_dynamic(self, policy: nn.Module, batch: Batch) -> dict[str, float]:
        """Keep this batch's informative groups; train once they are as many as the batch brought
        (or ``resample_cap`` batches were gathered). Metrics name the steps trained on now
        (``steps_trained``, held ones included), held for later (``steps_held``) and dropped
        (``dropped/<reason>``), so that the learner's accounting adds up."""
        c = self.config
        with torch.no_grad():
            _, used, keep, info = _group_advantages(batch, c.norm_std, c.min_group)
        groups = int(info["groups"] - info["groups_uniform"])
        mask = batch.mask.bool()
        n_valid, n_used, n_keep = int(mask.sum()), int(mask[used].sum()), int(mask[keep].sum())
        if groups:
            kept = select_segments(batch, keep)
            kept.group = torch.unique(kept.group, return_inverse=True)[1] + self._held_groups  # unique across batches
            self._held.append(kept)
            self._held_groups += groups
        self._gathered += 1
        full = self._held_groups >= max(int(info["groups"]), 1)
        counts = {"num_steps": float(n_valid), "groups_uniform": info["groups_uniform"],
                  "groups_held": float(self._held_groups), "resample_batches": float(self._gathered),
                  "dropped/grpo_uniform_group": float(n_used - n_keep),
                  "dropped/grpo_unused_segment": float(n_valid - n_used)}
        if not full and self._gathered < c.resample_cap:
            held = sum(int(b.mask.sum()) for b in self._held)
            return {**counts, "steps_trained": 0.0, "steps_held": float(held), "deferred": 1.0, "minibatches": 0.0,
                    "nonfinite_loss": 0.0, "no_signal": 0.0}
        held, self._held, self._held_groups, self._gathered = self._held, [], 0, 0
        if not held:  # the cap, and not one informative group: nothing to learn from
            return {**counts, "steps_trained": 0.0, "steps_held": 0.0, "deferred": 0.0, "minibatches": 0.0,
                    "nonfinite_loss": 0.0, "no_signal": 1.0, "resample_capped": 1.0}
        merged = concat_segments(held)
        merged.learner_version = batch.learner_version
        out = self._update(policy, merged)
        out.update(counts, steps_trained=float(merged.mask.sum()), steps_held=0.0, deferred=0.0,
                   resample_capped=float(not full))
        return out

    def _update(self, policy: nn.Module, batch: Batch) -> dict[str, float]:
        c = self.config
        self._take_reference(policy)  # before anything changes the policy: the weights that acted first
        self._optimizer_for(policy)
        device = next(policy.parameters()).device
        b = self._batch_to(batch, device)
        mask = b.mask.bool()
        n_valid = int(mask.sum())
        lags = b.lags.double()
        with torch.no_grad():
            adv, used, _, info = _group_advantages(b, c.norm_std, c.min_group)
        steps = mask & used.unsqueeze(1)
        n = int(steps.sum())
        base = {"num_steps": float(n_valid),
                "lag_mean": float(lags.mean()) if n_valid else 0.0,
                "lag_max": float(lags.max()) if n_valid else 0.0,
                "steps_used": float(n), **info}
        names = ["policy_loss", "entropy", "approx_kl", "clipfrac"] + (["kl_ref"] if c.kl_coef > 0 else [])
        dp = distributed.active()
        joint = dp is not None  # one rank of a data-parallel job: takes part even with no rows
        if (n_valid or joint) and hasattr(policy, "update_obs_stats"):
            policy.update_obs_stats(_index(b.obs, mask))
        # no step without a signal: with every used step's advantage 0 (all groups uniform) and no
        # entropy or KL term the loss has no gradient, yet Adam's momentum alone would move the policy
        signal = self._signal(adv[steps], dp)  # every rank of a data-parallel job asks, rows or not
        if n == 0 or not signal:
            nonfinite = self._epochs(policy, None, 0, device)[2] if joint and signal else False
            self.updates += 1
            return {**base, **dict.fromkeys(names, math.nan), "nonfinite_loss": float(nonfinite), "minibatches": 0.0,
                    "no_signal": float(n > 0 and not signal)}

        flat = {"obs": _index(b.obs, steps), "actions": b.actions[steps], "logprobs": b.logprobs[steps],
                "advantages": adv[steps]}
        weights = self._step_weights(steps)
        if weights is not None:
            flat["weights"] = weights
        if c.kl_coef > 0:
            flat["ref_logprobs"] = self._ref_logprobs(flat["obs"], flat["actions"], n)
        sums, count, nonfinite = self._epochs(policy, flat, n, device)
        self.updates += 1

        out = {k: float(v) / count for k, v in sums.items()} if count else dict.fromkeys(names, math.nan)
        # the runtime reads this: a loss that was NaN/inf stopped the update (faults.nonfinite)
        out["nonfinite_loss"] = float(nonfinite)
        out["minibatches"] = float(count)
        out["no_signal"] = 0.0
        out.update(base)
        return out

    def _step_weights(self, steps: Tensor) -> Tensor | None:
        """``[n]`` weights of the used steps (``steps``: ``[S, T]`` bool) in the loss's mean, or
        ``None`` under ``loss_agg="step"`` (a plain mean); under ``"episode"``
        ``n / (episodes * length)``, so that every episode's steps sum to the same share and the
        weights average 1 (a minibatch's mean is then an unbiased estimate of the mean over episodes)."""
        if self.config.loss_agg == "step":
            return None
        n = int(steps.sum())
        length = steps.sum(1, keepdim=True).float()  # [S, 1]: each used episode's steps
        episodes = int((length > 0).sum())
        w = (n / (episodes * length.clamp(min=1))).expand_as(steps)
        return w[steps]

    def _signal(self, advantages: Tensor, dp: distributed.DataParallel | None) -> bool:
        """Whether the loss can have a gradient: a non-zero advantage (on any rank of a
        data-parallel job, so that all ranks skip together), or an entropy or KL term."""
        c = self.config
        if c.ent_coef > 0 or c.kl_coef > 0:
            return True
        mine = bool(advantages.any())
        if dp is None:
            return mine
        return bool(dp.all_max(torch.tensor([float(mine)], dtype=torch.float64), "agreeing on a signal")[0])


def _freeze(module: nn.Module) -> nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module
