# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The verdicts of ``ci/multi_rank.py`` on broken inputs: its comparison of a
kernel result with a reference fails past the layer-5 tolerances, its
cross-rank equality sees a rank that differs, and a check failing on one rank
only fails the check in the report rank 0 writes (real gloo groups of two
spawned processes)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "multi_rank.py"


def _module() -> Any:
    """The script as a module; its checks are replaced in the ranks' tests."""
    module: ModuleType | None = sys.modules.get("_multi_rank_under_test")
    if module is None:
        spec = importlib.util.spec_from_file_location("_multi_rank_under_test", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def _layer1_helpers() -> Any:
    """Layer 1's test helpers (a draft server process, loopback ports, the
    warm process), which the script uses too. Imported when called: the ranks
    that run kernels import this module, and must set Triton's interpreter
    before Triton loads."""
    folder = str(_module().TOY_TARGET_DIR)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import k3_layer1_server

    return k3_layer1_server


def _reference(rows: int = 100) -> tuple[Any, Any]:
    """A float64 reference (o, lse) of ``rows`` rows, two heads; row 0 saw no
    KV (-inf LSE, zero output)."""
    gen = torch.Generator().manual_seed(3)
    ref_o = torch.randn(rows, 2, 512, generator=gen, dtype=torch.float64)
    ref_lse = torch.randn(rows, 2, generator=gen, dtype=torch.float64)
    ref_o[0] = 0
    ref_lse[0] = float("-inf")
    return ref_o, ref_lse


def test_a_result_equal_to_the_reference_passes_the_comparison() -> None:
    ref_o, ref_lse = _reference()
    assert _module()._compare(ref_o.clone(), ref_lse.clone(), ref_o, ref_lse)["ok"]


def test_an_output_two_percent_off_in_norm_fails_the_comparison() -> None:
    ref_o, ref_lse = _reference()
    # Every row 2% off: within the per-row tolerance, past the norm one.
    verdict = _module()._compare(ref_o * 1.02, ref_lse.clone(), ref_o, ref_lse)
    assert not verdict["ok"]


def test_one_row_five_percent_off_fails_the_comparison() -> None:
    ref_o, ref_lse = _reference()
    o = ref_o.clone()
    o[7, 1] *= 1.05  # 0.5% of the norm over 100 rows: only the row catches it
    assert not _module()._compare(o, ref_lse.clone(), ref_o, ref_lse)["ok"]


def test_an_lse_off_by_three_thousandths_fails_the_comparison() -> None:
    ref_o, ref_lse = _reference()
    lse = ref_lse.clone()
    lse[5, 0] += 3e-3
    assert not _module()._compare(ref_o.clone(), lse, ref_o, ref_lse)["ok"]


def test_output_in_a_row_that_sees_no_kv_fails_the_comparison() -> None:
    ref_o, ref_lse = _reference()
    o = ref_o.clone()
    o[0, 0, 3] = 1.0
    assert not _module()._compare(o, ref_lse.clone(), ref_o, ref_lse)["ok"]


# ------------------------------------------------- two ranks on gloo


def _spawn(
    fn: Any, tmp_path: Path, *args: Any, ranks: int = 2, kernels: bool = False
) -> Any:
    """Run ``fn(rank, init_method, out, *args)`` on ``ranks`` processes; rank 0
    writes JSON to ``out``, which is returned parsed. Ranks that run Triton
    kernels (``kernels``) start afresh, so that Triton's interpreter is on
    before Triton loads; others fork from layer 1's warm process (torch and
    vllm imported already)."""
    import torch.multiprocessing as mp

    helpers = _layer1_helpers()
    if not kernels:
        helpers.warm_context()
    out = tmp_path / "rank0.json"
    init = f"tcp://127.0.0.1:{helpers.free_tcp_port()}"
    mp.start_processes(
        fn,
        args=(init, str(out), *args),
        nprocs=ranks,
        join=True,
        start_method="spawn" if kernels else "forkserver",
    )
    return json.loads(out.read_text())


def _spawn_beside_a_server(fn: Any, tmp_path: Path, *args: Any) -> Any:
    """``_spawn(fn, tmp_path, *args, server_address, workdir)`` while a real
    reference draft server (layer 1's test process) listens on loopback."""
    helpers = _layer1_helpers()
    server = helpers.DraftServerProcess(
        tmp_path / "server", address=f"tcp://127.0.0.1:{helpers.free_tcp_port()}"
    ).start()
    try:
        return _spawn(fn, tmp_path, *args, server.address, str(tmp_path))
    finally:
        server.stop()


@contextlib.contextmanager
def _gloo_rank(rank: int, init: str, out: str) -> Iterator[list[Any]]:
    """This rank in a gloo group of two for the block; what the block puts in
    the yielded list rank 0 writes to ``out`` as JSON. Kernels run under
    Triton's interpreter (set before Triton is imported)."""
    import torch.distributed as dist

    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    reported: list[Any] = []
    try:
        yield reported
        if rank == 0:
            Path(out).write_text(json.dumps(reported[0]))
    finally:
        dist.destroy_process_group()


def _equality_rank(rank: int, init: str, out: str) -> None:
    with _gloo_rank(rank, init, out) as reported:
        reported.append(_module()._all_equal_to_rank0(torch.tensor([5, 6 + rank])))


def test_a_tensor_that_differs_on_rank_one_is_not_equal_to_rank_zero(
    tmp_path: Path,
) -> None:
    assert _spawn(_equality_rank, tmp_path) == [False, [True, False]]


def _worker_args(module: Any, init: str, out: str, server: str, workdir: str) -> Any:
    return module.WorkerArgs(
        world_size=2,
        backend="gloo",
        init_method=init,
        server_address=server,
        result_path=out,
        workdir=workdir,
    )


def _worker_rank(rank: int, init: str, out: str, failing: str, workdir: str) -> None:
    module = _module()
    passed = {"status": "PASS", "summary": "stub"}

    def check(name: str) -> Any:
        def run(*_: Any) -> dict[str, Any]:
            if rank == 1 and name == failing:
                raise RuntimeError(f"{name} broke on rank 1")
            return dict(passed)

        return run

    # The checks are stubs; the verdict exchange under test is the real one.
    module.check_tp_broadcast = check("tp_broadcast")
    module.check_dcp_merge = check("dcp_merge")
    module.check_replicated_draft = check("replicated_draft")
    module._vllm_speculator_available = lambda: "stubbed checks"
    module.worker(rank, _worker_args(module, init, out, "tcp://127.0.0.1:1", workdir))


def test_a_check_raising_on_rank_one_only_fails_in_rank_zeros_report(
    tmp_path: Path,
) -> None:
    result = _spawn(_worker_rank, tmp_path, "dcp_merge", str(tmp_path))
    statuses = {name: check["status"] for name, check in result["checks"].items()}
    # The checks after the failed one do not run: another rank may be gone.
    assert statuses == {"tp_broadcast": "PASS", "dcp_merge": "FAIL"}
    assert result["checks"]["dcp_merge"]["summary"].startswith("another rank failed")


# ----------------------------------------------- the run's verdict (main)


def _main_with(result: dict[str, Any], out: str) -> None:
    """The script's ``main()`` with the world run, the draft server and the
    probe of the ranks' environment replaced: the verdict over the checks
    rank 0 reported is what is under test."""

    class Server:
        address = "tcp://127.0.0.1:1"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def start(self) -> Server:
            return self

        def stop(self) -> None:
            pass

    module = _module()
    sys.modules["k3_layer1_server"] = types.SimpleNamespace(  # type: ignore[assignment]
        DraftServerProcess=Server, free_tcp_port=lambda: 1
    )
    module.run_world = lambda n, server, workdir, timeout_s: dict(result, world_size=n)
    module._python_path_env = lambda: dict(os.environ)
    sys.exit(module.main(["--world-sizes", "1", "--out", out]))


PASS = {"status": "PASS", "summary": "ok"}
ALL_PASS = dict.fromkeys(("tp_broadcast", "dcp_merge", "replicated_draft"), PASS)


def _main_verdict(result: dict[str, Any], tmp_path: Path) -> tuple[int, bool]:
    """The exit status and verdict of ``_main_with`` in a warm process."""
    out = tmp_path / "report.json"
    log = tmp_path / "main.log"
    proc = _layer1_helpers().WarmProcess(_main_with, (result, str(out)), log)
    try:
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert out.exists(), log.read_text()[-4000:]
    return code, json.loads(out.read_text())["passed"]


def test_a_run_whose_checks_all_pass_passes(tmp_path: Path) -> None:
    result = {"backend": "gloo", "checks": ALL_PASS}
    assert _main_verdict(result, tmp_path) == (0, True)


@pytest.mark.parametrize(
    "result",
    [
        {"backend": "gloo", "checks": {**ALL_PASS, "dcp_merge": {"status": "SKIP"}}},
        {"backend": "gloo", "checks": {"tp_broadcast": PASS, "dcp_merge": PASS}},
        {"backend": "gloo", "checks": ALL_PASS, "error": "timed out after 300 s"},
    ],
    ids=["a-check-skipped", "a-check-missing", "the-world-errored"],
)
def test_a_run_with_a_check_that_did_not_pass_fails(
    result: dict[str, Any], tmp_path: Path
) -> None:
    assert _main_verdict(result, tmp_path) == (1, False)


# ------------------------------------ broken kernels' results fail a check


def _perturbed(fn: Any, broken: bool) -> Any:
    """``fn`` with its first output scaled by 1.1 where ``broken``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        o, lse = fn(*args, **kwargs)
        return (o * 1.1 if broken else o), lse

    return run


def _dcp_merge_rank(rank: int, init: str, out: str, broken_ranks: list[int]) -> None:
    with _gloo_rank(rank, init, out) as reported:
        module = _module()
        module.lse_merge = _perturbed(module.lse_merge, rank in broken_ranks)
        reported.append(module.check_dcp_merge(rank, 2, torch.device("cpu"))["status"])


@pytest.mark.parametrize(
    "broken_ranks", [[0, 1], [1]], ids=["on-every-rank", "on-rank-one-only"]
)
def test_a_dcp_merge_off_by_ten_percent_fails_the_check(
    broken_ranks: list[int], tmp_path: Path
) -> None:
    assert _spawn(_dcp_merge_rank, tmp_path, broken_ranks, kernels=True) == "FAIL"


def _replicated_rank(rank: int, init: str, out: str, breakage: str) -> None:
    with _gloo_rank(rank, init, out) as reported:
        module = _module()
        reported.append(_replicated_status(module, rank, breakage))


def _replicated_status(module: Any, rank: int, breakage: str) -> str:
    """The replicated-draft check's status with the draft attention broken
    as ``breakage`` says."""
    real = module._rank_draft_attention

    def attention(kernels: Any, sharded: bool, *args: Any) -> Any:
        if breakage == "sharded-as-replicated":
            return real(kernels, False, *args)
        broken = {
            "replicated-off-on-rank-one": not sharded and rank == 1,
            "replicated-off-dcp1": not sharded,
            "sharded-partial-off": sharded and rank == 1,
        }[breakage]
        return _perturbed(real, broken)(kernels, sharded, *args)

    module._rank_draft_attention = attention
    return module.check_replicated_draft(rank, 2, torch.device("cpu"))["status"]


@pytest.mark.parametrize(
    "breakage",
    [
        "replicated-off-on-rank-one",
        "replicated-off-dcp1",
        "sharded-as-replicated",
        "sharded-partial-off",
    ],
)
def test_a_broken_draft_kv_layout_fails_the_replicated_draft_check(
    breakage: str, tmp_path: Path
) -> None:
    assert _spawn(_replicated_rank, tmp_path, breakage, kernels=True) == "FAIL"


def _run_tp_broadcast_only(
    module: Any, rank: int, init: str, out: str, server: str, workdir: str
) -> None:
    """The script's worker with the other two checks stubbed to pass."""
    module.check_dcp_merge = lambda *_: {"status": "PASS"}
    module.check_replicated_draft = lambda *_: {"status": "PASS"}
    module.worker(rank, _worker_args(module, init, out, server, workdir))


def _tp_rank(
    rank: int, init: str, out: str, forced: str, server: str, workdir: str
) -> None:
    module = _module()

    class Proxy(module.FaultProxy):  # type: ignore[name-defined]
        """The fault proxy with every PROPOSE in mode ``forced``."""

        @property
        def mode(self) -> str:
            return forced

        @mode.setter
        def mode(self, value: str) -> None:
            pass

    module.FaultProxy = Proxy
    _run_tp_broadcast_only(module, rank, init, out, server, workdir)


@pytest.mark.parametrize(
    "forced",
    ["pass", "malformed"],
    ids=["the-faults-not-injected", "no-step-drafts"],
)
def test_drafts_that_do_not_follow_the_fault_plan_fail_the_tp_broadcast_check(
    forced: str, tmp_path: Path
) -> None:
    result = _spawn_beside_a_server(_tp_rank, tmp_path, forced)
    assert result["checks"]["tp_broadcast"]["status"] == "FAIL"


def _swapping_rank(rank: int, init: str, out: str, server: str, workdir: str) -> None:
    from vllm.distributed.parallel_state import GroupCoordinator

    real = GroupCoordinator.broadcast

    def broadcast(self: Any, input_: Any, src: int = 0) -> Any:
        output = real(self, input_, src)
        if rank == 1 and input_.dtype == torch.int64 and input_.dim() == 2:
            # Rank 1 gets its requests' drafts in the wrong rows: every row
            # stays a valid draft or a -1 row, only the ranks disagree.
            input_.copy_(input_.flip(0))
        return output

    GroupCoordinator.broadcast = broadcast
    _run_tp_broadcast_only(_module(), rank, init, out, server, workdir)


def test_drafts_that_differ_on_rank_one_fail_the_tp_broadcast_check(
    tmp_path: Path,
) -> None:
    result = _spawn_beside_a_server(_swapping_rank, tmp_path)
    check = result["checks"]["tp_broadcast"]
    assert check["status"] == "FAIL"
    assert "ranks differ" in check["summary"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-sizes", "abc"], "--world-sizes 'abc': give sizes of at least 1"),
        (["--world-sizes", "0"], "--world-sizes '0': give sizes of at least 1"),
        (["--timeout", "-1"], "--timeout -1.0: give a positive number of seconds"),
        (["--timeout", "nan"], "--timeout nan: give a positive number of seconds"),
    ],
)
def test_bad_arguments_are_usage_errors_before_any_rank_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _module().main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
