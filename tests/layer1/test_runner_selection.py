# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""With a remote draft address, ``VllmConfig`` picks Model Runner V2 (the only
runner that drafts remotely) or refuses the configuration in one line when V2
cannot run it; without an address, upstream's V1 fallback is unchanged.

The V1 runner would build a local DFlash proposer and load the draft onto the
target's GPUs, ignoring the address."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from toy_target import make_vllm_config

import vllm.config.vllm as vllm_config_module
from vllm.platforms.interface import Platform, PlatformEnum

ADDRESS = "tcp://127.0.0.1:5599"
NOT_ZEROMQ = "is not a ZeroMQ tcp://, ipc:// or inproc:// address"
NOT_TCP = "is not tcp://HOST:PORT with a port in 1..65535"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "VLLM_K3_DRAFT_REMOTE_ADDRESS",
        "VLLM_K3_DSPARK_REMOTE_ADDRESS",
        "VLLM_USE_V2_MODEL_RUNNER",
    ):
        monkeypatch.delenv(name, raising=False)


def refusal(tmp_path: Path, **kwargs: Any) -> str:
    """The message of the ValueError that building the config raises (pydantic
    reports it as the single error of a ValidationError)."""
    with pytest.raises(ValidationError) as info:
        make_vllm_config(tmp_path, **kwargs)
    (error,) = info.value.errors()
    return str(error["ctx"]["error"])


def without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA platform without Triton, as the config module sees it."""
    platform = Platform()
    platform._enum = PlatformEnum.CUDA
    monkeypatch.setattr(vllm_config_module, "current_platform", platform)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", False)


def test_v2_switched_off_with_a_remote_address_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", ADDRESS)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    message = refusal(tmp_path)
    assert "\n" not in message
    assert f"VLLM_K3_DRAFT_REMOTE_ADDRESS={ADDRESS}" in message
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in message


def test_v2_switched_off_with_the_legacy_dspark_address_is_refused(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("VLLM_K3_DSPARK_REMOTE_ADDRESS", ADDRESS)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    message = refusal(tmp_path, method="dspark")
    assert f"VLLM_K3_DSPARK_REMOTE_ADDRESS={ADDRESS}" in message
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in message


def test_dual_batch_overlap_with_a_remote_address_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", ADDRESS)
    message = refusal(tmp_path, enable_dbo=True)
    assert "\n" not in message
    assert message.startswith(
        f"Remote drafting (VLLM_K3_DRAFT_REMOTE_ADDRESS={ADDRESS}) requires "
        "Model Runner V2, which does not yet support dual batch overlap"
    )
    assert message.endswith("unset VLLM_K3_DRAFT_REMOTE_ADDRESS.")


def test_missing_triton_with_a_remote_address_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", ADDRESS)
    without_triton(monkeypatch)
    message = refusal(tmp_path)
    assert "\n" not in message
    assert "Triton" in message


def test_v2_forced_on_with_a_remote_address_runs_without_triton(monkeypatch, tmp_path):
    # VLLM_USE_V2_MODEL_RUNNER=1 overrides the Triton check, as upstream's
    # selection does without an address.
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", ADDRESS)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    without_triton(monkeypatch)
    assert make_vllm_config(tmp_path).use_v2_model_runner


def test_remote_address_with_defaults_selects_model_runner_v2(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", ADDRESS)
    assert make_vllm_config(tmp_path).use_v2_model_runner


def test_without_a_remote_address_the_v1_fallback_is_upstreams(monkeypatch, tmp_path):
    assert not make_vllm_config(tmp_path / "dbo", enable_dbo=True).use_v2_model_runner
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not make_vllm_config(tmp_path / "off").use_v2_model_runner
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    without_triton(monkeypatch)
    assert not make_vllm_config(tmp_path / "triton").use_v2_model_runner


def test_the_legacy_dspark_address_leaves_dflash_on_upstreams_fallback(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("VLLM_K3_DSPARK_REMOTE_ADDRESS", ADDRESS)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not make_vllm_config(tmp_path).use_v2_model_runner


@pytest.mark.parametrize(
    "address, accepted",
    [
        ("127.0.0.1:5555", NOT_ZEROMQ),
        (" tcp://127.0.0.1:5555", NOT_ZEROMQ),
        ("ipc://", NOT_ZEROMQ),
        ("tcp://127.0.0.1", NOT_TCP),
        ("tcp://127.0.0.1:0", NOT_TCP),
        ("tcp://127.0.0.1:70000", NOT_TCP),
        ("tcp://127.0.0.1:65536", NOT_TCP),
        # Digits, but not ASCII ones: ZeroMQ reads no port in them.
        ("tcp://127.0.0.1:\u0665\u0665", NOT_TCP),
        ("tcp://127.0.0.1:\u00b2", NOT_TCP),
        ("tcp://127.0.0.1:5555 ", NOT_TCP),
        ("tcp://*:5555", "names the bind wildcard '*', not a host to connect to"),
    ],
)
@pytest.mark.parametrize(
    "variable, method",
    [
        ("VLLM_K3_DRAFT_REMOTE_ADDRESS", "dflash"),
        ("VLLM_K3_DSPARK_REMOTE_ADDRESS", "dspark"),
    ],
)
def test_a_malformed_address_is_refused_when_the_config_is_built(
    monkeypatch, tmp_path, variable, method, address, accepted
):
    monkeypatch.setenv(variable, address)
    message = refusal(tmp_path, method=method)
    assert message == f"{variable}: draft server address {address!r} {accepted}"


@pytest.mark.parametrize(
    "variable", ["VLLM_K3_DRAFT_REMOTE_ADDRESS", "VLLM_K3_DSPARK_REMOTE_ADDRESS"]
)
def test_a_remote_address_without_speculative_decoding_is_warned_about(
    monkeypatch, tmp_path, caplog, variable
):
    """The operator asked for remote drafts but configured no speculative
    decoding: the engine serves without drafts, and says why."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    make_vllm_config(tmp_path)  # writes the target's config.json
    monkeypatch.setenv(variable, ADDRESS)
    with caplog.at_level(logging.WARNING):
        config = VllmConfig(
            model_config=ModelConfig(
                model=str(tmp_path / "target"),
                skip_tokenizer_init=True,
                max_model_len=4096,
                dtype="bfloat16",
            ),
            device_config=DeviceConfig(device="cpu"),
        )
    assert config.speculative_config is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"{variable}={ADDRESS}" in message and "--speculative-config" in message
        for message in warnings
    ), warnings
