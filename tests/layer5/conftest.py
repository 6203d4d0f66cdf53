# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of layer 5: the fused verify kernel module and upstream's kernel,
both loaded by file path (the GPU machine has no vllm package)."""

import types

import pytest


def _standalone() -> types.ModuleType:
    pytest.importorskip("triton", reason="the layer-5 kernel module needs triton")
    import k3_standalone  # sibling module: pytest prepends this directory

    return k3_standalone


@pytest.fixture(scope="session")
def fused_verify() -> types.ModuleType:
    """``k3_fused_mla_verify`` loaded from the overlay."""
    return _standalone().load_fused_verify()


@pytest.fixture(scope="session")
def upstream_decode() -> types.ModuleType:
    """Upstream 0.33.0's ``triton_decode_attention``, copied to
    ``.upstream/`` and carried to the GPU machine."""
    standalone = _standalone()
    if not standalone.UPSTREAM_DECODE_PATH.is_file():
        pytest.skip(
            f"{standalone.UPSTREAM_DECODE_PATH} is missing: copy upstream's "
            "vllm/v1/attention/ops/triton_decode_attention.py there"
        )
    return standalone.load_upstream_decode()
