# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The per-group slot-mapping kernel on a CUDA GPU, against the pure-Python
reference: the p4 spec example and random geometries (sharded and replicated
groups mixed, padding requests, disabled groups, long prefills).

Needs only torch and triton: the kernel module is loaded by file path (the
installed vllm's when there is one, else ``overlay/``), never through vllm.
"""

import types

import pytest
import torch

pytest.importorskip("triton", reason="the kernel under test is a Triton kernel")

from k3l4_slots import (  # noqa: E402  (sibling module, after the skip)
    PAD,
    load_kernel_module,
    random_case,
    run_kernel,
    spec_example,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: the kernel under test is a Triton GPU kernel",
    ),
]


@pytest.fixture(scope="module")
def kernels() -> types.ModuleType:
    return load_kernel_module("_k3l4_gpu_slot_mapping")


def test_spec_example_on_gpu(kernels: types.ModuleType) -> None:
    sharded, replicated = run_kernel(kernels, spec_example(), "cuda")
    assert sharded[:8] == [PAD, PAD, 320, PAD, PAD, PAD, 321, PAD]
    assert replicated[:8] == list(range(1280, 1288))
    assert set(sharded[8:]) == set(replicated[8:]) == {PAD}


@pytest.mark.parametrize("seed", range(200))
def test_random_geometries_on_gpu(kernels: types.ModuleType, seed: int) -> None:
    case = random_case(seed)
    assert run_kernel(kernels, case, "cuda") == case.expected()


@pytest.mark.parametrize("seed", range(10))
def test_long_prefills_on_gpu(kernels: types.ModuleType, seed: int) -> None:
    case = random_case(1000 + seed, max_query_len=5000)
    assert run_kernel(kernels, case, "cuda") == case.expected()
