# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer 1's real-scheduler harness (``k3_sched_loop``) with probabilistic
remote drafting: ``LogitsRunner`` and the ``make_logits_loop`` fixture, used
by ``test_loop_real_scheduler_logits`` (whose docstring says what the runner
checks) and by layer 3's deferred loop, which name this module in
``pytest_plugins``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from k3_l2_reference import gumbel_sample
from k3_sched_loop import HostRunner
from toy_target import MAX_MODEL_LEN, VOCAB, WINDOW

from vllm.k3_draft.logits_codec import decode_logits
from vllm.v1.worker.gpu.spec_decode.dspark import remote_draft_logits
from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
    FILL,
    RemoteDraftLogits,
)

# The server's batched float32 logits and the oracle's differ in the last
# bits, which can move their bf16 rounding by one unit (relative 2**-8).
BF16_ULP = 2.0**-7
# And by about 1e-6 near zero, where a bf16 unit is smaller; logits of another
# context differ by tenths.
ATOL = 1e-4


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


@pytest.fixture
def make_logits_loop(make_loop, monkeypatch):
    """``make(async_scheduling, topk, ...)``: ``make_loop`` with
    ``draft_sample_method="probabilistic"``, ``VLLM_K3_DRAFT_LOGITS_TOPK=topk``
    and a ``LogitsRunner`` (or ``runner_cls``); upstream's Triton
    ``gumbel_sample`` is its CPU reference (this host has no Triton backend)."""
    monkeypatch.setattr(remote_draft_logits, "gumbel_sample", gumbel_sample)

    def make(
        async_scheduling: bool,
        topk: int,
        runner_cls: type[LogitsRunner] = LogitsRunner,
        **kwargs: Any,
    ) -> Any:
        monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", str(topk))

        def probabilistic(config: Any) -> None:
            config.speculative_config.draft_sample_method = "probabilistic"

        loop = make_loop(
            async_scheduling,
            runner_cls=runner_cls,
            configure=probabilistic,
            **kwargs,
        )
        assert loop.runner.ext.format.topk == topk
        return loop

    return make
