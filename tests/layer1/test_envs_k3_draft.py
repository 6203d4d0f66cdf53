# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The remote draft variables of ``vllm.envs``: defaults, legacy names and
clear errors for malformed values."""

from __future__ import annotations

import os

import pytest

from vllm import envs

NAMES = (
    "VLLM_K3_DRAFT_REMOTE_ADDRESS",
    "VLLM_K3_DSPARK_REMOTE_ADDRESS",
    "VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS",
    "VLLM_K3_DSPARK_REMOTE_TIMEOUT_MS",
    "VLLM_K3_DRAFT_TIMING_LOG_INTERVAL",
    "VLLM_K3_DRAFT_CURVE_SERVER_KEY",
    "VLLM_K3_DRAFT_CURVE_CLIENT_KEY",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_defaults():
    assert envs.VLLM_K3_DRAFT_REMOTE_ADDRESS is None
    assert envs.VLLM_K3_DSPARK_REMOTE_ADDRESS is None
    assert envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS == 30000
    assert envs.VLLM_K3_DRAFT_TIMING_LOG_INTERVAL == 0
    assert envs.VLLM_K3_DRAFT_CURVE_SERVER_KEY is None


def test_empty_address_is_unset(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", "")
    assert envs.VLLM_K3_DRAFT_REMOTE_ADDRESS is None


@pytest.mark.parametrize("value", ["abc", "1.5", "", "30s"])
def test_malformed_timeout_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", value)
    with pytest.raises(ValueError, match="VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS=.* not an"):
        _ = envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS


def test_timeout_below_one_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", "0")
    with pytest.raises(ValueError, match="must be at least 1"):
        _ = envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS


def test_timeout_beyond_zeromqs_bound_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", str(2**31 - 1))
    assert envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS == 2**31 - 1
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", str(2**31))
    with pytest.raises(
        ValueError,
        match=r"VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS=2147483648 must be at most 2147483647",
    ):
        _ = envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS


def test_legacy_timeout_applies_when_the_new_one_is_unset(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DSPARK_REMOTE_TIMEOUT_MS", "1234")
    assert envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS == 1234
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", "77")
    assert envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS == 77


def test_malformed_legacy_timeout_names_the_legacy_variable(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DSPARK_REMOTE_TIMEOUT_MS", "fast")
    with pytest.raises(ValueError, match="VLLM_K3_DSPARK_REMOTE_TIMEOUT_MS"):
        _ = envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS


def test_negative_timing_interval_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DRAFT_TIMING_LOG_INTERVAL", "-1")
    with pytest.raises(ValueError, match="VLLM_K3_DRAFT_TIMING_LOG_INTERVAL"):
        _ = envs.VLLM_K3_DRAFT_TIMING_LOG_INTERVAL


def test_remote_variables_do_not_change_compile_factors(monkeypatch):
    before = envs.compile_factors()
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", "tcp://127.0.0.1:5555")
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", "100")
    monkeypatch.setenv("VLLM_K3_DSPARK_REMOTE_TIMEOUT_MS", "200")
    assert envs.compile_factors() == before


def test_the_lowest_allowed_values_are_accepted(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", "1")
    monkeypatch.setenv("VLLM_K3_DSPARK_REMOTE_TIMEOUT_MS", "1")
    monkeypatch.setenv("VLLM_K3_DRAFT_TIMING_LOG_INTERVAL", "0")
    assert envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS == 1
    assert envs.VLLM_K3_DSPARK_REMOTE_TIMEOUT_MS == 1
    assert envs.VLLM_K3_DRAFT_TIMING_LOG_INTERVAL == 0


VALUES = {
    "VLLM_K3_DRAFT_REMOTE_ADDRESS": "tcp://127.0.0.1:5555",
    "VLLM_K3_DSPARK_REMOTE_ADDRESS": "ipc:///tmp/k3-draft",
    "VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS": "100",
    "VLLM_K3_DSPARK_REMOTE_TIMEOUT_MS": "200",
    "VLLM_K3_DRAFT_TIMING_LOG_INTERVAL": "10",
    "VLLM_K3_DRAFT_CURVE_SERVER_KEY": "/keys/server.key",
    "VLLM_K3_DRAFT_CURVE_CLIENT_KEY": "/keys/client.key_secret",
}


@pytest.mark.parametrize("name", NAMES)
def test_no_remote_variable_changes_compile_factors(monkeypatch, name):
    """Where the draft server is, how long to wait and its keys leave the
    torch.compile cache key alone: a moved server recompiles nothing."""
    before = envs.compile_factors()
    monkeypatch.setenv(name, VALUES[name])
    assert envs.compile_factors() == before


@pytest.mark.parametrize("name", NAMES)
def test_every_remote_variable_passes_vllms_environment_validation(monkeypatch, name):
    """``vllm serve`` warns about every VLLM_* variable that ``vllm.envs``
    does not register, and refuses to start with
    ``--fail-on-environ-validation``: the documented legacy names too."""
    from vllm.platforms.interface import Platform

    for other in list(os.environ):
        if other.startswith("VLLM_") and other not in envs.environment_variables:
            monkeypatch.delenv(other)
    monkeypatch.setenv(name, "1234")
    Platform.validate_environ(hard_fail=True)
