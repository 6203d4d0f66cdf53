# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A ``GPUModelRunner`` and its ``Worker`` on CPU for layer 3's ordering
tests (``conftest`` offers the factories as fixtures).

``runner_factory`` builds the runner without ``__init__`` (it needs CUDA) and
gives it a real ``RemoteK3DSparkSpeculator`` and minimal fakes of the parts
that the real ``execute_model`` (request-state updates of a step without
tokens), ``sample_tokens`` and ``store_draft_tokens`` touch. ``sample_tokens``
runs the real ``GPUModelRunner.sample_tokens`` of one step whose forward has
run: the target's sampling (``sample``) and its device post-update
(``postprocess_sampled``, a Triton kernel) are stubbed, and so is upstream's
``AsyncOutput`` (CUDA streams and events). ``worker_factory`` builds a
``Worker`` of such a runner whose real ``compile_or_warm_up_model`` runs a
given stand-in of upstream's kernel warm-up (``warmup_kernels``)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from k3_runner_stubs import FakeEplb, Inert
from toy_target import HIDDEN, NUM_AUX

from vllm.config import CompilationMode
from vllm.k3_draft.deferred import DeferredResolution
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker import gpu_worker
from vllm.v1.worker.gpu import model_runner
from vllm.v1.worker.gpu.model_runner import ExecuteModelState, GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

NUM_SLOTS = 8


class DraftTable:
    """``req_states.draft_tokens`` that records every store with the owner of
    each slot at that moment."""

    def __init__(
        self, owners: dict[int, str], log: list[tuple], k: int, device: torch.device
    ) -> None:
        self.data = torch.full((NUM_SLOTS, k), -9, dtype=torch.int64, device=device)
        self.owners = owners
        self.log = log

    def __setitem__(self, idx: torch.Tensor, value: torch.Tensor) -> None:
        slots = idx.tolist()
        self.log.append(("store", [self.owners.get(s) for s in slots], slots))
        self.data[idx] = value

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.data[idx]


class FakeRequestStates:
    """The slots of ``RequestState`` (its real buffers need CUDA)."""

    def __init__(self, log: list[tuple], k: int, device: torch.device) -> None:
        self.log = log
        self.req_id_to_index: dict[str, int] = {}
        self.owners: dict[int, str] = {}
        self.draft_tokens = DraftTable(self.owners, log, k, device)
        self.num_computed_tokens_np = np.zeros(NUM_SLOTS, dtype=np.int32)
        self.prefill_len = SimpleNamespace(np=np.zeros(NUM_SLOTS, dtype=np.int32))
        self.num_computed_prefill_tokens = np.zeros(NUM_SLOTS, dtype=np.int32)
        # Read by ``sample_tokens`` (handed to the prompt-logprobs worker and
        # to ``propose``).
        self.all_token_ids = SimpleNamespace(gpu=None)
        self.num_computed_tokens = SimpleNamespace(gpu=None)
        self.prompt_len = SimpleNamespace(np=np.zeros(NUM_SLOTS, dtype=np.int32))
        self.last_sampled_tokens = (
            torch.arange(NUM_SLOTS, dtype=torch.int64, device=device).reshape(
                NUM_SLOTS, 1
            )
            + 40
        )
        self.next_prefill_tokens = torch.zeros(
            1, NUM_SLOTS, dtype=torch.int32, device=device
        )

    def add_request(self, req_id: str, **kwargs: Any) -> None:
        slot = min(set(range(NUM_SLOTS)) - set(self.owners))
        self.req_id_to_index[req_id] = slot
        self.owners[slot] = req_id
        self.log.append(("add", req_id, slot))

    def remove_request(self, req_id: str) -> int | None:
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is not None:
            del self.owners[slot]
            self.log.append(("remove", req_id, slot))
        return slot

    def apply_staged_writes(self) -> None:
        pass


class RecordingHandler:
    """``draft_tokens_handler``: records the output copy of the draft ids."""

    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    def set_draft_tokens(self, input_batch: Any, draft_tokens: torch.Tensor) -> None:
        self.log.append(("output_copy", list(input_batch.req_ids)))


class FakeSampler(Inert):
    """The sampling state ``sample_tokens`` hands to ``propose``; the host
    temperatures (``np``) share the CPU tensor's memory (a copy on CUDA)."""

    def __init__(self, temperature: torch.Tensor, seeds: torch.Tensor) -> None:
        self.sampling_states = SimpleNamespace(
            temperature=SimpleNamespace(gpu=temperature, np=temperature.cpu().numpy()),
            seeds=SimpleNamespace(gpu=seeds),
        )


class FakeAsyncOutput:
    """Upstream's ``AsyncOutput`` copies the sampled tokens on CUDA streams."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


def _sample(
    hidden_states: torch.Tensor, input_batch: Any, grammar_output: Any
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``GPUModelRunner.sample``: one token sampled, none rejected."""
    n, device = input_batch.num_reqs, hidden_states.device
    sampled = SimpleNamespace(
        sampled_token_ids=torch.zeros(n, 1, dtype=torch.int64, device=device)
    )
    return (
        sampled,
        torch.ones(n, dtype=torch.int32, device=device),
        torch.zeros(n, dtype=torch.int32, device=device),
    )


def runner_factory(monkeypatch: pytest.MonkeyPatch) -> Callable[..., GPUModelRunner]:
    """``make(speculator, log, k)``: a runner of ``speculator`` (its
    ``k3_deferred`` is the speculator's resolution strategy) whose stores and
    output copies of draft tokens and request adds/removes go to ``log``; its
    request states live on the speculator's device."""
    monkeypatch.setattr(model_runner, "AsyncOutput", FakeAsyncOutput)

    def make(
        speculator: Any,
        log: list[tuple],
        k: int,
        temperature: torch.Tensor | None = None,
        seeds: torch.Tensor | None = None,
    ) -> GPUModelRunner:
        runner = GPUModelRunner.__new__(GPUModelRunner)
        device = speculator.device
        parts: dict[str, Any] = dict(
            speculator=speculator,
            k3_deferred=(
                speculator.resolution
                if isinstance(speculator.resolution, DeferredResolution)
                else None
            ),
            k3_no_draft_ids=None,
            req_states=FakeRequestStates(log, k, device),
            draft_tokens_handler=RecordingHandler(log),
            num_speculative_steps=k,
            scheduler_config=SimpleNamespace(async_scheduling=True),
            lora_config=None,
            adaptive_verification=None,
            pcp_manager=None,
            pp_handler=None,
            pooling_runner=None,
            encoder_cache=None,
            aux_output_connector=None,
            kv_block_zeroer=None,
            execute_model_state=None,
            is_last_pp_rank=True,
            model=SimpleNamespace(compute_logits=None),
            main_stream=None,
            output_copy_stream=None,
            check_ep_fault=False,
            _draft_workspace_lane=0,
            eplb=FakeEplb(),
            prompt_logprobs_worker=Inert(),
            model_state=Inert(),
            block_tables=Inert(),
            lora_state=Inert(),
            kv_connector=Inert(),
            sampler=FakeSampler(
                torch.zeros(NUM_SLOTS, device=device)
                if temperature is None
                else temperature,
                torch.zeros(NUM_SLOTS, dtype=torch.int64, device=device)
                if seeds is None
                else seeds,
            ),
        )
        runner.__dict__.update(parts)
        # Not under test: the target's sampling and its device post-update.
        runner.__dict__["sample"] = _sample
        runner.__dict__["postprocess_sampled"] = lambda *args, **kwargs: None
        runner.__dict__["_merge_ec_connector_no_forward"] = lambda *args: None
        return runner

    return make


def sample_tokens(runner: GPUModelRunner, batch: Any, k: int, seed: int) -> Any:
    """The real ``sample_tokens`` of a step of ``batch`` whose forward ran:
    random aux hidden states (seeded by ``seed``) on the batch's device, ``k``
    draft tokens."""
    gen = torch.Generator().manual_seed(seed)
    aux = [
        torch.randn(batch.num_tokens, HIDDEN, generator=gen).to(batch.positions.device)
        for _ in range(NUM_AUX)
    ]
    runner.execute_model_state = ExecuteModelState(
        input_batch=batch,
        attn_metadata={},
        slot_mappings_by_layer={},
        hidden_states=aux[0],
        aux_hidden_states=aux,
        dp_sync_state=None,
        finished_req_ids=set(),
        ec_connector_output=None,
        cudagraph_stats=None,
        num_spec_tokens_to_schedule=k,
    )
    return runner.sample_tokens(None)


def scheduler_output(finished: set[str], new: list[str]) -> SchedulerOutput:
    """A step without tokens: ``finished`` leave, ``new`` are added."""
    output = SchedulerOutput.make_empty()
    output.finished_req_ids = finished
    output.scheduled_new_reqs = [
        SimpleNamespace(
            req_id=rid,
            prefill_token_ids=[1, 2, 3],
            prompt_len=3,
            sampling_params=None,
            num_computed_tokens=0,
            block_ids=(),
            lora_request=None,
            mm_features=[],
        )
        for rid in new
    ]
    return output


def worker_factory(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Worker]:
    """``make(runner, warm_up)``: a ``Worker`` (built without
    ``__init__``: CUDA) of ``runner``, eager, JIT warm-up on, whose kernel
    warm-up is ``warm_up(model_runner, execute_model, sample_tokens)``. The
    process-wide effects of the rest of its warm-up (kernel tuning, seeding,
    GC freeze, sync-check and JIT monitors) are off."""
    for name in (
        "kernel_warmup",
        "set_random_seed",
        "freeze_gc_heap",
        "maybe_attach_gc_debug_callback",
        "enable_gpu_sync_check",
    ):
        monkeypatch.setattr(gpu_worker, name, lambda *args, **kwargs: None)

    def make(runner: GPUModelRunner, warm_up: Callable[..., None]) -> Worker:
        monkeypatch.setattr(gpu_worker, "warmup_kernels", warm_up)
        worker = Worker.__new__(Worker)
        compilation = SimpleNamespace(
            mode=CompilationMode.NONE,
            backend="",
            compilation_time=0.0,
            encoder_compilation_time=0.0,
        )
        parts: dict[str, Any] = dict(
            model_runner=runner,
            use_v2_model_runner=True,
            vllm_config=SimpleNamespace(
                compilation_config=compilation,
                kernel_config=SimpleNamespace(enable_jit_warmup=True),
            ),
            compilation_config=compilation,
            model_config=SimpleNamespace(enforce_eager=True, seed=0),
            cache_config=SimpleNamespace(kv_cache_memory_bytes=None),
            parallel_config=SimpleNamespace(data_parallel_index=0),
            _maybe_activate_jit_monitor=lambda: None,
        )
        worker.__dict__.update(parts)
        return worker

    return make
