# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A deterministic toy target and verifier loop for the remote draft client.

* ``make_vllm_config``: a real ``VllmConfig`` for a tiny Qwen3 target with a
  DFlash (or DSpark) draft config, built from config.json files on disk.
* ``ToyTarget``: the target's aux hidden rows and greedy next token are pure
  functions of the token prefix. Its next token mostly *is* the draft's first
  token for the full exact context (so drafts get accepted), and sometimes a
  hash token (so they get rejected).
* ``DraftOracle``: an in-process reference engine with the server's weights;
  ``expected`` is what the server's engine must draft for an exact context.
* ``VerifierLoop``: a greedy verifier driving ``RemoteK3DSparkSpeculator.propose``
  with real ``InputBatch`` objects. Its request table is the smallest honest
  fake of upstream's ``RequestState`` (which needs a CUDA driver to build): it
  has the host token table ``all_token_ids_cpu`` and nothing else. Every step
  checks that each draft row is either all -1 or the oracle's draft for the
  request's exact committed context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm.k3_draft.engine import DraftLimits, ProposeBatch
from vllm.k3_draft.reference_engine import ReferenceEngine, ReferenceModelConfig
from vllm.v1.worker.gpu.input_batch import InputBatch

HIDDEN = 64
NUM_AUX = 3
WIDTH = HIDDEN * NUM_AUX
VOCAB = 1024
MAX_MODEL_LEN = 4096
WINDOW = 64
# Server-side tie tolerance: the server batches requests, the oracle does not,
# so float32 logits may differ in the last bits.
TIE_TOLERANCE = 1e-4
_MASK64 = (1 << 64) - 1


def init_single_rank_world(config: Any) -> None:
    """vLLM's distributed state as one gloo rank (TP and PP of 1) under
    ``config``; undo with ``destroy_model_parallel`` and
    ``destroy_distributed_environment``."""
    from k3_layer1_server import free_tcp_port

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)


def make_vllm_config(
    root: Path,
    method: str = "dflash",
    num_speculative_tokens: int = 3,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 512,
    data_parallel_size: int = 1,
    enable_dbo: bool = False,
) -> Any:
    """A real VllmConfig of a tiny target + draft (configs written to root);
    ``enable_dbo`` turns dual batch overlap on (with an all2all backend that
    supports it)."""
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    common = {
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    target = {**common, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4}
    draft = {**common, "num_hidden_layers": 1, "block_size": num_speculative_tokens}
    if method == "dflash":
        draft["architectures"] = ["DFlashDraftModel"]
        draft["dflash_config"] = {"target_layer_ids": [0, 1, 2], "mask_token_id": 1023}
    else:
        draft["architectures"] = ["Qwen3DSparkModel"]
        draft["target_layer_ids"] = [0, 1, 2]
        draft["mask_token_id"] = 1023
    for name, config in (("target", target), ("draft", draft)):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(
        model=str(root / "target"),
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
        dtype="bfloat16",
    )
    speculative_config = SpeculativeConfig(
        method=method,
        model=str(root / "draft"),
        num_speculative_tokens=num_speculative_tokens,
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
    )
    return VllmConfig(
        model_config=model_config,
        speculative_config=speculative_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=(
            ParallelConfig(
                data_parallel_size=data_parallel_size,
                enable_dbo=True,
                all2all_backend="deepep_low_latency",
            )
            if enable_dbo
            else ParallelConfig(data_parallel_size=data_parallel_size)
        ),
    )


def _mix(h: int, token: int) -> int:
    h = (h ^ (token + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9 & _MASK64
    return (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64


class DraftOracle:
    """The server's reference draft (same seed and shape), one request at a
    time: ``expected`` drafts from an exact context."""

    def __init__(self, k_max: int = 4) -> None:
        limits = DraftLimits(
            max_requests=1,
            max_batch_size=1,
            max_speculative_tokens=k_max,
            max_context_tokens=WINDOW,
            max_model_len=MAX_MODEL_LEN,
            block_size=16,
            window_size=WINDOW,
            prefix_cache_tokens=2 * WINDOW,
        )
        model = ReferenceModelConfig(
            method="dflash",
            vocab_size=VOCAB,
            context_width=WIDTH,
            hidden_size=HIDDEN,
            num_layers=2,
            num_heads=4,
            seed=0,
        )
        self.engine = ReferenceEngine(limits, model, torch.device("cpu"))
        self.engine.load()

    def expected(
        self, rows: torch.Tensor, start: int, anchor: int, end: int, k: int
    ) -> torch.Tensor:
        """Draft logits ``[k, V]`` at anchor position ``end`` with context
        rows ``rows`` at positions ``[start, end)`` (``start >= end - W``)."""
        batch = ProposeBatch(
            num_speculative_tokens=k,
            slots=[0],
            starts=[start],
            ends=[end],
            anchor_token_ids=[anchor],
            counts=[end - start],
            positions=torch.arange(start, end),
            rows=rows,
            want_logits=True,
        )
        output = self.engine.propose(batch)
        assert output.logits is not None
        return output.logits[0].float()


class ToyTarget:
    """Greedy target whose rows and next tokens are functions of the prefix.
    Its next token mostly is the first token of the draft of ``depth`` tokens
    for the exact context (the draft attends within its block, so that token
    depends on the depth asked for)."""

    def __init__(
        self, oracle: DraftOracle, disagree_every: int = 4, depth: int = 1
    ) -> None:
        self.oracle = oracle
        self.disagree_every = disagree_every
        self.depth = depth
        self._hash: dict[tuple[int, ...], int] = {}

    def prefix_hashes(self, tokens: list[int]) -> list[int]:
        out, h = [], 0
        for token in tokens:
            h = _mix(h, token)
            out.append(h)
        return out

    @staticmethod
    def row(prefix_hash: int) -> torch.Tensor:
        """The aux hidden row (bf16 ``[WIDTH]``) of a token whose prefix
        (itself included) hashes to ``prefix_hash``."""
        rng = np.random.default_rng(prefix_hash)
        return torch.from_numpy(rng.standard_normal(WIDTH, dtype=np.float32)).to(
            torch.bfloat16
        )

    def rows(self, tokens: list[int], start: int, end: int) -> torch.Tensor:
        hashes = self.prefix_hashes(tokens[:end])
        if end == start:
            return torch.empty(0, WIDTH, dtype=torch.bfloat16)
        return torch.stack([self.row(h) for h in hashes[start:end]])

    def next_token(self, tokens: list[int]) -> int:
        """The greedy token after ``tokens``."""
        key = tuple(tokens)
        if key not in self._hash:
            h = self.prefix_hashes(tokens)[-1]
            if h % self.disagree_every == 0:
                token = h % (VOCAB - 1)
            else:
                end = len(tokens) - 1
                start = max(0, end - WINDOW)
                logits = self.oracle.expected(
                    self.rows(tokens, start, end), start, tokens[end], end, self.depth
                )
                token = int(logits[0].argmax())
            self._hash[key] = token
        return self._hash[key]

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Target-only greedy decoding."""
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(self.next_token(tokens))
        return tokens


def check_draft(
    target: ToyTarget, tokens: list[int], start: int, end: int, draft: np.ndarray
) -> int:
    """Assert ``draft`` is what the server's engine drafts after the committed
    ``tokens[: end + 1]`` with valid context ``[start, end)``; returns the
    number of positions accepted as float ties."""
    first = max(start, end - WINDOW)
    logits = target.oracle.expected(
        target.rows(tokens, first, end), first, tokens[end], end, len(draft)
    )
    ties = 0
    for j, token in enumerate(draft.tolist()):
        best = int(logits[j].argmax())
        if token != best:
            gap = float(logits[j, best] - logits[j, token])
            assert gap <= TIE_TOLERANCE, (
                f"draft {draft.tolist()} at anchor {end} (start {start}) is not "
                f"the engine's draft {logits.argmax(-1).tolist()}"
            )
            ties += 1
    return ties


@dataclass
class ToyRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)
    row: int = -1
    # Tokens the runner prefills (upstream's ``prefill_len``): the prompt,
    # and the outputs too once resumed after preemption.
    prefill_len: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.prefill_len = len(self.prompt)

    @property
    def remaining(self) -> int:
        return len(self.prompt) + self.max_tokens - len(self.tokens)

    @property
    def done(self) -> bool:
        return self.remaining <= 0


@dataclass
class TokenTable:
    """The smallest honest fake of upstream's ``RequestState`` for the remote
    speculator: only the host token table it reads."""

    all_token_ids_cpu: torch.Tensor


@dataclass
class StepStats:
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    no_draft: int = 0
    ties: int = 0


class VerifierLoop:
    """A greedy verifier around a remote speculator (see the module docstring).

    ``step(batch)`` runs one verifier step over the named running requests:
    each either prefills a chunk of at most ``chunk`` tokens or decodes its
    last token plus the drafts of the previous step.
    """

    def __init__(
        self,
        speculator: Any,
        target: ToyTarget,
        table: TokenTable,
        max_num_reqs: int,
        k: int,
        chunk: int = 48,
    ) -> None:
        self.spec = speculator
        self.target = target
        self.table = table
        self.k = k
        self.chunk = chunk
        self.max_num_reqs = max_num_reqs
        self.requests: dict[str, ToyRequest] = {}
        self.free_rows = list(range(max_num_reqs))
        self.last_sampled = torch.zeros(max_num_reqs, 1, dtype=torch.int64)
        self.next_prefill = torch.zeros(1, max_num_reqs, dtype=torch.int32)
        self.stats = StepStats()

    # ---------------------------------------------------------- requests

    def add(
        self, request_id: str, prompt: list[int], max_tokens: int, computed: int = 0
    ) -> ToyRequest:
        """Admit a request; ``computed`` prompt tokens are a prefix-cache hit."""
        request = ToyRequest(request_id, prompt, max_tokens)
        request.num_computed = computed
        request.row = self.free_rows.pop(0)
        self._write_table(request)
        self.requests[request_id] = request
        return request

    def remove(self, request_id: str) -> ToyRequest:
        """Finish or preempt: the request's table row is freed for reuse."""
        request = self.requests.pop(request_id)
        self.table.all_token_ids_cpu[request.row].fill_(-7)
        self.free_rows.append(request.row)
        return request

    def resume(self, request: ToyRequest, computed: int) -> None:
        """Re-admit a preempted request with ``computed`` cached tokens."""
        request.num_computed = computed
        request.drafts = []
        request.prefill_len = len(request.tokens)
        request.row = self.free_rows.pop(0)
        self._write_table(request)
        self.requests[request.request_id] = request

    def _write_table(self, request: ToyRequest) -> None:
        row = self.table.all_token_ids_cpu[request.row]
        row.fill_(-7)
        row[: len(request.tokens)] = torch.tensor(request.tokens, dtype=torch.int32)

    # -------------------------------------------------------------- step

    def step(self, batch: list[str]) -> None:
        requests = [self.requests[rid] for rid in batch]
        positions, input_tokens, counts = [], [], []
        num_sampled, num_rejected = [], []
        hidden_rows = []
        prefilling = np.zeros(len(requests), dtype=np.bool_)
        for i, request in enumerate(requests):
            start = request.num_computed
            known = len(request.tokens)
            prefilling[i] = start < request.prefill_len
            if start < known - 1:
                # Prefill chunk (no drafts).
                count = min(self.chunk, known - start)
                scheduled = request.tokens[start : start + count]
                drafts: list[int] = []
            else:
                scheduled = [request.tokens[-1], *request.drafts]
                drafts = request.drafts
                count = len(scheduled)
            positions.append(torch.arange(start, start + count))
            counts.append(count)
            # The target's hidden rows of the scheduled tokens (drafts included).
            seen = request.tokens[:start] + [max(t, 0) for t in scheduled]
            hidden_rows.append(self.target.rows(seen, start, start + count))
            input_tokens += scheduled
            sampled, rejected = self._verify(request, start, count, drafts)
            num_sampled.append(sampled)
            num_rejected.append(rejected)
        drafts_out = self._propose(
            requests,
            counts,
            positions,
            hidden_rows,
            num_sampled,
            num_rejected,
            prefilling,
        )
        for i, request in enumerate(requests):
            self._check(request, drafts_out[i])

    def _verify(
        self, request: ToyRequest, start: int, count: int, drafts: list[int]
    ) -> tuple[int, int]:
        """Greedy verification; commits tokens; returns (sampled, rejected)."""
        known = len(request.tokens)
        if not drafts and start + count < known:
            request.num_computed = start + count
            self.next_prefill[0, request.row] = request.tokens[start + count]
            return 0, 0
        accepted = 0
        for draft in drafts:
            # The last token of a request is always a sampled (bonus) token.
            if request.remaining <= 1 or draft != self.target.next_token(
                request.tokens
            ):
                break
            request.tokens.append(draft)
            accepted += 1
        request.tokens.append(self.target.next_token(request.tokens))
        request.num_computed = len(request.tokens) - 1
        self.last_sampled[request.row, 0] = request.tokens[-1]
        row = self.table.all_token_ids_cpu[request.row]
        row[: len(request.tokens)] = torch.tensor(request.tokens, dtype=torch.int32)
        self.stats.accepted += accepted
        self.stats.rejected += len(drafts) - accepted
        return accepted + 1, len(drafts) - accepted

    def _propose(
        self,
        requests: list[ToyRequest],
        counts: list[int],
        positions: list[torch.Tensor],
        hidden_rows: list[torch.Tensor],
        num_sampled: list[int],
        num_rejected: list[int],
        prefilling: np.ndarray,
    ) -> np.ndarray:
        n = len(requests)
        num_tokens = sum(counts)
        query_start_loc_np = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc_np[1:])
        idx_np = np.array([r.row for r in requests], dtype=np.intp)
        rows = torch.cat(hidden_rows)
        aux = list(rows.split(HIDDEN, dim=-1))
        input_batch = make_input_batch(
            [r.request_id for r in requests],
            idx_np,
            query_start_loc_np,
            torch.cat(positions),
            num_tokens,
            prefilling,
            np.array([r.prefill_len for r in requests], dtype=np.int32),
        )
        drafts = self.spec.propose(
            input_batch,
            {},
            {},
            rows,
            aux,
            torch.tensor(num_sampled, dtype=torch.int32),
            torch.tensor(num_rejected, dtype=torch.int32),
            self.last_sampled,
            self.next_prefill,
            torch.zeros(self.max_num_reqs),
            torch.zeros(self.max_num_reqs, dtype=torch.int64),
        )
        assert drafts.shape == (n, self.k) and drafts.is_contiguous()
        return drafts.numpy().copy()

    def _check(self, request: ToyRequest, drafts: np.ndarray) -> None:
        """Every draft row is all -1 or the engine's draft for the exact
        committed context."""
        request.drafts = []
        if (drafts == -1).all():
            self.stats.no_draft += 1
            if not request.done:
                request.drafts = [-1] * self.k
            return
        assert (drafts >= 0).all(), f"partial draft row {drafts}"
        end = request.num_computed
        state = self.spec.plan.retained[request.request_id]
        assert state.end == end and not state.stale
        self.stats.ties += check_draft(
            self.target, request.tokens, state.start, end, drafts
        )
        self.stats.drafted += 1
        if not request.done:
            request.drafts = drafts.tolist()


def make_input_batch(
    req_ids: list[str],
    idx_mapping_np: np.ndarray,
    query_start_loc_np: np.ndarray,
    positions: torch.Tensor,
    num_tokens: int,
    is_prefilling: np.ndarray | None = None,
    prefill_len: np.ndarray | None = None,
) -> InputBatch:
    """A real InputBatch (CPU tensors) with the fields propose() reads
    (``is_prefilling``: none of the requests, unless given; ``prefill_len``:
    0 for each, unless given)."""
    n = len(req_ids)
    idx_mapping = torch.from_numpy(idx_mapping_np.astype(np.int64))
    query_start_loc = torch.from_numpy(query_start_loc_np.copy())
    num_scheduled = np.diff(query_start_loc_np).astype(np.int32)
    return InputBatch(
        req_ids=req_ids,
        num_reqs=n,
        num_reqs_after_padding=n,
        idx_mapping=idx_mapping,
        idx_mapping_np=idx_mapping_np,
        expanded_idx_mapping=idx_mapping,
        expanded_local_pos=torch.zeros(n, dtype=torch.int32),
        num_scheduled_tokens=num_scheduled,
        num_tokens=num_tokens,
        num_tokens_after_padding=num_tokens,
        num_draft_tokens=0,
        num_draft_tokens_per_req=None,
        query_start_loc=query_start_loc,
        query_start_loc_np=query_start_loc_np,
        seq_lens=torch.zeros(n, dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.zeros(n, dtype=torch.int32),
        dcp_local_seq_lens=None,
        num_computed_tokens_np=np.zeros(n, dtype=np.int32),
        prefill_len_np=(
            np.zeros(n, dtype=np.int32) if prefill_len is None else prefill_len
        ),
        num_computed_prefill_tokens_np=np.zeros(n, dtype=np.int32),
        is_prefilling_np=(
            np.zeros(n, dtype=np.bool_) if is_prefilling is None else is_prefilling
        ),
        has_prefill=False,
        decode_graph_eligible=True,
        input_ids=torch.zeros(num_tokens, dtype=torch.int32),
        positions=positions,
        is_padding=torch.zeros(num_tokens, dtype=torch.bool),
        logits_indices=query_start_loc[1:] - 1,
        cu_num_logits=torch.arange(n + 1, dtype=torch.int32),
        cu_num_logits_np=np.arange(n + 1, dtype=np.int32),
        has_structured_output_reqs=False,
        prompt_lens=None,
    )
