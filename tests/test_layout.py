"""No import circle in ``ebrl/`` (function-level and ``TYPE_CHECKING`` imports included), and
the space-tree utilities of :mod:`ebrl.spaces` treat arrays and dicts of arrays alike."""

import ast
from pathlib import Path

import numpy as np
import pytest

from ebrl import spaces

ROOT = Path(__file__).resolve().parent.parent / "ebrl"


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the ``ebrl`` modules it imports: at module level, inside functions and under
    ``TYPE_CHECKING`` alike. ``from package import name`` counts the submodule ``name`` where
    there is one, else the package; a package is not counted for its submodules' sake."""
    mods = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                head = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                names = [f"{head}.{a.name}" if f"{head}.{a.name}" in mods else head for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_ebrl_has_no_import_circle():
    graph = import_graph()
    assert {"ebrl.runtime.sim.pool", "ebrl.runtime.run", "ebrl.cli"} <= set(graph)
    assert cycles(graph) == []


def test_the_circle_finder_finds_a_circle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "ebrl"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from ebrl.a.x import f\n")
    (pkg / "a" / "x.py").write_text("def f():\n    from ebrl.a import y\n")
    (pkg / "a" / "y.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import x\n")
    assert cycles(import_graph(pkg)) == [["ebrl.a.x", "ebrl.a.y"]]


def _obs(i: float, as_dict: bool):
    pos = np.full(3, i, np.float32)
    return {"pos": pos, "cam": {"rgb": np.full((2, 2), int(i), np.uint8)}} if as_dict else pos


@pytest.mark.parametrize("as_dict", [False, True], ids=["array", "dict"])
def test_stack_unstack_index_round_trip(as_dict):
    xs = [_obs(i, as_dict) for i in range(4)]
    batch = spaces.stack(xs)
    assert spaces.batch_size(batch) == 4
    rows = spaces.unstack(batch, 4)
    for a, b in zip(rows, xs):
        spaces.tree_map(np.testing.assert_array_equal, a, b)
    spaces.tree_map(np.testing.assert_array_equal, spaces.index(batch, 2), xs[2])
    assert spaces.batch_size(spaces.index(batch, slice(0, 0))) == 0
    spaces.tree_map(np.testing.assert_array_equal, spaces.index(spaces.batch_of_one(xs[1]), 0), xs[1])


@pytest.mark.parametrize("as_dict", [False, True], ids=["array", "dict"])
def test_empty_like_write_and_copy(as_dict):
    buf = spaces.empty_like(_obs(0, as_dict), 5)
    for t in range(5):
        spaces.write(buf, t, _obs(t, as_dict))
    spaces.tree_map(np.testing.assert_array_equal, buf, spaces.stack([_obs(t, as_dict) for t in range(5)]))
    src = _obs(1, as_dict)
    copy = spaces.copy_tree(src)
    spaces.tree_map(lambda a: a.fill(9), src)  # an env writing into the array it returned
    spaces.tree_map(np.testing.assert_array_equal, copy, _obs(1, as_dict))


@pytest.mark.parametrize("as_dict", [False, True], ids=["array", "dict"])
def test_finiteness(as_dict):
    batch = spaces.stack([_obs(i, as_dict) for i in range(3)])
    assert spaces.all_finite(batch)
    assert spaces.finite_rows(batch, 3).tolist() == [True, True, True]
    pos = batch["pos"] if as_dict else batch
    pos[1, 0] = np.nan
    assert not spaces.all_finite(batch)
    assert spaces.finite_rows(batch, 3).tolist() == [True, False, True]
    assert spaces.all_finite(spaces.index(batch, 2))
