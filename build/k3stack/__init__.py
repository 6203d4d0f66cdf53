# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tooling that applies, refreshes, rebases, builds and qualifies the stack."""


class StackError(Exception):
    """A user-facing failure: printed as one line, nothing is changed."""
