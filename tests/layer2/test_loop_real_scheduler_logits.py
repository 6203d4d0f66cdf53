# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Probabilistic remote drafting driven by vLLM's real v1 scheduler (CPU).

Layer 1's ``SchedulerLoop`` (``k3_sched_loop``: upstream's ``Scheduler`` or
``AsyncScheduler``, the v2 runner's host bookkeeping, a real draft server
process) with ``draft_sample_method="probabilistic"``: requests at
temperature > 0 (with and without their own seed) next to greedy ones, the
draft logits over the wire at full vocabulary or top-k
(``VLLM_K3_DRAFT_LOGITS_TOPK``), through chunked prefill, preemption and
resume, prefix-cache hits, stops and aborts. Upstream's Triton
``gumbel_sample`` is its CPU reference (``reference_gumbel``).

``LogitsRunner`` checks the structure that makes rejection sampling exact,
every step:

* after ``propose``: a step asks for the logits exactly when it drafts and
  has a request at temperature > 0; every PROPOSE reply's logits entry is
  recorded as the client receives it (decoded by the codec); each request
  with a draft was carried by a reply of this step, whose wire logits are the
  reference engine's for the request's exact committed context (to a bf16
  unit) and whose sample positions follow its anchor; and each draft token is
  upstream's Gumbel draw from that wire row on the standard draft stream
  (the request's temperature and seed, mixed with the slot, keyed by the
  position before the drafted token).
* at verification: for a request at temperature > 0, every draft slot the
  rejection step reads (up to the first -1) holds the token of the reply that
  drafted it, and the row the rejection sampler reads for it
  (``speculator.draft_logits[state, slot]``) is bit for bit that reply's wire
  row (top-k: scattered over ``FILL``). A slot without a draft is -1, so it is
  verified against no row.

The target is a point mass (``ToyTarget``), so exact rejection sampling emits
its token at any temperature: outputs equal target-only greedy decoding. The
distribution itself is ``test_exactness``'s subject.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from k3_l2_reference import gumbel_sample
from k3_sched_loop import BLOCK, MAX_NUM_SEQS, HostRunner, Spec, prompt_tokens
from toy_target import MAX_MODEL_LEN, VOCAB, WINDOW

from vllm.k3_draft.logits_codec import decode_logits
from vllm.k3_draft.protocol import MAX_REQUEST_ID_CHARS
from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
    FILL,
    RemoteDraftLogits,
)

pytest_plugins = ("conftest_client", "k3_sched_loop")

# The server's batched float32 logits and the oracle's differ in the last
# bits, which can move their bf16 rounding by one unit (relative 2**-8).
BF16_ULP = 2.0**-7
# And by about 1e-6 near zero, where a bf16 unit is smaller; logits of another
# context differ by tenths.
ATOL = 1e-4
TOPK = 16


class LogitsRunner(HostRunner):
    """``HostRunner`` with the checks of the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        (ext,) = [e for e in self.spec.extensions if isinstance(e, RemoteDraftLogits)]
        self.ext = ext
        # The runner binds its sampler's temperatures (bind_sampling_states).
        ext.bind_temperatures(self.temperature.numpy())
        self.cache = self.spec.draft_logits
        assert self.cache is ext.draft_logits
        self.replies: list[tuple[Any, torch.Tensor, np.ndarray]] = []
        consume = ext.consume

        def recording_consume(metadata: Any, frames: list[Any], proposal: Any) -> Any:
            self._record(metadata, frames, proposal)
            return consume(metadata, frames, proposal)

        ext.consume = recording_consume  # type: ignore[method-assign]
        # By request: the draft tokens and wire rows (bf16 [K, V]) the next
        # verification of a request at temperature > 0 must read.
        self.pending: dict[str, tuple[list[int], torch.Tensor]] = {}
        self._scratch = torch.empty_like(self.cache)
        self.counts = {
            "logits_steps": 0,
            "greedy_draft_steps": 0,
            "sampled_rows": 0,
            "off_argmax": 0,
            "verified_slots": 0,
            "verified_requests": 0,
            "past_model_length": 0,
            # Requests of a step with a reply that the reply did not carry.
            "not_in_reply": 0,
        }

    def _record(self, metadata: Any, frames: list[Any], proposal: Any) -> None:
        """A reply's logits as dense bf16 ``[R, K, V]`` rows (top-k over
        ``FILL``) and its sample positions."""
        fmt = self.ext.format
        frames = [bytes(memoryview(f)) for f in frames]
        decoded = decode_logits(
            metadata,
            frames,
            fmt,
            proposal.anchor_positions,
            proposal.num_speculative_tokens,
            self.ext.max_model_len,
        )
        values = torch.from_numpy(decoded.values.copy()).view(torch.bfloat16)
        if decoded.ids is None:
            dense = values
        else:
            dense = torch.full((*values.shape[:2], VOCAB), FILL, dtype=torch.bfloat16)
            dense.scatter_(2, torch.from_numpy(decoded.ids.astype(np.int64)), values)
        self.replies.append((proposal, dense, decoded.positions.copy()))

    def _add(self, new: Any) -> None:
        super()._add(new)
        self.pending.pop(new.req_id, None)

    def _remove(self, rid: str) -> None:
        super()._remove(rid)
        self.pending.pop(rid, None)

    def verifying(self, rid: str, idx: int, drafts: list[int]) -> None:
        if self.temperature[idx] == 0:
            return  # greedy verification reads no draft logits
        for j, token in enumerate(drafts):
            if token < 0:
                break  # verification stops at a slot without a draft
            assert rid in self.pending, f"{rid} verifies slot {j} no reply drafted"
            tokens, q = self.pending[rid]
            assert token == tokens[j], (rid, j, token, tokens)
            row = self.cache[idx, j]
            assert torch.equal(row.view(torch.int16), q[j].view(torch.int16)), (
                f"{rid}: the draft-logits row of slot {j} (state {idx}) is not "
                "the wire logits of the reply that drafted it"
            )
            self.counts["verified_slots"] += 1
        if drafts and drafts[0] >= 0:
            self.counts["verified_requests"] += 1

    def _check(
        self, req_ids: list[str], idx_np: np.ndarray, drafts: torch.Tensor, k: int
    ) -> None:
        replies, self.replies = self.replies, []
        for rid in req_ids:
            self.pending.pop(rid, None)
        sampling = bool((self.temperature[idx_np] != 0).any())
        if not (k and sampling):
            # No logits asked for: greedy drafts (the server's own tokens).
            assert not replies, "a step without sampling requests got logits"
            super()._check(req_ids, idx_np, drafts, k)
            if k and (drafts[:, :k] >= 0).any():
                self.counts["greedy_draft_steps"] += 1
            return
        self.counts["logits_steps"] += 1
        wire: dict[str, tuple[torch.Tensor, np.ndarray]] = {}
        for proposal, dense, positions in replies:
            assert proposal.num_speculative_tokens == k
            for r, rid in enumerate(proposal.request_ids):
                assert rid not in wire, f"{rid} in two replies of one step"
                wire[rid] = (dense[r], positions[r])
        for i, (rid, idx) in enumerate(zip(req_ids, idx_np)):
            row = drafts[i, :k]
            if rid not in wire:
                assert (row == -1).all(), f"{rid} has drafts {row} but no reply"
                self.counts["not_in_reply"] += int(bool(replies))
                continue
            q, positions = wire[rid]
            end = int(self.num_computed[idx])
            state = self.spec.plan.retained[rid]
            assert state.end == end and not state.stale, (rid, state, end)
            # Sample positions: the drafted tokens' positions after the anchor,
            # none past the model length.
            valid = positions >= 0
            slots = np.arange(k)
            assert (positions[valid] == end + 1 + slots[valid]).all(), (rid, end)
            assert (end + 1 + slots[~valid] >= MAX_MODEL_LEN).all(), (rid, end)
            self._check_wire(rid, idx, state.start, end, q, valid)
            # Upstream's draw from the wire row on the standard draft stream.
            temperature = float(self.temperature[idx])
            want = gumbel_sample(
                q,
                torch.full((k,), int(idx)),
                self.temperature,
                self.seeds,
                torch.from_numpy(positions - 1),
                apply_temperature=True,
                is_drafting=True,
                logits_cache=self._scratch,
                logits_cache_col=torch.arange(k, dtype=torch.int32),
            )
            want[~torch.from_numpy(valid)] = -1
            assert row.tolist() == want.tolist(), (rid, temperature, row, want)
            self.counts["past_model_length"] += int(not valid.all())
            if not valid.any():
                continue
            self.stats.drafted += 1
            if temperature:
                self.counts["sampled_rows"] += 1
                argmax = q.float().argmax(-1)
                self.counts["off_argmax"] += int((row[valid] != argmax[valid]).any())
                self.pending[rid] = (row.tolist(), q.clone())

    def _check_wire(
        self,
        rid: str,
        idx: int,
        start: int,
        end: int,
        q: torch.Tensor,
        valid: np.ndarray,
    ) -> None:
        """The wire rows of the ``valid`` slots are the reference engine's
        logits for the request's exact committed context and draft width
        (top-k: at the ids sent)."""
        first = max(start, end - WINDOW)
        tokens = self.table[idx, : end + 1].tolist()
        want = self.target.oracle.expected(
            self.target.rows(tokens, first, end), first, tokens[end], end, q.shape[0]
        )[valid]
        got = q[valid].float()
        sent = got != FILL
        assert int(sent.sum()) == (len(got) * (self.ext.format.topk or VOCAB))
        torch.testing.assert_close(
            got[sent], want[sent], rtol=BF16_ULP, atol=ATOL, msg=f"{rid} wire logits"
        )


TRANSPORT = pytest.mark.parametrize("topk", [0, TOPK], ids=["full", f"top{TOPK}"])
SCHEDULING = pytest.mark.parametrize(
    "async_scheduling", [False, True], ids=["sync", "async"]
)
# Low temperatures keep most draws on the draft's argmax (drafts get accepted,
# stops land inside accepted blocks); 1.0 draws far from it.
TEMPERATURES = (0.02, 0.1, 1.0)
# Dynamic speculative decoding: 3 drafts up to 2 requests, 2 up to 4, then 1.
DYNAMIC_K = [(1, 2, 3), (3, 4, 2), (5, MAX_NUM_SEQS, 1)]


@pytest.fixture
def make_logits_loop(make_loop, monkeypatch, reference_gumbel):
    def make(async_scheduling: bool, topk: int, **kwargs: Any) -> Any:
        monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", str(topk))

        def probabilistic(config: Any) -> None:
            config.speculative_config.draft_sample_method = "probabilistic"

        loop = make_loop(
            async_scheduling,
            runner_cls=LogitsRunner,
            configure=probabilistic,
            **kwargs,
        )
        assert loop.runner.ext.format.topk == topk
        return loop

    return make


def _check_counts(loop: Any) -> None:
    counts = loop.runner.counts
    stats = loop.runner.stats
    assert counts["logits_steps"] > 0 and counts["sampled_rows"] > 0
    assert counts["off_argmax"] > 0  # temperature reached the draws
    assert counts["verified_slots"] > 0
    assert stats.accepted > 0 and stats.rejected > 0


@SCHEDULING
@TRANSPORT
def test_mixed_temperatures_with_chunked_prefill_verify_the_wire_rows(
    make_logits_loop, async_scheduling, topk
):
    """Requests arrive every step, greedy ones first (all-greedy steps ask for
    no logits), then sampling ones with and without seeds, long prompts
    chunked by a small token budget, and one the protocol cannot carry (its
    batch row no reply covers): every verified slot reads the wire row of the
    reply that drafted it, no draft comes without a reply, and outputs equal
    target-only decoding."""
    loop = make_logits_loop(async_scheduling, topk)
    specs = {}
    for i in range(10):
        temperature = 0.0 if i < 2 or i % 4 == 3 else TEMPERATURES[i % 3]
        seed = None if i % 5 == 4 else 1000 + i
        prompt = prompt_tokens(i, 10 + 17 * (i % 5))
        specs[f"c{i}"] = Spec(prompt, 8 + 3 * i, temperature=temperature, seed=seed)
    # An id longer than the protocol carries: the request gets no draft, and
    # its batch row is one the step's reply does not cover.
    specs["x" * (MAX_REQUEST_ID_CHARS + 1)] = Spec(
        prompt_tokens(20, 30), 30, temperature=1.0, seed=5
    )
    pending = list(specs)

    def arrive(n: int) -> None:
        # The two greedy requests run alone for a few steps.
        if pending and (n < 2 or n >= 6):
            rid = pending.pop(0)
            loop.add(rid, specs[rid])

    loop.run(each=arrive)
    assert loop.finished.keys() == specs.keys()
    _check_counts(loop)
    assert loop.runner.counts["greedy_draft_steps"] > 0
    assert loop.runner.counts["not_in_reply"] > 0
    assert loop.runner.stats.chunks > 0


@SCHEDULING
@TRANSPORT
def test_preemption_prefix_hits_stops_and_aborts_verify_the_wire_rows(
    make_logits_loop, async_scheduling, topk
):
    """A KV cache too small for every running request (preemption, resume by
    recompute), a repeated prompt (prefix-cache hit padded with drafts),
    shared prefixes, a stop token and aborts, all sampling: every verified
    slot reads the wire row of the reply that drafted it, and outputs equal
    target-only decoding."""
    loop = make_logits_loop(async_scheduling, topk, num_blocks=24)
    target = loop.target
    shared = prompt_tokens(99, 40)
    specs: dict[str, Spec] = {
        "dup0": Spec(prompt_tokens(500, 2 * BLOCK + 1), 12, temperature=0.1, seed=7)
    }
    specs["dup1"] = Spec(specs["dup0"].prompt, 12, temperature=0.02, seed=8)
    for i in range(8):
        prompt = (
            shared + prompt_tokens(200 + i, 3 + 5 * i)
            if i % 2
            else prompt_tokens(300 + i, 30)
        )
        specs[f"p{i}"] = Spec(
            prompt, 20 + 4 * i, temperature=TEMPERATURES[i % 3], seed=i or None
        )
    stop_prompt = prompt_tokens(400, 25)
    ninth = target.generate(stop_prompt, 9)[-1]
    specs["stop"] = Spec(
        stop_prompt, 40, stop_token_ids=[ninth], temperature=0.02, seed=3
    )
    pending = list(specs)
    pending.remove("dup1")
    aborted: list[str] = []

    def drive(n: int) -> None:
        if n == 6:
            pending.insert(0, "dup1")
        if pending and n % 2 == 0:
            rid = pending.pop(0)
            loop.add(rid, specs[rid])
        if n == 21:
            aborted.extend(r for r in ("p5", "p6") if r not in loop.finished)
            loop.abort(aborted)

    loop.run(each=drive)
    assert loop.finished.keys() == specs.keys()
    assert aborted
    _check_counts(loop)
    stats = loop.runner.stats
    assert stats.preemptions > 0 and stats.prefix_hits > 0
    assert stats.padded_prefills > 0 and stats.cut_in_block > 0


@SCHEDULING
def test_random_schedule_verifies_the_wire_rows(make_logits_loop, async_scheduling):
    """Seeded random arrivals (shared prefixes, repeated prompts, random
    temperatures and seeds), stop tokens, aborts and finished ids taken by
    new requests over a KV cache that preempts, K chosen per step by batch
    size, top-k on the sync run and the full vocabulary on the async one."""
    rng = random.Random(5)
    loop = make_logits_loop(
        async_scheduling,
        0 if async_scheduling else TOPK,
        num_blocks=12,
        max_num_batched_tokens=48,
        k_per_batch_size=DYNAMIC_K,
    )
    target = loop.target
    prefixes = [prompt_tokens(650 + i, rng.randrange(8, 40)) for i in range(3)]
    added: list[str] = []
    count = 0

    def new_spec() -> Spec:
        prompt = rng.choice(prefixes) + prompt_tokens(
            rng.randrange(10**6), rng.randrange(0, 20)
        )
        stops = []
        if rng.random() < 0.3:
            stops = [target.generate(prompt, rng.randrange(1, 12))[-1]]
        temperature = rng.choice((0.0, *TEMPERATURES))
        seed = rng.choice((None, rng.randrange(-(2**40), 2**40)))
        return Spec(prompt, rng.randrange(1, 40), stops, temperature, seed)

    def drive(n: int) -> None:
        nonlocal count
        # An idle engine always gets a request (else the run ends early).
        if count < 20 and (not loop.busy() or rng.random() < 0.8):
            done = loop.reusable()
            if done and rng.random() < 0.3:
                rid = rng.choice(sorted(done))
                loop.reuse(rid)
            else:
                rid = f"r{count}"
                added.append(rid)
            count += 1
            loop.add(rid, new_spec())
        running = [r for r in added if r not in loop.finished]
        if running and rng.random() < 0.05:
            loop.abort([rng.choice(running)])

    loop.run(each=drive)
    assert count == 20 and set(added) == loop.finished.keys()
    _check_counts(loop)
    stats = loop.runner.stats
    assert stats.preemptions > 0 and len(stats.k_used) == 3
    assert stats.short_verifies > 0


@SCHEDULING
def test_model_length_inside_a_draft_block_verifies_the_wire_rows(
    make_logits_loop, async_scheduling
):
    """Sampling requests that reach the model length (no sample position past
    it: those slots keep no draft) next to a short one, top-k on the sync
    run and the full vocabulary on the async one."""
    loop = make_logits_loop(
        async_scheduling, 0 if async_scheduling else TOPK, max_num_batched_tokens=1024
    )
    specs = {
        f"m{i}": Spec(
            prompt_tokens(700 + i, MAX_MODEL_LEN - 9 - 2 * i),
            40,
            temperature=TEMPERATURES[i],
            seed=i,
        )
        for i in range(3)
    }
    specs["short"] = Spec(prompt_tokens(710, 20), 30, temperature=0.1)
    for rid, spec in specs.items():
        loop.add(rid, spec)
    loop.run()
    assert loop.finished.keys() == specs.keys()
    for i in range(3):
        assert len(loop.finished[f"m{i}"]) == 9 + 2 * i
    _check_counts(loop)
    assert loop.runner.counts["past_model_length"] > 0
