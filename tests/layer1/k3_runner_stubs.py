# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stand-ins for the parts of a ``GPUModelRunner`` built without ``__init__``
that a runner test does not exercise (layers 1 and 3)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any


class Inert:
    """Any method call is accepted and ignored (runner parts not under test)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class FakeEplb(Inert):
    def suppress(self) -> Any:
        return nullcontext()
