"""What PPO, DecoupledPPO, V-trace and GRPO share: :class:`MinibatchAlgo`, an Adam optimiser
made at a policy's first update and epochs of shuffled minibatches that never step on a NaN/inf
loss (and, as one rank of a data-parallel job, take the same steps as every other rank)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn

from ebrl import distributed
from ebrl.algos.batch import Batch
from ebrl.policies.base import critic_parameters
from ebrl.spaces import tree_map


def _index(x: Tensor | dict[str, Any], idx: Tensor) -> Tensor | dict[str, Any]:
    """``x[idx]``, per leaf for dict observations (nested ones too)."""
    if isinstance(x, Tensor):
        return x[idx]
    return {k: _index(v, idx) for k, v in x.items()}


@torch.no_grad()
def _evaluate_valid(policy: nn.Module, obs, actions: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """``(logprobs [N], values [N])`` of the current weights on the valid steps, in minibatch-sized chunks."""
    n = actions.shape[0]
    logps, values = [], []
    for idx in torch.arange(n, device=actions.device).split(chunk):
        logp, _, v = policy.evaluate(_index(obs, idx), actions[idx])
        logps.append(logp)
        values.append(v)
    return torch.cat(logps), torch.cat(values)


def refuse_unknown(algo: str, config_cls: type, overrides: dict[str, Any], extra: tuple[str, ...] = ()) -> None:
    """A ``TypeError`` naming the keyword overrides that ``config_cls`` has no field for, and the
    valid names (its fields, then the constructor's own keywords ``extra``)."""
    valid = [f.name for f in dataclasses.fields(config_cls)]
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise TypeError(f"{algo}() got unknown keyword(s) {unknown}; valid names: {valid + list(extra)}")


class MinibatchAlgo:
    """What PPO and GRPO share: an Adam optimiser made at the first update of a policy (with a
    restored state applied then), batches moved to the policy's device, and the epochs of
    shuffled minibatches that never step on a NaN/inf loss.

    Needs ``config`` (``lr``, ``update_epochs``, ``minibatch_size``, ``max_grad_norm``),
    ``loss_fn``/``loss``, ``_gen`` (the minibatch RNG), ``optimizer``, ``_policy`` and
    ``_pending_optimizer_state``. With ``demos`` (a :class:`~ebrl.algos.demo_loss.DemoLoss`),
    every minibatch step adds its weighted behaviour-cloning term (weight by ``updates`` done).
    """

    demos = None  # DemoLoss | None
    updates = 0  # updates done (the critic warm-up and the demonstrations' weight count them)
    lr_now: float | None = None  # the learning rate, where an adaptive schedule moved it from config.lr
    kl_stopped = False  # whether the last update stopped early at max_kl

    @property
    def current_lr(self) -> float:
        """The learning rate the next step takes: ``config.lr``, or where a schedule moved it."""
        return self.config.lr if self.lr_now is None else self.lr_now

    def set_lr(self, lr: float) -> None:
        """Step with ``lr`` from now on (the optimiser's, and the one made after a reset or a
        restore; a value head with its own ``critic_lr`` keeps that)."""
        self.lr_now = float(lr)
        for group in self.optimizer.param_groups if self.optimizer is not None else ():
            if not group.get("critic"):
                group["lr"] = self.lr_now

    def reset_optimizer(self) -> None:
        """A fresh optimiser at the next update (after an update undone for NaN/inf: its moments may hold them)."""
        self.optimizer = None
        self._pending_optimizer_state = None

    def _param_groups(self, policy: nn.Module) -> list[dict]:
        """Adam's groups: everything at the (adaptive) lr; with ``config.critic_lr``, the value
        head in a group of its own at that lr."""
        critic_lr = getattr(self.config, "critic_lr", None)
        critic = {id(p) for p in critic_parameters(policy)} if critic_lr is not None else set()
        if not critic:
            return [{"params": list(policy.parameters())}]
        return [{"params": [p for p in policy.parameters() if id(p) not in critic]},
                {"params": [p for p in policy.parameters() if id(p) in critic], "lr": critic_lr, "critic": True}]

    def _optimizer_for(self, policy: nn.Module) -> None:
        if self.optimizer is None or policy is not self._policy:
            self.optimizer = torch.optim.Adam(self._param_groups(policy), lr=self.current_lr, eps=1e-5)
            self._policy = policy
            if self._pending_optimizer_state is not None:
                self.optimizer.load_state_dict(self._pending_optimizer_state)
                self._pending_optimizer_state = None
                for group in self.optimizer.param_groups:  # the saved groups' lr is the one restored with it
                    group["lr"] = self.config.critic_lr if group.get("critic") else self.current_lr

    @staticmethod
    def _batch_to(batch: Batch, device: torch.device) -> Batch:
        def to(x):  # dict observations: a tensor per key; other fields (ints) stay as they are
            return x.to(device) if isinstance(x, Tensor) else x

        return Batch(**{f.name: tree_map(to, getattr(batch, f.name)) for f in dataclasses.fields(batch)})

    def _epochs(self, policy: nn.Module, flat: dict[str, Tensor] | None, n: int, device: torch.device,
                norm_adv: bool = False, only: list[Tensor] | None = None) -> tuple[dict[str, Tensor | float], int, bool]:
        """``update_epochs`` passes over the ``n`` rows of ``flat`` in shuffled minibatches
        (advantages normalised per minibatch with ``norm_adv``); returns the summed metrics,
        the minibatches stepped and whether a NaN/inf loss stopped the update there. With
        ``only``, just those parameters step (every other gradient is dropped before clipping).

        As one rank of a data-parallel job (:mod:`ebrl.distributed`) every rank takes the same
        number of steps (the most any rank needs at ``minibatch_size`` rows), its rows split
        evenly over them, and each step applies the rows-weighted mean of the ranks' gradients;
        a rank with fewer rows (or none) still takes every step."""
        c = self.config
        dp = distributed.active()
        loss_fn = self.loss_fn or self.loss
        params = [p for p in policy.parameters() if p.requires_grad] if dp is not None else []
        steps = dp.agree_steps(n, c.minibatch_size) if dp is not None else None
        keep = {id(p) for p in only or ()}
        held = [] if only is None else [p for p in policy.parameters() if id(p) not in keep]
        sums: dict[str, Tensor | float] = {}
        count = 0
        max_kl = getattr(c, "max_kl", 0.0) if dp is None else 0.0
        self.kl_stopped = False
        for _ in range(c.update_epochs if steps is None or steps else 0):
            perm = torch.randperm(n, generator=self._gen).to(device)
            chunks = (torch.tensor_split(perm, steps) if steps is not None
                      else [perm[start:start + c.minibatch_size] for start in range(0, n, c.minibatch_size)])
            for idx in chunks:
                finite, metrics = True, {}
                if idx.numel():
                    mb = {k: _index(v, idx) for k, v in flat.items()}
                    if norm_adv and idx.numel() > 1:
                        a = mb["advantages"]
                        mb["advantages"] = (a - a.mean()) / (a.std() + 1e-8)
                    loss, metrics = loss_fn(policy, mb)
                    if self.demos is not None:
                        term, weight = self.demos(policy, self.updates)
                        if term is not None:
                            loss = loss + weight * term
                            metrics = {**metrics, "demo_loss": term.detach()}
                        metrics = {**metrics, "demo_weight": weight}
                    finite = bool(torch.isfinite(loss))
                if not finite and dp is None:  # never step on NaN/inf: the rest of the update is skipped
                    return sums, count, True
                if max_kl and float(metrics.get("approx_kl", 0.0)) > max_kl:  # moved far enough: stop here
                    self.kl_stopped = True
                    return sums, count, False
                self.optimizer.zero_grad(set_to_none=True)
                if idx.numel() and finite:
                    loss.backward()
                if dp is not None and not dp.reduce_grads(params, int(idx.numel()), finite):  # some rank's was NaN/inf
                    return sums, count, True
                for p in held:  # Adam leaves a parameter without a gradient as it is
                    p.grad = None
                if math.isfinite(c.max_grad_norm):
                    nn.utils.clip_grad_norm_(policy.parameters(), c.max_grad_norm)
                self.optimizer.step()
                if idx.numel():
                    for k, v in metrics.items():
                        sums[k] = sums.get(k, 0.0) + (v.detach() if isinstance(v, Tensor) else v)
                    count += 1
        return sums, count, False
