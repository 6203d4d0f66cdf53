# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draft logits over the wire: full vocabulary against top-k, one run.

Transport: a draft server process on loopback TCP (layer 1's server and
ZeroMQ transport around the synthetic ``TableEngine`` of
``tests/layer2/k3_l2_engines.py``, whose bf16 logits have the Kimi vocabulary,
V = 163,840) answers steady-state PROPOSEs of ``batch`` requests, K = 3, that
ask for the full-vocabulary logits or their top-k slices (k in 16, 64, 256),
or for none (``greedy``: a step whose requests are all greedy);
the cases are interleaved, request by request, each sending its header as
the verifier does (``encode_propose_request``; the round trip's clock starts
where ``plan.py``'s does) and each served from the table engine's kept
outputs of its batch. The logits live on
``--device`` (``cuda``: the top-k selection and the copy to the host run on the
GPU, as on a GPU draft server). The client is layer 2's: the reply is
validated and staged by ``RemoteDraftLogits.consume`` (``--no-consume`` where
vllm cannot be imported, e.g. a GPU box without it: round trips only). Reported per
case (p50 and p99 over the iterations, microseconds): the reply bytes (header
and frames), the PROPOSE round trip, the server's handling time
(``timing_ms.total``, which includes the engine and the encoding of the
logits: bf16 staging or the top-k selection, on the engine's device, here the
CPU), the engine's own time, the round trip minus the server's handling (the
transport), and the client's validation and staging (``consume``).

Every reply is also checked outside the round trip (``decode_logits``, no
vllm needed), and once per case its content against the table's logits: a
server that sent no top-k (or stale frames) fails the run instead of
timing it. ``--context-rows N --context-width W`` send, in every PROPOSE,
N context rows of W bf16 values per request with the anchors advancing by
N, as the verifier's decode steps do (N >= 1: each step sends its accepted
tokens' rows; Kimi DFlash W = 3 x 7168); the default, no rows, is a
PROPOSE no decode step sends.
``--curve`` runs the server and the client over CurveZMQ (fresh
certificates, the server's ZAP authenticator), as any bind beyond loopback
must: ZeroMQ then encrypts and decrypts every frame, the rows and the logits
included.

Acceptance: the acceptance rate a verifier loses by sampling drafts from the
top-k slice, computed exactly from synthetic draft distributions q (peaked
and flat) and target distributions p near them: per position
``sum_x min(p(x), q(x))`` against ``sum_x min(p(x), q_k(x))``, where ``q_k``
is q renormalised on its top k tokens.

Usage::

    python bench/bench_draft_logits.py --iters 200 --out logits.json [--curve]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cli_types import (
    device,
    int_at_most,
    non_negative_int,
    output_file,
    popen,
    positive_int,
    refusal,
    run,
    zmq_timeout_s,
)
from curve_certificates import CurveCertificates

from vllm.entrypoints.k3_dspark_rpc import MAX_BUSY_POLL_US
from vllm.k3_draft import protocol
from vllm.k3_draft.client import DraftClient, TransportError
from vllm.k3_draft.logits_codec import LogitsFormat, decode_logits
from vllm.k3_draft.plan import Proposal

TESTS = Path(__file__).resolve().parent.parent / "tests"
ENGINES = TESTS / "layer2"
sys.path.insert(0, str(TESTS / "layer1"))
from k3_layer1_server import free_tcp_port  # noqa: E402

VOCAB = 163_840
K = 3
TOPKS = (16, 64, 256)
BATCHES = (1, 8)
# The table server's max_model_len (k3_l2_engines.py's default).
MAX_MODEL_LEN = 1 << 20
ENGINE_TIMINGS = ("context", "query", "device_wait", "copy_back")


class _OneRank:
    rank_in_group, world_size = 0, 1

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor


def seeded_table() -> torch.Tensor:
    """The table's logits, the same draws every run: ``[max batch, K, V]``
    bf16."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(max(BATCHES), K, VOCAB, generator=generator).bfloat16()


def start_server(
    table: torch.Tensor,
    scratch: str,
    address: str,
    args: argparse.Namespace,
    curve: CurveCertificates | None = None,
    stamps: str | None = None,
) -> subprocess.Popen:
    """The table server of ``table`` (saved in the folder ``scratch``) on
    ``address``, for a run of ``add_run_arguments``' options ``args``, once
    it serves; with ``stamps``, it records where each request's time goes
    into that file when terminated (``k3_l2_engines.record_stamps``)."""
    table_path = os.path.join(scratch, "table.pt")
    torch.save(table, table_path)
    command = [
        sys.executable,
        str(ENGINES / "k3_l2_engines.py"),
        "--address",
        address,
        "--table",
        table_path,
        "--max-batch-size",
        str(max(BATCHES)),
        *("--device", args.device),
        *("--busy-poll-us", str(args.server_busy_poll_us)),
        *("--context-width", str(args.context_width)),
        *("--max-context-tokens", str(max(16, args.context_rows * max(BATCHES)))),
        *(curve.server_flags if curve else ()),
        *(("--stamps", stamps) if stamps else ()),
    ]
    # One engine thread: idle OpenMP workers would spin against the client.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryFile() as log:
        proc = popen(command, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        assert proc.stdout is not None
        # A way out of here leaves it to cli_types.run to stop.
        if proc.stdout.readline().strip() == "serving":
            # Its log from here on (none while it serves) is not kept.
            return proc
        proc.wait()
        raise SystemExit(f"the table server did not start: {refusal(proc, log)}")


class Case:
    """Steady-state PROPOSEs of ``batch`` requests asking for ``fmt`` (for no
    logits when ``topk`` is None)."""

    def __init__(
        self,
        client: DraftClient,
        batch: int,
        topk: int | None,
        consume: bool,
        context_rows: int = 0,
        context_width: int = 8,
        reference: torch.Tensor | None = None,
    ) -> None:
        self.client = client
        # The table's rows the batch drafts from (anchor tokens 0..batch-1):
        # what the reply must hold.
        self.reference = None if reference is None else reference[:batch]
        self.checked = False
        self.context_rows = context_rows
        self.batch = batch
        self.greedy = topk is None
        self.fmt = LogitsFormat(VOCAB, topk or 0)
        self.fields = {} if self.greedy else self.fmt.request_fields()
        self.name = f"b{batch} " + (
            "greedy" if topk is None else f"top-{topk}" if topk else "full"
        )
        self.extension = None
        if consume and not self.greedy:
            from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
                RemoteDraftLogits,
            )

            self.extension = RemoteDraftLogits(
                self.fmt, K, batch, 1 << 20, torch.device("cpu"), False, _OneRank()
            )
        self.ids = [f"{self.name}-{i}" for i in range(batch)]
        self.anchors = np.arange(batch, dtype=np.int64) + 100
        self.proposal = Proposal(tuple(self.ids), np.arange(batch), self.anchors, K)
        self.samples: dict[str, list[float]] = {
            key: []
            for key in ("rtt", "server", "engine", "consume", "validate", "bytes")
        }
        self.frames: list[Any] = []
        self._rows = torch.randn(batch * context_rows, context_width).bfloat16()
        self._propose(self._wire(reset=True))

    def _wire(self, reset: bool) -> list[tuple[str, bool, int, int, int, int]]:
        if self.context_rows:
            # The verifier's steady PROPOSE carries each request's newly
            # verified rows (plan.py): the anchors advance by them, and the
            # positions [anchor - n, anchor) travel with their rows.
            self.anchors = self.anchors + self.context_rows
            self.proposal = Proposal(
                tuple(self.ids), np.arange(self.batch), self.anchors, K
            )
            positions = np.concatenate(
                [np.arange(a - self.context_rows, a) for a in self.anchors]
            ).astype(np.int64)
            self.frames = [positions, self._rows.view(torch.uint8).numpy()]
        return [
            (
                rid,
                reset,
                int(anchor) - self.context_rows,
                self.context_rows,
                i,
                int(anchor),
            )
            for i, (rid, anchor) in enumerate(zip(self.ids, self.anchors))
        ]

    def _propose(
        self, wire: list[tuple[str, bool, int, int, int, int]]
    ) -> tuple[dict[str, Any], list[Any]]:
        """One PROPOSE as the verifier sends it (``plan.py``: the header
        formatted by ``encode_propose_request``)."""
        request = protocol.encode_propose_request(K, wire, self.fields)
        return self.client.call_encoded(protocol.OP_PROPOSE, request, self.frames)

    def run(self, record: bool) -> None:
        steady = self._wire(reset=False)
        start = time.perf_counter()
        header, frames = self._propose(steady)
        received = time.perf_counter()
        replies = protocol.extension_frames(header, frames)
        if self.greedy:
            if replies:
                raise RuntimeError(f"{self.name}: logits came unasked")
            if record:
                self._record(header, frames, received - start)
            return
        ((meta, logits_frames),) = replies.values()
        if self.extension is not None:
            self.extension.consume(meta, logits_frames, self.proposal)
        consumed = time.perf_counter()
        # The wire checks need no vllm: every reply is validated (outside the
        # round trip, as plan.py's), and once in the steady state its content
        # is compared with the table's logits, so that no case is timed on
        # a reply that is malformed or wrong.
        decoded = decode_logits(
            meta, logits_frames, self.fmt, self.anchors, K, MAX_MODEL_LEN
        )
        validated = time.perf_counter()
        if record and not self.checked and self.reference is not None:
            self._check(decoded)
            self.checked = True
        if not record:
            return
        self.samples["validate"].append(validated - consumed)
        if self.extension is not None:
            self.samples["consume"].append(consumed - received)
        self._record(header, frames, received - start)

    def _record(self, header: dict[str, Any], frames: list[Any], rtt: float) -> None:
        timing = header["timing_ms"]
        reply_bytes = len(protocol.encode_header(header)) + sum(
            len(memoryview(f)) for f in frames
        )
        for key, value in (
            ("rtt", rtt),
            ("server", timing["total"] / 1e3),
            ("engine", sum(timing[k] for k in ENGINE_TIMINGS) / 1e3),
            ("bytes", reply_bytes),
        ):
            self.samples[key].append(value)

    def _check(self, decoded: Any) -> None:
        ref = self.reference
        assert ref is not None
        bits = torch.from_numpy(decoded.values.copy())
        if decoded.ids is None:
            if not torch.equal(bits, ref.view(torch.int16)):
                raise RuntimeError(f"{self.name}: the reply is not the logits")
            return
        ids = torch.from_numpy(decoded.ids.copy()).long()
        values = bits.view(torch.bfloat16).float()
        wanted = ref.float().topk(self.fmt.topk, dim=-1).values
        if not (
            torch.equal(ref.gather(-1, ids).view(torch.int16), bits)
            and torch.equal(values.sort(-1).values, wanted.sort(-1).values)
        ):
            raise RuntimeError(f"{self.name}: the reply is not the top-k logits")

    def summary(self) -> dict[str, Any]:
        def us(values: list[float]) -> dict[str, float]:
            array = np.asarray(values) * 1e6
            return {
                "p50": float(np.percentile(array, 50)),
                "p99": float(np.percentile(array, 99)),
            }

        s = self.samples
        transport = [r - h for r, h in zip(s["rtt"], s["server"])]
        return {
            "case": self.name,
            "batch": self.batch,
            "topk": None if self.greedy else self.fmt.topk,
            "reply_bytes": int(np.median(s["bytes"])),
            "rtt_us": us(s["rtt"]),
            "server_us": us(s["server"]),
            "engine_us": us(s["engine"]),
            "transport_us": us(transport),
            "consume_us": us(s["consume"]) if s["consume"] else None,
            "validate_us": us(s["validate"]) if s["validate"] else None,
        }


def acceptance(seed: int = 0) -> list[dict[str, Any]]:
    """Exact per-position acceptance with the full q and with its top-k.

    Draft logits are N(0, scale^2) over the vocabulary (peaked: most mass on a
    few tokens; flat: spread over many); the target's logits are the draft's
    plus N(0, 1) noise.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for shape, scale in (("peaked", 5.0), ("moderate", 2.5), ("flat", 1.0)):
        draft = rng.normal(size=VOCAB) * scale
        target = draft + rng.normal(size=VOCAB)
        for temperature in (0.7, 1.0):
            q = np.exp((draft - draft.max()) / temperature)
            q /= q.sum()
            p = np.exp((target - target.max()) / temperature)
            p /= p.sum()
            full = float(np.minimum(p, q).sum())
            order = np.argsort(q)[::-1]
            for k in TOPKS:
                q_k = np.zeros_like(q)
                q_k[order[:k]] = q[order[:k]]
                mass = float(q_k.sum())
                q_k /= mass
                kept = float(np.minimum(p, q_k).sum())
                rows.append(
                    {
                        "distribution": shape,
                        "temperature": temperature,
                        "k": k,
                        "q_mass_in_topk": mass,
                        "acceptance_full": full,
                        "acceptance_topk": kept,
                        "lost": full - kept,
                    }
                )
    return rows


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a run against the table server, shared with
    ``bench_propose_legs.py``: iterations, the logits' device, the server's
    busy poll, the context rows every PROPOSE carries, the reply timeout."""
    parser.add_argument("--iters", type=positive_int, default=200)
    parser.add_argument("--warmup", type=non_negative_int, default=20)
    parser.add_argument(
        "--device", type=device, default="cpu", help="the draft logits' device"
    )
    parser.add_argument(
        "--server-busy-poll-us",
        type=int_at_most(MAX_BUSY_POLL_US),
        default=0,
        help="the server's busy poll after each reply (microseconds)",
    )
    parser.add_argument(
        "--context-rows",
        type=non_negative_int,
        default=0,
        help="context rows per request in each PROPOSE (the verifier's steady "
        "state sends its accepted tokens' rows: 1 to K + 1)",
    )
    parser.add_argument(
        "--context-width",
        type=positive_int,
        default=8,
        help="bf16 values per context row (Kimi DFlash: 3 x 7168 = 21504)",
    )
    parser.add_argument(
        "--reply-timeout-s",
        type=zmq_timeout_s,
        default=60.0,
        help="give up when the table server has not answered for this long "
        "(default: %(default)s)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument(
        "--no-consume",
        action="store_true",
        help="skip the client's staging (RemoteDraftLogits needs vllm)",
    )
    parser.add_argument(
        "--out", type=output_file, help="write the results as JSON here"
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help="over CurveZMQ, as any bind beyond loopback must be",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = seeded_table()
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    with tempfile.TemporaryDirectory() as scratch:
        curve = CurveCertificates(scratch) if args.curve else None
        server = start_server(table, scratch, address, args, curve)
    timeout_ms = round(args.reply_timeout_s * 1e3)
    client = DraftClient(address, timeout_ms, curve.client_keys if curve else None)
    try:
        cases = [
            Case(
                client,
                batch,
                topk,
                not args.no_consume,
                args.context_rows,
                args.context_width,
                table,
            )
            for batch in BATCHES
            for topk in (0, *TOPKS, None)
        ]
        for index in range(args.warmup + args.iters):
            for case in cases:
                case.run(record=index >= args.warmup)
    except TransportError as exc:
        status = server.poll()
        exited = "" if status is None else f"; the table server exited ({status})"
        raise SystemExit(f"{exc}{exited}") from None
    finally:
        client.close()
        server.terminate()
        server.wait()
    results = [case.summary() for case in cases]
    full = {r["batch"]: r for r in results if r["topk"] == 0}
    print(
        f"{'case':<14} {'reply B':>10} {'bytes x':>8} {'rtt p50/p99 us':>18} "
        f"{'rtt x':>6} {'server p50':>10} {'transport p50':>13} {'consume p50':>11}"
    )
    for r in results:
        base = full[r["batch"]]
        r["bytes_reduction"] = base["reply_bytes"] / r["reply_bytes"]
        r["rtt_speedup_p50"] = base["rtt_us"]["p50"] / r["rtt_us"]["p50"]
        r["transport_speedup_p50"] = (
            base["transport_us"]["p50"] / r["transport_us"]["p50"]
        )
        print(
            f"{r['case']:<14} {r['reply_bytes']:>10} {r['bytes_reduction']:>8.1f} "
            f"{r['rtt_us']['p50']:>8.0f}/{r['rtt_us']['p99']:<9.0f} "
            f"{r['rtt_speedup_p50']:>6.1f} {r['server_us']['p50']:>10.0f} "
            f"{r['transport_us']['p50']:>13.0f} "
            + (f"{r['consume_us']['p50']:>11.0f}" if r["consume_us"] else f"{'-':>11}")
        )
    loss = acceptance()
    print(
        f"\n{'q':<9} {'T':>4} {'k':>4} {'q mass':>7} {'acc full':>9} "
        f"{'acc top-k':>9} {'lost':>7}"
    )
    for row in loss:
        print(
            f"{row['distribution']:<9} {row['temperature']:>4} {row['k']:>4} "
            f"{row['q_mass_in_topk']:>7.4f} {row['acceptance_full']:>9.4f} "
            f"{row['acceptance_topk']:>9.4f} {row['lost']:>7.4f}"
        )
    if args.out:
        meta = {
            "cpus": os.cpu_count(),
            "device": args.device,
            "server_busy_poll_us": args.server_busy_poll_us,
            "curve": args.curve,
            "iters": args.iters,
            "vocab": VOCAB,
            "k": K,
        }
        with open(args.out, "w") as out:
            json.dump(
                {"meta": meta, "transport": results, "acceptance": loss}, out, indent=2
            )


if __name__ == "__main__":
    run(main)
