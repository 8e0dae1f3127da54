"""Shared test setup: every test is bounded by pytest-timeout (pytest.ini);
multi-rank tests run through pydist.spawn.run_ranks, which fails fast."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    if not torch.cuda.is_available():
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip_cuda)
