# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""pytest plugin for qualify's pristine baseline: deselects the tests named in
the JSON list at ``$K3_QUALIFY_SETTLED`` (ids in qualify's JUnit form,
``dotted.module[.Class]::name``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _pytest.junitxml import mangle_test_address


def junit_id(nodeid: str) -> str:
    """The id pytest's JUnit XML gives the test ``nodeid``, as qualify reads it."""
    names = mangle_test_address(nodeid)
    return f"{'.'.join(names[:-1])}::{names[-1]}"


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    settled = set(json.loads(Path(os.environ["K3_QUALIFY_SETTLED"]).read_text()))
    keep = [item for item in items if junit_id(item.nodeid) not in settled]
    if len(keep) < len(items):
        config.hook.pytest_deselected(
            items=[item for item in items if junit_id(item.nodeid) in settled]
        )
        items[:] = keep
