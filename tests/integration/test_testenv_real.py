"""The CPU test environment: its recipe, its cache entry, the environment it gives a run.

The unit tests use small fake vLLM trees; the ``network`` test takes the real environment
of the pinned vLLM tree (the session's ``real_testenv``, built once) and imports vLLM from
that tree through it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from vllm_overlay.envs import testenv
from vllm_overlay.pin.lockfile import read_lock

ROOT = Path(__file__).resolve().parents[2]

COMMON = """\
regex # Replace re for higher-performance regex matching
numpy
transformers >= 5.5.3
protobuf >= 5.29.6, !=6.30.*  # CVE
llguidance >= 1.7.0, < 1.8.0; platform_machine == "x86_64"
"""


PROBE = """\
import json, torch, vllm, transformers
from vllm.platforms import current_platform
config = transformers.AutoConfig.from_pretrained("facebook/opt-125m")
print(json.dumps({
    "vllm": vllm.__file__,
    "torch": torch.__version__,
    "platform": type(current_platform).__name__,
    "model_type": config.model_type,
}))
"""


@pytest.mark.network
@pytest.mark.slow
def test_the_real_environment_imports_vllm_from_the_tree(real_tree, real_testenv, tmp_path):
    env = real_testenv
    assert (env.path / testenv.MARKER).is_file()
    recipe = json.loads((env.path / "recipe.json").read_text())
    version = read_lock(ROOT / "upstream.lock").upstream.version
    assert recipe["constraints_file"] == f"constraints/testenv-vllm-{version}.txt"
    pins = set((ROOT / recipe["constraints_file"]).read_text().splitlines())
    torch_pin = next(p.split("==")[1] for p in pins if p.startswith("torch=="))
    frozen = set((env.path / testenv.FREEZE).read_text().splitlines())
    assert {p for p in pins if not p.startswith("#")} <= frozen  # exactly the pinned set
    assert env.torch_version == torch_pin
    environ = env.environ(tmp_path / "work", real_tree)
    proc = subprocess.run(
        [str(env.python), "-c", PROBE],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(probe["vllm"]).resolve().is_relative_to(real_tree.resolve())
    assert probe["torch"] == env.torch_version
    assert probe["platform"] == "CpuPlatform"
    assert probe["model_type"] == "opt"
