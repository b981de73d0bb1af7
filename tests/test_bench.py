"""Every bundled benchmark suite runs under --quick and reports every field (a smoke test:
timing claims live in bench/ and the README, never in assertions)."""

import json
import math

import pytest

from ebrl.bench_loader import list_suites
from ebrl.cli import main

ROW_FIELDS = {"runner", "env_steps", "wall_s", "steps_per_s", "rollout_steps_per_s", "cpu_util", "mean_return"}
EBRL_FIELDS = ROW_FIELDS | {"busy_generator", "busy_learner", "gen_batch_hist", "lag_hist", "gen_batch_mean"}


def test_list_names_every_suite(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("overhead", "longtail", "mujoco-state", "heterogeneous"):
        assert name in out


@pytest.mark.parametrize("suite", sorted(list_suites()))
def test_suite_runs_quick_and_reports_every_field(suite, tmp_path):
    assert main(["bench", suite, "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / f"{suite}.json").read_text())
    assert report["rows"] and (tmp_path / f"{suite}-results.md").read_text().startswith("### `ebrl bench")
    for row in report["rows"]:
        assert row["steps_per_s"] > 0 and row["env_steps"] > 0
        if "runner" in row:
            assert (EBRL_FIELDS if row["runner"].startswith("ebrl-") else ROW_FIELDS) <= set(row)
    assert all(math.isfinite(v) and v > 0 for v in report["ratios"].values())
    for case, limit in report.get("limits", {}).items():
        assert set(limit["capacity_steps_per_s"]) == {"sim", "generation", "training"}
        assert all(math.isfinite(e) and e > 0 for e in limit["efficiency"].values())
        runners = {r["runner"] for r in report["rows"] if r["case"] == case}
        assert {"ebrl-async", "ebrl-sync", "ebrl-pipelined", "gym-sync", "gym-async"} <= runners
