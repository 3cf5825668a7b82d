"""Fake ``tpu`` tensors for the TorchTPU stack's tests (torchtpu_support registers the device)."""

import pytest
from torch._subclasses import FakeTensorMode

import torchtpu_support  # noqa: F401  (registers the tpu device)


@pytest.fixture
def fake():
    """Tensors made inside are fake ``tpu`` tensors (shapes, dtypes and devices, no data)."""
    with FakeTensorMode():
        yield
