# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``init_speculator`` picks the remote speculator before the local
DFlash/DSpark ones when an address is set, and is upstream's otherwise.

The speculator classes are replaced by recorders so that the selection alone
is tested (building a local DFlash speculator needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.worker.gpu.spec_decode import init_speculator
from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_module
from vllm.v1.worker.gpu.spec_decode.dspark import remote_speculator
from vllm.v1.worker.gpu.spec_decode.dspark import speculator as dspark_module

pytest_plugins = ("conftest_client",)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def recorders(monkeypatch):
    for name in ("VLLM_K3_DRAFT_REMOTE_ADDRESS", "VLLM_K3_DSPARK_REMOTE_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dflash_module, "DFlashSpeculator", lambda c, d: "dflash")
    monkeypatch.setattr(dspark_module, "DSparkSpeculator", lambda c, d: "dspark")
    monkeypatch.setattr(
        remote_speculator,
        "RemoteK3DSparkSpeculator",
        lambda c, d, r, address: ("remote", address),
    )


def test_unset_address_keeps_the_local_dflash(vllm_config_factory):
    assert init_speculator(vllm_config_factory(), CPU, None) == "dflash"


def test_address_selects_the_remote_speculator(monkeypatch, vllm_config_factory):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", "ipc:///tmp/draft")
    selected = init_speculator(vllm_config_factory(), CPU, None)
    assert selected == ("remote", "ipc:///tmp/draft")


def test_legacy_address_selects_remote_dspark(monkeypatch, vllm_config_factory):
    monkeypatch.setenv("VLLM_K3_DSPARK_REMOTE_ADDRESS", "ipc:///tmp/legacy")
    config = vllm_config_factory(method="dspark")
    assert init_speculator(config, CPU, None) == ("remote", "ipc:///tmp/legacy")


def test_legacy_address_is_ignored_for_dflash(monkeypatch, vllm_config_factory):
    monkeypatch.setenv("VLLM_K3_DSPARK_REMOTE_ADDRESS", "ipc:///tmp/legacy")
    assert init_speculator(vllm_config_factory(), CPU, None) == "dflash"


def test_new_address_wins_over_the_legacy_one(monkeypatch, vllm_config_factory):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", "ipc:///tmp/new")
    monkeypatch.setenv("VLLM_K3_DSPARK_REMOTE_ADDRESS", "ipc:///tmp/legacy")
    config = vllm_config_factory(method="dspark")
    assert init_speculator(config, CPU, None) == ("remote", "ipc:///tmp/new")
