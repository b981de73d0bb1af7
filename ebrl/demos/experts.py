"""Scripted experts: hand-written controllers that solve a task from its state, for demonstrations.

``expert_for(name, env)`` returns ``act(obs) -> action`` for the env ``name`` (as ``ebrl.envs.make``
spells it). Each reads the positions it needs from the observation (the Fetch tasks' flattened
``achieved_goal, desired_goal, observation``) or, where the observation does not carry them, from
the simulator (``env.unwrapped``), as ManiSkill's own scripted solutions do. They are good, not
perfect: ``ebrl demos collect`` reports their success rate, and ``--only-success`` keeps the
episodes that succeeded.

- ``mock/reach``: a PD controller towards the instructed target.
- ``robotics/FetchReach*``: the gripper to the goal.
- ``robotics/FetchPush*``: behind the object (seen from the goal), down to the table, push.
- ``robotics/FetchPickAndPlace*``: above the object, down, close, carry to the goal.
- ``maniskill/PushCube-v1``, ``maniskill/PickCube-v1``: the same with ManiSkill's end-effector
  control (``control_mode="pd_ee_delta_pos"``, which the expert asks for).
- ``so101/PickCube``: above the cube, down, close, lift, with the package's top-down grasp
  (:mod:`ebrl.demos.so101_expert`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Expert = Callable[[Any], np.ndarray]
GAIN = 10.0  # Fetch's position control moves 5 cm per unit of action: this closes 1 cm in ~one step


def _towards(grip: np.ndarray, target: np.ndarray, gripper: float, gain: float = GAIN) -> np.ndarray:
    return np.concatenate([np.clip(gain * (target - grip), -1.0, 1.0), [gripper]]).astype(np.float32)


def _fetch_parts(obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(achieved goal, desired goal, robot/object observation) of a flattened Fetch observation."""
    obs = np.asarray(obs, np.float64)
    return obs[0:3], obs[3:6], obs[6:]


def fetch_reach(obs: np.ndarray) -> np.ndarray:
    achieved, goal, _ = _fetch_parts(obs)
    return _towards(achieved, goal, 0.0)


def fetch_push(obs: np.ndarray) -> np.ndarray:
    """Behind the object on the line from the goal through it, at table height, then along that line."""
    obj, goal, o = _fetch_parts(obs)
    grip = o[0:3]
    d = goal[:2] - obj[:2]
    dist = float(np.linalg.norm(d))
    if dist < 0.01:
        return _towards(grip, grip, -1.0)
    u = d / dist
    rel = obj[:2] - grip[:2]
    along, perp = float(rel @ u), float(np.linalg.norm(rel - (rel @ u) * u))
    behind = obj[:2] - 0.06 * u
    low = obj[2]
    if 0.02 < along < 0.1 and perp < 0.02 and abs(grip[2] - low) < 0.02:  # in place: push through to the goal
        target = np.concatenate([grip[:2] + u * min(dist + 0.02, 0.05) + 0.5 * (rel - along * u), [low]])
    elif np.linalg.norm(grip[:2] - behind) < 0.015:  # above the spot: down to the table
        target = np.concatenate([behind, [low]])
    else:  # over to the spot, high enough to pass over the object
        target = np.concatenate([behind, [low + 0.08]])
    return _towards(grip, target, -1.0)


def fetch_pick_and_place(obs: np.ndarray) -> np.ndarray:
    """Above the object, down with the fingers open, close on it, carry it to the goal."""
    obj, goal, o = _fetch_parts(obs)
    grip, fingers = o[0:3], float(o[9] + o[10])
    rel = obj - grip
    if np.linalg.norm(rel) < 0.02 and fingers < 0.06:  # held: carry it
        return _towards(obj, goal, -1.0)
    if np.linalg.norm(rel[:2]) > 0.01:  # over it, high
        return _towards(grip, np.concatenate([obj[:2], [obj[2] + 0.08]]), 1.0)
    if abs(rel[2]) > 0.01:  # down, open
        return _towards(grip, obj, 1.0)
    return _towards(grip, obj, -1.0)  # around it: close


def mock_reach(env) -> Expert:
    base = env.unwrapped

    def act(obs: Any) -> np.ndarray:
        state = np.asarray(obs["state"], np.float64)
        pos, vel = state[:base.dim], state[base.dim:]
        target = base.targets[int(obs["instruction"])]
        return np.clip(3.0 * (target - pos) - 4.0 * vel, -1.0, 1.0).astype(np.float32)

    return act


def maniskill_expert(task: str, env) -> Expert:
    base = env.unwrapped
    base = getattr(base, "env", base).unwrapped  # ebrl's ManiSkillEnv holds ManiSkill's own env
    mode = getattr(base, "control_mode", None)
    if mode != "pd_ee_delta_pos":
        raise ValueError(f"the maniskill/{task} expert drives the end effector: make the env with "
                         f"control_mode='pd_ee_delta_pos' (it has {mode!r})")

    def pos(x) -> np.ndarray:
        p = x.pose.p if hasattr(x, "pose") else x
        p = p.cpu().numpy() if hasattr(p, "cpu") else np.asarray(p)
        return np.asarray(p, np.float64).reshape(-1, 3)[0]

    def push(_obs: Any) -> np.ndarray:
        tcp, cube, goal = pos(base.agent.tcp), pos(base.obj), pos(base.goal_region)
        half = float(getattr(base, "cube_half_size", 0.02))
        behind = cube - np.array([half + 0.03, 0.0, 0.0])
        behind[2] = cube[2]
        if tcp[0] < cube[0] - half and abs(tcp[1] - cube[1]) < 0.01 and abs(tcp[2] - cube[2]) < 0.01:
            target = np.array([goal[0] + 0.02, cube[1], cube[2]])
        elif np.linalg.norm(tcp[:2] - behind[:2]) < 0.01:
            target = behind
        else:
            target = behind + np.array([0.0, 0.0, 0.06])
        return np.concatenate([np.clip(target - tcp, -0.1, 0.1) / 0.1, [-1.0]]).astype(np.float32)

    def pick(_obs: Any) -> np.ndarray:
        tcp, cube = pos(base.agent.tcp), pos(base.cube)
        goal = pos(base.goal_site)
        grasped = bool(np.asarray(base.agent.is_grasping(base.cube)).reshape(-1)[0])
        if grasped:
            target, gripper = goal, -1.0
        elif np.linalg.norm(tcp[:2] - cube[:2]) > 0.01:
            target, gripper = cube + np.array([0.0, 0.0, 0.06]), 1.0
        elif abs(tcp[2] - cube[2]) > 0.01:
            target, gripper = cube, 1.0
        else:
            target, gripper = cube, -1.0
        return np.concatenate([np.clip(target - tcp, -0.1, 0.1) / 0.1, [gripper]]).astype(np.float32)

    experts = {"PushCube-v1": push, "PickCube-v1": pick}
    if task not in experts:
        raise ValueError(f"no scripted expert for maniskill/{task}; there are: {', '.join(experts)}")
    return experts[task]


def expert_for(name: str, env) -> Expert:
    """The scripted expert for env ``name`` (built as ``env``); a clear error where there is none."""
    suite, _, task = name.partition("/")
    if suite == "mock" and task == "reach":
        return mock_reach(env)
    if suite == "robotics":
        if not isinstance(getattr(env, "observation_space", None), type(env.action_space)):  # Box observation
            raise ValueError(f"the {name} expert reads the flattened observation: make it with flatten=True")
        for prefix, expert in (("FetchReach", fetch_reach), ("FetchPush", fetch_push),
                               ("FetchPickAndPlace", fetch_pick_and_place)):
            if task.startswith(prefix):
                return expert
    if suite == "maniskill":
        return maniskill_expert(task, env)
    if suite == "so101" and task == "PickCube":
        from ebrl.demos.so101_expert import so101_pick

        return so101_pick(env)
    raise ValueError(f"no scripted expert for {name}: there are mock/reach, robotics/FetchReach*, FetchPush*, "
                     "FetchPickAndPlace*, maniskill/PushCube-v1 and PickCube-v1, so101/PickCube; or collect with a "
                     "trained policy (--policy RUN_DIR)")
