# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Logging for the draft server's modules.

``init_logger`` is vLLM's when vLLM is importable and the standard library's
otherwise, so the server also runs on a host that carries only these overlay
modules. ``configure_process_logging`` gives the standalone process a handler.
"""

import logging

try:
    from vllm.logger import init_logger
except ImportError:  # a draft host without vLLM
    init_logger = logging.getLogger  # type: ignore[assignment]

_FORMAT = "%(levelname)s %(asctime)s [%(name)s:%(lineno)d] %(message)s"


def configure_process_logging() -> None:
    """Log INFO and above to stderr unless logging is configured already."""
    if not (logging.getLogger().handlers or logging.getLogger("vllm").handlers):
        logging.basicConfig(level=logging.INFO, format=_FORMAT)


__all__ = ["configure_process_logging", "init_logger"]
