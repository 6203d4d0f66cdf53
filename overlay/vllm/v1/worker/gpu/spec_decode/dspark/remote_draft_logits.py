# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Probabilistic remote drafting: the verifier half of the draft-logits
capabilities (wire format: ``vllm.k3_draft.logits_codec``).

With ``draft_sample_method="probabilistic"`` the remote speculator asks each
PROPOSE for the draft's pre-temperature logits, the full vocabulary or, with
``VLLM_K3_DRAFT_LOGITS_TOPK=k``, the top-k slice of every drafted slot, and
``RemoteDraftLogits`` turns them into draft tokens and the draft-logits cache
that upstream's rejection sampler reads (``speculator.draft_logits``,
bf16 ``[max_num_reqs, K, V]``):

* ``consume`` (rank 0, host only, safe on a reply thread): validates the reply
  entry and frame (``decode_logits``) and copies it, in batch order, into one
  of ``num_staging_slots`` pinned staging slots; rows and slots the reply does
  not cover get no sample position. Before reusing a slot it waits for the
  device copy that last read it, unless the slot was selected (the stream's
  owner waited in ``prepare_staging``).
* ``publish`` (every TP rank, same order, device work only, no host sync):
  rank 0 copies the staging slot to the device, the step's sample positions
  and logits are broadcast from rank 0, top-k slices are scattered over a
  fill of the most negative finite bf16 (q is zero outside the top-k), and
  upstream's Gumbel sampler draws each slot's token on the standard draft
  stream (request seed mixed with the slot index, keyed by the position
  before the drafted token, temperature applied, fp64 when the model config
  asks) while it writes the slot's logits to the cache. A slot without a
  sample position (no reply for its request, past the model length, or past
  this step's draft width) is masked out of the kernel: it keeps no draft
  (-1) and its cache row is left untouched.
  In a batch with structured-output requests every row is first made a
  point mass at its most likely token (a grammar-refused draft is resampled
  from the target's distribution upstream, which is exact only then).

A step that drafts no tokens (it skips drafts), or whose requests are all
greedy (temperature 0) once the runner bound its temperatures
(``bind_sampling_states``), does not ask for the logits (``wanted``):
rejection reads no draft logits then, so the server's own draft tokens (none
when it skips drafts) stand and no cache row changes.

Deferred resolution (a higher layer) publishes a slot before its reply
arrives; ``deferral_safe``, ``prepare_staging``, ``select_staging``,
``staged_payload`` and ``clear_staging`` let it free, choose, read and empty
staging slots by number.

Device memory: the cache plus a sampling buffer of the same size; rank 0 also
pins ``num_staging_slots`` host copies of the largest reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm import envs
from vllm.distributed.parallel_state import GroupCoordinator, get_tp_group
from vllm.k3_draft.logits_codec import LogitsFormat, decode_logits
from vllm.k3_draft.plan import NO_DRAFT, Proposal, ProposeExtension
from vllm.logger import init_logger
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.sample.states import SamplingStates
    from vllm.v1.worker.gpu.spec_decode.dspark.remote_speculator import (
        PublishContext,
        RemoteK3DSparkSpeculator,
    )

logger = init_logger(__name__)

# Logit of the tokens outside a top-k slice: the most negative finite bf16.
# exp((FILL - max) / T) is exactly 0 at every temperature; below T = 1,
# FILL / T rounds to -inf in fp32, which is safe because every slot's largest
# logit is finite and below 2**16 in magnitude (the codec refuses others).
FILL = float(torch.finfo(torch.bfloat16).min)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Rows:
    """Per-request rows of one buffer: sample positions (int64 ``[K]``), then
    for top-k the ids (int32 ``[K, k]``) and the values' bf16 bit patterns
    (int16 ``[K, k]``), in one uint8 row of ``row_bytes``, so that a batch is
    one contiguous prefix."""

    def __init__(
        self, fmt: LogitsFormat, rows: int, k: int, device: torch.device, pin: bool
    ) -> None:
        topk = fmt.topk
        ids_at = 8 * k
        values_at = ids_at + 4 * k * topk
        row_bytes = _round_up(values_at + 2 * k * topk, 8)
        self.bytes = torch.zeros(
            rows, row_bytes, dtype=torch.uint8, device=device, pin_memory=pin
        )
        self.positions = self.bytes[:, :ids_at].view(torch.int64)
        # No sample position until a reply fills the row.
        self.positions.fill_(-1)
        self.ids: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        if topk:
            self.ids = self.bytes[:, ids_at:values_at].view(torch.int32)
            self.ids = self.ids.view(rows, k, topk)
            self.values = self.bytes[:, values_at : values_at + 2 * k * topk]
            self.values = self.values.view(torch.int16).view(rows, k, topk)


@dataclass
class _Staging:
    """A host copy of one reply, in batch order (rank 0; pinned on CUDA).

    ``dense``: full-vocabulary values' bf16 bit patterns (int16
    ``[max_num_reqs, K, V]``); top-k keeps its values in ``rows``. ``copied``
    is recorded after the device copy that reads this staging.
    """

    rows: _Rows
    dense: torch.Tensor | None
    copied: torch.cuda.Event | None


class RemoteDraftLogits(ProposeExtension):
    """See the module docstring. ``draft_logits`` is the rejection sampler's
    cache; ``num_staging_slots`` bounds how many consumed replies may await
    ``publish`` (a deferred resolution keeps at most one pending)."""

    #: Its staging can be published before the reply is consumed: the slot
    #: methods below (rank 0, host only; an index is taken modulo
    #: ``num_staging_slots``).
    deferral_safe = True

    def __init__(
        self,
        fmt: LogitsFormat,
        num_speculative_tokens: int,
        max_num_reqs: int,
        max_model_len: int,
        device: torch.device,
        use_fp64: bool,
        tp_group: GroupCoordinator,
        num_staging_slots: int = 2,
    ) -> None:
        self.format = fmt
        self.capability = fmt.capability
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.use_fp64 = use_fp64
        self.tp_group = tp_group
        vocab = fmt.vocab_size
        self.draft_logits = torch.full(
            (max_num_reqs, self.k, vocab), FILL, dtype=torch.bfloat16, device=device
        )
        self._dense = torch.full(
            (max_num_reqs * self.k, vocab), FILL, dtype=torch.bfloat16, device=device
        )
        self._rows = _Rows(fmt, max_num_reqs, self.k, device, pin=False)
        self._cols = torch.arange(self.k, dtype=torch.int32, device=device).repeat(
            max_num_reqs
        )
        self._cuda = device.type == "cuda"
        # The runner's host temperatures by request state (bind_temperatures).
        self._temperature: np.ndarray | None = None
        self._staging: list[_Staging] = []
        self._next = 0
        # The next consume fills a prepared slot (select_staging).
        self._selected = False
        if tp_group.rank_in_group == 0:
            host = torch.device("cpu")
            self._staging = [
                _Staging(
                    _Rows(fmt, max_num_reqs, self.k, host, pin=self._cuda),
                    None
                    if fmt.topk
                    else torch.empty(
                        (max_num_reqs, self.k, vocab),
                        dtype=torch.int16,
                        pin_memory=self._cuda,
                    ),
                    torch.cuda.Event() if self._cuda else None,
                )
                for _ in range(num_staging_slots)
            ]

    def bind_temperatures(self, temperature: np.ndarray) -> None:
        """Every rank: the runner's host temperatures by request state index
        (``SamplingStates.temperature.np``, written before a request's first
        step), which ``wanted`` reads."""
        self._temperature = temperature

    def wanted(self, input_batch: InputBatch, num_speculative_tokens: int) -> bool:
        """False when the step drafts no tokens (it skips drafts) or, once
        ``bind_temperatures`` ran, when every request of the step is
        greedy."""
        if num_speculative_tokens == 0:
            return False
        if self._temperature is None:
            return True
        idx = input_batch.idx_mapping_np[: input_batch.num_reqs]
        return bool(np.any(self._temperature[idx] != 0.0))

    def request_fields(self, num_speculative_tokens: int) -> dict[str, Any]:
        return self.format.request_fields()

    def prepare_staging(self, index: int) -> None:
        """Stream owner, before it starts the reply that fills slot ``index``:
        wait for the device copy that last read the slot. The reply thread
        then fills (``select_staging``, ``consume``) or empties it
        (``clear_staging``) without waiting: the copy that ``publish``
        enqueues for that very reply may already be parked behind the gate
        that only the reply thread releases."""
        staging = self.staged_payload(index)
        if staging.copied is not None:
            staging.copied.synchronize()

    def select_staging(self, index: int) -> None:
        """Make the next ``consume`` fill the prepared staging slot
        ``index``; later ones go on round robin from there (and wait)."""
        self._next = index % len(self._staging)
        self._selected = True

    def staged_payload(self, index: int) -> _Staging:
        """Slot ``index``'s payload for ``publish``: the object ``consume``
        returns when it fills that slot. ``publish`` reads what the slot
        holds when its copy runs, so the slot may still be filled or emptied
        until then."""
        return self._staging[index % len(self._staging)]

    def clear_staging(self, index: int) -> None:
        """Empty the prepared slot ``index``: publishing it then gives no
        draft and leaves every cache row untouched (as publishing None
        does)."""
        self._selected = False
        self.staged_payload(index).rows.positions.fill_(-1)

    def consume(
        self, metadata: dict[str, Any], frames: list[Any], proposal: Proposal
    ) -> _Staging:
        decoded = decode_logits(
            metadata,
            frames,
            self.format,
            proposal.anchor_positions,
            proposal.num_speculative_tokens,
            self.max_model_len,
        )
        staging = self._staging[self._next]
        self._next = (self._next + 1) % len(self._staging)
        if self._selected:
            self._selected = False
        elif staging.copied is not None:
            staging.copied.synchronize()
        rows, k = proposal.batch_rows, proposal.num_speculative_tokens
        positions = staging.rows.positions.numpy()
        positions.fill(-1)
        positions[rows, :k] = decoded.positions
        if decoded.ids is None:
            assert staging.dense is not None
            staging.dense.numpy()[rows, :k] = decoded.values
        else:
            assert staging.rows.ids is not None and staging.rows.values is not None
            staging.rows.ids.numpy()[rows, :k] = decoded.ids
            staging.rows.values.numpy()[rows, :k] = decoded.values
        return staging

    def publish(self, payload: _Staging | None, context: PublishContext) -> None:
        step = context.step
        n, k = step.num_reqs, self.k
        rows = self._rows
        dense = self._dense[: n * k]
        if self.tp_group.rank_in_group == 0:
            if payload is None:
                rows.positions[:n].fill_(-1)
            else:
                rows.bytes[:n].copy_(payload.rows.bytes[:n], non_blocking=True)
                if payload.dense is not None:
                    dense.view(torch.int16).copy_(
                        payload.dense[:n].view(n * k, -1), non_blocking=True
                    )
                if payload.copied is not None:
                    payload.copied.record()
        self.tp_group.broadcast(rows.bytes[:n], src=0)
        if not self.format.topk:
            self.tp_group.broadcast(dense.view(torch.uint8), src=0)
        positions = rows.positions[:n]
        valid = positions >= 0
        valid[:, step.num_speculative_tokens :] = False
        if rows.ids is not None and rows.values is not None:
            grid = dense.view(n, k, -1).fill_(FILL)
            grid.scatter_(2, rows.ids[:n].long(), rows.values[:n].view(torch.bfloat16))
        if step.input_batch.has_structured_output_reqs:
            # A draft the grammar refuses becomes "no draft" upstream, and the
            # rejection sampler then resamples that position from the
            # target's distribution, not from the residual max(p - q, 0):
            # exact only when q is a point mass. So with structured outputs in
            # the batch every slot drafts its most likely token, and the cache
            # row the rejection step reads is that point mass.
            top = dense.argmax(dim=-1, keepdim=True)
            dense.fill_(FILL).scatter_(1, top, 0.0)
        idx_mapping = step.input_batch.idx_mapping[:n].to(torch.int64)
        sampled = gumbel_sample(
            dense,
            torch.where(valid, idx_mapping[:, None], -1).view(-1),
            step.temperature,
            step.seeds,
            (positions - 1).view(-1),
            apply_temperature=True,
            is_drafting=True,
            logits_cache=self.draft_logits,
            logits_cache_col=self._cols[: n * k],
            use_fp64=self.use_fp64,
        )
        context.draft_tokens.copy_(torch.where(valid, sampled.view(n, k), NO_DRAFT))


def bind_sampling_states(speculator: object, sampling_states: SamplingStates) -> None:
    """Runner, once its sampler exists: bind a remote speculator's
    draft-logits extension to the sampler's temperatures (``wanted``); any
    other speculator is left alone."""
    for extension in getattr(speculator, "extensions", ()):
        if isinstance(extension, RemoteDraftLogits):
            extension.bind_temperatures(sampling_states.temperature.np)


def make_remote_draft_logits(
    speculator: RemoteK3DSparkSpeculator,
) -> RemoteDraftLogits | None:
    """The ``ProposeExtension`` factory: a ``RemoteDraftLogits`` when the
    speculative config drafts probabilistically (it then also becomes
    ``speculator.draft_logits``), else None. ``VLLM_K3_DRAFT_LOGITS_TOPK`` is
    validated either way."""
    config = speculator.vllm_config
    speculative_config = config.speculative_config
    assert speculative_config is not None
    vocab = config.model_config.get_vocab_size()
    topk = envs.VLLM_K3_DRAFT_LOGITS_TOPK
    if topk > vocab:
        raise ValueError(
            f"VLLM_K3_DRAFT_LOGITS_TOPK={topk} exceeds the vocabulary size {vocab}."
        )
    method = speculative_config.draft_sample_method
    if method != "probabilistic":
        if topk:
            logger.warning(
                "VLLM_K3_DRAFT_LOGITS_TOPK=%d has no effect with "
                "draft_sample_method=%r: only probabilistic drafting receives "
                "draft logits",
                topk,
                method,
            )
        return None
    extension = RemoteDraftLogits(
        LogitsFormat(vocab, topk),
        speculator.num_speculative_steps,
        speculator.max_num_reqs,
        config.model_config.max_model_len,
        speculator.device,
        config.model_config.use_fp64_gumbel,
        get_tp_group(),
    )
    speculator.draft_logits = extension.draft_logits
    logger.info(
        "Remote drafting samples from %s draft logits (%s)",
        f"top-{topk}" if topk else "full-vocabulary",
        extension.capability,
    )
    return extension
