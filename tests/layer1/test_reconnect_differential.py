# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Randomized differential check of the draft server's request table.

Seeded random runs of PROPOSE (resets, rewinds as deep as the server allows,
batches of several requests), RECONNECT (random source, target and prefix
end, chains of them, a request into itself and then from it at a prefix about
a window shorter), FREE (with an id the server never saw, the freed id then
drafted from as a new request), RESET and CLEAR on the real server core and
reference engine. After every PROPOSE, each request's drafts must equal those
of a fresh server given only that request's history: its own rows since its
reset, or for a reconnected request its source's history up to
``prefix_end`` and then its own rows. What the server cannot draft that way it
must refuse, leaving its state as it was: a RECONNECT whose window-aligned
restore start the source's context cache does not cover (the rows it was
given or wrote, the last ``prefix_cache_tokens`` of them), a PROPOSE whose
anchor's window reaches before a restored start, and a PROPOSE of more new
requests than the table has free slots. After every step, the counters that
/v1/status and /metrics report must agree with the replies the server gave
and the histories the client holds.
"""

import dataclasses
import json
import random
from typing import Any

import pytest
import torch

from vllm.k3_draft import protocol
from vllm.k3_draft.engine import DraftLimits
from vllm.k3_draft.reference_engine import ReferenceEngine, ReferenceModelConfig
from vllm.k3_draft.server import DraftServer

WIDTH = 8
# A large vocabulary makes the argmax sensitive to one missing window row.
VOCAB = 512
IDS = [f"r{i}" for i in range(6)]


def make_server(limits: DraftLimits, method: str) -> DraftServer:
    model = ReferenceModelConfig(
        method=method,
        vocab_size=VOCAB,
        context_width=WIDTH,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        seed=1,
    )
    engine = ReferenceEngine(limits, model, torch.device("cpu"))
    engine.load()
    return DraftServer(engine)


@dataclasses.dataclass
class History:
    """What a client knows of a request: the origin of its rows, where the
    server's K/V starts (the reset position or ``restored_start``), its end,
    high-water mark, the first position the server's context cache was given
    or kept (``rows_start``) and rows by position."""

    origin: int
    start: int
    end: int
    high: int
    rows_start: int
    rows: dict[int, torch.Tensor] = dataclasses.field(repr=False)


# (request id, reset, first position, anchor position, anchor token)
Entry = tuple[str, bool, int, int, int]


def send_propose(
    server: DraftServer, k: int, entries: list[Entry], rows: list[torch.Tensor]
) -> dict[str, Any]:
    requests = [
        {
            "request_id": rid,
            "reset": reset,
            "reset_position": first if reset else 0,
            "context_count": anchor - first,
            "anchor_token_id": token,
            "anchor_position": anchor,
        }
        for rid, reset, first, anchor, token in entries
    ]
    header = protocol.request_header(
        "PROPOSE", num_speculative_tokens=k, requests=requests
    )
    frames: list[Any] = [protocol.encode_header(header)]
    runs = [(first, anchor) for _, _, first, anchor, _ in entries if anchor > first]
    if runs:
        positions = torch.cat([torch.arange(first, anchor) for first, anchor in runs])
        frames += [
            protocol.tensor_frame(positions),
            protocol.tensor_frame(torch.cat([r for r in rows if len(r)])),
        ]
    return json.loads(bytes(server.handle(frames)[0]))


def call(server: DraftServer, op: str, **fields: Any) -> dict[str, Any]:
    header = protocol.encode_header(protocol.request_header(op, **fields))
    return json.loads(bytes(server.handle([header])[0]))


def table(server: DraftServer) -> dict[str, tuple[int, ...]]:
    return {rid: dataclasses.astuple(s) for rid, s in server.requests.items()}


class Run:
    """One seeded run against a server with ``limits``; ``fresh`` is a
    one-request server that drafts from a window's rows alone."""

    def __init__(self, seed: int, limits: DraftLimits, method: str) -> None:
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.limits = limits
        self.server = make_server(limits, method)
        self.fresh = make_server(
            dataclasses.replace(limits, max_requests=1, max_batch_size=1), method
        )
        self.max_rewind = self.server.max_rewind
        self.known: dict[str, History] = {}
        self.follow: str | None = None
        # What the server's status must report, from its replies.
        self.requests_by_op: dict[str, int] = {}
        self.errors_by_op: dict[str, int] = {}
        self.proposed_requests = 0
        self.context_rows = 0
        self.counts = dict.fromkeys(
            (
                "compared",
                "rewinds",
                "reconnects",
                "uncovered",
                "covered_at_the_boundary",
                "window_refusals",
                "shorter_after_self",
                "full_table_refusals",
                "clears",
            ),
            0,
        )

    def fresh_tokens(
        self, history: History, anchor: int, token: int, k: int
    ) -> list[int]:
        """Drafts of a fresh server given the window's rows of ``history``."""
        first = max(history.origin, anchor - self.limits.window_size)
        rows = [history.rows[p] for p in range(first, anchor)]
        reply = send_propose(
            self.fresh,
            k,
            [("x", True, first, anchor, token)],
            [torch.stack(rows) if rows else torch.empty(0, WIDTH)],
        )
        assert reply["ok"], reply
        return reply["tokens"][0]

    def tally(self, op: str, reply: dict[str, Any]) -> None:
        """Count ``reply`` as the server's status must: under ``op``, and as
        an error unless it is ok."""
        self.requests_by_op[op] = self.requests_by_op.get(op, 0) + 1
        if not reply.get("ok"):
            self.errors_by_op[op] = self.errors_by_op.get(op, 0) + 1

    def check_status(self) -> None:
        """What /v1/status and /metrics report agrees with the replies
        counted so far and with the client's histories."""
        status = self.server.snapshot()
        errors = self.errors_by_op
        accepted = {op: n - errors.get(op, 0) for op, n in self.requests_by_op.items()}
        expected = {
            "requests_by_op": self.requests_by_op,
            "errors_by_op": errors,
            "proposals": accepted.get("PROPOSE", 0),
            "proposed_requests": self.proposed_requests,
            "context_rows": self.context_rows,
            "reconnects": accepted.get("RECONNECT", 0),
            "reconnect_failures": errors.get("RECONNECT", 0),
            "active_requests": len(self.known),
        }
        assert {key: status[key] for key in expected} == expected
        # One latency sample per accepted PROPOSE.
        assert status["latency_ms"]["count"] == expected["proposals"], status
        cached = sum(h.end - self.cached(h) for h in self.known.values())
        assert status["prefix_cache"]["cached_tokens"] == cached, status

    def reaches_before_restore(self, history: History, anchor: int) -> bool:
        restored = history.start > history.origin
        return restored and anchor - self.limits.window_size < history.start

    def propose(self) -> None:
        rng, limits = self.rng, self.limits
        ids = rng.sample(IDS, rng.randint(1, limits.max_batch_size))
        if self.follow is not None and self.follow not in ids:
            # Right after a RECONNECT: draft (often rewinding) from the target;
            # after a FREE: from the freed id as a new request.
            ids[0] = self.follow
        self.follow = None
        free = limits.max_requests - len(self.known)
        k = rng.randint(1, limits.max_speculative_tokens)
        budget = limits.max_context_tokens
        entries: list[Entry] = []
        for rid in ids:
            history = self.known.get(rid)
            longest = rng.choice(
                (
                    limits.max_speculative_tokens + 2,
                    limits.window_size + limits.block_size,
                    limits.window_size + limits.prefix_cache_tokens + 4,
                )
            )
            count = min(rng.randint(0, longest), budget)
            token = rng.randrange(VOCAB - 1)
            if history is None or rng.random() < 0.05:
                if history is None:
                    # Now and then a new request the table has no slot for.
                    if free <= 0 and rng.random() < 0.9:
                        continue
                    free -= 1
                first = rng.randint(0, 40)
                entry = (rid, True, first, first + count, token)
            elif count == 0 or rng.random() < 0.15:
                entry = (rid, False, history.end, history.end, token)
            else:
                lowest = max(history.start, history.high - self.max_rewind)
                first = (
                    lowest if rng.random() < 0.3 else rng.randint(lowest, history.end)
                )
                entry = (rid, False, first, first + count, token)
                # Mostly leave out what the server must refuse.
                refused = self.reaches_before_restore(history, first + count)
                if refused and rng.random() < 0.5:
                    continue
            entries.append(entry)
            budget -= entry[3] - entry[2]
        if not entries:
            return
        rows = [
            torch.randn(anchor - first, WIDTH, generator=self.generator).bfloat16()
            for _, _, first, anchor, _ in entries
        ]
        before = table(self.server)
        reply = send_propose(self.server, k, entries, rows)
        self.tally("PROPOSE", reply)
        refusals = {
            "window_refusals": any(
                not reset and self.reaches_before_restore(self.known[rid], anchor)
                for rid, reset, _, anchor, _ in entries
            ),
            "full_table_refusals": free < 0,
        }
        if any(refusals.values()):
            # Either refusal may be the one reported.
            error = reply.get("error", "")
            reasons = {
                "window_refusals": "before the restored start",
                "full_table_refusals": "free slots",
            }
            reported = [
                name
                for name, text in reasons.items()
                if refusals[name] and text in error
            ]
            assert reported, reply
            assert table(self.server) == before
            self.counts[reported[0]] += 1
            return
        assert reply["ok"], (reply, entries)
        self.proposed_requests += len(entries)
        self.context_rows += sum(anchor - first for _, _, first, anchor, _ in entries)
        for (rid, reset, first, anchor, token), new_rows, tokens in zip(
            entries, rows, reply["tokens"]
        ):
            if reset:
                history = History(first, first, first, first, first, {})
                self.known[rid] = history
            else:
                history = self.known[rid]
                self.counts["rewinds"] += first < history.end
            for position in [p for p in history.rows if p >= first]:
                del history.rows[position]
            history.rows.update(zip(range(first, anchor), new_rows))
            history.end = anchor
            history.high = max(history.high, anchor)
            expected = self.fresh_tokens(history, anchor, token, k)
            assert tokens == expected, (rid, first, anchor, history)
            self.counts["compared"] += 1

    def restore_start(self, source: History, prefix_end: int) -> int:
        """The spec's restore start: the window-aligned position before
        ``prefix_end``, or the origin of the source's history if later."""
        window_start = max(0, prefix_end - self.limits.window_size)
        block = self.limits.block_size
        return max(window_start // block * block, source.origin)

    def cached(self, history: History) -> int:
        """The first position the server's context cache holds for
        ``history``: rows given or kept from ``rows_start``, the last
        ``prefix_cache_tokens`` written."""
        return max(history.rows_start, history.high - self.limits.prefix_cache_tokens)

    def reconnect(
        self,
        source_id: str | None = None,
        target_id: str | None = None,
        prefix_end: int | None = None,
    ) -> bool:
        """One RECONNECT (random where not given); whether it was accepted."""
        rng, limits = self.rng, self.limits
        if source_id is None:
            source_id = rng.choice(sorted(self.known))
        source = self.known[source_id]
        if target_id is None:
            target_id = rng.choice(IDS)
        cached = self.cached(source)
        if prefix_end is None:
            boundary = [
                end
                for end in range(source.origin, source.end + 1)
                if self.restore_start(source, end) in (cached - 1, cached)
            ]
            x = rng.random()
            if x < 0.2 and boundary:
                # The restore starts at, or one before, the first cached row.
                prefix_end = rng.choice(boundary)
            elif x < 0.7:
                prefix_end = max(source.start, source.end - rng.randint(0, 3))
            else:
                prefix_end = rng.randint(source.origin, source.end)
        before = table(self.server)
        reply = call(
            self.server,
            "RECONNECT",
            source_request_id=source_id,
            request_id=target_id,
            prefix_end=prefix_end,
        )
        self.tally("RECONNECT", reply)
        if target_id not in self.known and len(self.known) == limits.max_requests:
            assert "no free slot" in reply.get("error", ""), reply
            assert table(self.server) == before
            return False
        # The source's context cache must hold all of the restore.
        start = self.restore_start(source, prefix_end)
        if start < cached:
            assert "is not covered" in reply.get("error", ""), reply
            assert table(self.server) == before
            self.counts["uncovered"] += 1
            return False
        assert reply["ok"] and reply["restored_start"] == start, reply
        self.counts["reconnects"] += 1
        self.counts["covered_at_the_boundary"] += start == cached > source.start
        self.known[target_id] = History(
            source.origin,
            start,
            prefix_end,
            prefix_end,
            # Into itself nothing is copied: the rows it held stay.
            cached if target_id == source_id else start,
            {p: row for p, row in source.rows.items() if p < prefix_end},
        )
        self.follow = target_id
        return True

    def reconnect_shorter_after_self(self) -> None:
        """A request resumes by a RECONNECT into itself, then another request
        reconnects from it at a prefix about a window shorter (its rows before
        the restored start serve it where its cache still holds them)."""
        rng, window, block = self.rng, self.limits.window_size, self.limits.block_size
        source_id = rng.choice(sorted(self.known))
        source = self.known[source_id]
        prefix_end = max(source.origin, source.end - rng.randint(0, 3))
        if not self.reconnect(source_id, source_id, prefix_end):
            return
        source = self.known[source_id]
        shorter = max(source.origin, prefix_end - rng.randint(1, window + block))
        # Before its restored start: what only its kept rows can serve.
        kept = self.restore_start(source, shorter) < source.start
        accepted = self.reconnect(source_id, rng.choice(IDS), shorter)
        self.counts["shorter_after_self"] += accepted and kept

    def free(self) -> None:
        """FREE a request, half the time with an id the server never saw
        (a no-op); then the freed id comes back as a new request."""
        rid = self.rng.choice(sorted(self.known))
        ids = [rid, "never-seen"] if self.rng.random() < 0.5 else [rid]
        reply = call(self.server, "FREE", request_ids=ids)
        self.tally("FREE", reply)
        assert reply["ok"] and reply["active_requests"] == len(self.known) - 1, reply
        del self.known[rid]
        if len(ids) > 1:
            self.follow = rid

    def reset(self) -> None:
        rid = self.rng.choice(sorted(self.known))
        reply = call(self.server, "RESET", request_ids=[rid])
        self.tally("RESET", reply)
        assert reply["ok"], reply
        self.known[rid] = History(0, 0, 0, 0, 0, {})

    def clear(self) -> None:
        reply = call(self.server, "CLEAR")
        self.tally("CLEAR", reply)
        assert reply["ok"] and reply["active_requests"] == 0, reply
        self.known.clear()
        self.counts["clears"] += 1

    def step(self) -> None:
        x = self.rng.random()
        if x < 0.6 or self.follow is not None or not self.known:
            self.propose()
        elif x < 0.75:
            self.reconnect()
        elif x < 0.85:
            self.reconnect_shorter_after_self()
        elif x < 0.93:
            self.free()
        elif x < 0.98:
            self.reset()
        else:
            self.clear()
        self.check_status()


@pytest.fixture
def one_thread():
    # The tensors are tiny: intra-op threads only contend (10x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CONFIGS = [
    # block, window, prefix cache, method: rewinds bounded by the block ...
    (4, 8, 16, "dflash"),
    (8, 16, 32, "dspark"),
    (2, 6, 12, "dspark"),
    # ... by the context cache (prefix_cache_tokens - window + 1) ...
    (8, 16, 19, "dflash"),
    # ... or to a single row.
    (1, 3, 6, "dflash"),
    (4, 8, 8, "dspark"),
]


@pytest.mark.parametrize(("block", "window", "cache", "method"), CONFIGS)
def test_every_draft_matches_a_fresh_server_given_the_request_history(
    block: int, window: int, cache: int, method: str, one_thread: None
):
    limits = DraftLimits(
        max_requests=4,
        max_batch_size=3,
        max_speculative_tokens=4,
        max_context_tokens=2 * window + cache,
        max_model_len=1 << 20,
        block_size=block,
        window_size=window,
        prefix_cache_tokens=cache,
    )
    run = Run(block * 1000 + window * 10 + cache, limits, method)
    for _ in range(600):
        run.step()
    assert min(run.counts["reconnects"], run.counts["rewinds"]) > 20, run.counts
    assert min(run.counts["full_table_refusals"], run.counts["clears"]) > 0, run.counts
    if cache >= 2 * window:
        # Room for rows before a restored start that a shorter restore needs.
        assert run.counts["shorter_after_self"] > 0, run.counts
