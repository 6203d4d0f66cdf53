# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command line of the stack tooling; the nox sessions call it."""

import sys

if sys.version_info < (3, 11):
    # Before any import of the tooling, which needs 3.11's standard library
    # (tomllib): one line rather than a traceback.
    found = ".".join(str(part) for part in sys.version_info[:3])
    sys.exit(
        f"error: the tooling needs Python 3.11.4 or later, this is Python {found}; "
        "run nox with a newer Python"
    )

from k3stack.cli import main  # noqa: E402

sys.exit(main())
