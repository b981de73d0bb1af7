"""The runtime's sim modules import in any order (no import cycle), and the space-tree utilities
of :mod:`ebrl.spaces` treat arrays and dicts of arrays alike."""

import subprocess
import sys

import numpy as np
import pytest

from ebrl import spaces

SIM_MODULES = ["ebrl.spaces", "ebrl.runtime.fields", "ebrl.runtime.sim_types", "ebrl.runtime.vector_envs",
               "ebrl.runtime.sim_local", "ebrl.runtime.sim_threads", "ebrl.runtime.sim_worker_process",
               "ebrl.runtime.sim_worker_link", "ebrl.runtime.sim_workers_elastic", "ebrl.runtime.sim_workers",
               "ebrl.runtime.sim_mixed", "ebrl.runtime.sim_pool"]


@pytest.fixture(scope="module")
def fresh_imports():
    """One fresh interpreter per first module, all started at once (each spends seconds importing
    torch; in turn they cost a minute of the suite): ``{first: (returncode, stderr)}``."""
    procs = {}
    for first in SIM_MODULES:
        code = "; ".join(f"import {m}" for m in [first, *(m for m in SIM_MODULES if m != first)])
        procs[first] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
    try:
        stderrs = {first: p.communicate(timeout=110)[1] for first, p in procs.items()}
        return {first: (procs[first].returncode, err) for first, err in stderrs.items()}
    finally:
        for p in procs.values():
            p.kill()


@pytest.mark.parametrize("first", SIM_MODULES)
def test_sim_modules_import_in_a_fresh_interpreter_whichever_comes_first(first, fresh_imports):
    # a cycle can only bite the module imported first (whatever it pulls in is then cached), so
    # one fresh interpreter per first module covers every order; the others follow
    returncode, stderr = fresh_imports[first]
    assert returncode == 0, stderr


def test_no_function_level_imports_between_sim_modules():
    import ast
    import importlib

    for name in SIM_MODULES:
        tree = ast.parse(open(importlib.import_module(name).__file__).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("ebrl.runtime.sim"):
                        pytest.fail(f"{name}.{node.name} imports {inner.module} inside a function")


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
