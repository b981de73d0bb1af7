"""π0 / π0.5 on a GPU: what the first machine with CUDA should measure, as one script.

    python bench/gpu_pi0.py                      # a published-size random π0, then π0.5, in bf16
    python bench/gpu_pi0.py --path /models/pi0   # your own checkpoint instead
    python bench/gpu_pi0.py --tiny --device cpu  # the same steps on a tiny model (what the tests run)

Without CUDA (and without ``--device cpu``) it prints why it skipped and exits 0. Per model it
writes one JSON object (``--out``, default ``gpu_pi0.json``) with:

- ``faithful_max_abs``: ``PI0Policy.act`` with ``method="ode"`` against the model's own
  ``sample_actions`` from the same noise, in the model's dtype (bf16 rounds; this says by how much);
- ``act_ms``: milliseconds per ``act`` call (Flow-Noise, 10 denoising steps, two 224-pixel
  cameras) at batch sizes 1, 8, 32 (median of 5 after a warm-up), and the peak memory;
- ``update_s``: one PPO update (LoRA rank 32) on 64 stored decisions, with and without gradient
  checkpointing, and the peak memory of each;
- ``publication_mb``: what one weight publication moves (LoRA's trainables) against the whole
  state.

Nothing is downloaded: the published-size model is built from ``PI0Config()``'s defaults with
random weights (``ebrl.testing.save_random_pi0(full_size=True)``), which times the same
architecture a real checkpoint has.
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

from ebrl.benchmark.suite import median_call_s

STATE, ACTIONS, EXECUTE = 8, 7, 5  # LIBERO's: 8 state dims, 7 action dims; πRL executes 5 of each chunk
CAMERAS = {"agentview": (224, 224), "wrist": (224, 224)}
WORDS = ["put the bowl on the plate"]


def spaces():
    obs = {k: gym.spaces.Box(0, 255, (h, w, 3), np.uint8) for k, (h, w) in CAMERAS.items()}
    obs["state"] = gym.spaces.Box(-np.inf, np.inf, (STATE,), np.float32)
    return gym.spaces.Dict(obs), gym.spaces.Box(-1.0, 1.0, (EXECUTE, ACTIONS), np.float32)


def observations(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    obs = {k: rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for k, (h, w) in CAMERAS.items()}
    obs["state"] = rng.standard_normal((n, STATE)).astype(np.float32)
    return obs


def peak_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e6 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def stored_batch(policy, obs: dict, segments: int):
    """What the rollout storage hands PPO after ``policy`` acted on ``obs``: ``segments`` segments
    of equal length, zero rewards, no episode ends (the update's cost does not depend on them)."""
    from ebrl.algos.batch import Batch

    out = policy.act(obs)
    steps = len(out.logprobs) // segments
    shaped = {k: torch.as_tensor(v).reshape(segments, steps, *np.shape(v)[1:]) for k, v in obs.items()}
    no = torch.zeros(segments, steps, dtype=torch.bool)
    return Batch(obs=shaped, actions=torch.from_numpy(out.actions).reshape(segments, steps, *out.actions.shape[1:]),
                 logprobs=torch.from_numpy(out.logprobs).reshape(segments, steps),
                 values=torch.from_numpy(out.values).reshape(segments, steps),
                 rewards=torch.zeros(segments, steps), terminated=no, truncated=no,
                 mask=torch.ones(segments, steps, dtype=torch.bool),
                 versions=torch.zeros(segments, steps, dtype=torch.long),
                 bootstrap_obs={k: v[:, -1] for k, v in shaped.items()},
                 final_obs={k: v[:0, 0] for k, v in shaped.items()}, final_index=torch.zeros(0, 2, dtype=torch.long))


def measure(path: Path, device: torch.device, dtype: str, batches: tuple[int, ...], reps: int, rows: int) -> dict:
    from ebrl.algos import PPO
    from ebrl.policies.base import published_state, state_nbytes
    from ebrl.policies.pi0.policy import PI0Policy

    obs_space, act_space = spaces()
    out: dict = {"path": str(path), "device": str(device), "dtype": dtype}
    ode = PI0Policy.from_pretrained(path, obs_space, act_space, instruction=WORDS[0], method="ode", dtype=dtype,
                                    value_head=False).to(device)
    obs = observations(2)
    noise = torch.randn(2, ode.chunk_size, ode.max_action_dim, generator=torch.Generator().manual_seed(0))
    ours = ode.act(obs, noise=noise).env_actions
    inputs = ode.model_inputs(obs)
    with torch.no_grad():
        theirs = ode.hf_model.sample_actions(**inputs, noise=noise.to(device, ode.hf_model.dtype))
    theirs = ode.to_env(theirs.float().reshape(2, -1).cpu().numpy())
    out["faithful_max_abs"] = float(np.abs(ours - theirs).max())
    del ode
    for checkpointing in (False, True):
        reset_peak(device)
        policy = PI0Policy.from_pretrained(path, obs_space, act_space, instruction=WORDS[0], dtype=dtype, lora_rank=32,
                                           gradient_checkpointing=checkpointing).to(device)
        if not checkpointing:
            out["act_ms"] = {str(b): 1e3 * median_call_s(lambda b=b: policy.act(observations(b)), device, reps)
                             for b in batches}
            out["act_peak_mb"] = peak_mb(device)
            trainable = state_nbytes(published_state(policy))
            out["publication_mb"] = {"lora": trainable / 1e6, "whole": state_nbytes(policy.state_dict()) / 1e6}
        batch = stored_batch(policy, observations(rows), segments=2)
        algo = PPO(minibatch_size=rows, update_epochs=1)
        reset_peak(device)
        key = "update_s_checkpointing" if checkpointing else "update_s"
        out[key] = median_call_s(lambda: algo.update(policy, batch), device, 1)
        out[key.replace("_s", "_peak_mb")] = peak_mb(device)
        del policy
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", help="a π0 / π0.5 checkpoint directory of your own (default: random, published size)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (checks the script, times nothing real)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--out", default="gpu_pi0.json")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_pi0: skipped: no CUDA device here (torch.cuda.is_available() is False); "
              "--device cpu --tiny runs the same steps on the CPU")
        return 0
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    batches, reps, rows = ((1, 2), 2, 4) if args.tiny else ((1, 8, 32), 5, 64)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(args.path)] if args.path else []
        if not paths:
            from ebrl.testing import save_random_pi0

            for kind in ("pi0", "pi05"):
                where = Path(tmp) / kind
                size = {} if args.tiny else {"full_size": True, "device": str(device), "dtype": torch.bfloat16}
                t0 = time.perf_counter()
                save_random_pi0(where, kind=kind, state_dim=STATE, action_dim=ACTIONS, sentences=tuple(WORDS),
                                **({"chunk_size": EXECUTE} if args.tiny else {}), **size)
                print(f"gpu_pi0: built a random {kind} in {time.perf_counter() - t0:.0f} s", flush=True)
                paths.append(where)
        for path in paths:
            results.append(measure(path, device, dtype, batches, reps, rows))
            print(json.dumps(results[-1], indent=2), flush=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
