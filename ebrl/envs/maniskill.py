"""ManiSkill3 GPU-vectorised tasks as one vector env: ``make("maniskill/PickCube-v1", num_envs=256)``.

ManiSkill steps all ``num_envs`` scenes of a task in one call on the GPU (PhysX GPU, with
batched rendering), so the runtime hosts it as one unit: run it with ``sim.vector_size =
num_envs`` (several such units on one GPU work too). :class:`ManiSkillEnvs` is a gymnasium
``VectorEnv`` with ``AutoresetMode.SAME_STEP``: envs whose episode ends are reset in the same
call (ManiSkill's partial reset, ``options={"env_idx": ...}``) and their last observation is
in ``infos["final_obs"]``. Observations, rewards and flags come back as NumPy arrays in host
memory, where the runtime keeps its rollouts; actions go to the simulator's device.

Observations: ``obs_mode="state"`` gives ManiSkill's flat state vector; ``pixels=128`` renders
the task's sensor cameras (sorted by name; ``camera=`` picks one) at that size and gives
``{"pixels": uint8 [H, W, 3 * cameras], "state": float32}`` (agent and task state flattened),
like :class:`ebrl.envs.PixelObservation`.
``info["success"]`` feeds the runtime's ``success_once``/``success_at_end``.

Install: ``pip install 'ebrl[maniskill]'``. ManiSkill renders and simulates through SAPIEN,
which needs a Vulkan-capable GPU driver even for state observations; on a machine without one,
``make`` says so instead of failing deep inside SAPIEN. Example (on a GPU machine)::

    >>> import ebrl
    >>> from ebrl.envs import make
    >>> envs = make("maniskill/PickCube-v1", num_envs=256)            # doctest: +SKIP
    >>> cfg = ebrl.RunConfig(num_envs=256, sim={"vector_size": 256})   # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.envs import did_you_mean
from ebrl.spaces import tree_map

INSTALL = "pip install 'ebrl[maniskill]' (ManiSkill3 and SAPIEN; a Vulkan-capable GPU driver is needed to run it)"
NO_VULKAN = ("ManiSkill could not start SAPIEN's renderer/simulator: it needs a Vulkan-capable GPU and driver "
             "(NVIDIA: the driver's Vulkan ICD, e.g. /usr/share/vulkan/icd.d/nvidia_icd.json; check with "
             "`vulkaninfo`). CPU-only machines cannot run ManiSkill; use the mujoco, robotics or dmc suites.")
NO_CUDA = ("ManiSkill's GPU simulation (sim_backend='gpu', the default for num_envs > 1) needs a CUDA GPU; "
           "sim_backend='cpu' steps one env per instance and still needs a Vulkan driver to build the scene.")


def _import():
    try:
        import mani_skill.envs  # noqa: F401  (importing registers the ManiSkill task ids)
    except ImportError as exc:
        if importlib.util.find_spec("mani_skill") is None:
            raise ImportError(f"maniskill envs need ManiSkill3: {INSTALL}") from None
        raise ImportError(f"ManiSkill3 is installed but failed to import ({exc}); reinstall it: {INSTALL}") from exc


def task_names() -> list[str]:
    """Registered ManiSkill task ids (empty when ManiSkill is not installed)."""
    try:
        _import()
    except ImportError:
        return []
    return sorted(k for k, spec in gym.registry.items() if _is_maniskill(spec.entry_point))


def _is_maniskill(entry_point: Any) -> bool:
    # ManiSkill registers functools.partial(mani_skill.utils.registration.make, env_id=...)
    fn = getattr(entry_point, "func", entry_point)
    return "mani_skill" in (entry_point if isinstance(entry_point, str) else getattr(fn, "__module__", "") or "")


def _flat_state(obs: dict) -> Any:
    """Concatenate every tensor under ``agent`` and ``extra`` into [N, D] float32 (sorted keys)."""
    import torch

    parts = []

    def walk(node):
        for key in sorted(node):
            v = node[key]
            if isinstance(v, dict):
                walk(v)
            else:
                parts.append(v.reshape(v.shape[0], -1).float())

    for group in ("agent", "extra"):
        if group in obs:
            walk(obs[group])
    return torch.cat(parts, dim=1)


def _to_numpy(x: Any) -> Any:
    """A tensor (or dict of them) as NumPy arrays of their own: a CPU tensor's ``.numpy()`` would
    share its memory, and ManiSkill's CPU backend returns tensors it updates in place (the
    ``elapsed_steps`` of every info), which would change arrays already handed out."""
    return tree_map(_leaf_to_numpy, x)


def _leaf_to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach()
        return x.numpy().copy() if x.device.type == "cpu" else x.cpu().numpy()
    return np.array(x)


class ManiSkillEnvs(gym.vector.VectorEnv):
    """One ManiSkill task, ``num_envs`` envs stepped together; same-step autoreset."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, task: str, num_envs: int, *, pixels: int | tuple[int, int] | None = None,
                 camera: str | None = None, **kwargs):
        _import()
        if not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"maniskill num_envs={num_envs!r}: must be an integer >= 1")
        if task not in gym.registry:
            raise ValueError(f"unknown ManiSkill task {task!r}{did_you_mean(task, task_names())}")
        self.pixels = pixels is not None
        if self.pixels:
            height, width = (pixels, pixels) if isinstance(pixels, int) else tuple(pixels)
            kwargs.setdefault("obs_mode", "rgb")
            kwargs.setdefault("sensor_configs", {"width": width, "height": height})
        self.camera = camera
        try:
            self.env = gym.make(task, num_envs=num_envs, **kwargs)
        except RuntimeError as exc:  # SAPIEN reports missing devices as RuntimeErrors
            text = str(exc).lower()
            if 'device "cuda"' in text:
                raise RuntimeError(f"{NO_CUDA} ({exc})") from None
            if any(w in text for w in ("vulkan", "vk::", "rendering device", "render device")):
                raise RuntimeError(f"{NO_VULKAN} ({exc})") from None
            raise
        base = self.env.unwrapped
        self.device = getattr(base, "device", None)
        self.num_envs = num_envs
        self.single_action_space = base.single_action_space
        obs, _ = self.env.reset(seed=0)
        first = self._observe(obs)
        if self.pixels:
            h, w, c = first["pixels"].shape[1:]
            self.single_observation_space = gym.spaces.Dict({
                "pixels": gym.spaces.Box(0, 255, (h, w, c), np.uint8),
                "state": gym.spaces.Box(-np.inf, np.inf, first["state"].shape[1:], np.float32)})
        else:
            self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, first.shape[1:], np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def _observe(self, obs: Any) -> Any:
        """ManiSkill's observation on its device -> host NumPy in this adapter's layout."""
        if not self.pixels:
            return _to_numpy(obs).astype(np.float32, copy=False)
        import torch

        sensors = obs["sensor_data"]
        names = [self.camera] if self.camera is not None else sorted(sensors)
        missing = [n for n in names if n not in sensors]
        if missing:
            raise ValueError(f"maniskill camera {missing[0]!r} not among the task's sensors: {sorted(sensors)}")
        rgb = torch.cat([sensors[n]["rgb"] for n in names], dim=-1)
        return {"pixels": _to_numpy(rgb).astype(np.uint8, copy=False), "state": _to_numpy(_flat_state(obs))}

    def reset(self, *, seed: int | list[int | None] | None = None, options: dict | None = None):
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        if mask is not None:
            # partial reset: ManiSkill draws these envs' next episodes from its per-env RNG streams,
            # which the last full reset seeded, so runs stay reproducible
            import torch

            options["env_idx"] = torch.as_tensor(np.flatnonzero(mask), device=self.device)
            obs, info = self.env.reset(options=options)
        else:
            if isinstance(seed, list) and any(s is None for s in seed):
                seed = None
            obs, info = self.env.reset(seed=seed, options=options or None)
        return self._observe(obs), _info(info, self.num_envs)

    def step(self, actions):
        import torch

        act = torch.as_tensor(np.asarray(actions), dtype=torch.float32, device=self.device)
        obs, reward, terminated, truncated, info = self.env.step(act)
        terminated = _flags(terminated, self.num_envs)
        truncated = _flags(truncated, self.num_envs)
        done = terminated | truncated
        obs = self._observe(obs)
        infos = _info(info, self.num_envs)
        if done.any():
            rows = np.flatnonzero(done)
            final_obs = np.full(self.num_envs, None, dtype=object)
            for i in rows:
                final_obs[i] = {k: v[i].copy() for k, v in obs.items()} if self.pixels else obs[i].copy()
            new_obs, _ = self.reset(options={"reset_mask": done})
            if self.pixels:
                for k in obs:
                    obs[k][rows] = new_obs[k][rows]
            else:
                obs[rows] = new_obs[rows]
            # step infos stay (a finished env's entry is its episode's last, kept in final_info too)
            infos = {**infos, "final_obs": final_obs, "_final_obs": done, "final_info": dict(infos), "_final_info": done}
        return obs, _to_numpy(reward).astype(np.float32).reshape(self.num_envs), terminated, truncated, infos

    def close_extras(self, **kwargs) -> None:
        self.env.close()


def _flags(x: Any, n: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(_to_numpy(x), bool).reshape(-1), (n,)).copy()


def _info(info: dict, n: int) -> dict:
    """ManiSkill's batched info (tensors) -> gymnasium vector infos (NumPy, [n]-shaped only)."""
    out = {}
    for key, value in info.items():
        v = _to_numpy(value)
        if isinstance(v, np.ndarray) and v.ndim >= 1 and v.shape[0] == n:
            out[key] = v
    return out
