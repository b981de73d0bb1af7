"""ManiSkill3 tasks: ``make("maniskill/PickCube-v1")``, on the CPU or, vectorised, on a CUDA GPU.

Where the envs run follows what the machine has (``sim_backend=`` overrides it):

- **CPU** (no CUDA GPU, or ``sim_backend="physx_cpu"``): ManiSkill's CPU backend steps one
  scene per instance, so each env is a plain ``gym.Env`` (:class:`ManiSkillEnv`) that the
  runtime's thread or process pools host like any other env: ``RunConfig(num_envs=N)``, or
  ``make_vector("maniskill/PickCube-v1", N)`` for a gymnasium ``SyncVectorEnv`` of N of them.
  ``num_envs=N > 1`` in ``make`` is refused there.
- **CUDA GPU** (``sim_backend="physx_cuda"``, the default when ``torch.cuda.is_available()``):
  ManiSkill steps all ``num_envs`` scenes of a task in one call (PhysX GPU, with batched
  rendering), so the runtime hosts them as one unit: :class:`ManiSkillEnvs`, a gymnasium
  ``VectorEnv`` run with ``sim.vector_size = num_envs`` (several such units on one GPU work
  too). It resets finished envs in the same call (``AutoresetMode.SAME_STEP``, ManiSkill's
  partial reset ``options={"env_idx": ...}``), their last observation in
  ``infos["final_obs"]``. Actions go to the simulator's device; everything else comes back
  as NumPy arrays in host memory, where the runtime keeps its rollouts.

Both give the same observations: ``obs_mode="state"`` (the default) ManiSkill's flat float32
state vector; ``pixels=128`` renders the task's sensor cameras (sorted by name; ``camera=``
picks one) at that size and gives ``{"pixels": uint8 [H, W, 3 * cameras], "state": float32}``
(agent and task state flattened), like :class:`ebrl.envs.PixelObservation`. ``info["success"]``
(a bool; a bool array of the vector env) feeds the runtime's ``success_once``/``success_at_end``. Episode ends:
success is ``terminated`` (as ManiSkill reports it), the task's time limit (ManiSkill's
``max_episode_steps``, 50 for PickCube) ``truncated``; ``env.spec.max_episode_steps`` says it
on the CPU. ``ignore_terminations=True`` (ManiSkill's ``ManiSkillVectorEnv`` option of that name)
never reports ``terminated``: episodes run to the time limit, success stays in ``info``. Train
PPO on a dense reward that way: ended at its success, an episode forfeits the dense reward that
staying near the goal keeps paying (PickCube's ``normalized_dense``: 1 at success, about 0.7 a
step just before it, so with ``gamma=0.8`` not succeeding is worth ~3.5 and succeeding 1), and
the critic learns to steer away from success. ManiSkill's own PPO baseline avoids it by
bootstrapping at every episode end (``bootstrap_at_done="always"``). ``reset(seed=s)`` repeats
an episode exactly, and so do the unseeded resets after it (``enhanced_determinism=True`` is the
default here).

Install: ``pip install 'ebrl[maniskill]'``. ManiSkill simulates and renders through SAPIEN,
which needs a Vulkan device even for state observations: on a machine without a GPU, Mesa's
lavapipe (a CPU Vulkan driver, Mesa >= 25); with an NVIDIA GPU, its driver's Vulkan ICD.
Without one ``make`` says what to install instead of failing deep inside SAPIEN. SAPIEN's
Vulkan context does not survive ``fork``: with ``sim.backend="process"``, close the ManiSkill
envs you built in the parent before the run (``close()`` frees them at once; the runtime's own
are), or a worker that renders hangs in the driver. CPU example
(~4 s to build, then several hundred steps/s)::

    >>> from ebrl.envs import make
    >>> env = make("maniskill/PickCube-v1")                            # doctest: +SKIP
    >>> obs, info = env.reset(seed=0)                                  # doctest: +SKIP
    >>> obs.shape, env.action_space.shape, env.spec.max_episode_steps  # doctest: +SKIP
    ((42,), (8,), 50)

and on a GPU, 256 envs as one vector env::

    >>> import ebrl
    >>> envs = make("maniskill/PickCube-v1", num_envs=256)            # doctest: +SKIP
    >>> cfg = ebrl.RunConfig(num_envs=256, sim={"vector_size": 256})   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
from typing import Any

import gymnasium as gym
import numpy as np

from ebrl.config import did_you_mean
from ebrl.spaces import index, tree_map

INSTALL = "pip install 'ebrl[maniskill]' (ManiSkill3 and SAPIEN; SAPIEN also needs a Vulkan driver)"
NO_VULKAN = ("ManiSkill found no Vulkan device ({error}): SAPIEN needs one even for state observations. "
             "Install a Vulkan driver: without a GPU Mesa >= 25's lavapipe (Debian 12: apt-get install -t "
             "bookworm-backports mesa-vulkan-drivers libvulkan1; Debian 12's own Mesa 22 lacks an extension "
             "SAPIEN needs; the repo's .ci/install-system does this), with an NVIDIA GPU its driver's Vulkan ICD "
             "(/usr/share/vulkan/icd.d/nvidia_icd.json); check with `vulkaninfo --summary`")
NO_CUDA = ("ManiSkill's GPU simulation (sim_backend='physx_cuda') needs a CUDA GPU ({error}); "
           "sim_backend='physx_cpu' steps one env per instance on the CPU")
ONE_PER_INSTANCE = ("maniskill/{task} num_envs={n}: ManiSkill's CPU backend (sim_backend='physx_cpu'{why}) steps "
                    "one env per instance; run N envs with RunConfig(num_envs=N) or make_vector('maniskill/{task}', "
                    "N), or sim_backend='physx_cuda' on a CUDA GPU")
CPU_BACKENDS = ("cpu", "physx_cpu")  # ManiSkill's names for its CPU backend; every other one is a CUDA device


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def uses_gpu(sim_backend: str | None = None) -> bool:
    """Whether ``maniskill/`` envs run GPU-vectorised: ``sim_backend`` if given, else CUDA's presence."""
    return cuda_available() if sim_backend is None else sim_backend not in CPU_BACKENDS


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


def make_maniskill(task: str, *, num_envs: int | None = None, pixels: int | tuple[int, int] | None = None,
                   camera: str | None = None, sim_backend: str | None = None, **kwargs) -> gym.Env:
    """``maniskill/<task>`` as this machine runs it: :class:`ManiSkillEnvs` (``num_envs``, default
    1) when :func:`uses_gpu`, else one :class:`ManiSkillEnv` under gymnasium's ``TimeLimit`` at the
    task's own limit (which ManiSkill applies too; the wrapper puts it in ``env.spec``)."""
    _import()
    if uses_gpu(sim_backend):
        return ManiSkillEnvs(task, 1 if num_envs is None else num_envs, pixels=pixels, camera=camera,
                             sim_backend=sim_backend or "physx_cuda", **kwargs)
    if num_envs not in (None, 1):
        why = "" if sim_backend else ": no CUDA GPU here"
        raise ValueError(ONE_PER_INSTANCE.format(task=task, n=num_envs, why=why))
    env = ManiSkillEnv(task, pixels=pixels, camera=camera, sim_backend=sim_backend or "physx_cpu", **kwargs)
    limit = env.max_episode_steps
    return gym.wrappers.TimeLimit(env, limit) if limit else env


def _build(task: str, num_envs: int, pixels: int | tuple[int, int] | None, **kwargs) -> gym.Env:
    """``gym.make`` of a ManiSkill task, SAPIEN's missing-device errors turned into what to do."""
    _import()
    if not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"maniskill num_envs={num_envs!r}: must be an integer >= 1")
    if task not in gym.registry:
        raise ValueError(f"unknown ManiSkill task {task!r}{did_you_mean(task, task_names())}")
    if pixels is not None:
        height, width = (pixels, pixels) if isinstance(pixels, int) else tuple(pixels)
        kwargs.setdefault("obs_mode", "rgb")
        kwargs.setdefault("sensor_configs", {"width": width, "height": height})
    if not cuda_available():
        kwargs.setdefault("render_backend", "cpu")  # what ManiSkill falls back to, without its warning
    # an unseeded reset (every autoreset) then draws its episode from the last seed, under a seeded
    # torch RNG, instead of from torch's global RNG: episodes repeat with the seed
    kwargs.setdefault("enhanced_determinism", True)
    try:
        return gym.make(task, num_envs=num_envs, **kwargs)
    except RuntimeError as exc:  # SAPIEN raises these when it finds no device (checked with SAPIEN 3.0.3)
        text = str(exc).lower()
        if 'device "cuda"' in text:
            raise RuntimeError(NO_CUDA.format(error=exc)) from None
        if any(w in text for w in ("vulkan", "vk::", "rendering device", "render device")):
            raise RuntimeError(NO_VULKAN.format(error=exc)) from None
        raise


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


def _observe(obs: Any, pixels: bool, camera: str | None) -> Any:
    """ManiSkill's batched observation on its device -> host NumPy [N, ...] in this module's layout."""
    if not pixels:
        return _to_numpy(obs).astype(np.float32, copy=False)
    import torch

    sensors = obs["sensor_data"]
    names = [camera] if camera is not None else sorted(sensors)
    missing = [n for n in names if n not in sensors]
    if missing:
        raise ValueError(f"maniskill camera {missing[0]!r} not among the task's sensors: {sorted(sensors)}")
    rgb = torch.cat([sensors[n]["rgb"] for n in names], dim=-1)
    return {"pixels": _to_numpy(rgb).astype(np.uint8, copy=False), "state": _to_numpy(_flat_state(obs))}


def _space(first: Any, pixels: bool) -> gym.spaces.Space:
    """The single-env observation space of a batched observation ``first``."""
    if pixels:
        return gym.spaces.Dict({
            "pixels": gym.spaces.Box(0, 255, first["pixels"].shape[1:], np.uint8),
            "state": gym.spaces.Box(-np.inf, np.inf, first["state"].shape[1:], np.float32)})
    return gym.spaces.Box(-np.inf, np.inf, first.shape[1:], np.float32)


class ManiSkillEnv(gym.Env):
    """One ManiSkill task on its CPU backend (one scene per instance) as a plain gymnasium env.

    Observations as :class:`ManiSkillEnvs` gives them, unbatched; rewards are floats, flags and
    ``info["success"]`` bools, other info values Python numbers. ``env.spec`` (id
    ``maniskill/<task>``, the constructor's arguments) rebuilds it with ``env.spec.make()``.
    ``render_mode="rgb_array"`` makes ``render()`` return ManiSkill's render camera as uint8
    [H, W, 3].
    """

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, task: str, *, pixels: int | tuple[int, int] | None = None, camera: str | None = None,
                 sim_backend: str = "physx_cpu", render_mode: str | None = None, ignore_terminations: bool = False,
                 **kwargs):
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"ManiSkillEnv render_mode={render_mode!r}: must be None or 'rgb_array'")
        self.ignore_terminations = _flag("ignore_terminations", ignore_terminations)
        self.env = _build(task, 1, pixels, sim_backend=sim_backend, render_mode=render_mode, **kwargs)
        self.spec = gym.envs.registration.EnvSpec(
            f"maniskill/{task}", entry_point=f"{__name__}:ManiSkillEnv", nondeterministic=False,
            order_enforce=False, disable_env_checker=True,
            kwargs={"task": task, "pixels": pixels, "camera": camera, "sim_backend": sim_backend,
                    **({"render_mode": render_mode} if render_mode else {}),
                    **({"ignore_terminations": True} if ignore_terminations else {}), **kwargs})
        self.render_mode = render_mode
        self.pixels, self.camera = pixels is not None, camera
        # ManiSkill's own time limit (its TimeLimitWrapper keeps the registered or given one here)
        self.max_episode_steps: int | None = getattr(self.env, "_max_episode_steps", None)
        self.action_space = self.env.unwrapped.single_action_space
        with _closed_on_error(self):
            obs, _ = self.env.reset(seed=0)
            self.observation_space = _space(_observe(obs, self.pixels, camera), self.pixels)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        obs, info = self.env.reset(seed=seed, options=options)
        return index(_observe(obs, self.pixels, self.camera), 0), _unbatch(info)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(np.asarray(action, np.float32))
        return (index(_observe(obs, self.pixels, self.camera), 0), float(reward),
                bool(terminated) and not self.ignore_terminations, bool(truncated), _unbatch(info))

    def render(self):
        if self.render_mode is None:
            return None
        return _to_numpy(self.env.render())[0].astype(np.uint8, copy=False)

    def close(self) -> None:
        _close(self)


def _close(owner: ManiSkillEnv | ManiSkillEnvs) -> None:
    """Close ``owner.env`` (a ManiSkill env), drop it and free its SAPIEN scene now, in this
    process (ManiSkill's task objects keep the scene alive as long as the env). Left to a later
    garbage collection, the last scene could be freed in a process forked from this one (the
    runtime's sim workers, its learner), which then hangs for good in the Vulkan driver, tearing
    down a render context whose driver threads exist only here (seen with lavapipe)."""
    env, owner.env = owner.env, None
    if env is not None:
        env.close()
        del env
        gc.collect()


@contextlib.contextmanager
def _closed_on_error(owner: ManiSkillEnv | ManiSkillEnvs):
    """A constructor that fails (a camera the task lacks) frees its scene, see :func:`_close`."""
    try:
        yield
    except BaseException:
        _close(owner)
        raise


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"maniskill {name}={value!r}: must be true or false")
    return value


def _unbatch(info: dict) -> dict:
    """ManiSkill's info of one env (tensors of [1]) -> Python scalars (arrays of their own for
    per-env arrays): gymnasium's vector envs batch Python bools into bool arrays, NumPy ones
    into object arrays."""
    return {k: v[0].item() if v.ndim == 1 else v[0] for k, v in _info(info, 1).items()}


class ManiSkillEnvs(gym.vector.VectorEnv):
    """One ManiSkill task, ``num_envs`` envs stepped together; same-step autoreset."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, task: str, num_envs: int, *, pixels: int | tuple[int, int] | None = None,
                 camera: str | None = None, ignore_terminations: bool = False, **kwargs):
        self.ignore_terminations = _flag("ignore_terminations", ignore_terminations)
        self.env = _build(task, num_envs, pixels, **kwargs)
        self.pixels, self.camera = pixels is not None, camera
        base = self.env.unwrapped
        self.device = getattr(base, "device", None)
        self.num_envs = num_envs
        self.single_action_space = base.single_action_space
        with _closed_on_error(self):
            obs, _ = self.env.reset(seed=0)
            self.single_observation_space = _space(self._observe(obs), self.pixels)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def _observe(self, obs: Any) -> Any:
        return _observe(obs, self.pixels, self.camera)
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
        terminated = _flags(terminated, self.num_envs) & (not self.ignore_terminations)
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
        _close(self)


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
