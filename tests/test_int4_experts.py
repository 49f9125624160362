"""Routed experts kept in packed INT4 (kernels/int4_experts.py): the unpacking against an independent
reading of the format, the Triton kernel (Triton's interpreter on a CPU, compiled on a GPU) and torch's
CPU path against the reference, and each path giving a pair the same bits alone as beside others (what
spec == plain needs of a product: a verify block holds more pairs than a plain step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_device import KERNEL_DEVICE
from test_quantized_formats import dequantize_int4_groups

from specgen.kernels import int4_experts as ie


def expert_stack(E, N, K, group=32, seed=0):
    """E experts' packed words (every bit pattern, signed words included) and bf16 scales."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (E, N, K // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    scale = (torch.rand(E, N, K // group, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    return packed, scale


def pairs_input(P, K, E, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(P, K, generator=gen) * torch.linspace(0.2, 2, K)).to(dtype)
    experts = torch.randint(0, E, (P,), generator=gen)
    return x, experts


def close(got, expected, rel=1e-5):
    """Equal up to the order of float32 additions: within rel of the row's largest term sum."""
    scale = expected.abs().amax().item() + 1e-6
    assert (got.float() - expected.float()).abs().max().item() <= rel * scale * 8, \
        (got.float() - expected.float()).abs().max().item()


def test_the_unpacking_equals_an_independent_reading_of_the_format():
    packed, scale = expert_stack(3, 8, 64)
    ours = ie.dequantize(packed, scale, 32)
    for e in range(3):
        theirs = dequantize_int4_groups(packed[e].numpy(), scale[e].float().numpy(), (8, 64), 32)
        np.testing.assert_array_equal(ours[e].numpy(), theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_reference(dtype):
    E, N, K = 5, 96, 128                    # N not a multiple of the tile: masked columns
    packed, scale = expert_stack(E, N, K)
    x, experts = pairs_input(37, K, E, dtype=dtype)
    experts[:20] = 2                        # one expert with more pairs than a block holds
    expected = ie.int4_pairs_reference(x, experts, packed, scale, 32)
    got = ie.int4_pairs_triton(*(t.to(KERNEL_DEVICE) for t in (x, experts, packed, scale)), 32)
    assert got.dtype == dtype
    close(got.cpu(), expected, rel=1e-5 if dtype == torch.float32 else 1e-2)


def test_the_kernel_gives_a_pair_the_same_bits_alone_and_beside_others():
    E, N, K = 4, 64, 64
    packed, scale = expert_stack(E, N, K, seed=3)
    x, experts = pairs_input(24, K, E, seed=4)
    experts[:] = 1                          # every pair one expert: a block of 16 rows, then 8
    on = lambda *t: [a.to(KERNEL_DEVICE) for a in t]     # noqa: E731
    together = ie.int4_pairs_triton(*on(x, experts, packed, scale), 32).cpu()
    for p in (0, 17, 23):
        alone = ie.int4_pairs_triton(*on(x[p:p + 1], experts[p:p + 1], packed, scale), 32).cpu()
        assert torch.equal(alone[0], together[p])


def test_the_cpu_layout_holds_the_same_weights_and_multiplies_to_the_reference():
    E, N, K = 4, 48, 128
    packed, scale = expert_stack(E, N, K, seed=5)
    codes, pairs = ie.cpu_layout(packed, scale)
    assert codes.dtype == torch.uint8 and pairs.shape == (E, K // 32, N, 2)
    eye = torch.eye(K, dtype=torch.float32)
    for e in range(E):   # the CPU kernel itself reads the repacked weights back: the identity's product
        back = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, codes[e], 32, pairs[e].float()).t()
        assert torch.equal(back, ie.dequantize(packed[e], scale[e], 32))
    x, experts = pairs_input(19, K, E, seed=6)
    close(ie.int4_pairs(x, experts, codes, pairs, 32), ie.int4_pairs_reference(x, experts, packed, scale, 32),
          rel=1e-2)     # torch's CPU kernel rounds its output to bf16


@pytest.mark.parametrize("threads", [1, 2])
def test_the_cpu_path_gives_a_pair_the_same_bits_alone_and_beside_others(threads):
    E, N, K = 3, 64, 256
    codes, pairs = ie.cpu_layout(*expert_stack(E, N, K, seed=7))
    x, experts = pairs_input(33, K, E, seed=8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = ie.int4_pairs(x, experts, codes, pairs, 32)
        for p in range(0, 33, 4):
            assert torch.equal(ie.int4_pairs(x[p:p + 1], experts[p:p + 1], codes, pairs, 32)[0], together[p])
    finally:
        torch.set_num_threads(before)


def test_dense_experts_quantized_on_load_read_back_through_the_independent_unpacking():
    """`quantize_symmetric` (target.quantization: int4 on a dense MoE) writes the published format: the
    NumPy reader gives each weight back within half a step of its group's bf16 scale."""
    gen = torch.Generator().manual_seed(9)
    dense = torch.randn(2, 16, 64, generator=gen) * 0.05
    packed, scale = ie.quantize_symmetric(dense, 32)
    assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16 and packed.shape == (2, 16, 8)
    assert torch.equal(ie.pack_codes(ie.unpack_codes(packed, 64)), packed)
    for e in range(2):
        theirs = dequantize_int4_groups(packed[e].numpy(), scale[e].float().numpy(), (16, 64), 32)
        step = scale[e].float().repeat_interleave(32, dim=1)
        assert (torch.from_numpy(theirs) - dense[e]).abs().le(step / 2 + 1e-7).all()
