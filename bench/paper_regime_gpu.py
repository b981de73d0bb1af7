"""The paper's regime on a real GPU next to its emulated twin: a check of the emulated device's
scheduling model (``ebrl.emulated``) against a measurement, on the first machine with CUDA.

    python bench/paper_regime_gpu.py                                  # CUDA: a published-size π0 in bf16
    python bench/paper_regime_gpu.py --tiny --device cpu --env mock   # the same steps, tiny (what the tests run)

1. A published-size π0 with random weights (``ebrl.testing.save_random_pi0(full_size=True)``,
   nothing downloaded), LoRA rank 32, on the device, reading two blank 224-pixel cameras and the
   env's state (its first 32 entries: π0's ``max_state_dim``), acting in chunks of 5.
2. Calibration: its policy call at batch 1, 4 and 8 and its training step (forward, backward,
   AdamW) at 4 and 8 samples, each the median of a few after a warm-up, fitted to a
   :class:`~ebrl.emulated.DeviceProfile` as the published figures are (``fit_line``).
3. Runs, one after another in one process, in the order real async, real sync, emulated sync,
   emulated async: the ``paper-regime`` suite's ManiSkill3 ``PickCube-v1`` from state
   (``--env mock``: a mock env), ``ENVS`` envs (``--tiny``: 2), ``SEGMENTS`` segments of
   ``SEGMENT`` decisions per env, PPO at its defaults and every runtime knob at its default
   (the device shared on priority streams). The emulated runs put the suite's small policy
   (``policy_for``: chunks and denoising steps as the suite's) on an emulated device running the
   calibrated profile.

Written to ``--out`` (JSON): the profile, each run's env steps/s, updates and busy shares, and
per schedule the emulated run's steps/s over the real one's; and async/sync on each. A check of
the model on one machine, not a timing claim: one round, no fresh processes. Where the two
differ, the emulation's blind spots are the first suspects: contention between concurrent
kernels, a kernel waiting for the other stream's blocks, launch overhead, host copies
(docs/gpu.md). Without CUDA (and without ``--device cpu``) it says why it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from ebrl.benchmark.loader import load_suite
from ebrl.benchmark.suite import median_call_s

SUITE = load_suite("paper-regime")  # the workload, its chunks and its small policy: the emulated twin's
CHUNK, DENOISE_STEPS = SUITE.CHUNK, SUITE.DENOISE_STEPS
ENVS, SEGMENT, SEGMENTS = 8, 8, 2
MAX_STATE = 32  # π0's max_state_dim: a longer state is cut to its first entries (the timing does not read it)
WORD = "pick up the cube"
CAMERAS = ("agentview", "wrist")


class BlankCameras(gym.ObservationWrapper):
    """A state env's observation as π0 reads it: blank camera frames and the state's first
    ``MAX_STATE`` entries (the model's cost does not depend on the pixels)."""

    def __init__(self, env: gym.Env, size: int):
        super().__init__(env)
        n = min(MAX_STATE, int(np.prod(env.observation_space.shape)))
        self._frame = np.zeros((size, size, 3), np.uint8)
        self.observation_space = gym.spaces.Dict(
            {**{k: gym.spaces.Box(0, 255, (size, size, 3), np.uint8) for k in CAMERAS},
             "state": gym.spaces.Box(-np.inf, np.inf, (n,), np.float32)})
        self._n = n

    def observation(self, obs):
        state = np.asarray(obs, np.float32).reshape(-1)[: self._n]
        return {**{k: self._frame for k in CAMERAS}, "state": state}


def make_env(kind: str):
    if kind == "mock":
        from ebrl.testing import Latency, MockEnv

        return MockEnv(dim=8, episode_len=50, latency=Latency.constant(0.002))
    return SUITE.maniskill(0)


class EnvFn:
    """A picklable ``env_fn`` (worker processes build the envs): ``kind``'s env, with blank
    cameras of ``size`` pixels or without (``None``)."""

    def __init__(self, kind: str, size: int | None):
        self.kind, self.size = kind, size

    def __call__(self, i: int):
        env = make_env(self.kind)
        return env if self.size is None else BlankCameras(env, self.size)


def observations(space: gym.spaces.Dict, n: int) -> dict:
    return {k: np.zeros((n, *s.shape), s.dtype) for k, s in space.spaces.items()}


def calibrate(policy, space, device: torch.device, reps: int):
    """The policy's call and training step on this device, fitted as the published figures are."""
    from ebrl.emulated import PI0_DENOISE_SHARE, DeviceProfile, fit_line

    act_s = {b: median_call_s(lambda b=b: policy.act(observations(space, b)), device, reps) for b in (1, 4, 8)}
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step(b: int) -> None:
        obs = observations(space, b)
        chains = torch.as_tensor(policy.act(obs).actions)
        logp, _, value = policy.evaluate(obs, chains)
        (logp.mean() + value.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_s = {b: median_call_s(lambda b=b: step(b), device, reps) - act_s[b] for b in (4, 8)}  # less the act inside
    act_fixed, act_per_row = fit_line(act_s)
    train_fixed, train_per_sample = fit_line(train_s)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    profile = DeviceProfile(f"measured-{device.type}", total_sms=sms, sm_granularity=min(8, sms // 2),
                            act_fixed_s=act_fixed, act_per_row_s=act_per_row, train_fixed_s=train_fixed,
                            train_per_sample_s=train_per_sample, denoise_steps=DENOISE_STEPS,
                            denoise_share=PI0_DENOISE_SHARE, sources="bench/paper_regime_gpu.py calibration")
    return profile, {"act_s": act_s, "train_step_s": train_s}


def run_once(env_fn, policy, schedule: str, envs: int, seed: int) -> dict:
    import ebrl
    from ebrl.algos import PPO

    cfg = ebrl.RunConfig(num_envs=envs, segment_len=SEGMENT, total_env_steps=envs * SEGMENT * SEGMENTS,
                         schedule=schedule, seed=seed)
    t0 = time.perf_counter()
    result = ebrl.run_sync(ebrl.Trainer(env_fn, policy, PPO(seed=seed), cfg))
    wall = time.perf_counter() - t0
    return {"schedule": schedule, "env_steps": result.env_steps, "wall_s": wall, "steps_per_s": result.env_steps / wall,
            "updates": result.updates, "gen_busy": result.generator_busy_s / wall,
            "learner_busy": result.learner_busy_s / wall, "accounting_ok": result.accounting_ok()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random π0 (checks the script, times nothing real)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--env", choices=("maniskill", "mock"), default="maniskill")
    ap.add_argument("--out", default="paper_regime_gpu.json")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("paper_regime_gpu: skipped: no CUDA device here (torch.cuda.is_available() is False); "
              "--tiny --device cpu --env mock runs the same steps on the CPU")
        return 0
    from ebrl.policies.pi0.policy import PI0Policy
    from ebrl.testing import save_random_pi0

    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    size = 16 if args.tiny else 224
    probe = EnvFn(args.env, size)(0)
    obs_space, one_action = probe.observation_space, probe.action_space
    probe.close()
    act_space = gym.spaces.Box(np.broadcast_to(one_action.low, (CHUNK, *one_action.shape)).copy(),
                               np.broadcast_to(one_action.high, (CHUNK, *one_action.shape)).copy(), dtype=np.float32)
    envs = 2 if args.tiny else ENVS
    out: dict = {"command": " ".join(sys.argv), "device": str(device), "dtype": dtype, "env": args.env,
                 "envs": envs, "segment": SEGMENT, "segments": SEGMENTS, "chunk": CHUNK, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        state_dim, action_dim = obs_space["state"].shape[0], one_action.shape[0]
        shape = ({"max_dim": max(8, state_dim, action_dim), "chunk_size": CHUNK, "image_size": size}
                 if args.tiny else {"full_size": True, "device": str(device), "dtype": torch.bfloat16})
        t0 = time.perf_counter()
        save_random_pi0(Path(tmp) / "pi0", state_dim=state_dim, action_dim=action_dim, cameras=len(CAMERAS),
                        sentences=(WORD,), **shape)
        print(f"paper_regime_gpu: built a random π0 in {time.perf_counter() - t0:.0f} s", flush=True)
        real = PI0Policy.from_pretrained(Path(tmp) / "pi0", obs_space, act_space, instruction=WORD, dtype=dtype,
                                         lora_rank=32, denoise_steps=DENOISE_STEPS).to(device)
        profile, calibration = calibrate(real, obs_space, device, reps=2 if args.tiny else 5)
        out["calibration"] = calibration
        out["profile"] = {k: getattr(profile, k) for k in ("name", "total_sms", "act_fixed_s", "act_per_row_s",
                                                            "train_fixed_s", "train_per_sample_s")}
        print(json.dumps(out["profile"]), flush=True)
        for schedule in ("async", "sync"):
            out["runs"].append({"kind": "real", **run_once(EnvFn(args.env, size), real, schedule, envs, 0)})
            print(json.dumps(out["runs"][-1]), flush=True)
        del real
    state_env = EnvFn(args.env, None)
    probe = state_env(0)
    for schedule in ("sync", "async"):
        out["runs"].append({"kind": "emulated", **run_once(state_env, SUITE.policy_for(probe, 0, profile), schedule,
                                                            envs, 0)})
        print(json.dumps(out["runs"][-1]), flush=True)
    probe.close()
    rate = {(r["kind"], r["schedule"]): r["steps_per_s"] for r in out["runs"]}
    out["emulated/real"] = {s: rate["emulated", s] / rate["real", s] for s in ("async", "sync")}
    out["async/sync"] = {k: rate[k, "async"] / rate[k, "sync"] for k in ("real", "emulated")}
    print(json.dumps({k: out[k] for k in ("emulated/real", "async/sync")}, indent=2), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
