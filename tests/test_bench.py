"""Every bundled benchmark suite runs under --quick and reports every field (a smoke test:
timing claims live in bench/ and the README, never in assertions)."""

import json
import math

import pytest

from ebrl.benchmark.loader import list_suites
from ebrl.cli import main

ROW_FIELDS = {"runner", "env_steps", "wall_s", "steps_per_s", "rollout_steps_per_s", "cpu_util", "core_util",
              "mean_return"}
EBRL_FIELDS = ROW_FIELDS | {"busy_generator", "busy_learner", "gen_batch_hist", "lag_hist", "gen_batch_mean"}
STAMP = {"cpus", "cpu_model", "versions", "commit", "date", "command"}


def test_list_names_every_suite(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("overhead", "longtail", "mujoco-state", "heterogeneous"):
        assert name in out


# the real simulators build slowly (a LIBERO env with a camera: ~4 s, steps 0.1 s; ManiSkill's
# demonstrations, SFT and three RL runs): more time
SLOW = {"embodied": 300, "libero": 300, "sft-rl": 300, "paper-regime": 300, "sample-efficiency": 300}
# ManiSkill and LIBERO builds on two runners: past make test's budget, so make test-slow runs it;
# sample-efficiency: three ManiSkill PushCube runs (worker builds, demonstrations) of ~25 s each
IN_TEST_SLOW = {"paper-regime", "sample-efficiency"}


def _suite_param(s: str):
    marks = ([pytest.mark.timeout(SLOW[s])] if s in SLOW else []) + ([pytest.mark.slow] if s in IN_TEST_SLOW else [])
    return pytest.param(s, marks=marks)


@pytest.mark.parametrize("suite", [_suite_param(s) for s in sorted(list_suites())])
def test_suite_runs_quick_and_reports_every_field(suite, tmp_path, capsys):
    # in this process: a fresh interpreter per run (the default) costs seconds of imports each;
    # the next test runs the default path. One torch thread: a smoke test times nothing, and on a
    # busy machine torch's threads spin-waiting for each other made a small model's call take seconds
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["bench", suite, "--quick", "--in-process", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / f"{suite}.json").read_text())
    assert report["rows"] and (tmp_path / f"{suite}-results.md").read_text().startswith("### `ebrl bench")
    assert STAMP <= set(report["meta"]) and {"torch", "mujoco", "gymnasium"} <= set(report["meta"]["versions"])
    for row in report["rows"]:
        assert row["steps_per_s"] > 0 and row["env_steps"] > 0 and {"case", "round", "runner"} <= set(row)
        if "mean_return" in row:  # a training runner
            assert (EBRL_FIELDS if row["runner"].startswith("ebrl-") else ROW_FIELDS) <= set(row)
    # every runner of every case has its median and spread, over as many rounds as rows
    for case, runners in report["summary"].items():
        for runner, figures in runners.items():
            n = sum(1 for r in report["rows"] if r["case"] == case and r["runner"] == runner)
            s = figures["steps_per_s"]
            assert s["n"] == n == len(s["values"]) and s["min"] <= s["median"] <= s["max"]
    for ratio in report["ratios"].values():
        assert ratio["n"] >= 1 and all(math.isfinite(v) and v > 0 for v in ratio["values"])
    for case, limit in report.get("limits", {}).items():
        assert set(limit["capacity_steps_per_s"]) == {"sim", "generation", "training"}
        assert all(math.isfinite(e) and e > 0 for e in limit["efficiency"].values())
        runners = {r["runner"] for r in report["rows"] if r["case"] == case}
        assert set(limit["efficiency"]) == runners and {"ebrl-async", "ebrl-sync"} <= runners
    # the report ends by counting the targets, whatever was met
    met = sum(t["met"] for t in report["targets"])
    assert report["targets_met"] == met
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == f"targets met: {met} of {len(report['targets'])}"


def test_each_run_of_a_suite_is_a_fresh_process_by_default(tmp_path):
    assert main(["bench", "longtail-user", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "longtail-user.json").read_text())
    assert report["meta"]["fresh_processes"] and report["meta"]["embedded"]
    assert [r["runner"] for r in report["rows"]] == ["ebrl-async", "ebrl-sync"]
    for row in report["rows"]:  # start-up is reported per run, from the run() call
        assert EBRL_FIELDS <= set(row) and 0 < row["first_step_s"] < row["first_update_s"] < row["wall_s"]


def test_targets_are_judged_on_the_median_and_missing_figures_count_as_missed():
    from ebrl.benchmark import Target, check_targets, spread

    figures = {"a: async/sync": spread([1.0, 2.5, 3.0]), "b: async/sync": spread([1.9, 1.95, 2.4])}
    rows = check_targets({**figures}, {"async/sync": 2.0, "a: async/best peer": 1.3})
    assert [(t["figure"], t["met"]) for t in rows] == [("a: async/sync", True), ("b: async/sync", False),
                                                      ("a: async/best peer", False)]
    assert rows[-1]["note"] == "not measured"
    low = check_targets({"x": spread([5.0, 7.0, 6.5])}, {"x": Target(6.0, lower_is_better=True)}, unit=" µs")
    assert low[0]["met"] is False and low[0]["target"] == "<= 6 µs"


def test_run_capped_stops_when_until_says_so():
    """The convergence suites' stop at a threshold: ``until(row)`` ends the run cleanly, with
    every step accounted for, long before its step budget. The wall-time cap is an hour, so only
    ``until`` can stop the run here (a stop that did not work would spend the whole budget)."""
    import ebrl
    from ebrl.algos import PPO
    from ebrl.benchmark.suite import run_capped
    from ebrl.policies import MLPPolicy
    from ebrl.testing import MockEnv

    budget = 64 * 300  # 300 updates' worth of steps
    cfg = ebrl.RunConfig(num_envs=4, segment_len=16, total_env_steps=budget, log_every_s=0.05)
    trainer = ebrl.Trainer(lambda i: MockEnv(dim=3, episode_len=8), MLPPolicy(3, 3, seed=0), PPO(minibatch_size=32), cfg)
    asked = []

    def until(row):
        asked.append(row["update"])
        return row["update"] >= 3

    result = run_capped(trainer, 3600.0, until=until)
    assert max(asked) >= 3 and result.updates >= 3  # it said yes once a row showed update 3
    assert result.env_steps < budget  # and that stopped the run
    assert result.env_steps == result.trained + sum(result.dropped.values()) + result.in_flight_at_stop
