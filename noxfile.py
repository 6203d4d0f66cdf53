# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The user interface of the overlay: one nox session per task.

The logic lives in ``build/k3stack`` (standard library only), so apply,
refresh, rebase and build run in nox's own interpreter with no environment to
create; qualify, lint, typecheck, gpu and bench get environments of their own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
REQUIREMENTS = ROOT / "build" / "requirements-qualify.txt"
TOOLS = ["ruff==0.17.6", "mypy==2.4.1"]
LINT_PATHS = ["overlay", "build", "tests", "bench", "ci", "noxfile.py"]

nox.options.sessions = ["apply", "build"]
# `nox -s apply build` must not build after a failed apply.
nox.options.stop_on_first_error = True
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"


def _stack(session: nox.Session, *args: str) -> None:
    session.run(
        sys.executable,
        "-m",
        "k3stack",
        *args,
        env={"PYTHONPATH": str(ROOT / "build")},
        external=True,
    )


@nox.session(venv_backend="none")
def apply(session: nox.Session) -> None:
    """Lay out the pinned upstream and commit each layer (``-- --upto N``)."""
    _stack(session, "apply", *session.posargs)


@nox.session(venv_backend="none")
def refresh(session: nox.Session) -> None:
    """Write the work tree's layer commits back to patches/ and overlay/."""
    _stack(session, "refresh", *session.posargs)


@nox.session(venv_backend="none")
def rebase(session: nox.Session) -> None:
    """Classify every layer on another upstream (``-- --to VERSION``)."""
    _stack(session, "rebase", *session.posargs)


@nox.session(venv_backend="none")
def build(session: nox.Session) -> None:
    """Patched wheel, image context and lock from the applied tree."""
    _stack(session, "build", *session.posargs)


@nox.session(venv_backend="none")
def validate(session: nox.Session) -> None:
    """Check the series and the overlay ownership."""
    _stack(session, "validate")


@nox.session
def qualify(session: nox.Session) -> None:
    """Every prefix of the stack: apply, install, import, suites (``-- --layer N``)."""
    session.install("-r", str(REQUIREMENTS))
    _stack(
        session,
        "qualify",
        "--python",
        str(Path(session.bin) / "python"),
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check; also validates the series."""
    _stack(session, "validate")
    session.install(TOOLS[0])
    session.run("ruff", "check", *LINT_PATHS)
    session.run("ruff", "format", "--check", *LINT_PATHS)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the overlay, the tooling, the benchmarks, this file and the
    tests (each test folder on its own: they are rootless pytest folders whose
    conftest and helper modules share names)."""
    session.install(TOOLS[1], "nox", "pytest", "numpy", "pyzmq", "prometheus_client")
    build_dir = str(ROOT / "build")
    session.run(
        "mypy",
        "overlay",
        "build",
        "bench",
        "ci",
        "noxfile.py",
        env={"MYPYPATH": build_dir},
    )
    for folder in sorted(p for p in (ROOT / "tests").iterdir() if p.is_dir()):
        if not list(folder.glob("*.py")):
            continue
        path = os.pathsep.join([build_dir, str(ROOT / "tests" / "layer1"), str(folder)])
        session.run("mypy", str(folder.relative_to(ROOT)), env={"MYPYPATH": path})


def _has_cuda(session: nox.Session, python: str) -> bool:
    """Whether torch under ``python`` sees a CUDA device (False without torch)."""
    probe = session.run(
        python,
        "-c",
        "import torch; print(torch.cuda.is_available())",
        silent=True,
        success_codes=[0, 1],
        external=True,
    )
    return "True" in str(probe)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU-marked tests, the multi-rank checks and the GPU benchmark, on a
    machine with CUDA (``ci/gpu-h200.sh``); skipped with one line elsewhere."""
    if not _has_cuda(session, "python3"):
        session.skip("no CUDA device here: the GPU tests run on a machine with one")
    session.run("bash", str(ROOT / "ci" / "gpu-h200.sh"), external=True)


# bench/bench_<name>.py: (needs a CUDA GPU, extra arguments).
BENCHMARKS: dict[str, tuple[bool, tuple[str, ...]]] = {
    "remote_rpc": (False, ()),
    "draft_logits": (False, ()),
    "propose_legs": (False, ()),
    "client_plan": (False, ()),
    "server_phases": (False, ()),
    "draft_server_gpu": (True, ()),
    "deferred_resolve": (True, ()),
    "fused_mla_verify": (
        True,
        (
            "--upstream-kernel",
            str(ROOT / ".work/tree/vllm/v1/attention/ops/triton_decode_attention.py"),
        ),
    ),
}


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmarks against the applied stack (run `nox -s apply` first):
    all of them, or those named (`nox -s bench -- remote_rpc draft_logits`);
    the GPU ones only where CUDA is available. Each writes
    `dist/bench/<name>.json`. Figures are written down with the command that
    produced them, never asserted."""
    scripts = {p.stem[len("bench_") :] for p in (ROOT / "bench").glob("bench_*.py")}
    if scripts != BENCHMARKS.keys():
        session.error(
            f"bench/ and BENCHMARKS differ: {sorted(scripts ^ BENCHMARKS.keys())}"
        )
    unknown = sorted(set(session.posargs) - BENCHMARKS.keys())
    if unknown:
        session.error(f"unknown benchmarks {unknown}; known: {sorted(BENCHMARKS)}")
    session.install("-r", str(REQUIREMENTS))
    python = str(Path(session.bin) / "python")
    site = ROOT / ".work" / "site"
    _stack(session, "site", "--python", python, "--dest", str(site))
    cuda = _has_cuda(session, python)
    out = ROOT / "dist" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    for name in session.posargs or BENCHMARKS:
        needs_gpu, args = BENCHMARKS[name]
        if needs_gpu and not cuda:
            session.log(f"bench_{name}: skipped, needs a CUDA GPU")
            continue
        session.run(
            "python",
            str(ROOT / "bench" / f"bench_{name}.py"),
            *args,
            "--out",
            str(out / f"{name}.json"),
            env={"PYTHONPATH": str(site)},
        )
