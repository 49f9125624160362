import os
import sys
from pathlib import Path

# Tests import their checkpoint builders as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
# Triton kernels run through the interpreter on CPU; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
