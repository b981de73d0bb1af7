"""Where each env's time goes: the one observer of the driver's path.

The driver tells :class:`EnvWaits` what happened to a set of envs and when (their step came
back, their action came, they parked, ...). It keeps, per env, the seconds waited so far by
cause, which the live profiler reads as :meth:`EnvWaits.counters` snapshots, and, when a
:class:`~ebrl.telemetry.timeline.Timeline` is given, records the same spans there (``sim``,
``act``, ``blocked``, ``fail`` per env lane). One place measures a wait, so the controller's
profile and a trace cannot disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ebrl.telemetry.timeline import Timeline


class EnvWaits:
    """Per-env wait seconds by cause, and the timeline's spans (see module docstring)."""

    def __init__(self, num_envs: int, timeline: Timeline | None = None):
        self.timeline = timeline
        self.lanes = [f"env {i}" for i in range(num_envs)]
        # when each env became ready (or parked), and when its step was submitted
        self.t_ready = np.zeros(num_envs)
        self.t_sub = np.zeros(num_envs)
        # seconds since the start: the round trip of its sim steps (the step, plus any wait for a
        # lane or worker), waits for an action, for the lockstep group's last member (the
        # barrier) and for queue space (backpressure)
        self.sim = np.zeros(num_envs)
        self.action = np.zeros(num_envs)
        self.barrier = np.zeros(num_envs)
        self.blocked = np.zeros(num_envs)

    def _spans(self, ids: np.ndarray, name: str, since: np.ndarray, now: float) -> None:
        if self.timeline is not None:
            for i in ids.tolist():
                self.timeline.record(self.lanes[i], name, since[i], now)

    def _waited(self, ids: np.ndarray, name: str, since: np.ndarray, into: np.ndarray, now: float) -> None:
        """Envs ``ids`` waited from ``since`` to ``now``: counted in ``into``, drawn as ``name``."""
        self._spans(ids, name, since, now)
        into[ids] += now - since[ids]

    def ready(self, ids: np.ndarray | slice, now: float) -> None:
        """Envs ``ids`` are ready for their next step (after a reset, a rebuild or a move)."""
        self.t_ready[ids] = now

    def stepped(self, ids: np.ndarray, now: float) -> None:
        """Their steps came back: ready now."""
        self._waited(ids, "sim", self.t_sub, self.sim, now)
        self.t_ready[ids] = now

    def failed(self, ids: np.ndarray, now: float) -> None:
        """Their step failed (recovery takes them until they are ready again)."""
        self._spans(ids, "fail", self.t_sub, now)

    def passed_barrier(self, ids: np.ndarray, now: float) -> None:
        """A lockstep group goes on: the time since each member came back was the barrier.
        ``t_ready`` stays at the arrival (the timeline's ``act`` spans the barrier too), so the
        action wait, measured from ``t_ready`` when the actions come, is credited it back now."""
        barrier = now - self.t_ready[ids]
        self.barrier[ids] += barrier
        self.action[ids] -= barrier

    def submitted(self, ids: np.ndarray, now: float) -> None:
        """Their actions came and their steps went to the pool."""
        self._waited(ids, "act", self.t_ready, self.action, now)
        self.t_sub[ids] = now

    def parked(self, ids: np.ndarray, now: float) -> None:
        """They wait for queue space (backpressure) from now on."""
        self._waited(ids, "act", self.t_ready, self.action, now)
        self.t_ready[ids] = now

    def unparked(self, ids: np.ndarray, now: float) -> None:
        """The learner took segments: they may go on."""
        self._waited(ids, "blocked", self.t_ready, self.blocked, now)
        self.t_ready[ids] = now

    def counters(self, parked: np.ndarray, now: float) -> dict[str, np.ndarray]:
        """Per env, the seconds waited so far: for the step (``sim``), for the action, at the
        lockstep barrier, and parked by backpressure, a park in progress (envs ``parked``)
        counted up to ``now``: a long update holds them across profile windows, and each window
        should see its share."""
        blocked = self.blocked.copy()
        blocked[parked] += now - self.t_ready[parked]
        return {"sim": self.sim.copy(), "action": self.action.copy(), "barrier": self.barrier.copy(),
                "backpressure": blocked}
