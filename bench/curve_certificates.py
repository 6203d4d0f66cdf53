# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CurveZMQ certificates for the benchmarks that run the draft server over
CURVE, as any bind beyond loopback must."""

from __future__ import annotations

import os
import shutil

import zmq
import zmq.auth

from vllm.k3_draft.client import CurveKeys


class CurveCertificates:
    """A fresh server certificate and one authorized client's under
    ``directory``: ``server_flags`` for the draft server, the client's keys
    for a socket or a ``DraftClient``."""

    def __init__(self, directory: str) -> None:
        authorized = os.path.join(directory, "authorized")
        os.mkdir(authorized)
        server_public, self.server_secret_file = zmq.auth.create_certificates(
            directory, "server"
        )
        client_public, client_secret = zmq.auth.create_certificates(directory, "client")
        # The server refuses secret files other users can read.
        for path in (self.server_secret_file, client_secret):
            os.chmod(path, 0o600)
        shutil.copy(client_public, authorized)
        self.server_flags = [
            *("--curve-secret-key", self.server_secret_file),
            *("--curve-authorized-keys", authorized),
        ]
        client_keys = zmq.auth.load_certificate(client_secret)
        self.client_keys = CurveKeys(
            server_public=zmq.auth.load_certificate(server_public)[0],
            client_public=client_keys[0],
            client_secret=client_keys[1],
        )
