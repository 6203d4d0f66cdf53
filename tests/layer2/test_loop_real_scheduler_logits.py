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
``gumbel_sample`` is its CPU reference (``k3_l2_reference``).

``LogitsRunner`` (``k3_l2_sched_loop``) checks the structure that makes
rejection sampling exact, every step:

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

import pytest
from k3_sched_loop import (
    BLOCK,
    MAX_NUM_SEQS,
    Spec,
    prompt_tokens,
    run_in_order,
    run_random_schedule,
    run_together,
)
from toy_target import MAX_MODEL_LEN

from vllm.k3_draft.protocol import MAX_REQUEST_ID_CHARS

pytest_plugins = ("conftest_client", "k3_sched_loop", "k3_l2_sched_loop")

TOPK = 16

TRANSPORT = pytest.mark.parametrize("topk", [0, TOPK], ids=["full", f"top{TOPK}"])
SCHEDULING = pytest.mark.parametrize(
    "async_scheduling", [False, True], ids=["sync", "async"]
)
# Low temperatures keep most draws on the draft's argmax (drafts get accepted,
# stops land inside accepted blocks); 1.0 draws far from it.
TEMPERATURES = (0.02, 0.1, 1.0)
# Dynamic speculative decoding: 3 drafts up to 2 requests, 2 up to 4, then 1.
DYNAMIC_K = [(1, 2, 3), (3, 4, 2), (5, MAX_NUM_SEQS, 1)]


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
    assert run_in_order(loop, specs, late="dup1", abort=("p5", "p6"))
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
    prefixes = [prompt_tokens(650 + i, rng.randrange(8, 40)) for i in range(3)]
    run_random_schedule(loop, rng, prefixes, (0.0, *TEMPERATURES))
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
    run_together(loop, specs)
    for i in range(3):
        assert len(loop.finished[f"m{i}"]) == 9 + 2 * i
    _check_counts(loop)
    assert loop.runner.counts["past_model_length"] > 0
