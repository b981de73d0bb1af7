"""The learner's loop as one rank of a data-parallel job (:mod:`ebrl.distributed`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ebrl.runtime.learner import Learner

JOINT_POLL_S = 0.005  # how often a rank waiting for its queue looks for another rank's request


async def run_joint(learner: Learner) -> None:
    """Updates as one rank of a data-parallel job (:mod:`ebrl.distributed`): every rank
    joins every update, asked for by whichever rank's queue falls due first, with what it
    holds; a header first shares each rank's state (done, stopping, steps) and checks that
    the weights agree. The job ends when every rank is done, all at the same update."""
    dp = learner.dp
    rollout = learner.rollout
    while not rollout.steps_per_env.any() and not (rollout.finished or learner.state.stopping):
        await asyncio.sleep(JOINT_POLL_S)  # a rank joins updates once it has a step to store
    # lockstep schedules and lag 0 pause generation to train, so a rank's queue stays due
    # until it trains: an update waits for every rank (a job-wide sync), else for the first
    everyone = learner.pause_generation
    said_done = False
    rounds = 0  # keys are per round, not per version: a skipped update must not re-fire its key
    while True:
        rounds += 1
        asked = False
        while True:  # ask when this queue is due; join when another rank asked (every rank, under sync)
            # a rank that is done asks once (under sync: every round, where it never holds one up)
            done = rollout.finished and (everyone or not said_done)
            if not asked and (learner.state.stopping or done or (not rollout.finished and rollout.due())):
                dp.request(rounds, stop=learner.state.stopping)
                said_done, asked = said_done or rollout.finished, True
            if dp.requested(rounds, dp.world_size if everyone else 1):
                break
            await rollout.wait_changed(JOINT_POLL_S)
        mine = [float(rollout.finished), float(learner.state.stopping), float(learner.stats.simulated),
                float(learner.stats.trained)]
        published = learner.published() if learner.version else None
        rows = await learner.stage.aside(dp.header, mine, published)  # in the learner's thread
        learner.job = {"done": sum(r[0] for r in rows), "stopping": sum(r[1] for r in rows),
                       "env_steps": int(sum(r[2] for r in rows)), "trained": int(sum(r[3] for r in rows)),
                       "rank_env_steps": [int(r[2]) for r in rows]}
        if learner.job["stopping"]:
            learner.state.stop()  # every rank stops at the same update
            rollout.poke()
            return
        if not rollout.steps_per_env.any():  # a rank must have stored a step to bring its (empty) batch
            raise RuntimeError(f"rank {dp.rank} ended before recording any step: it cannot take part in updates")
        if learner.pause_generation:
            await learner.generator.pause()
        slots = await rollout.take(learner.version, joint=True)
        await learner.train(slots)
        if learner.job["done"] == dp.world_size:  # each rank handed over everything: the last update
            return
