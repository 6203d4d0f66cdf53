# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Same-call A/B of variants of the layer-5 kernel module.

Each variant is a copy of ``k3_fused_mla_verify.py`` loaded by path beside
the others. Per case (the target and neighbouring shapes of
``bench_fused_mla_verify.py``) every variant runs once on the same inputs and
its output and LSE are compared bit for bit with the first variant's (and
checked for NaN); then the variants' CUDA-graph replays are timed
(``do_bench`` median, L2 cleared) in interleaved rounds, alternating the
order. Reported: median and range of the rounds per variant, in us, and the
unique-KV bandwidth; a variant whose outputs differ is named.

Usage::

    python bench/compare_fused_mla_verify.py --rounds 5 --out ab.json \\
        head=/path/to/old/k3_fused_mla_verify.py \\
        new=overlay/vllm/v1/attention/ops/k3_fused_mla_verify.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from bench_fused_mla_verify import (
    BF16,
    FP8,
    KiB,
    Workload,
    _graphed,
    _time_ms,
    fused_launcher,
    measure_copy_gbps,
)
from cli_types import output_file, positive_int
from k3_standalone import load_module

# (batch, context, KV dtype, query_len, heads)
CASES = [
    (8, 32 * KiB, BF16, 4, 16),
    (8, 4 * KiB, BF16, 4, 16),
    (8, 128 * KiB, BF16, 4, 16),
    (32, 32 * KiB, BF16, 4, 16),
    (1, 32 * KiB, BF16, 4, 16),
    (8, 32 * KiB, BF16, 8, 16),
    (8, 32 * KiB, BF16, 4, 128),
    (8, 32 * KiB, FP8, 4, 16),
    (12, 32 * KiB, BF16, 4, 12),
    (8, 128 * KiB, FP8, 4, 16),
    (32, 32 * KiB, FP8, 4, 16),
    (1, 32 * KiB, FP8, 4, 16),
    (8, 32 * KiB, FP8, 8, 16),
    (8, 32 * KiB, FP8, 4, 128),
    (8, 4 * KiB, FP8, 4, 16),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "variants", nargs="+", help="NAME=PATH, the first is the reference"
    )
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--out", type=output_file, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("compare_fused_mla_verify needs a CUDA GPU")
    modules: dict[str, ModuleType] = {}
    for spec in args.variants:
        name, sep, path = spec.partition("=")
        if not sep or not name or name in modules or not Path(path).is_file():
            parser.error(f"{spec!r} is not NAME=PATH of an existing file, NAME unique")
        modules[name] = load_module(Path(path).resolve(), f"_compare_{len(modules)}")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = measure_copy_gbps()
    print(f"copy {copy_gbps:.0f} GB/s (read+write)", flush=True)
    report: dict = {"copy_gbps_read_plus_write": copy_gbps, "cases": []}
    # Every buffer a captured graph writes stays alive until the end.
    alive: list[object] = []
    for batch, context, kv_dtype, query_len, heads in CASES:
        torch.manual_seed(0)
        work = Workload(batch, context, kv_dtype)
        rows = batch * query_len
        q = torch.randn(rows, heads, 576, device="cuda").to(BF16)
        reference = next(iter(modules.values()))
        splits = reference.choose_num_kv_splits(
            batch, heads, query_len, context, sm_count
        )
        outputs, replays = {}, {}
        for name, module in modules.items():
            o = torch.full((rows, heads, 512), float("nan"), dtype=BF16, device="cuda")
            lse = torch.full((rows, heads), float("nan"), device="cuda")
            workspace = torch.empty(
                module.workspace_numel(rows, heads, splits), device="cuda"
            )
            alive.append((work, q, o, lse, workspace))

            run = fused_launcher(module, work, q, query_len, splits, o, lse, workspace)
            run()
            torch.cuda.synchronize()
            outputs[name] = (o.clone(), lse.clone())
            replays[name] = _graphed(run)
        first_o, first_lse = next(iter(outputs.values()))
        differ = [
            name
            for name, (o, lse) in outputs.items()
            if not (torch.equal(o.view(torch.int16), first_o.view(torch.int16)))
            or not torch.equal(lse, first_lse)
        ]
        with_nan = [name for name, (o, _) in outputs.items() if o.isnan().any()]
        times: dict[str, list[float]] = {name: [] for name in replays}
        order: list[tuple[str, Callable[[], None]]] = list(replays.items())
        for r in range(args.rounds):
            for name, replay in order if r % 2 == 0 else order[::-1]:
                times[name].append(_time_ms(replay) * 1e3)
        case = f"B{batch} {context // KiB}K q{query_len} {heads} h {kv_dtype}"
        cells = [
            f"{name} {statistics.median(t):.1f} [{min(t):.1f}-{max(t):.1f}] "
            f"({work.kv_bytes() / statistics.median(t) / 1e3:.0f} GB/s)"
            for name, t in times.items()
        ]
        print(f"{case}: " + "  ".join(cells), flush=True)
        if differ or with_nan:
            print(f"  outputs differ from the first: {differ}; NaN: {with_nan}")
        report["cases"].append(
            {
                "case": case,
                "splits": splits,
                "us": times,
                "outputs_differ": differ,
                "nan": with_nan,
            }
        )
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
