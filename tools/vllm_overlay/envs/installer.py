"""Making virtualenvs and installing into them: uv where it is installed, pip otherwise.

uv (a dependency of this tool, so normally in its own virtualenv) builds the CPU test
environment several times faster than pip: it downloads in parallel, resolves without
building metadata, and links files from its cache instead of copying them. Where uv is
missing (a tool installed without its dependencies), the same steps run with pip.

uv does not read pip's configuration, so what pip is configured with is passed on: the
index-url and extra-index-urls as ``UV_INDEX_URL``/``UV_EXTRA_INDEX_URL`` (in the
environment, so credentials in them never reach a command line or an error message),
find-links as ``--find-links``, the cert as ``SSL_CERT_FILE``; it takes the best match
across all indexes as pip does (``--index-strategy unsafe-best-match``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import process, util


@dataclass(frozen=True)
class Installer:
    """uv (``uv`` is its path) or pip (``uv`` is None). With ``log``, an install streams
    its output there as it runs and says so on stderr (``process.run(log=...)``)."""

    uv: str | None
    log: Path | None = None

    @property
    def name(self) -> str:
        return "uv" if self.uv else "pip"

    def venv(self, python: str, dest: Path, env: dict[str, str]) -> Path:
        """A new virtualenv at ``dest`` made from ``python``; returns its interpreter."""
        if self.uv:
            process.run(
                self.uv, "venv", "--quiet", "--no-config", "--python", python, dest, env=env
            )
        else:
            process.run(python, "-m", "venv", dest, env=env)
        return dest / "bin" / "python"

    def install_command(self, python: Path | str) -> list[str]:
        """The argv prefix that installs packages into the environment of ``python``."""
        if self.uv:
            return [
                self.uv,
                "pip",
                "install",
                "--no-config",
                "--python",
                os.fspath(python),
                "--index-strategy",
                "unsafe-best-match",
                *_find_links_args(),
            ]
        return [os.fspath(python), "-m", "pip", "install", "--progress-bar", "off"]

    def install(
        self, python: Path, args: Sequence[str], env: dict[str, str], hint: str
    ) -> process.Output:
        if self.log is None:
            return process.run(*self.install_command(python), *args, env=env, hint=hint)
        return process.run(*self.install_command(python), *args, env=env, hint=hint, log=self.log,
                        what=f"{self.name} install")  # fmt: skip

    def freeze(self, python: Path, env: dict[str, str]) -> str:
        """``name==version`` of everything installed in the environment of ``python``."""
        if self.uv:
            argv = [self.uv, "pip", "freeze", "--no-config", "--python", os.fspath(python)]
        else:
            argv = [os.fspath(python), "-m", "pip", "freeze", "--all"]
        return process.run(*argv, env=env).stdout

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The environment the installer runs in."""
        env = dict(base)
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        env["PYTHONNOUSERSITE"] = "1"
        if self.uv:
            env.update(uv_index_env())  # in the environment: no credentials in any argv
            # uv reads the CA bundle and the client certificate pip is told to use
            for key, var in (("cert", "SSL_CERT_FILE"), ("client-cert", "SSL_CLIENT_CERT")):
                value = _pip_setting(key)
                if value and var not in env:
                    env[var] = value
        return env


def installer() -> Installer:
    """uv if it is installed, else pip."""
    return Installer(util.find_uv())


def _pip_setting(key: str) -> str:
    """A pip setting, read by the index client's one reader of pip's configuration."""
    from vllm_overlay.index.client import pip_setting

    return pip_setting(key)


def uv_index_env() -> dict[str, str]:
    """pip's indexes as uv's variables (uv does not read pip's configuration)."""
    from vllm_overlay.index.client import configured_index_urls

    primary, *extras = configured_index_urls()
    env = {"UV_INDEX_URL": primary}
    if extras:
        env["UV_EXTRA_INDEX_URL"] = " ".join(extras)
    return env


def _find_links_args() -> list[str]:
    args = []
    for link in _pip_setting("find-links").split():
        args += ["--find-links", link]
    return args


def find_links_files() -> tuple[str, ...]:
    """The file names in pip's find-links directories (a URL's page is not read)."""
    names: set[str] = set()
    for link in _pip_setting("find-links").split():
        path = Path(link.removeprefix("file://"))
        if "://" not in link.removeprefix("file://") and path.is_dir():
            names.update(p.name for p in path.iterdir())
    return tuple(sorted(names))


def uv_index_args() -> list[str]:
    """pip's indexes and find-links as uv options."""
    env = uv_index_env()
    args = ["--index-url", env["UV_INDEX_URL"]]
    for url in env.get("UV_EXTRA_INDEX_URL", "").split():
        args += ["--extra-index-url", url]
    return args + _find_links_args()


def main() -> None:
    """Print pip's indexes as uv options, one per line (the Makefile bootstraps with them)."""
    print("\n".join(["--index-strategy", "unsafe-best-match", *uv_index_args()]))


if __name__ == "__main__":
    main()
