"""One isolated environment for a test: no real $HOME, no user git config, a cache of its own
(tests marked ``network`` keep the real cache, so real release artifacts download once)."""

from __future__ import annotations

import os

REAL_HOME = os.environ.get("HOME", "/root")
# How long a test waits for another process's entry of the real cache (VLLM_OVERLAY_LOCK_TIMEOUT).
# On a cold cache one xdist worker downloads and imports a release (minutes on a slow machine)
# while the other waits for it: the wait is bounded only against a deadlock, not timed.
SHARED_CACHE_LOCK_TIMEOUT = "3600"


def isolate(monkeypatch, tmp_path_factory, network: bool) -> None:
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
    if network:
        cache = os.environ.get("VLLM_OVERLAY_CACHE") or os.path.join(
            REAL_HOME, ".cache", "vllm-overlay"
        )
        monkeypatch.setenv("VLLM_OVERLAY_CACHE", cache)
        monkeypatch.setenv("VLLM_OVERLAY_LOCK_TIMEOUT", SHARED_CACHE_LOCK_TIMEOUT)
    else:
        monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("VLLM_OVERLAY_PROJECT", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    for k in list(os.environ):
        if k.startswith("GIT_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
