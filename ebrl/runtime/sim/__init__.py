"""Where ``env.step`` runs: one :class:`SimPool` routing each env to a host (inline, thread
lanes, or worker processes), behind one send/recv interface. See :mod:`ebrl.runtime.sim.pool`."""

from ebrl.runtime.sim.block import Block, Outbox, StepRows
from ebrl.runtime.sim.pool import LOCAL, SimPool
from ebrl.runtime.sim.stepping import EnvFn

__all__ = ["LOCAL", "Block", "EnvFn", "Outbox", "SimPool", "StepRows"]
