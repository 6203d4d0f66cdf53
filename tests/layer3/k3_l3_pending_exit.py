# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Child process of ``test_a_pending_reply_does_not_delay_interpreter_exit``.

``python k3_l3_pending_exit.py ADDRESS FLAG`` starts a deferred draft reply
against the server at ADDRESS, waits until the file FLAG exists (the server
got the PROPOSE and holds its answer), then returns from its main thread with
the reply still pending. Writes its model configs beside FLAG; needs the path
of the layer-3 tests."""

import sys
import time
from pathlib import Path
from typing import Any, cast

import torch
from test_deferred_resolve import _batch, _deferred, _propose, _runner_view
from toy_target import (
    MAX_MODEL_LEN,
    TokenTable,
    init_single_rank_world,
    make_vllm_config,
)

from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    RemoteK3DSparkSpeculator,
)


def main(address: str, flag: Path) -> None:
    config = make_vllm_config(flag.parent)
    init_single_rank_world(config)
    rows = config.scheduler_config.max_num_seqs
    table = TokenTable(torch.full((rows, MAX_MODEL_LEN), -7, dtype=torch.int32))
    speculator = RemoteK3DSparkSpeculator(
        config, torch.device("cpu"), cast(Any, table), address
    )
    strategy = _deferred(speculator)
    strategy.select_step(_runner_view(), _batch(["a"], [3]))
    _propose(speculator, _batch(["a"], [3]))
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert time.monotonic() < deadline, "the server never got the PROPOSE"
        time.sleep(0.01)
    assert strategy.pending
    print("main thread returns with a pending reply", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
