# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer 3 reuses layer 1's helpers (``toy_target``, ``k3_layer1_server``,
``conftest_client``) and layer 2's (``k3_l2_reference``: the CPU reference of
upstream's Gumbel sampler) by import: put their folders on the path."""

import sys
from pathlib import Path

for layer in ("layer1", "layer2"):
    folder = str(Path(__file__).resolve().parents[1] / layer)
    if folder not in sys.path:
        sys.path.insert(0, folder)
