# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pinned upstream release (``build/pin.toml``)."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import tomllib

from k3stack import StackError

PIN_FILE = Path(__file__).resolve().parent.parent / "pin.toml"


@dataclass(frozen=True)
class Artifact:
    """One upstream file, identified by name, size and sha256."""

    filename: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    commit: str
    sdist: Artifact
    wheels: dict[str, Artifact]
    base_image: str

    def wheel(self, machine: str | None = None) -> Artifact:
        """The wheel for ``machine`` (default: this machine's architecture)."""
        arch = machine or platform.machine()
        arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(arch.lower(), arch)
        try:
            return self.wheels[arch]
        except KeyError:
            raise StackError(
                f"no pinned {self.name} wheel for architecture {arch!r} "
                f"(pinned: {', '.join(sorted(self.wheels))})"
            ) from None


def load_pin(path: Path = PIN_FILE) -> Pin:
    """Read and check the pin file."""
    try:
        data = tomllib.loads(path.read_text())
        up = data["upstream"]
        return Pin(
            name=up["name"],
            version=up["version"],
            commit=up["commit"],
            sdist=Artifact(**up["sdist"]),
            wheels={k: Artifact(**v) for k, v in up["wheels"].items()},
            base_image=data["image"]["base"],
        )
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError) as e:
        raise StackError(f"{path}: invalid pin file ({type(e).__name__}: {e})") from e
