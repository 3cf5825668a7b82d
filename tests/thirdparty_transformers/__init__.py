"""Model test modules for transformers' ``ModelTesterMixin`` (issue 71): BERT, GPT-2 and T5.

The tests are transformers' (``tests/test_modeling_common.py`` of its sdist, at the installed
version); the testers, the few settings of each case, ``extra_tests.py`` and
``generation/test_utils.py`` (a stand-in for transformers' generation test module, which the
sdist lacks) are ours. tests/test_thirdparty.py copies them into a copy of the sdist's
``tests/``: this folder as ``tests/thirdparty_transformers/``, ``generation/`` as
``tests/generation/``, where their relative imports resolve, and runs each model's module
plain, with ``torch_pallas.route_dropout()`` around each test and with the models' dropouts
converted too. This suite does not collect them (conftest.py).
"""
