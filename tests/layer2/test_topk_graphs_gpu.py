# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Top-k frames of CUDA logits by CUDA graph replay (layer 2's server half,
``TopkGraphs``): the frame a replay writes is byte for byte the eager
encoder's, for the logits in the buffer at replay time, whatever sequence of
shapes, k and host buffers led there. Needs no vllm (the server half runs on
draft hosts without it)."""

from __future__ import annotations

import pytest
import torch

from vllm.k3_draft import protocol
from vllm.k3_draft.capabilities import draft_logits
from vllm.k3_draft.capabilities.draft_logits import DraftLogitsReply, TopkGraphs
from vllm.k3_draft.logits_codec import (
    LogitsFormat,
    encode_logits,
    sample_positions,
    topk_frame,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: graphs replay there"
    ),
]

VOCAB = 163_840
K = 3
MAX_MODEL_LEN = 1 << 20


def _logits(batch: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(batch, K, VOCAB, generator=generator, device="cuda").bfloat16()


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _eager(logits: torch.Tensor, k: int) -> bytes:
    return bytes(topk_frame(logits, k).cpu().numpy())


def _write(
    graphs: TopkGraphs, logits: torch.Tensor, k: int, host: torch.Tensor
) -> bool:
    """``graphs.write`` and the wait for what it queued."""
    replayed = graphs.write(logits, k, host)
    torch.cuda.current_stream().synchronize()
    return replayed


@pytest.mark.parametrize(("batch", "k"), [(1, 1), (1, 64), (8, 64), (8, 256)])
def test_a_key_seen_twice_is_replayed_with_the_eager_frame(batch: int, k: int) -> None:
    graphs, logits = TopkGraphs(), _logits(batch, seed=k)
    host = _pinned(batch * K * k * 6)
    assert not _write(graphs, logits, k, host)  # first sighting: eager
    assert _write(graphs, logits, k, host)  # captured, replayed
    assert bytes(host.numpy()) == _eager(logits, k)


def test_a_replay_reads_the_buffer_as_it_is_now() -> None:
    graphs, logits = TopkGraphs(), _logits(8, seed=1)
    host = _pinned(8 * K * 64 * 6)
    _write(graphs, logits, 64, host)
    _write(graphs, logits, 64, host)
    logits.copy_(_logits(8, seed=2))
    host.zero_()
    assert _write(graphs, logits, 64, host)
    assert bytes(host.numpy()) == _eager(logits, 64)


def test_another_shape_or_strides_at_one_address_is_a_new_key() -> None:
    # An engine with CUDA graphs returns graph_logits[:num_reqs]: batches of
    # different sizes share one address. The 5-row view and the strided view
    # are new keys (first sighting: eager, nothing written), never a replay of
    # a graph captured for another view of the same address.
    graphs, buf = TopkGraphs(), _logits(8, seed=6)
    host = _pinned(8 * K * 64 * 6)  # one staging buffer, sliced as the server's
    views = [
        (buf[:8], False),
        (buf[:8], True),
        (buf[:5], False),
        (buf[:5], True),
        (buf[:8], True),
        (buf[:4], False),
        (buf[:4], True),
        (buf[::2], False),  # shape [4, K, V] at buf's address, rows 0, 2, 4, 6
        (buf[::2], True),
        (buf[:4], True),
    ]
    for step, (view, replayed) in enumerate(views):
        assert view.data_ptr() == buf.data_ptr()
        buf.copy_(_logits(8, seed=20 + step))
        host.zero_()
        frame = host[: view.shape[0] * K * 64 * 6]
        assert _write(graphs, view, 64, frame) == replayed, step
        if replayed:
            assert bytes(frame.numpy()) == _eager(view, 64), step
        else:
            assert not host.any(), step
    assert len(graphs) == 4


def test_a_buffer_that_moves_every_call_is_never_captured() -> None:
    graphs = TopkGraphs()
    host = _pinned(8 * K * 64 * 6)
    kept = [_logits(8, seed=seed) for seed in range(4)]
    assert not any(_write(graphs, logits, 64, host) for logits in kept)


def test_a_new_host_buffer_drops_the_graphs() -> None:
    graphs, logits = TopkGraphs(), _logits(1, seed=3)
    host = _pinned(K * 16 * 6)
    _write(graphs, logits, 16, host)
    assert _write(graphs, logits, 16, host)
    other = _pinned(K * 16 * 6)
    assert not _write(graphs, logits, 16, other)  # seen anew
    assert _write(graphs, logits, 16, other)
    assert bytes(other.numpy()) == _eager(logits, 16)


def test_keys_beyond_the_bound_stay_eager_and_evict_nothing() -> None:
    graphs, logits = TopkGraphs(max_graphs=2), _logits(1, seed=4)
    host = _pinned(K * 3 * 6)
    for k in (1, 2, 3):
        _write(graphs, logits, k, host[: K * k * 6])
    assert [_write(graphs, logits, k, host[: K * k * 6]) for k in (1, 2, 3)] == [
        True,
        True,
        False,
    ]
    assert len(graphs) == 2
    assert _write(graphs, logits, 1, host[: K * 6])  # still captured
    assert bytes(host[: K * 6].numpy()) == _eager(logits, 1)


def test_a_failed_capture_turns_the_graphs_off_for_good(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    captures: list[int] = []

    def uncapturable(logits: torch.Tensor, k: int) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            captures.append(k)
            raise RuntimeError("operation not permitted when stream is capturing")
        return topk_frame(logits, k)

    monkeypatch.setattr(draft_logits, "topk_frame", uncapturable)
    graphs, logits = TopkGraphs(), _logits(1, seed=6)
    host = _pinned(K * 16 * 6)
    assert not _write(graphs, logits, 16, host)  # seen once
    assert not _write(graphs, logits, 16, host)  # the capture fails
    assert not _write(graphs, logits, 16, host)
    assert not _write(graphs, logits, 16, _pinned(K * 16 * 6))
    assert captures == [16]
    assert len(graphs) == 0


def _context(logits: torch.Tensor) -> protocol.ReplyContext:
    """A PROPOSE's reply context for ``logits`` ``[R, K, V]`` (anchors 100..)."""
    batch = logits.shape[0]
    return protocol.ReplyContext(
        tuple(f"r{i}" for i in range(batch)),
        tuple(range(100, 100 + batch)),
        K,
        torch.zeros(batch, K, dtype=torch.int64),
        logits,
    )


def _reply(
    reply: DraftLogitsReply, topk: int, context: protocol.ReplyContext
) -> tuple[dict, list]:
    """``reply``'s metadata and frames for ``topk`` (0: full vocabulary), once
    ``wait_frames`` returned."""
    fmt = LogitsFormat(VOCAB, topk)
    options = reply.parse_request(
        fmt.request_fields(), {"vocab_size": VOCAB, "max_model_len": MAX_MODEL_LEN}
    )
    meta, frames = reply.build_reply(options, context)
    reply.wait_frames()
    return meta, frames


def _expected(logits: torch.Tensor, topk: int) -> tuple[dict, bytes]:
    """The eager encoder's metadata and frame bytes of ``_context(logits)``."""
    anchors = range(100, 100 + logits.shape[0])
    meta, frame = encode_logits(
        logits,
        LogitsFormat(VOCAB, topk),
        sample_positions(anchors, K, MAX_MODEL_LEN),
    )
    return meta, bytes(frame.cpu().numpy())


def test_repeated_proposes_replay_one_graph_writing_the_eager_frames() -> None:
    reply = DraftLogitsReply(topk=True)
    logits = _logits(8, seed=5)
    context = _context(logits)
    expected_meta, _ = _expected(logits, 64)
    for seed in range(3):
        logits.copy_(_logits(8, seed=10 + seed))
        expected = _eager(logits, 64)
        meta, frames = _reply(reply, 64, context)
        assert meta == expected_meta
        assert [bytes(f) for f in frames] == [expected]
    # Captured at the second PROPOSE and replayed at the third: the staging
    # buffer was kept (a new one would have dropped the graph each time).
    assert len(reply._graphs) == 1


def test_frames_of_changing_batches_and_formats_are_the_eager_bytes() -> None:
    # One logits buffer viewed per batch size, as an engine with CUDA graphs
    # returns it: each reply's staged frame, once wait_frames returned, is
    # the eager encoder's, whether eager, captured or replayed.
    replies = {0: DraftLogitsReply(topk=False), 64: DraftLogitsReply(topk=True)}
    buf = _logits(8, seed=7)
    for step, batch in enumerate((8, 3, 8, 3, 8, 1)):
        buf.copy_(_logits(8, seed=30 + step))
        logits = buf[:batch]
        context = _context(logits)
        for topk, reply in replies.items():
            meta, frames = _reply(reply, topk, context)
            expected_meta, expected = _expected(logits, topk)
            assert meta == expected_meta, (step, topk)
            assert [bytes(f) for f in frames] == [expected], (step, topk)
    assert len(replies[64]._graphs) == 2  # batches 8 and 3, captured once each


def test_replies_of_more_sizes_than_the_staging_views_kept_stay_exact() -> None:
    # 70 reply sizes at batch 1, the largest first (the buffer grows once):
    # more than the staging views kept per size, which are then dropped and
    # rebuilt.
    reply = DraftLogitsReply(topk=True)
    logits = _logits(1, seed=8)
    context = _context(logits)
    for k in (70, *range(1, 70)):
        _, frames = _reply(reply, k, context)
        assert [bytes(f) for f in frames] == [_eager(logits, k)], k


def test_the_staging_views_kept_stay_within_their_bound() -> None:
    reply = DraftLogitsReply(topk=True)
    logits = _logits(1, seed=9)
    context = _context(logits)
    for k in (70, *range(1, 70)):
        _reply(reply, k, context)
        assert len(reply._host_frames) <= draft_logits._MAX_HOST_FRAMES, k
