import pytest
import torch

import qkrope  # noqa: F401  (turns on Triton's interpreter when there is no CUDA device)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
