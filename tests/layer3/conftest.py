# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer 3 reuses layer 1's helpers (``toy_target``, ``k3_layer1_server``,
``conftest_client``) by import: put their folder on the path."""

import sys
from pathlib import Path

LAYER1 = str(Path(__file__).resolve().parents[1] / "layer1")
if LAYER1 not in sys.path:
    sys.path.insert(0, LAYER1)
