"""The paper's regime on an emulated device: real simulators on this machine's CPU cores, and a
π0-class policy generating and training on an emulated H200 (:mod:`ebrl.emulated`, profile
``pi0-h200``: every figure a published measurement, see docs/gpu.md). Every table says
"emulated device".

Workloads: ManiSkill3 ``PickCube-v1`` from state (16 envs, SAPIEN's CPU backend) and
LIBERO-spatial from state (8 envs over 4 tasks, no renderer). The policy: a small
:class:`~ebrl.policies.FlowPolicy` (chunks of 5 actions, openpi's LIBERO replanning, and 10
denoising steps, π0's) computes the numbers on the CPU; each call takes the emulated π0's time
(a chunk of 5 actions per decision, so one env step of the table is one decision, 5 simulator
steps). PPO at its defaults, segments of 16 decisions, two updates' worth of decisions a run.

Runners, every knob at its default except the named one, each run a fresh process, 3
alternating rounds:

- ``async``: EBRL at its defaults: the device shared on two priority streams
  (``resources.gpu_streams``), generation's kernels first;
- ``pipelined`` (RLinf's grouped pipeline) and ``sync`` (lockstep, RLinf's collocated mode),
  at the same defaults: a lockstep schedule never generates while it trains, so whichever side
  runs has every SM;
- ``async, SM split``: EBRL with the device split between generation and training by the
  controller's SM-quota rule (green contexts, emulated);
- ``async, one stream``: EBRL on one shared stream (generation and training queue in turn).

Reported per run: decisions/s end to end (training included) and in rollout, the device's
utilisation and each side's busy share, the controller's SM decisions, how far each call's
held time is from the model (``held error``), and the calls whose CPU work outran the device;
and, from the one-stream run's calls, the most any SM split could gain on them
(:meth:`~ebrl.emulated.EmulatedDevice.split_ceiling`).
"""

from __future__ import annotations

import math
import statistics
import time


import ebrl
from ebrl.algos import PPO
from ebrl.benchmark import Target, check_targets, spread, summarize_rows
from ebrl.benchmark.figures import round_ratios
from ebrl.benchmark.report import fmt_ratio
from ebrl.benchmark.fresh import call_fresh
from ebrl.benchmark.suite import CpuMeter
from ebrl.emulated import emulated
from ebrl.envs import make
from ebrl.envs.chunks import ActionChunk
from ebrl.policies import FlowPolicy

DESCRIPTION = ("the paper's regime, emulated device: real ManiSkill3 and LIBERO from state on the CPU, a "
               "π0-class policy generating and training on an emulated H200 (published latencies)")
PROFILE = "pi0-h200"
CHUNK, DENOISE_STEPS, SEGMENT = 5, 10, 16
LIBERO_TASKS = 4


def maniskill(i: int):
    return make("maniskill/PickCube-v1")


def libero(i: int):
    return make(f"libero/libero_spatial/{(i // 2) % LIBERO_TASKS}", cameras=(), object_state=True, instruction=True)


WORKLOADS = {"maniskill-pickcube": (maniskill, 16), "libero-spatial": (libero, 8)}  # env_fn, num_envs
RUNNERS = {"async": ("async", None), "pipelined": ("pipelined", None), "sync": ("sync", None),
           "async, SM split": ("async", "green-contexts"), "async, one stream": ("async", "one-stream")}
QUICK_RUNNERS = ("async", "sync")
TARGETS = {"async/sync": 1.3, "async/pipelined": 1.2, "SM split/one stream": 1.1,
           "held error p95": Target(0.02, lower_is_better=True)}


def policy_for(env, seed: int, profile=PROFILE):
    """The small flow policy for ``env``'s spaces, acting in chunks of ``CHUNK``, on a new
    emulated device running ``profile`` (a name or a :class:`~ebrl.emulated.DeviceProfile`)."""
    chunk = ActionChunk(env, CHUNK).action_space  # the space run() gives the env (ebrl.envs.chunks.for_policy)
    small = FlowPolicy.from_spaces(env.observation_space, chunk, denoise_steps=DENOISE_STEPS, seed=seed)
    return emulated(small, profile)


def measure(workload: str, runner: str, num_envs: int, decisions: int, seed: int) -> dict:
    env_fn = WORKLOADS[workload][0]
    schedule, mode = RUNNERS[runner]
    probe = env_fn(0)
    policy = policy_for(probe, seed)
    probe.close()
    cfg = ebrl.RunConfig(num_envs=num_envs, segment_len=SEGMENT, total_env_steps=decisions, schedule=schedule,
                         seed=seed, resources={"gpu_streams": mode} if mode else {})
    trainer = ebrl.Trainer(env_fn, policy, PPO(seed=seed), cfg)
    device, meter = policy.emulator, CpuMeter()
    t0 = time.perf_counter()
    result = ebrl.run_sync(trainer)
    wall = time.perf_counter() - t0
    paused = result.learner_busy_s if schedule != "async" else 0.0  # lockstep: no rollout while training
    errors = sorted(device.held_errors())
    util = [p["system"].get("gpu0_sm_util") for p in result.profiles]
    return {"case": workload, "runner": runner, "env_steps": result.env_steps, "wall_s": wall,
            "steps_per_s": result.env_steps / wall, "rollout_steps_per_s": result.env_steps / max(wall - paused, 1e-9),
            "updates": result.updates, "device_util": spread(u for u in util if u is not None)["median"],
            "gen_busy": device.busy_s["generation"] / wall, "train_busy": device.busy_s["training"] / wall,
            "held_error_p50": statistics.median(errors) if errors else math.nan,
            "held_error_p95": errors[int(0.95 * (len(errors) - 1))] if errors else math.nan,
            "calls": len(errors), "overruns": device.overruns, "gen_batch_mean": result.gen_batch_mean,
            "sm_decisions": [d for d in result.decisions if d["knob"] == "gen_sms"],
            "split_ceiling": device.split_ceiling(), "final_split": device.describe(), "accounting_ok": result.accounting_ok(), **meter.read()}


def run(quick: bool = False, in_process: bool = False) -> dict:
    rounds = 1 if quick else 3
    runners = QUICK_RUNNERS if quick else tuple(RUNNERS)
    rows = []
    for workload, (_, num_envs) in WORKLOADS.items():
        num_envs = 2 if quick else num_envs  # --quick: a smoke test of the real path
        decisions = num_envs * (4 if quick else 2 * SEGMENT)
        for r in range(rounds):
            order = runners if r % 2 == 0 else runners[::-1]  # alternate, so drift lands on every runner alike
            for runner in order:
                kwargs = dict(workload=workload, runner=runner, num_envs=num_envs, decisions=decisions, seed=r)
                row = measure(**kwargs) if in_process else call_fresh("suite:paper_regime:measure", kwargs)
                rows.append({"round": r, **row})
    summary = summarize_rows(rows, ("steps_per_s", "rollout_steps_per_s", "device_util", "gen_busy", "train_busy",
                                    "held_error_p95", "cpu_util"))
    ratios = {}
    for workload, present in summary.items():
        for name, head, base in (("async/sync", "async", "sync"), ("async/pipelined", "async", "pipelined"),
                                 ("SM split/one stream", "async, SM split", "async, one stream"),
                                 ("priority streams/one stream", "async", "async, one stream")):
            if head in present and base in present:
                ratios[f"{workload}: {name}"] = round_ratios(rows, workload, head, [base])
    figures = {f"{w}: held error p95": present["async"]["held_error_p95"] for w, present in summary.items()
               if "async" in present}
    notes = []
    for w in summary:
        mine = [r for r in rows if r["case"] == w]
        ceiling = spread(r["split_ceiling"] for r in mine if r["runner"] == "async, one stream")
        if ceiling["n"]:
            notes.append(f"{w}: the most any SM split could gain on the one-stream run's calls: {fmt_ratio(ceiling)}")
        split = [r for r in mine if r["runner"] == "async, SM split"]
        if split:
            moves = [len(r["sm_decisions"]) for r in split]
            ends = sorted({f"{r['final_split']['gen_sms']}/{r['final_split']['train_sms']}" for r in split})
            notes.append(f"{w}: SM-quota decisions per SM-split run: {', '.join(map(str, moves))}; "
                         f"final split (generation/training SMs): {', '.join(ends)}")
    targets = (check_targets(ratios, {k: v for k, v in TARGETS.items() if not isinstance(v, Target)})
               + check_targets(figures, {"held error p95": TARGETS["held error p95"]}, unit=""))
    return {"rows": rows, "summary": summary, "ratios": ratios, "figures": figures, "notes": notes, "targets": targets,
            "meta": {"device": f"emulated device ({PROFILE})", "rounds": rounds, "description": DESCRIPTION,
                     "fresh_processes": not in_process, "chunk": CHUNK, "denoise_steps": DENOISE_STEPS,
                     "segment_len": SEGMENT, "accounting_ok": all(r.get("accounting_ok", True) for r in rows)}}
