# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exactness: remote draft logits + Gumbel drafting + block rejection emit
tokens that follow the target distribution.

Set-up (V = 16, K = 3): a target whose distribution at each verify row
depends on the drafted prefix (random tables ``p_j(x | d_1..d_j)``) and a
DFlash-like draft with a fixed random distribution per slot. Per case, one
PROPOSE of ``N`` requests goes through a real draft server on loopback
(``k3_l2_engines``: layer 1's server and ZeroMQ transport around a table
engine) and the real client (``RemotePlan`` with ``RemoteDraftLogits``), which
validates the reply, scatters it and samples every draft block with the
Gumbel sampler (a distinct seed and position per request) while writing the
draft-logits cache. Block verification then reads that cache
(``k3_l2_reference.block_rejection_sample``, a port of upstream's kernels,
checked against them in ``test_upstream_kernels_interpreted``). Each request
is one draw of the first two emitted tokens ``(x1, x2)``; when the verifier
emits one token, ``x2`` is drawn from the target given ``x1``, as the next
step would. Under exactness ``(x1, x2) ~ P = p_0(x1) p_1(x2 | x1)``.

Statistic and its false-fail bound: the L1 distance ``D`` between the
empirical law of ``N`` i.i.d. draws and the law ``L`` they follow satisfies
``E[D] <= sum_c sqrt(L_c (1 - L_c) / N)`` (Jensen, per cell), and moving one
draw changes ``D`` by at most ``2 / N``, so McDiarmid gives
``P(D >= E[D] + t) <= exp(-N t^2 / 2)``. With
``t = sqrt(2 ln(1 / delta) / N)`` the threshold
``tau(L) = sum_c sqrt(L_c (1 - L_c) / N) + t`` is crossed with probability at
most ``delta``. Each case tests the joint law (256 cells) and the marginal of
``x1`` (16 cells) at ``delta = 1e-8`` each: 16 tests, so with the fixed seeds
a correct implementation fails with probability below 1.6e-7 (< 1e-6),
treating the hash-based random streams as ideal. With ``N = 24000`` the
thresholds are about 0.06 (marginal) and 0.08 to 0.12 (joint).

Power: if the pipeline's true law is ``L'``, then with probability at least
``1 - delta`` its empirical distance to ``P`` is at least
``||L' - P||_1 - tau(L')``. The wrong-q tests compute ``L'`` exactly
(``block_verification_law``: drafts sampled from one q and verified against
another) and assert ``||L' - P||_1 > tau(P) + tau(L')`` before running: the
test then fails on them with probability at least ``1 - delta``, and the
run shows it does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from k3_l2_engines import CONTEXT_WIDTH, LoopbackServer, TableEngine, table_limits
from k3_l2_reference import (
    block_rejection_sample,
    block_verification_law,
    l1_threshold,
)

from vllm.k3_draft.client import DraftClient, ServerRequirements
from vllm.k3_draft.logits_codec import LogitsFormat
from vllm.k3_draft.plan import RemotePlan, StepInputs, StepRequest
from vllm.v1.worker.gpu.spec_decode.dspark.remote_draft_logits import (
    RemoteDraftLogits,
)
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
    PublishContext,
    RemoteStep,
)

V, K = 16, 3
DRAWS = 24_000
DELTA = 1e-8
MAX_MODEL_LEN = 1 << 16
TOPK = 4
TARGET_SCALE = 2.0


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@dataclass(frozen=True)
class Target:
    """Raw target logits of row j given the drafts before it, ``[V]*(j+1)``."""

    raw: list[np.ndarray]

    def law(self, temperature: float) -> list[np.ndarray]:
        return [_softmax(r / temperature) for r in self.raw]


@pytest.fixture(scope="module")
def target() -> Target:
    rng = np.random.default_rng(2026)
    return Target(
        [rng.normal(size=(V,) * (j + 1)) * TARGET_SCALE for j in range(K + 1)]
    )


def _draft_raw(seed: int, target: Target, far: bool) -> np.ndarray:
    """Pre-temperature draft logits ``[K, V]``: random, with the first slot
    near the target's first row or, when ``far``, where it has little mass."""
    raw = np.random.default_rng(seed).normal(size=(K, V)) * 1.5
    raw[0] = -1.5 * target.raw[0] if far else target.raw[0] + 0.5 * raw[0]
    return raw


@dataclass
class Run:
    """One case's draws and the distributions its draft cache holds."""

    x1: np.ndarray
    x2: np.ndarray
    q_cache: np.ndarray  # [K, V] pre-temperature logits sampled from
    temperature: float

    def q(self, logits: np.ndarray | None = None) -> np.ndarray:
        """Draft distributions ``[K, V]`` of ``logits`` (default: the
        sampled ones) at the run's temperature."""
        chosen = self.q_cache if logits is None else logits
        return _softmax(chosen.astype(np.float64) / self.temperature)

    def joint(self) -> np.ndarray:
        counts = np.zeros((V, V))
        np.add.at(counts, (self.x1, self.x2), 1.0)
        return counts / len(self.x1)


def _propose_and_verify(
    target: Target,
    case: int,
    draft_raw: np.ndarray,
    temperature: float,
    topk: int,
    use_fp64: bool,
    group: Any,
    corrupt: Callable[[torch.Tensor], None] | None = None,
) -> Run:
    """The pipeline of the module docstring for one case (anchor ``case``)."""
    table = torch.zeros(V, K, V)
    table[case] = torch.from_numpy(draft_raw)
    server = LoopbackServer(TableEngine(table_limits(DRAWS, K, MAX_MODEL_LEN), table))
    fmt = LogitsFormat(V, topk)
    extension = RemoteDraftLogits(
        fmt, K, DRAWS, MAX_MODEL_LEN, torch.device("cpu"), use_fp64, group
    )
    needs = ServerRequirements(
        method="dflash",
        capabilities=frozenset({fmt.capability}),
        context_width=CONTEXT_WIDTH,
        vocab_size=V,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=DRAWS,
        num_speculative_tokens=K,
        max_num_batched_tokens=1,
    )
    client = DraftClient(server.address, 60_000)
    try:
        plan = RemotePlan(client, needs, [extension])
        # Handshake first: a first step's own PING waits only a few
        # milliseconds for its PONG, less than a loaded machine may take.
        plan.connect()
        anchors = 1 + (np.arange(DRAWS) * 7) % 50_000
        requests = [
            StepRequest(f"c{case}-{i}", int(a), 0, case, 0, None)
            for i, a in enumerate(anchors)
        ]
        rows = torch.empty(0, CONTEXT_WIDTH, dtype=torch.bfloat16)
        result = plan.run(StepInputs(requests, K, rows))
    finally:
        client.close()
        server.close()
    assert (result.tokens >= 0).all(), "the PROPOSE failed"
    seeds = torch.from_numpy(
        np.random.default_rng(case).integers(-(2**62), 2**62, DRAWS)
    )
    temperatures = torch.full((DRAWS,), temperature)
    step = RemoteStep(
        input_batch=SimpleNamespace(
            idx_mapping=torch.arange(DRAWS), has_structured_output_reqs=False
        ),
        num_reqs=DRAWS,
        num_speculative_tokens=K,
        temperature=temperatures,
        seeds=seeds,
        staged=None,
        extensions=(extension,),
    )
    drafts = torch.full((DRAWS, K), -1, dtype=torch.int64)
    extension.publish(result.payloads[fmt.capability], PublishContext(step, drafts))
    assert (drafts >= 0).all()
    q_cache = extension.draft_logits[0].float().numpy()
    if corrupt is not None:
        corrupt(extension.draft_logits)
    d = drafts.numpy()
    raw = target.raw
    processed = (
        np.stack(
            [
                np.broadcast_to(raw[0], (DRAWS, V)),
                raw[1][d[:, 0]],
                raw[2][d[:, 0], d[:, 1]],
                raw[3][d[:, 0], d[:, 1], d[:, 2]],
            ],
            1,
        )
        / temperature
    )
    rows_per = K + 1
    sampled_ids = np.concatenate([np.full((DRAWS, 1), case), d], 1)
    positions = anchors[:, None] + np.arange(rows_per)
    idx = torch.arange(DRAWS)
    sampled, num_sampled = block_rejection_sample(
        torch.from_numpy(processed.astype(np.float32)).view(-1, V),
        extension.draft_logits,
        torch.from_numpy(sampled_ids).view(-1),
        torch.arange(DRAWS + 1) * rows_per,
        torch.from_numpy(positions).view(-1),
        idx,
        idx.repeat_interleave(rows_per),
        torch.arange(rows_per).repeat(DRAWS),
        temperatures,
        seeds,
        K,
        use_fp64=use_fp64,
    )
    x1 = sampled[:, 0].numpy()
    law1 = torch.from_numpy(target.law(temperature)[1][x1])
    continuation = torch.multinomial(
        law1, 1, generator=torch.Generator().manual_seed(case)
    )[:, 0]
    x2 = torch.where(num_sampled >= 2, sampled[:, 1], continuation).numpy()
    return Run(x1, x2, q_cache, temperature)


CASES = {
    "full-T0.7": (0, 0.7, False, False),
    "full-T1.0-fp64": (0, 1.0, True, False),
    "full-T1.6": (0, 1.6, False, False),
    "top4-T0.7": (TOPK, 0.7, False, False),
    "top4-T1.0": (TOPK, 1.0, False, False),
    "top4-T1.6-fp64": (TOPK, 1.6, True, False),
    "far-full-T1.0": (0, 1.0, False, True),
    "far-top4-T1.0": (TOPK, 1.0, False, True),
}


def _target_law(target: Target, temperature: float) -> np.ndarray:
    law = target.law(temperature)
    return law[0][:, None] * law[1]


def _distances(run: Run, law: np.ndarray) -> dict[str, tuple[float, float]]:
    """Per statistic: (L1 distance of the draws to ``law``, its threshold)."""
    joint = run.joint()
    return {
        "joint": (
            float(np.abs(joint - law).sum()),
            l1_threshold(law.reshape(-1), DRAWS, DELTA),
        ),
        "first": (
            float(np.abs(joint.sum(1) - law.sum(1)).sum()),
            l1_threshold(law.sum(1), DRAWS, DELTA),
        ),
    }


@pytest.mark.parametrize("name", list(CASES))
def test_emitted_tokens_follow_the_target(target, one_rank, reference_gumbel, name):
    topk, temperature, use_fp64, far = CASES[name]
    case = list(CASES).index(name)
    draft = _draft_raw(case, target, far)
    run = _propose_and_verify(
        target, case, draft, temperature, topk, use_fp64, one_rank
    )
    p0 = target.law(temperature)[0]
    q0 = run.q()[0]
    if far:
        assert 0.5 * np.abs(p0 - q0).sum() > 0.9, "the draft is not far from p"
    if topk:
        assert np.count_nonzero(q0 > 0) == topk, "q is not zero off the top-k"
    for statistic, (distance, threshold) in _distances(
        run, _target_law(target, temperature)
    ).items():
        assert distance < threshold, (name, statistic, distance, threshold)


def _wrong_q_run(target, one_rank, topk, corrupt_to):
    case = 12 + bool(topk)
    temperature = 1.0
    draft = np.random.default_rng(case).normal(size=(K, V)) * 2.5
    wrong = corrupt_to(draft)

    def corrupt(cache: torch.Tensor) -> None:
        cache[:] = torch.from_numpy(wrong).to(torch.bfloat16)

    run = _propose_and_verify(
        target, case, draft, temperature, topk, False, one_rank, corrupt
    )
    q_verify = run.q(torch.from_numpy(wrong).bfloat16().float().numpy())
    wrong_law = block_verification_law(target.law(temperature), run.q(), q_verify)
    return run, wrong_law


def _assert_detected(run: Run, target: Target, wrong_law: np.ndarray) -> None:
    """The exact power condition, then the detection itself."""
    law = _target_law(target, run.temperature)
    gaps = {
        "joint": np.abs(wrong_law - law).sum(),
        "first": np.abs(wrong_law.sum(1) - law.sum(1)).sum(),
    }
    wrong_thresholds = {s: tau for s, (_, tau) in _distances(run, wrong_law).items()}
    distances = _distances(run, law)
    powered = [
        statistic
        for statistic, (_, threshold) in distances.items()
        if gaps[statistic] > threshold + wrong_thresholds[statistic]
    ]
    assert powered, "the test has no power against this q"
    for statistic in powered:
        distance, threshold = distances[statistic]
        assert distance >= threshold, (statistic, distance, threshold)


def test_untruncated_q_with_topk_sampling_fails_the_test(
    target, one_rank, reference_gumbel
):
    run, wrong_law = _wrong_q_run(target, one_rank, TOPK, lambda raw: raw)
    _assert_detected(run, target, wrong_law)


def test_q_at_another_temperature_fails_the_test(target, one_rank, reference_gumbel):
    run, wrong_law = _wrong_q_run(target, one_rank, 0, lambda raw: raw / 2.5)
    _assert_detected(run, target, wrong_law)
