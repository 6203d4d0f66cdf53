# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Multi-rank qualification of layers 1, 4 and 5 (issue 8).

For each world size N in ``--world-sizes`` this script spawns N processes
(``torch.multiprocessing``, start method spawn) that form one
``torch.distributed`` group: NCCL with one GPU per rank when
``N <= torch.cuda.device_count()``, else gloo on CPU. Every process sets
``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` before it touches torch.distributed. The ranks run:

1. ``tp_broadcast`` (layer 1): rank 0 drives the remote-draft client against a
   real draft server process (``python -m vllm.entrypoints.k3_dspark_standalone
   --engine reference``) through a fault-injecting ZeroMQ proxy on loopback;
   steps pass through, get a malformed reply, an out-of-vocabulary reply, or
   no reply at all (the server unreachable within the RPC timeout). With the
   patched vllm importable, every rank builds a real
   ``RemoteK3DSparkSpeculator`` in vllm's distributed environment
   (``init_distributed_environment`` + ``initialize_model_parallel`` with
   tensor parallel size N) and calls ``propose``, whose ``publish`` broadcasts
   through ``get_tp_group().broadcast``. Without vllm (the GPU box), rank 0
   runs the same client plan (``vllm.k3_draft.plan.RemotePlan``, importable
   from ``overlay/``) and the tensor goes through ``torch.distributed``'s
   broadcast. Every rank all-gathers the proposal and compares it with rank
   0's bit for bit; rank 0 checks fail-closed steps give -1 rows.
2. ``dcp_merge`` (layers 4/5): every rank r of D = N runs the fused MLA verify
   kernel (``overlay/.../k3_fused_mla_verify.py``, loaded by path) on its
   rank-local shard of a paged KV (interleaved ownership, ``dcp_size=D``,
   ``dcp_rank=r``), all-gathers the LSE, rescales its output and all-reduces
   it (the DCP merge); the merged result must be bit-identical on every rank
   and is compared with the single-rank (D=1) kernel run and a float64
   reference on rank 0. The merge is timed
   (CUDA events on GPU, ``perf_counter`` on CPU); timings are reported, never
   asserted. On CPU the kernel runs under ``TRITON_INTERPRET=1`` (fp16 query
   and KV: the interpreter cannot compute bf16) with tiny shapes.
3. ``replicated_draft``: every rank writes the draft's K/V into its paged
   cache at the slots of layer 4's slot-mapping kernel
   (``overlay/.../k3_dcp_block_table.py``, by path) and attends over its
   rank-local read-back. Replicated layout: identical on every rank
   (all-gather, ``torch.equal``) and equal to DCP1; sharded layout without an
   LSE merge: differs from DCP1 (for D > 1), and merged by LSE matches it.

Prints one line per check per N and a summary; ``--out`` writes JSON. Exit
status 0 only when no check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
OVERLAY = REPO_ROOT / "overlay"
FUSED_VERIFY_PATH = OVERLAY / "vllm/v1/attention/ops/k3_fused_mla_verify.py"
BLOCK_TABLE_PATH = OVERLAY / "vllm/v1/worker/gpu/k3_dcp_block_table.py"
TOY_TARGET_DIR = REPO_ROOT / "tests" / "layer1"

NVLS_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# The reference draft server runs with the layer-1 tests' options
# (tests/layer1/k3_layer1_server.py: DEFAULT_OPTIONS); these mirror them.
VOCAB = 1024
HIDDEN = 64
NUM_AUX = 3
WIDTH = HIDDEN * NUM_AUX
MAX_NUM_SEQS = 8
MAX_BATCHED = 512
MAX_MODEL_LEN = 4096
K = 3
RPC_TIMEOUT_MS = 2000
NO_DRAFT = -1
# (proxy mode, scheduled tokens, rejected tokens) per step for two requests.
# Fail modes: "malformed" (reply frame 0 is not JSON), "oov" (token ids out of
# the vocabulary), "unreachable" (no reply within the RPC timeout). "recover"
# passes after waiting out the client's reconnect back-off (1 s).
STEPS: list[tuple[str, int, int]] = [
    ("pass", 16, 0),
    ("pass", K + 1, 1),
    ("malformed", K + 1, 0),
    ("pass", K + 1, 2),
    ("oov", K + 1, 3),
    ("pass", K + 1, 0),
    ("unreachable", K + 1, 1),
    ("recover", K + 1, 0),
    ("pass", K + 1, 1),
]
FAIL_MODES = ("malformed", "oov", "unreachable")
REQUEST_IDS = ["req-a", "req-b"]

# Layer-5 tolerances (tests/layer5/test_fused_mla_verify_gpu.py): relative
# output error in norm over all seen rows, worst (row, head) relative error,
# absolute LSE error; rows that see no KV must be exact (-inf LSE, zero output).
O_NORM_TOL = 1e-2
O_ROW_TOL = 3e-2
LSE_TOL = 2e-3
# Sharded draft partials merged by LSE vs DCP1 (float32 attention).
DRAFT_MERGE_TOL = 1e-5


def log(msg: str) -> None:
    print(msg, flush=True)


def load_by_path(path: Path, name: str) -> types.ModuleType:
    """Execute ``path`` as module ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class FaultProxy(threading.Thread):
    """A ZeroMQ ROUTER in front of the draft server that forwards every
    request and, for PROPOSE, applies ``mode``: "pass" (and "recover"),
    "malformed", "oov" or "unreachable" (the request is dropped)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(daemon=True)
        import zmq

        self.zmq = zmq
        self.context = zmq.Context()
        self.front = self.context.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.back = self.context.socket(zmq.REQ)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.setsockopt(zmq.RCVTIMEO, 30000)
        self.back.connect(upstream)
        self.mode = "pass"
        self.ops: list[tuple[str, str]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        poller = self.zmq.Poller()
        poller.register(self.front, self.zmq.POLLIN)
        while not self._halt.is_set():
            if not poller.poll(50):
                continue
            ident, empty, *frames = self.front.recv_multipart()
            op = json.loads(frames[0]).get("op", "?")
            mode = self.mode if op == "PROPOSE" else "pass"
            self.ops.append((op, mode))
            if mode == "unreachable":
                continue
            self.back.send_multipart(frames)
            reply = self.back.recv_multipart()
            if mode == "malformed":
                reply = [b"\xff{not json"]
            elif mode == "oov":
                header = json.loads(reply[0])
                header["tokens"] = [[VOCAB + 7] * len(r) for r in header["tokens"]]
                reply = [json.dumps(header).encode(), *reply[1:]]
            self.front.send_multipart([ident, empty, *reply])

    def close(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.front.close(linger=0)
        self.back.close(linger=0)
        self.context.term()


# ------------------------------------------------------------------- workers


@dataclass
class WorkerArgs:
    world_size: int
    backend: str
    init_method: str
    server_address: str
    result_path: str
    workdir: str


def _set_worker_env() -> None:
    os.environ.update(NVLS_ENV)
    os.environ["VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS"] = str(RPC_TIMEOUT_MS)


def _vllm_speculator_available() -> str | None:
    """None when the patched vllm's speculator imports, else why not."""
    try:
        import vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator  # noqa: F401
    except Exception as exc:  # ImportError, or a compiled extension failing
        return f"{type(exc).__name__}: {exc}"[:200]
    return None


def worker(rank: int, args: WorkerArgs) -> None:
    _set_worker_env()
    # The interpreter's numpy divides by zero on masked (-inf) lanes.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    import torch
    import torch.distributed as dist

    n = args.world_size
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    why_not_vllm = _vllm_speculator_available()
    result: dict[str, Any] = {"world_size": n, "backend": args.backend}
    vllm_config = None
    if why_not_vllm is None:
        sys.path.insert(0, str(TOY_TARGET_DIR))
        from toy_target import make_vllm_config

        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )

        vllm_config = make_vllm_config(
            Path(args.workdir) / f"config-rank{rank}",
            num_speculative_tokens=K,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_BATCHED,
        )
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(
                world_size=n,
                rank=rank,
                distributed_init_method=args.init_method,
                local_rank=rank,
                backend=args.backend,
            )
            initialize_model_parallel(tensor_model_parallel_size=n)
    else:
        dist.init_process_group(
            args.backend, init_method=args.init_method, rank=rank, world_size=n
        )
    checks: dict[str, dict[str, Any]] = {}
    for name, fn in (
        ("tp_broadcast", lambda: check_tp_broadcast(rank, args, device, vllm_config)),
        ("dcp_merge", lambda: check_dcp_merge(rank, n, device)),
        ("replicated_draft", lambda: check_replicated_draft(rank, n, device)),
    ):
        try:
            checks[name] = fn()
        except Exception as exc:
            checks[name] = {
                "status": "FAIL",
                "summary": f"{type(exc).__name__}: {exc}"[:300],
                "traceback": traceback.format_exc()[-2000:],
            }
        # A failed rank must not leave the others in a collective.
        flag = torch.tensor(
            [1 if checks[name]["status"] == "FAIL" else 0], device=device
        )
        dist.all_reduce(flag)
        if checks[name]["status"] != "FAIL" and int(flag.item()):
            checks[name]["status"] = "FAIL"
            checks[name]["summary"] = "another rank failed: " + checks[name].get(
                "summary", ""
            )
        if int(flag.item()):
            break
    if why_not_vllm is not None:
        checks.setdefault("tp_broadcast", {})["vllm_unavailable"] = why_not_vllm
    result["checks"] = checks
    if rank == 0:
        Path(args.result_path).write_text(json.dumps(result, indent=1))
    dist.barrier()
    if vllm_config is not None:
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()
    else:
        dist.destroy_process_group()


def _all_equal_to_rank0(tensor: Any) -> tuple[bool, list[bool]]:
    """All-gather ``tensor``; every rank compares rank 0's copy with its own,
    then the verdicts are all-gathered: (all equal, per-rank verdicts)."""
    import torch
    import torch.distributed as dist

    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    mine = torch.equal(gathered[0], tensor)
    verdict = torch.tensor([1 if mine else 0], device=tensor.device)
    verdicts = [torch.empty_like(verdict) for _ in range(dist.get_world_size())]
    dist.all_gather(verdicts, verdict)
    per_rank = [bool(v.item()) for v in verdicts]
    return all(per_rank), per_rank


# ------------------------------------------------------- 1: TP broadcast


def check_tp_broadcast(
    rank: int, args: WorkerArgs, device: Any, vllm_config: Any
) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist

    proxy: FaultProxy | None = None
    if rank == 0:
        proxy = FaultProxy(args.server_address)
        proxy.start()
    use_vllm = vllm_config is not None
    speculator: Any = None
    plan: Any = None
    table = torch.full((MAX_NUM_SEQS, MAX_MODEL_LEN), -7, dtype=torch.int32)
    if use_vllm:
        sys.path.insert(0, str(TOY_TARGET_DIR))
        from toy_target import TokenTable, make_input_batch

        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
            RemoteK3DSparkSpeculator,
        )

        with set_current_vllm_config(vllm_config):
            speculator = RemoteK3DSparkSpeculator(
                vllm_config,
                device,
                TokenTable(table),  # type: ignore[arg-type]
                proxy.address if proxy is not None else "tcp://127.0.0.1:1",
            )
        path = (
            "RemoteK3DSparkSpeculator.propose -> publish -> "
            f"get_tp_group().broadcast (TP group of {args.world_size}, "
            f"{args.backend})"
        )
    else:
        from vllm.k3_draft.client import DraftClient, ServerRequirements
        from vllm.k3_draft.plan import RemotePlan, StepInputs, StepRequest

        if proxy is not None:
            needs = ServerRequirements(
                method="dflash",
                capabilities=frozenset(),
                context_width=WIDTH,
                vocab_size=VOCAB,
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=MAX_NUM_SEQS,
                num_speculative_tokens=K,
                max_num_batched_tokens=MAX_BATCHED,
            )
            plan = RemotePlan(DraftClient(proxy.address, RPC_TIMEOUT_MS), needs)
            plan.connect()
        path = (
            "FALLBACK (vllm not importable): vllm.k3_draft.plan.RemotePlan on "
            f"rank 0 + torch.distributed.broadcast ({args.backend})"
        )

    n_req = len(REQUEST_IDS)
    first = [0] * n_req
    steps_out: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        for step_no, (mode, count, rejected) in enumerate(STEPS):
            if proxy is not None:
                if mode == "recover":
                    time.sleep(1.2)  # the client's reconnect back-off
                proxy.mode = mode
            gen = torch.Generator().manual_seed(step_no)
            rows = torch.randn(n_req * count, WIDTH, generator=gen).to(torch.bfloat16)
            positions = torch.cat(
                [torch.arange(first[i], first[i] + count) for i in range(n_req)]
            )
            anchors = [100 + 10 * step_no + i for i in range(n_req)]
            qsl = np.arange(n_req + 1, dtype=np.int32) * count
            if use_vllm:
                last_sampled = torch.zeros(MAX_NUM_SEQS, 1, dtype=torch.int64)
                last_sampled[:n_req, 0] = torch.tensor(anchors)
                batch = make_input_batch(
                    list(REQUEST_IDS),
                    np.arange(n_req, dtype=np.intp),
                    qsl,
                    positions,
                    n_req * count,
                )
                aux = [h.to(device) for h in rows.float().split(HIDDEN, dim=-1)]
                drafts = speculator.propose(
                    batch,
                    {},
                    {},
                    aux[0],
                    aux,
                    torch.ones(n_req, dtype=torch.int32),
                    torch.full((n_req,), rejected, dtype=torch.int32),
                    last_sampled,
                    torch.zeros(1, MAX_NUM_SEQS, dtype=torch.int32),
                    torch.zeros(MAX_NUM_SEQS),
                    torch.zeros(MAX_NUM_SEQS, dtype=torch.int64),
                ).clone()
            else:
                drafts = torch.full((n_req, K), NO_DRAFT, dtype=torch.int64)
                if plan is not None:
                    requests = [
                        StepRequest(
                            request_id=rid,
                            first_position=first[i],
                            num_context=count - rejected,
                            anchor_token_id=anchors[i],
                            row_offset=i * count,
                            tokens=None,
                        )
                        for i, rid in enumerate(REQUEST_IDS)
                    ]
                    result = plan.run(StepInputs(requests, K, rows))
                    drafts.copy_(torch.from_numpy(result.tokens))
                drafts = drafts.to(device)
                dist.broadcast(drafts, src=0)
            equal, per_rank = _all_equal_to_rank0(drafts)
            host = drafts.cpu()
            no_draft_rows = int((host == NO_DRAFT).all(dim=1).sum())
            valid_rows = int(((host >= 0) & (host < VOCAB)).all(dim=1).sum())
            steps_out.append(
                {
                    "step": step_no,
                    "mode": mode,
                    "bit_identical": equal,
                    "per_rank": per_rank,
                    "drafts": host.tolist(),
                }
            )
            if not equal:
                failures.append(f"step {step_no}: ranks differ {per_rank}")
            if mode in FAIL_MODES and no_draft_rows != n_req:
                failures.append(f"step {step_no} ({mode}): not all rows -1")
            if no_draft_rows + valid_rows != n_req:
                failures.append(f"step {step_no}: a partial or invalid draft row")
            expect_drafts = mode == "recover" or step_no in (0, len(STEPS) - 1)
            if expect_drafts and valid_rows != n_req:
                failures.append(f"step {step_no} ({mode}): expected drafts")
            first = [f + count - rejected for f in first]
    finally:
        if speculator is not None and speculator.plan is not None:
            speculator.plan.client.close()
        if plan is not None:
            plan.client.close()
        if proxy is not None:
            proxy.close()
    fail_closed = sum(1 for s in steps_out if s["mode"] in FAIL_MODES)
    status = "FAIL" if failures else "PASS"
    return {
        "status": status,
        "path": path,
        "summary": (
            f"{len(steps_out)} steps ({fail_closed} fail-closed: malformed, "
            f"out-of-vocabulary, unreachable), proposal bit-identical on "
            f"{args.world_size} rank(s) every step; via {path}"
            if not failures
            else "; ".join(failures)
        ),
        "steps": steps_out,
        "proxy_ops": [] if proxy is None else proxy.ops,
    }


# ----------------------------------------------------------- 2: DCP merge


def _cpu_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _paged(
    stored: list[Any], page_size: int, generator: Any, device: Any
) -> tuple[Any, Any]:
    """Page per-request KV ``[n, 576]`` into a NaN-poisoned cache in a random
    page order; unused block-table entries point at a poisoned spare page."""
    import torch

    dtype = stored[0].dtype
    pages = [-(-len(kv) // page_size) for kv in stored]
    width = max([1, *pages])
    num_blocks = sum(pages) + 1
    cache = torch.full((num_blocks, page_size, 576), float("nan")).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=generator).tolist()
    table = torch.full((len(stored), width), num_blocks - 1, dtype=torch.int32)
    for b, kv in enumerate(stored):
        for j in range(pages[b]):
            page = order.pop()
            table[b, j] = page
            chunk = kv[j * page_size : (j + 1) * page_size]
            cache[page, : len(chunk)] = chunk
    return cache.to(device), table.to(device)


def _reference_mla(
    q: Any, stored: list[Any], query_len: int, sm_scale: float
) -> tuple[Any, Any]:
    """float64 causal MLA attention (value = first 512 of the 576 dims)."""
    import torch

    rows_o, rows_lse = [], []
    for b, kv in enumerate(stored):
        qb = q[b * query_len : (b + 1) * query_len].double()  # [R, H, 576]
        kvd = kv.double()
        n = len(kv)
        scores = torch.einsum("rhd,nd->rhn", qb, kvd) * sm_scale
        visible = (
            torch.arange(n)[None, :]
            < (n - query_len + 1 + torch.arange(query_len))[:, None]
        )
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - torch.where(torch.isinf(lse), 0, lse)[..., None])
        o = torch.einsum("rhn,nd->rhd", p, kvd[:, :512])
        rows_o.append(torch.nan_to_num(o, nan=0.0))
        rows_lse.append(lse)
    return torch.cat(rows_o), torch.cat(rows_lse)


def _compare(o: Any, lse: Any, ref_o: Any, ref_lse: Any) -> dict[str, Any]:
    """Errors of (o, lse) against (ref_o, ref_lse) and the verdict."""
    import torch

    o, lse = o.double().cpu(), lse.double().cpu()
    ref_o, ref_lse = ref_o.double().cpu(), ref_lse.double().cpu()
    empty = torch.isinf(ref_lse)
    seen = ~empty
    out: dict[str, Any] = {
        "written": bool(not o.isnan().any() and not lse.isnan().any()),
        "empty_rows_exact": bool(
            torch.equal(lse[empty], ref_lse[empty]) and (o[empty] == 0).all()
        ),
        "empty_rows": int(empty.sum()),
    }
    diff = o[seen] - ref_o[seen]
    out["o_norm_err"] = float(diff.norm() / ref_o[seen].norm())
    out["o_row_err"] = float((diff.norm(dim=-1) / ref_o[seen].norm(dim=-1)).max())
    out["lse_err"] = float((lse[seen] - ref_lse[seen]).abs().max())
    out["ok"] = bool(
        out["written"]
        and out["empty_rows_exact"]
        and out["o_norm_err"] < O_NORM_TOL
        and out["o_row_err"] < O_ROW_TOL
        and out["lse_err"] < LSE_TOL
    )
    return out


def lse_merge(o_local: Any, lse_local: Any) -> tuple[Any, Any]:
    """The DCP merge: all-gather the LSE, rescale the local partial output by
    ``exp(lse_r - lse_global)`` and all-reduce (sum) it in float32. Rows no
    rank sees keep -inf and zero."""
    import torch
    import torch.distributed as dist

    lses = [torch.empty_like(lse_local) for _ in range(dist.get_world_size())]
    dist.all_gather(lses, lse_local)
    stacked = torch.stack(lses)
    top = stacked.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    total = torch.exp(stacked - top).sum(dim=0)
    scale = torch.where(
        total > 0, torch.exp(lse_local - top) / total, torch.zeros_like(total)
    )
    out = o_local.float() * scale[..., None]
    dist.all_reduce(out)
    merged_lse = torch.where(
        total > 0, top + torch.log(total), torch.full_like(total, float("-inf"))
    )
    return out, merged_lse


def _time_merge(
    rows: int, heads: int, device: Any, iters: int, warmup: int
) -> dict[str, Any]:
    """Median merge time (all-gather LSE + rescale + all-reduce), rank 0's
    and the slowest rank's."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    o = torch.randn(rows, heads, 512, generator=gen).to(device)
    lse = torch.randn(rows, heads, generator=gen).to(device)
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            lse_merge(o, lse)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            lse_merge(o, lse)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    median = torch.tensor(
        [statistics.median(times)], dtype=torch.float64, device=device
    )
    medians = [torch.empty_like(median) for _ in range(dist.get_world_size())]
    dist.all_gather(medians, median)
    return {
        "rows": rows,
        "heads": heads,
        "bytes_per_rank": rows * heads * (512 + 1) * 4,
        "iters": iters,
        "median_ms_rank0": round(float(median.item()), 4),
        "median_ms_slowest": round(max(float(m.item()) for m in medians), 4),
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
    }


def _run_fused(
    ops: types.ModuleType,
    q: Any,
    cache: Any,
    table: Any,
    seq: Any,
    *,
    query_len: int,
    splits: int,
    sm_scale: float,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
) -> tuple[Any, Any]:
    """The fused verify kernel on NaN-poisoned outputs: (o, lse)."""
    import torch

    rows, heads = q.shape[0], q.shape[1]
    o = torch.full((rows, heads, 512), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((rows, heads), float("nan"), device=q.device)
    workspace = torch.empty(ops.workspace_numel(rows, heads, splits), device=q.device)
    ops.fused_mla_verify_decode(
        q,
        cache,
        table,
        seq,
        o,
        lse,
        workspace,
        query_len=query_len,
        sm_scale=sm_scale,
        num_kv_splits=splits,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        cp_interleave=interleave,
    )
    return o, lse


def check_dcp_merge(rank: int, n: int, device: Any) -> dict[str, Any]:
    import torch
    import triton

    interpreted = _cpu_interpreted()
    if device.type == "cpu" and not interpreted:
        return {"status": "SKIP", "summary": "CPU without TRITON_INTERPRET=1"}
    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if interpreted and version < (3, 8):
        return {
            "status": "SKIP",
            "summary": (
                f"triton {triton.__version__}'s interpreter cannot run the "
                "kernel (needs >= 3.8: loop bounds become int(ndarray))"
            ),
        }
    ops = load_by_path(FUSED_VERIFY_PATH, "_k3_fused_mla_verify_mr")
    if interpreted:
        dtype = torch.float16  # the interpreter (numpy) has no bf16 arithmetic
        query_len, heads, page, splits = 2, 2, 16, 2
        seq_lens = [0, 1, 37, 70]
        interleaves = [4]
    else:
        dtype = torch.bfloat16
        query_len, heads, page, splits = 4, 16, 64, 4
        seq_lens = [1, 5, 333, 9000]
        interleaves = [1, 16]
    sm_scale = 192**-0.5
    cases = []
    failures = []
    for interleave in interleaves:
        gen = torch.Generator().manual_seed(7 + interleave)  # same on every rank
        stored = [torch.randn(m, 576, generator=gen).to(dtype) for m in seq_lens]
        rows = len(seq_lens) * query_len
        q = torch.randn(rows, heads, 576, generator=gen).to(dtype).to(device)
        seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)

        def run(cache: Any, table: Any, dcp_size: int, dcp_rank: int) -> Any:
            return _run_fused(
                ops,
                q,  # noqa: B023  (called within this iteration only)
                cache,
                table,
                seq,  # noqa: B023
                query_len=query_len,
                splits=splits,
                sm_scale=sm_scale,
                dcp_size=dcp_size,
                dcp_rank=dcp_rank,
                interleave=interleave,  # noqa: B023
            )

        local = [
            kv[((torch.arange(len(kv)) // interleave) % n) == rank] for kv in stored
        ]
        for m, kv in zip(seq_lens, local):
            assert len(kv) == ops.local_kv_len(m, n, rank, interleave)
        cache, table = _paged(local, page, gen, device)
        o_r, lse_r = run(cache, table, n, rank)
        merged_o, merged_lse = lse_merge(o_r, lse_r)
        identical, _ = _all_equal_to_rank0(
            torch.cat([merged_o.flatten(), merged_lse.flatten()])
        )
        case: dict[str, Any] = {
            "dcp_size": n,
            "interleave": interleave,
            "merged_identical_on_all_ranks": identical,
        }
        if not identical:
            failures.append(f"I={interleave}: the merged result differs across ranks")
        if rank == 0:
            full_cache, full_table = _paged(
                stored, page, torch.Generator().manual_seed(99), device
            )
            single_o, single_lse = run(full_cache, full_table, 1, 0)
            ref_o, ref_lse = _reference_mla(q.cpu(), stored, query_len, sm_scale)
            case["merged_vs_single"] = _compare(
                merged_o, merged_lse, single_o, single_lse
            )
            case["merged_vs_float64"] = _compare(merged_o, merged_lse, ref_o, ref_lse)
            case["single_vs_float64"] = _compare(single_o, single_lse, ref_o, ref_lse)
            for key in ("merged_vs_single", "merged_vs_float64", "single_vs_float64"):
                if not case[key]["ok"]:
                    failures.append(f"I={interleave} {key}: {case[key]}")
        cases.append(case)
    if device.type == "cuda":
        shapes = [(len(seq_lens) * query_len, heads), (32 * 4, 16), (32 * 4, 96)]
        iters, warmup = 50, 5
    else:
        shapes = [(len(seq_lens) * query_len, heads), (8 * 4, 16)]
        iters, warmup = 5, 1
    costs = [_time_merge(r, h, device, iters, warmup) for r, h in shapes]
    status = "FAIL" if failures else "PASS"
    worst = {
        key: max(c.get("merged_vs_single", {}).get(key, 0.0) for c in cases)
        for key in ("o_norm_err", "o_row_err", "lse_err")
    }
    cost_text = ", ".join(
        f"{c['rows']}x{c['heads']}: {c['median_ms_rank0']} ms" for c in costs
    )
    summary = (
        f"D={n} I={interleaves} {str(dtype).replace('torch.', '')} "
        f"{'interpreted' if interpreted else 'GPU'}: merged == single-rank "
        f"(worst o_norm {worst['o_norm_err']:.1e}, o_row {worst['o_row_err']:.1e},"
        f" lse {worst['lse_err']:.1e}; tol {O_NORM_TOL}/{O_ROW_TOL}/{LSE_TOL}); "
        f"merge cost (rows x heads: median) {cost_text}"
    )
    return {
        "status": status,
        "summary": summary if not failures else "; ".join(failures)[:500],
        "dtype": str(dtype),
        "query_len": query_len,
        "heads": heads,
        "seq_lens": seq_lens,
        "page_size": page,
        "num_kv_splits": splits,
        "tolerances": {"o_norm": O_NORM_TOL, "o_row": O_ROW_TOL, "lse": LSE_TOL},
        "cases": cases,
        "merge_cost": costs,
    }


# ------------------------------------------------ 3: replicated draft KV

DRAFT_SEQ, DRAFT_ROWS, DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_DIM = 103, 4, 4, 2, 16
PAD = -1


def _attend(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """Non-causal GQA attention (the DFlash query block over the context):
    output [rows, H, d] and LSE [rows, H]."""
    import torch

    group = DRAFT_HEADS // DRAFT_KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DRAFT_DIM**-0.5
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(0, 1).contiguous()


def _rank_draft_attention(
    kernels: types.ModuleType,
    sharded: bool,
    rank: int,
    n: int,
    q: Any,
    k: Any,
    v: Any,
) -> tuple[Any, Any]:
    """K/V written at the slot-mapping kernel's slots on ``rank`` (PAD: another
    rank owns the token), read back in rank-local order, attended."""
    import torch

    device = q.device
    block_size = 16 if sharded else 32
    cp_size = n if sharded else 1
    num_blocks = -(-DRAFT_SEQ // (block_size * cp_size))
    block_ids = [(7 * i + 3 * rank) % 64 + 64 * rank for i in range(num_blocks)]
    table = torch.tensor([block_ids], dtype=torch.int32, device=device)
    slots = torch.full((1, DRAFT_SEQ), 12345, dtype=torch.int64, device=device)
    kernels.compute_slot_mappings(
        slots,
        torch.tensor([0], dtype=torch.int32, device=device),
        torch.tensor([0, DRAFT_SEQ], dtype=torch.int32, device=device),
        torch.arange(DRAFT_SEQ, dtype=torch.int64, device=device),
        torch.tensor([table.data_ptr()], dtype=torch.uint64, device=device),
        torch.tensor([table.stride(0)], dtype=torch.int64, device=device),
        torch.tensor([block_size], dtype=torch.int32, device=device),
        torch.tensor([True], device=device),
        torch.tensor([sharded], device=device),
        rank,
        n,
        1,
        PAD,
    )
    slot = slots[0]
    owned = slot != PAD
    k_cache = torch.full(
        (512 * block_size, DRAFT_KV_HEADS, DRAFT_DIM), float("nan"), device=device
    )
    v_cache = k_cache.clone()
    k_cache[slot[owned]] = k[owned]
    v_cache[slot[owned]] = v[owned]
    local = torch.arange(int(owned.sum()), device=device)
    read = table[0].long()[local // block_size] * block_size + local % block_size
    return _attend(q, k_cache[read], v_cache[read])


def check_replicated_draft(rank: int, n: int, device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if device.type == "cpu" and not _cpu_interpreted():
        return {"status": "SKIP", "summary": "CPU without TRITON_INTERPRET=1"}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    kernels = load_by_path(BLOCK_TABLE_PATH, "_k3_dcp_block_table_mr")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(DRAFT_ROWS, DRAFT_HEADS, DRAFT_DIM, generator=gen).to(device)
    k = torch.randn(DRAFT_SEQ, DRAFT_KV_HEADS, DRAFT_DIM, generator=gen).to(device)
    v = torch.randn(DRAFT_SEQ, DRAFT_KV_HEADS, DRAFT_DIM, generator=gen).to(device)
    rep_o, rep_lse = _rank_draft_attention(kernels, False, rank, n, q, k, v)
    identical, per_rank = _all_equal_to_rank0(
        torch.cat([rep_o.flatten(), rep_lse.flatten()])
    )
    shard_o, shard_lse = _rank_draft_attention(kernels, True, rank, n, q, k, v)
    # NCCL gathers contiguous tensors only.
    shard_o, shard_lse = shard_o.contiguous(), shard_lse.contiguous()
    # Sharded partials merged by LSE (what the target does, the draft does not).
    lses = [torch.empty_like(shard_lse) for _ in range(dist.get_world_size())]
    outs = [torch.empty_like(shard_o) for _ in range(dist.get_world_size())]
    dist.all_gather(lses, shard_lse)
    dist.all_gather(outs, shard_o)
    weights = torch.softmax(torch.stack(lses), dim=0).unsqueeze(-1)
    merged = (torch.stack(outs) * weights).sum(dim=0)
    dcp1_o, dcp1_lse = _attend(q, k, v)
    equal_dcp1 = bool(torch.equal(rep_o, dcp1_o) and torch.equal(rep_lse, dcp1_lse))
    shard_diff = float((shard_o - dcp1_o).abs().max())
    merge_err = float((merged - dcp1_o).abs().max())
    flags = torch.tensor(
        [int(equal_dcp1), int(n == 1 or shard_diff > 0.1)], device=device
    )
    gathered = [torch.empty_like(flags) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flags)
    all_equal_dcp1 = all(bool(g[0]) for g in gathered)
    all_differ = all(bool(g[1]) for g in gathered)
    failures = []
    if not identical:
        failures.append(f"replicated outputs differ across ranks {per_rank}")
    if not all_equal_dcp1:
        failures.append("replicated output != DCP1 on some rank")
    if not all_differ:
        failures.append("sharded-without-merge did not differ from DCP1")
    if merge_err > DRAFT_MERGE_TOL:
        failures.append(f"sharded merged by LSE off DCP1 by {merge_err:.2e}")
    shard_text = (
        f"sharded without merge differs from DCP1 (max |diff| {shard_diff:.2f} "
        "on rank 0)"
        if n > 1
        else "sharded == replicated at D=1"
    )
    return {
        "status": "FAIL" if failures else "PASS",
        "summary": (
            f"replicated draft attention bit-identical on {n} rank(s) and == DCP1; "
            f"{shard_text}; sharded merged by LSE within {merge_err:.1e} "
            f"(tol {DRAFT_MERGE_TOL})"
            if not failures
            else "; ".join(failures)
        ),
        "replicated_identical_per_rank": per_rank,
        "replicated_equals_dcp1": all_equal_dcp1,
        "sharded_max_abs_diff_rank0": shard_diff,
        "sharded_merged_max_abs_err": merge_err,
        "shape": {
            "seq": DRAFT_SEQ,
            "query_rows": DRAFT_ROWS,
            "heads": DRAFT_HEADS,
            "kv_heads": DRAFT_KV_HEADS,
            "head_dim": DRAFT_DIM,
        },
    }


# ---------------------------------------------------------------------- main


def _python_path_env() -> dict[str, str]:
    """The environment of the server and the workers: ``overlay/`` put in front of
    PYTHONPATH when ``vllm.k3_draft`` is not importable otherwise."""
    env = dict(os.environ)
    env.update(NVLS_ENV)
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm.k3_draft.protocol"],
        env=env,
        capture_output=True,
    )
    if probe.returncode != 0:
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(OVERLAY) + (os.pathsep + path if path else "")
    return env


def run_world(n: int, server: Any, workdir: Path, timeout_s: float) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp
    from k3_layer1_server import free_tcp_port

    use_nccl = torch.cuda.is_available() and n <= torch.cuda.device_count()
    backend = "nccl" if use_nccl else "gloo"
    # Triton's interpreter must be on before triton is imported (CPU ranks).
    if use_nccl:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1"
    result_path = workdir / f"result-{n}.json"
    args = WorkerArgs(
        world_size=n,
        backend=backend,
        init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
        server_address=server.address,
        result_path=str(result_path),
        workdir=str(workdir),
    )
    started = time.monotonic()
    context = mp.start_processes(
        worker, args=(args,), nprocs=n, join=False, start_method="spawn"
    )
    error = None
    try:
        while not context.join(timeout=1):
            if time.monotonic() - started > timeout_s:
                error = f"timed out after {timeout_s:.0f} s"
                for proc in context.processes:
                    if proc.is_alive():
                        proc.kill()
                break
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[-1500:]}"
    wall = round(time.monotonic() - started, 2)
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        result = {"world_size": n, "backend": backend, "checks": {}}
    if error is not None:
        result["error"] = error
    result["wall_s"] = wall
    result["device"] = "cuda" if use_nccl else "cpu"
    return result


def _out_path(text: str) -> Path:
    """A JSON file to write after the run (its missing folders are made
    then): refused now if it is a folder or cannot be made there."""
    path = Path(text)
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write a file at {text!r}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--world-sizes", default="1,2", help="comma-separated N (default 1,2)"
    )
    parser.add_argument("--out", type=_out_path, help="write the JSON report here")
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds per world size"
    )
    opts = parser.parse_args(argv)
    if not 0 < opts.timeout < math.inf:
        parser.error(f"--timeout {opts.timeout}: give a positive number of seconds")
    try:
        sizes = [int(s) for s in opts.world_sizes.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        parser.error(f"--world-sizes {opts.world_sizes!r}: give sizes of at least 1")
    os.environ.update(NVLS_ENV)
    os.environ["PYTHONPATH"] = _python_path_env().get("PYTHONPATH", "")
    sys.path[:0] = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p]
    import torch

    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nvls_env": dict(NVLS_ENV),
        "python": sys.executable,
        "results": [],
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    ok = True
    with tempfile.TemporaryDirectory(prefix="k3-multi-rank-") as tmp:
        workdir = Path(tmp)
        # The layer-1 tests' server helpers; the server inherits this
        # environment.
        sys.path.insert(0, str(TOY_TARGET_DIR))
        from k3_layer1_server import DraftServerProcess, free_tcp_port

        server = DraftServerProcess(
            workdir / "server", address=f"tcp://127.0.0.1:{free_tcp_port()}"
        ).start()
        try:
            for n in sizes:
                result = run_world(n, server, workdir, opts.timeout)
                report["results"].append(result)
                checks = result.get("checks", {})
                for name in ("tp_broadcast", "dcp_merge", "replicated_draft"):
                    check = checks.get(name)
                    if check is None:
                        status, text = "FAIL", result.get("error", "did not run")
                    else:
                        status, text = check["status"], check.get("summary", "")
                    # A check that could not run here (SKIP) is not a pass.
                    ok &= status == "PASS"
                    log(f"N={n} {result['backend']:<5} {name:<16} {status}  {text}")
                if "error" in result:
                    ok = False
                    log(f"N={n} error: {result['error']}")
        finally:
            server.stop()
    report["passed"] = ok
    counts: dict[str, int] = {}
    for result in report["results"]:
        for check in result.get("checks", {}).values():
            counts[check["status"]] = counts.get(check["status"], 0) + 1
    log(
        f"summary: world sizes {sizes}: "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + (" -- all checks passed" if ok else " -- FAILED")
    )
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
