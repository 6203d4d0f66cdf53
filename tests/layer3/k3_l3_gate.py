# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load ``vllm/k3_draft/stream_gate.py`` by file path (the GPU machine has no
vllm package): from the overlay of this checkout, else ``$K3_STREAM_GATE``."""

import importlib.util
import os
import sys
import types
from pathlib import Path

GATE_PATH = Path(
    os.environ.get(
        "K3_STREAM_GATE",
        Path(__file__).resolve().parents[2] / "overlay/vllm/k3_draft/stream_gate.py",
    )
)


def load_stream_gate() -> types.ModuleType:
    name = "k3_stream_gate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GATE_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
