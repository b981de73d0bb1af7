"""RunState: what every part of a run reads about where the run stands.

One object owns the step budget, the count of envs still stepping (``active``), those held by
backpressure (``parked``) and the stop request. The driver changes it; the generator's "every
live env waits" rule and the rollout queue's "an update is due" rule read it, and each of them
watches it (:meth:`RunState.watch`): a change wakes them, so no caller pokes them in pairs.

    >>> state = RunState(budget=10, active=4)
    >>> state.claim(3), state.budget, state.live
    (3, 7, 4)
    >>> state.claim(8, unit=4)   # vector envs of 4: one whole step is left
    4
    >>> woken = []
    >>> state.watch(lambda: woken.append(state.live))
    >>> state.park(1); state.finish(2)
    >>> woken, state.all_parked
    ([3, 1], False)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RunState:
    budget: int  # env steps not yet claimed
    active: int  # envs that will still record a step (they stop once the budget is spent)
    parked: int = 0  # active envs held by backpressure (a full rollout queue)
    stopping: bool = False  # stop requested: no new steps; the update in flight finishes
    watchers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def watch(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` after every change of ``active``, ``parked`` or ``stopping``."""
        self.watchers.append(wake)

    def changed(self) -> None:
        for wake in self.watchers:
            wake()

    def claim(self, n: int, unit: int = 1, whole: bool = False) -> int:
        """Claim a step for each of ``n`` envs, in whole units of ``unit`` envs (a vector env steps
        whole), or for all ``n`` or none with ``whole`` (a lockstep group); returns how many got one."""
        got = (n if self.budget >= n else 0) if whole else min(n, self.budget // unit * unit)
        self.budget -= got
        return got

    def release(self, n: int) -> None:
        """Give back steps claimed for steps that never happened (an env failed)."""
        if not self.stopping:
            self.budget += n

    def park(self, n: int) -> None:
        """``n`` envs wait for queue space (the driver unparks them as the learner frees it)."""
        self.parked += n
        self.changed()

    def finish(self, n: int) -> None:
        """``n`` envs will record no more steps (the budget is spent)."""
        self.active -= n
        self.changed()

    def stop(self) -> None:
        self.budget = 0
        self.stopping = True
        self.changed()

    @property
    def live(self) -> int:
        """Envs that may still ask for an action."""
        return self.active - self.parked

    @property
    def all_parked(self) -> bool:
        return self.active > 0 and self.parked >= self.active
