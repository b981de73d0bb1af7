"""A/B one bench suite between two commits: ``python bench/ab.py SUITE BASE [HEAD]``.

Each commit is checked out in a git worktree of its own; the suite then runs ``--rounds``
times per commit, alternating (base first in odd rounds, head first in even ones), each run
``ebrl bench SUITE`` in a fresh interpreter with that worktree first on ``PYTHONPATH``. Every
run's JSON is kept under ``--out``; the table pools each figure's values over the rounds and
says whether head's median lies inside base's min-max. For "did this change cost anything",
not for the README: its numbers come from ``make bench``.

    python bench/ab.py overhead e98855a --rounds 3 --out /tmp/ab-overhead   # before issue 26 against HEAD
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent


def worktree(rev: str, path: Path) -> Path:
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(path), rev], cwd=REPO, check=True)
    return path


def run_suite(suite: str, tree: Path, out: Path, quick: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "ebrl", "bench", suite, "--out", str(out)] + (["--quick"] if quick else [])
    subprocess.run(cmd, cwd=tree, env=env, check=True)


def pooled(runs: list[Path], suite: str) -> dict[tuple[str, str, str], list[float]]:
    """(case, runner, figure) -> every round's values, over all runs of one commit."""
    values: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        summary = json.loads((run / f"{suite}.json").read_text())["summary"]
        for case, runners in summary.items():
            for runner, figures in runners.items():
                for figure, stat in figures.items():
                    raw = (stat.get("values") or []) if isinstance(stat, dict) else []
                    finite = [v for v in raw if isinstance(v, (int, float)) and math.isfinite(v)]
                    if finite:
                        values.setdefault((case, runner, figure), []).extend(finite)
    return values


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def table(base: dict, head: dict, figure: str | None) -> str:
    rows = []
    for key in sorted(base.keys() & head.keys()):
        if figure is not None and key[2] != figure:
            continue
        b, h = base[key], head[key]
        mb, mh = statistics.median(b), statistics.median(h)
        ratio = f"{mh / mb:.2f}" if mb else "n/a"
        inside = "yes" if min(b) <= mh <= max(b) else "**no**"
        rows.append(f"| {key[0]} | {key[1]} | {key[2]} | {_num(mb)} [{_num(min(b))}-{_num(max(b))}] (n={len(b)}) "
                    f"| {_num(mh)} [{_num(min(h))}-{_num(max(h))}] (n={len(h)}) | {ratio} | {inside} |")
    return "\n".join(["| case | runner | figure | base: median [min-max] | head | head/base | inside base's spread |",
                      "|---|---|---|---|---|---|---|", *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite")
    p.add_argument("base", help="the commit to compare against")
    p.add_argument("head", nargs="?", default="HEAD", help="the commit measured (default HEAD)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="ab_out", help="where every run's JSON and the table go")
    p.add_argument("--figure", default=None, help="only this figure of the summary (e.g. us_per_step)")
    p.add_argument("--quick", action="store_true", help="the suite's short run (a smoke test of this script)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    out = Path(args.out).resolve()  # the suite runs inside each worktree
    out.mkdir(parents=True, exist_ok=True)
    revs = {"base": args.base, "head": args.head}
    with tempfile.TemporaryDirectory(prefix="ebrl-ab-") as tmp:
        trees = {label: worktree(rev, Path(tmp) / label) for label, rev in revs.items()}
        try:
            runs: dict[str, list[Path]] = {"base": [], "head": []}
            for r in range(1, args.rounds + 1):
                for label in ("base", "head") if r % 2 else ("head", "base"):
                    print(f"round {r}: {label} ({revs[label]})", flush=True)
                    run_out = out / f"{label}-{r}"
                    run_suite(args.suite, trees[label], run_out, args.quick)
                    runs[label].append(run_out)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    text = (f"`python bench/ab.py {args.suite} {args.base} {args.head} --rounds {args.rounds}`: "
            f"{args.rounds} alternating rounds, each run of the suite a fresh process.\n\n"
            + table(pooled(runs["base"], args.suite), pooled(runs["head"], args.suite), args.figure) + "\n")
    (out / "ab.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
