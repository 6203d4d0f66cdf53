# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The verifier half: ``RemoteDraftLogits`` inside the real
``RemoteK3DSparkSpeculator`` (real VllmConfig and InputBatch) against a real
draft server process, its fail-closed path against a scripted server, the
TP broadcast between ranks, and ``VLLM_K3_DRAFT_LOGITS_TOPK``.

Upstream's Triton ``gumbel_sample`` is replaced by its CPU reference
(``reference_gumbel``); these tests check what the extension feeds it.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from k3_l2_publish import publish_context, reply_for
from k3_l2_reference import gumbel_sample
from toy_target import (
    HIDDEN,
    MAX_MODEL_LEN,
    NUM_AUX,
    WIDTH,
    DraftOracle,
    make_input_batch,
)
from tp_replay import RecordingRank0, ReplayingRank1

from vllm import envs
from vllm.k3_draft import protocol
from vllm.k3_draft.client import IncompatibleServerError
from vllm.k3_draft.logits_codec import (
    CAPABILITY_FULL,
    CAPABILITY_TOPK,
    LogitsFormat,
    encode_logits,
    sample_positions,
)
from vllm.k3_draft.plan import Proposal
from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
    FILL,
    RemoteDraftLogits,
    bind_sampling_states,
)

pytest_plugins = ("conftest_client",)

K = 3
VOCAB = 1024
ROWS = (3, 5)  # request-state rows of the requests "a" and "b"
# The server's batched float32 logits and the oracle's differ in the last
# bits, which can move their bf16 rounding by one unit (relative 2**-8).
BF16_ULP = 2.0**-7


@pytest.fixture
def probabilistic(vllm_config_factory, monkeypatch) -> Any:
    """The toy VllmConfig with draft_sample_method='probabilistic'."""
    monkeypatch.delenv("VLLM_K3_DRAFT_LOGITS_TOPK", raising=False)
    config = copy.copy(vllm_config_factory())
    config.speculative_config = copy.copy(config.speculative_config)
    config.speculative_config.draft_sample_method = "probabilistic"
    return config


def _step(
    speculator: Any,
    starts: tuple[int, int] = (10, 20),
    temperature: tuple[float, float] = (0.0, 0.8),
    seeds: tuple[int, int] = (11, -(2**40)),
    **kwargs: Any,
) -> torch.Tensor:
    """One step of two decoding requests (table rows ``ROWS``) scheduled from
    ``starts`` with K + 1 tokens each, of which 2 and 1 are valid context:
    their anchors are at ``starts[0] + 2`` and ``starts[1] + 1``."""
    n, per = 2, K + 1
    input_batch = make_input_batch(
        ["a", "b"],
        np.array(ROWS),
        np.array([0, per, 2 * per], dtype=np.int32),
        torch.cat([torch.arange(s, s + per) for s in starts]),
        n * per,
    )
    aux = [torch.zeros(n * per, HIDDEN) for _ in range(NUM_AUX)]
    temp = torch.zeros(8)
    temp[list(ROWS)] = torch.tensor(temperature)
    seed = torch.zeros(8, dtype=torch.int64)
    seed[list(ROWS)] = torch.tensor(seeds)
    return speculator.propose(
        input_batch,
        {},
        {},
        aux[0],
        aux,
        torch.tensor([2, 1], dtype=torch.int32),
        torch.tensor([2, 3], dtype=torch.int32),
        torch.zeros(8, 1, dtype=torch.int64),
        torch.zeros(1, 8, dtype=torch.int32),
        temp,
        seed,
        **kwargs,
    ).clone()


@pytest.fixture(scope="module")
def oracle_logits() -> torch.Tensor:
    """The reference draft's logits ``[2, K, V]`` for ``_step``'s requests."""
    oracle = DraftOracle()
    rows = torch.zeros(2, WIDTH, dtype=torch.bfloat16)
    return torch.stack(
        [
            oracle.expected(rows[:2], 10, 0, 12, K),
            oracle.expected(rows[:1], 20, 0, 21, K),
        ]
    )


def _expected_drafts(
    cache: torch.Tensor, anchors, temperature, seeds, use_fp64: bool = False
) -> torch.Tensor:
    """What upstream's sampler draws from the cached rows of ``ROWS`` on the
    standard draft stream: seed mixed with the slot, keyed by anchor + j."""
    rows = cache[list(ROWS)].reshape(2 * K, -1)
    temp = torch.zeros(8)
    temp[list(ROWS)] = torch.tensor(temperature)
    seed = torch.zeros(8, dtype=torch.int64)
    seed[list(ROWS)] = torch.tensor(seeds)
    positions = torch.tensor([[a + j for j in range(K)] for a in anchors])
    return gumbel_sample(
        rows,
        torch.tensor(ROWS).repeat_interleave(K),
        temp,
        seed,
        positions.view(-1),
        apply_temperature=True,
        is_drafting=True,
        logits_cache=torch.empty_like(cache),
        logits_cache_col=torch.arange(K, dtype=torch.int32).repeat(2),
        use_fp64=use_fp64,
    ).view(2, K)


def _untouched(cache: torch.Tensor, rows) -> bool:
    return bool((cache[list(rows)] == FILL).all())


def test_greedy_config_keeps_layer_1_behaviour(
    make_speculator, vllm_config_factory, scripted_server
):
    speculator, _ = make_speculator(scripted_server.address, vllm_config_factory())
    assert speculator.draft_logits is None and speculator.extensions == []
    _step(speculator)
    propose = scripted_server.log[-1][1]
    assert "return_logits" not in propose and "logits_topk" not in propose


def test_a_malformed_topk_variable_fails_start_up_under_greedy_drafting_too(
    make_speculator, vllm_config_factory, scripted_server, monkeypatch
):
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", "abc")
    with pytest.raises(ValueError, match="VLLM_K3_DRAFT_LOGITS_TOPK"):
        make_speculator(scripted_server.address, vllm_config_factory())


def test_a_topk_without_probabilistic_drafting_is_warned_about(
    make_speculator, vllm_config_factory, scripted_server, monkeypatch, caplog
):
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", "8")
    with caplog.at_level(logging.WARNING):
        speculator, _ = make_speculator(scripted_server.address, vllm_config_factory())
    assert speculator.draft_logits is None
    assert any(
        "VLLM_K3_DRAFT_LOGITS_TOPK=8 has no effect with draft_sample_method='greedy'"
        in r.getMessage()
        for r in caplog.records
    )


def test_full_vocabulary_drafts_sample_the_wire_logits(
    make_speculator, probabilistic, reference_server, reference_gumbel, oracle_logits
):
    speculator, _ = make_speculator(reference_server.address, probabilistic)
    cache = speculator.draft_logits
    assert cache.shape == (8, K, VOCAB) and cache.dtype == torch.bfloat16
    assert _untouched(cache, range(8))
    # The toy draft's logits are nearly flat: at 0.8 its draws are those of
    # the untempered logits, at 0.5 they are not.
    temperature = (0.0, 0.5)
    drafts = _step(speculator, temperature=temperature)
    # The cache rows of both requests hold the server's bf16 logits.
    torch.testing.assert_close(
        cache[list(ROWS)].float(), oracle_logits, rtol=BF16_ULP, atol=1e-6
    )
    assert _untouched(cache, set(range(8)) - set(ROWS))
    # Greedy request: the argmax. Sampled request: upstream's draw on the
    # standard draft stream.
    assert torch.equal(drafts[0], cache[ROWS[0]].float().argmax(-1))
    expected = _expected_drafts(cache, (12, 21), temperature, (11, -(2**40)))
    assert torch.equal(drafts, expected)


def test_fp64_gumbel_config_draws_with_fp64_noise(
    make_speculator, probabilistic, reference_server, reference_gumbel
):
    config = copy.copy(probabilistic)
    config.model_config = copy.copy(config.model_config)
    config.model_config.use_fp64_gumbel = True
    speculator, _ = make_speculator(reference_server.address, config)
    temperature, seeds = (0.9, 0.9), (11, 12)
    drafts = _step(speculator, temperature=temperature, seeds=seeds)
    cache, anchors = speculator.draft_logits, (12, 21)
    fp64 = _expected_drafts(cache, anchors, temperature, seeds, use_fp64=True)
    # The fp64 and fp32 noise streams draw apart here.
    assert not torch.equal(fp64, _expected_drafts(cache, anchors, temperature, seeds))
    assert torch.equal(drafts, fp64)


def test_topk_drafts_are_zero_outside_the_slice(
    make_speculator,
    probabilistic,
    reference_server,
    reference_gumbel,
    oracle_logits,
    monkeypatch,
):
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", "8")
    speculator, _ = make_speculator(reference_server.address, probabilistic)
    seeds = (5, 6)
    drafts = _step(speculator, temperature=(1.3, 0.6), seeds=seeds)
    cache = speculator.draft_logits[list(ROWS)].float()
    kept = cache != FILL
    assert (kept.sum(-1) == 8).all()
    # The kept entries are the draft's top 8, at their bf16 values.
    oracle = oracle_logits
    kth = oracle.topk(8, -1).values[..., -1:].expand_as(oracle)
    assert (oracle[kept] >= kth[kept] * (1 - 2 * BF16_ULP)).all()
    torch.testing.assert_close(cache[kept], oracle[kept], rtol=BF16_ULP, atol=1e-6)
    assert kept.gather(-1, drafts[..., None]).all()
    expected = _expected_drafts(speculator.draft_logits, (12, 21), (1.3, 0.6), seeds)
    assert torch.equal(drafts, expected)


def test_slots_without_a_sample_position_keep_no_draft_and_their_row(
    make_speculator, probabilistic, reference_server, reference_gumbel
):
    speculator, _ = make_speculator(reference_server.address, probabilistic)
    cache = speculator.draft_logits
    # Request "a" ends two positions before the model length: only its first
    # slot has a sample position.
    end = MAX_MODEL_LEN - 4
    drafts = _step(speculator, starts=(end, 20), temperature=(0.9, 0.9))
    assert (drafts[0, 0] >= 0) and (drafts[0, 1:] == -1).all()
    assert (drafts[1] >= 0).all()
    assert (cache[ROWS[0], 1:] == FILL).all() and (cache[ROWS[0], 0] != FILL).any()


def test_slots_past_the_steps_draft_width_keep_no_draft_and_their_row(
    make_speculator, probabilistic, reference_server, reference_gumbel
):
    speculator, _ = make_speculator(reference_server.address, probabilistic)
    # A step of width 0 still asks the server for one slot (the protocol's
    # least K), whose logits and sample positions come back.
    drafts = _step(speculator, num_speculative_tokens=0)
    retained = speculator.plan.retained
    assert set(retained) == {"a", "b"}
    assert not any(state.stale for state in retained.values())
    assert (drafts == -1).all()
    assert _untouched(speculator.draft_logits, range(8))


# ------------------------------------------------------------ greedy steps


def _bind_temperatures(speculator: Any, temperature: tuple[float, float]) -> None:
    """The runner's hook: its host temperatures by request-state row."""
    host = np.zeros(8, dtype=np.float32)
    host[list(ROWS)] = temperature
    bind_sampling_states(
        speculator, SimpleNamespace(temperature=SimpleNamespace(np=host))
    )


def test_an_all_greedy_step_asks_for_no_logits_and_keeps_the_servers_drafts(
    make_speculator, probabilistic, scripted_server
):
    scripted_server.pong["capabilities"].append(CAPABILITY_FULL)
    speculator, _ = make_speculator(scripted_server.address, probabilistic)
    _bind_temperatures(speculator, (0.0, 0.0))
    drafts = _step(speculator, temperature=(0.0, 0.0))
    propose = scripted_server.log[-1][1]
    assert "return_logits" not in propose and "logits_topk" not in propose
    # The scripted server drafts 5 everywhere.
    assert (drafts == 5).all()
    assert _untouched(speculator.draft_logits, range(8))
    assert not any(state.stale for state in speculator.plan.retained.values())


@pytest.mark.parametrize("temperature", [(0.0, 0.8), (0.5, 0.5)])
def test_a_step_with_a_sampling_request_asks_for_the_logits(
    make_speculator, probabilistic, scripted_server, reference_gumbel, temperature
):
    scripted_server.pong["capabilities"].append(CAPABILITY_FULL)
    speculator, _ = make_speculator(scripted_server.address, probabilistic)
    _bind_temperatures(speculator, temperature)
    _step(speculator, temperature=temperature)
    assert scripted_server.log[-1][1]["return_logits"] is True


def test_a_sampling_step_that_drafts_no_tokens_asks_for_no_logits(
    make_speculator, probabilistic, scripted_server, reference_gumbel
):
    """A step that skips drafts (the scheduler's ``skip_drafts``: every
    request a non-final prefill chunk or at its last token) PROPOSEs only to
    keep the server in sync; rejection reads no draft logits after it."""
    scripted_server.pong["capabilities"].append(CAPABILITY_FULL)
    speculator, _ = make_speculator(scripted_server.address, probabilistic)
    _bind_temperatures(speculator, (0.5, 0.5))
    drafts = _step(speculator, temperature=(0.5, 0.5), num_speculative_tokens=0)
    propose = scripted_server.log[-1][1]
    assert "return_logits" not in propose and "logits_topk" not in propose
    assert (drafts == -1).all()
    assert _untouched(speculator.draft_logits, range(8))
    assert not any(state.stale for state in speculator.plan.retained.values())


def test_without_the_runners_temperatures_a_greedy_step_asks_for_the_logits(
    make_speculator, probabilistic, scripted_server, reference_gumbel
):
    scripted_server.pong["capabilities"].append(CAPABILITY_FULL)
    speculator, _ = make_speculator(scripted_server.address, probabilistic)
    _step(speculator, temperature=(0.0, 0.0))
    assert scripted_server.log[-1][1]["return_logits"] is True


# ------------------------------------------------------------- fail closed


def _scripted_propose(header: dict[str, Any], corrupt: str) -> list[bytes]:
    """A PROPOSE reply with logits of ``header``'s requests, then broken."""
    requests = header["requests"]
    k = header["num_speculative_tokens"]
    fmt = LogitsFormat(VOCAB, header.get("logits_topk", 0))
    anchors = [r["anchor_position"] for r in requests]
    logits = torch.randn(len(requests), k, VOCAB, generator=torch.Generator())
    meta, frame = encode_logits(
        logits, fmt, sample_positions(anchors, k, MAX_MODEL_LEN)
    )
    data = bytearray(protocol.tensor_frame(frame))
    if corrupt == "nan":
        data[0:2] = b"\xc0\x7f"
    elif corrupt == "huge":
        data[0:2] = b"\x80\x47"  # 2**16: overflows fp32 at small temperatures
    elif corrupt == "oov":
        data[meta["values_nbytes"] : meta["values_nbytes"] + 4] = (VOCAB).to_bytes(
            4, "little"
        )
    elif corrupt == "short":
        data = data[:-1]
    elif corrupt == "positions":
        meta["sample_positions"][0][0] += 1
    entries = [{**meta, "capability": fmt.capability, "num_frames": 1}]
    if corrupt == "missing":
        entries, data = [], bytearray()
    reply = protocol.ok_reply(
        protocol.OP_PROPOSE,
        server_id="scripted-1",
        tokens=logits.argmax(-1).tolist(),
        latency_ms=0.1,
        timing_ms=dict.fromkeys(protocol.TIMING_FIELDS, 0.0),
        extensions=entries,
    )
    return [protocol.encode_header(reply), *([bytes(data)] if data else [])]


@pytest.mark.parametrize(
    "corrupt, topk",
    [
        ("none", 0),
        ("nan", 0),
        ("huge", 0),
        ("short", 0),
        ("positions", 0),
        ("missing", 0),
        ("none", 16),
        ("oov", 16),
        ("nan", 16),
    ],
)
def test_a_malformed_logits_reply_fails_the_step_closed(
    make_speculator,
    probabilistic,
    scripted_server,
    reference_gumbel,
    monkeypatch,
    corrupt,
    topk,
):
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", str(topk))
    scripted_server.pong["capabilities"] += [CAPABILITY_FULL, CAPABILITY_TOPK]
    scripted_server.handlers[protocol.OP_PROPOSE] = lambda header, frames: (
        _scripted_propose(header, corrupt)
    )
    speculator, _ = make_speculator(scripted_server.address, probabilistic)
    drafts = _step(speculator, temperature=(0.7, 0.7))
    request = scripted_server.log[-1][1]
    assert request["return_logits"] is True
    assert request.get("logits_topk", 0) == topk
    if corrupt == "none":
        assert (drafts >= 0).all() and not _untouched(speculator.draft_logits, ROWS)
        return
    assert (drafts == -1).all()
    assert _untouched(speculator.draft_logits, range(8))
    assert all(speculator.plan.retained[rid].stale for rid in ("a", "b"))
    before = len(scripted_server.ops())
    _step(speculator, starts=(12, 21))
    assert scripted_server.ops()[before : before + 2] == ["PING", "FREE"]


def test_server_without_the_capability_is_refused_at_init(
    make_speculator, probabilistic, scripted_server
):
    scripted_server.pong["capabilities"].append(CAPABILITY_TOPK)
    with pytest.raises(IncompatibleServerError, match=CAPABILITY_FULL):
        make_speculator(scripted_server.address, probabilistic)


# ----------------------------------------------------- ranks and staging


@pytest.mark.parametrize("topk", [0, 5])
def test_every_rank_publishes_the_same_drafts_and_cache(reference_gumbel, topk):
    fmt = LogitsFormat(40, topk)
    proposal = Proposal(("x", "y"), np.array([2, 0]), np.array([9, 30]), K)
    rank0 = RecordingRank0()
    ext0 = RemoteDraftLogits(fmt, K, 8, 64, torch.device("cpu"), False, rank0)
    payload = ext0.consume(*reply_for(fmt, proposal, 1), proposal)
    drafts0 = torch.full((3, K), -1)
    ext0.publish(payload, publish_context(drafts0, [4, 1, 6]))
    rank1 = ReplayingRank1(rank0.sent)
    ext1 = RemoteDraftLogits(fmt, K, 8, 64, torch.device("cpu"), False, rank1)
    drafts1 = torch.full((3, K), -1)
    ext1.publish(None, publish_context(drafts1, [4, 1, 6]))
    assert rank1.sent == [] and len(rank0.sent) == (1 if topk else 2)
    assert torch.equal(drafts0, drafts1) and torch.equal(
        ext0.draft_logits, ext1.draft_logits
    )
    # Batch row 1 had no reply: no draft, its cache row (request 1) untouched.
    assert (drafts0[1] == -1).all() and (drafts0[[0, 2]] >= 0).all()
    assert _untouched(ext0.draft_logits, [0, 1, 2, 3, 5, 7])


@pytest.mark.parametrize("topk", [0, 5])
def test_with_structured_outputs_every_slot_drafts_its_likeliest_token_as_a_point_mass(
    one_rank, reference_gumbel, topk
):
    """Upstream resamples a draft the grammar refuses from the target's
    distribution, not from the residual: exact only when q is a point mass."""
    fmt = LogitsFormat(40, topk)
    proposal = Proposal(("x", "y"), np.array([0, 1]), np.array([9, 30]), K)
    extension = RemoteDraftLogits(fmt, K, 8, 64, torch.device("cpu"), False, one_rank)
    meta, frames = reply_for(fmt, proposal, 3)
    payload = extension.consume(meta, frames, proposal)
    drafts = torch.full((2, K), -1)
    extension.publish(payload, publish_context(drafts, [4, 1], structured=True))
    sent = torch.randn(2, K, 40, generator=torch.Generator().manual_seed(3))
    likeliest = sent.bfloat16().float().argmax(-1)
    assert torch.equal(drafts, likeliest)
    point_mass = torch.full((2, K, 40), FILL).scatter_(-1, likeliest[..., None], 0.0)
    assert torch.equal(extension.draft_logits[[4, 1]].float(), point_mass)


def test_two_consumed_replies_publish_their_own_logits(one_rank, reference_gumbel):
    """Two staging slots: a reply consumed while the previous one still awaits
    publish (deferred resolution) does not overwrite it."""
    fmt = LogitsFormat(40, 0)
    first = Proposal(("x",), np.array([0]), np.array([9]), K)
    second = Proposal(("x",), np.array([0]), np.array([10]), K)
    reference = RemoteDraftLogits(fmt, K, 8, 64, torch.device("cpu"), False, one_rank)
    deferred = RemoteDraftLogits(fmt, K, 8, 64, torch.device("cpu"), False, one_rank)
    expected = []
    for proposal, seed in ((first, 1), (second, 2)):
        drafts = torch.full((1, K), -1)
        reference.publish(
            reference.consume(*reply_for(fmt, proposal, seed), proposal),
            publish_context(drafts, [2]),
        )
        expected.append((drafts, reference.draft_logits.clone()))
    payloads = [
        deferred.consume(*reply_for(fmt, p, seed), p)
        for p, seed in ((first, 1), (second, 2))
    ]
    for payload, (drafts, cache) in zip(payloads, expected):
        got = torch.full((1, K), -1)
        deferred.publish(payload, publish_context(got, [2]))
        assert torch.equal(got, drafts) and torch.equal(deferred.draft_logits, cache)


def test_a_reused_staging_slot_keeps_no_rows_of_its_earlier_reply(
    one_rank, reference_gumbel
):
    """Two staging slots: the third step's reply reuses the first step's
    slot, and covers batch row 0 only (row 1 got no reply this step)."""
    fmt = LogitsFormat(40, 0)
    extension = RemoteDraftLogits(fmt, K, 8, 64, torch.device("cpu"), False, one_rank)
    both = Proposal(("x", "y"), np.array([0, 1]), np.array([9, 30]), K)
    only_x = Proposal(("x",), np.array([0]), np.array([12]), K)
    for proposal, seed in ((both, 1), (both, 2)):
        extension.publish(
            extension.consume(*reply_for(fmt, proposal, seed), proposal),
            publish_context(torch.full((2, K), -1), [4, 1]),
        )
    cache = extension.draft_logits.clone()
    drafts = torch.full((2, K), -1)
    extension.publish(
        extension.consume(*reply_for(fmt, only_x, 3), only_x),
        publish_context(drafts, [4, 1]),
    )
    assert (drafts[0] >= 0).all() and (drafts[1] == -1).all()
    assert torch.equal(extension.draft_logits[1], cache[1])


def test_a_second_topk_reply_leaves_only_its_own_top_k_in_the_cache(
    one_rank, reference_gumbel
):
    """Top-k replies for the same request on two steps: the cache row holds
    the second step's k entries, none of the first's."""
    fmt = LogitsFormat(40, 5)
    first = Proposal(("x",), np.array([0]), np.array([9]), K)
    second = Proposal(("x",), np.array([0]), np.array([10]), K)
    extension = RemoteDraftLogits(fmt, K, 8, 64, torch.device("cpu"), False, one_rank)
    only_second = RemoteDraftLogits(fmt, K, 8, 64, torch.device("cpu"), False, one_rank)
    for proposal, seed in ((first, 1), (second, 2)):
        extension.publish(
            extension.consume(*reply_for(fmt, proposal, seed), proposal),
            publish_context(torch.full((1, K), -1), [2]),
        )
    only_second.publish(
        only_second.consume(*reply_for(fmt, second, 2), second),
        publish_context(torch.full((1, K), -1), [2]),
    )
    assert ((extension.draft_logits[2] != FILL).sum(-1) == 5).all()
    assert torch.equal(extension.draft_logits, only_second.draft_logits)


# ------------------------------------------- staging slots chosen by number


def _two_slot_extension(one_rank: Any) -> RemoteDraftLogits:
    fmt = LogitsFormat(40, 0)
    return RemoteDraftLogits(fmt, K, 8, 64, torch.device("cpu"), False, one_rank)


def _single_proposal(anchor: int = 9) -> Proposal:
    return Proposal(("x",), np.array([0]), np.array([anchor]), K)


def test_extension_declares_itself_deferral_safe(one_rank):
    assert _two_slot_extension(one_rank).deferral_safe is True


def test_consume_fills_the_selected_staging_slot(one_rank):
    extension = _two_slot_extension(one_rank)
    proposal = _single_proposal()
    extension.select_staging(1)
    payload = extension.consume(*reply_for(extension.format, proposal, 1), proposal)
    assert payload is extension.staged_payload(1)
    assert payload is not extension.staged_payload(0)


def test_consumes_after_a_selection_go_on_round_robin(one_rank):
    extension = _two_slot_extension(one_rank)
    proposal = _single_proposal()
    reply = reply_for(extension.format, proposal, 1)
    extension.select_staging(3)  # taken modulo the two slots: slot 1
    got = [extension.consume(*reply, proposal) for _ in range(3)]
    want = [extension.staged_payload(i) for i in (1, 0, 1)]
    assert all(g is w for g, w in zip(got, want))


def test_staged_payload_taken_before_consume_publishes_the_reply(
    one_rank, reference_gumbel
):
    """``publish`` reads the slot when it runs: a payload taken while the
    reply is outstanding publishes what ``consume`` later filled in."""
    proposal = _single_proposal()
    reference = _two_slot_extension(one_rank)
    reply = reply_for(reference.format, proposal, 1)
    want = torch.full((1, K), -1)
    reference.publish(reference.consume(*reply, proposal), publish_context(want, [2]))
    deferred = _two_slot_extension(one_rank)
    deferred.select_staging(1)
    early = deferred.staged_payload(1)
    deferred.consume(*reply, proposal)
    got = torch.full((1, K), -1)
    deferred.publish(early, publish_context(got, [2]))
    assert (want >= 0).all()
    assert torch.equal(got, want)
    assert torch.equal(deferred.draft_logits, reference.draft_logits)


def test_a_cleared_slot_publishes_no_draft_and_keeps_the_cache(
    one_rank, reference_gumbel
):
    extension = _two_slot_extension(one_rank)
    first, second = _single_proposal(9), _single_proposal(10)
    drafts = torch.full((1, K), -1)
    extension.publish(
        extension.consume(*reply_for(extension.format, first, 1), first),
        publish_context(drafts, [2]),
    )
    cache = extension.draft_logits.clone()
    extension.select_staging(0)
    extension.consume(*reply_for(extension.format, second, 2), second)
    extension.clear_staging(0)
    got = torch.full((1, K), 7)
    extension.publish(extension.staged_payload(0), publish_context(got, [2]))
    assert (got == -1).all()
    assert torch.equal(extension.draft_logits, cache)


@pytest.mark.parametrize("topk", [0, 5])
def test_a_slot_no_reply_filled_publishes_no_draft_and_keeps_the_cache(
    one_rank, reference_gumbel, topk
):
    extension = RemoteDraftLogits(
        LogitsFormat(40, topk), K, 8, 64, torch.device("cpu"), False, one_rank
    )
    cache = extension.draft_logits.clone()
    got = torch.full((2, K), 7)
    extension.publish(extension.staged_payload(1), publish_context(got, [4, 5]))
    assert (got == -1).all()
    assert torch.equal(extension.draft_logits, cache)


class _ParkedCopy:
    """Stands in for a device copy's event and counts the host waits for it
    (for a copy parked behind a gate, a wait from the thread that alone
    releases the gate never returns)."""

    def __init__(self) -> None:
        self.waits = 0

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        self.waits += 1


def test_prepare_waits_for_the_copy_that_last_read_the_slot(one_rank):
    extension = _two_slot_extension(one_rank)
    copy = extension.staged_payload(1).copied = _ParkedCopy()
    extension.prepare_staging(3)  # modulo the two slots: slot 1
    assert copy.waits == 1


@pytest.mark.parametrize("fill", ["consume", "clear"])
def test_a_selected_slot_is_filled_without_waiting_for_its_published_copy(
    one_rank, fill
):
    """The reply thread fills or clears a slot whose copy ``publish`` already
    enqueued behind the gate that the reply thread alone releases."""
    extension = _two_slot_extension(one_rank)
    proposal = _single_proposal()
    extension.prepare_staging(1)
    extension.select_staging(1)
    parked = extension.staged_payload(1).copied = _ParkedCopy()
    if fill == "consume":
        extension.consume(*reply_for(extension.format, proposal, 1), proposal)
    else:
        extension.clear_staging(1)
    assert parked.waits == 0


def test_a_consume_without_selection_waits_for_the_slots_last_copy(one_rank):
    extension = _two_slot_extension(one_rank)
    proposal = _single_proposal()
    reply = reply_for(extension.format, proposal, 1)
    extension.select_staging(1)
    extension.consume(*reply, proposal)  # the selected fill
    copy = extension.staged_payload(0).copied = _ParkedCopy()
    extension.consume(*reply, proposal)  # round robin: slot 0, not selected
    assert copy.waits == 1


# ------------------------------------------------------------------ envs


def test_topk_variable(monkeypatch):
    monkeypatch.delenv("VLLM_K3_DRAFT_LOGITS_TOPK", raising=False)
    assert envs.VLLM_K3_DRAFT_LOGITS_TOPK == 0
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", "64")
    assert envs.VLLM_K3_DRAFT_LOGITS_TOPK == 64


@pytest.mark.parametrize(
    "value, match", [("abc", "not an integer"), ("-1", "at least 0")]
)
def test_malformed_topk_variable_names_it(monkeypatch, value, match):
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", value)
    with pytest.raises(ValueError, match=f"VLLM_K3_DRAFT_LOGITS_TOPK.*{match}"):
        _ = envs.VLLM_K3_DRAFT_LOGITS_TOPK


def test_topk_above_the_vocabulary_is_a_startup_error(
    make_speculator, probabilistic, scripted_server, monkeypatch
):
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", str(VOCAB + 1))
    with pytest.raises(ValueError, match="VLLM_K3_DRAFT_LOGITS_TOPK=1025 exceeds"):
        make_speculator(scripted_server.address, probabilistic)


def test_topk_equal_to_the_vocabulary_is_accepted_and_keeps_every_logit(
    make_speculator,
    probabilistic,
    reference_server,
    reference_gumbel,
    oracle_logits,
    monkeypatch,
):
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", str(VOCAB))
    speculator, _ = make_speculator(reference_server.address, probabilistic)
    (extension,) = speculator.extensions
    assert extension.capability == CAPABILITY_TOPK
    temperature = (0.9, 0.5)
    drafts = _step(speculator, temperature=temperature)
    cache = speculator.draft_logits
    torch.testing.assert_close(
        cache[list(ROWS)].float(), oracle_logits, rtol=BF16_ULP, atol=1e-6
    )
    expected = _expected_drafts(cache, (12, 21), temperature, (11, -(2**40)))
    assert torch.equal(drafts, expected)


def test_topk_variable_does_not_change_compile_factors(monkeypatch):
    monkeypatch.delenv("VLLM_K3_DRAFT_LOGITS_TOPK", raising=False)
    before = envs.compile_factors()
    monkeypatch.setenv("VLLM_K3_DRAFT_LOGITS_TOPK", "64")
    assert envs.compile_factors() == before
