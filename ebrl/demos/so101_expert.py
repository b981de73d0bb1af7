"""The scripted SO-101 pick: above the cube, down, close, lift (``so101/PickCube``).

It reads the true cube position and the grasp point from the simulator, as the ManiSkill experts
read privileged state, so it works from pixel observations too (which carry no cube position).
It needs the package's top-down grasp, ``top_down_ik=True`` (the gripper points down, the action
moves the point between the jaws) and ``jaw_pads=True`` (flat fingertips to pinch with): without
them the package's position-only IK cannot straddle the cube, and nothing is lifted. ``ebrl demos
collect so101/PickCube --policy scripted`` asks for both and for ``action_scale=0.025`` (2.5 cm a
unit of action, the scale the package's own controllers use) unless told otherwise.

It is stateful (closing takes steps in which nothing observable changes) and starts over when the
simulator's clock reads zero, i.e. after each ``reset``. Measured here (seeds ``1 << 29`` on):
10 of 10 with the fixed cube; with ``random_block_position=True`` 14 of 20 from state and 7 of 10
at 64 pixels; the misses are cubes beyond x ~ 0.38 m, which the arm cannot reach pointing down.

    >>> from ebrl.envs import make
    >>> from ebrl.demos.so101_expert import EXPERT_ENV_KWARGS, so101_pick
    >>> env = make("so101/PickCube", **EXPERT_ENV_KWARGS)
    >>> act = so101_pick(env)
    >>> obs, info = env.reset(seed=0)
    >>> for _ in range(60):
    ...     obs, reward, terminated, truncated, info = env.step(act(obs))
    ...     if terminated:
    ...         break
    >>> info["success"]
    True
    >>> env.close()
"""

from __future__ import annotations

from typing import Any

import numpy as np

# what the expert needs of the env (collect asks for these unless told otherwise)
EXPERT_ENV_KWARGS = {"top_down_ik": True, "jaw_pads": True, "action_scale": 0.025}
HOVER = 0.07  # m above the table: clear of the cube while lining up over it
GRASP = 0.015  # m above the table: the pads pinch the cube's upper half (the package's pick-place value)
LIFT = 0.13  # m above the grasp height: past the task's 10 cm, with room for the cube slipping
TOLERANCE = 0.004  # m: close enough to a waypoint to go on
CAREFUL = 0.4  # action units while the jaws are at the cube: slow enough not to knock it over
CLOSE_STEPS = 10  # control steps for the jaws to close (nothing observable says when they have)
TIMEOUT = 40  # steps in one moving phase, so an unreachable waypoint does not stall the episode
OPEN, CLOSED = 1.0, 0.0


class SO101Pick:
    """Hover over the cube, descend, close, lift and hold; ``act(obs)`` reads the simulator."""

    PHASES = ("hover", "descend", "close", "lift")

    def __init__(self, env):
        self.base = env.unwrapped
        if not getattr(self.base, "_top_down_ik", False):
            raise ValueError("the so101/PickCube expert grasps from above: make the env with top_down_ik=True and "
                             "jaw_pads=True (ebrl demos collect does unless told otherwise)")
        self.scale = float(self.base._action_scale)
        self.reset()

    def reset(self) -> None:
        self.phase, self.steps, self.table_z = 0, 0, None

    def _target(self, grasp: np.ndarray, cube: np.ndarray) -> np.ndarray:
        name = self.PHASES[self.phase]
        if name == "hover":
            return np.array([cube[0], cube[1], self.table_z + HOVER])
        if name == "descend":
            return np.array([cube[0], cube[1], self.table_z + GRASP])
        return np.array([grasp[0], grasp[1], self.table_z + GRASP + LIFT])  # lift, then hold there

    def __call__(self, _obs: Any) -> np.ndarray:
        data = self.base._data
        if data.time < 1e-9:  # a fresh episode: the package's reset zeroes the clock
            self.reset()
        grasp = np.asarray(self.base.ik_point_pos, np.float64)
        cube = np.asarray(data.sensor("block_pos").data, np.float64)
        if self.table_z is None:
            self.table_z = float(cube[2])
        while True:
            name = self.PHASES[self.phase]
            if name == "close":
                delta, done = np.zeros(3), self.steps >= CLOSE_STEPS
            else:
                error = self._target(grasp, cube) - grasp
                limit = CAREFUL if name in ("descend", "lift") else 1.0
                delta = np.clip(error / self.scale, -limit, limit)
                done = name != "lift" and (np.linalg.norm(error) < TOLERANCE or self.steps >= TIMEOUT)
            if not done:
                break
            self.phase, self.steps = self.phase + 1, 0
        self.steps += 1
        return np.array([*delta, OPEN if self.phase < 2 else CLOSED], np.float32)


def so101_pick(env) -> SO101Pick:
    """The ``so101/PickCube`` expert for ``env`` (made with :data:`EXPERT_ENV_KWARGS`)."""
    return SO101Pick(env)


__all__ = ["EXPERT_ENV_KWARGS", "SO101Pick", "so101_pick"]
