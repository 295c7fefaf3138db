"""The settings of one command, made once from its options and carried down as one object.

``Settings.from_options(args)`` reads them from a command's options; every function that
fetches from the index, makes a pinned tree or runs tests takes the object, never the pieces:

- the package index: ``--index-url``, else pip's configuration (``PIP_INDEX_URL``, pip.conf,
  pip's own default), with the credentials pip would send (``index/auth.py``: the URL's user
  part, ``~/.netrc``, keyring) and pip's TLS settings (``cert``, ``client-cert``);
- where the pinned tree comes from: ``--source`` (the release sdist on the index, or the
  git remote) and ``--git-url`` (a mirror of the upstream repository);
- the Python that runs tests: ``--test-python`` (None: vLLM's CPU test environment).

pip's configuration is read by ``index/pipconfig.py``, once per process, and only when the
index is first needed: a command whose files are all cached reads none of it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vllm_overlay.index.auth import redact
from vllm_overlay.index.client import (
    FETCH_HINT,
    TIMEOUT,
    IndexClient,
    configured_index_urls,
)


@dataclass(frozen=True)
class Settings:
    """Where a command's inputs come from, and what runs its tests."""

    index_url: str | None = None  # --index-url; None: pip's configured index (and extras)
    source: str = "sdist"  # --source: "sdist" (the release sdist) or "git" (the remote)
    git_url: str | None = None  # --git-url: a mirror of the upstream git repository
    test_python: str | None = None  # --test-python; None: vLLM's CPU test environment

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> Settings:
        """The settings a command's options give (an option the command lacks: its default)."""
        return cls(
            index_url=getattr(args, "index_url", None),
            source=getattr(args, "source", None) or "sdist",
            git_url=getattr(args, "git_url", None),
            test_python=getattr(args, "test_python", None),
        )

    @property
    def index_urls(self) -> list[str]:
        """The index URLs to search, primary first, as pip would use them."""
        return configured_index_urls(self.index_url)

    def where(self) -> str:
        """The index URLs for a message (user parts redacted)."""
        return ", ".join(redact(u) for u in self.index_urls)

    def client(self, *, timeout: float = TIMEOUT, hint: str = FETCH_HINT) -> IndexClient:
        """A client of the index with pip's credentials and TLS settings for it (pip's
        ``cert`` and ``client-cert``, read at the first https request)."""
        return IndexClient(self.index_urls, timeout=timeout, hint=hint)


# A command given no options: pip's index, credentials and TLS; the sdist; the test environment.
DEFAULTS = Settings()
