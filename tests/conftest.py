import os
import sys
from pathlib import Path

# Tests import their checkpoint builders as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, Triton kernels run through the interpreter (set before specgen's kernels are jitted).
# On a GPU they compile for real, so the GPU tests test the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
