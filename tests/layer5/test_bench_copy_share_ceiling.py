# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused verify benchmark's ceiling of the copy share: 100% where
reading the KV takes longer than the useful products at the matmul's rate,
the ratio of the two times where the products take longer."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def copy_share_ceiling():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCH))
        spec = importlib.util.spec_from_file_location(
            "bench_fused_mla_verify", BENCH / "bench_fused_mla_verify.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
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
