# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The remote speculator driven by vLLM's real v1 scheduler (CPU): the
harness of ``test_loop_real_scheduler`` (and of the layer-2 and layer-3 loops,
which import it and name it in ``pytest_plugins`` for its fixtures).

``SchedulerLoop`` runs upstream's ``Scheduler`` (or ``AsyncScheduler`` with the
engine core's batch queue of two) with DFlash speculative decoding, K = 3,
against ``HostRunner``: the host-side bookkeeping of the v2 GPU model runner
(``vllm/v1/worker/gpu/model_runner.py``: ``finish_requests``,
``add_requests``, ``update_requests``, ``gather_batch_req_state``,
``prepare_prefill_inputs``, ``combine_sampled_and_draft_tokens``, greedy
rejection sampling, ``get_num_sampled_and_rejected``, ``post_update``,
``propose``, ``store_draft_tokens``) written in plain Python over a host token
table (the real runner needs CUDA and Triton), with a ``toy_target.ToyTarget``
as the greedy target (a point mass: exact rejection sampling emits its token
at any temperature) and a real draft server process (reference engine,
retaining only ``max_num_seqs`` requests, so LRU eviction runs) on ipc. The
scheduler sees what a v2 runner returns: the sampled tokens (accepted drafts
and the bonus token) in a ``ModelRunnerOutput``, and -1 placeholder drafts.
Requests carry their sampling parameters' temperature and seed into the
runner's per-state ``temperature`` and ``seeds``, which ``propose`` gets.

Every step checks that each draft row is -1 or the server engine's draft for
the request's exact committed context, and that each request's output so far
is a prefix of target-only greedy decoding; each finished request's output
equals target-only decoding up to its stop. Subclasses of ``HostRunner`` add
checks or steps: ``verifying`` sees the draft slots the rejection step
verifies, ``_check`` the drafts ``store`` stores, ``before_propose`` the
step's ``InputBatch``.

Fixtures: ``tight_server`` (module), ``target`` (module), ``make_loop``.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from k3_layer1_server import DraftServerProcess
from toy_target import (
    HIDDEN,
    MAX_MODEL_LEN,
    DraftOracle,
    ToyTarget,
    check_draft,
    make_input_batch,
    make_vllm_config,
)

K = 3
BLOCK = 16
EOS = 1022
MAX_NUM_SEQS = 8


def make_config(
    root: Path,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    async_scheduling: bool,
) -> Any:
    """``make_vllm_config``'s target and draft with the scheduler and cache
    settings of a serving engine (chunked prefill, prefix caching)."""
    config = make_vllm_config(
        root, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    config.scheduler_config.async_scheduling = async_scheduling
    config.scheduler_config.enable_chunked_prefill = True
    config.cache_config.enable_prefix_caching = True
    config.cache_config.block_size = BLOCK
    return config


def make_scheduler(config: Any, num_blocks: int) -> Any:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    config.cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(config)
    cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
    scheduler = cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        block_size=BLOCK,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
    )
    assert scheduler.use_v2_model_runner
    return scheduler


class CachedOracle:
    """``DraftOracle.expected`` memoised (the sync and async runs of a test
    ask for the same contexts)."""

    def __init__(self, oracle: DraftOracle) -> None:
        self.oracle = oracle
        self._cache: dict[tuple, torch.Tensor] = {}

    def expected(
        self, rows: torch.Tensor, start: int, anchor: int, end: int, k: int
    ) -> torch.Tensor:
        key = (rows.view(torch.int16).numpy().tobytes(), start, anchor, end, k)
        if key not in self._cache:
            self._cache[key] = self.oracle.expected(rows, start, anchor, end, k)
        return self._cache[key]


@dataclass
class Stats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    preemptions: int = 0
    prefix_hits: int = 0
    padded_prefills: int = 0
    chunks: int = 0
    # Requests whose stop (max_tokens, stop token) cut a step's sampled tokens.
    cut_in_block: int = 0
    # Request steps verifying fewer than K draft slots.
    short_verifies: int = 0
    # The numbers of drafts proposed per step.
    k_used: set[int] = field(default_factory=set)


class HostRunner:
    """The v2 model runner's request state and step, on the host (see the
    module docstring); ``execute`` runs one ``SchedulerOutput``."""

    def __init__(
        self, speculator: Any, target: ToyTarget, table: Any, max_num_reqs: int
    ) -> None:
        self.spec = speculator
        self.target = target
        # The host view of RequestState.all_token_ids: never cleared, like
        # the real one (rows keep a finished request's tokens).
        self.table = table.all_token_ids_cpu
        self.max_num_reqs = max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.free_indices = list(range(max_num_reqs))
        n = max_num_reqs
        self.prefill_len = np.zeros(n, dtype=np.int32)
        self.total_len = np.zeros(n, dtype=np.int64)
        self.num_computed = np.zeros(n, dtype=np.int64)  # the device value
        self.num_computed_np = np.zeros(n, dtype=np.int64)  # the host mirror
        self.num_computed_prefill = np.zeros(n, dtype=np.int64)
        self.last_sampled = torch.zeros(n, 1, dtype=torch.int64)
        self.next_prefill = torch.zeros(1, n, dtype=torch.int32)
        self.draft_tokens = torch.zeros(n, K, dtype=torch.int64)
        # SamplingStates.temperature and .seeds (a random seed when unset).
        self.temperature = torch.zeros(n, dtype=torch.float32)
        self.seeds = torch.zeros(n, dtype=torch.int64)
        self._seed_rng = random.Random(0)
        self.stats = Stats()
        self.last_req_ids: list[str] = []
        self.last_num_spec = 0
        # The last step's sampled tokens by request, before any stop trims them.
        self.last_sampled_lists: dict[str, list[int]] = {}

    # -------------------------------------------------------- requests

    def _remove(self, rid: str) -> None:
        idx = self.req_id_to_index.pop(rid, None)
        if idx is not None:
            self.free_indices.append(idx)

    def _add(self, new: Any) -> None:
        self._remove(new.req_id)
        idx = self.free_indices.pop()
        self.req_id_to_index[new.req_id] = idx
        tokens = list(new.prefill_token_ids)
        self.prefill_len[idx] = len(tokens)
        self.total_len[idx] = len(tokens)
        self.table[idx, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        self.num_computed[idx] = new.num_computed_tokens
        self.num_computed_np[idx] = new.num_computed_tokens
        self.num_computed_prefill[idx] = new.num_computed_tokens
        self.draft_tokens[idx].zero_()
        params = new.sampling_params
        self.temperature[idx] = params.temperature
        seed = params.seed
        self.seeds[idx] = (
            self._seed_rng.randrange(-(2**63), 2**63) if seed is None else seed
        )
        if new.num_computed_tokens:
            self.stats.prefix_hits += 1

    # ------------------------------------------------------------ step

    def execute(self, so: Any) -> Any:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        for rid in sorted(so.finished_req_ids | so.preempted_req_ids):
            self._remove(rid)
        self.stats.preemptions += len(so.preempted_req_ids)
        for new in so.scheduled_new_reqs:
            self._add(new)
        cached = so.scheduled_cached_reqs
        for rid, nct in zip(cached.req_ids, cached.num_computed_tokens):
            self.num_computed_np[self.req_id_to_index[rid]] = nct
        np.minimum(
            self.num_computed_np, self.prefill_len, out=self.num_computed_prefill
        )
        self.last_req_ids = []
        self.last_sampled_lists = {}
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT

        spec_tokens = so.scheduled_spec_decode_tokens
        req_ids = sort_batch_req_ids(so.num_scheduled_tokens, spec_tokens, 1 + K)
        idx_np = np.array([self.req_id_to_index[r] for r in req_ids], dtype=np.intp)
        is_prefilling = self.num_computed_prefill[idx_np] < self.prefill_len[idx_np]
        counts, positions, rows = [], [], []
        num_sampled, num_rejected, sampled_lists = [], [], []
        for rid, idx in zip(req_ids, idx_np):
            q = so.num_scheduled_tokens[rid]
            nd = len(spec_tokens.get(rid, ()))
            nc = int(self.num_computed[idx])
            prefill_len = int(self.prefill_len[idx])
            inputs = self.table[idx, nc : nc + q].tolist()
            if nc < prefill_len:
                nxt = nc + q
                self.next_prefill[0, idx] = (
                    int(self.table[idx, nxt]) if nxt < prefill_len else 0
                )
                self.stats.chunks += 1
                if nd:
                    self.stats.padded_prefills += 1
            seq_len = nc + q
            num_logits = nd + 1
            if 0 < nd < K:
                self.stats.short_verifies += 1
            # The draft slots verification reads: -1 in a step starting
            # within the prefill (gather_draft_sampled's placeholders).
            verified = [-1] * nd
            if seq_len > prefill_len:
                if seq_len - num_logits >= prefill_len:
                    inputs[q - num_logits] = int(self.last_sampled[idx, 0])
                if nd:
                    inputs[q - nd :] = self.draft_tokens[idx, :nd].tolist()
                    if seq_len - num_logits >= prefill_len:
                        verified = inputs[q - nd :]
                        self.verifying(rid, int(idx), verified)
            # The forward (NoDraftIds puts token 0 where no draft is).
            seen = self.table[idx, :nc].tolist() + [max(t, 0) for t in inputs]
            rows.append(self.target.rows(seen, nc, seq_len))
            positions.append(torch.arange(nc, seq_len))
            counts.append(q)
            # Rejection sampling against the point-mass target.
            out: list[int] = []
            if seq_len >= prefill_len:
                first = seq_len - num_logits
                for j in range(nd):
                    token = self.target.next_token(seen[: first + j + 1])
                    out.append(token)
                    if verified[j] != token:
                        break
                else:
                    out.append(self.target.next_token(seen[:seq_len]))
                self.stats.accepted += len(out) - 1
                self.stats.rejected += num_logits - len(out)
            ns = len(out)
            nr = num_logits - ns if ns else 0
            # post_update
            if ns:
                self.last_sampled[idx, 0] = out[-1]
                tl = int(self.total_len[idx])
                self.table[idx, tl : tl + ns] = torch.tensor(out, dtype=torch.int32)
                self.total_len[idx] = tl + ns
            self.num_computed[idx] = nc + q - nr
            num_sampled.append(ns)
            num_rejected.append(nr)
            sampled_lists.append(out)

        num_spec = 0 if so.skip_drafts else so.num_spec_tokens_to_schedule
        if num_spec:
            self.stats.k_used.add(num_spec)
        drafts = self._propose(
            req_ids,
            idx_np,
            counts,
            positions,
            rows,
            num_sampled,
            num_rejected,
            is_prefilling,
            num_spec,
        )
        self.store(req_ids, idx_np, drafts, num_spec)
        self.last_req_ids = req_ids
        self.last_num_spec = num_spec
        self.last_sampled_lists = dict(zip(req_ids, sampled_lists))
        self.stats.steps += 1
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            # Copies: the scheduler trims them in place at a stop.
            sampled_token_ids=[list(out) for out in sampled_lists],
        )

    def store(
        self, req_ids: list[str], idx_np: np.ndarray, drafts: torch.Tensor, k: int
    ) -> None:
        """``store_draft_tokens``: the step's drafts (``k`` wide) into the
        request state, after ``_check``."""
        drafts[:, k:] = -1
        self.draft_tokens[torch.from_numpy(idx_np.astype(np.int64))] = drafts
        self._check(req_ids, idx_np, drafts, k)

    def before_propose(self, input_batch: Any) -> None:
        """Called with the step's ``InputBatch`` right before ``propose``."""

    def verifying(self, rid: str, idx: int, drafts: list[int]) -> None:
        """Called with the draft slots a step verifies for ``rid`` (state
        row ``idx``), before its forward; -1 where no draft."""

    def _propose(
        self,
        req_ids: list[str],
        idx_np: np.ndarray,
        counts: list[int],
        positions: list[torch.Tensor],
        rows: list[torch.Tensor],
        num_sampled: list[int],
        num_rejected: list[int],
        is_prefilling: np.ndarray,
        num_spec: int,
    ) -> torch.Tensor:
        n = len(req_ids)
        qsl = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        hidden = torch.cat(rows)
        input_batch = make_input_batch(
            req_ids,
            idx_np,
            qsl,
            torch.cat(positions),
            int(qsl[-1]),
            is_prefilling,
            self.prefill_len[idx_np].copy(),
        )
        self.before_propose(input_batch)
        drafts = self.spec.propose(
            input_batch,
            {},
            {},
            hidden,
            list(hidden.split(HIDDEN, dim=-1)),
            torch.tensor(num_sampled, dtype=torch.int32),
            torch.tensor(num_rejected, dtype=torch.int32),
            self.last_sampled,
            self.next_prefill,
            self.temperature,
            self.seeds,
            num_speculative_tokens=num_spec,
        )
        assert drafts.shape == (n, K) and drafts.is_contiguous()
        return drafts.clone()

    def _check(
        self, req_ids: list[str], idx_np: np.ndarray, drafts: torch.Tensor, k: int
    ) -> None:
        """Each draft row is -1 or the engine's draft for the exact committed
        context of its request (anchor at its device num_computed)."""
        for i, (rid, idx) in enumerate(zip(req_ids, idx_np)):
            row = drafts[i, :k].numpy()
            if k == 0 or (row == -1).all():
                continue
            assert (row >= 0).all(), f"partial draft row {row} of {rid}"
            end = int(self.num_computed[idx])
            state = self.spec.plan.retained[rid]
            assert state.end == end and not state.stale, (rid, state, end)
            tokens = self.table[idx, : end + 1].tolist()
            check_draft(self.target, tokens, state.start, end, row)
            self.stats.drafted += 1

    def take_draft_token_ids(self) -> Any:
        """``DraftTokensHandler.get_draft_tokens`` without structured output:
        placeholders only."""
        from vllm.v1.outputs import DraftTokenIds

        return DraftTokenIds(
            self.last_req_ids, [[-1] * self.last_num_spec for _ in self.last_req_ids]
        )


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 0.0
    seed: int | None = None

    def expected(self, target: ToyTarget) -> list[int]:
        """Target-only greedy output up to the first stop, max_tokens or the
        model length."""
        max_tokens = min(self.max_tokens, MAX_MODEL_LEN - len(self.prompt))
        out = target.generate(self.prompt, max_tokens)[len(self.prompt) :]
        stops = set(self.stop_token_ids) | {EOS}
        for i, token in enumerate(out):
            if token in stops:
                return out[: i + 1]
        return out


class SchedulerLoop:
    """Engine core around ``HostRunner``: ``step`` is ``EngineCore.step`` +
    ``post_step`` (sync scheduling) or ``step_with_batch_queue`` with a queue
    of two (async scheduling)."""

    def __init__(self, scheduler: Any, runner: HostRunner, target: ToyTarget):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(BLOCK, sha256)
        self.scheduler = scheduler
        self.runner = runner
        self.target = target
        self.async_scheduling = scheduler.scheduler_config.async_scheduling
        self.queue: deque = deque()
        self.specs: dict[str, Spec] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, list[int]] = {}
        self.aborted: set[str] = set()
        self.steps = 0
        # The step each finished request finished at.
        self.finished_at: dict[str, int] = {}

    def add(self, rid: str, spec: Spec) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(
            temperature=spec.temperature,
            seed=spec.seed,
            max_tokens=spec.max_tokens,
            stop_token_ids=spec.stop_token_ids,
        )
        params.update_from_generation_config({}, EOS)
        request = Request(
            request_id=rid,
            prompt_token_ids=list(spec.prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        self.specs[rid] = spec
        self.outputs[rid] = []
        self.scheduler.add_request(request)

    def abort(self, rids: list[str]) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        for rid in rids:
            self.aborted.add(rid)
            self.finished[rid] = self.outputs[rid]
            self.finished_at[rid] = self.steps

    def reusable(self) -> list[str]:
        """Finished ids that no step in flight still names: an async step
        scheduled before the finish was known is collected one step later.
        (Reusing an id with its step in flight hands that step's tokens to
        the new request in upstream's scheduler; the frontend makes ids
        unique, so the engine core never sees that.)"""
        return [r for r, at in self.finished_at.items() if at < self.steps - 2]

    def reuse(self, rid: str) -> None:
        del self.finished[rid], self.finished_at[rid]
        self.aborted.discard(rid)

    def step(self) -> None:
        self.steps += 1
        scheduler = self.scheduler
        if not self.async_scheduling:
            if not scheduler.has_requests():
                return
            so = scheduler.schedule()
            out = self.runner.execute(so)
            sampled = self.runner.last_sampled_lists
            self._collect(scheduler.update_from_output(so, out), sampled)
            if so.total_num_scheduled_tokens > 0:
                scheduler.update_draft_token_ids(self.runner.take_draft_token_ids())
            return
        if scheduler.has_requests():
            so = scheduler.schedule()
            out = self.runner.execute(so)
            executed = so.total_num_scheduled_tokens > 0
            self.queue.appendleft((so, out, self.runner.last_sampled_lists))
            if len(self.queue) < 2 and (executed or scheduler.has_requests()):
                return
        elif not self.queue:
            return
        so, out, sampled = self.queue.pop()
        self._collect(scheduler.update_from_output(so, out), sampled)

    def _collect(
        self, engine_outputs: dict[int, Any], sampled: dict[str, list[int]]
    ) -> None:
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                rid = output.request_id
                if rid in self.aborted:
                    continue
                self.outputs[rid] += output.new_token_ids
                want = self.specs[rid].expected(self.target)
                got = self.outputs[rid]
                assert got == want[: len(got)], (rid, got, want)
                if output.finish_reason is not None:
                    assert got == want, (rid, got, want)
                    self.finished[rid] = got
                    self.finished_at[rid] = self.steps
                    if len(output.new_token_ids) < len(sampled[rid]):
                        self.runner.stats.cut_in_block += 1

    def busy(self) -> bool:
        return self.scheduler.has_requests() or bool(self.queue)

    def run(
        self, max_steps: int = 2000, each: Callable[[int], None] | None = None
    ) -> None:
        """Step until every request finished; ``each(n)`` before step n."""
        for n in range(max_steps):
            if each is not None:
                each(n)
            if not self.busy():
                return
            self.step()
        raise AssertionError("requests did not finish")


def run_together(loop: SchedulerLoop, specs: dict[str, Spec]) -> None:
    """Add every one of ``specs`` at once and run them all to the end."""
    for rid, spec in specs.items():
        loop.add(rid, spec)
    loop.run()
    assert loop.finished.keys() == specs.keys()


def run_in_order(
    loop: SchedulerLoop, specs: dict[str, Spec], late: str, abort: tuple[str, ...]
) -> list[str]:
    """Run ``specs`` to the end, one added every other step in their order,
    except ``late``: held back until step 6, then added first. At step 21
    those of ``abort`` still running are aborted; returns them."""
    pending = [rid for rid in specs if rid != late]
    aborted: list[str] = []

    def drive(n: int) -> None:
        if n == 6:
            pending.insert(0, late)
        if pending and n % 2 == 0:
            rid = pending.pop(0)
            loop.add(rid, specs[rid])
        if n == 21:
            aborted.extend(rid for rid in abort if rid not in loop.finished)
            loop.abort(aborted)

    loop.run(each=drive)
    assert loop.finished.keys() == specs.keys()
    return aborted


def run_random_schedule(
    loop: SchedulerLoop,
    rng: random.Random,
    prefixes: list[list[int]],
    temperatures: tuple[float, ...],
    requests: int = 20,
) -> None:
    """Run ``requests`` seeded random arrivals to the end: prompts on one of
    ``prefixes``, random lengths and max_tokens, a stop token on 30% of them,
    temperatures from ``temperatures`` and random seeds; 5% of steps abort
    a running request, and 30% of arrivals take a finished id once one may
    be reused. An idle engine always gets a request (else the run ends
    early)."""
    added: list[str] = []

    def new_spec() -> Spec:
        prompt = rng.choice(prefixes) + prompt_tokens(
            rng.randrange(10**6), rng.randrange(0, 20)
        )
        stops = []
        if rng.random() < 0.3:
            stops = [loop.target.generate(prompt, rng.randrange(1, 12))[-1]]
        temperature = rng.choice(temperatures)
        seed = rng.choice((None, rng.randrange(-(2**40), 2**40)))
        return Spec(prompt, rng.randrange(1, 40), stops, temperature, seed)

    arrivals = 0

    def drive(n: int) -> None:
        nonlocal arrivals
        if arrivals < requests and (not loop.busy() or rng.random() < 0.8):
            done = loop.reusable()
            if done and rng.random() < 0.3:
                rid = rng.choice(sorted(done))
                loop.reuse(rid)
            else:
                rid = f"r{arrivals}"
                added.append(rid)
            arrivals += 1
            loop.add(rid, new_spec())
        running = [rid for rid in added if rid not in loop.finished]
        if running and rng.random() < 0.05:
            loop.abort([rng.choice(running)])

    loop.run(each=drive)
    assert arrivals == requests and set(added) == loop.finished.keys()


def prompt_tokens(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 1 for i in range(length)]


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A draft server retaining as many requests as the engine runs
    (``max_num_seqs``): finished ones are evicted least recently used first."""
    server = DraftServerProcess(
        tmp_path_factory.mktemp("tight"), max_requests=MAX_NUM_SEQS
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def target(oracle: DraftOracle) -> ToyTarget:
    # The depth the verifier drafts at: drafts get accepted, so stops land
    # inside accepted blocks.
    return ToyTarget(CachedOracle(oracle), depth=K)  # type: ignore[arg-type]


@pytest.fixture
def make_loop(
    tmp_path: Path, tight_server: Any, make_speculator: Any, target: ToyTarget
) -> Callable[..., SchedulerLoop]:
    """``make(async_scheduling, ...)``: a ``SchedulerLoop`` on the tight
    server; ``runner_cls`` runs its steps, ``configure(config)`` edits the
    ``VllmConfig`` before the speculator is built."""

    def make(
        async_scheduling: bool,
        max_num_batched_tokens: int = 64,
        num_blocks: int = 1000,
        k_per_batch_size: list[tuple[int, int, int]] | None = None,
        timeout_ms: int = 2000,
        runner_cls: type[HostRunner] = HostRunner,
        configure: Callable[[Any], None] | None = None,
    ) -> SchedulerLoop:
        config = make_config(
            tmp_path / f"cfg{int(async_scheduling)}",
            MAX_NUM_SEQS,
            max_num_batched_tokens,
            async_scheduling,
        )
        spec_config = config.speculative_config
        spec_config.num_speculative_tokens_per_batch_size = k_per_batch_size
        if configure is not None:
            configure(config)
        speculator, table = make_speculator(
            tight_server.address, config=config, timeout_ms=timeout_ms
        )
        assert speculator.plan.server is not None
        runner = runner_cls(speculator, target, table, MAX_NUM_SEQS)
        return SchedulerLoop(make_scheduler(config, num_blocks), runner, target)

    return make
