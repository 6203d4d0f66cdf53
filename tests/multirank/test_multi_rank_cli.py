# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``ci/multi_rank.py --out`` at a path no file can be written to (a folder,
below a file) is a usage error before any rank starts, not a traceback after
the whole run that loses its report."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "multi_rank.py"


@pytest.mark.parametrize("where", ["folder", "below a file"])
def test_an_out_path_it_cannot_write_is_a_usage_error(where, tmp_path):
    out = tmp_path if where == "folder" else Path(__file__) / "report.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--world-sizes", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith(
        f"argument --out: cannot write a file at '{out}'"
    )


def test_an_out_path_in_folders_not_made_yet_is_accepted(tmp_path):
    from importlib.util import module_from_spec, spec_from_file_location

    module = sys.modules.get("_multi_rank_cli")
    if module is None:
        spec = spec_from_file_location("_multi_rank_cli", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = module_from_spec(spec)
        # Its dataclasses look their module up.
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    out = tmp_path / "a" / "b" / "report.json"
    assert module._out_path(str(out)) == out
