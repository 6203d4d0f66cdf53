# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU references of upstream's probabilistic speculative-decoding kernels,
and the exact law of block verification.

Upstream's samplers are Triton kernels. On a CPU host they only run under
Triton's interpreter, at about 7 ms per program: far too slow for tens of
thousands of draws, and the resample kernel's ``tldevice.log1p`` has no
interpreter implementation. So the statistical tests use these references,
and ``test_upstream_kernels_interpreted`` checks them against the real kernels
(``vllm/v1/worker/gpu/sample/gumbel.py`` and
``spec_decode/rejection_sampler_utils.py``) on smaller batches.

* ``gumbel_sample``: upstream's ``gumbel_sample`` (same signature): murmur3
  noise (fp32 or fp64), the draft salt, the slot index mixed into the seed,
  temperature, and the logits-cache write (rows with a negative request index
  are skipped).
* ``block_rejection_sample``: upstream's ``rejection_sample`` with
  ``use_block_verification=True`` and draft logits, for batches where every
  request has ``K`` valid drafts and a positive temperature (the only case
  the tests need): Philox acceptance draws, block acceptance ``h``, residual
  resampling with murmur3 Gumbel noise.
* ``block_verification_law``: the exact (float64) law of the first two tokens
  a verifier emits, by enumerating every draft block, when drafts are
  sampled from ``q_sample`` but verified against ``q_verify``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_M32 = 0xFFFFFFFF
_DRAFT_NOISE_SALT = 1 << 30
_TL_RAND_MIN = np.float32(4.6566127342e-10)
_PHILOX_KEY_A = np.uint32(0x9E3779B9)
_PHILOX_KEY_B = np.uint32(0xBB67AE85)
_PHILOX_ROUND_A = np.uint32(0xD2511F53)
_PHILOX_ROUND_B = np.uint32(0xCD9E8D57)


# ------------------------------------------------------------ random streams


def _rotl(value: np.ndarray, shift: int) -> np.ndarray:
    return (value << np.uint32(shift)) | (value >> np.uint32(32 - shift))


def _mix(h: np.ndarray, key: np.ndarray) -> np.ndarray:
    key = _rotl(key * np.uint32(0xCC9E2D51), 15) * np.uint32(0x1B873593)
    return _rotl(h ^ key, 13) * np.uint32(5) + np.uint32(0xE6546B64)


def _fmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def murmur3_hash32(
    seed: np.ndarray, pos: np.ndarray, offset: np.ndarray, domain: int = 0
) -> np.ndarray:
    """gumbel.py ``murmur3_hash32`` (broadcasting int64 seed/pos, offsets)."""
    seed, pos, offset = np.broadcast_arrays(
        np.atleast_1d(np.asarray(seed, np.int64)),
        np.atleast_1d(np.asarray(pos, np.int64)),
        np.atleast_1d(np.asarray(offset, np.int64)),
    )
    h = np.full(seed.shape, domain, dtype=np.uint32)
    h = _mix(h, (seed & _M32).astype(np.uint32))
    h = _mix(h, ((seed >> 32) & _M32).astype(np.uint32))
    h = _mix(h, (pos & _M32).astype(np.uint32))
    h = _mix(h, (offset & _M32).astype(np.uint32))
    return _fmix(h ^ np.uint32(16))


def murmur3_uniform32(seed, pos, offset) -> np.ndarray:
    bits = murmur3_hash32(seed, pos, offset)
    hi = (bits >> np.uint32(16)).astype(np.int32).astype(np.float32)
    lo = (bits & np.uint32(0xFFFF)).astype(np.int32).astype(np.float32)
    return hi * np.float32(1.52587890625e-05) + (lo + np.float32(0.5)) * np.float32(
        2.3283064365386963e-10
    )


def murmur3_uniform64(seed, pos, offset) -> np.ndarray:
    lo = murmur3_hash32(seed, pos, offset).astype(np.uint64)
    hi = murmur3_hash32(seed, pos, offset, domain=0x9E3779B9).astype(np.uint64)
    bits = ((hi << np.uint64(32)) | lo) >> np.uint64(11)
    uniform = (bits.astype(np.float64) + 0.5) * 1.1102230246251565e-16
    return np.where(uniform == 1.0, uniform - 1.1102230246251565e-16, uniform)


def _log1p_neg_stable(value: np.ndarray) -> np.ndarray:
    polynomial: np.ndarray = np.asarray(np.float32(1.0 / 8.0))
    for coefficient in (1 / 7, 1 / 6, 1 / 5, 1 / 4, 1 / 3, 1 / 2, 1.0):
        polynomial = np.float32(coefficient) + value * polynomial
    series = -value * polynomial
    direct = np.log(
        np.maximum(np.float32(1.0) - value, np.float32(5.960464477539063e-08))
    )
    return np.where(value < 0.25, series, direct)


def gumbel_noise(seed, pos, keys, use_fp64: bool) -> np.ndarray:
    """The Gumbel noise of ``gumbel_noised_argmax`` (``pos`` already salted)."""
    if use_fp64:
        return -np.log(-np.log(murmur3_uniform64(seed, pos, keys)))
    return -np.log(-_log1p_neg_stable(murmur3_uniform32(seed, pos, keys)))


def _umulhi(a: np.uint32, b: np.ndarray) -> np.ndarray:
    product = np.uint64(a) * b.astype(np.uint64)
    return (product >> np.uint64(32)).astype(np.uint32)


def philox_uniform(seed: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """``tl_rand32(seed, offset, includes_zero=False)``: Triton's ``tl.rand``
    (Philox 4x32-10 on a 64-bit seed and offset)."""
    seed = np.atleast_1d(np.asarray(seed, np.int64)).astype(np.uint64)
    offset = np.atleast_1d(np.asarray(offset, np.int64))
    k0 = (seed & np.uint64(_M32)).astype(np.uint32)
    k1 = ((seed >> np.uint64(32)) & np.uint64(_M32)).astype(np.uint32)
    c0 = (offset & _M32).astype(np.uint32)
    c1 = ((offset >> 32) & _M32).astype(np.uint32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    for _ in range(10):
        c0, c1, c2, c3 = (
            _umulhi(_PHILOX_ROUND_B, c2) ^ c1 ^ k0,
            _PHILOX_ROUND_B * c2,
            _umulhi(_PHILOX_ROUND_A, c0) ^ c3 ^ k1,
            _PHILOX_ROUND_A * c0,
        )
        k0 = k0 + _PHILOX_KEY_A
        k1 = k1 + _PHILOX_KEY_B
    x = c0.view(np.int32)
    x = np.where(x < 0, ~x, x)
    uniform = x.astype(np.float32) * np.float32(4.6566127342e-10)
    return np.maximum(uniform, _TL_RAND_MIN)


def spec_step_seed(seed: np.ndarray, step: np.ndarray | int) -> np.ndarray:
    return np.asarray(seed, np.int64) ^ (np.asarray(step, np.int64) << 32)


def _noised_argmax(
    logits: torch.Tensor, seed: np.ndarray, pos: np.ndarray, use_fp64: bool
) -> torch.Tensor:
    """Argmax of fp32 ``logits`` ``[n, V]`` plus murmur3 Gumbel noise."""
    keys = np.arange(logits.shape[1], dtype=np.int64)[None, :]
    noise = gumbel_noise(seed[:, None], pos[:, None], keys, use_fp64)
    scores = logits.double() if use_fp64 else logits
    return (scores + torch.from_numpy(noise)).argmax(-1)


# ------------------------------------------------------------------ kernels


def gumbel_sample(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    pos: torch.Tensor,
    apply_temperature: bool,
    is_drafting: bool,
    logits_cache: torch.Tensor | None = None,
    logits_cache_col: torch.Tensor | None = None,
    use_fp64: bool = False,
    logits_cache_source: torch.Tensor | None = None,
) -> torch.Tensor:
    """Upstream ``gumbel_sample`` on CPU (see the module docstring)."""
    num_tokens, vocab = logits.shape
    idx = expanded_idx_mapping.long()
    valid = idx >= 0
    safe = idx.clamp(min=0)
    temp = torch.where(valid, temperature[safe].float(), 0.0)
    seeds = torch.where(valid, seed[safe].long(), 0).numpy()
    if logits_cache is not None:
        assert logits_cache_col is not None
        source = logits if logits_cache_source is None else logits_cache_source
        col = logits_cache_col.long().expand(num_tokens)
        logits_cache[idx[valid], col[valid], :vocab] = source[valid]
        seeds = spec_step_seed(seeds, col.numpy())
    scores = logits.float()
    noisy = temp != 0
    if apply_temperature:
        scores = torch.where(noisy[:, None], scores / temp[:, None], scores)
    positions = pos.long().numpy() + (_DRAFT_NOISE_SALT if is_drafting else 0)
    noised = _noised_argmax(scores, seeds, positions, use_fp64)
    plain = scores.argmax(-1)
    return torch.where(noisy, noised, plain)


def block_rejection_sample(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    expanded_local_pos: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    num_speculative_steps: int,
    use_fp64: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream ``rejection_sample(..., use_block_verification=True)`` with
    draft logits, for ``K`` valid drafts per request and temperatures > 0.
    Returns ``(sampled [R, K + 1] (-1 after the emitted tokens), num_sampled
    [R])``."""
    k = num_speculative_steps
    rows = k + 1
    num_reqs = idx_mapping.shape[0]
    vocab = min(target_logits.shape[1], draft_logits.shape[-1])
    assert torch.equal(cu_num_logits.long(), torch.arange(num_reqs + 1) * rows)
    assert torch.equal(expanded_local_pos.long(), torch.arange(rows).repeat(num_reqs))
    req = idx_mapping.long()
    assert torch.equal(expanded_idx_mapping.long(), req.repeat_interleave(rows))
    temp = temperature[req].float()
    assert (temp > 0).all(), "the reference covers temperatures > 0 only"
    target = target_logits[:, :vocab].float().view(num_reqs, rows, vocab)
    target_logp = target - torch.logsumexp(target, -1, keepdim=True)
    draft = draft_logits[req, :, :vocab].float() / temp[:, None, None]
    draft_logp = draft - torch.logsumexp(draft, -1, keepdim=True)
    drafts = draft_sampled.view(num_reqs, rows)[:, 1:].long()
    assert (drafts >= 0).all(), "the reference covers valid drafts only"
    ratio = (
        target_logp[:, :k].gather(-1, drafts[..., None])
        - draft_logp.gather(-1, drafts[..., None])
    ).squeeze(-1)
    cumulative = torch.zeros(num_reqs, k)
    log_p = torch.zeros(num_reqs)
    for j in range(k):
        log_p = torch.clamp(log_p + ratio[:, j], max=0.0)
        cumulative[:, j] = log_p
    # Block acceptance thresholds h_i for an accepted length of i + 1.
    prefix = cumulative.exp()
    h = prefix.clone()
    for i in range(k - 1):
        mass = torch.clamp(
            prefix[:, i, None] * target_logp[:, i + 1].exp()
            - draft_logp[:, i + 1].exp(),
            min=0.0,
        ).sum(-1)
        denom = mass + 1.0 - prefix[:, i]
        h[:, i] = torch.where(denom > 0, mass / denom, 1.0)
    seeds = seed[req].long().numpy()
    positions = pos.long().view(num_reqs, rows).numpy()
    accepted = torch.zeros(num_reqs, dtype=torch.long)
    for i in range(k):
        u = philox_uniform(spec_step_seed(seeds, i), positions[:, i])
        accepted = torch.where(torch.from_numpy(u) <= h[:, i], i + 1, accepted)
    # Resample at the first unaccepted row (the bonus row when all accepted).
    at = accepted[:, None, None].expand(num_reqs, 1, vocab)
    is_bonus = accepted == k
    bonus = target[:, k]
    shifted = (
        target_logp.gather(1, at).squeeze(1)
        + torch.where(
            accepted > 0,
            cumulative.gather(1, (accepted - 1).clamp(min=0)[:, None]).squeeze(1),
            0.0,
        )[:, None]
    )
    rejected_draft = draft_logp.gather(1, at.clamp(max=k - 1)).squeeze(1)
    q_over_p = (rejected_draft - shifted).exp()
    residual = torch.where(
        q_over_p < 1.0, shifted + torch.log1p(-q_over_p), float("-inf")
    )
    residual = torch.where(is_bonus[:, None], bonus, residual)
    resample_pos = positions[np.arange(num_reqs), accepted.numpy()]
    token = _noised_argmax(residual, seeds, resample_pos, use_fp64)
    sampled = torch.full((num_reqs, rows), -1, dtype=torch.long)
    slot = torch.arange(rows)[None, :]
    sampled = torch.where(
        slot < accepted[:, None],
        draft_sampled.view(num_reqs, rows).roll(-1, 1),
        sampled,
    )
    sampled[torch.arange(num_reqs), accepted] = token
    return sampled, (accepted + 1).to(torch.int32)


# -------------------------------------------------------------- exact law


def block_verification_law(
    target: list[np.ndarray], q_sample: np.ndarray, q_verify: np.ndarray
) -> np.ndarray:
    """Exact law ``[V, V]`` of the first two emitted tokens (float64).

    ``target[j]`` holds the target distribution of row ``j`` given the drafts
    before it, shape ``[V] * (j + 1)`` (last axis: the token); ``q_sample``
    and ``q_verify`` are ``[K, V]`` draft distributions (DFlash: independent
    of earlier drafts). When fewer than two tokens are emitted the second is
    the target's next token, as the following step would emit it.
    """
    k, vocab = q_sample.shape
    assert len(target) == k + 1
    shape = (vocab,) * k
    # Draft block d (axes 0..K-1) and its sampling weight.
    weight = np.ones(shape)
    for j in range(k):
        weight = weight * q_sample[j].reshape((1,) * j + (vocab,) + (1,) * (k - j - 1))

    def row(j: int) -> np.ndarray:
        """Target distribution of row j for every block: shape + (V,)."""
        return np.broadcast_to(
            target[j].reshape(target[j].shape[:-1] + (1,) * (k - j) + (vocab,)),
            shape + (vocab,),
        )

    def at_draft(dist: np.ndarray, j: int) -> np.ndarray:
        """dist(d_j) for every block (dist indexed by the axis-j draft)."""
        index = np.indices(shape)[j]
        return np.take_along_axis(dist, index[..., None], -1)[..., 0]

    prefix = [np.ones(shape)]
    for j in range(k):
        q_d = q_verify[j][np.indices(shape)[j]]
        prefix.append(np.minimum(prefix[-1] * at_draft(row(j), j) / q_d, 1.0))

    def residual(t: int) -> np.ndarray:
        if t == k:
            return row(k)
        r = np.maximum(prefix[t][..., None] * row(t) - q_verify[t], 0.0)
        total = r.sum(-1, keepdims=True)
        return np.divide(r, total, out=np.zeros_like(r), where=total > 0)

    h = []
    for i in range(k):
        p = prefix[i + 1]
        if i < k - 1:
            mass = np.maximum(p[..., None] * row(i + 1) - q_verify[i + 1], 0.0).sum(-1)
            denom = mass + 1.0 - p
            h.append(np.divide(mass, denom, out=np.ones_like(mass), where=denom > 0))
        else:
            h.append(p)
    law = np.zeros((vocab, vocab))
    draft = [np.indices(shape)[j] for j in range(k)]
    for t in range(k + 1):
        p_t = h[t - 1] if t else np.ones(shape)
        for i in range(t, k):
            p_t = p_t * (1.0 - h[i])
        mass = weight * p_t
        if t >= 2:
            np.add.at(law, (draft[0], draft[1]), mass)
        elif t == 1:
            np.add.at(law, draft[0], mass[..., None] * residual(1))
        else:
            first = (mass[..., None] * residual(0)).reshape(-1, vocab).sum(0)
            law += first[:, None] * target[1]
    return law


def l1_threshold(law: np.ndarray, draws: int, delta: float) -> float:
    """``t`` with ``P(||empirical - law||_1 >= t) <= delta`` for ``draws``
    i.i.d. draws from ``law`` (see ``test_exactness``)."""
    spread = np.sqrt(law * (1.0 - law) / draws).sum()
    return float(spread + math.sqrt(2.0 * math.log(1.0 / delta) / draws))
