"""SmolVLA on SO-101 from pixels, on this machine: act latency, LoRA PPO update, memory, RL loop.

A random SmolVLA at the published size (``save_random_smolvla(full_size=True)``: SmolVLM2-500M cut
to 16 layers, 512-pixel cameras, chunks of 50, 10 denoising steps; one camera ``front``, state 14,
action 4, as an SO-101 dataset names them) or, with ``--quick``, a tiny one, acts on
``so101/PickCube`` at 64 pixels (the expert's env settings). Each measurement runs in a fresh
process, whose tree's peak resident memory is sampled every 0.1 s:

- ``act_ms``: milliseconds per ``act`` at batch 1, 4 and 16 on a real rendered observation (one
  warm-up call at batch 1, then ``--reps`` calls at each size, median).
- ``train``: ``ebrl train`` with LoRA PPO from the random folder (2 envs, one update of
  ``--steps`` env steps, one PPO epoch in minibatches of ``--minibatch``, gradient checkpointing
  at full size): seconds per update (the learner's busy time over its
  updates) and env steps/s of the whole loop, both from the run's ``result.json``.

Prints one JSON object. ``python bench/smolvla_so101.py --quick`` takes about a minute; the full
size takes ~10 minutes on 2 CPU cores. The folders are written once under ``--dir``.

    >>> # python bench/smolvla_so101.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENV_KWARGS = {"pixels": 64, "fast_render": True, "top_down_ik": True, "jaw_pads": True, "action_scale": 0.025}
FEATURE_MAP = {"observation.images.front": "pixels", "observation.state": "agent_pos"}
TASK = "pick up the red block"
TINY = {"image_size": 16, "max_dim": 16}  # --quick: save_random_smolvla's tiny defaults otherwise


def write_folder(root: Path, full: bool) -> tuple[Path, Path]:
    """The random SmolVLA folder and its VLM directory (written once)."""
    from ebrl.testing_smolvla import save_random_smolvla

    path, vlm = root / ("full" if full else "tiny") / "policy", root / ("full" if full else "tiny") / "vlm"
    if not (path / "model.safetensors").is_file():
        save_random_smolvla(path, vlm, camera_names=("front",), state_dim=14, action_dim=4, full_size=full,
                            **({} if full else TINY))
    return path, vlm


def policy_options(path: Path, vlm: Path, full: bool) -> dict:
    small = {} if full else {"noise_hidden": [16], "value_hidden": [16]}
    # full size: gradient checkpointing, or the update's activations (a 512-pixel image and 10 denoising
    # steps a sample) ran this 23 GiB machine out of memory at a minibatch of 4
    return {"path": str(path), "vlm": str(vlm), "feature_map": FEATURE_MAP, "instruction": TASK, "lora_rank": 16,
            "execute": 10 if full else 2, "gradient_checkpointing": full, **small}


def act_part(path: Path, vlm: Path, full: bool, reps: int) -> dict:
    """In a fresh process: ms per act at batch 1, 4, 16."""
    import numpy as np
    import torch

    from ebrl.envs import make
    from ebrl.policies.smolvla.policy import SmolVLAPolicy

    torch.set_num_threads(1)  # as a run's acting: one thread (two made a tiny model 100x slower on this shared box)
    env = make("so101/PickCube", **ENV_KWARGS)
    options = {k: v for k, v in policy_options(path, vlm, full).items() if k != "path"}
    t0 = time.perf_counter()
    policy = SmolVLAPolicy.from_pretrained(path, env.observation_space, env.action_space, **options)
    load_s = time.perf_counter() - t0
    obs, _ = env.reset(seed=0)
    env.close()
    out = {"load_s": load_s, "params": sum(p.numel() for p in policy.parameters())}
    policy.act({k: np.asarray(v)[None] for k, v in obs.items()})  # warm-up
    for batch in (1, 4, 16):
        rows = {k: np.repeat(np.asarray(v)[None], batch, axis=0) for k, v in obs.items()}
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            policy.act(rows)
            times.append((time.perf_counter() - t0) * 1e3)
        out[f"act_ms_batch{batch}"] = sorted(times)[len(times) // 2]
    return out


def train_part(path: Path, vlm: Path, full: bool, steps: int, log_dir: Path, minibatch: int) -> dict:
    """In a fresh process: ``ebrl train`` with LoRA PPO, one update."""
    from ebrl.cli import main

    feature_map = "{" + ", ".join(f'"{k}" = "{v}"' for k, v in FEATURE_MAP.items()) + "}"  # a TOML table
    options = {k: v for k, v in policy_options(path, vlm, full).items() if k != "feature_map"}
    sets = ["env=so101/PickCube", *(f"env_kwargs.{k}={json.dumps(v)}" for k, v in ENV_KWARGS.items()),
            "policy.kind=hf", f"policy.feature_map={feature_map}",
            *(f"policy.{k}={json.dumps(v)}" for k, v in options.items()),
            "run.num_envs=2", f"run.segment_len={steps // 2}", f"run.total_env_steps={steps}",
            'run.sim={backend="thread"}', "run.learner=thread", f"ppo.minibatch_size={minibatch}",
            "ppo.update_epochs=1"]
    code = main(["train", "--quiet", "--log-dir", str(log_dir), *(a for s in sets for a in ("--set", s))])
    if code != 0:
        raise SystemExit(f"ebrl train failed ({code})")
    result = json.loads((log_dir / "result.json").read_text())
    return {"ppo_update_s": result["learner_busy_s"] / max(result["updates"], 1), "updates": result["updates"],
            "env_steps": result["env_steps"], "env_steps_per_s": result["env_steps_per_s"],
            "train_wall_s": result["wall_s"]}


def fresh(args: list[str]) -> dict:
    """Run this script's ``args`` in a fresh process; its JSON and the tree's peak RSS (GiB)."""
    import psutil

    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    peak, done = 0, threading.Event()

    def watch():
        nonlocal peak
        while not done.wait(0.1):
            try:
                root = psutil.Process(proc.pid)
                peak = max(peak, sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
            except psutil.Error:
                pass

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    out, _ = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode != 0:  # -9: killed, out of memory
        part = {"failed": proc.returncode}
    else:
        part = json.loads(out.strip().splitlines()[-1])
    part["peak_rss_gib"] = peak / 2**30
    print(json.dumps({args[1]: part}), file=sys.stderr, flush=True)  # as each part ends: a later one may fail
    return part


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny SmolVLA: a smoke test")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "ebrl-bench-smolvla-so101"))
    ap.add_argument("--reps", type=int, default=None, help="act calls per batch size (default 1 full, 5 quick)")
    ap.add_argument("--steps", type=int, default=None, help="env steps of the RL run (default 20 full, 16 quick)")
    ap.add_argument("--minibatch", type=int, default=None, help="PPO minibatch (default 2 full, 16 quick)")
    ap.add_argument("--parts", default="act,train", help="which measurements, e.g. train")
    ap.add_argument("--part", choices=("act", "train"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    full, root = not args.quick, Path(args.dir)
    reps = args.reps or (1 if full else 5)
    steps = args.steps or (20 if full else 16)
    minibatch = args.minibatch or (2 if full else 16)
    if args.part:
        path, vlm = write_folder(root, full)
        part = act_part(path, vlm, full, reps) if args.part == "act" else train_part(
            path, vlm, full, steps, Path(tempfile.mkdtemp(dir=root, prefix="train-")), minibatch)
        print(json.dumps(part))
        return
    t0 = time.perf_counter()
    write_folder(root, full)
    written_s = time.perf_counter() - t0
    flags = [*(["--quick"] if args.quick else []), "--dir", str(root), "--reps", str(reps), "--steps", str(steps),
             "--minibatch", str(minibatch)]
    report = {"size": "full" if full else "tiny", "cpu_count": os.cpu_count(), "load_avg_1min": os.getloadavg()[0],
              "folder_written_s": written_s}
    for part in args.parts.split(","):
        report[part] = fresh(["--part", part, *flags])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
