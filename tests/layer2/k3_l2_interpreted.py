# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's Triton samplers under Triton's CPU interpreter against the
references of ``k3_l2_reference``; exits non-zero on a mismatch.

Usage: ``TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python k3_l2_interpreted.py
[standard]``
(the interpreter must be on before triton is imported; an empty device list
is how ``vllm.triton_utils`` keeps Triton enabled on a host without a GPU
driver). Checks, bit for bit on tokens and caches:

* ``gumbel_sample`` (drafting, bf16 logits cache, per-token slot columns,
  masked rows, greedy and sampled temperatures, 64-bit seeds; fp32 and fp64
  noise) against ``k3_l2_reference.gumbel_sample``;
* ``rejection_sample(use_block_verification=True)`` with draft logits
  against ``k3_l2_reference.block_rejection_sample``, on full-vocabulary
  caches and on top-k slices over the large negative fill (temperatures
  down to 0.5, where the scaled fill is -inf in fp32); the interpreter has
  no ``libdevice.log1p``, it is given ``log(1 + x)``;
* ``RemoteDraftLogits.publish`` driving upstream's ``gumbel_sample`` against
  the same publish driving the reference (full vocabulary and top-k).

With the argument ``standard`` it checks instead vLLM's default rejection
method, ``rejection_sample(use_block_verification=False)``, on what layer 2
hands it: codec replies (top-k over ``TOPK_V`` tokens, and full vocabulary)
go through ``consume`` and ``publish`` with upstream's ``gumbel_sample``, and
the drafts, the accepted lengths and every emitted token must be those of
textbook speculative sampling (Leviathan et al.) with ``q`` the softmax of the
reply's values at the request's temperature (zero outside a top-k slice),
drawn with the same Gumbel noise and Philox acceptance uniforms.
"""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import numpy as np
import torch

from vllm.triton_utils import tl, triton

V, K = 40, 3
# Vocabulary of the top-k rejection check: two of the rejection kernel's
# vocabulary blocks, so that (as at Kimi's 163,840) slots have whole blocks
# holding only the fill.
VOCAB_BLOCK, TOPK_V = 8192, 9000


@triton.jit
def _log1p(x):
    """The interpreter's stand-in for ``libdevice.log1p``."""
    return tl.log(1.0 + x)


def _check_gumbel(use_fp64: bool) -> None:
    from k3_l2_reference import gumbel_sample as reference

    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    generator = torch.Generator().manual_seed(7 + use_fp64)
    rows = 16 * K
    logits = (torch.randn(rows, V, generator=generator) * 3).bfloat16()
    # Every (request, slot) once, shuffled; some rows masked.
    order = torch.randperm(rows, generator=generator)
    idx = torch.arange(16).repeat_interleave(K)[order]
    cols = torch.arange(K, dtype=torch.int32).repeat(16)[order]
    idx[::7] = -1
    temperature = torch.rand(16, generator=generator) * 2
    temperature[::5] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (16,), generator=generator)
    pos = torch.randint(0, 1 << 20, (rows,), generator=generator)
    caches = [torch.zeros(16, K, V, dtype=torch.bfloat16) for _ in range(2)]
    tokens = [
        sample(
            logits,
            idx,
            temperature,
            seeds,
            pos,
            apply_temperature=True,
            is_drafting=True,
            logits_cache=cache,
            logits_cache_col=cols,
            use_fp64=use_fp64,
        )
        for sample, cache in zip((gumbel_sample, reference), caches)
    ]
    assert torch.equal(tokens[0], tokens[1]), (use_fp64, tokens)
    assert torch.equal(caches[0].view(torch.int16), caches[1].view(torch.int16))
    print(f"gumbel_sample fp64={use_fp64}: {rows} rows match")


def _check_rejection(use_fp64: bool, topk: int) -> None:
    """``topk`` = 0: full-vocabulary draft logits over ``V`` tokens.
    ``topk`` > 0: over ``TOPK_V`` tokens the cache holds, per slot, the
    ``topk`` largest logits scattered over ``remote_draft_logits.FILL``, as
    ``publish`` stages a top-k reply; one vocabulary block or the other is
    all fill, and a third of the requests run at temperature 0.5, where
    ``FILL / T`` is -inf in fp32."""
    from k3_l2_reference import block_rejection_sample

    import vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils as utils
    from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import FILL

    utils.tldevice = types.SimpleNamespace(log1p=_log1p)  # type: ignore[assignment]
    generator = torch.Generator().manual_seed(11 + use_fp64 + 2 * topk)
    # The resample kernel runs one interpreted program per 1024 tokens: fewer
    # requests over the larger vocabulary.
    vocab, reqs, rows = (TOPK_V, 12, K + 1) if topk else (V, 24, K + 1)
    idx = torch.randperm(32, generator=generator)[:reqs]
    temperature = 0.3 + torch.rand(32, generator=generator) * 1.7
    seeds = torch.randint(-(2**62), 2**62, (32,), generator=generator)
    draft = (torch.randn(32, K, vocab, generator=generator) * 2).bfloat16()
    if topk:
        temperature[::3] = 0.5
        # Logits mostly below zero, so that reading the fill as a zero logit
        # would move q; every fourth request keeps its top-k in the second
        # block.
        draft -= 6
        draft[::4, :, VOCAB_BLOCK:] += 8
        top = draft.float().topk(topk, -1).indices
        draft = torch.full_like(draft, FILL).scatter_(-1, top, draft.gather(-1, top))
        for in_block in ((top < VOCAB_BLOCK)[idx], (top >= VOCAB_BLOCK)[idx]):
            assert not in_block.any(-1).all(), "no slot has this block all fill"
        assert (temperature[idx] == 0.5).any()
    # Target rows near the draft (finite where the draft is the fill) so
    # that some blocks are accepted.
    bonus = torch.randn(reqs, 1, vocab, generator=generator) * 2
    target = torch.cat([draft[idx].float().clamp(min=-20.0), bonus], 1)
    target = target + torch.randn(reqs, rows, vocab, generator=generator) * 0.7
    target = (target / temperature[idx][:, None, None]).view(-1, vocab)
    q = torch.softmax(draft[idx].float() / temperature[idx][:, None, None], -1)
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=generator)
    drafts = drafts.view(reqs, K)
    draft_sampled = torch.cat([torch.zeros(reqs, 1, dtype=torch.long), drafts], 1)
    pos = torch.randint(0, 1 << 20, (reqs, 1), generator=generator) + torch.arange(rows)
    args = (
        target.contiguous(),
        draft,
        draft_sampled.view(-1),
        torch.arange(reqs + 1) * rows,
        pos.view(-1),
        idx,
        idx.repeat_interleave(rows),
        torch.arange(rows).repeat(reqs),
        temperature,
        seeds,
        K,
    )
    got, got_num = utils.rejection_sample(
        *args, use_fp64=use_fp64, use_block_verification=True
    )
    want, want_num = block_rejection_sample(*args, use_fp64=use_fp64)
    assert torch.equal(got_num.int(), want_num), (got_num, want_num)
    emitted = torch.arange(rows)[None, :] < want_num[:, None]
    assert torch.equal(got[emitted], want[emitted]), (got, want)
    print(
        f"rejection_sample fp64={use_fp64} top-k={topk}: {reqs} requests match "
        f"(accepted lengths {sorted(set((want_num - 1).tolist()))})"
    )


def _speculative_sampling(
    q: np.ndarray,
    target: np.ndarray,
    seeds: np.ndarray,
    pos: np.ndarray,
    anchors: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Textbook speculative sampling in float64, independent of the cache
    layout: per request, draft slot ``j`` draws Gumbel-max from ``q[r, j]``
    (draft noise stream: slot mixed into the seed, keyed by the position
    before the token), the target accepts the ``i``-th draft ``x`` iff
    ``u * q(x) < p(x)`` (``u`` the Philox draw at its position), and the
    first rejection (or the bonus row) emits Gumbel-max of
    ``max(p - q, 0)`` (or ``p``). Returns drafts ``[R, K]``, accepted
    lengths ``[R]`` and emitted tokens ``[R]``."""
    from k3_l2_reference import (
        _DRAFT_NOISE_SALT,
        gumbel_noise,
        philox_uniform,
        spec_step_seed,
    )

    reqs, k, vocab = q.shape
    keys = np.arange(vocab)

    def gumbel_max(probs: np.ndarray, seed, position) -> int:
        noise = gumbel_noise(seed, position, keys, False).astype(np.float64)
        with np.errstate(divide="ignore"):
            return int(np.argmax(np.log(probs) + noise))

    p = np.exp(target - target.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    drafts = np.array(
        [
            [
                gumbel_max(
                    q[r, j],
                    spec_step_seed(seeds[r], j),
                    anchors[r] + j + _DRAFT_NOISE_SALT,
                )
                for j in range(k)
            ]
            for r in range(reqs)
        ]
    )
    accepted = np.full(reqs, k)
    emitted = np.zeros(reqs, dtype=np.int64)
    for r in range(reqs):
        for i in range(k):
            u = float(philox_uniform(seeds[r : r + 1], pos[r, i : i + 1])[0])
            x = drafts[r, i]
            if not u * q[r, i, x] < p[r, i, x]:
                accepted[r] = i
                break
        a = accepted[r]
        law = p[r, a] if a == k else np.maximum(p[r, a] - q[r, a], 0.0)
        emitted[r] = gumbel_max(law, seeds[r], pos[r, a])
    return drafts, accepted, emitted


def _check_standard_rejection(topk: int) -> None:
    """The default method on layer 2's draft rows (see the module docstring).
    ``topk`` > 0: every fourth request keeps its slice in the second of the
    kernel's 8192-token vocabulary blocks, so each block is all fill for some
    slot, and temperatures 0.5 (``FILL / T`` is -inf in fp32), 1.0 and 1.7."""
    import vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils as utils
    from vllm.k3_draft.logits_codec import LogitsFormat, encode_logits, sample_positions
    from vllm.k3_draft.plan import Proposal
    from vllm.k3_draft.protocol import tensor_frame
    from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
        RemoteDraftLogits,
    )
    from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
        PublishContext,
        RemoteStep,
    )

    utils.tldevice = types.SimpleNamespace(log1p=_log1p)  # type: ignore[assignment]
    generator = torch.Generator().manual_seed(23 + topk)
    vocab, reqs, rows, max_reqs = TOPK_V, 9, K + 1, 12
    temps = (0.5, 1.0, 1.7) if topk else (0.5, 1.7)
    # Requests sit at shuffled cache rows; seeds are 64-bit.
    idx = torch.randperm(max_reqs, generator=generator)[:reqs]
    temperature = torch.tensor([temps[i % len(temps)] for i in range(max_reqs)])
    seeds = torch.randint(-(2**62), 2**62, (max_reqs,), generator=generator)
    anchors = torch.randint(0, 1 << 20, (reqs,), generator=generator)
    # Mostly negative logits, so that reading the fill as a zero logit would
    # move q.
    logits = torch.randn(reqs, K, vocab, generator=generator) * 2 - 6
    logits[::4, :, VOCAB_BLOCK:] += 8

    fmt = LogitsFormat(vocab, topk)
    max_len = 1 << 21
    meta, frame = encode_logits(
        logits, fmt, sample_positions(anchors.tolist(), K, max_len)
    )
    meta.update(capability=fmt.capability, num_frames=1)
    extension = RemoteDraftLogits(
        fmt, K, max_reqs, max_len, torch.device("cpu"), False, _OneRank()
    )
    proposal = Proposal(
        tuple(map(str, range(reqs))), np.arange(reqs), anchors.numpy(), K
    )
    payload = extension.consume(meta, [bytes(tensor_frame(frame))], proposal)
    drafts = torch.full((reqs, K), -1)
    step = RemoteStep(
        input_batch=SimpleNamespace(
            idx_mapping=idx.int(), has_structured_output_reqs=False
        ),
        num_reqs=reqs,
        num_speculative_tokens=K,
        temperature=temperature,
        seeds=seeds,
        staged=None,
        extensions=(extension,),
    )
    extension.publish(payload, PublishContext(step, drafts))

    # q from the reply alone: the softmax of its values at the request's
    # temperature, zero outside a top-k slice.
    temp = temperature[idx].double()[:, None, None]
    if topk:
        assert payload.rows.ids is not None and payload.rows.values is not None
        ids = payload.rows.ids[:reqs].long()
        values = payload.rows.values[:reqs].view(torch.bfloat16).double()
        scaled = torch.full((reqs, K, vocab), -torch.inf, dtype=torch.float64)
        scaled.scatter_(2, ids, values / temp)
        for in_block in (ids < VOCAB_BLOCK, ids >= VOCAB_BLOCK):
            assert not in_block.any(-1).all(), "no slot has this block all fill"
    else:
        assert payload.dense is not None
        dense = payload.dense[:reqs].view(torch.bfloat16).double()
        scaled = dense / temp
    q = torch.softmax(scaled, -1)
    # Target rows near the draft so that drafts are often accepted, with most
    # of their mass on the slice, so that the residual max(p - q, 0) depends
    # on q.
    near = torch.where(q > 0, logits, logits - 6).float()
    bonus = torch.randn(reqs, 1, vocab, generator=generator) * 2
    target = torch.cat([near, bonus], 1)
    target = target + torch.randn(reqs, rows, vocab, generator=generator) * 0.7
    target = (target / temperature[idx][:, None, None]).view(-1, vocab)
    pos = (anchors[:, None] + 1 + torch.arange(rows)).view(-1)

    want_drafts, accepted, emitted = _speculative_sampling(
        q.numpy(),
        target.view(reqs, rows, vocab).double().numpy(),
        seeds[idx].numpy(),
        pos.view(reqs, rows).numpy(),
        anchors.numpy(),
    )
    assert torch.equal(drafts, torch.from_numpy(want_drafts)), (drafts, want_drafts)
    got, got_num = utils.rejection_sample(
        target.contiguous(),
        extension.draft_logits,
        torch.cat([torch.zeros(reqs, 1, dtype=torch.long), drafts], 1).view(-1),
        torch.arange(reqs + 1) * rows,
        pos,
        idx,
        idx.repeat_interleave(rows),
        torch.arange(rows).repeat(reqs),
        temperature,
        seeds,
        K,
        use_block_verification=False,
    )
    assert got_num.tolist() == (accepted + 1).tolist(), (got_num, accepted)
    for r in range(reqs):
        a = accepted[r]
        assert got[r, :a].tolist() == drafts[r, :a].tolist(), (r, got[r], drafts[r])
        assert int(got[r, a]) == emitted[r], (r, got[r], emitted[r])
    lengths = sorted(set(accepted.tolist()))
    # Both outcomes occur: a rejection resampled from max(p - q, 0), and a
    # fully accepted block with its bonus token.
    assert lengths[0] < K and lengths[-1] > 0, lengths
    print(
        f"standard rejection top-k={topk}: {reqs} requests match (accepted {lengths})"
    )


class _OneRank:
    rank_in_group, world_size = 0, 1

    def broadcast(self, tensor, src=0):
        return tensor


def _check_publish(topk: int) -> None:
    import k3_l2_reference

    from vllm.k3_draft.logits_codec import LogitsFormat, encode_logits, sample_positions
    from vllm.k3_draft.plan import Proposal
    from vllm.k3_draft.protocol import tensor_frame
    from vllm.v1.worker.gpu.spec_decode.dspark import remote_draft_logits
    from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
        PublishContext,
        RemoteStep,
    )

    fmt = LogitsFormat(V, topk)
    proposal = Proposal(("a", "b", "c"), np.array([0, 2, 3]), np.array([5, 90, 63]), K)
    logits = torch.randn(3, K, V, generator=torch.Generator().manual_seed(topk))
    meta, frame = encode_logits(logits, fmt, sample_positions([5, 90, 63], K, 65))
    meta.update(capability=fmt.capability, num_frames=1)
    results = []
    upstream = remote_draft_logits.gumbel_sample
    for sampler in (upstream, k3_l2_reference.gumbel_sample):
        remote_draft_logits.gumbel_sample = sampler
        extension = remote_draft_logits.RemoteDraftLogits(
            fmt, K, 8, 65, torch.device("cpu"), True, _OneRank()
        )
        payload = extension.consume(meta, [bytes(tensor_frame(frame))], proposal)
        drafts = torch.full((4, K), -1)
        step = RemoteStep(
            input_batch=SimpleNamespace(
                idx_mapping=torch.tensor([6, 1, 0, 2]),
                has_structured_output_reqs=False,
            ),
            num_reqs=4,
            num_speculative_tokens=K,
            temperature=torch.tensor([0.7, 1.0, 0.0, 1, 1.5, 1, 0.9, 1]),
            seeds=torch.arange(8) * 77 - 300,
            staged=None,
            extensions=(extension,),
        )
        extension.publish(payload, PublishContext(step, drafts))
        results.append((drafts, extension.draft_logits))
    remote_draft_logits.gumbel_sample = upstream
    (drafts, cache), (want_drafts, want_cache) = results
    assert torch.equal(drafts, want_drafts), (drafts, want_drafts)
    assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16))
    # Row 1 has no reply, row 2 runs past the model length, row 3 (greedy)
    # has one slot before it.
    assert (drafts[0] >= 0).all() and (drafts[1:3] == -1).all(), drafts
    assert drafts[3, 0] >= 0 and (drafts[3, 1:] == -1).all(), drafts
    print(f"publish top-k={topk}: drafts and cache match {drafts.tolist()}")


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (and CUDA_VISIBLE_DEVICES=)")
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise SystemExit("Triton is disabled: set CUDA_VISIBLE_DEVICES to ''")
    if sys.argv[1:] == ["standard"]:
        for topk in (4, 0):
            _check_standard_rejection(topk)
        print("standard rejection checks passed")
        return
    for use_fp64 in (False, True):
        _check_gumbel(use_fp64)
        for topk in (0, 4):
            _check_rejection(use_fp64, topk)
    for topk in (0, 5):
        _check_publish(topk)
    print("all interpreted checks passed")


if __name__ == "__main__":
    main()
