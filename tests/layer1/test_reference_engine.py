# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reference draft engine (CPU; the CUDA graph tests need a GPU)."""

import dataclasses

import pytest
import torch

from vllm.k3_draft.engine import (
    DraftLimits,
    MemoryPlan,
    ProposeBatch,
    graph_batch_sizes,
    padded_batch_size,
    plan_context,
)
from vllm.k3_draft.reference_engine import (
    ReferenceEngine,
    ReferenceModelConfig,
    TorchDraftEngine,
)

LIMITS = DraftLimits(
    max_requests=4,
    max_batch_size=4,
    max_speculative_tokens=4,
    max_context_tokens=512,
    max_model_len=4096,
    block_size=16,
    window_size=32,
    prefix_cache_tokens=64,
)
WIDTH = 48


def make_engine(
    seed=0, method="dflash", device="cpu", graphs=False, latent=False
) -> ReferenceEngine:
    model = ReferenceModelConfig(
        method=method, context_width=WIDTH, seed=seed, latent_attention=latent
    )
    engine = ReferenceEngine(LIMITS, model, torch.device(device), graphs)
    engine.load()
    engine.capture_cuda_graphs()
    return engine


def rows(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, WIDTH, generator=generator).bfloat16()


def batch(slots, starts, ends, counts, context, k=3, anchors=None) -> ProposeBatch:
    positions = torch.cat(
        [torch.arange(end - count, end) for end, count in zip(ends, counts)]
    )
    return ProposeBatch(
        num_speculative_tokens=k,
        slots=list(slots),
        starts=list(starts),
        ends=list(ends),
        anchor_token_ids=anchors or [5] * len(slots),
        counts=list(counts),
        positions=positions,
        rows=context,
        want_logits=True,
    )


def first(engine: ReferenceEngine, context: torch.Tensor, k: int = 3):
    n = context.shape[0]
    return engine.propose(batch([0], [0], [n], [n], context, k))


SHAPE = ReferenceModelConfig(context_width=WIDTH).shape()
# Grouped-query (Qwen3) or multi-head latent (MLA) attention.
ATTENTIONS = pytest.mark.parametrize("latent", [False, True], ids=["gqa", "mla"])


def test_query_heads_must_be_a_multiple_of_the_kv_heads():
    with pytest.raises(ValueError, match="multiple of kv heads"):
        dataclasses.replace(SHAPE, num_heads=6, num_kv_heads=4)


def test_a_mask_token_past_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dataclasses.replace(SHAPE, mask_token_id=SHAPE.vocab_size)


@pytest.mark.parametrize("size", [0, SHAPE.vocab_size])
def test_a_draft_vocabulary_that_is_not_a_proper_subset_is_refused(size):
    with pytest.raises(ValueError, match="must be positive and below vocab_size"):
        dataclasses.replace(SHAPE, draft_vocab_size=size)


def test_a_weight_of_2_to_the_63_elements_is_refused():
    # embed and lm_head: 2**32 x 2**31, one element beyond torch's count.
    with pytest.raises(ValueError, match=r"more than 2\*\*63 - 1 elements"):
        dataclasses.replace(SHAPE, vocab_size=2**32, hidden_size=2**31)


def test_cuda_graphs_on_a_cpu_engine_are_refused():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ReferenceEngine(LIMITS, ReferenceModelConfig(), torch.device("cpu"), True)


def test_same_seed_same_tokens():
    context = rows(20, 1)
    assert torch.equal(
        first(make_engine(0), context).tokens, first(make_engine(0), context).tokens
    )


def test_other_seed_other_logits():
    context = rows(20, 1)
    assert not torch.equal(
        first(make_engine(0), context).logits, first(make_engine(1), context).logits
    )


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_output_shapes_follow_k(method):
    output = first(make_engine(method=method), rows(10, 2), k=4)
    assert output.tokens.shape == (1, 4) and output.logits.shape == (1, 4, 1024)
    assert torch.equal(output.tokens, output.logits.argmax(-1))


def test_dspark_biases_each_draft_by_the_markov_row_of_the_token_before_it():
    # Raising the Markov row of the first drafted token changes the second
    # draft's logits only, not the first's (biased by the anchor's row).
    engine, context = make_engine(method="dspark"), rows(10, 2)
    before = first(engine, context, k=2)
    drafted = int(before.tokens[0, 0])
    assert drafted != 5  # not the anchor token
    engine.w["markov_w1"][drafted] += 1.0
    after = first(engine, context, k=2)
    assert torch.equal(after.logits[:, 0], before.logits[:, 0])
    assert not torch.equal(after.logits[:, 1], before.logits[:, 1])


@ATTENTIONS
def test_drafts_depend_on_relative_positions_only(latent):
    # RoPE on queries and context keys alike: the same rows 100 positions
    # later draft the same logits.
    context = rows(20, 2)
    at_0 = first(make_engine(latent=latent), context)
    later = make_engine(latent=latent).propose(batch([0], [100], [120], [20], context))
    torch.testing.assert_close(later.logits, at_0.logits, atol=1e-4, rtol=1e-4)


@ATTENTIONS
def test_context_outside_the_window_does_not_matter(latent):
    tail = rows(32, 3)
    old_a = torch.cat((rows(40, 4), tail))
    old_b = torch.cat((rows(40, 5), tail))
    a, b = (
        first(make_engine(latent=latent), old_a),
        first(make_engine(latent=latent), old_b),
    )
    assert torch.equal(a.logits, b.logits)


@ATTENTIONS
def test_context_inside_the_window_matters(latent):
    a = first(make_engine(latent=latent), torch.cat((rows(1, 6), rows(31, 3))))
    b = first(make_engine(latent=latent), torch.cat((rows(1, 7), rows(31, 3))))
    assert not torch.equal(a.logits, b.logits)


def assert_drafts_as_if_fresh_from_15(previous: torch.Tensor, latent: bool) -> None:
    """After ``previous`` filled positions [0, 20) of slot 0, a request valid
    from 15 drafts exactly as on a fresh engine."""
    engine = make_engine(latent=latent)
    engine.propose(batch([0], [0], [20], [20], previous))
    fresh = make_engine(latent=latent)
    context = rows(5, 9)
    a = engine.propose(batch([0], [15], [20], [5], context))
    b = fresh.propose(batch([0], [15], [20], [5], context))
    assert a.logits is not None and b.logits is not None
    assert torch.equal(a.logits, b.logits)


@ATTENTIONS
def test_positions_before_the_valid_start_are_ignored(latent):
    assert_drafts_as_if_fresh_from_15(rows(20, 8), latent)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 3.0e38])
@ATTENTIONS
def test_a_previous_owners_non_finite_kv_does_not_reach_the_next(poison, latent):
    # NaN/inf KV below the next request's start (3e38 overflows to inf in the
    # projections).
    assert_drafts_as_if_fresh_from_15(
        torch.full((20, WIDTH), poison).bfloat16(), latent
    )


def rows_at(first: int, end: int) -> torch.Tensor:
    """Context rows of positions ``[first, end)``, each a function of its
    position only (the same whichever PROPOSE carries it)."""
    return torch.stack(
        [
            torch.randn(WIDTH, generator=torch.Generator().manual_seed(p))
            for p in range(first, end)
        ]
    ).bfloat16()


@ATTENTIONS
def test_rewind_after_one_long_context_matches_an_incremental_build(latent):
    # One PROPOSE of 100 rows, then a rewind by a block (the server's limit).
    engine = make_engine(latent=latent)
    engine.propose(batch([0], [0], [100], [100], rows_at(0, 100)))
    rewound = engine.propose(batch([0], [0], [85], [1], rows_at(84, 85)))
    fresh = make_engine(latent=latent)
    for first, end in ((0, 32), (32, 64), (64, 85)):
        built = fresh.propose(
            batch([0], [0], [end], [end - first], rows_at(first, end))
        )
    assert rewound.logits is not None and built.logits is not None
    # Same K/V up to the rounding of other batch shapes.
    torch.testing.assert_close(rewound.logits, built.logits, rtol=0, atol=1e-4)


@ATTENTIONS
def test_rewind_after_restore_matches_a_request_of_the_restored_positions(latent):
    engine = make_engine(latent=latent)
    for first, end in ((0, 32), (32, 64), (64, 96), (96, 100)):
        engine.propose(batch([0], [0], [end], [end - first], rows_at(first, end)))
    engine.restore(0, 1, 64, 100)
    rewound = engine.propose(batch([1], [64], [85], [1], rows_at(84, 85)))
    fresh = make_engine(latent=latent)
    built = fresh.propose(batch([1], [64], [85], [21], rows_at(64, 85)))
    assert rewound.logits is not None and built.logits is not None
    torch.testing.assert_close(rewound.logits, built.logits, rtol=0, atol=1e-4)


@ATTENTIONS
def test_restore_rebuilds_the_same_kv_in_another_slot(latent):
    engine = make_engine(latent=latent)
    engine.propose(batch([0], [0], [50], [50], rows(50, 10)))
    engine.restore(0, 2, 16, 50)
    geometry = engine.geometry
    positions = torch.arange(16, 50)
    src = geometry.slot_mapping(torch.zeros_like(positions), positions)
    dst = geometry.slot_mapping(torch.full_like(positions, 2), positions)
    # [layer, position, latent] or [layer, K/V, position, head, dim].
    dim = 1 if latent else 2
    torch.testing.assert_close(
        engine.kv.index_select(dim, dst), engine.kv.index_select(dim, src)
    )


def test_memory_plan_counts_kv_of_every_block():
    engine = ReferenceEngine(
        LIMITS, ReferenceModelConfig(context_width=WIDTH), torch.device("cpu")
    )
    blocks = 1 + 4 * (32 // 16 + 1)
    assert engine.memory_plan().kv_bytes == 2 * 2 * blocks * 16 * 64 * 4


def test_a_latent_draft_caches_one_latent_per_layer_and_position():
    engine = ReferenceEngine(
        LIMITS,
        ReferenceModelConfig(context_width=WIDTH, latent_attention=True),
        torch.device("cpu"),
    )
    blocks = 1 + 4 * (32 // 16 + 1)
    # kv_lora_rank 32 + qk_rope_head_dim 8 values, float32.
    assert engine.memory_plan().kv_bytes == 2 * blocks * 16 * (32 + 8) * 4


@ATTENTIONS
def test_memory_plan_counts_the_bytes_load_allocates(latent):
    # More retained requests (6) than batch rows (4): K/V and a cache ring
    # per retained request.
    limits = dataclasses.replace(LIMITS, max_requests=6)
    engine = ReferenceEngine(
        limits,
        ReferenceModelConfig(context_width=WIDTH, latent_attention=latent),
        torch.device("cpu"),
    )
    engine.load()
    plan = engine.memory_plan()
    assert plan.kv_bytes == engine.kv.nbytes
    assert plan.prefix_cache_bytes == engine.cache.rows.nbytes
    # The RoPE table counts with the weights.
    weights = sum(w.nbytes for w in engine.w.values())
    assert plan.weight_bytes == weights + engine.rope.nbytes


class MisshapenEngine(ReferenceEngine):
    """The reference draft with its LM head one vocabulary row short."""

    def host_weights(self) -> dict[str, torch.Tensor]:
        weights = super().host_weights()
        weights["lm_head"] = weights["lm_head"][:-1]
        return weights


class ReducedVocabularyEngine(TorchDraftEngine):
    """The reference draft over half the vocabulary: draft id i drafts
    vocabulary id 2 i."""

    seed = 0

    def host_weights(self) -> dict[str, torch.Tensor]:
        weights = ReferenceEngine.host_weights(self)
        weights["draft_to_target"] = 2 * torch.arange(self.shape.draft_vocab)
        return weights


def test_memory_plan_counts_a_reduced_vocabularys_int64_id_map():
    shape = dataclasses.replace(SHAPE, draft_vocab_size=SHAPE.vocab_size // 2)
    engine = ReducedVocabularyEngine(LIMITS, shape, torch.device("cpu"))
    engine.load()
    weights = sum(w.nbytes for w in engine.w.values())
    assert engine.memory_plan().weight_bytes == weights + engine.rope.nbytes


def test_load_refuses_weights_that_do_not_match_the_draft_shape():
    engine = MisshapenEngine(
        LIMITS, ReferenceModelConfig(context_width=WIDTH), torch.device("cpu")
    )
    with pytest.raises(ValueError, match="do not match the draft shape"):
        engine.load()


def test_memory_plan_stages_every_context_row_with_its_position_and_the_logits():
    engine = ReferenceEngine(
        LIMITS, ReferenceModelConfig(context_width=WIDTH), torch.device("cpu")
    )
    rows_and_indices = 512 * (WIDTH * 2 + 24)  # bf16 rows, three int64 indices
    logits = 4 * 4 * 1024 * 4  # batch x K x vocab, float32 on CPU
    assert engine.memory_plan().staging_bytes == rows_and_indices + logits


def test_plan_context_keeps_only_rows_the_cache_can_hold():
    context = batch([1], [0], [100], [100], rows(100, 11))
    plan = plan_context(context, reach=48, budget=64)
    assert plan.keep is not None and plan.kv_select is not None
    assert plan.keep.tolist() == list(range(36, 100))
    # K/V of the ring's reach (window 32 + block 16): rows 52..99.
    assert plan.kv_select.tolist() == list(range(16, 64))


def test_plan_context_writes_kv_of_the_reach_only_when_the_cache_holds_more():
    # 60 rows fit the cache (64) but not the KV ring's reach (48).
    plan = plan_context(batch([1], [0], [60], [60], rows(60, 13)), reach=48, budget=64)
    assert plan.keep is None
    assert plan.kv_select is not None and plan.kv_select.tolist() == list(range(12, 60))


def test_plan_context_drops_rows_beyond_a_budget_below_the_reach():
    # reach 48 > budget 32: 40 rows fit the KV ring but not the cache ring.
    plan = plan_context(batch([1], [0], [40], [40], rows(40, 12)), reach=48, budget=32)
    assert plan.keep is not None and plan.keep.tolist() == list(range(8, 40))
    assert plan.positions.tolist() == list(range(8, 40))


@pytest.mark.parametrize("counts", [[100, 70], [60], [40, 30]])
def test_a_context_pass_writes_each_kv_slot_at_most_once(counts):
    """Rows past the KV window's reach go to the reserved block 0, not over
    the ring slot of a kept row: on CUDA, which of two writes to one slot
    lands is undefined (here, in order, the kept row would win either way,
    so the pass's own index is what shows it)."""
    engine = make_engine()
    n = len(counts)
    context = torch.cat([rows(c, 60 + i) for i, c in enumerate(counts)])
    engine.propose(batch(list(range(n)), [0] * n, counts, counts, context))
    plan = plan_context(
        batch(list(range(n)), [0] * n, counts, counts, context),
        engine.limits.kv_reach,
        engine.cache.budget,
    )
    written = engine._host_context[2, : plan.positions.shape[0]]
    outside_block_0 = written[written >= engine.limits.block_size]
    assert outside_block_0.unique().numel() == outside_block_0.numel()
    assert outside_block_0.numel() == sum(
        min(c, engine.limits.kv_reach) for c in counts
    )


def test_graph_batch_sizes_cover_every_batch_size():
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(1) == [1]


def test_a_batch_pads_to_the_smallest_captured_size_holding_it():
    sizes = [1, 2, 4, 8, 12]
    assert [padded_batch_size(sizes, n) for n in range(1, 13)] == (
        [1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12]
    )


def test_memory_plan_total_is_the_sum_of_its_parts():
    plan = MemoryPlan(kv_bytes=1, prefix_cache_bytes=2, weight_bytes=4, staging_bytes=8)
    assert plan.total == 15


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["dflash", "dspark"])
@ATTENTIONS
def test_cuda_graph_replay_matches_eager(method, latent):
    eager = make_engine(method=method, device="cuda", latent=latent)
    graphed = make_engine(method=method, device="cuda", graphs=True, latent=latent)
    assert len(graphed._graphs) == len(graph_batch_sizes(4)) * 4
    # Every captured (batch bucket, depth), a padded bucket (3 -> 4) too.
    for n in (1, 2, 3, 4):
        ends = [40 + i for i in range(n)]
        context = torch.cat([rows(e, 12 + i) for i, e in enumerate(ends)])
        args = (list(range(n)), [0] * n, ends, ends, context)
        for k in (1, 2, 3, 4):
            a, b = eager.propose(batch(*args, k=k)), graphed.propose(batch(*args, k=k))
            torch.testing.assert_close(a.logits, b.logits, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@ATTENTIONS
def test_graphed_context_pass_keeps_only_the_rows_eager_keeps(latent):
    # 100 and 70 rows: past the context cache's budget (64) and the KV
    # window's reach (48), so rows are dropped from both; 170 rows run
    # padded to 256. A second step then reads what the first one kept.
    eager = make_engine(device="cuda", latent=latent)
    graphed = make_engine(device="cuda", graphs=True, latent=latent)
    ends, counts = [100, 70], [100, 70]
    context = torch.cat([rows(c, 40 + i) for i, c in enumerate(counts)])
    steps = [([0, 0], ends, counts, context)]
    steps.append(([0, 0], [e + 2 for e in ends], [2, 2], rows(4, 50)))
    for starts, step_ends, step_counts, step_rows in steps:
        args = ([0, 1], starts, step_ends, step_counts, step_rows)
        a, b = eager.propose(batch(*args)), graphed.propose(batch(*args))
        torch.testing.assert_close(a.logits, b.logits, atol=5e-2, rtol=5e-2)
    # What RECONNECT restores from: the cached rows agree too.
    torch.testing.assert_close(
        eager.cache.rows[: graphed.cache.scratch_row],
        graphed.cache.rows[: graphed.cache.scratch_row],
        atol=5e-2,
        rtol=5e-2,
    )


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_graphs_of_an_engine_on_another_device_than_the_current_one():
    torch.cuda.set_device(0)
    eager = make_engine(device="cuda:1")
    graphed = make_engine(device="cuda:1", graphs=True)
    ends = [40, 41]
    context = torch.cat([rows(e, 30 + i) for i, e in enumerate(ends)])
    args = ([0, 1], [0, 0], ends, ends, context)
    a, b = eager.propose(batch(*args)), graphed.propose(batch(*args))
    assert b.logits is not None and b.logits.device == torch.device("cuda:1")
    torch.testing.assert_close(a.logits, b.logits, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_eager_start_up_holds_the_largest_querys_working_memory(method):
    # Large enough that a query's working memory (the gathered window K/V of
    # every row, per layer) is tens of MiB: the start-up check after
    # capture_cuda_graphs must already see it without graphs.
    limits = DraftLimits(16, 16, 4, 64, 8192, 16, 2048, 4096)
    model = ReferenceModelConfig(method=method, hidden_size=256, num_heads=8)
    engine = ReferenceEngine(limits, model, torch.device("cuda"))
    engine.load()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert engine.capture_cuda_graphs() == []
    assert torch.cuda.max_memory_allocated() - before >= 16 * 2**20
    warmed = torch.cuda.memory_reserved()
    n = limits.max_batch_size
    slots = list(range(n))
    empty = torch.empty(0, model.context_width).bfloat16()
    engine.propose(batch(slots, [0] * n, [4000] * n, [0] * n, empty, k=4))
    # The largest query again: at most a small-pool segment more.
    assert torch.cuda.memory_reserved() - warmed <= 2 * 2**20
