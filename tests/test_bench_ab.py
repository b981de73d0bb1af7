"""bench/ab.py's pooling and table (the runs themselves are ``ebrl bench``, tested elsewhere)."""

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("bench_ab", Path(__file__).parent.parent / "bench" / "ab.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


def _run(tmp_path: Path, name: str, us: list[float], rate: list[float]) -> Path:
    run = tmp_path / name
    run.mkdir()
    summary = {"noop": {"async 16": {"us_per_step": {"values": us}, "steps_per_s": {"values": rate},
                                     "first_step_s": {"values": [float("nan")]}}}}
    (run / "overhead.json").write_text(json.dumps({"summary": summary}))
    return run


def test_rounds_pool_per_commit_and_the_table_flags_a_median_outside_the_base_spread(tmp_path):
    base = ab.pooled([_run(tmp_path, "base-1", [6.0, 6.2], [100.0]), _run(tmp_path, "base-2", [6.4], [110.0])],
                     "overhead")
    head = ab.pooled([_run(tmp_path, "head-1", [6.1, 6.3], [150.0]), _run(tmp_path, "head-2", [6.3], [160.0])],
                     "overhead")
    assert base[("noop", "async 16", "us_per_step")] == [6.0, 6.2, 6.4]
    assert ("noop", "async 16", "first_step_s") not in base  # NaN only: nothing to compare
    rows = {line.split(" | ")[2]: line for line in ab.table(base, head, None).splitlines()[2:]}
    assert rows["us_per_step"].endswith("| 6.3 [6.1-6.3] (n=3) | 1.02 | yes |")  # inside [6.0, 6.4]
    assert rows["steps_per_s"].endswith("| **no** |")  # 155 outside [100, 110]
    only = ab.table(base, head, "us_per_step").splitlines()[2:]
    assert len(only) == 1 and "us_per_step" in only[0]
