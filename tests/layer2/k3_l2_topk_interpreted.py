# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm.k3_draft.topk_select.topk_rows`` under Triton's CPU interpreter,
with 64-column chunks: reads ``{name: (x, k)}`` from a ``torch.save`` file,
writes ``{name: (values, ids)}`` to another.

Usage: ``TRITON_INTERPRET=1 python k3_l2_topk_interpreted.py CASES OUT`` (the
interpreter must be on before triton is imported: ``tl.sum`` and
``tl.cumsum`` are Triton functions defined at its import).
"""

from __future__ import annotations

import os
import sys

import torch


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    from vllm.k3_draft import topk_select

    topk_select.CHUNK = 64
    cases = torch.load(sys.argv[1])
    torch.save(
        {name: topk_select.topk_rows(x, k) for name, (x, k) in cases.items()},
        sys.argv[2],
    )


if __name__ == "__main__":
    main()
