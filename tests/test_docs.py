"""Every docstring example in the package runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import ebrl

MODULES = sorted(m.name for m in pkgutil.walk_packages(ebrl.__path__, "ebrl."))


def test_every_subpackage_is_a_package():
    # a directory without __init__.py is left out of a wheel by setuptools' package discovery
    assert {"ebrl.runtime", "ebrl.envs", "ebrl.policies", "ebrl.algos", "ebrl.telemetry"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
