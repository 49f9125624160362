import os
import sys
from pathlib import Path

# Tests import their checkpoint builders as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
# Triton kernels run through the interpreter on CPU; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
