"""The release's own pre-commit hooks, on the files a change touches.

vLLM's sdist carries its ``.pre-commit-config.yaml``. We run, on the commit's files, in the
clone (a git work tree, as pre-commit runs them):

- ruff's two hooks (``ruff-check`` with the configured arguments, ``--fix`` included, and
  ``ruff-format``) with the ruff the configuration pins: its ``rev`` is a frozen commit with
  the version in a ``# frozen: vX.Y.Z`` comment (or the tag itself), installed once into a
  cached environment of its own (``envs/clientenv.py``: one pinned requirement). Where the
  tree has no configuration (or names no version), this tool's own ruff runs with the tree's
  ``pyproject.toml``, and the result says so.
- the local hooks written in Python (``entry: python tools/pre_commit/<hook>.py``) whose
  ``files``/``exclude``/``types`` select a touched file, with the Python of the release's
  test environment, where every ``additional_dependencies`` entry is installed there (mypy's,
  which needs its own pinned mypy and stubs, is skipped and listed as skipped).

Hooks that fix files (ruff's ``--fix``, ruff format, the SPDX header) fix them: ``run``
reports what changed. `upstream` runs them once to apply their fixes to the commit, then again
on the commit, where each must pass and change nothing (what pre-commit's second run sees).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from packaging.requirements import InvalidRequirement, Requirement

from vllm_overlay.gitrepo import open_repo, run_git
from vllm_overlay.process import run
from vllm_overlay.util import sha256_file

CONFIG = ".pre-commit-config.yaml"
RUFF_REPO = "ruff-pre-commit"
RUFF_ENTRY = {"ruff-check": ("check", "--force-exclude"), "ruff": ("check", "--force-exclude"),
              "ruff-format": ("format", "--force-exclude")}  # fmt: skip
TYPES = {"python": (".py",), "pyi": (".pyi",)}


@dataclass
class HookResult:
    id: str
    ran: bool
    ok: bool = True
    changed: list[str] = field(default_factory=list)  # files the hook rewrote
    output: str = ""
    why_skipped: str = ""
    tool: str = ""  # what ran it (ruff's version and where it came from)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in ("", [])}


@dataclass
class Hooks:
    """The hooks of a tree that apply to some files, ready to run."""

    config_found: bool
    ruff: list[str]  # the ruff command
    ruff_tool: str
    entries: list[tuple[str, list[str], list[str]]]  # (id, argv before the files, files)
    skipped: list[HookResult]


def load_config(tree: Path, python: str) -> dict | None:
    """The tree's pre-commit configuration, read with ``python`` (it needs PyYAML: vLLM's
    test environment has it, this tool does not depend on it); None where there is none."""
    path = tree / CONFIG
    if not path.is_file():
        return None
    code = "import json, sys, yaml; json.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)"
    out = run(python, "-c", code, os.fspath(path), hint=f"{path} could not be read as YAML")
    return json.loads(out.stdout) if out.stdout.strip() else {}


def ruff_version(tree: Path, config: dict | None) -> str:
    """The ruff version the configuration pins ('' where it pins none)."""
    for repo in (config or {}).get("repos", []):
        if RUFF_REPO not in str(repo.get("repo", "")):
            continue
        rev = str(repo.get("rev", ""))
        if m := re.fullmatch(r"v?(\d+\.\d+\.\d+)", rev):
            return m.group(1)
        text = (tree / CONFIG).read_text()
        if m := re.search(rf"rev:\s*{re.escape(rev)}\s*#\s*frozen:\s*v?(\d+\.\d+\.\d+)", text):
            return m.group(1)
    return ""


def _ruff(version: str) -> tuple[list[str], str]:
    if version:
        from vllm_overlay.envs.clientenv import ensure_client_env

        env = ensure_client_env(f"ruff=={version}", pinned=False)
        return [os.fspath(env.bin("ruff"))], f"ruff {version}, as the release's configuration pins"
    here = Path(sys.executable).parent / "ruff"
    found = os.fspath(here) if here.exists() else shutil.which("ruff")
    if not found:
        return [], ""
    v = run(found, "--version", check=False).stdout.strip()
    return [found], f"{v} of this tool's environment (the tree pins no ruff), with its config"


def _selected(hook: dict, config: dict, files: list[str]) -> list[str]:
    """The files ``hook`` runs on, as pre-commit chooses them."""
    out = []
    types = hook.get("types") or []
    types_or = hook.get("types_or") or []
    for f in files:
        if hook.get("files") and not re.search(hook["files"], f):
            continue
        if hook.get("exclude") and re.search(hook["exclude"], f):
            continue
        if config.get("exclude") and re.search(config["exclude"], f):
            continue
        suffix = PurePosixPath(f).suffix
        if types and not all(suffix in TYPES.get(t, ()) for t in types):
            continue
        if types_or and not any(suffix in TYPES.get(t, ()) for t in types_or):
            continue
        out.append(f)
    return out


def _installed(python: str, deps: list[str]) -> str:
    """'' where every dependency is installed in ``python`` at a version it allows; else
    which is not."""
    for dep in deps:
        try:
            req = Requirement(dep)
        except InvalidRequirement:
            return f"{dep} (not a requirement)"
        code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
        out = run(python, "-c", code, req.name, check=False)
        if out.returncode != 0:
            return f"{req.name} is not installed in the test environment"
        if req.specifier and not req.specifier.contains(out.stdout.strip(), prereleases=True):
            return f"it needs {dep}; the test environment has {req.name} {out.stdout.strip()}"
    return ""


def select(tree: Path, files: list[str], python: str) -> Hooks:
    """The hooks of ``tree`` (its configuration read with ``python``) for ``files``."""
    config = load_config(tree, python)
    ruff, tool = _ruff(ruff_version(tree, config))
    entries: list[tuple[str, list[str], list[str]]] = []
    skipped: list[HookResult] = []
    py = [f for f in files if PurePosixPath(f).suffix in (".py", ".pyi")]
    if config is None:
        entries = [
            ("ruff-check", [*ruff, "check", "--fix"], py),
            ("ruff-format", [*ruff, "format"], py),
        ]
        return Hooks(False, ruff, tool, entries, skipped)
    default_stages = config.get("default_stages") or ["pre-commit"]
    for repo in config.get("repos", []):
        local = repo.get("repo") == "local"
        for hook in repo.get("hooks", []):
            hid = hook.get("id", "?")
            stages = hook.get("stages") or default_stages
            chosen = _selected(hook, config, files)
            if not chosen or "pre-commit" not in stages and "commit" not in stages:
                continue
            if RUFF_REPO in str(repo.get("repo", "")) and hid in RUFF_ENTRY:
                sub, *opts = RUFF_ENTRY[hid]
                entries.append((hid, [*ruff, sub, *opts, *hook.get("args", [])], chosen))
                continue
            entry = shlex.split(str(hook.get("entry", "")))
            if not (local and hook.get("language") == "python" and entry[:1] == ["python"]):
                how = f"a {hook['language']} hook" if "language" in hook else "its own environment"
                skipped.append(HookResult(hid, False, why_skipped=(
                    f"not run here ({how}, from {repo.get('repo')})")))  # fmt: skip
                continue
            why = _installed(python, hook.get("additional_dependencies", []))
            if why:
                skipped.append(HookResult(hid, False, why_skipped=f"not run here: {why}"))
                continue
            argv = [python, *entry[1:], *hook.get("args", [])]
            entries.append((hid, argv, chosen if hook.get("pass_filenames", True) else []))
    return Hooks(True, ruff, tool, entries, skipped)


def run_hooks(clone: Path, hooks: Hooks) -> list[HookResult]:
    """Run each hook in ``clone``; what each said and which files it changed."""
    results = []
    for hid, argv, files in hooks.entries:
        if not argv or not argv[0]:
            results.append(HookResult(hid, False, ok=False, why_skipped="no ruff found"))
            continue
        before = _digests(clone)
        out = run(*argv, *files, cwd=clone, check=False)
        after = _digests(clone)
        changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
        text = (out.stdout + out.stderr).strip()
        tool = hooks.ruff_tool if hid in RUFF_ENTRY else "the release's test environment"
        results.append(HookResult(hid, True, out.returncode == 0 and not changed, changed,
                                  text[-3000:], tool=tool))  # fmt: skip
    return results + hooks.skipped


def _digests(clone: Path) -> dict[str, str]:
    """path -> sha256 of each file that differs from the commit (or is new): what a hook
    changed shows as a digest that moved."""
    with open_repo(clone) as w:
        out = run_git(w.git, "status", "--porcelain=v1", "-z", "--untracked-files=all").stdout
    paths = [e[3:] for e in out.split("\0") if len(e) > 3]
    return {p: sha256_file(clone / p) if (clone / p).is_file() else "" for p in paths}
