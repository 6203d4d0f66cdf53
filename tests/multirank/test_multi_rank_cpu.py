# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``ci/multi_rank.py`` at world size 2 on CPU: two real processes in a gloo
group, a real reference-engine draft server on loopback, the fused verify and
slot-mapping kernels under Triton's CPU interpreter. Every check of its JSON
report must pass: the layer-1 proposal (fail-closed -1 steps included) is
bit-identical on both ranks, the DCP merge of the two rank-local kernel runs
equals the single-rank result, and the replicated draft attention is
identical on both ranks and equal to DCP1 while the sharded one is not."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="the draft transport needs pyzmq")
triton = pytest.importorskip("triton", reason="the kernels need triton")

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "multi_rank.py"
CHECKS = ("tp_broadcast", "dcp_merge", "replicated_draft")


@pytest.mark.skipif(
    tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 8),
    reason="the fused kernel needs Triton >= 3.8's interpreter on CPU",
)
def test_world_size_two_on_gloo_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "multi-rank.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    # Force CPU ranks (gloo) even where a GPU is visible.
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--world-sizes", "2", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    assert "error" not in result, result["error"]
    statuses = {name: result["checks"][name]["status"] for name in CHECKS}
    assert statuses == dict.fromkeys(CHECKS, "PASS"), json.dumps(
        result["checks"], indent=1
    )[-4000:]
    assert report["passed"] and proc.returncode == 0
    # Layer 1: fail-closed steps broadcast -1 rows, identical on both ranks.
    steps = result["checks"]["tp_broadcast"]["steps"]
    assert all(step["per_rank"] == [True, True] for step in steps)
    failed = [s for s in steps if s["mode"] in ("malformed", "oov", "unreachable")]
    assert len(failed) == 3
    assert all(row == [-1] * len(row) for s in failed for row in s["drafts"])
    assert all(t >= 0 for row in steps[-1]["drafts"] for t in row)
    # Layers 4/5: the merge was timed.
    assert result["checks"]["dcp_merge"]["merge_cost"]
