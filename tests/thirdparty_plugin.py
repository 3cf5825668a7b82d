"""A pytest plugin that runs another project's tests (transformers', PEFT's) with torch_pallas
around each of them: tests/test_thirdparty.py loads it (``-p thirdparty_plugin``) into pytest runs
of those projects' own test files, which it then compares (issue 71).

``TORCH_PALLAS_AROUND_EACH_TEST`` says what surrounds each test:

- ``plain``: nothing (torch_pallas imported, as in the other two, so that only the mode differs);
- ``route``: ``torch_pallas.route_dropout()`` entered around each test's call phase (where a
  ``unittest.TestCase`` runs ``setUp``, the test and ``tearDown``);
- ``convert``: the models that a test builds get torch_pallas's dropout modules, as
  ``convert_dropout`` would give them, and the test runs routed too, as the README's example
  does (convert, then route): during each test's setup and call phases ``torch.nn.Dropout``,
  ``Dropout1d``, ``Dropout2d`` and ``Dropout3d`` are torch_pallas's classes (subclasses of
  torch's, so ``isinstance`` checks still hold). A module that bound the name at import
  (``from torch.nn import Dropout``) keeps torch's class; transformers and PEFT write
  ``nn.Dropout(...)``.

Unset or empty, the plugin does nothing. ``TORCH_PALLAS_THIRDPARTY_STUBS``, a comma-separated
list of module names (``diffusers,datasets``: PEFT's test helpers import them at module level,
for tests that need the Hub), makes ``import NAME`` give a stub where NAME is not installed: each
of its attributes is a class that raises ``ModuleNotFoundError`` when called, so that only the
tests that use them fail, in every mode alike.
"""

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest

MODE = os.environ.get("TORCH_PALLAS_AROUND_EACH_TEST", "")
MODES = ("", "plain", "route", "convert")
DROPOUT_CLASSES = ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: consulted only for modules no other finder found."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in self.names else None

    def create_module(self, spec):
        return _stub_module(spec.name)

    def exec_module(self, module):
        pass


def _stub_module(name):
    module = types.ModuleType(name, f"A stub for {name}, which is not installed (thirdparty_plugin).")

    def __getattr__(attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)

        def refuse(*args, **kwargs):
            raise ModuleNotFoundError(f"{name} is not installed: {name}.{attribute} is a stub "
                                      "(tests/thirdparty_plugin.py, TORCH_PALLAS_THIRDPARTY_STUBS)")

        return type(attribute, (), {"__new__": refuse, "__module__": name})

    module.__getattr__ = __getattr__
    return module


def pytest_configure(config):
    if MODE not in MODES:
        raise pytest.UsageError(f"TORCH_PALLAS_AROUND_EACH_TEST={MODE!r}: expected one of {', '.join(MODES[1:])}")
    stubs = [name for name in os.environ.get("TORCH_PALLAS_THIRDPARTY_STUBS", "").split(",") if name]
    if stubs:
        sys.meta_path.append(_StubFinder(stubs))
    if MODE:
        import torch_pallas  # noqa: F401  (torch_xla's client before JAX, in every mode)


def pytest_report_header(config):
    if MODE:
        return f"thirdparty_plugin: TORCH_PALLAS_AROUND_EACH_TEST={MODE}"


@contextlib.contextmanager
def _converted_dropout_classes():
    import torch

    import torch_pallas.nn

    saved = {name: getattr(torch.nn, name) for name in DROPOUT_CLASSES}
    try:
        for name in DROPOUT_CLASSES:
            setattr(torch.nn, name, getattr(torch_pallas.nn, name))
        yield
    finally:
        for name, cls in saved.items():
            setattr(torch.nn, name, cls)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _converted_dropout_classes() if MODE == "convert" else contextlib.nullcontext():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if MODE not in ("route", "convert"):
        return (yield)
    import torch_pallas

    with _converted_dropout_classes() if MODE == "convert" else contextlib.nullcontext():
        with torch_pallas.route_dropout():
            return (yield)
