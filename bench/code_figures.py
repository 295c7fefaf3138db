#!/usr/bin/env python3
"""The code's shape in three figures: modules over 450 lines, functions over 80 lines, and the
places in the tool that start a child process (a call to ``subprocess.Popen``/``run``/``call``/
``check_call``/``check_output``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*``,
``os.system``, ``os.popen``, ``os.fork``, ``pty.spawn``, or a ``multiprocessing`` process).

python bench/code_figures.py [PACKAGE_DIR]   (default: tools/vllm_overlay)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MODULE_LINES = 450
FUNCTION_LINES = 80
SUBPROCESS_CALLS = {"Popen", "run", "call", "check_call", "check_output", "getoutput",
                    "getstatusoutput"}  # fmt: skip
OS_CALLS = {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp"}


def starts_a_child(call: ast.Call) -> bool:
    """Whether ``call`` starts a child process (by the names above)."""
    f = call.func
    if not isinstance(f, ast.Attribute) or not isinstance(f.value, ast.Name):
        return False
    owner, name = f.value.id, f.attr
    if owner == "subprocess":
        return name in SUBPROCESS_CALLS
    if owner == "os":
        return name in OS_CALLS or name.startswith(("exec", "spawn"))
    if owner == "pty":
        return name in ("spawn", "fork")
    return owner == "multiprocessing" and name in ("Process", "Pool")


def figures(package: Path) -> dict[str, list[str]]:
    modules, functions, children = [], [], []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            modules.append(f"{rel}: {lines} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > FUNCTION_LINES:
                    functions.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
            elif isinstance(node, ast.Call) and starts_a_child(node):
                children.append(f"{rel}:{node.lineno} {ast.unparse(node.func)}")
    return {
        f"modules over {MODULE_LINES} lines": modules,
        f"functions over {FUNCTION_LINES} lines": functions,
        "places that start a child process": children,
    }


def main(argv: list[str]) -> int:
    package = (
        Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "tools" / "vllm_overlay"
    )
    for title, items in figures(package).items():
        print(f"{title}: {len(items)}")
        for item in items:
            print(f"    {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
