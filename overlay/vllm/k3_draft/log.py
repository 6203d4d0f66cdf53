# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Logging for the draft server's modules.

``init_logger`` is vLLM's when vLLM is importable and the standard library's
otherwise, so the server also runs on a host that carries only these overlay
modules. ``configure_process_logging`` gives the standalone process a handler.
"""

import logging
import os

try:
    from vllm.logger import init_logger
except ImportError:  # a draft host without vLLM
    init_logger = logging.getLogger  # type: ignore[assignment]

_FORMAT = "%(levelname)s %(asctime)s [%(name)s:%(lineno)d] %(message)s"


def logging_level() -> int:
    """The level ``VLLM_LOGGING_LEVEL`` names (default INFO), read as vLLM
    reads it; a ``ValueError`` naming the variable if it names no level."""
    try:
        from vllm import envs

        name = envs.VLLM_LOGGING_LEVEL
    except ImportError:  # a draft host without vLLM
        name = os.getenv("VLLM_LOGGING_LEVEL", "INFO").upper()
    level = logging.getLevelNamesMapping().get(name)
    if level is None:
        raise ValueError(
            f"VLLM_LOGGING_LEVEL={name!r} is not a logging level "
            "(DEBUG, INFO, WARNING, ERROR or CRITICAL)"
        )
    return level


def configure_process_logging(level: int = logging.INFO) -> None:
    """Log ``level`` and above to stderr unless logging is configured
    already."""
    if not (logging.getLogger().handlers or logging.getLogger("vllm").handlers):
        logging.basicConfig(level=level, format=_FORMAT)


__all__ = ["configure_process_logging", "init_logger", "logging_level"]
