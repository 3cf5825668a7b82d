"""This folder's modules are not tests of this suite (__init__.py says whose they are):
tests/test_thirdparty.py runs them beside transformers' ``tests/``, where their relative imports
(``from ..test_modeling_common import ModelTesterMixin``) resolve. Collected here, they would fail
to import."""

collect_ignore = ["generation"]
collect_ignore_glob = ["test_*.py"]
