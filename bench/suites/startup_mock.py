"""Start-up alone: ``ebrl.run_sync`` of 16 MockEnvs for 160 env steps (one update), MLP policy
and PPO at their defaults, each run a fresh Python process. The figure is the whole ``run()``
after the script's imports, with the time to the first env step and to the end of the first
update; beside it, what ``import ebrl`` (with the algorithms and ebrl.testing) costs a fresh
interpreter, since EBRL pays torch's lazy ``torch._dynamo`` import there and not in ``run()``
(README, design note 12)."""

from __future__ import annotations

import subprocess
import sys
import time

DESCRIPTION = "16 MockEnvs, 160 steps: run() after imports, and the imports, in fresh processes"
IMPORTS = "import time; t = time.perf_counter(); import ebrl, ebrl.algos, ebrl.testing; print(time.perf_counter() - t)"
TARGET_S = 0.3  # run() after imports (issue 22)
FIRST_STEP_TARGET_S = 0.1


def measure(schedule: str, seed: int) -> dict:
    import ebrl
    from ebrl.algos import PPO
    from ebrl.policies import MLPPolicy
    from ebrl.testing import MockEnv

    env = MockEnv(dim=4)
    trainer = ebrl.Trainer(lambda i: MockEnv(dim=4), MLPPolicy.from_spaces(env.observation_space, env.action_space),
                           PPO(seed=seed), ebrl.RunConfig(num_envs=16, total_env_steps=160, schedule=schedule, seed=seed))
    t0 = time.perf_counter()
    result = ebrl.run_sync(trainer)
    wall = time.perf_counter() - t0
    return {"case": "mock-16x160", "runner": f"ebrl-{schedule}", "env_steps": result.env_steps, "wall_s": wall,
            "steps_per_s": result.env_steps / wall, "first_step_s": result.first_step_s,
            "first_update_s": result.first_update_s, "updates": result.updates, "learner": result.learner_mode}


def run(quick: bool = False, in_process: bool = False) -> dict:
    from ebrl.benchmark import Target, check_targets, summarize_rows
    from ebrl.benchmark.fresh import call_fresh

    rows = []
    for r in range(1 if quick else 3):
        for schedule in ("async", "sync"):
            # what the imports cost a fresh interpreter, measured beside each run
            out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True)
            kwargs = {"schedule": schedule, "seed": r}
            row = measure(**kwargs) if in_process else call_fresh("suite:startup-mock:measure", kwargs)
            rows.append({"round": r, **row, "import_s": float(out.stdout.strip().splitlines()[-1])})
    fields = ("wall_s", "steps_per_s", "first_step_s", "first_update_s", "import_s")
    summary = summarize_rows(rows, fields)
    runners = summary["mock-16x160"]
    figures = {f"mock-16x160: {name} run() wall": runners[name]["wall_s"] for name in ("ebrl-async", "ebrl-sync")}
    figures["mock-16x160: ebrl-async to first env step"] = runners["ebrl-async"]["first_step_s"]
    targets = check_targets(figures, {"mock-16x160: ebrl-async run() wall": Target(TARGET_S, lower_is_better=True),
                                      "mock-16x160: ebrl-async to first env step":
                                          Target(FIRST_STEP_TARGET_S, lower_is_better=True)}, unit=" s")
    return {"rows": rows, "summary": summary, "targets": targets,
            "meta": {"rounds": 1 if quick else 3, "fresh_processes": not in_process, "num_envs": 16,
                     "steps_per_run": 160}}
