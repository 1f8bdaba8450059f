import os

import pytest
import torch

os.environ["AUTOSHARD_VERIFY"] = "1"  # every pass is verified in every test, spawned ranks too


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
