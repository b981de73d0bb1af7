"""Every docstring example in the package runs and prints what it shows."""

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import ebrl

MODULES = sorted(m.name for m in pkgutil.walk_packages(ebrl.__path__, "ebrl."))

# Modules documented in prose only: entry points, package indexes and the runtime's plumbing,
# which the user reaches through run(). Every other module must show itself in examples.
NO_EXAMPLES = {
    "ebrl.__main__", "ebrl.algos", "ebrl.algos.batch", "ebrl.algos.minibatch", "ebrl.benchmark",
    "ebrl.benchmark.bench", "ebrl.benchmark.docs", "ebrl.benchmark.limits", "ebrl.benchmark.loader",
    "ebrl.benchmark.report", "ebrl.benchmark.spec", "ebrl.cli_demos", "ebrl.demos", "ebrl.demos.experts",
    "ebrl.envs.metaworld", "ebrl.launch", "ebrl.policies", "ebrl.policies.base", "ebrl.policies.heads", "ebrl.runs",
    "ebrl.runtime", "ebrl.runtime.collate", "ebrl.runtime.driver", "ebrl.runtime.driver.episodes",
    "ebrl.runtime.driver.loop", "ebrl.runtime.driver.recovery", "ebrl.runtime.learner", "ebrl.runtime.learner_process",
    "ebrl.runtime.resources", "ebrl.runtime.resources.knobs", "ebrl.runtime.resources.manager",
    "ebrl.runtime.resources.rules_sim", "ebrl.runtime.rollout", "ebrl.runtime.run", "ebrl.runtime.sim",
    "ebrl.runtime.sim.lanes", "ebrl.runtime.sim.local", "ebrl.runtime.sim.worker", "ebrl.runtime.sim.workers",
    "ebrl.runtime.stats", "ebrl.telemetry", "ebrl.telemetry.progress", "ebrl.trainer",
}


def examples_written(module) -> int:
    """The ``>>>`` prompts in the module's file, less those marked ``+SKIP``: one example each, for doctest to run."""
    prompts = re.findall(r"^[ \t]*>>>(?: .*|)$", Path(module.__file__).read_text(), re.M)
    return sum("doctest: +SKIP" not in line for line in prompts)


def test_every_subpackage_is_a_package():
    # a directory without __init__.py is left out of a wheel by setuptools' package discovery
    assert {"ebrl.runtime", "ebrl.envs", "ebrl.policies", "ebrl.algos", "ebrl.telemetry"} <= set(MODULES)


def test_the_modules_without_examples_exist():
    assert NO_EXAMPLES <= set(MODULES), NO_EXAMPLES - set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
    written = examples_written(module)
    # every example in the file ran (none hidden from doctest: a docstring that is not one, a skipped object)
    assert result.attempted == written, f"{name}: {written} examples written in its file, {result.attempted} ran"
    if name in NO_EXAMPLES:
        assert written == 0, f"{name} has examples now: take it off NO_EXAMPLES"
    else:
        assert result.attempted > 0, f"{name} runs no docstring example: add one (or list it in NO_EXAMPLES)"
