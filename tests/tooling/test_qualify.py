# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""qualify judges a layer's upstream tests against pristine upstream.

The tests run with this interpreter, which has pytest and pytest-timeout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest
from conftest import UPSTREAM_FILES, Synthetic, make_sdist

from k3stack import StackError
from k3stack.gitutil import git
from k3stack.qualify import (
    Outcomes,
    Row,
    UpstreamRun,
    _finish,
    baseline,
    check_imports,
    export_tests,
    judge_against_pristine,
    judge_suite,
    of_files,
    qualify_command,
    qualify_layer,
    read_junit,
    settled_tests,
)

PYTHON = sys.executable


def prepare(syn: Synthetic, tmp_path: Path, sdist: Path | None = None) -> Path:
    """Give each layer a passing suite, apply, and install the pristine wheel;
    return the pristine install."""
    for n in (1, 2, 3):
        suite = syn.root / "tests" / f"layer{n}"
        suite.mkdir(parents=True)
        (suite / f"test_layer{n}.py").write_text("def test_ok():\n    assert True\n")
    git(syn.root, "add", "-A")
    git(syn.root, "commit", "-q", "-m", "suites")
    syn.apply(sdist=sdist)
    site0 = tmp_path / "work" / "site-0"
    with zipfile.ZipFile(syn.wheel) as zf:
        zf.extractall(site0)
    (site0 / ".k3stack-wheel").write_text("synthetic")
    (tmp_path / "out").mkdir()
    return site0


def qualify_layer_3(syn: Synthetic, tmp_path: Path, site0: Path) -> Row:
    stack = syn.stack()
    layer = stack.layer(3)
    work, out = tmp_path / "work", tmp_path / "out"
    row = qualify_layer(
        stack, syn.pin, layer, syn.tree, syn.wheel, site0, PYTHON, work, out
    )
    judge_against_pristine(PYTHON, syn.tree, site0, [row], work, out)
    return row


def change_layer_3(syn: Synthetic, edit: dict[str, str]) -> None:
    syn.amend(3, edit)
    syn.take_back("layer 3 changed")
    syn.apply()


def layer_3_row_with_upstream_test(syn: Synthetic, tmp_path: Path, test: str) -> Row:
    """Layer 3's row after layer 3 appends ``test`` to upstream's
    tests/test_model.py."""
    site0 = prepare(syn, tmp_path)
    text = UPSTREAM_FILES["tests/test_model.py"] + "\n\n" + test
    change_layer_3(syn, {"tests/test_model.py": text})
    return qualify_layer_3(syn, tmp_path, site0)


def with_upstream_test(
    syn: Synthetic, tmp_path: Path, name: str, text: str
) -> tuple[Path, Path]:
    """An sdist with one more upstream test file ``name``, listed among layer
    3's upstream tests, and its pristine install (``prepare``)."""
    files = {**UPSTREAM_FILES, name: text}
    sdist = make_sdist(tmp_path / "vllm-1.0-extra.tar.gz", files)
    patch = syn.root / "patches/0003-layer-3.patch"
    patch.write_text(
        patch.read_text().replace("Upstream-Tests:\n", f"Upstream-Tests:\n {name}\n")
    )
    return sdist, prepare(syn, tmp_path, sdist)


def test_a_qualified_layer_leaves_no_build_output_behind(
    filled: Synthetic, tmp_path: Path
) -> None:
    site0 = prepare(filled, tmp_path)
    assert qualify_layer_3(filled, tmp_path, site0).ok
    assert (tmp_path / "work" / "site-3").is_dir()
    assert not (tmp_path / "work" / "dist-3").exists()


def test_a_test_skipped_on_pristine_that_fails_on_the_stack_is_a_regression(
    filled: Synthetic, tmp_path: Path
) -> None:
    text = (
        "import pytest\nimport vllm.model as m\n\n\n"
        "@pytest.mark.skipif(not hasattr(m, 'step_99'), reason='no step_99')\n"
        "def test_step_99():\n    assert m.step_99() == 99\n"
    )
    sdist, site0 = with_upstream_test(filled, tmp_path, "tests/test_feature.py", text)
    model = UPSTREAM_FILES["vllm/model.py"] + "def step_99():\n    return 0\n"
    change_layer_3(filled, {"vllm/model.py": model})
    filled.apply(sdist=sdist)
    row = qualify_layer_3(filled, tmp_path, site0)
    assert not row.ok
    assert "regression: tests.test_feature::test_step_99" in row.notes


def test_an_upstream_test_file_that_runs_no_test_fails_its_row(
    filled: Synthetic, tmp_path: Path
) -> None:
    text = "import pytest\n\n\n@pytest.mark.gpu\ndef test_kernel():\n    assert False\n"
    sdist, site0 = with_upstream_test(filled, tmp_path, "tests/test_gpu_only.py", text)
    filled.apply(sdist=sdist)
    row = qualify_layer_3(filled, tmp_path, site0)
    assert not row.ok
    assert (
        "tests/test_gpu_only.py: no test ran (none collected or all deselected)"
        in row.notes
    )


def test_a_cached_baseline_is_not_reused_in_another_environment(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (
        "import os\nfrom vllm.model import step_2\n\n\n"
        "def test_env():\n    assert 'K3_BREAK' not in os.environ\n"
        "    assert step_2() == 2\n"
    )
    sdist, site0 = with_upstream_test(filled, tmp_path, "tests/test_env.py", text)
    monkeypatch.setenv("K3_BREAK", "1")  # fails on pristine too: cached so
    filled.apply(sdist=sdist)
    assert qualify_layer_3(filled, tmp_path, site0).ok
    monkeypatch.delenv("K3_BREAK")
    model = UPSTREAM_FILES["vllm/model.py"].replace("return 2\n", "return -2\n", 1)
    change_layer_3(filled, {"vllm/model.py": model})
    filled.apply(sdist=sdist)
    row = qualify_layer_3(filled, tmp_path, site0)
    assert "regression: tests.test_env::test_env" in row.notes


def test_an_upstream_run_that_dies_fails_rather_than_reading_the_last_runs_xml(
    filled: Synthetic, tmp_path: Path
) -> None:
    site0 = prepare(filled, tmp_path)
    assert qualify_layer_3(filled, tmp_path, site0).ok
    # Importing vllm.model now kills the interpreter: pytest writes no XML.
    model = UPSTREAM_FILES["vllm/model.py"] + "import os\nos.abort()\n"
    change_layer_3(filled, {"vllm/model.py": model})
    row = qualify_layer_3(filled, tmp_path, site0)
    assert not row.ok
    assert "upstream tests did not run to the end (pytest exit code -6)" in row.notes
    assert row.upstream.startswith("0 passed")


def test_an_upstream_run_that_is_interrupted_fails(
    filled: Synthetic, tmp_path: Path
) -> None:
    row = layer_3_row_with_upstream_test(
        filled, tmp_path, "def test_stop():\n    raise KeyboardInterrupt\n"
    )
    assert not row.ok
    assert "upstream tests did not run to the end (pytest exit code 2)" in row.notes


def hub_test_and_step_one_broken(syn: Synthetic, tmp_path: Path) -> Row:
    """Layer 3's row where an upstream file cannot be collected (pristine
    too) and layer 3 breaks the test of another."""
    sdist, site0 = with_upstream_test(
        syn, tmp_path, "tests/test_aaa_needs_hub.py", "import no_such_hub_module\n"
    )
    model = UPSTREAM_FILES["vllm/model.py"].replace("return 1\n", "return -1\n", 1)
    syn.amend(3, {"vllm/model.py": model})
    syn.take_back("layer 3 breaks step_1")
    syn.apply(sdist=sdist)
    return qualify_layer_3(syn, tmp_path, site0)


def test_an_upstream_file_that_cannot_be_collected_hides_no_regression_in_another(
    filled: Synthetic, tmp_path: Path
) -> None:
    row = hub_test_and_step_one_broken(filled, tmp_path)
    assert not row.ok
    assert [n for n in row.notes if n.startswith("regression")] == [
        "regression: tests.test_model::test_step_one"
    ]


@pytest.mark.parametrize(
    "text",
    [
        "import pytest\npytest.skip('CUDA required', allow_module_level=True)\n",
        "import no_such_hub_module\n",
    ],
    ids=["skipped", "not-collected"],
)
def test_a_file_skipped_or_not_collected_on_pristine_and_layer_is_no_regression(
    filled: Synthetic, tmp_path: Path, text: str
) -> None:
    _, site0 = with_upstream_test(filled, tmp_path, "tests/test_needs_cuda.py", text)
    row = qualify_layer_3(filled, tmp_path, site0)
    assert row.ok, row.notes


def model_test_the_stack_deselects() -> str:
    """Upstream's model test with its first test marked 'gpu', which
    qualify's -m "not gpu" deselects."""
    return "import pytest\n" + UPSTREAM_FILES["tests/test_model.py"].replace(
        "def test_step_one", "@pytest.mark.gpu\ndef test_step_one"
    )


def test_a_test_passing_on_pristine_that_no_longer_runs_is_a_regression(
    filled: Synthetic, tmp_path: Path
) -> None:
    site0 = prepare(filled, tmp_path)
    test = model_test_the_stack_deselects()
    test += "\n\ndef test_other():\n    assert True\n"
    change_layer_3(filled, {"tests/test_model.py": test})
    row = qualify_layer_3(filled, tmp_path, site0)
    assert not row.ok
    assert "regression: tests.test_model::test_step_one (did not run)" in row.notes


def test_the_baseline_is_not_reused_for_an_interpreter_with_other_packages(
    synthetic: Synthetic, tmp_path: Path
) -> None:
    files = dict(UPSTREAM_FILES)
    files["tests/test_hub.py"] = "def test_hub():\n    import hub_client\n"
    site0 = prepare(synthetic, tmp_path, make_sdist(tmp_path / "hub.tar.gz", files))
    # The same interpreter with one more distribution installed.
    extra = tmp_path / "extra"
    (extra / "hub_client-1.0.dist-info").mkdir(parents=True)
    (extra / "hub_client-1.0.dist-info/METADATA").write_text(
        "Metadata-Version: 2.1\nName: hub-client\nVersion: 1.0\n"
    )
    (extra / "hub_client.py").write_text("")
    with_hub = tmp_path / "python-with-hub"
    with_hub.write_text(
        f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{extra}" exec {PYTHON} "$@"\n'
    )
    with_hub.chmod(0o755)
    work, out = tmp_path / "work", tmp_path / "out"
    tests = ["tests/test_hub.py"]
    without = baseline(PYTHON, synthetic.tree, site0, tests, work, out)
    assert without.results == {"tests.test_hub::test_hub": "failed"}
    with_it = baseline(str(with_hub), synthetic.tree, site0, tests, work, out)
    assert with_it.results == {"tests.test_hub::test_hub": "passed"}


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos.abort()\n",
        # pytest writes its XML when interrupted too: that is no baseline.
        "def test_stop():\n    raise KeyboardInterrupt\n",
    ],
    ids=["dies", "interrupted"],
)
def test_a_pristine_run_that_does_not_finish_is_refused_and_not_cached(
    synthetic: Synthetic, tmp_path: Path, source: str
) -> None:
    files = dict(UPSTREAM_FILES, **{"tests/test_stop.py": source})
    site0 = prepare(synthetic, tmp_path, make_sdist(tmp_path / "stop.tar.gz", files))
    work, out = tmp_path / "work", tmp_path / "out"
    tests = ["tests/test_stop.py"]
    with pytest.raises(StackError, match="did not run to the end on pristine"):
        baseline(PYTHON, synthetic.tree, site0, tests, work, out)
    assert not list(work.glob("baseline-*.json"))


def site_with(tmp_path: Path, modules: dict[str, str]) -> Path:
    """A site holding an empty ``vllm`` and ``vllm.envs`` and ``modules``
    (name under ``vllm/`` -> source)."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    for name, source in {"__init__": "", "envs": "", **modules}.items():
        (site / "vllm" / f"{name}.py").write_text(source)
    return site


def test_an_import_that_kills_the_interpreter_is_reported_as_such(
    tmp_path: Path,
) -> None:
    site = site_with(tmp_path, {"crash": "import os\nos.abort()\n"})
    assert check_imports(PYTHON, site, ["vllm.crash"]) == [
        "the import check ended with exit code -6 and no message"
    ]


def test_an_import_that_exits_the_interpreter_does_not_end_the_check(
    tmp_path: Path,
) -> None:
    site = site_with(
        tmp_path,
        {
            "cli": "import sys\nsys.exit(0)\n",
            "broken": "raise RuntimeError('broken')\n",
        },
    )
    assert check_imports(PYTHON, site, ["vllm.cli", "vllm.broken"]) == [
        "vllm.cli: SystemExit: 0",
        "vllm.broken: RuntimeError: broken",
    ]


def test_an_import_that_ends_the_process_with_status_0_is_reported(
    tmp_path: Path,
) -> None:
    site = site_with(tmp_path, {"quits": "import os\nos._exit(0)\n"})
    assert check_imports(PYTHON, site, ["vllm.quits"]) == [
        "the import check ended with exit code 0 and no message"
    ]


def test_an_import_that_ends_the_process_after_printing_is_reported(
    tmp_path: Path,
) -> None:
    site = site_with(tmp_path, {"quits": "import os\nprint('bye')\nos._exit(0)\n"})
    assert check_imports(PYTHON, site, ["vllm.quits"]) == [
        "bye",
        "the import check ended with exit code 0 and no message",
    ]


ONE_THREAD = (
    "import os\n\n\ndef test_threads():\n"
    "    assert os.environ['OMP_NUM_THREADS'] == '1'\n"
)


def test_a_layer_suite_runs_torch_on_one_thread_per_worker(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spinning OpenMP threads of one worker would starve the other's server
    round trips on a small machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    site0 = prepare(filled, tmp_path)
    (filled.root / "tests/layer3/test_layer3.py").write_text(ONE_THREAD)
    row = qualify_layer_3(filled, tmp_path, site0)
    assert row.ok, row.notes
    assert row.focused == "1 passed, 0 failed"


def test_upstream_tests_run_in_the_callers_thread_setting(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    test = ONE_THREAD.replace("test_threads", "test_new").replace("'1'", "'4'")
    row = layer_3_row_with_upstream_test(filled, tmp_path, test)
    assert row.ok, row.notes


def test_a_skipped_test_of_our_own_suites_fails_its_row() -> None:
    row = Row("3")
    outcomes = Outcomes({"t.a::one": "passed", "t.b::two": "skipped"})
    judge_suite(row, 0, outcomes)
    assert not row.ok
    assert row.focused == "1 passed, 0 failed, 1 skipped"
    assert "t.b::two" in row.notes[0]


def test_a_suite_that_ran_and_passed_whole_keeps_its_row() -> None:
    row = Row("3")
    judge_suite(row, 0, Outcomes({"t.a::one": "passed"}))
    assert row.ok and row.passed == 1 and not row.notes


def qualify_args(tmp_path: Path, layer: int | None) -> argparse.Namespace:
    return argparse.Namespace(layer=layer, python=PYTHON, out=tmp_path / "out")


def refuse_running_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("qualify ran tests")

    monkeypatch.setattr("k3stack.qualify.run_pytest", no_run)


def test_qualify_refuses_layer_0_before_running_anything(
    synthetic: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_running_tests(monkeypatch)
    with pytest.raises(StackError, match="layer 0: the series has 3 layers"):
        qualify_command(synthetic.stack(), synthetic.pin, qualify_args(tmp_path, 0))


def test_qualify_refuses_an_empty_series_in_one_line(
    synthetic: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_running_tests(monkeypatch)
    for patch in (synthetic.root / "patches").glob("*.patch"):
        patch.unlink()
    (synthetic.root / "patches/series").write_text("# no layers yet\n")
    with pytest.raises(StackError, match="patches/series lists no layers"):
        qualify_command(synthetic.stack(), synthetic.pin, qualify_args(tmp_path, None))


def test_qualify_refuses_a_lower_layer_using_a_higher_one_s_module_before_running(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_running_tests(monkeypatch)
    for n in (1, 2, 3):
        (filled.root / "tests" / f"layer{n}").mkdir(parents=True)
    (filled.root / "overlay/vllm/remote/__init__.py").write_text("import vllm.logits\n")
    with pytest.raises(StackError, match="a lower layer cannot use a higher one's"):
        qualify_command(filled.stack(), filled.pin, qualify_args(tmp_path, None))


def test_a_suite_run_that_exited_non_zero_fails_its_row() -> None:
    # A file that could not be collected: pytest says so only in its exit code.
    row = Row("3")
    judge_suite(row, 1, Outcomes({"t.a::one": "passed"}))
    assert not row.ok


def test_a_suite_run_with_no_passing_test_fails_its_row() -> None:
    row = Row("3")
    judge_suite(row, 0, Outcomes())
    assert not row.ok


def test_a_failed_test_is_counted_in_its_row() -> None:
    row = Row("3")
    judge_suite(row, 1, Outcomes({"t.a::one": "passed", "t.a::two": "failed"}))
    assert (row.ok, row.passed, row.failed) == (False, 1, 1)


def test_a_nameless_test_case_reads_as_failed(tmp_path: Path) -> None:
    """What pytest.exit() inside a test leaves in the JUnit XML."""
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest"><testcase time="0.000" />'
        "</testsuite></testsuites>"
    )
    assert read_junit(junit).results == {"None::None": "failed"}


def test_a_test_that_errored_reads_as_failed(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_setup">'
        '<error message="fixture failed"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert read_junit(junit).results == {"tests.test_a::test_setup": "failed"}


def test_a_new_upstream_test_that_fails_on_the_layer_is_a_regression(
    filled: Synthetic, tmp_path: Path
) -> None:
    row = layer_3_row_with_upstream_test(
        filled, tmp_path, "def test_new():\n    assert False\n"
    )
    assert not row.ok
    assert "regression: tests.test_model::test_new" in row.notes


def test_a_new_upstream_test_that_the_layer_skips_is_a_regression(
    filled: Synthetic, tmp_path: Path
) -> None:
    """Pristine has no outcome for it: it must pass, as one pristine passed."""
    test = "import pytest\n\n\ndef test_new():\n    pytest.skip('no hub')\n"
    row = layer_3_row_with_upstream_test(filled, tmp_path, test)
    assert not row.ok
    assert "regression: tests.test_model::test_new" in row.notes


def test_a_test_of_a_module_whose_name_extends_the_file_s_is_not_its() -> None:
    assert of_files("tests.test_model::test_one", ["tests/test_model.py"])
    assert not of_files("tests.test_model_extra::test_one", ["tests/test_model.py"])


def test_a_failed_row_fails_qualify(tmp_path: Path) -> None:
    rows = [Row("1 one"), Row("2 two", ok=False)]
    with pytest.raises(StackError, match="qualify failed for: 2 two"):
        _finish(rows, tmp_path, 0.0)


def test_qualify_refuses_a_missing_suite_before_running_anything(
    synthetic: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_running_tests(monkeypatch)
    with pytest.raises(StackError, match="Suite path tests/layer1 does not exist"):
        qualify_command(synthetic.stack(), synthetic.pin, qualify_args(tmp_path, None))


def test_an_upstream_test_the_layer_s_tree_lacks_is_refused(
    synthetic: Synthetic, tmp_path: Path
) -> None:
    with pytest.raises(StackError, match="not in the tree at layer-3: tests/gone.py"):
        export_tests(
            synthetic.tree,
            "layer-3",
            tmp_path / "t",
            ["tests/test_model.py", "tests/gone.py"],
        )


def test_a_layer_with_changes_and_no_suite_fails_its_row(
    filled: Synthetic, tmp_path: Path
) -> None:
    site0 = prepare(filled, tmp_path)
    shutil.rmtree(filled.root / "tests" / "layer2")
    stack = filled.stack()
    layer = stack.layer(2)
    work, out = tmp_path / "work", tmp_path / "out"
    row = qualify_layer(
        stack, filled.pin, layer, filled.tree, filled.wheel, site0, PYTHON, work, out
    )
    assert row.focused == "FAIL (no suite)"
    assert not row.ok


def test_an_overlay_module_that_fails_to_import_fails_its_row(
    filled: Synthetic, tmp_path: Path
) -> None:
    site0 = prepare(filled, tmp_path)
    change_layer_3(filled, {"vllm/broken.py": "raise RuntimeError('no hub')\n"})
    row = qualify_layer_3(filled, tmp_path, site0)
    assert row.imports == "FAIL (1)"
    assert not row.ok


def test_the_upstream_column_counts_regressions_apart_from_known_failures(
    filled: Synthetic, tmp_path: Path
) -> None:
    row = hub_test_and_step_one_broken(filled, tmp_path)
    assert row.upstream == ("0 passed, 1 regressions, 1 not passing on pristine either")


def test_the_baseline_is_not_reused_for_another_set_of_upstream_tests(
    synthetic: Synthetic, tmp_path: Path
) -> None:
    files = dict(UPSTREAM_FILES)
    files["tests/test_more.py"] = "def test_more():\n    assert True\n"
    site0 = prepare(synthetic, tmp_path, make_sdist(tmp_path / "more.tar.gz", files))
    work, out = tmp_path / "work", tmp_path / "out"
    baseline(PYTHON, synthetic.tree, site0, ["tests/test_model.py"], work, out)
    tests = ["tests/test_model.py", "tests/test_more.py"]
    assert baseline(PYTHON, synthetic.tree, site0, tests, work, out).results == {
        "tests.test_model::test_step_one": "passed",
        "tests.test_more::test_more": "passed",
    }


def test_the_baseline_is_not_reused_for_another_set_of_settled_tests(
    synthetic: Synthetic, tmp_path: Path
) -> None:
    site0 = prepare(synthetic, tmp_path)
    work, out = tmp_path / "work", tmp_path / "out"
    tests = ["tests/test_model.py"]
    step_one = "tests.test_model::test_step_one"
    settled = frozenset({step_one})
    assert (
        baseline(PYTHON, synthetic.tree, site0, tests, work, out, settled).results == {}
    )
    assert baseline(PYTHON, synthetic.tree, site0, tests, work, out).results == {
        step_one: "passed"
    }


def test_tests_the_stack_passed_are_left_out_of_the_pristine_run(
    filled: Synthetic, tmp_path: Path
) -> None:
    text = (
        "import pytest\n\n\nclass TestShapes:\n"
        "    @pytest.mark.parametrize('p', ['a/b', 'c::d', 'e[f]'])\n"
        "    def test_shape(self, p):\n        assert p\n"
    )
    _, site0 = with_upstream_test(filled, tmp_path, "tests/test_shapes.py", text)
    row = qualify_layer_3(filled, tmp_path, site0)
    assert row.ok, row.notes
    assert row.upstream == "4 passed, 0 regressions, 0 not passing on pristine either"
    pristine = read_junit(tmp_path / "out" / "baseline.xml")
    assert pristine.results == {}
    report = json.loads((tmp_path / "out" / "baseline.json").read_text())
    assert len(report["not_run_on_pristine_passed_on_the_stack"]) == 4


ENV_A, ENV_C = "tests.test_envs::test_a", "tests.test_envs::test_c"


def run_of(files: list[str], results: dict[str, str]) -> UpstreamRun:
    return UpstreamRun(files, Outcomes(results))


def test_a_test_one_layer_failed_is_not_settled_by_another_that_passed_it() -> None:
    runs = [
        run_of(["tests/test_envs.py"], {ENV_A: "passed", ENV_C: "passed"}),
        run_of(["tests/test_envs.py"], {ENV_A: "failed", ENV_C: "passed"}),
    ]
    assert settled_tests(runs) == {ENV_C}


def test_a_test_missing_from_a_layer_that_runs_its_file_is_not_settled() -> None:
    runs = [
        run_of(["tests/test_envs.py"], {ENV_A: "passed", ENV_C: "passed"}),
        run_of(["tests/test_envs.py", "tests/test_b.py"], {ENV_C: "passed"}),
        run_of(["tests/test_b.py"], {"tests.test_b::test_b": "passed"}),
    ]
    assert settled_tests(runs) == {ENV_C}


def test_qualify_refuses_a_python_that_does_not_run_in_one_line(
    synthetic: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_running_tests(monkeypatch)
    args = qualify_args(tmp_path, None)
    args.python = str(tmp_path / "no-such-python")
    with pytest.raises(StackError, match="no-such-python: No such file"):
        qualify_command(synthetic.stack(), synthetic.pin, args)
    assert not (tmp_path / "out").exists()


def test_site_refuses_a_python_that_does_not_run_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from k3stack.cli import main

    dest = tmp_path / "site"
    python = str(tmp_path / "no-such-python")
    assert main(["site", "--python", python, "--dest", str(dest)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-python: No such file" in err
    assert not dest.exists()


def test_a_pristine_install_pip_cannot_make_is_refused_in_one_line(
    synthetic: Synthetic, tmp_path: Path
) -> None:
    import venv

    from k3stack.qualify import pristine_site

    venv.create(tmp_path / "bare", with_pip=False)
    python = str(tmp_path / "bare" / "bin" / "python")
    with pytest.raises(StackError, match="pip could not install .*No module named pip"):
        pristine_site(python, synthetic.wheel, tmp_path / "work")
    assert not (tmp_path / "work" / "site-0" / ".k3stack-wheel").exists()


def test_a_site_file_edited_in_place_does_not_spoil_later_sites(
    filled: Synthetic, tmp_path: Path
) -> None:
    from k3stack.artifacts import build
    from k3stack.qualify import install_site, pristine_site

    work = tmp_path / "work"
    dist = tmp_path / "dist"
    payload = build(filled.stack(), filled.pin, filled.tree, filled.wheel, dist, 3)
    payload_dir = payload.context / "stack"
    site = tmp_path / "site"
    install_site(PYTHON, pristine_site(PYTHON, filled.wheel, work), payload_dir, site)
    # A file no layer changes, edited in place as editors and `>>` do: the
    # site is a hard-link copy of the pristine install.
    with (site / "vllm" / "__init__.py").open("a") as f:
        f.write("print('trying something')\n")
    install_site(PYTHON, pristine_site(PYTHON, filled.wheel, work), payload_dir, site)
    init = UPSTREAM_FILES["vllm/__init__.py"]
    assert (site / "vllm" / "__init__.py").read_text() == init
    assert (work / "site-0" / "vllm" / "__init__.py").read_text() == init


def layer_junit(tmp_path: Path, n: int) -> tuple[dict[str, str], int]:
    """The cases of layer ``n``'s JUnit XML by id and state, and the sum of
    its suites' ``failures`` and ``errors`` counts."""
    root = ET.parse(tmp_path / "out" / f"layer-{n}.xml").getroot()
    failed = sum(
        int(s.get("failures", 0)) + int(s.get("errors", 0))
        for s in root.iter("testsuite")
    )
    return read_junit(tmp_path / "out" / f"layer-{n}.xml").results, failed


def test_the_layer_junit_fails_no_test_that_fails_on_pristine_too(
    filled: Synthetic, tmp_path: Path
) -> None:
    text = "def test_download():\n    raise OSError('no model hub here')\n"
    _, site0 = with_upstream_test(filled, tmp_path, "tests/test_hub.py", text)
    row = qualify_layer_3(filled, tmp_path, site0)
    assert row.ok, row.notes
    cases, failed = layer_junit(tmp_path, 3)
    assert failed == 0
    assert cases["tests.test_hub::test_download"] == "skipped"
    assert cases["k3stack.qualify::layer 3 0003-layer-3.patch"] == "passed"


def test_the_layer_junit_fails_a_regression_the_stack_skipped_or_did_not_run(
    filled: Synthetic, tmp_path: Path
) -> None:
    site0 = prepare(filled, tmp_path)
    test = model_test_the_stack_deselects()
    test += "\n\n@pytest.mark.skip('later')\ndef test_other():\n    assert True\n"
    test += "\n\ndef test_third():\n    assert True\n"
    change_layer_3(filled, {"tests/test_model.py": test})
    row = qualify_layer_3(filled, tmp_path, site0)
    assert not row.ok
    cases, failed = layer_junit(tmp_path, 3)
    # Not run, and skipped (a new test must pass: pristine lacks it).
    assert cases["tests.test_model::test_step_one"] == "failed"
    assert cases["tests.test_model::test_other"] == "failed"
    assert cases["tests.test_model::test_third"] == "passed"
    assert cases["k3stack.qualify::layer 3 0003-layer-3.patch"] == "failed"
    assert failed == 3


def test_the_layer_junit_stays_well_formed_with_control_characters_in_notes(
    tmp_path: Path,
) -> None:
    from k3stack.qualify import write_layer_junit

    junit = tmp_path / "layer-3.xml"
    row = Row("3 0003-layer-3.patch", ok=False, junit=junit)
    row.notes.append("vllm.remote: RuntimeError: \x1b[31mno device\x1b[0m\x00")
    write_layer_junit(row, Outcomes())
    failure = ET.parse(junit).getroot().find(".//failure")
    assert failure is not None and "no device" in (failure.text or "")


def qualify_into(
    syn: Synthetic, out: Path, layer: int, monkeypatch: pytest.MonkeyPatch
) -> set[str]:
    """``qualify --layer N --out OUT`` on ``syn`` (upstream files from a
    cache holding the synthetic sdist and wheel); the names in ``out``."""
    monkeypatch.setenv("K3_STACK_CACHE", str(syn.root.parent / "fetch-cache"))
    args = argparse.Namespace(layer=layer, python=PYTHON, out=out)
    qualify_command(syn.stack(), syn.pin, args)
    return {p.name for p in out.iterdir()}


def stack_with_suites(syn: Synthetic) -> None:
    """Give the checkout a tooling suite and each layer a passing suite, and
    put the synthetic upstream files where ``fetch`` looks first."""
    cache = syn.root.parent / "fetch-cache"
    cache.mkdir()
    for path in (syn.sdist, syn.wheel):
        shutil.copyfile(path, cache / path.name)
    for suite in ("tooling", "layer1", "layer2", "layer3"):
        (syn.root / "tests" / suite).mkdir(parents=True)
        test = syn.root / "tests" / suite / f"test_{suite}.py"
        test.write_text("def test_ok():\n    assert True\n")
    git(syn.root, "add", "-A")
    git(syn.root, "commit", "-q", "-m", "suites")


def test_a_cached_baseline_still_writes_its_junit_into_a_new_out(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack_with_suites(filled)
    first = qualify_into(filled, tmp_path / "first", 2, monkeypatch)
    again = qualify_into(filled, tmp_path / "again", 2, monkeypatch)
    assert "baseline.xml" in first
    assert again == first
    pristine = (tmp_path / "first" / "baseline.xml").read_bytes()
    assert (tmp_path / "again" / "baseline.xml").read_bytes() == pristine


def test_a_run_into_the_out_of_an_earlier_run_leaves_none_of_its_files(
    filled: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack_with_suites(filled)
    out = tmp_path / "out"
    assert "layer-2.xml" in qualify_into(filled, out, 2, monkeypatch)
    names = qualify_into(filled, out, 1, monkeypatch)
    assert sorted(names) == [
        "baseline.json",
        "baseline.xml",
        "layer-1-focused.xml",
        "layer-1-upstream.xml",
        "layer-1.xml",
        "summary.md",
        "tooling.xml",
    ]


def test_qualify_refuses_an_out_holding_files_it_did_not_write(
    synthetic: Synthetic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_running_tests(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / "layer-2.xml").write_text("<testsuites/>\n")
    with pytest.raises(StackError, match="holds 'notes.txt', which qualify does not"):
        qualify_command(synthetic.stack(), synthetic.pin, qualify_args(tmp_path, 2))
    assert sorted(p.name for p in out.iterdir()) == ["layer-2.xml", "notes.txt"]
