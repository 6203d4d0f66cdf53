# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The model runner's hook around empty remote draft slots (spec p1, fail
closed): the real ``GPUModelRunner.execute_model`` and ``sample_tokens`` of
one verification step whose drafts a failed-closed proposal left empty (-1).

The runner is built without ``__init__`` (it needs CUDA) and is given a real
``RemoteK3DSparkSpeculator`` (no server: it fails closed), a real
``NoDraftIds``, a real ``InputBatch`` and an embedding model on CPU. The
rest of the step (scheduling, attention metadata, the KV connector, the
output copy) is stubbed; the rejection sampler records the input ids it
reads the drafts from."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from k3_layer1_server import free_tcp_port
from k3_runner_stubs import FakeEplb, Inert
from toy_target import HIDDEN, NUM_AUX, make_input_batch

from vllm.config import CUDAGraphMode
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.gpu import model_runner
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import NoDraftIds

pytest_plugins = ("conftest_client",)

VOCAB = 64
K = 3
LAST_SAMPLED = 42


class FakeModelState(Inert):
    def prepare_inputs(self, *args: Any) -> dict[str, Any]:
        return {}


class EmbeddingModel(torch.nn.Module):
    """The target's forward: an eager embedding lookup (a -1 id faults) whose
    output is also the aux hidden states; and the ids it looked up."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.looked_up: list[list[int]] = []

    def forward(
        self, input_ids: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.looked_up.append(input_ids.tolist())
        hidden_states = self.embed(input_ids)
        return hidden_states, [hidden_states] * NUM_AUX

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden_states.shape[0], VOCAB)


class RecordingRejectionSampler:
    """Upstream's rejection sampler reads the drafts from the input ids."""

    def __init__(self) -> None:
        self.input_ids: list[list[int]] = []

    def __call__(self, logits: torch.Tensor, input_batch: Any, *args: Any) -> Any:
        self.input_ids.append(input_batch.input_ids.tolist())
        n = input_batch.num_reqs
        return SimpleNamespace(
            sampled_token_ids=torch.zeros(n, K + 1, dtype=torch.int64),
            num_sampled=torch.ones(n, dtype=torch.int32),
            num_rejected=torch.full((n,), K, dtype=torch.int32),
        )


def _make_runner(
    monkeypatch: pytest.MonkeyPatch, speculator: Any, input_batch: Any
) -> GPUModelRunner:
    """A runner whose ``prepare_inputs`` yields ``input_batch``, eager, one
    rank, no LoRA/encoder/DP/PP/ubatching."""
    batch_desc = SimpleNamespace(
        num_tokens=input_batch.num_tokens,
        cg_mode=CUDAGraphMode.NONE,
        num_ubatches=1,
        num_active_loras=0,
    )
    monkeypatch.setattr(
        model_runner, "dispatch_cg_and_sync_dp", lambda *a, **k: (batch_desc, None)
    )
    monkeypatch.setattr(model_runner, "build_slot_mappings_by_layer", lambda *a: {})
    monkeypatch.setattr(
        model_runner, "set_forward_context", lambda *a, **k: nullcontext()
    )
    monkeypatch.setattr(model_runner, "AsyncOutput", lambda **kwargs: kwargs)
    runner = GPUModelRunner.__new__(GPUModelRunner)
    batch_req_state = SimpleNamespace(
        num_tokens=input_batch.num_tokens, has_prefill=False
    )
    parts: dict[str, Any] = dict(
        speculator=speculator,
        k3_no_draft_ids=NoDraftIds(),
        # Layer 3's hook, when the stack has it: immediate resolution.
        k3_deferred=None,
        model=EmbeddingModel(),
        rejection_sampler=RecordingRejectionSampler(),
        sampler=SimpleNamespace(
            sampling_states=SimpleNamespace(
                temperature=SimpleNamespace(gpu=torch.zeros(8)),
                seeds=SimpleNamespace(gpu=torch.zeros(8, dtype=torch.int64)),
            )
        ),
        req_states=SimpleNamespace(
            all_token_ids=SimpleNamespace(gpu=None),
            num_computed_tokens=SimpleNamespace(gpu=None),
            prompt_len=SimpleNamespace(np=np.zeros(8, dtype=np.int32)),
            last_sampled_tokens=torch.zeros(8, 1, dtype=torch.int64),
            next_prefill_tokens=torch.zeros(1, 8, dtype=torch.int32),
            draft_tokens=torch.full((8, K), -9, dtype=torch.int64),
        ),
        num_speculative_steps=K,
        draft_tokens_handler=Inert(),
        observability_config=SimpleNamespace(cudagraph_metrics=False),
        vllm_config=None,
        model_config=None,
        kv_cache_config=None,
        attn_groups=[],
        cudagraph_manager=None,
        ubatch_runner=None,
        batch_sharder=None,
        pcp_manager=None,
        pp_handler=None,
        lora_config=None,
        encoder_cache=None,
        aux_output_connector=None,
        adaptive_verification=None,
        parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
        dcp_size=1,
        decode_query_len=K + 1,
        is_encoder_decoder=False,
        uses_inputs_embeds=False,
        use_aux_hidden_state_outputs=True,
        is_first_pp_rank=True,
        is_last_pp_rank=True,
        execute_model_state=None,
        main_stream=None,
        output_copy_stream=None,
        check_ep_fault=False,
        _draft_workspace_lane=0,
        eplb=FakeEplb(),
        model_state=FakeModelState(),
        block_tables=Inert(),
        kv_connector=Inert(),
        step_timing=Inert(),
        prompt_logprobs_worker=Inert(),
    )
    runner.__dict__.update(parts)
    # Not under test: request-state updates, input and attention preparation,
    # the device post-update.
    for name in (
        "update_pp_decode_requests",
        "finish_requests",
        "free_states",
        "add_requests",
        "update_requests",
        "postprocess_sampled",
    ):
        runner.__dict__[name] = lambda *args, **kwargs: None
    runner.__dict__["gather_batch_req_state"] = lambda *a: (batch_req_state, K + 1)
    runner.__dict__["prepare_inputs"] = lambda *a: input_batch
    runner.__dict__["prepare_attn"] = lambda *a: ({}, {})
    return runner


def test_empty_drafts_reach_the_rejection_sampler_but_not_the_embedding(
    monkeypatch, make_speculator
):
    # No server: the previous step's proposal failed closed (K empty drafts).
    speculator, _ = make_speculator(
        f"tcp://127.0.0.1:{free_tcp_port()}", timeout_ms=200
    )
    per = K + 1
    input_batch = make_input_batch(
        ["a"],
        np.array([3]),
        np.array([0, per], dtype=np.int32),
        torch.arange(10, 10 + per),
        per,
    )
    input_batch.input_ids = torch.tensor([LAST_SAMPLED] + [-1] * K)
    input_batch.num_draft_tokens = K
    input_batch.logits_indices = torch.arange(per)
    runner = _make_runner(monkeypatch, speculator, input_batch)
    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.num_scheduled_tokens = {"a": per}
    scheduler_output.total_num_scheduled_tokens = per
    scheduler_output.num_spec_tokens_to_schedule = K

    runner.execute_model(scheduler_output)
    runner.sample_tokens(None)

    assert runner.model.looked_up == [[LAST_SAMPLED] + [0] * K]
    assert runner.rejection_sampler.input_ids == [[LAST_SAMPLED] + [-1] * K]
