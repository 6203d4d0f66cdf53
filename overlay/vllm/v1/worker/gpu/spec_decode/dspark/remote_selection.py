# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model runner selection for remote drafting.

Only Model Runner V2 drafts remotely (``init_speculator`` picks
``RemoteK3DSparkSpeculator``); the V1 runner would load the draft locally and
ignore the address. ``VllmConfig.use_v2_model_runner`` therefore asks
``remote_draft_selects_v2`` before it considers the V1 fallback, and a
malformed address is refused there, when the config is built; without a
speculative config, an address set is warned about (it is ignored).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm import envs
from vllm.k3_draft.client import check_server_address
from vllm.logger import init_logger
from vllm.v1.worker.gpu.spec_decode import remote_draft_address

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def remote_address_variable() -> str:
    """The variable ``remote_draft_address`` took the address from."""
    return (
        "VLLM_K3_DRAFT_REMOTE_ADDRESS"
        if envs.VLLM_K3_DRAFT_REMOTE_ADDRESS
        else "VLLM_K3_DSPARK_REMOTE_ADDRESS"
    )


@contextlib.contextmanager
def naming_variable(variable: str) -> Iterator[None]:
    """A ``ValueError`` of the block, prefixed with the variable that set
    what it refuses."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"{variable}: {exc}") from None


def remote_draft_selects_v2(vllm_config: VllmConfig, v2_can_run: bool) -> bool:
    """Whether drafting is remote (``remote_draft_address``), so that Model
    Runner V2 must run this config.

    ``v2_can_run`` is False where V2 lacks what it runs on (Triton). A
    malformed address (``check_server_address``) raises a one-line ValueError
    naming its variable, as does a remote config V2 cannot run: V2 switched
    off with ``VLLM_USE_V2_MODEL_RUNNER=0``, or, unless V2 is forced on,
    ``v2_can_run`` False or a feature V2 does not support yet (upstream's
    list).
    """
    speculative_config = getattr(vllm_config, "speculative_config", None)
    if speculative_config is None:
        ignored = [
            f"{name}={value}"
            for name, value in (
                ("VLLM_K3_DRAFT_REMOTE_ADDRESS", envs.VLLM_K3_DRAFT_REMOTE_ADDRESS),
                ("VLLM_K3_DSPARK_REMOTE_ADDRESS", envs.VLLM_K3_DSPARK_REMOTE_ADDRESS),
            )
            if value
        ]
        if ignored:
            logger.warning_once(
                "%s ignored: no speculative decoding is configured (give "
                "--speculative-config with method dflash or dspark to draft "
                "remotely)",
                ", ".join(ignored),
            )
        return False
    address = remote_draft_address(speculative_config)
    if address is None:
        return False
    name = remote_address_variable()
    with naming_variable(name):
        check_server_address(address)
    remote = f"Remote drafting ({name}={address}) requires Model Runner V2"
    forced = envs.VLLM_USE_V2_MODEL_RUNNER
    if forced is False:
        raise ValueError(
            f"{remote}; remove VLLM_USE_V2_MODEL_RUNNER=0 or unset {name}."
        )
    if forced is None:
        if not v2_can_run:
            raise ValueError(
                f"{remote}, which requires Triton; install it or unset {name}."
            )
        unsupported = vllm_config._get_v2_model_runner_unsupported_features()
        if unsupported:
            raise ValueError(
                f"{remote}, which does not yet support {', '.join(unsupported)}; "
                f"turn that off or unset {name}."
            )
    return True
