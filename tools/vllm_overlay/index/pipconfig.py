"""pip's configuration, the one reader: ``pip config list`` run once per process for each
Python and environment, and a setting as pip reads it (``pip_setting``: PIP_<KEY>, else the
configuration files).

``pip config list`` starts a Python (about a second on a loaded machine), and a publish, an
environment install or an index client each ask several settings: the reading is kept for the
process, keyed by the interpreter, the variables pip's configuration depends on, and the size
and modification time of every configuration file pip would read, so an edited pip.conf or a
changed variable is read again."""

from __future__ import annotations

import os
import re
import sys

from vllm_overlay.process import run

SECTIONS = (":env:", "download", "install", "global")
_VARIABLES = ("HOME", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS", "VIRTUAL_ENV")
_read: dict[tuple, dict[str, str]] = {}


def pip_config() -> dict[str, str]:
    """pip's configuration as `section.key` -> value (pip config list), read once per key."""
    key = _key()
    if key not in _read:
        _read[key] = _list()
    return dict(_read[key])


def pip_setting(key: str) -> str:
    """A pip setting as pip reads it: PIP_<KEY>, else pip's configuration files ("" if unset)."""
    env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
    if env is not None:
        return env
    conf = pip_config()
    for section in SECTIONS:
        if f"{section}.{key}" in conf:
            return conf[f"{section}.{key}"]
    return ""


def _list() -> dict[str, str]:
    out = run(sys.executable, "-m", "pip", "config", "list", check=False)
    conf: dict[str, str] = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^([^=]+)=(.*)$", line.strip())
        if not m:
            continue
        val = m.group(2).strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
            val = val[1:-1]
        conf[m.group(1).strip()] = val
    return conf


def _key() -> tuple:
    """What ``pip config list`` depends on: the interpreter, the variables, the files."""
    env = tuple(sorted((k, v) for k, v in os.environ.items()
                       if k.startswith("PIP_") or k in _VARIABLES))  # fmt: skip
    files = []
    for path in _files():
        try:
            st = os.stat(path)
        except OSError:
            continue
        files.append((path, st.st_size, st.st_mtime_ns))
    return sys.executable, env, tuple(files)


def _files() -> list[str]:
    """Every configuration file pip would read, as pip lists them (``PIP_CONFIG_FILE`` too)."""
    found = [os.environ.get("PIP_CONFIG_FILE", "")]
    try:
        from pip._internal.configuration import get_configuration_files
    except ImportError:  # pragma: no cover - only without pip: its variables still count
        return [f for f in found if f]
    found += [f for files in get_configuration_files().values() for f in files]
    return [f for f in found if f]
