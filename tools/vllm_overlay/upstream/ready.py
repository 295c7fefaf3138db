"""`vllm-overlay upstream CHANGE`: prepare, prove and write what a person submits.

1. The commit (``prepare.py``): the change alone on a clone of the release's tree, its tests
   in vLLM's layout without our scaffolding, signed off by the user.
2. The hooks (``hooks.py``): the release's pre-commit hooks on the commit's files, once to
   apply their fixes (folded into the commit), then again, where each must pass unchanged.
3. The proof: the change's tests at the release with the commit (they must pass) and on the
   release without it, the tests alone (they must fail), in the release's test environment.
4. The rules: the CI step that selects each test (``ci.py``), the docs pages of the changed
   modules, the duplicate-work searches, the sizes; then the commit against the release's
   AGENTS.md and tests/AGENTS.md, item by item (``checklist.py``).
5. The files: ``<id>.patch`` (``git format-patch``), ``pull-request.md`` (the release's
   template filled, ``texts.py``) or, for a change marked ``security``, ``advisory.md`` and
   nothing meant for public eyes; ``checklist.md``; ``proof.json``; the clone, ``vllm/``, on
   branch ``upstream/<id>``. All of it is
   built beside the output directory and renamed into place: a refused run leaves the old
   output as it was, and writes the proof of its refusal to ``<out>.refused.json``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from vllm_overlay.errors import UpstreamError, UsageError
from vllm_overlay.gitrepo import last_commit_date, show_bytes, user_config, user_identity
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.project import Project
from vllm_overlay.testing import junit, proving
from vllm_overlay.upstream import checklist, ci, scrub, texts
from vllm_overlay.upstream import hooks as hooks_
from vllm_overlay.upstream import prepare as prep_
from vllm_overlay.util import atomic_write_text, info

FIXED_DATE = "2000-01-01T00:00:00+0000"
ASSISTED_BY_KEY = "vllm-overlay.assistedBy"  # git config: who assisted, "Name <email>"


def default_out(project: Project, change_id: str) -> Path:
    return project.work_dir / "upstream" / change_id


def identity(project: Project) -> tuple[str, str]:
    found = user_identity(project.root)
    if found is None:
        raise UsageError(
            "your git identity is not set: vLLM takes only signed-off commits (DCO), signed "
            'with your name and email. Set them: git config --global user.name "Your Name"; '
            "git config --global user.email you@example.com"
        )
    return found


def assistant(project: Project, given: str | None) -> str:
    """Who assisted, as the attribution trailer names them: ``--assisted-by``, else the git
    config ``vllm-overlay.assistedBy``; refused where neither says."""
    found = (given or "").strip() or user_config(project.root, ASSISTED_BY_KEY)
    if not found:
        raise UsageError(
            "say which AI assistant helped: vLLM's AGENTS.md asks AI-assisted work for an "
            "attribution trailer and a statement in the pull request. Pass --assisted-by "
            f'"Name <email>", or set it once: git config --global {ASSISTED_BY_KEY} '
            '"Name <email>"'
        )
    if "\n" in found or not re.fullmatch(r"[^<>]+(<[^<>@\s]+@[^<>\s]+>)?", found):
        raise UsageError(f'--assisted-by {found!r}: give one name, as "Name <email>"')
    return found


def _date(project: Project, change_id: str) -> str:
    """The commit's date: the last commit of the change in this project's history (the same
    overlay gives the same patch), else a fixed one."""
    return last_commit_date(project.root, f"overlay/{change_id}") or FIXED_DATE


def _run(tree: Path, targets: list[str], work: Path, name: str, test_python: str | None) -> dict:
    run = proving.run_tests(
        proving.runner_for(tree, test_python),
        tree,
        [os.fspath(tree / t) for t in targets],
        work / f"{name}-work",
        work / f"{name}.log",
    )
    return {"ok": run.ok, "summary": run.summary, "counts": run.counts(), "failing": run.failing,
            "passed": run.passed, "failed": run.failed, "errors": run.errors,
            "first_error": run.first_error, "log": run.log,
            "output": _output(run, tree)}  # fmt: skip


def _output(run: proving.TestRun, tree: Path) -> list[str]:
    """What a reviewer needs of a run: pytest's short summary line of each failing test
    (``FAILED id - message``, the message from the JUnit report, with the assertion's
    expression when pytest gave one; each trimmed), then pytest's own last line."""
    lines = []
    if run.junit:
        for r in junit.parse_junit_file(Path(run.junit)).values():
            if not r.failing:
                continue
            text = (r.message.strip() or r.detail.strip()).replace(os.fspath(tree) + "/", "")
            msg = [ln.strip() for ln in text.splitlines() if ln.strip()]
            word = "FAILED" if r.outcome == "failed" else "ERROR"
            lines.append(_trim(f"{word} {r.nodeid} - {msg[0] if msg else r.outcome}"))
            if len(msg) > 1 and msg[1].startswith("assert "):
                lines.append("  " + _trim(msg[1]))
    final = re.compile(r"^=*\s*(\d+ [a-z]+(?:, \d+ [a-z]+)* in [\d.]+s\b(?: \([\d:]+\))?)")
    log = Path(run.log).read_text(errors="replace").splitlines() if run.log else []
    last = next((m.group(1) for ln in reversed(log) if (m := final.match(ln.strip()))), "")
    return lines + [last or run.summary]


def _trim(line: str, width: int = 200) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def upstream(project: Project, change_id: str, *, out: Path | None = None,
             prefix: str | None = None, settings: Settings = DEFAULTS,
             assisted_by: str | None = None) -> dict:  # fmt: skip
    """Prepare ``change_id`` for upstream into ``out``; the report (raises when refused).
    Its tests run with ``settings.test_python`` (None: the hooks' Python)."""
    started = time.monotonic()
    lock, overlay = project.lock(), project.overlay()
    change = overlay.change(change_id)
    if not change.ours:
        raise UsageError(
            f"{change_id} is a backport of {change.origin}: it is upstream's own work already."
        )
    who = identity(project)
    helper = assistant(project, assisted_by)
    name, release = lock.upstream.name, lock.upstream.version
    out = (out or default_out(project, change_id)).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    info(f"upstream: {change_id} as {name} {release} would take it")
    prep, repo, base = prep_.prepare(lock, overlay, change_id, settings=settings)
    title = f"{prefix or texts.prefix_for(change)} {change.title}"
    if not prep_.title_ok(title):
        raise UsageError(f"{title!r} does not follow vLLM's title rule: [Tag] prefixes, a "
                         "space, the description (pass --prefix \"[Bugfix]\").")  # fmt: skip
    targets = _targets(prep)
    message = texts.commit_message(change, title, targets, who, helper)
    left = prep_.leftovers(prep, message)
    if left:
        raise UpstreamError(
            "our overlay is still named in what would go upstream:\n    "
            + "\n    ".join(left)
            + "\nSay it without naming the overlay in the change's files (overlay/"
            f"{change_id}/) or its why, then run this again."
        )
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    stage.chmod(0o755)  # what mkdir would make (mkdtemp's is private)
    try:
        report = _build(project, prep, repo, base, stage, title, message, who, targets,
                        settings.test_python, helper)  # fmt: skip
        report["seconds"] = round(time.monotonic() - started, 1)
        if not report["ok"]:
            refused = out.parent / f"{out.name}.refused.json"
            atomic_write_text(refused, json.dumps(report, indent=2, sort_keys=True) + "\n")
            raise UpstreamError(_refusal(report, refused))
        atomic_write_text(stage / "proof.json", json.dumps(report, indent=2, sort_keys=True) + "\n")
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        stage.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        (out.parent / f"{out.name}.refused.json").unlink(missing_ok=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    report["out"] = os.fspath(out)
    report["written"] = [os.fspath(out / f) for f in report["files"]]
    return report


def _build(project: Project, prep, repo: Path, base: str, stage: Path, title: str,
           message: str, who: tuple[str, str], targets: list[str],
           test_python: str | None, helper: str) -> dict:  # fmt: skip
    change = prep.change
    lock = project.lock()
    name, release = lock.upstream.name, lock.upstream.version
    clone = stage / "vllm"
    prep_.clone(repo, base, clone, change.id)
    python = test_python or _hooks_python(clone, stage / "runs" / "hooks")
    stacked = _commit_stack(project, prep, clone, who, python, helper)
    # As prepared: where the hooks fixed the lines of a change below, they fix them here the
    # same way (they run on this commit too), so its diff holds its own lines alone.
    prep_.write(clone, prep.files)
    date = _date(project, change.id)
    paths = sorted(prep.files)
    prep_.commit(clone, paths, message, who, date)
    selected = hooks_.select(clone, paths, python)
    fixes = hooks_.run_hooks(clone, selected)  # their fixes, as a first pre-commit run makes
    fixed = prep_.amend_fixes(clone, paths, date, who)
    checked = hooks_.run_hooks(clone, selected)
    work = stage / "runs"
    info(f"upstream: {change.id}'s tests with the commit, then on {release} without it")
    with_, without = _prove(clone, prep, targets, work, test_python)
    proof = {
        "change": change.id, "release": f"{name} {release}", "title": title,
        "targets": targets, "with": with_, "without": without,
        "hooks": [h.to_json() for h in checked], "hook_fixes": [h.to_json() for h in fixes
                                                                if h.changed],
        "hooks_fixed_files": fixed, "brought": prep.brought, "notes": prep.notes,
        "security": change.security, "stack": stacked, "commit_files": paths,
        "engine_tests": list(change.engine_tests),
        "assisted_by": helper,
    }  # fmt: skip
    final = {p: show_bytes(clone, "HEAD", p) or b"" for p in paths}  # the hooks' fixes in
    # the files as the commit's parent has them: the release, or the changes it is stacked on
    below = {p: show_bytes(clone, "HEAD~1", p) for p in paths}
    _rules_facts(proof, clone, "HEAD~1", python, final, below, change)
    files, patch, body, text = _write_texts(stage, clone, prep, proof, name, release, helper)
    failed = _failures(with_, without, checked, files[-1], text)
    found = checklist.items(proof, final, below, clone, message, body)
    proof["checklist"] = [it.to_json() for it in found]
    (stage / "checklist.md").write_text(checklist.render(change.id, f"{name} {release}", found))
    files += ["checklist.md", "proof.json", "vllm/"]
    shutil.rmtree(work, ignore_errors=True)
    sizes = {f: (stage / f).stat().st_size for f in files if (stage / f).is_file()}
    return {**proof, "ok": not failed, "failed": failed, "files": files, "sizes": sizes,
            "patch_lines": patch.count(b"\n")}  # fmt: skip


def _prove(clone: Path, prep, targets: list[str], work: Path, test_python: str | None
           ) -> tuple[dict, dict]:  # fmt: skip
    """The change's tests with the commit, then without it: the two runs' reports."""
    with_tree = prep_.test_tree(clone, "HEAD", work / "with")
    # without: the commit's parent (the release, or the changes it is stacked on)
    without_tree = prep_.test_tree(clone, "HEAD~1", work / "without", keep=prep.tests)
    with_ = _run(with_tree, targets, work, "with", test_python)
    without = _run(without_tree, targets, work, "without", test_python)
    shutil.rmtree(with_tree, ignore_errors=True)
    shutil.rmtree(without_tree, ignore_errors=True)
    return with_, without


def _write_texts(stage: Path, clone: Path, prep, proof: dict, name: str, release: str,
                 helper: str) -> tuple[list[str], bytes, str | None, str]:  # fmt: skip
    """The patches (the changes upstream takes first, then this one) and the pull-request body,
    or for a security fix the advisory, written into ``stage``: the files written, this
    change's patch, the body (None for an advisory) and the text a person submits."""
    change = prep.change
    files = []
    for k, part in enumerate(prep.stack):
        part_name = f"{k + 1:04d}-{part.change.id}.patch"
        (stage / part_name).write_bytes(prep_.format_patch(clone, f"HEAD~{len(prep.stack) - k}"))
        files.append(part_name)
    patch = prep_.format_patch(clone)
    patch_name = f"{len(prep.stack) + 1:04d}-{change.id}.patch"
    (stage / patch_name).write_bytes(patch)
    files.append(patch_name)
    if change.security:
        policy = (show_bytes(clone, "HEAD", texts.SECURITY) or b"").decode()
        text = texts.advisory(change, release, name, policy, proof, patch_name, helper)
        (stage / "advisory.md").write_text(text)
        files.append("advisory.md")
        return files, patch, None, text
    template = show_bytes(clone, "HEAD", texts.TEMPLATE)
    body = texts.pr_body(change, template.decode() if template else None, proof, helper)
    (stage / "pull-request.md").write_text(body)
    files.append("pull-request.md")
    return files, patch, body, body


def _failures(with_: dict, without: dict, checked: list, text_file: str, text: str) -> list[str]:
    """Why the proof refuses: the tests, our overlay named in the text a person submits
    (``text_file``), the hooks."""
    failed = []
    if not with_["ok"]:
        failed.append(f"the tests with the commit: {with_['summary']} ({with_['first_error']})")
    if without["ok"] or without["failed"] + without["errors"] == 0:
        failed.append(f"the tests without the commit did not fail: {without['summary']}")
    named = scrub.leftovers(text_file, text)
    if named:
        failed.append("our overlay is named in " + text_file + ":\n" + "\n".join(named))
    for h in checked:
        if h.ran and not h.ok:
            changed = f", changed {', '.join(h.changed)}" if h.changed else ""
            failed.append(f"hook {h.id}{changed}: {h.output[-800:]}")
    if not any(h.ran and h.id.startswith("ruff") for h in checked):
        failed.append("ruff did not run (no ruff found)")
    return failed


def _targets(prep) -> list[str]:
    """The tests the proof runs: the change's own (``path::test``, as overlay.toml lists them)
    where its tests sit in a file with others, else its test files."""
    files = [t for t in prep.tests if os.path.basename(t).startswith("test_")]
    own = [t for t in prep.change.tests if t.split("::")[0] in files]
    return own if own and all("::" in t for t in own) else files


def _commit_stack(project: Project, prep, clone: Path, who: tuple[str, str], python: str,
                  helper: str) -> list[dict]:  # fmt: skip
    """The changes ``prep`` is stacked on, committed into ``clone`` in order, each with the
    release's hooks' fixes folded in (as its own preparation makes them)."""
    done = []
    for part in prep.stack:
        prep_.write(clone, part.files)
        paths = sorted(part.files)
        title = f"{texts.prefix_for(part.change)} {part.change.title}"
        date = _date(project, part.change.id)
        message = texts.commit_message(part.change, title, _targets(part), who, helper)
        prep_.commit(clone, paths, message, who, date)
        hooks_.run_hooks(clone, hooks_.select(clone, paths, python))
        fixed = prep_.amend_fixes(clone, paths, date, who)
        done.append({"change": part.change.id, "title": title, "hooks_fixed_files": fixed})
    return done


def _rules_facts(proof: dict, clone: Path, base: str, python: str, final: dict[str, bytes],
                 base_files: dict[str, bytes | None], change) -> None:  # fmt: skip
    """What the body and the checklist need beyond the proof: the CI steps that select the
    tests, the docs pages of the changed modules, the duplicate-work searches, the sizes."""
    steps = ci.load_steps(clone, python)
    code = [p for p in proof["commit_files"] if not p.startswith("tests/")]
    files = dict.fromkeys(t.split("::")[0] for t in proof["targets"])  # path, or path::test
    sels = ci.select(steps, {f: final[f].decode(errors="replace") for f in files})
    proof["ci"] = {"steps_read": len(steps), "tests": [
        {**sel.to_json(), "steps": [{**j, "uncovered": ci.uncovered(st, code)}
                                    for (st, _r, _n), j in zip(sel.steps, sel.to_json()["steps"],
                                                               strict=True)]}
        for sel in sels]}  # fmt: skip
    proof["docs_pages"] = checklist.docs_pages(clone, final)
    agents = show_bytes(clone, "HEAD", "AGENTS.md")
    urls = [*change.bugs, *([change.forwarded.to] if change.forwarded.to else [])]
    proof["duplicate"] = {
        "recorded": "; ".join([change.forwarded.summary(), *(f"issue {b}" for b in change.bugs)]),
        "commands": checklist.duplicate_commands(agents.decode() if agents else None,
                                                 urls,
                                                 checklist.area_keywords(final)),
    }  # fmt: skip
    stats = prep_.numstat(clone, base)
    tests = [v for p, v in stats.items() if p.startswith("tests/")]
    code_stats = [v for p, v in stats.items() if not p.startswith("tests/")]
    proof["size"] = {"test_lines_added": sum(a for a, _ in tests),
                     "code_lines_added": sum(a for a, _ in code_stats),
                     "code_lines_removed": sum(r for _, r in code_stats)}  # fmt: skip


def _hooks_python(tree: Path, work: Path) -> str:
    """The Python the local hooks run with: the release's test environment's for vLLM."""
    python, _ = proving.runner_for(tree).command(tree, work)
    return python


def _refusal(report: dict, where: Path) -> str:
    return (f"refused: {report['change']} is not ready for upstream; what failed:\n    "
            + "\n    ".join(x.replace("\n", "\n      ") for x in report["failed"])
            + f"\nThe whole proof is in {where}; nothing else was written.")  # fmt: skip
