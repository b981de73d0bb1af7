"""V-trace (IMPALA, Espeholt et al. 2018, https://arxiv.org/abs/1802.01561) on padded segments.

Under policy lag the samples come from a behaviour policy ``mu`` older than the learner's
policy ``pi``. V-trace turns them into value targets ``vs`` for ``pi`` with truncated importance
weights: ``rho = min(rho_bar, pi/mu)`` fixes *which* value is learned (``V^pi`` for
``rho_bar = inf``), ``c = lam * min(c_bar, pi/mu)`` cuts the traces, bounding the variance.
:class:`VTrace` is PPO whose advantages and value targets come from V-trace, computed with the
learner's current policy and critic at the start of each update.

Example::

    >>> import torch
    >>> from ebrl.algos.vtrace import VTrace, vtrace
    >>> zero = torch.zeros(1, 3); no = torch.zeros(1, 3, dtype=torch.bool)
    >>> mask = torch.tensor([[True, True, False]])
    >>> target = torch.tensor([[0.0, 2.0, 0.0]])  # pi/mu = e^2 at step 1: rho and c truncated to 1
    >>> vs, adv = vtrace(zero, target, torch.ones(1, 3), zero, torch.tensor([[0.0, 3.0, 0.0]]),
    ...                  no, no, mask, gamma=1.0)
    >>> vs, adv
    (tensor([[5., 4., 0.]]), tensor([[5., 4., 0.]]))

    >>> from ebrl.algos import Batch
    >>> from ebrl.policies import MLPPolicy
    >>> policy = MLPPolicy(3, 2, seed=0)
    >>> S, T = 2, 5
    >>> obs = torch.randn(S, T, 3); acts = torch.randn(S, T, 2)
    >>> with torch.no_grad():
    ...     logp, _, v = policy.evaluate(obs.reshape(-1, 3), acts.reshape(-1, 2))
    >>> no = torch.zeros(S, T, dtype=torch.bool)
    >>> batch = Batch(obs, acts, logp.reshape(S, T) - 0.5, v.reshape(S, T), torch.randn(S, T), no, no,
    ...               torch.ones(S, T, dtype=torch.bool), torch.zeros(S, T, dtype=torch.long),
    ...               torch.randn(S, 3), torch.zeros(0, 3), torch.zeros(0, 2, dtype=torch.long))
    >>> metrics = VTrace(lr=1e-3, minibatch_size=4, rho_bar=1.0, c_bar=1.0).update(policy, batch)
    >>> metrics["num_steps"]
    10.0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ebrl.algos.advantages import _last_valid
from ebrl.algos.batch import Batch
from ebrl.algos.minibatch import _evaluate_valid, refuse_unknown
from ebrl.algos.ppo import PPO, Checks, PPOConfig


@torch.no_grad()
def vtrace(
    behaviour_logp: Tensor,
    target_logp: Tensor,
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    episode_end: Tensor,
    mask: Tensor,
    gamma: float | Tensor,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``(vs, pg_advantages)``, both ``[S, T]`` with 0 at invalid slots; no gradient (targets).

    Segments follow :func:`ebrl.algos.advantages.gae`'s conventions: ``next_values`` as
    :func:`~ebrl.algos.advantages.build_next_values` gives it (``values[t + 1]`` inside an
    episode, the bootstrap value at a segment's last valid step, the final value at a truncated
    step), ``episode_end = terminated | truncated``. Reference semantics, for every valid ``(s, t)``::

        ratio[t]  = exp(target_logp[t] - behaviour_logp[t])            # pi / mu
        rho[t]    = min(rho_bar, ratio[t])
        c[t]      = lam * min(c_bar, ratio[t])
        next_v[t] = next_values[t] * (1 - terminated[t])
        delta[t]  = rho[t] * (rewards[t] + gamma * next_v[t] - values[t])
        stop[t]   = episode_end[t] or t is the last valid step
        vs[t]     = values[t] + delta[t]                                       if stop[t]
                  = values[t] + delta[t] + gamma * c[t] * (vs[t + 1] - values[t + 1])  otherwise
        vs_next[t] = next_v[t] if stop[t] else vs[t + 1]
        pg_adv[t] = rho[t] * (rewards[t] + gamma * vs_next[t] - values[t])

    So the trace never crosses an episode end; a truncated step and a segment's last valid step
    bootstrap through ``next_values``, a terminated one through 0. With ``target == behaviour``
    (``rho = 1``, ``c = lam``), ``vs`` is exactly GAE(``lam``)'s returns, and for ``lam = 1``
    ``pg_adv`` is GAE(1)'s advantage. Invalid slots may hold anything (even NaN); they never
    reach a valid one.
    """
    terminated, episode_end, mask = terminated.bool(), episode_end.bool(), mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    ratio = torch.where(mask, (target_logp - behaviour_logp).to(values.dtype).exp(), zero)
    rho = ratio.clamp(max=rho_bar)
    c = lam * ratio.clamp(max=c_bar)
    next_v = torch.where(terminated, zero, next_values)
    delta = torch.where(mask, rho * (rewards + gamma * next_v - values), zero)
    # cont[s, t]: vs[t] includes vs[t + 1] (same episode, and t + 1 is valid).
    cont = mask & ~episode_end & ~_last_valid(mask)

    vs_minus_v = torch.zeros_like(delta)
    last = torch.zeros_like(delta[:, 0])
    per_step = isinstance(gamma, Tensor)  # [S, T] discounts for action chunks
    for t in reversed(range(delta.shape[1])):
        last = delta[:, t] + torch.where(cont[:, t], (gamma[:, t] if per_step else gamma) * c[:, t] * last, zero)
        vs_minus_v[:, t] = last
    vs = torch.where(mask, values + vs_minus_v, zero)

    vs_next = torch.zeros_like(vs)
    vs_next[:, :-1] = vs[:, 1:]
    vs_next = torch.where(cont, vs_next, next_v)
    pg_adv = torch.where(mask, rho * (rewards + gamma * vs_next - values), zero)
    return vs, pg_adv


@dataclass
class VTraceConfig(PPOConfig):
    rho_bar: float = 1.0  # truncation of the importance weight in delta and the pg advantage (math.inf: none)
    c_bar: float = 1.0  # truncation of the trace coefficients (math.inf: none); the trace is lam * min(c_bar, pi/mu)

    def __post_init__(self):
        super().__post_init__()
        c = Checks(self)
        for name in ("rho_bar", "c_bar"):
            c.check(name, c.num(name) > 0, "a float > 0 (math.inf disables truncation)")


# ---- shared with ebrl.algos.dppo -----------------------------------------------------------


def _make_config(cls: type, algo: str, config: PPOConfig | None, overrides: dict):
    """``cls`` built from ``config`` (a plain :class:`PPOConfig` is lifted) and keyword overrides."""
    refuse_unknown(algo, cls, overrides, ("loss_fn", "demos"))
    if config is None:
        config = cls()
    elif not isinstance(config, cls):
        if not isinstance(config, PPOConfig):
            raise TypeError(f"{algo}() needs a {cls.__name__} or PPOConfig, got {type(config).__name__}")
        config = cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(PPOConfig)})
    return dataclasses.replace(config, **overrides)


class VTrace(PPO):
    """PPO on V-trace targets. ``VTrace(rho_bar=2.0)`` overrides fields of :class:`VTraceConfig`.

    At the start of each update (no gradient) the learner's current weights are evaluated on
    the batch: their log-probs are the target policy ``pi``, their values ``V`` (the current
    critic, as IMPALA's learner). :func:`vtrace` with ``lam = gae_lambda`` then gives the value
    targets ``vs`` (``returns``) and policy-gradient advantages; the minibatch epochs run
    PPO's clipped loss on them.

    The PPO ratio is taken against the *update-start* policy ``pi``, not the behaviour policy
    ``mu``: V-trace's ``rho = min(rho_bar, pi/mu)`` inside the advantages already is the
    behaviour-to-target correction, so a ratio ``pi_theta/mu`` would apply it twice, and a
    clip around stale ``mu`` would freeze samples whose lag already moved the policy past
    ``1 +- clip_coef`` (no gradient from them at all). With ``pi_theta/pi`` the first step is
    exactly IMPALA's gradient ``rho * grad log pi * (r + gamma vs' - V)`` and the clip bounds
    this update's own step, as in PPO at lag 0. ``approx_kl``/``clipfrac`` are measured
    against ``pi``, and value clipping is around the update-start values ``V``.

    Equivalence: on lag-0 data (behaviour log-probs and values equal to the current policy's),
    ``gae_lambda = 1`` and ``rho_bar, c_bar >= 1``, the advantages and returns are GAE(1)'s and
    an update gives PPO(``gae_lambda=1``)'s weights. For ``gae_lambda < 1`` only the value
    targets agree (V-trace's advantage is a one-step ``r + gamma vs' - V``, not GAE's).
    """

    config: VTraceConfig

    def __init__(self, config: VTraceConfig | PPOConfig | None = None, *, loss_fn=None, demos=None, **overrides):
        super().__init__(_make_config(VTraceConfig, "VTrace", config, overrides), loss_fn=loss_fn,
                         demos=demos)

    def train_data(self, policy: nn.Module, b: Batch, obs, rewards: Tensor,
                   discounts: Tensor | None = None) -> dict[str, Tensor]:
        c = self.config
        mask = b.mask.bool()
        actions = b.actions[mask]
        with torch.no_grad():
            target_logp, cur_values = _evaluate_valid(policy, obs, actions, c.minibatch_size)
            values = b.values.new_zeros(mask.shape)
            values[mask] = cur_values.to(values.dtype)
            target = b.logprobs.new_zeros(mask.shape)
            target[mask] = target_logp.to(target.dtype)
            next_values = self._next_values(policy, b, values)
            vs, pg_adv = vtrace(b.logprobs, target, rewards, values, next_values, b.terminated,
                                b.terminated | b.truncated, mask, c.gamma if discounts is None else discounts,
                                c.gae_lambda, c.rho_bar, c.c_bar)
        return {"obs": obs, "actions": actions, "logprobs": target[mask], "values": values[mask],
                "advantages": pg_adv[mask], "returns": vs[mask]}
