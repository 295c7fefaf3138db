"""Per-test outcomes from a JUnit XML report, as pytest writes it.

One ``TestResult`` per test id. pytest's ``junit_family=xunit1`` (what the suite asks for)
records each test's file, so the id is rebuilt exactly (``tests/x/test_a.py::TestB::test_c[1]``);
for a report without file attributes the id is ``classname::name``, which is still the same
on both sides of a comparison made by the same pytest.

Outcomes: ``passed``, ``failed`` (the test body failed, or its worker crashed), ``error``
(setup or teardown failed, or the file could not be collected) and ``skipped`` (skip and
xfail). A test that pytest reports twice (a failing call and a failing teardown) keeps the
worst outcome and both messages.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, replace
from pathlib import Path

from vllm_overlay.errors import JunitError
from vllm_overlay.testing.contract import MARKERS_PROPERTY  # noqa: F401 (re-exported)

OUTCOMES = ("passed", "failed", "error", "skipped")
FAILING = ("failed", "error")

_RANK = {"failed": 3, "error": 2, "skipped": 1, "passed": 0}


@dataclass(frozen=True)
class TestResult:
    __test__ = False  # not a pytest test class

    nodeid: str
    outcome: str
    message: str = ""  # the message attribute of <failure>, <error> or <skipped>
    detail: str = ""  # the element's text: the traceback, or the skip location
    output: str = ""  # captured output and logs (<system-out>, <system-err>) of a failure
    markers: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def failing(self) -> bool:
        return self.outcome in FAILING

    @property
    def summary(self) -> str:
        """One short line: the message's first line, else the detail's last line."""
        text = self.message.strip() or self.detail.strip()
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            return ""
        line = (lines[0] if self.message.strip() else lines[-1]).strip()
        return line if len(line) <= 160 else line[:157] + "..."


def parse_junit_file(path: Path) -> dict[str, TestResult]:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        raise JunitError(f"no JUnit report at {path}") from None
    return parse_junit(text, str(path))


def parse_junit(text: str, where: str = "JUnit report") -> dict[str, TestResult]:
    """Every test in the report, by id."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise JunitError(f"{where} is not valid XML ({e})") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise JunitError(f"{where}: expected <testsuites> or <testsuite>, found <{root.tag}>")
    results: dict[str, TestResult] = {}
    for case in root.iter("testcase"):
        result = _result(case)
        prev = results.get(result.nodeid)
        results[result.nodeid] = result if prev is None else _merge(prev, result)
    return results


def _nodeid(case: ET.Element) -> str:
    classname = case.get("classname", "")
    name = case.get("name", "")
    file = case.get("file", "")
    if not file.endswith(".py"):
        return f"{classname}::{name}" if classname else name
    if not classname:
        return file  # a collection error of the whole file
    module = file[: -len(".py")].replace("/", ".")
    rest = classname[len(module) + 1 :].split(".") if classname.startswith(module + ".") else []
    if classname != module and not rest:
        return f"{classname}::{name}"
    return "::".join([file, *rest, name])


def _result(case: ET.Element) -> TestResult:
    outcome, message, detail = "passed", "", ""
    for tag, kind in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        for el in case.findall(tag):
            if _RANK[kind] > _RANK[outcome]:
                outcome = kind
            message = "\n".join(filter(None, [message, el.get("message", "")]))
            detail = "\n".join(filter(None, [detail, el.text or ""]))
    output = "\n".join(
        el.text for tag in ("system-out", "system-err") for el in case.findall(tag) if el.text
    )
    markers: tuple[str, ...] = ()
    for prop in case.iter("property"):
        if prop.get("name") == MARKERS_PROPERTY:
            markers = tuple(m for m in prop.get("value", "").split(",") if m)
    try:
        seconds = float(case.get("time", "0") or 0)
    except ValueError:
        seconds = 0.0
    return TestResult(_nodeid(case), outcome, message, detail, output, markers, seconds)


def _merge(a: TestResult, b: TestResult) -> TestResult:
    worse, other = (a, b) if _RANK[a.outcome] >= _RANK[b.outcome] else (b, a)
    return replace(
        worse,
        message="\n".join(filter(None, [worse.message, other.message])),
        detail="\n".join(filter(None, [worse.detail, other.detail])),
        output="\n".join(filter(None, [worse.output, other.output])),
        markers=worse.markers or other.markers,
        seconds=a.seconds + b.seconds,
    )
