# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused MLA verification decode vs upstream's unfused Triton path, one run.

For each case (batch x context x query_len x heads, KV dtype) both paths run
on the same inputs: a paged KV cache (page 64, pages in random order, random
values), random bf16 queries, every request at the same context with causal
verify rows. Upstream's ``triton_decode_attention.py`` is loaded standalone
(``--upstream-kernel``) and called as vLLM 0.33.0's ``TritonMLAImpl``
calls it: one decode row per query token, block-table rows repeated, per-row
causal extents, its ``num_kv_splits`` choice. The metadata each path needs is
prepared once outside the timed region; each path is captured in a CUDA graph
and the graph replays are timed (median, ``triton.testing.do_bench``, which
clears the L2 between runs).

Reported per case: milliseconds, speedup, unique-KV bandwidth
(batch x context x 576 x bytes per element over the time), that bandwidth as
a share of the device-to-device copy bandwidth measured in the same run (the
copy counts bytes read plus bytes written, so 100% means reading the KV once
as fast as a copy moves bytes), the useful attention FLOP/s as a share of
a bf16 matmul measured in the same run, and the ceiling of the copy share:
what the case would reach if its useful FLOPs ran at that matmul's rate and
nothing else took time (below 100% where the products, not the bytes, bound
the case). ``--sweep`` also times alternative tilings of the fused kernel on
the target cases.

Usage::

    python bench/bench_fused_mla_verify.py \\
        --upstream-kernel .upstream/triton_decode_attention.py --out out.json
"""

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import triton
import triton.runtime.errors
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layer5"))
from cli_types import existing_file, output_file
from k3_standalone import (  # noqa: E402
    load_fused_verify,
    load_upstream_decode,
    make_upstream_verify,
    upstream_num_kv_splits,
)

PAGE_SIZE = 64
SM_SCALE = 192**-0.5
K_SCALE = 0.05
KiB = 1024
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (at least ~20 timed runs)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    estimate = start.elapsed_time(end) / 3
    return triton.testing.do_bench(
        fn,
        warmup=max(25.0, 3 * estimate),
        rep=max(100.0, 25 * estimate),
        return_mode="median",
    )


def _graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture ``fn`` (already run once, so compiled) in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_copy_gbps(nbytes: int = 4 * KiB**3) -> float:
    """Device-to-device copy, bytes read plus bytes written per second / 1e9."""
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def measure_matmul_tflops(n: int = 8192) -> float:
    """bf16 n x n x n matmul on random data, TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=BF16)
    b = torch.randn(n, n, device="cuda", dtype=BF16)
    ms = _time_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


class Workload:
    """Paged KV and queries of one (batch, context, KV dtype)."""

    def __init__(self, batch: int, context: int, kv_dtype: torch.dtype) -> None:
        pages = context // PAGE_SIZE
        num_blocks = batch * pages
        self.batch, self.context, self.kv_dtype = batch, context, kv_dtype
        self.cache = torch.empty(
            num_blocks, PAGE_SIZE, 576, dtype=kv_dtype, device="cuda"
        )
        for chunk in self.cache.split(4096):
            values = torch.randn(chunk.shape, device="cuda")
            chunk.copy_(values / K_SCALE if kv_dtype == FP8 else values)
        self.table = (
            torch.randperm(num_blocks, device="cuda").view(batch, pages).to(torch.int32)
        )
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.k_scale = torch.tensor(
            [K_SCALE if kv_dtype == FP8 else 1.0], device="cuda"
        )

    def kv_bytes(self) -> int:
        return self.batch * self.context * 576 * self.cache.element_size()


def copy_share_ceiling(
    kv_bytes: int, flops: float, copy_gbps: float, matmul_tflops: float
) -> float:
    """Largest share of the copy bandwidth, in percent, that reading
    ``kv_bytes`` once allows when ``flops`` run at ``matmul_tflops``: 100
    where the copy takes longer than the products."""
    copy_ms = kv_bytes / copy_gbps / 1e6
    return 100 * copy_ms / max(copy_ms, flops / matmul_tflops / 1e9)


def fused_launcher(
    ops: Any,
    work: Workload,
    q: torch.Tensor,
    query_len: int,
    splits: int,
    o: torch.Tensor,
    lse: torch.Tensor,
    workspace: torch.Tensor,
    config: Any = None,
) -> Callable[[], None]:
    """One call of the fused kernel of module ``ops`` on ``work``'s KV."""

    def run() -> None:
        ops.fused_mla_verify_decode(
            q,
            work.cache,
            work.table,
            work.seq_lens,
            o,
            lse,
            workspace,
            query_len=query_len,
            sm_scale=SM_SCALE,
            num_kv_splits=splits,
            k_scale=work.k_scale,
            config=config,
        )

    return run


def run_case(
    ops,
    upstream,
    work: Workload,
    query_len: int,
    heads: int,
    sm_count: int,
    variants: list[tuple[Any, int]],
) -> list[dict]:
    """Time the unfused path once and the fused kernel once per variant:
    (tiling or None for the default, multiplier of the default split count);
    one result row per variant that fits the device."""
    rows = work.batch * query_len
    q = torch.randn(rows, heads, 576, device="cuda").to(BF16)
    unfused = make_upstream_verify(
        upstream,
        q,
        work.cache,
        work.table,
        work.seq_lens,
        query_len=query_len,
        sm_scale=SM_SCALE,
        k_scale=work.k_scale,
        num_kv_splits=upstream_num_kv_splits(work.context, sm_count),
    )
    up_o, _ = unfused()
    unfused_ms = _time_ms(_graphed(unfused))
    default_splits = ops.choose_num_kv_splits(
        work.batch, heads, query_len, work.context, sm_count
    )
    o = torch.empty(rows, heads, 512, dtype=BF16, device="cuda")
    lse = torch.empty(rows, heads, device="cuda")
    max_scale = max(scale for _, scale in variants)
    workspace = torch.empty(
        ops.workspace_numel(rows, heads, default_splits * max_scale), device="cuda"
    )
    visible = work.batch * sum(work.context - t for t in range(query_len))
    flops = 2 * visible * heads * (576 + 512)
    results = []
    for config, split_scale in variants:
        splits = default_splits * split_scale
        fused = fused_launcher(
            ops, work, q, query_len, splits, o, lse, workspace, config
        )
        used = config or ops.default_config(query_len, heads)
        # The variants share ``o``: poisoned, a variant that leaves rows
        # unwritten shows them instead of the previous variant's output.
        o.fill_(float("nan"))
        try:
            fused()
        except triton.runtime.errors.OutOfResources as exc:
            if config is None:
                raise
            print(f"tiling {used} does not fit: {exc}", flush=True)
            continue
        diff = ((o.float() - up_o.float()).norm() / up_o.float().norm()).item()
        # test_matches_upstream_unfused_decode's tolerance: a wrong kernel is
        # not timed.
        if not diff < (2e-2 if work.kv_dtype == FP8 else 1e-2):
            if config is None and split_scale == 1:
                raise RuntimeError(f"fused output differs from upstream by {diff:.3e}")
            print(f"tiling {used} differs from upstream by {diff:.3e}", flush=True)
            continue
        fused_ms = _time_ms(_graphed(fused))
        results.append(
            {
                "batch": work.batch,
                "context": work.context,
                "query_len": query_len,
                "heads": heads,
                "kv_dtype": str(work.kv_dtype).removeprefix("torch."),
                "config": asdict(used),
                "fused_splits": splits,
                "unfused_splits": upstream_num_kv_splits(work.context, sm_count),
                "unfused_ms": unfused_ms,
                "fused_ms": fused_ms,
                "speedup": unfused_ms / fused_ms,
                "fused_kv_gbps": work.kv_bytes() / fused_ms / 1e6,
                "unfused_kv_gbps": work.kv_bytes() / unfused_ms / 1e6,
                "fused_tflops": flops / fused_ms / 1e9,
                "kv_bytes": work.kv_bytes(),
                "useful_flops": flops,
                "rel_diff_vs_unfused": diff,
            }
        )
    return results


def _cases() -> list[tuple[int, int, torch.dtype, list[tuple[int, int]]]]:
    """(batch, context, kv dtype, [(query_len, heads), ...]) to run: every
    batch x context with query_len 2/4/8 at 16 heads and 4 at 128 heads (also
    2 and 8 at batch 8 from 32K), query_len 4 at 12 heads where the targets
    apply (batch 8 and up, context 32K and up), and an fp8 KV cache at batch
    8, 32K."""
    cases = []
    for batch in [1, 8, 32]:
        for context in [4 * KiB, 32 * KiB, 128 * KiB]:
            shapes = [(query_len, 16) for query_len in (2, 4, 8)]
            if batch >= 8 and context >= 32 * KiB:
                shapes.append((4, 12))
            qlens_128 = (2, 4, 8) if batch == 8 and context >= 32 * KiB else (4,)
            shapes += [(query_len, 128) for query_len in qlens_128]
            cases.append((batch, context, BF16, shapes))
    cases.append((8, 32 * KiB, FP8, [(4, 16), (4, 12), (4, 128)]))
    return cases


def _sweep_variants(ops, query_len: int, heads: int) -> list[tuple[Any, int]]:
    """Triton tilings (BLOCK_N, stages) and Gluon buffer depths at the default
    split count, and the default tiling at twice the splits."""
    base = ops.default_config(query_len, heads)
    tilings = [(False, 32, 2), (False, 32, 3), (False, 32, 4), (False, 64, 2)]
    tilings += [(True, 32, 3), (True, 32, 4)]
    variants: list[tuple[Any, int]] = [
        (ops.VerifyKernelConfig(base.heads_per_tile, block_n, 8, stages, gluon), 1)
        for gluon, block_n, stages in tilings
    ]
    return [*variants, (None, 2)]


def _versions() -> dict:
    driver = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "driver_and_gpu": driver,
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
    }


def _table(rows: list[dict], copy_gbps: float, matmul_tflops: float) -> str:
    lines = [
        "| B | ctx | qlen | heads | kv | fused ms | unfused ms | speedup | "
        "fused GB/s | % copy | fused TFLOP/s | % matmul | ceiling % copy |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |",
    ]
    for r in rows:
        ceiling = copy_share_ceiling(
            r["kv_bytes"], r["useful_flops"], copy_gbps, matmul_tflops
        )
        lines.append(
            f"| {r['batch']} | {r['context'] // KiB}K | {r['query_len']} | "
            f"{r['heads']} | {r['kv_dtype']} | {r['fused_ms']:.3f} | "
            f"{r['unfused_ms']:.3f} | {r['speedup']:.2f} | "
            f"{r['fused_kv_gbps']:.0f} | {100 * r['fused_kv_gbps'] / copy_gbps:.0f} | "
            f"{r['fused_tflops']:.0f} | "
            f"{100 * r['fused_tflops'] / matmul_tflops:.0f} | {ceiling:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream-kernel", type=existing_file, required=True)
    parser.add_argument("--out", type=output_file, required=True)
    parser.add_argument(
        "--sweep", action="store_true", help="also time tilings on target cases"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_mla_verify needs a CUDA GPU")

    torch.manual_seed(0)
    ops = load_fused_verify()
    upstream = load_upstream_decode(args.upstream_kernel.resolve())
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = measure_copy_gbps()
    matmul_tflops = measure_matmul_tflops()
    print(f"copy {copy_gbps:.0f} GB/s (read+write), bf16 matmul {matmul_tflops:.0f}")

    results: list[dict] = []
    sweep: list[dict] = []
    failed: list[dict] = []
    report = {
        "versions": _versions(),
        "copy_gbps_read_plus_write": copy_gbps,
        "matmul_bf16_tflops": matmul_tflops,
        "page_size": PAGE_SIZE,
        "results": results,
        "sweep": sweep,
        "failed": failed,
    }
    for batch, context, kv_dtype, shapes in _cases():
        work = Workload(batch, context, kv_dtype)
        for query_len, heads in shapes:
            target = batch == 8 and context >= 32 * KiB and query_len == 4
            variants: list[tuple[Any, int]] = [(None, 1)]
            if args.sweep and target:
                variants += _sweep_variants(ops, query_len, heads)
            try:
                rows = run_case(
                    ops, upstream, work, query_len, heads, sm_count, variants
                )
            except Exception as exc:  # report the case, keep measuring the rest
                case = (batch, context, str(kv_dtype), query_len, heads)
                print(f"case {case} failed: {exc!r}", flush=True)
                failed.append({"case": case, "error": repr(exc)})
                continue
            results.append(rows[0])
            sweep.extend(rows[1:])
            print("\n".join(_table(rows, copy_gbps, matmul_tflops).splitlines()[2:]))
            args.out.write_text(json.dumps(report, indent=1))
        del work
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(report, indent=1))

    if sweep:
        print("\nsweep (fused tilings, target cases)")
        for r in sweep:
            print(
                f"B{r['batch']} ctx{r['context'] // KiB}K h{r['heads']} "
                f"{r['kv_dtype']} {r['config']} splits {r['fused_splits']}: "
                f"{r['fused_ms']:.4f} ms "
                f"{r['fused_kv_gbps']:.0f} GB/s"
            )
    for failure in failed:
        print(f"FAILED {failure}")
    print(f"\n{report['versions']}")
    print(f"copy {copy_gbps:.0f} GB/s read+write; bf16 matmul {matmul_tflops:.0f}\n")
    print(_table(results, copy_gbps, matmul_tflops))


if __name__ == "__main__":
    main()
