# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``python -m k3stack COMMAND``: apply, refresh, rebase, build, site, validate,
qualify."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from k3stack import StackError
from k3stack.artifacts import build, docker_build
from k3stack.fetch import fetch
from k3stack.gitutil import git
from k3stack.pin import Pin, load_pin
from k3stack.refresh import finish_write_back, refresh, refuse_stopped_refresh
from k3stack.series import Stack, check_layering, check_suites, load_stack
from k3stack.upstream import from_checkout, from_sdist
from k3stack.worktree import UPSTREAM_TAG, build_tree, current_marker, tree_lock

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TREE = ROOT / ".work" / "tree"
DEFAULT_DIST = ROOT / "dist"


def pristine_message(pin: Pin) -> str:
    return f"{pin.name} {pin.version} (upstream {pin.commit}), pristine\n"


def do_apply(
    stack: Stack, pin: Pin, tree: Path, upto: int | None, source: Path | None
) -> None:
    if source is None:
        lay_out = from_sdist(fetch(pin.sdist, pin.name))
    else:
        lay_out = from_checkout(source, pin.commit)
    build_tree(stack, tree, lay_out, pristine_message(pin), upto)


def cmd_apply(args: argparse.Namespace) -> None:
    stack, pin = load_stack(ROOT), load_pin()
    n = len(stack.upto(args.upto))  # an --upto out of range fetches nothing
    start = time.monotonic()
    do_apply(stack, pin, args.tree, args.upto, args.source)
    print(
        f"apply: {pin.name} {pin.version} + {n} layers in {args.tree} "
        f"({time.monotonic() - start:.1f} s); `git log --oneline` shows the stack"
    )


def cmd_refresh(args: argparse.Namespace) -> None:
    # What an interrupted refresh left half written is finished first: until
    # then the checkout may not load.
    changed = finish_write_back(ROOT)
    changed += refresh(load_stack(ROOT), args.tree)
    for line in changed:
        print(f"refresh: {line}")
    print(f"refresh: {len(changed)} files changed")


def check_tree_upstream(tree: Path, pin: Pin) -> None:
    """Refuse a tree whose pristine commit is not the pinned release's (apply
    and ``rebase --port`` write ``pristine_message(pin)``): after a re-pin its
    files over the other release's binaries would be neither release."""
    found = git(tree, "log", "-1", "--format=%s", UPSTREAM_TAG, check=False)
    wanted = pristine_message(pin).strip()
    if found != wanted:
        raise StackError(
            f"{tree} holds {found or 'no pristine commit'!r} as upstream, the pin "
            f"is {wanted!r}; refused: run `nox -s apply` again"
        )


def cmd_build(args: argparse.Namespace) -> None:
    with tree_lock(args.tree, "build"):
        _build(args)


def _build(args: argparse.Namespace) -> None:
    stack, pin = load_stack(ROOT), load_pin()
    marker = current_marker(stack, args.tree)
    check_tree_upstream(args.tree, pin)
    layers, listed = marker["layers"], len(stack.layers)
    if layers < listed:
        # A tree applied with --upto, or before the series gained layers.
        left = range(layers + 1, listed + 1)
        names = f"layer {left[0]}" if len(left) == 1 else f"layers {left[0]}..{listed}"
        print(
            f"build: {args.tree} holds layers 1..{layers} of the series' "
            f"{listed}: the artifacts leave out {names} "
            "(`nox -s apply` applies them all)"
        )
    start = time.monotonic()
    wheel = fetch(pin.wheel(), pin.name)
    result = build(stack, pin, args.tree, wheel, args.dist, layers)
    print(f"build: wheel {result.wheel} ({time.monotonic() - start:.1f} s)")
    print(f"build: image context {result.context}")
    print(f"build: lock {result.lock}")
    tag = f"vllm-k3-overlay:{result.version.replace('+', '-')}"
    print(f"build: {docker_build(result.context, tag)}")


def cmd_site(args: argparse.Namespace) -> None:
    from k3stack.qualify import check_python, install_site, pristine_site

    check_site_dest(args.dest)
    check_python(args.python, "pip")
    stack, pin = load_stack(ROOT), load_pin()
    work = ROOT / ".work"
    with tree_lock(args.tree, "site"):
        marker = current_marker(stack, args.tree)
        check_tree_upstream(args.tree, pin)
        wheel = fetch(pin.wheel(), pin.name)
        result = build(
            stack, pin, args.tree, wheel, work / "site-dist", marker["layers"]
        )
    site0 = pristine_site(args.python, wheel, work / "qualify")
    install_site(args.python, site0, result.context / "stack", args.dest)
    print(f"site: {result.version} installed in {args.dest}")


def check_site_dest(dest: Path) -> None:
    """Refuse a ``--dest`` that ``site`` would replace but did not make: a
    file, or a non-empty folder without the stamp every site it makes
    carries (a site-packages the patched wheel was pip-installed into holds
    other packages)."""
    from k3stack.qualify import WHEEL_STAMP

    if not dest.exists():
        return
    if not dest.is_dir():
        raise StackError(f"site: {dest} exists and is not a directory; refused")
    if any(dest.iterdir()) and not (dest / WHEEL_STAMP).is_file():
        raise StackError(
            f"site: {dest} is not empty and was not made by `site`; refused: "
            "choose another --dest or remove it"
        )


def cmd_validate(args: argparse.Namespace) -> None:
    stack = load_stack(ROOT)
    check_suites(stack)
    check_layering(stack)
    print(
        f"validate: {len(stack.layers)} layers, series, overlay ownership, layering "
        "and suites ok"
    )


def cmd_rebase(args: argparse.Namespace) -> None:
    from k3stack.rebase import rebase_command

    if not args.port:
        rebase_command(load_stack(ROOT), load_pin(), args)
        return
    with tree_lock(args.tree, "rebase --port"):
        rebase_command(load_stack(ROOT), load_pin(), args)


def cmd_qualify(args: argparse.Namespace) -> None:
    from k3stack.qualify import qualify_command

    qualify_command(load_stack(ROOT), load_pin(), args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3stack", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("apply", help="lay out upstream and commit each layer")
    a.add_argument("--upto", type=int, help="stop after layer N")
    a.add_argument("--tree", type=Path, default=DEFAULT_TREE)
    a.add_argument("--source", type=Path, help="a git checkout at the pinned commit")
    a.set_defaults(func=cmd_apply)
    r = sub.add_parser("refresh", help="write layer commits back to patches/")
    r.add_argument("--tree", type=Path, default=DEFAULT_TREE)
    r.set_defaults(func=cmd_refresh)
    b = sub.add_parser("build", help="wheel, image context and lock")
    b.add_argument("--tree", type=Path, default=DEFAULT_TREE)
    b.add_argument("--dist", type=Path, default=DEFAULT_DIST)
    b.set_defaults(func=cmd_build)
    st = sub.add_parser("site", help="install the applied stack into a folder")
    st.add_argument("--tree", type=Path, default=DEFAULT_TREE)
    st.add_argument("--dest", type=Path, default=ROOT / ".work" / "site")
    st.add_argument("--python", default=sys.executable)
    st.set_defaults(func=cmd_site)
    v = sub.add_parser("validate", help="check the series and overlay ownership")
    v.set_defaults(func=cmd_validate)
    rb = sub.add_parser("rebase", help="classify every layer on another upstream")
    target = rb.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", metavar="VERSION", help="an upstream release")
    target.add_argument("--checkout", type=Path, help="a git checkout of upstream")
    rb.add_argument("--report", type=Path, default=ROOT / "dist" / "rebase")
    rb.add_argument("--write-pin", action="store_true", help="pin --to VERSION")
    rb.add_argument(
        "--port",
        action="store_true",
        help="pin --to VERSION and rebase the work tree's layer commits onto it",
    )
    rb.add_argument(
        "--tree", type=Path, default=DEFAULT_TREE, help="the work tree --port moves"
    )
    rb.set_defaults(func=cmd_rebase)
    q = sub.add_parser("qualify", help="per-layer qualification")
    q.add_argument("--layer", type=int, help="qualify only layer N (prefix 1..N)")
    q.add_argument("--python", default=sys.executable)
    q.add_argument("--out", type=Path, default=ROOT / "dist" / "qualify")
    q.set_defaults(func=cmd_qualify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command != "refresh":  # refresh finishes it first
            refuse_stopped_refresh(ROOT, args.command)
        args.func(args)
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C is the operator's choice, not a failure of ours: one line.
        print(f"error: {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0
