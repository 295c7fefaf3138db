"""The house rules of the package itself: stages import downwards only, one module starts
child processes, one module defines exceptions, and the command line works without the test
extra (pytest)."""

from __future__ import annotations

import ast
import builtins
import re
import subprocess
import sys
import textwrap
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "tools" / "vllm_overlay"

# Lowest first. A module may import its own stage and any stage below it, never above.
STAGES = (
    "base", "index", "pin", "overlay", "wheel", "envs", "testing", "rebase", "track", "upstream", "cli",
)  # fmt: skip
BASE_MODULES = {"__init__", "errors", "util", "gitcmd", "gitrepo", "progress", "process"}
CLI_MODULES = {"main", "__main__", "commands"}


def stage_of(module: str) -> str:
    """The stage of ``vllm_overlay.<a>[.<b>…]`` (or of a path relative to the package)."""
    first = module.split(".")[0]
    if first in BASE_MODULES:
        return "base"
    if first in CLI_MODULES:
        return "cli"
    if first in STAGES:
        return first
    raise AssertionError(f"vllm_overlay.{module} belongs to no stage: add it to STAGES")


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"] or ["__init__"]
        out.append((".".join(parts), path))
    return out


def _submodule(package: str, name: str) -> str:
    """``package.name`` where that is a module of ours (or the package's ``__version__``),
    else ``package`` (``name`` is something the package defines)."""
    sub = f"{package}.{name}"
    rel = Path(*sub.split(".")[1:]) if sub.startswith("vllm_overlay.") else None
    if sub == "vllm_overlay.__version__" or (
        rel is not None and ((PKG / rel).with_suffix(".py").is_file() or (PKG / rel).is_dir())
    ):
        return sub
    return package


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """Every ``vllm_overlay.*`` module the file imports, anywhere in it (functions too)."""
    found: list[tuple[int, str]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                names = [".".join(["vllm_overlay", *filter(None, base), node.module or ""])]
            else:
                names = [node.module or ""]
            # from vllm_overlay.pkg import mod, names: each submodule by its own name
            names = [_submodule(names[0], a.name) for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("vllm_overlay.") and name != "vllm_overlay.__version__":
                found.append((node.lineno, name.removeprefix("vllm_overlay.").strip(".")))
    return found


def test_every_module_belongs_to_a_stage():
    for module, _ in modules():
        stage_of(module)


def test_stages_import_downwards_only():
    rank = {s: i for i, s in enumerate(STAGES)}
    wrong = []
    for module, path in modules():
        mine = stage_of(module)
        for line, target in imported_modules(path, module):
            if target == "__version__":
                continue
            theirs = stage_of(target)
            if rank[theirs] > rank[mine]:
                wrong.append(f"{path.relative_to(PKG)}:{line} ({mine}) imports {target} ({theirs})")
    assert not wrong, "lower stages import higher ones:\n" + "\n".join(wrong)


def test_the_layering_check_catches_an_upward_import(tmp_path):
    """The check itself can fail: a pin module importing the wheel stage is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from vllm_overlay.wheel.build import build\n")
    [(line, target)] = imported_modules(bad, "pin.bad")
    assert (line, stage_of(target)) == (2, "wheel")
    assert STAGES.index(stage_of(target)) > STAGES.index(stage_of("pin.bad"))


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph`` (module -> the modules it imports): its strongly connected
    components of more than one module, each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (anywhere in the file, functions too)."""
    known = {m for m, _ in modules()}
    graph: dict[str, set[str]] = {}
    for module, path in modules():
        targets = set()
        for _, target in imported_modules(path, module):
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def test_no_import_circles():
    """No module imports, even inside a function, one that imports it back (through any
    chain): a circle means two modules are one, or something sits in the wrong one."""
    circles = import_circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_catches_a_circle(tmp_path):
    """The check itself can fail: the cache importing the builder again (the builder imports
    the cache: the circle there was) and a three-module ring are found; a chain is not."""
    graph = import_graph()
    assert "envs.cache" in graph["envs.envbuild"]
    back = {**graph, "envs.cache": graph["envs.cache"] | {"envs.envbuild"}}
    assert ["envs.cache", "envs.envbuild"] in import_circles(back)
    ring = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(ring) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from vllm_overlay.envs import envbuild\n")
    assert imported_modules(lazy, "envs.cache") == [(2, "envs.envbuild")]


# ---- one runner, one exceptions module ------------------------------------------------------

RUNNER = PKG / "process.py"  # the one module that starts a child process
ERRORS = PKG / "errors.py"  # the one module that defines exception classes
# What starts a child, by module: any use of one of these names (a call, or the function
# passed on: ``pool.submit(subprocess.run, …)``), reached through the module under any name
# (``import subprocess as sp``, ``import asyncio.subprocess``) or imported from it (``from
# subprocess import run as go``); ``exec*``, ``spawn*`` and ``posix_spawn*`` too for os.
STARTS_A_CHILD = {
    "subprocess": {"Popen", "run", "call", "check_call", "check_output", "getoutput",
                   "getstatusoutput"},
    "os": {"system", "popen", "fork", "forkpty"},
    "pty": {"spawn", "fork"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "asyncio.subprocess": {"create_subprocess_exec", "create_subprocess_shell"},
    "multiprocessing": {"Process", "Pool", "get_context"},
    "multiprocessing.pool": {"Pool"},
    "concurrent.futures": {"ProcessPoolExecutor"},
    "concurrent.futures.process": {"ProcessPoolExecutor"},
    "git": {"Git"},  # GitPython's own command object: gitcmd.Git is the one way
    "git.cmd": {"Git"},
}  # fmt: skip
# Methods that start a child whatever object they are on: an event loop's.
CHILD_METHODS = {"subprocess_exec", "subprocess_shell"}
# The git layer's command object subclasses GitPython's, and starts every git through the
# runner (gitcmd.py); the use below is that subclassing and the parent's wrapper type.
ALLOWED = {("gitcmd.py", "git.Git")}


def _starts_a_child(module: str, name: str) -> bool:
    if module == "os" and name.startswith(("exec", "spawn", "posix_spawn")):
        return True
    return name in STARTS_A_CHILD.get(module, ())


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _annotations(tree: ast.AST) -> list[ast.expr]:
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            found += [a.annotation for a in every if a is not None and a.annotation is not None]
            found += [node.returns] if node.returns is not None else []
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
    return found


def child_starts(path: Path) -> list[tuple[int, str]]:
    """Every use in the file of something that starts a child process (``STARTS_A_CHILD``,
    ``CHILD_METHODS``), whether it names the module (``subprocess.Popen``, under any
    ``import … as``, or a submodule) or a name imported from it (``from subprocess import
    run``), called or not."""
    tree = ast.parse(path.read_text(), str(path))
    modules: dict[str, str] = {}  # local name -> module
    names: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                # ``import asyncio.subprocess`` binds ``asyncio``; ``as x`` binds the whole
                modules[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = (node.module, a.name)
    # a type annotation names a class, it starts nothing (``proc: subprocess.Popen[bytes]``)
    hints = {id(n) for a in _annotations(tree) for n in ast.walk(a)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in hints:
            continue
        if isinstance(node, ast.Attribute) and node.attr in CHILD_METHODS:
            found.add((node.lineno, f"*.{node.attr}"))
            continue
        parts = _dotted(node) if isinstance(node, (ast.Attribute, ast.Name)) else None
        if not parts:
            continue
        if parts[0] in modules:
            dotted = [*modules[parts[0]].split("."), *parts[1:]]
        elif parts[0] in names:
            module, name = names[parts[0]]
            dotted = [*module.split("."), name, *parts[1:]]
        else:
            continue
        for i in range(1, len(dotted)):  # subprocess.run, asyncio.subprocess.create_…
            if _starts_a_child(".".join(dotted[:i]), dotted[i]):
                found.add((node.lineno, ".".join(dotted[: i + 1])))
                break
    return sorted(found)


def test_only_the_runner_starts_a_child_process():
    """Every child starts in ``process.py`` (one Popen, one stop policy); the others call it,
    GitPython's git children too (gitcmd.py)."""
    found = [
        f"{path.relative_to(PKG)}:{line} {use}"
        for _, path in modules()
        if path != RUNNER
        for line, use in child_starts(path)
        if (str(path.relative_to(PKG)), use) not in ALLOWED
    ]
    assert not found, "a child process started outside process.py:\n" + "\n".join(found)
    assert [use for _, use in child_starts(RUNNER)] == ["subprocess.Popen"]


def test_the_runner_check_catches_a_child_started_elsewhere(tmp_path):
    """The check itself can fail: each way of starting a child is found, a lookalike is not."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        textwrap.dedent("""\
        import asyncio
        import asyncio.subprocess
        import multiprocessing as mp
        import os
        import subprocess as sp
        from concurrent.futures import ProcessPoolExecutor
        from os import system
        from subprocess import run as go
        from vllm_overlay import process
        async def f(loop, pool):
            sp.Popen(["x"])
            go(["x"])
            os.execvp("x", ["x"])
            await asyncio.create_subprocess_exec("x")
            await asyncio.subprocess.create_subprocess_shell("x")
            await loop.subprocess_exec(object, "x")
            mp.get_context("spawn").Process(target=f)
            ProcessPoolExecutor()
            pool.submit(sp.run, ["x"])
            system("x")
            os.spawnlp(os.P_WAIT, "x", "x")
            process.run("x")
            "x".split()
            asyncio.sleep(0)
        """)
    )
    assert child_starts(bad) == [
        (11, "subprocess.Popen"), (12, "subprocess.run"), (13, "os.execvp"),
        (14, "asyncio.create_subprocess_exec"), (15, "asyncio.subprocess.create_subprocess_shell"),
        (16, "*.subprocess_exec"), (17, "multiprocessing.get_context"),
        (18, "concurrent.futures.ProcessPoolExecutor"), (19, "subprocess.run"),
        (20, "os.system"), (21, "os.spawnlp"),
    ]  # fmt: skip


_EXCEPTION_NAME = re.compile(r"(Error|Exception|Warning|Exit|Interrupt)$")
BUILTIN_EXCEPTIONS = {
    n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
}


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def exception_classes(paths: list[Path]) -> list[tuple[Path, int, str]]:
    """Every class in ``paths`` that derives from an exception: a builtin one, one named like
    one (``…Error``, ``…Exception``, ``…Warning``: another library's), or one of these
    classes (through any chain of them)."""
    classes = [
        (path, node)
        for path in paths
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef)
    ]
    known = set(BUILTIN_EXCEPTIONS)
    found: dict[tuple[Path, int], str] = {}
    grew = True
    while grew:
        grew = False
        for path, node in classes:
            if (path, node.lineno) in found:
                continue
            bases = {_base_name(b) for b in node.bases}
            if bases & known or any(_EXCEPTION_NAME.search(b) for b in bases):
                found[(path, node.lineno)] = node.name
                known.add(node.name)
                grew = True
    return sorted((path, line, name) for (path, line), name in found.items())


def test_exception_classes_are_defined_in_errors_only():
    """One exceptions module (twine's one class per condition, each with its docstring)."""
    found = exception_classes([path for _, path in modules()])
    outside = [f"{p.relative_to(PKG)}:{line} {name}" for p, line, name in found if p != ERRORS]
    assert not outside, "exception classes outside errors.py:\n" + "\n".join(outside)
    inside = [name for p, _, name in found if p == ERRORS]
    assert len(inside) >= 30 and "OverlayError" in inside
    import vllm_overlay.errors as errors

    undocumented = [n for n in inside if not getattr(errors, n).__doc__]
    assert not undocumented, f"exception classes without a docstring: {undocumented}"


def test_the_exceptions_check_catches_a_class_outside_errors(tmp_path):
    """The check itself can fail: a class deriving from ours, from a builtin exception, or
    from another such class is found; a plain class is not."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        textwrap.dedent("""\
        from vllm_overlay import errors
        class Plain:
            pass
        class StageError(errors.BuildError):
            pass
        class Lookup(LookupError):
            pass
        class Deeper(Lookup):
            pass
        """)
    )
    found = [(line, name) for _, line, name in exception_classes([bad])]
    assert found == [(4, "StageError"), (6, "Lookup"), (8, "Deeper")]


BLOCK_PYTEST = textwrap.dedent(
    """
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("pytest", "_pytest", "pluggy"):
                raise ImportError(f"{name} is blocked: the CLI must not need the test extra")
    sys.meta_path.insert(0, _Block())
    """
)


def _python_without_pytest(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_PYTEST)
    env = {"PYTHONPATH": f"{site}:{PKG.parent}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_block_really_blocks_pytest(tmp_path):
    proc = _python_without_pytest(tmp_path, "import pytest")
    assert proc.returncode != 0 and "is blocked" in proc.stderr


def test_the_cli_and_every_verbs_help_work_without_pytest(tmp_path):
    code = textwrap.dedent(
        """
        import contextlib, io, sys
        import vllm_overlay.main as m
        assert "pytest" not in sys.modules
        verbs = list(m.COMMANDS)
        for argv in [["--help"]] + [[v, "--help"] for v in verbs]:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    m.main(argv)
                except SystemExit as e:
                    assert e.code == 0, (argv, e.code)
            assert "usage: vllm-overlay" in out.getvalue(), argv
        print(len(verbs), "verbs")
        """
    )
    proc = _python_without_pytest(tmp_path, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("verbs")


def test_the_plugin_repeats_the_runner_contract_exactly():
    """The plugin is copied alone into vLLM's test run, so it repeats the contract's names."""
    from vllm_overlay.testing import contract, plugin

    names = [n for n in vars(contract) if n.isupper() and n != "PLUGIN_FILE"]
    assert len(names) >= 5
    assert {n: getattr(plugin, n) for n in names} == {n: getattr(contract, n) for n in names}
    assert contract.PLUGIN_FILE.resolve() == Path(plugin.__file__).resolve()
