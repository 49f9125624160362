"""Where tests run the Triton kernels: on the GPU when the machine has one (Triton then compiles for
it and refuses CPU tensors), else on the CPU through Triton's interpreter (conftest.py sets
TRITON_INTERPRET). A kernel test builds its inputs on the CPU (seeded generators) and moves them here."""

import torch

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
