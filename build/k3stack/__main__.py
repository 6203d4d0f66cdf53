# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command line of the stack tooling; the nox sessions call it."""

from __future__ import annotations

import sys

from k3stack.cli import main

sys.exit(main())
