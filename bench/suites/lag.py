"""Lag robustness: the final return with ``max_policy_lag=4`` against the same run at lag 0,
for PPO as it ships (which corrects lagged batches: ``PPOConfig.lag_correction``), PPO
without that correction (its clip around the behaviour policy), and V-trace.

The async schedule on MockEnv (dim 8, 16-step episodes, 1 ms sleeping steps), 32 envs, an MLP,
every algorithm at its defaults (PPO's minibatch 512 as the longtail suite). Only
``max_policy_lag`` differs between the two runs of a pair, and the env-step budget is the same.
Each (algorithm, lag) runs once per seed, alternating within a seed. The figure is, per seed,
the final mean return (the last 100 episodes) at lag 4 over the one at lag 0; its median over
3 seeds is the target's (>= 0.95 for PPO as it ships and for V-trace, where PPO without the
correction is expected to fall short). The mean lag actually trained at is reported next to
it: a bound that is never reached would test nothing.
"""

from __future__ import annotations

import math
from functools import partial

import ebrl
from ebrl.algos import PPO, VTrace
from ebrl.benchmark.figures import Target, check_targets, spread
from ebrl.policies import MLPPolicy
from ebrl.testing import Latency, MockEnv

DESCRIPTION = ("final return at max_policy_lag=4 over lag 0: PPO (lag-corrected, its default) vs PPO "
               "uncorrected vs V-trace, 3 seeds")
SEEDS = (0, 1, 2)
ALGOS = {"ppo": PPO, "ppo-uncorrected": partial(PPO, lag_correction=False), "vtrace": VTrace}
LAGS = (0, 4)
NUM_ENVS, STEPS, QUICK_STEPS = 32, 60_000, 2_048


def env_fn(i: int) -> MockEnv:
    return MockEnv(dim=8, latency=Latency.constant(0.001))


def _run(algo: str, lag: int, seed: int, steps: int) -> dict:
    env = env_fn(0)
    policy = MLPPolicy.from_spaces(env.observation_space, env.action_space, seed=seed)
    cfg = ebrl.RunConfig(num_envs=NUM_ENVS, total_env_steps=steps, max_policy_lag=lag, seed=seed, log_every_s=3600.0)
    res = ebrl.run_sync(ebrl.Trainer(env_fn, policy, ALGOS[algo](minibatch_size=512, seed=seed), cfg))
    lags = [h["lag_mean"] for h in res.history if not math.isnan(h.get("lag_mean", math.nan))]
    return {"final_return": res.mean_return, "lag_mean": sum(lags) / len(lags) if lags else math.nan,
            "lag_max": max((h["lag_max"] for h in res.history), default=0), "env_steps": res.env_steps,
            "wall_s": res.wall_s, "steps_per_s": res.env_steps_per_s, "updates": res.updates}


def run(quick: bool) -> dict:
    seeds, steps = (SEEDS[:1], QUICK_STEPS) if quick else (SEEDS, STEPS)
    rows = []
    for seed in seeds:
        for algo in ALGOS:
            for lag in LAGS:
                out = _run(algo, lag, seed, steps)
                rows.append({"case": algo, "round": seed, "runner": f"lag {lag}", **out})
                print(f"  seed {seed} {algo} lag {lag}: final return {out['final_return']:.2f}, mean lag "
                      f"{out['lag_mean']:.2f}", flush=True)
    ratios, figures = {}, {}
    for algo in ALGOS:
        per_seed = []
        for seed in seeds:
            by = {r["runner"]: r for r in rows if r["case"] == algo and r["round"] == seed}
            base = by["lag 0"]["final_return"]
            if math.isfinite(base) and base > 0:
                per_seed.append(by["lag 4"]["final_return"] / base)
        ratios[f"{algo}: lag 4/lag 0 final return"] = spread(per_seed)
        for lag in LAGS:
            mine = [r for r in rows if r["case"] == algo and r["runner"] == f"lag {lag}"]
            figures[f"{algo}: lag {lag} final return"] = spread(r["final_return"] for r in mine)
            figures[f"{algo}: lag {lag} mean lag trained"] = spread(r["lag_mean"] for r in mine)
    targets = check_targets({f"{a}: lag 4/lag 0 final return": ratios[f"{a}: lag 4/lag 0 final return"]
                             for a in ("ppo", "vtrace")}, {"lag 4/lag 0 final return": Target(0.95)})
    targets += check_targets({"ppo-uncorrected: lag 4/lag 0 final return":
                              ratios["ppo-uncorrected: lag 4/lag 0 final return"]},
                             {"ppo-uncorrected: lag 4/lag 0 final return": Target(0.95, lower_is_better=True)})
    ratios = {k: v for k, v in ratios.items() if v["n"]}
    return {"rows": rows, "ratios": ratios, "figures": figures, "targets": targets,
            "meta": {"description": DESCRIPTION, "quick": quick, "seeds": list(seeds), "rounds": len(seeds),
                     "num_envs": NUM_ENVS, "steps": steps}}
