# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Plugin package for wire capabilities (see ``vllm.k3_draft.protocol``).

A higher layer adds a module here that registers its ``ReplyExtension`` in
``vllm.k3_draft.protocol.CAPABILITIES`` at import; the draft server imports
every module of this package at startup. Layer 1 ships none.
"""
