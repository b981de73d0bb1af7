"""The flow-matching action chain, once for every flow policy: sampling, Flow-Noise, Flow-SDE,
the chain's log-prob, the executed block and the flow-matching SFT loss.

A flow policy turns Gaussian noise into an action chunk ``[K, A]`` by integrating a velocity
field from ``tau = 0`` (noise) to ``tau = 1`` (actions) in ``N`` Euler steps (``tau_k = k / N``,
``dt = 1 / N``). Plain Euler is deterministic given ``x_0``, so the chunk has no density for
PPO's ratio; πRL (Chen et al. 2025) makes every step a Gaussian transition, and the whole chain
``[x_0 .. x_N]`` is the stored "action"::

    x_0 ~ N(0, I)
    x_{k+1} = mean_k(x_k) + sigma_k * eps_k        (on the executed block; elsewhere the mean)
    log p(chain) = log N(x_0[S]; 0, I) + sum_k log N(x_{k+1}[S]; mean_k[S], sigma_k[S]^2)

``S``, the **block**, is what the env executes: the chunk's first ``execute`` actions and first
``A`` dims (π0's chunks are longer and wider than what the env takes; noise elsewhere would only
add variance to the ratios). ``method`` picks ``mean_k`` and ``sigma_k``:

- ``"flow-noise"`` (πRL's Flow-Noise): the Euler mean ``x + dt * v`` and the policy's learned
  ``sigma`` (a noise head, state- and step-dependent);
- ``"flow-sde"`` (πRL's Flow-SDE, from Flow-GRPO): the ODE as the SDE with the same marginals.
  In π0's time ``t = 1 - tau`` (noise at ``t = 1``, ``v_t = noise - actions``),
  ``sigma_t = a * sqrt(t / (1 - t))`` (``a = noise_level``; at ``t = 1`` the next time in the
  denominator, as RLinf's ``sample_mean_var_val``) and, with ``delta = 1 / N``::

      mean_k = x - delta * [v_t + sigma_t^2 / (2 t) * (x + (1 - t) v_t)],   std_k = sqrt(delta) * sigma_t

  (``x + (1 - t) v_t`` is the predicted noise; the correction is per coordinate, so noising the
  block alone keeps the marginals);
- ``"ode"``: no noise (sampling is the plain ODE; nothing to train with RL).

``predict="velocity"`` means the network's output is ``v = dx/dtau``; ``predict="action"``
means it is the final chunk ``x1_hat`` and ``v = (x1_hat - x) / (1 - tau)``, so the last step's
mean is exactly ``x1_hat``. :meth:`FlowChain.flow_matching_loss` is rectified flow's SFT loss:
``x_tau = (1 - tau) noise + tau target``, the output regressed onto ``target - noise`` (or onto
``target`` with ``predict="action"``), on the demonstrated entries.

**What a flow policy supplies**: one function, the velocity (and noise) of its network over a
context it computes once per ``act``/``evaluate``/loss call (observation features, a VLM's
KV-cached prefix)::

    velocity(x: Tensor [R, S, K, A], t: Tensor [R, S]) -> (out [R, S, K, A], sigma or None)

``S`` flow states per row (one in sampling, all ``N`` steps when scoring a stored chain: a
policy that cannot batch them loops over ``S``) at times ``t`` in the policy's own convention:
``noise_at=0`` (``t = tau``, FlowPolicy's) or ``noise_at=1`` (``t = 1 - tau`` and
``v = noise - actions``: π0's and SmolVLA's, the times computed as ``sample_actions`` does, so
the ODE is theirs to the bit). ``out`` is ``dx/dt`` or ``x1_hat`` as ``predict`` says;
``sigma`` is Flow-Noise's learned std, ``[R, S, K, A]`` or just the block (None without a
noise head). A policy with its own training-time distribution passes ``sample_time`` to the
loss. The policy keeps a :class:`FlowChain` of its settings and calls
:meth:`~FlowChain.sample` in ``act``, :meth:`~FlowChain.score` in ``evaluate``,
:meth:`~FlowChain.step_params` and :meth:`~FlowChain.flow_matching_loss`; it maps the final
state to env actions itself (:class:`ChunkSpace` for a flow in ``[-1, 1]``).

A toy velocity that flows every chunk to ``0.5`` (a real policy's reads its context)::

    >>> import torch
    >>> from ebrl.policies.flow_chain import FlowChain
    >>> chain = FlowChain(steps=4, shape=(2, 3), predict="action")
    >>> def velocity(x, tau):  # x1_hat = 0.5 everywhere, a learned sigma of 0.1
    ...     return torch.full_like(x, 0.5), torch.full_like(x, 0.1)
    >>> states, logp = chain.sample(velocity, rows=5, generator=torch.Generator().manual_seed(0))
    >>> states.shape, logp.shape      # [R, N + 1, K * A]: the chain PPO stores
    (torch.Size([5, 5, 6]), torch.Size([5]))
    >>> scored, entropy = chain.score(velocity, states)
    >>> bool(torch.allclose(scored, logp, atol=1e-5)), entropy.shape
    (True, torch.Size([5]))
    >>> loss = chain.flow_matching_loss(velocity, torch.full((5, 2, 3), 0.5), torch.Generator().manual_seed(0))
    >>> float(loss)                   # x1_hat is the target: nothing to learn
    0.0

A VLA in π0's time (SmolVLA plugs in the same way): a chunk of 50 actions of 32 dims of which
the env executes 5 of 7 dims, Flow-SDE; its ``velocity`` would read the KV-cached prefix it
computed once, with one action-expert pass per flow state (``x[:, s]`` at ``t[:, s]``)::

    >>> vla = FlowChain(steps=10, shape=(50, 32), block=(5, 7), method="flow-sde", noise_at=1)
    >>> def velocity(x, t):  # v = noise - actions, toward zero actions: x / t
    ...     return x / t[..., None, None], None
    >>> states, logp = vla.sample(velocity, rows=2, generator=torch.Generator().manual_seed(0))
    >>> states.shape, vla.executed(states[:, -1].reshape(2, 50, 32)).shape
    (torch.Size([2, 11, 1600]), torch.Size([2, 35]))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ebrl.policies.heads import LOG_SQRT_2PI

METHODS = ("flow-noise", "flow-sde", "ode")
PREDICTS = ("action", "velocity")

# the policy's velocity (and noise) at S flow states per row: see the module's docstring
Velocity = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]


def gauss_logp(x: Tensor, mean: Tensor, sigma: Tensor) -> Tensor:
    """``log N(x; mean, diag(sigma^2))`` summed over the last dimension."""
    z = (x - mean) / sigma
    return (-0.5 * z.square() - sigma.log() - LOG_SQRT_2PI).sum(-1)


def unit_logp(x: Tensor) -> Tensor:
    """``log N(x; 0, I)`` summed over the last dimension."""
    return (-0.5 * x.square() - LOG_SQRT_2PI).sum(-1)


@dataclasses.dataclass(frozen=True)
class FlowChain:
    """A flow policy's chain: ``steps`` (N), the chunk's ``shape`` ``(K, A)`` in the flow's
    space, the executed ``block`` ``(actions, dims)`` (default: all of it), ``method``,
    ``predict``, Flow-SDE's ``noise_level``, and ``noise_at``: the time at which the policy's
    flow is noise, 0 (rectified flow, FlowPolicy's) or 1 (π0's, SmolVLA's). See the module's docstring."""

    steps: int
    shape: tuple[int, int]
    block: tuple[int, int] | None = None
    method: str = "flow-noise"
    predict: str = "velocity"
    noise_level: float = 0.5
    noise_at: int = 0

    def __post_init__(self):
        if self.predict not in PREDICTS:
            raise ValueError(f"predict={self.predict!r} must be 'action' (the network predicts the final chunk) "
                             "or 'velocity' (it predicts the velocity field)")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"denoise_steps={self.steps!r} must be an int >= 1")
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} must be one of {list(METHODS)}")
        if self.method == "flow-sde" and not self.noise_level > 0:
            raise ValueError(f"flow-sde needs noise_level > 0 (method='ode' injects no noise), "
                             f"got {self.noise_level!r}")
        if self.noise_at not in (0, 1) or (self.noise_at == 1 and self.predict == "action"):
            raise ValueError(f"noise_at={self.noise_at!r} must be 0 or 1 (1 only with predict='velocity')")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        block = self.shape if self.block is None else tuple(int(d) for d in self.block)
        if not all(1 <= b <= s for b, s in zip(block, self.shape)):
            raise ValueError(f"the executed block {block} must fit in the chunk {self.shape}")
        object.__setattr__(self, "block", block)

    @property
    def dim(self) -> int:
        """Elements of a flow state, ``K * A`` (a stored chain is ``[R, N + 1, dim]``)."""
        return self.shape[0] * self.shape[1]

    @property
    def dt(self) -> float:
        """The Euler step in the policy's time: ``1 / N``, or ``-1 / N`` when its flow runs from noise at 1."""
        return (-1.0 if self.noise_at else 1.0) / self.steps

    def time(self, k: int) -> float:
        """Step ``k``'s time in the policy's convention, with ``sample_actions``' arithmetic."""
        return self.noise_at + k * self.dt

    def executed(self, x: Tensor) -> Tensor:
        """The block of states ``x [..., K, A]``, flattened: ``[..., actions * dims]``."""
        ke, a = self.block
        return x[..., :ke, :a].flatten(-2)

    # ---- one step --------------------------------------------------------------------------

    def _step(self, velocity: Velocity, x: Tensor, ks: Sequence[int]) -> tuple[Tensor, Tensor | None]:
        """Steps ``ks``' Gaussians from ``x [R, S, K, A]`` (row ``r``, state ``s`` at step ``ks[s]``):
        the mean ``[R, S, K, A]`` (every entry) and the std on the block ``[R, S, actions, dims]``
        (None for the ODE)."""
        times = [self.time(k) for k in ks]
        t = torch.tensor(times, device=x.device, dtype=x.dtype).expand(x.shape[0], len(ks))
        out, sigma = velocity(x, t)
        v = out if self.predict == "velocity" else (out - x) / (1.0 - t)[..., None, None]
        mean = x + self.dt * v  # the Euler step, as sample_actions takes it
        ke, a = self.block
        if self.method == "ode":
            return mean, None
        if self.method == "flow-noise":
            if sigma is None:
                raise ValueError("method='flow-noise' needs the policy's learned sigma (a noise head)")
            return mean, sigma[..., :ke, :a]
        # flow-sde in π0's time (noise at t = 1, v = noise - actions): sigma_t = a sqrt(t / (1 - t)),
        # at t = 1 the next time in the denominator (RLinf's sample_mean_var_val); std = sqrt(delta) sigma_t
        delta = 1.0 / self.steps
        pi0_t = [1.0 - k * delta if not self.noise_at else tk for k, tk in zip(ks, times)]
        sigma_t = [self.noise_level * math.sqrt(tk / (1.0 - (1.0 - delta if k == 0 else tk)))
                   for k, tk in zip(ks, pi0_t)]
        scale = torch.tensor([s ** 2 * delta / (2.0 * tk) for s, tk in zip(sigma_t, pi0_t)], device=x.device,
                             dtype=x.dtype)[:, None, None]
        one_minus_t = torch.tensor([1.0 - tk for tk in pi0_t], device=x.device, dtype=x.dtype)[:, None, None]
        block = (..., slice(0, ke), slice(0, a))
        v_pi0 = v[block] if self.noise_at else -v[block]
        predicted_noise = x[block] + one_minus_t * v_pi0
        mean = mean.clone()
        mean[block] = mean[block] - scale * predicted_noise
        std = torch.tensor([math.sqrt(delta) * s for s in sigma_t], device=x.device, dtype=x.dtype)
        return mean, std[:, None, None].expand_as(predicted_noise)

    def step_params(self, velocity: Velocity, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``(mean_k [R, K * A], sigma_k [R, actions * dims])`` of the transition from
        ``x = x_k [R, K * A]`` at step ``k``, with gradients (sigma zero for the ODE)."""
        mean, sigma = self._step(velocity, x.reshape(-1, 1, *self.shape), [k])
        if sigma is None:
            sigma = mean.new_zeros(mean.shape[0], 1, *self.block)
        return mean[:, 0].flatten(1), sigma[:, 0].flatten(1)

    # ---- acting and scoring ----------------------------------------------------------------

    def sample(self, velocity: Velocity, rows: int, generator: torch.Generator, *,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, x0: Tensor | None = None,
               deterministic: bool = False) -> tuple[Tensor, Tensor]:
        """Sample chains: ``(states [R, N + 1, K * A], logp [R])``. ``x0`` is given noise
        (``[R, K, A]`` or ``[R, K * A]``); otherwise drawn from ``generator``, or zero when
        ``deterministic`` (the mode: from zero noise, no noise on the way)."""
        shape = (rows, *self.shape)
        if x0 is not None:
            x = torch.as_tensor(x0, device=device).to(dtype).reshape(shape)
        else:
            x = torch.randn(shape, generator=generator, device=device, dtype=dtype)
            if deterministic:
                x = torch.zeros_like(x)
        logp = unit_logp(self.executed(x))
        states = [x]
        for k in range(self.steps):
            mean, sigma = (t if t is None else t[:, 0] for t in self._step(velocity, x[:, None], [k]))
            x = mean
            if sigma is not None:
                eps = torch.randn(sigma.shape, generator=generator, device=device, dtype=dtype)
                if not deterministic:
                    x = mean.clone()
                    x[:, :self.block[0], :self.block[1]] += sigma * eps
                # as score() computes it, not from eps
                logp = logp + gauss_logp(self.executed(x), self.executed(mean), sigma.flatten(1))
            states.append(x)
        return torch.stack(states, 1).flatten(2), logp

    def score(self, velocity: Velocity, states: Tensor) -> tuple[Tensor, Tensor]:
        """``(logp [M], entropy [M])`` of stored chains ``states [M, N + 1, K * A]``, with
        gradients: every step in one call of ``velocity``. The entropy is the chain's:
        ``N(0, I)``'s on the block (a constant) plus every step's Gaussian's, given the stored states."""
        m, n = states.shape[0], self.steps
        chain = states.reshape(m, n + 1, *self.shape)
        mean, sigma = self._step(velocity, chain[:, :-1], range(n))
        logp = unit_logp(self.executed(chain[:, 0]))
        size = self.block[0] * self.block[1]
        entropy = torch.full((m,), size * (0.5 + LOG_SQRT_2PI), device=states.device, dtype=states.dtype)
        if sigma is None:
            return logp, entropy
        sigma = sigma.flatten(2)
        logp = logp + gauss_logp(self.executed(chain[:, 1:]), self.executed(mean), sigma).sum(1)
        return logp, entropy + (0.5 + LOG_SQRT_2PI + sigma.log()).sum((1, 2))

    # ---- supervised fine-tuning ------------------------------------------------------------

    def flow_matching_loss(self, velocity: Velocity, target: Tensor, generator: torch.Generator, *,
                           sample_time: Callable[[int, torch.Generator], Tensor] | None = None,
                           scored: tuple[int, int] | None = None) -> Tensor:
        """Rectified-flow behaviour cloning on ``target`` chunks ``[B, K, A]`` (the flow's space):
        ``noise`` then the time drawn from ``generator`` (``U(0, 1)``, or ``sample_time(B,
        generator)``, on the generator's device), the noisy chunk between them at that time, and
        the squared error of ``out`` against the straight-line velocity (``target - noise``, or
        ``noise - target`` from noise at 1), or against ``target`` with ``predict="action"`` (the
        velocity loss divided by ``(1 - tau)^2``, well defined at ``tau -> 1``), averaged over the
        first ``scored = (actions, dims)`` entries (all by default)."""
        rows, device = target.shape[0], target.device
        noise = torch.randn(target.shape, generator=generator, device=generator.device).to(device, target.dtype)
        time = (sample_time(rows, generator) if sample_time is not None
                else torch.rand(rows, generator=generator, device=generator.device)).to(device, target.dtype)
        w = time[:, None, None]
        x_t = w * noise + (1 - w) * target if self.noise_at else (1.0 - w) * noise + w * target
        out, _ = velocity(x_t[:, None], time[:, None])
        want = target if self.predict == "action" else noise - target if self.noise_at else target - noise
        ke, a = self.shape if scored is None else scored
        return (out[:, 0] - want)[:, :ke, :a].square().mean()


def _chain_setting(field: str) -> property:
    def get(self) -> Any:
        return getattr(self.chain, field)

    def set_(self, value: Any) -> None:
        self.chain = dataclasses.replace(self.chain, **{field: value})

    return property(get, set_, doc=f"The chain's ``{field}``; setting it rebuilds the chain.")


class HasChain:
    """A flow policy's settings, read from and written to its :class:`FlowChain` (``self.chain``)."""

    chain: FlowChain
    denoise_steps = _chain_setting("steps")
    method = _chain_setting("method")
    predict = _chain_setting("predict")


# ---- what FlowPolicy and HFFlowPolicy share: a flow in [-1, 1], a sigmoid-bounded noise head ----

class SigmoidSigma:
    """Flow-Noise's learned std as FlowPolicy and HFFlowPolicy bound it: a noise head's output
    mapped into ``[sigma_min, sigma_max]`` by a sigmoid, starting at ``init_sigma``."""

    def __init__(self, sigma_min: float, init_sigma: float, sigma_max: float):
        if not 0 < sigma_min < init_sigma < sigma_max:
            raise ValueError(f"need 0 < sigma_min < init_sigma < sigma_max, got {sigma_min!r}, {init_sigma!r}, "
                             f"{sigma_max!r}")
        self.sigma_min, self.init_sigma, self.sigma_max = float(sigma_min), float(init_sigma), float(sigma_max)

    def init_bias(self, bias: Tensor) -> None:
        """Fill the noise head's last bias so that sigma starts at ``init_sigma``."""
        p = (self.init_sigma - self.sigma_min) / (self.sigma_max - self.sigma_min)
        with torch.no_grad():
            bias.fill_(math.log(p / (1.0 - p)))

    def __call__(self, raw: Tensor) -> Tensor:
        return self.sigma_min + (self.sigma_max - self.sigma_min) * torch.sigmoid(raw)


def tanh_sigma(raw: Tensor, sigma_min: float, sigma_max: float) -> Tensor:
    """Flow-Noise's learned std as πRL's ``ExploreNoiseNet`` bounds it (π0's and SmolVLA's noise
    heads): ``log sigma^2`` interpolated between ``2 log sigma_min`` and ``2 log sigma_max`` by
    ``tanh(raw)``.

        >>> round(float(tanh_sigma(torch.zeros(1), 0.08, 0.32)), 4)  # the middle: sqrt(0.08 * 0.32)
        0.16
    """
    lo, hi = 2 * math.log(sigma_min), 2 * math.log(sigma_max)
    return torch.exp(0.5 * (lo + (hi - lo) * (torch.tanh(raw) + 1) / 2))


def chunk_2d(shape: Sequence[int]) -> tuple[int, int]:
    """An action Box's shape as a chunk ``(K, A)``: ``(A,)`` is one action, ``(1, A)``."""
    return (int(shape[0]), int(shape[1])) if len(shape) == 2 else (1, int(shape[0]))


class TimeEmbedding(nn.Module):
    """π0's sinusoidal time embedding: ``tau [...] -> [..., dim]``, the sines then the cosines
    at ``dim // 2`` frequencies whose periods are geometric in ``[4e-3, 4]``."""

    def __init__(self, dim: int):
        super().__init__()
        periods = torch.logspace(math.log10(4e-3), math.log10(4.0), dim // 2)
        self.register_buffer("freqs", 2.0 * math.pi / periods, persistent=False)

    def forward(self, tau: Tensor) -> Tensor:
        angles = tau[..., None] * self.freqs
        return torch.cat([angles.sin(), angles.cos()], -1)


class ChunkSpace:
    """Between the env's chunk Box and the flow's ``[-1, 1]`` space, for a policy with
    ``chunk_shape``, ``chunk_dim`` and the Box bounds ``action_low``/``action_high``
    (:class:`~ebrl.policies.flow.FlowPolicy`, :class:`~ebrl.policies.hf_flow.HFFlowPolicy`)."""

    chunk_shape: tuple[int, ...]
    chunk_dim: int
    action_low: np.ndarray
    action_high: np.ndarray

    def to_env(self, x: np.ndarray) -> np.ndarray:
        """Final flow states ``[B, K * A]`` (normalised space) -> env actions ``[B, *chunk_shape]``."""
        x = np.clip(x.reshape(-1, *self.chunk_shape), -1.0, 1.0)
        return (self.action_low + (x + 1.0) * 0.5 * (self.action_high - self.action_low)).astype(np.float32)

    def normalize_actions(self, chunks: Tensor) -> Tensor:
        """Env-space chunks ``[B, *chunk_shape]`` -> the flow's ``[-1, 1]`` space, ``[B, K * A]``."""
        low = torch.as_tensor(self.action_low, device=chunks.device, dtype=chunks.dtype)
        high = torch.as_tensor(self.action_high, device=chunks.device, dtype=chunks.dtype)
        x = 2.0 * (chunks.reshape(-1, *self.chunk_shape) - low) / (high - low) - 1.0
        return x.clamp(-1.0, 1.0).reshape(-1, self.chunk_dim)


__all__ = ["ChunkSpace", "FlowChain", "HasChain", "SigmoidSigma", "TimeEmbedding", "Velocity", "chunk_2d", "gauss_logp",
           "tanh_sigma", "unit_logp"]
