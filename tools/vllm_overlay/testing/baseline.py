"""The cached baseline: one side's run on pristine upstream, kept by what decides it.

Cached under ``cache_dir()/suite-baselines/<key>.json``, keyed by the upstream pin, the
environment's recipe, the selection, the run options and the source of the modules that run
a side (a change to how a side runs invalidates cached baselines). The entry holds the JUnit
XML with its sha256; an entry that does not check out is ``CorruptBaseline`` (rebuilt).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay import util
from vllm_overlay.envs import childenv
from vllm_overlay.errors import CorruptBaseline, JunitError
from vllm_overlay.testing import contract as suite_plugin
from vllm_overlay.testing import runner, side
from vllm_overlay.testing.junit import parse_junit
from vllm_overlay.testing.side import RunEnv, RunOptions, SideRun

FORMAT = 1  # of the cached baseline entry


@dataclass(frozen=True)
class BaselineKey:
    inputs: dict = field(hash=False)

    @property
    def digest(self) -> str:
        text = json.dumps(self.inputs, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def baseline_key(
    upstream: dict, code: str, env: RunEnv, selection: tuple[str, ...], opts: RunOptions
) -> BaselineKey:
    return BaselineKey(
        {
            "format": FORMAT,
            "upstream": upstream,
            "code": code,
            "environment": env.recipe,
            "selection": list(selection),
            "options": opts.key(),
            "runner": _runner_digest(),
        }
    )


def _runner_digest() -> str:
    """How a side runs (side, runner, plugin): a change there invalidates baselines."""
    h = hashlib.sha256()
    for path in (side.__file__, runner.__file__, childenv.__file__, suite_plugin.PLUGIN_FILE):
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def baseline_path(key: BaselineKey) -> Path:
    return util.cache_dir() / "suite-baselines" / f"{key.digest}.json"


def store_baseline(key: BaselineKey, run: SideRun) -> Path:
    path = baseline_path(key)
    doc = {
        "format": FORMAT,
        "key": key.digest,
        "inputs": key.inputs,
        "seconds": round(run.seconds, 1),
        "returncode": run.returncode,
        "collected": list(run.collected),
        "junit_sha256": util.sha256_bytes(run.junit_xml.encode()),
        "junit": run.junit_xml,
    }
    util.atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def load_baseline(key: BaselineKey) -> SideRun | None:
    """The cached baseline for ``key``; None if there is none; CorruptBaseline if unusable."""
    path = baseline_path(key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptBaseline(f"{path} cannot be read ({e})") from None
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("format") != FORMAT or doc.get("key") != key.digest:
            raise ValueError("written for another format or key")
        junit_xml, collected = doc["junit"], doc["collected"]
        if util.sha256_bytes(junit_xml.encode()) != doc["junit_sha256"]:
            raise ValueError("its JUnit report does not match its recorded sha256")
        if not all(isinstance(c, str) for c in collected):
            raise ValueError("its list of collected tests is malformed")
        results = parse_junit(junit_xml, f"the JUnit report cached in {path}")
        seconds = float(doc["seconds"])
    except (ValueError, KeyError, TypeError, AttributeError, JunitError) as e:
        raise CorruptBaseline(f"{path} is corrupt ({e})") from None
    return SideRun(
        name="baseline",
        results=results,
        collected=tuple(collected),
        junit_xml=junit_xml,
        seconds=seconds,
        cached=True,
        returncode=int(doc.get("returncode", 0)),
        selection=tuple(key.inputs["selection"]),
    )
