"""Read a ``git format-patch`` / mbox file (what a pull request's ``.patch`` URL serves):
its commits' messages and authors, the pull request number, and one diff per file.

Every file diff is checked before anything uses it: paths must be plain relative paths
inside the tree (no ``..``, not absolute, not under ``.git``), and binary hunks, renames,
copies, deletions and mode changes are refused with a message, since an overlay change is
text patches and added files.
"""

from __future__ import annotations

import email
import email.policy
import re
from dataclasses import dataclass, field

from vllm_overlay.errors import ChangeImportError, UnsafePathError
from vllm_overlay.overlay.model import check_relpath
from vllm_overlay.overlay.patches import FilePatch, parse_patch

_FROM_LINE = re.compile(r"^From [0-9a-f]{7,40} ", re.MULTILINE)
_DIFF_GIT = re.compile(r"^diff --git (\S+) (\S+)$", re.MULTILINE)
_PR_SUBJECT = re.compile(r"\(#(\d+)\)\s*$")
_PR_URL = re.compile(r"/pull/(\d+)\b")
_SUBJECT_PREFIX = re.compile(r"^\s*\[[^\]]*PATCH[^\]]*\]\s*", re.IGNORECASE)
_SIGNATURE = re.compile(r"\n-- \n\d+(?:\.\d+)+[^\n]*\n*\Z")
_INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)", re.MULTILINE)
_TRAILER = re.compile(r"^(Signed-off-by|Co-authored-by|Co-Authored-By):\s*(.+)$", re.MULTILINE)


@dataclass
class FileDiff:
    path: str
    text: str  # this file's diff, as git wrote it (header, hunks)
    patch: FilePatch
    new_file: bool = False
    pre_blob: str | None = None  # the (abbreviated) blob id the diff was written against


@dataclass
class Commit:
    subject: str
    body: str
    author: str | None


@dataclass
class PatchSeries:
    commits: list[Commit] = field(default_factory=list)
    files: list[FileDiff] = field(default_factory=list)  # in the order they apply

    @property
    def pr(self) -> int | None:
        for c in self.commits:
            m = _PR_SUBJECT.search(c.subject)
            if m:
                return int(m.group(1))
        for c in self.commits:
            m = _PR_URL.search(c.body)
            if m:
                return int(m.group(1))
        return None

    @property
    def title(self) -> str | None:
        if not self.commits:
            return None
        return _PR_SUBJECT.sub("", self.commits[0].subject).strip() or None

    @property
    def why(self) -> str:
        parts = []
        for c in self.commits:
            body = _TRAILER.sub("", c.body).strip()
            if len(self.commits) > 1:
                parts.append(f"{c.subject}\n\n{body}".strip())
            elif body:
                parts.append(body)
        return "\n\n".join(parts)

    @property
    def authors(self) -> list[str]:
        out: list[str] = []
        for c in self.commits:
            found = [c.author] if c.author else []
            found += [m.group(2).strip() for m in _TRAILER.finditer(c.body)]
            for a in found:
                if a and a not in out:
                    out.append(a)
        return out


def parse_mbox(text: str, source: str) -> PatchSeries:
    """The commits and file diffs of ``text`` (an mbox of format-patch mails, or a plain
    ``git diff``); raises ChangeImportError naming ``source`` on anything it cannot carry."""
    starts = [m.start() for m in _FROM_LINE.finditer(text)]
    mails = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    series = PatchSeries()
    if not mails:
        _add_diffs(series, text, source)
    for mail in mails:
        commit, diff = _read_mail(mail, source)
        series.commits.append(commit)
        _add_diffs(series, diff, source)
    if not series.files:
        raise ChangeImportError(
            f"{source} holds no file diff (no `diff --git` section). Pass a git format-patch "
            "file, a pull request's .patch, or a `git diff`."
        )
    return series


def _read_mail(mail: str, source: str) -> tuple[Commit, str]:
    raw = mail.split("\n", 1)[1].encode("utf-8", errors="surrogateescape")
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    subject = " ".join(str(msg.get("Subject", "")).split())
    subject = _SUBJECT_PREFIX.sub("", subject)
    payload = msg.get_payload(decode=True)
    if isinstance(payload, bytes):
        charset = msg.get_content_charset() or "utf-8"
        body = payload.decode(charset, errors="surrogateescape")
    else:
        body = str(msg.get_payload())
    m = re.search(r"^---$", body, re.MULTILINE)
    d = _DIFF_GIT.search(body)
    cut = (
        m.start() if m and (d is None or m.start() < d.start()) else (d.start() if d else len(body))
    )
    message = body[:cut].strip()
    diff = body[d.start() :] if d else ""
    author = str(msg.get("From", "")).strip() or None
    if not subject:
        raise ChangeImportError(f"{source}: a mail without a Subject; is this a format-patch file?")
    return Commit(subject=subject, body=message, author=author), diff


def _add_diffs(series: PatchSeries, text: str, source: str) -> None:
    text = _SIGNATURE.sub("\n", text)
    heads = list(_DIFF_GIT.finditer(text))
    for i, h in enumerate(heads):
        chunk = text[h.start() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        chunk = chunk.rstrip("\n") + "\n"
        series.files.append(_file_diff(chunk, h.group(1), h.group(2), source))


def _file_diff(chunk: str, a: str, b: str, source: str) -> FileDiff:
    old = a[2:] if a.startswith("a/") else a
    new = b[2:] if b.startswith("b/") else b
    header = chunk.split("\n@@", 1)[0]
    where = f"{source}: the diff of {new}"
    for path in {old, new}:
        try:
            check_relpath(path, f"{source}: a path in the patch")
        except UnsafePathError as e:
            raise UnsafePathError(
                f"{e} The patch reaches outside the vLLM tree; nothing was imported."
            ) from e
    if "GIT binary patch" in header or re.search(r"^Binary files ", header, re.MULTILINE):
        raise ChangeImportError(
            f"{where} is a binary hunk; an overlay change carries text patches and added text "
            "files only. Leave the binary file out of the patch (or add it by hand); nothing "
            "was imported."
        )
    refused = {
        "rename from": "renames a file",
        "copy from": "copies a file",
        "deleted file mode": "deletes the file",
        "old mode": "changes the file's mode",
    }
    for marker, what in refused.items():
        if re.search(rf"^{marker}", header, re.MULTILINE) or (
            marker == "rename from" and old != new
        ):
            raise ChangeImportError(
                f"{where} {what}; an overlay change can patch and add files only. Remove that "
                "part from the patch and import the rest; nothing was imported."
            )
    new_file = bool(re.search(r"^new file mode", header, re.MULTILINE))
    idx = _INDEX.search(header)
    pre = idx.group(1) if idx and not new_file and set(idx.group(1)) != {"0"} else None
    if "\n--- " not in "\n" + chunk:
        raise ChangeImportError(f"{where} has no hunks (an empty file?); nothing was imported.")
    fp = parse_patch(chunk, where)
    return FileDiff(path=new, text=chunk, patch=fp, new_file=new_file, pre_blob=pre)
