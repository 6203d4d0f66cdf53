# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused verify benchmark's ceiling of the copy share: 100% where
reading the KV takes longer than the useful products at the matmul's rate,
the ratio of the two times where the products take longer."""

import pytest
from k3_standalone import REPO_ROOT, load_module

BENCH = REPO_ROOT / "bench"


@pytest.fixture(scope="module")
def copy_share_ceiling():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCH))
        module = load_module(
            BENCH / "bench_fused_mla_verify.py", "_bench_fused_mla_verify"
        )
    return module.copy_share_ceiling


def test_a_case_whose_copy_takes_longer_has_no_ceiling_below_100(
    copy_share_ceiling,
):
    # 1 GB at 1,000 GB/s: 1 ms; 0.5 TFLOP at 1,000 TFLOP/s: 0.5 ms.
    assert copy_share_ceiling(10**9, 0.5e12, 1000.0, 1000.0) == 100.0


def test_a_case_whose_products_take_longer_is_capped_by_their_time(
    copy_share_ceiling,
):
    # 1 GB at 1,000 GB/s: 1 ms; 2 TFLOP at 1,000 TFLOP/s: 2 ms.
    assert copy_share_ceiling(10**9, 2e12, 1000.0, 1000.0) == pytest.approx(50.0)
