# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Remote draft transport for speculative decoding (layer 1 and up).

``protocol`` is the wire contract shared by the draft server
(``vllm.entrypoints.k3_dspark_rpc``) and the verifier-side client. Server-side
modules of this package import only the standard library, torch, numpy, pyzmq,
prometheus_client and ``vllm.logger``, so the draft server also runs on hosts
without vLLM's compiled extensions.
"""
