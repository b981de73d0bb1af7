"""The benchmark tables of the README and docs/ are generated from docs/benchmarks/*.json and cannot drift."""

import shutil
from pathlib import Path

import pytest

from ebrl.benchmark.docs import PAGES, load_reports, render, replace_block

ROOT = Path(__file__).resolve().parent.parent


def test_every_table_is_exactly_what_the_json_renders(tmp_path):
    bench = tmp_path / "docs" / "benchmarks"
    shutil.copytree(ROOT / "docs" / "benchmarks", bench)
    for page in PAGES:
        shutil.copy(ROOT / page, tmp_path / page)
    render(bench, [tmp_path / page for page in PAGES], root=tmp_path)
    for page in PAGES:
        assert (tmp_path / page).read_text() == (ROOT / page).read_text(), \
            f"{page}'s tables differ from docs/benchmarks JSON: run `python -m ebrl.benchmark.docs`"
    for page in ["README.md", *(p.name for p in (ROOT / "docs" / "benchmarks").glob("*-results.md"))]:
        assert (bench / page).read_text() == (ROOT / "docs" / "benchmarks" / page).read_text(), page


def test_a_table_no_page_holds_is_an_error(tmp_path):
    bench = tmp_path / "docs" / "benchmarks"
    shutil.copytree(ROOT / "docs" / "benchmarks", bench)
    page = tmp_path / "README.md"
    page.write_text("<!-- bench:summary -->\n<!-- /bench:summary -->\n")
    with pytest.raises(ValueError, match="no page holds the tables"):
        render(bench, [page], root=tmp_path)
    page.write_text("<!-- bench:nothing -->\n<!-- /bench:nothing -->\n")
    with pytest.raises(ValueError, match="bench:nothing"):
        render(bench, [page], root=tmp_path)


def test_every_committed_report_has_rounds_medians_spread_and_a_stamp():
    reports = load_reports(ROOT / "docs" / "benchmarks")
    assert {"overhead", "longtail", "heterogeneous", "mujoco-state", "mujoco-pixels", "vector-gpu",
            "step-cost"} <= set(reports)
    for name, rep in reports.items():
        meta = rep["meta"]
        assert {"cpus", "cpu_model", "versions", "commit", "date", "command"} <= set(meta), name
        if meta.get("skipped"):  # a suite that could not measure here (gpu-split without CUDA) says why
            assert "skipped" in meta["skipped"] and "SKIPPED" in meta["description"], name
            continue
        if rep["targets"] and all(t["target"] == "holds" for t in rep["targets"]):  # soak: one long run of checks
            assert not meta["quick"] and rep["rows"], name
            continue
        # a ratio (a timing claim) needs 3 alternating rounds; a suite of scores alone (policies:
        # each workload to a threshold, no ratio between runners) at least 2 seeds
        assert not meta["quick"] and meta["rounds"] >= (3 if rep.get("ratios") else 2), name
        for runners in rep["summary"].values():
            for figs in runners.values():
                s = figs["steps_per_s"]
                assert s["n"] >= 3 and s["min"] <= s["median"] <= s["max"], name


def test_replace_block_is_idempotent_and_names_a_missing_marker():
    text = "a\n<!-- bench:x -->\n<!-- /bench:x -->\nb\n"
    once = replace_block(text, "x", "| t |\n")
    assert once == "a\n<!-- bench:x -->\n| t |\n<!-- /bench:x -->\nb\n"
    assert replace_block(once, "x", "| t |") == once
    with pytest.raises(ValueError, match="bench:y"):
        replace_block(text, "y", "")
