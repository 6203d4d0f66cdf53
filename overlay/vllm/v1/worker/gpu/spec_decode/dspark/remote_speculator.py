# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Remote DFlash/DSpark drafting: a speculator that proxies a draft server.

The draft model runs in a standalone server process
(``python -m vllm.entrypoints.k3_dspark_standalone``); ``init_speculator``
builds ``RemoteK3DSparkSpeculator`` when ``VLLM_K3_DRAFT_REMOTE_ADDRESS`` is set
(for method dspark also the legacy ``VLLM_K3_DSPARK_REMOTE_ADDRESS``). Rank 0 of
the tensor-parallel group talks to the server (``vllm.k3_draft.plan``); every
rank receives the draft tokens by broadcast from rank 0.

A proposal goes through three stages, so that a resolution strategy can move
the middle one off the critical path:

* ``stage`` (every rank, device side): rank 0 enqueues the device-to-host copies
  of the step's context rows and per-request facts;
* ``exchange`` (rank 0, host only, thread-safe with respect to the model
  runner): waits for those copies and runs the RPCs;
* ``publish`` (every rank, same order): scatters the tokens into the draft
  table, broadcasts them from rank 0 and lets each ``ProposeExtension`` the
  step asks for (``ProposeExtension.wanted``) publish its payload.

Extension points for higher layers: ``resolution`` (a ``ResolutionStrategy``;
``ImmediateResolution`` runs the three stages in ``propose``) and the
``ProposeExtension`` factories of ``vllm.k3_draft.plan``, discovered through
``vllm.k3_draft.protocol.load_capability_plugins``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm import envs
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.parallel_state import get_tp_group
from vllm.k3_draft.client import (
    CurveKeys,
    DraftClient,
    IncompatibleServerError,
    ServerRequirements,
)
from vllm.k3_draft.plan import (
    EXTENSION_FACTORIES,
    NO_DRAFT,
    ProposeExtension,
    RemotePlan,
    StepInputs,
    StepRequest,
    StepResult,
)
from vllm.k3_draft.protocol import load_capability_plugins
from vllm.k3_draft.security import load_certificate
from vllm.logger import init_logger
from vllm.v1.worker.gpu.dp_utils import DPSyncState
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.spec_decode.dspark.remote_selection import (
    naming_variable,
    remote_address_variable,
)
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
    get_eagle3_aux_layers_from_config,
)
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.states import RequestState

logger = init_logger(__name__)

REMOTE_METHODS = ("dflash", "dspark")


@dataclass
class StagedInputs:
    """Rank 0's host copies of one step, valid once ``event`` completed
    (``None``: the copies were synchronous).

    ``facts`` is int64 ``[3, R]``: rejected rows, first position and anchor
    token per request; ``prefilling`` whether each request prefills this step
    (the runner's ``is_prefilling_np``) and ``prefill_len`` how many tokens
    it prefills in all (``prefill_len_np``); ``rows`` the bf16 context rows of
    every scheduled token.
    """

    request_ids: list[str]
    idx_mapping: np.ndarray
    query_start_loc: np.ndarray
    prefilling: np.ndarray
    prefill_len: np.ndarray
    facts: torch.Tensor
    rows: torch.Tensor
    event: torch.cuda.Event | None


@dataclass
class RemoteStep:
    """One ``propose`` call as every rank sees it; ``staged`` on rank 0 only;
    ``extensions``: the speculator's extensions this step asks for."""

    input_batch: InputBatch
    num_reqs: int
    num_speculative_tokens: int
    temperature: torch.Tensor
    seeds: torch.Tensor
    staged: StagedInputs | None
    extensions: tuple[ProposeExtension, ...]


@dataclass(frozen=True)
class PublishContext:
    """What ``ProposeExtension.publish`` sees: the step and its broadcast
    ``[num_reqs, K]`` draft tokens (-1 where no draft)."""

    step: RemoteStep
    draft_tokens: torch.Tensor


class ResolutionStrategy(abc.ABC):
    """How ``propose`` turns a staged step into draft tokens."""

    @abc.abstractmethod
    def resolve(
        self, speculator: RemoteK3DSparkSpeculator, step: RemoteStep
    ) -> torch.Tensor:
        """The ``[num_reqs, K]`` draft tokens of ``step``, on every rank."""


class ImmediateResolution(ResolutionStrategy):
    """Exchange and publish inside ``propose`` (the synchronous path)."""

    def resolve(
        self, speculator: RemoteK3DSparkSpeculator, step: RemoteStep
    ) -> torch.Tensor:
        return speculator.publish(step, speculator.exchange(step))


def remote_curve_keys() -> CurveKeys | None:
    """The client's CurveZMQ keys from the environment, if configured; a
    ``ValueError`` naming the variable of a file that cannot serve."""
    server_key = envs.VLLM_K3_DRAFT_CURVE_SERVER_KEY
    client_key = envs.VLLM_K3_DRAFT_CURVE_CLIENT_KEY
    if server_key is None and client_key is None:
        return None
    if server_key is None or client_key is None:
        raise ValueError(
            "Set both VLLM_K3_DRAFT_CURVE_SERVER_KEY and "
            "VLLM_K3_DRAFT_CURVE_CLIENT_KEY, or neither."
        )
    with naming_variable("VLLM_K3_DRAFT_CURVE_SERVER_KEY"):
        server_public, _ = load_certificate(
            server_key, "the draft server's CURVE key", secret=False
        )
    with naming_variable("VLLM_K3_DRAFT_CURVE_CLIENT_KEY"):
        client_public, client_secret = load_certificate(
            client_key, "the client CURVE key", secret=True
        )
    return CurveKeys(server_public, client_public, client_secret)


class NoDraftIds:
    """The verifier's input ids around a step with remote drafts.

    A draft slot the remote draft left empty holds ``NO_DRAFT`` (-1) in the
    input ids, where upstream's rejection sampler reads it back (a draft it
    always rejects); no embedding may look it up (an eager one faults on the
    device). ``hide`` (before the forward) puts token 0 there and ``show``
    (before sampling) puts ``NO_DRAFT`` back; the model's outputs at those
    positions are never used, since verification stops at the empty slot.
    """

    def __init__(self) -> None:
        # The input ids last hidden and where they held NO_DRAFT.
        self._hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def hide(self, input_ids: torch.Tensor) -> None:
        self._hidden = (input_ids, input_ids < 0)
        input_ids.clamp_(min=0)

    def show(self) -> None:
        if self._hidden is not None:
            input_ids, empty = self._hidden
            input_ids.masked_fill_(empty, NO_DRAFT)
        self._hidden = None


class RemoteK3DSparkSpeculator(BaseSpeculator):
    """Proposes DFlash/DSpark drafts from a remote draft server."""

    supports_mm_inputs = False
    # Probabilistic draft logits (rejection sampling); a ProposeExtension of a
    # higher layer may provide them.
    draft_logits: torch.Tensor | None = None

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        req_states: RequestState,
        address: str,
    ) -> None:
        speculative_config = vllm_config.speculative_config
        assert speculative_config is not None
        method = speculative_config.method
        if method not in REMOTE_METHODS:
            raise ValueError(
                f"Remote drafting (VLLM_K3_DRAFT_REMOTE_ADDRESS) serves methods "
                f"{REMOTE_METHODS}, not {method!r}."
            )
        parallel_config = vllm_config.parallel_config
        # The plan takes itself for the server's only client: engines sharing
        # one server would FREE and CLEAR each other's requests. A dense
        # model's DP ranks are independent engines whose workers see
        # data_parallel_size=1 (reconfigure_for_independent_dp_rank); the DP
        # size the deployment was configured with survives in
        # elastic_ep_max_dp_size (at least data_parallel_size).
        dp_size = max(
            parallel_config.data_parallel_size,
            parallel_config.elastic_ep_max_dp_size or 1,
        )
        if dp_size > 1:
            raise ValueError(
                "Remote drafting serves one engine per draft server; "
                f"data_parallel_size={dp_size} is not supported."
            )
        if parallel_config.prefill_context_parallel_size > 1:
            raise ValueError(
                "Remote drafting does not support prefill context parallelism."
            )
        if getattr(vllm_config, "watermark_config", None) is not None:
            # Watermarked verification needs watermarked drafts, which the
            # draft server does not make.
            raise ValueError("Remote drafting does not support watermarking.")
        aux_layers = get_eagle3_aux_layers_from_config(speculative_config)
        if not aux_layers:
            raise ValueError(
                "Remote drafting needs the draft config to name the target "
                "layers it consumes (dflash_config.target_layer_ids or "
                "equivalent)."
            )
        model_config = vllm_config.model_config
        scheduler_config = vllm_config.scheduler_config
        self.vllm_config = vllm_config
        self.device = device
        self.num_speculative_steps: int = speculative_config.num_speculative_tokens
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.context_width = len(aux_layers) * model_config.get_hidden_size()
        self.draft_tokens = torch.full(
            (self.max_num_reqs, self.num_speculative_steps),
            NO_DRAFT,
            dtype=torch.int64,
            device=device,
        )
        self.resolution: ResolutionStrategy = ImmediateResolution()
        load_capability_plugins()
        self.extensions: list[ProposeExtension] = [
            extension
            for factory in EXTENSION_FACTORIES
            if (extension := factory(self)) is not None
        ]
        self.tp_group = get_tp_group()
        self.plan: RemotePlan | None = None
        if self.tp_group.rank_in_group != 0:
            return

        table = req_states.all_token_ids_cpu
        self._token_table = None if table is None else table.numpy()
        if self._token_table is None:
            logger.warning(
                "The token table has no host view: remote drafts of resumed "
                "requests cold-bootstrap instead of RECONNECTing."
            )
        pin = device.type == "cuda"
        self._host_facts = torch.empty(
            3, self.max_num_reqs, dtype=torch.int64, pin_memory=pin
        )
        self._host_rows = torch.empty(
            scheduler_config.max_num_batched_tokens,
            self.context_width,
            dtype=torch.bfloat16,
            pin_memory=pin,
        )
        needs = ServerRequirements(
            method=method,
            capabilities=frozenset(e.capability for e in self.extensions),
            context_width=self.context_width,
            vocab_size=model_config.get_vocab_size(),
            max_model_len=model_config.max_model_len,
            max_num_seqs=self.max_num_reqs,
            num_speculative_tokens=self.num_speculative_steps,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        )
        timeout_ms = envs.VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS
        curve = remote_curve_keys()
        with naming_variable(remote_address_variable()):
            client = DraftClient(address, timeout_ms, curve)
        self.plan = RemotePlan(
            client,
            needs,
            self.extensions,
            timing_log_interval=envs.VLLM_K3_DRAFT_TIMING_LOG_INTERVAL,
            # Equal token ids may stand for different hidden states under
            # LoRA adapters, multimodal inputs or prompt embeddings.
            share_prefixes=vllm_config.lora_config is None
            and not model_config.is_multimodal_model
            and not model_config.enable_prompt_embeds,
        )
        try:
            info = self.plan.connect()
        except IncompatibleServerError:
            client.close()
            raise
        except Exception as exc:
            logger.warning(
                "Draft server %s did not answer the handshake (%s); proposing no "
                "drafts until it does.",
                address,
                exc,
            )
        else:
            logger.info(
                "Remote %s drafting through %s (server %s, %d retained slots)",
                method,
                address,
                info.server_id,
                info.max_requests,
            )

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        """The draft's CUDA graphs live in the draft server."""

    def capture(self) -> None:
        """The draft's CUDA graphs live in the draft server."""

    @torch.inference_mode()
    def propose(
        self,
        input_batch: InputBatch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dp_sync_state: DPSyncState | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        num_reqs = input_batch.num_reqs
        if dummy_run or is_profile:
            # Dummy batches never reach the draft server.
            return self.draft_tokens[:num_reqs].fill_(NO_DRAFT)
        assert aux_hidden_states, "remote drafting needs the aux hidden states"
        if num_speculative_tokens is None:
            num_speculative_tokens = self.num_speculative_steps
        step = RemoteStep(
            input_batch=input_batch,
            num_reqs=num_reqs,
            num_speculative_tokens=num_speculative_tokens,
            temperature=temperature,
            seeds=seeds,
            staged=None,
            extensions=tuple(
                e
                for e in self.extensions
                if e.wanted(input_batch, num_speculative_tokens)
            ),
        )
        if self.plan is not None:
            step.staged = self.stage(
                input_batch,
                aux_hidden_states,
                num_sampled,
                num_rejected,
                last_sampled,
                next_prefill_tokens,
            )
        return self.resolution.resolve(self, step)

    def stage(
        self,
        input_batch: InputBatch,
        aux_hidden_states: list[torch.Tensor],
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
    ) -> StagedInputs:
        """Rank 0: enqueue the host copies of the step (see ``StagedInputs``)."""
        n, num_tokens = input_batch.num_reqs, input_batch.num_tokens
        idx = input_batch.idx_mapping[:n]
        first_rows = input_batch.query_start_loc[:n].long()
        anchors = torch.where(
            num_sampled[:n] > 0,
            last_sampled.reshape(-1)[idx],
            next_prefill_tokens[0, idx].long(),
        )
        facts = torch.stack(
            (num_rejected[:n].long(), input_batch.positions[first_rows], anchors)
        )
        rows = torch.cat([h[:num_tokens] for h in aux_hidden_states], dim=-1)
        host_facts = self._host_facts[:, :n]
        host_rows = self._host_rows[:num_tokens]
        non_blocking = self.device.type == "cuda"
        host_facts.copy_(facts, non_blocking=non_blocking)
        host_rows.copy_(rows, non_blocking=non_blocking)
        event = None
        if non_blocking:
            event = torch.cuda.Event()
            event.record()
        return StagedInputs(
            request_ids=list(input_batch.req_ids[:n]),
            idx_mapping=input_batch.idx_mapping_np[:n].copy(),
            query_start_loc=input_batch.query_start_loc_np[: n + 1].copy(),
            prefilling=input_batch.is_prefilling_np[:n].copy(),
            prefill_len=input_batch.prefill_len_np[:n].copy(),
            facts=host_facts,
            rows=host_rows,
            event=event,
        )

    def exchange(self, step: RemoteStep) -> StepResult | None:
        """Rank 0: the RPCs of ``step`` (host only); None on other ranks."""
        staged = step.staged
        if self.plan is None or staged is None:
            return None
        if staged.event is not None:
            staged.event.synchronize()
        rejected, first_positions, anchors = staged.facts.numpy()
        starts = staged.query_start_loc
        num_context = np.diff(starts) - rejected
        table = self._token_table
        requests = [
            StepRequest(
                request_id=rid,
                first_position=int(first_positions[i]),
                num_context=int(num_context[i]),
                anchor_token_id=int(anchors[i]),
                row_offset=int(starts[i]),
                tokens=None if table is None else table[staged.idx_mapping[i]],
                decoding=not staged.prefilling[i],
                prefill_len=int(staged.prefill_len[i]),
            )
            for i, rid in enumerate(staged.request_ids)
        ]
        return self.plan.run(
            StepInputs(
                requests, step.num_speculative_tokens, staged.rows, step.extensions
            )
        )

    def publish(self, step: RemoteStep, result: StepResult | None) -> torch.Tensor:
        """Every rank: the step's draft tokens, broadcast from rank 0."""
        drafts = self.draft_tokens[: step.num_reqs]
        if result is not None:
            drafts.fill_(NO_DRAFT)
            width = result.tokens.shape[1]
            drafts[:, :width].copy_(torch.from_numpy(result.tokens))
        self.tp_group.broadcast(drafts, src=0)
        context = PublishContext(step, drafts)
        payloads = {} if result is None else result.payloads
        for extension in step.extensions:
            extension.publish(payloads.get(extension.capability), context)
        return drafts
