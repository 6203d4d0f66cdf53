# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-layer qualification: every prefix applied, installed and tested.

For each prefix 1..N: apply, install the payload over a pristine install of
the upstream wheel with the same installer the image runs, import every module
the prefix adds, run layer N's focused suite, and run the upstream tests layer
N names. Upstream tests are judged against the same tests on pristine
upstream: a test that passes there must pass on the stack; the ones that fail
there (no model hub, no GPU) are listed in the baseline, never hidden. The
pristine run comes after the layers and leaves out the tests that passed on
every layer that ran them, whose pristine outcome cannot change a verdict.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from k3stack import StackError
from k3stack.artifacts import build
from k3stack.fetch import fetch
from k3stack.gitutil import git_bytes
from k3stack.install import matches_record
from k3stack.pin import Pin
from k3stack.series import Layer, Stack, check_layering, check_suites
from k3stack.upstream import from_sdist, require_tar_filters
from k3stack.worktree import UPSTREAM_TAG, build_tree, layer_tag

TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}
PER_TEST_TIMEOUT_S = 300
# The pytest plugin (pytest_plugins/k3_settled.py) that leaves the settled
# tests out of the pristine run, and the variable naming their list.
SETTLED_PLUGIN_DIR = Path(__file__).parent / "pytest_plugins"
SETTLED_ENV = "K3_QUALIFY_SETTLED"
# Our own suites run on two pytest-xdist workers: their tests wait on server
# processes and sockets much of the time (layer 1's suite in CI on the 2-core
# build box: 252 s in one process, 133-152 s on two). Each worker's torch runs
# one intra-op thread: OpenMP threads that spin after each parallel region
# take the cores from the other worker's server round trips
# (tests/layer1/test_loop_real_scheduler.py on two workers: 98 s with torch's
# default threads, 28 s with one). Upstream's tests run in one process, in the
# caller's environment, as upstream's CI runs them.
SUITE_WORKERS = ["-n", "2"]
SUITE_ENV = {"OMP_NUM_THREADS": "1"}
# pytest's exit codes for a run that went to the end (with or without failures),
# and for one that had nothing to run (every test deselected).
COMPLETED = (0, 1)
NOTHING_TO_RUN = 5


@dataclass
class Outcomes:
    """Test id -> 'passed' | 'failed' | 'skipped' from one JUnit XML file."""

    results: dict[str, str] = field(default_factory=dict)

    def count(self, state: str) -> int:
        return sum(1 for s in self.results.values() if s == state)


@dataclass
class UpstreamRun:
    """A layer's upstream test files and their outcomes on the layer."""

    files: list[str]
    outcomes: Outcomes


@dataclass
class Row:
    layer: str
    applies: str = "-"
    imports: str = "-"
    focused: str = "-"
    upstream: str = "-"
    ok: bool = True
    passed: int = 0
    failed: int = 0
    notes: list[str] = field(default_factory=list)
    # Set by qualify_layer, judged against pristine by judge_upstream.
    upstream_run: UpstreamRun | None = None
    # The layer's JUnit XML and the pytest XML files it is made from
    # (written by write_layer_junit once the row is judged).
    junit: Path | None = None
    junit_parts: list[Path] = field(default_factory=list)


def judge_suite(
    row: Row, code: int, outcomes: Outcomes, may_be_empty: bool = False
) -> None:
    """Fill ``row``'s focused column from one run of our own tests and fail
    it unless every test ran and passed: a failure, a skip (a test that did
    not run is not a pass; GPU tests are deselected, not skipped), a pytest
    exit code other than 0, or nothing passed (unless ``may_be_empty``)."""
    p, f = outcomes.count("passed"), outcomes.count("failed")
    skipped = [t for t, state in outcomes.results.items() if state == "skipped"]
    row.focused = f"{p} passed, {f} failed" + (
        f", {len(skipped)} skipped" if skipped else ""
    )
    row.passed += p
    row.failed += f
    if skipped:
        row.notes.append(
            f"{len(skipped)} skipped (e.g. {skipped[0]}): a test that did not "
            "run is not a pass"
        )
    if f or skipped or code != 0 or (p == 0 and not may_be_empty):
        row.ok = False


def read_junit(path: Path) -> Outcomes:
    outcomes = Outcomes()
    if not path.is_file():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        outcomes.results[_case_id(case)] = _case_state(case)
    return outcomes


def _case_id(case: ET.Element) -> str:
    return f"{case.get('classname')}::{case.get('name')}"


def _case_state(case: ET.Element) -> str:
    # A nameless case is what pytest.exit() inside a test leaves.
    if (
        case.find("failure") is not None
        or case.find("error") is not None
        or case.get("name") is None
    ):
        return "failed"
    if case.find("skipped") is not None:
        return "skipped"
    return "passed"


def pytest_args(junit: Path) -> list[str]:
    """pytest's options for every run; a file that cannot be collected does not
    keep the others from running."""
    return [
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not gpu and not subprocess_only",
        "--continue-on-collection-errors",
        f"--timeout={PER_TEST_TIMEOUT_S}",
        f"--junitxml={junit}",
    ]


def run_pytest(
    python: str,
    cwd: Path,
    site: Path,
    targets: list[str],
    junit: Path,
    settled: Path | None = None,
    own_suite: bool = False,
) -> tuple[int, Outcomes]:
    """pytest's exit code and the outcomes it wrote to ``junit`` (none when it
    wrote none: an XML from an earlier run is removed first). ``settled``: a
    JSON list of test ids (JUnit form) to deselect; ``own_suite``: our tests,
    run on ``SUITE_WORKERS`` with ``SUITE_ENV`` (otherwise one process)."""
    env = {**os.environ, **TEST_ENV, "PYTHONPATH": str(site)}
    junit.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", *pytest_args(junit)]
    if own_suite:
        env.update(SUITE_ENV)
        cmd += SUITE_WORKERS
    if settled is not None:
        env["PYTHONPATH"] += os.pathsep + str(SETTLED_PLUGIN_DIR)
        env[SETTLED_ENV] = str(settled)
        cmd += ["-p", "k3_settled"]
    cmd += targets
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    print(f"qualify:   pytest {' '.join(targets)[:90]} -> {tail[0][:120]}", flush=True)
    if proc.returncode not in (*COMPLETED, NOTHING_TO_RUN):
        print(proc.stdout[-4000:], file=sys.stderr)
    return proc.returncode, read_junit(junit)


def completed(code: int, junit: Path) -> bool:
    """Whether a pytest run went to the end and wrote its results."""
    return code in COMPLETED and junit.is_file()


# Names the wheel unpacked in the pristine install; every site copied from
# it carries it too, which is how `site` knows a folder it made.
WHEEL_STAMP = ".k3stack-wheel"


def install_site(python: str, pristine: Path, payload: Path, site: Path) -> None:
    """A copy of the pristine install (hard links) with the payload installed."""
    if site.exists():
        shutil.rmtree(site)
    shutil.copytree(pristine, site, copy_function=os.link, symlinks=True)
    proc = subprocess.run(
        [
            python,
            str(payload / "install.py"),
            "--payload",
            str(payload),
            "--site",
            str(site),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise StackError(f"install into {site} failed: {proc.stderr.strip()[-300:]}")


def check_python(python: str, *modules: str) -> None:
    """``StackError`` in one line unless ``python`` runs and imports
    ``modules`` (checked before any work that needs them)."""
    script = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    try:
        proc = subprocess.run(
            [python, "-c", script, *modules], capture_output=True, text=True
        )
    except OSError as e:
        raise StackError(f"--python {python}: {e.strerror or e}; refused") from None
    if proc.returncode != 0:
        raise StackError(
            f"--python {python} cannot import {', '.join(modules)}: "
            f"{failure(proc, 'it')}; refused"
        )


def pristine_site(python: str, wheel: Path, work: Path) -> Path:
    site = work / "site-0"
    stamp = site / WHEEL_STAMP
    key = f"{wheel.name} {wheel.stat().st_size}"
    if stamp.is_file() and stamp.read_text() == key:
        changed = changed_file(wheel, site)
        if changed is None:
            return site
        # The sites are hard-link copies of this one: a file of a site edited
        # in place (not replaced) changes it here too, and every later
        # install would fail its self-check on it.
        print(
            f"{site}: {changed} is not as {wheel.name} has it (a site's file "
            "edited in place?); installing the wheel again",
            flush=True,
        )
    if site.exists():
        shutil.rmtree(site)
    proc = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--target",
            str(site),
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise StackError(
            f"pip could not install {wheel.name} into {site}: {failure(proc, 'pip')}"
        )
    stamp.write_text(key)
    return site


def changed_file(wheel: Path, site: Path) -> str | None:
    """The first file of ``wheel``'s RECORD that is not in ``site`` with the
    size and hash the RECORD gives, or None."""
    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record).decode())))
    for row in rows:
        if len(row) != 3 or not row[1]:
            continue
        path = site / row[0]
        if not path.is_file() or not matches_record(path, row[1], row[2]):
            return row[0]
    return None


def export_tests(tree: Path, rev: str, dest: Path, paths: list[str]) -> None:
    """The upstream tests of ``rev`` (the tests/ tree and pyproject.toml)."""
    require_tar_filters()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    data = git_bytes(tree, "archive", "--format=tar", rev, "tests", "pyproject.toml")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    missing = [p for p in paths if not (dest / p).exists()]
    if missing:
        raise StackError(
            f"upstream tests not in the tree at {rev}: {', '.join(missing)}"
        )


def of_files(test_id: str, files: list[str]) -> bool:
    """Whether a JUnit test id (``dotted.module[.Class]::name``, or
    ``::dotted.module`` for a module skipped or not collected whole) is a test
    of one of ``files``."""
    classname, _, name = test_id.partition("::")
    classname = classname or name
    modules = [f.removesuffix(".py").replace("/", ".") for f in files]
    return any(classname == m or classname.startswith(f"{m}.") for m in modules)


def overlay_modules(layers: list[Layer]) -> list[str]:
    modules = []
    for layer in layers:
        for rel in layer.patch.overlay:
            if rel.endswith(".py"):
                mod = rel.removesuffix(".py").replace("/", ".")
                modules.append(mod.removesuffix(".__init__"))
    return modules


IMPORTS_DONE = "k3stack: every module was tried"


def check_imports(python: str, site: Path, modules: list[str]) -> list[str]:
    """The modules that fail to import, one line each; the check itself
    failing (a module that exits the interpreter too) is one more line."""
    script = (
        "import importlib, sys\n"
        "bad = []\n"
        "for m in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except BaseException as e:\n"
        "        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        f"print({IMPORTS_DONE!r})\n"
    )
    env = {**os.environ, **TEST_ENV, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [python, "-c", script, "vllm", "vllm.envs", *modules],
        capture_output=True,
        text=True,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line]
    if proc.returncode != 0 or not lines or lines[-1] != IMPORTS_DONE:
        return [*lines, failure(proc, "the import check")]
    return lines[:-1]


def failure(proc: subprocess.CompletedProcess[str], what: str) -> str:
    """The last line a failed process wrote to stderr, or how ``what`` ended
    (a process killed by a signal may write nothing)."""
    lines = proc.stderr.strip().splitlines()
    if lines:
        return lines[-1]
    return f"{what} ended with exit code {proc.returncode} and no message"


def interpreter_key(python: str) -> bytes:
    """What of ``python`` decides test outcomes: its version and the
    distributions installed in it."""
    script = (
        "import importlib.metadata as m, sys\n"
        "print(sys.version)\n"
        "print(*sorted(f\"{d.metadata['Name']}=={d.version}\" "
        "for d in m.distributions()), sep='\\n')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [python, "-c", script], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise StackError(f"{python} does not run: {failure(proc, 'it')}")
    return proc.stdout.encode()


def baseline(
    python: str,
    tree: Path,
    site0: Path,
    tests: list[str],
    work: Path,
    out: Path,
    settled: frozenset[str] = frozenset(),
) -> Outcomes:
    """Outcomes of ``tests`` on pristine upstream, less the ``settled`` test
    ids, cached by their inputs: the interpreter and its packages, the
    pristine install, the tests, the settled ids, how pytest runs them and
    the environment."""
    if not tests:
        return Outcomes()
    digest = hashlib.sha256(interpreter_key(python))
    # The environment the run inherits decides outcomes too.
    environment = sorted((k, v) for k, v in os.environ.items() if k != "PYTHONPATH")
    digest.update(json.dumps([pytest_args(Path("-")), TEST_ENV, environment]).encode())
    digest.update((site0 / WHEEL_STAMP).read_bytes())
    digest.update(git_bytes(tree, "rev-parse", f"{UPSTREAM_TAG}:tests"))
    digest.update("\0".join(sorted(tests)).encode())
    digest.update(b"\1" + "\0".join(sorted(settled)).encode())
    cache = work / f"baseline-{digest.hexdigest()[:16]}.json"
    # The pristine run's JUnit XML is cached beside its outcomes: a run that
    # reuses them writes it into its --out all the same.
    cached_junit = cache.with_suffix(".xml")
    junit = out / "baseline.xml"
    if cache.is_file() and cached_junit.is_file():
        outcomes = Outcomes(json.loads(cache.read_text()))
        shutil.copyfile(cached_junit, junit)
    else:
        dest = work / "tests-0"
        export_tests(tree, UPSTREAM_TAG, dest, tests)
        select = work / "settled.json"
        select.write_text(json.dumps(sorted(settled)))
        code, outcomes = run_pytest(python, dest, site0, sorted(tests), junit, select)
        # Nothing may be left to run once the settled tests are out.
        if code not in (*COMPLETED, NOTHING_TO_RUN) or not junit.is_file():
            raise StackError(
                "the upstream tests did not run to the end on pristine upstream "
                f"(pytest exit code {code}); there is no baseline to judge by"
            )
        shutil.copyfile(junit, cached_junit)
        cache.write_text(json.dumps(outcomes.results, indent=1, sort_keys=True))
    failing = sorted(t for t, s in outcomes.results.items() if s != "passed")
    (out / "baseline.json").write_text(
        json.dumps(
            {
                "tests": sorted(tests),
                "not_passing_on_pristine": failing,
                "not_run_on_pristine_passed_on_the_stack": sorted(settled),
            },
            indent=2,
        )
        + "\n"
    )
    return outcomes


def settled_tests(runs: list[UpstreamRun]) -> frozenset[str]:
    """The test ids that passed on every layer that ran them or whose
    upstream files they belong to: their pristine outcome cannot make a
    regression."""
    seen = {t for run in runs for t in run.outcomes.results}
    return frozenset(
        t
        for t in seen
        if all(
            run.outcomes.results.get(t) == "passed"
            for run in runs
            if t in run.outcomes.results or of_files(t, run.files)
        )
    )


def judge_upstream(row: Row, base: Outcomes) -> None:
    """Fill ``row``'s upstream column from its layer's run against the
    pristine outcomes: a test that passed on pristine must pass on the layer;
    failing, new and failing, or no longer run at all are regressions alike."""
    run = row.upstream_run
    if run is None:
        return
    now = run.outcomes
    pristine = {t: s for t, s in base.results.items() if of_files(t, run.files)}
    regressions = sorted(
        t
        for t in {*now.results, *pristine}
        if _regressed(now.results.get(t), pristine.get(t, "passed"))
    )
    known = sum(
        1
        for t, s in now.results.items()
        if s != "passed" and not _regressed(s, pristine.get(t, "passed"))
    )
    empty = [f for f in run.files if not any(of_files(t, [f]) for t in now.results)]
    row.upstream = (
        f"{now.count('passed')} passed, {len(regressions)} regressions, "
        f"{known} not passing on pristine either"
    )
    row.passed += now.count("passed")
    row.failed += len(regressions)
    row.notes += [
        f"regression: {t}" + ("" if t in now.results else " (did not run)")
        for t in regressions
    ]
    row.notes += [f"{f}: no test ran (none collected or all deselected)" for f in empty]
    row.ok = row.ok and not regressions and not empty


def _regressed(now: str | None, pristine: str) -> bool:
    """Whether a test's outcome on the stack (None: it did not run) is a
    regression from its outcome on pristine ("passed" for a test pristine
    does not have): not passing where pristine passed, or failing where
    pristine skipped it (a skip shows no failure)."""
    if now == "passed":
        return False
    return pristine == "passed" or (pristine == "skipped" and now == "failed")


def judge_against_pristine(
    python: str,
    tree: Path,
    site0: Path,
    rows: list[Row],
    work: Path,
    out: Path,
) -> None:
    """Run the pristine baseline for the rows' upstream tests, less the
    settled ones, and judge each row's upstream column against it."""
    runs = [row.upstream_run for row in rows if row.upstream_run is not None]
    files = sorted({f for run in runs for f in run.files})
    settled = settled_tests(runs)
    if files:
        print(
            f"qualify: pristine baseline ({len(settled)} tests passed on the "
            "stack wherever they ran, left out)",
            flush=True,
        )
    base = baseline(python, tree, site0, files, work, out, settled)
    for row in rows:
        judge_upstream(row, base)
        write_layer_junit(row, base)


def qualify_layer(
    stack: Stack,
    pin: Pin,
    layer: Layer,
    tree: Path,
    wheel: Path,
    site0: Path,
    python: str,
    work: Path,
    out: Path,
) -> Row:
    """Layer ``layer``'s row: applies, imports, its focused suite, and its
    upstream tests run (judged later by ``judge_against_pristine``)."""
    row = Row(f"{layer.number} {layer.name}")
    n = layer.number
    dist = work / f"dist-{n}"
    result = build(stack, pin, tree, wheel, dist, n)
    row.applies = "yes"
    site = work / f"site-{n}"
    install_site(python, site0, result.context / "stack", site)
    # Built to prove the prefix builds; what runs is the install. A wheel is
    # about 0.3 GB, and CI machines have run out of disk.
    shutil.rmtree(dist)
    bad = check_imports(python, site, overlay_modules(stack.upto(n)))
    row.imports = "ok" if not bad else f"FAIL ({len(bad)})"
    row.notes += bad
    junits = []
    empty = not layer.patch.files and not layer.patch.overlay
    suite = [p for p in layer.patch.suite if (stack.root / p).exists()]
    if suite:
        junit = out / f"layer-{n}-focused.xml"
        code, focused = run_pytest(
            python, stack.root, site, suite, junit, own_suite=True
        )
        junits.append(junit)
        judge_suite(row, code, focused, may_be_empty=empty)
    else:
        row.focused = "empty layer" if empty else "FAIL (no suite)"
        row.ok = row.ok and empty
    tests = layer.patch.upstream_tests
    if tests:
        dest = work / f"tests-{n}"
        export_tests(tree, layer_tag(n), dest, tests)
        junit = out / f"layer-{n}-upstream.xml"
        code, now = run_pytest(python, dest, site, sorted(tests), junit)
        junits.append(junit)
        if not completed(code, junit):
            row.ok = False
            row.notes.append(
                f"upstream tests did not run to the end (pytest exit code {code})"
            )
        row.upstream_run = UpstreamRun(sorted(tests), now)
    if bad:
        row.ok = False
    row.junit = out / f"layer-{n}.xml"
    row.junit_parts = junits
    return row


_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def write_layer_junit(row: Row, base: Outcomes) -> None:
    """Write ``row``'s JUnit XML once it is judged: its focused suite as
    pytest wrote it; its upstream tests as judged against pristine (a test
    not passing on pristine either reads as skipped, naming the baseline; a
    regression, skipped or not run at all, as failed); and one case for the
    row's verdict, failing with its notes when the row failed. So the file
    fails exactly when the table's row does (pytest's own upstream XML is
    kept beside it)."""
    if row.junit is None:
        return
    root = ET.Element("testsuites")
    for path in row.junit_parts:
        if path.is_file():
            parsed = ET.parse(path).getroot()
            suites = [parsed] if parsed.tag == "testsuite" else list(parsed)
            for suite in suites:
                suite.set("name", path.stem)
                if row.upstream_run is not None and path.stem.endswith("-upstream"):
                    _judge_suite_cases(suite, row.upstream_run, base)
                root.append(suite)
    verdict = ET.SubElement(
        root, "testsuite", name="qualify", tests="1", skipped="0", errors="0"
    )
    case = ET.SubElement(
        verdict, "testcase", classname="k3stack.qualify", name=f"layer {row.layer}"
    )
    verdict.set("failures", "0" if row.ok else "1")
    if not row.ok:
        failure = ET.SubElement(case, "failure", message="the layer failed")
        text = "\n".join(row.notes) or "see the qualify table"
        # Notes quote error messages, which may hold terminal colour codes
        # and other characters XML 1.0 does not allow.
        failure.text = _XML_ILLEGAL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)
    ET.ElementTree(root).write(row.junit, encoding="utf-8", xml_declaration=True)


def _judge_suite_cases(suite: ET.Element, run: UpstreamRun, base: Outcomes) -> None:
    """Rewrite an upstream suite's cases to their verdicts against pristine
    and recount it."""
    seen = set()
    for case in suite.iter("testcase"):
        test_id = _case_id(case)
        seen.add(test_id)
        state = _case_state(case)
        pristine = base.results.get(test_id, "passed")
        if state == "passed":
            continue
        if not _regressed(state, pristine):
            _set_outcome(
                case,
                "skipped",
                f"not passing on pristine upstream either ({pristine} there)",
            )
        elif state == "skipped":
            _set_outcome(
                case,
                "failure",
                "regression: passed on pristine upstream, skipped on the stack",
            )
    for test_id, state in sorted(base.results.items()):
        if test_id in seen or not of_files(test_id, run.files):
            continue
        if _regressed(None, state):
            classname, _, name = test_id.partition("::")
            case = ET.SubElement(suite, "testcase", classname=classname, name=name)
            _set_outcome(
                case,
                "failure",
                "regression: passed on pristine upstream, did not run on the stack",
            )
    cases = list(suite.iter("testcase"))
    counts = {"failures": "failure", "errors": "error", "skipped": "skipped"}
    suite.set("tests", str(len(cases)))
    for attribute, tag in counts.items():
        suite.set(attribute, str(sum(c.find(tag) is not None for c in cases)))


def _set_outcome(case: ET.Element, tag: str, message: str) -> None:
    for child in list(case):
        if child.tag in ("failure", "error", "skipped"):
            case.remove(child)
    ET.SubElement(case, tag, message=message)


def render_table(rows: list[Row]) -> str:
    lines = [
        "| layer | applies | imports | focused | upstream (vs pristine) | result |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.layer} | {r.applies} | {r.imports} | {r.focused} | {r.upstream} | "
            f"{'ok' if r.ok else 'FAIL'} |"
        )
    return "\n".join(lines)


# The names of the files qualify writes into --out.
REPORT_FILES = re.compile(
    r"(tooling|baseline|layer-\d+|layer-\d+-focused|layer-\d+-upstream"
    r"|lower-suites-on-\d+)\.xml|baseline\.json|summary\.md"
)


def earlier_report(out: Path) -> list[Path]:
    """The files an earlier run wrote into ``out``, which this run removes so
    that the folder describes it alone (a layer not run this time leaves no
    XML that reads as this run's); refuse a folder holding anything else,
    which qualify did not write and leaves alone."""
    if out.exists() and not out.is_dir():
        raise StackError(f"qualify: --out {out} is not a folder; refused")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    foreign = [
        p.name
        for p in entries
        if not (REPORT_FILES.fullmatch(p.name) and p.is_file() and not p.is_symlink())
    ]
    if foreign:
        raise StackError(
            f"qualify: --out {out} holds {foreign[0]!r}"
            + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "")
            + ", which qualify does not write; give an empty folder or the "
            "--out of an earlier run; refused"
        )
    return entries


def qualify_command(stack: Stack, pin: Pin, args: argparse.Namespace) -> None:
    if not stack.layers:
        raise StackError("qualify: patches/series lists no layers; nothing to qualify")
    targets = [stack.layer(args.layer)] if args.layer is not None else stack.layers
    check_python(args.python, "pip", "pytest")
    start = time.monotonic()
    work = stack.root / ".work" / "qualify"
    out: Path = args.out
    stale = earlier_report(out)
    check_suites(stack)
    check_layering(stack)
    for path in stale:
        path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    print(f"qualify: validate ok ({len(stack.layers)} layers)", flush=True)
    rows = [Row("tooling", applies="n/a", imports="n/a", upstream="n/a")]
    code, tooling = run_pytest(
        args.python,
        stack.root,
        stack.root / "build",
        ["tests/tooling"],
        out / "tooling.xml",
        own_suite=True,
    )
    judge_suite(rows[0], code, tooling)

    sdist = fetch(pin.sdist, pin.name)
    wheel = fetch(pin.wheel(), pin.name)
    tree = work / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    upto = max(layer.number for layer in targets)
    try:
        build_tree(
            stack,
            tree,
            from_sdist(sdist),
            f"{pin.name} {pin.version} pristine\n",
            upto,
        )
    except StackError as e:
        rows.append(Row(f"apply 1..{upto}", applies=f"FAIL: {e}", ok=False))
        _finish(rows, out, start)
        return
    site0 = pristine_site(args.python, wheel, work)
    layer_rows = []
    for layer in targets:
        print(f"qualify: layer {layer.number} ({layer.name})", flush=True)
        layer_rows.append(
            qualify_layer(stack, pin, layer, tree, wheel, site0, args.python, work, out)
        )
    judge_against_pristine(args.python, tree, site0, layer_rows, work, out)
    rows += layer_rows
    if upto > 1:
        rows.append(lower_suites_on_top(stack, upto, args.python, work, out))
    _finish(rows, out, start)


def lower_suites_on_top(
    stack: Stack, upto: int, python: str, work: Path, out: Path
) -> Row:
    """The suites of layers 1..upto-1 on prefix 1..upto: a higher layer must
    not break a lower one (each prefix row ran only its own layer's suite)."""
    row = Row(f"suites 1..{upto - 1} on 1..{upto}", applies="yes", upstream="n/a")
    suites = [
        p
        for layer in stack.upto(upto - 1)
        for p in layer.patch.suite
        if (stack.root / p).exists()
    ]
    site = work / f"site-{upto}"
    if not suites or not site.exists():
        row.focused = "no lower suites"
        return row
    print(f"qualify: suites of layers 1..{upto - 1} on the 1..{upto} install")
    junit = out / f"lower-suites-on-{upto}.xml"
    code, outcomes = run_pytest(python, stack.root, site, suites, junit, own_suite=True)
    row.imports = "ok"
    judge_suite(row, code, outcomes)
    return row


def _finish(rows: list[Row], out: Path, start: float) -> None:
    table = render_table(rows)
    notes = [f"- {r.layer}: {n}" for r in rows for n in r.notes]
    (out / "summary.md").write_text(table + "\n\n" + "\n".join(notes) + "\n")
    print(table)
    for note in notes[:40]:
        print(note)
    passed = sum(r.passed for r in rows)
    failed = sum(r.failed for r in rows)
    print(f"qualify: JUnit XML and summary in {out} ({time.monotonic() - start:.0f} s)")
    bad = [r.layer for r in rows if not r.ok]
    print(f"qualify: {passed} passed, {failed} failed")
    if bad:
        raise StackError(f"qualify failed for: {', '.join(bad)}")
