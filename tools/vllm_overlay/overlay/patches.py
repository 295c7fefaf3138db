"""Per-file unified diffs: a strict applier (no fuzz, no offsets) and a canonical writer.

A patch file holds the diff of one upstream file, as ``git diff`` writes it minus the
``index`` line. Applying checks every context and removed line at the exact line number
the hunk names; the first line that differs is reported with the hunk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vllm_overlay.errors import PatchError

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")
NO_NEWLINE = "\\ No newline at end of file"


@dataclass
class Hunk:
    header: str
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[str] = field(default_factory=list)  # each starts with ' ', '-' or '+'
    old_no_newline: bool = False
    new_no_newline: bool = False


@dataclass
class FilePatch:
    old_path: str | None  # None for a new file
    new_path: str | None  # None for a deleted file
    hunks: list[Hunk]


def _strip_prefix(p: str, prefix: str) -> str | None:
    if p == "/dev/null":
        return None
    p = p.split("\t", 1)[0]
    return p[len(prefix) :] if p.startswith(prefix) else p


def parse_patch(text: str, source: str) -> FilePatch:
    """Parse one file's unified diff; raise PatchError naming ``source`` on bad syntax."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    i = 0
    old_path = new_path = None
    seen_header = False
    while i < len(lines) and not lines[i].startswith("@@"):
        line = lines[i]
        if line.startswith("--- "):
            old_path = _strip_prefix(line[4:], "a/")
            seen_header = True
        elif line.startswith("+++ "):
            new_path = _strip_prefix(line[4:], "b/")
        i += 1
    if not seen_header:
        raise PatchError(f"{source}: not a unified diff (no '--- a/PATH' / '+++ b/PATH' header).")
    hunks: list[Hunk] = []
    while i < len(lines):
        m = _HUNK_RE.match(lines[i])
        if not m:
            if lines[i].startswith("diff --git"):
                raise PatchError(f"{source}: holds more than one file's diff; one patch per file.")
            raise PatchError(
                f"{source}:{i + 1}: expected a hunk header '@@ -a,b +c,d @@', got {lines[i]!r}."
            )
        h = Hunk(
            header=lines[i],
            old_start=int(m.group(1)),
            old_len=int(m.group(2)) if m.group(2) is not None else 1,
            new_start=int(m.group(3)),
            new_len=int(m.group(4)) if m.group(4) is not None else 1,
        )
        i += 1
        old_n = new_n = 0
        while i < len(lines) and (old_n < h.old_len or new_n < h.new_len or lines[i] == NO_NEWLINE):
            line = lines[i]
            if line == NO_NEWLINE:
                prev = h.lines[-1][:1] if h.lines else " "
                if prev in (" ", "-"):
                    h.old_no_newline = True
                if prev in (" ", "+"):
                    h.new_no_newline = True
                i += 1
                continue
            tag = line[:1]
            if tag == " ":
                old_n += 1
                new_n += 1
            elif tag == "-":
                old_n += 1
            elif tag == "+":
                new_n += 1
            elif line == "":  # some editors strip the space of an empty context line
                line = " "
                old_n += 1
                new_n += 1
            else:
                raise PatchError(f"{source}:{i + 1}: bad line in hunk {h.header!r}: {line!r}.")
            h.lines.append(line)
            i += 1
        if old_n != h.old_len or new_n != h.new_len:
            raise PatchError(
                f"{source}: hunk {h.header!r} is truncated: expected {h.old_len} old and "
                f"{h.new_len} new lines, found {old_n} and {new_n}."
            )
        hunks.append(h)
    return FilePatch(old_path=old_path, new_path=new_path, hunks=hunks)


def _split(data: bytes) -> tuple[list[str], bool]:
    text = data.decode("utf-8", errors="surrogateescape")
    if text == "":
        return [], True
    ends_nl = text.endswith("\n")
    lines = text.split("\n")
    if ends_nl:
        lines.pop()
    return lines, ends_nl


def apply_patch(original: bytes | None, patch: FilePatch, where: str) -> bytes:
    """Apply ``patch`` to ``original`` exactly; ``where`` names change and file for errors."""
    old_lines, ends_nl = _split(original or b"")
    out: list[str] = []
    pos = 0  # index into old_lines
    new_ends_nl = ends_nl
    for n, h in enumerate(patch.hunks, 1):
        start = h.old_start - 1 if h.old_len > 0 else h.old_start
        if start < pos:
            raise PatchError(f"{where}: hunk {n} ({h.header}) overlaps the previous hunk.")
        out.extend(old_lines[pos:start])
        line_no = start
        for line in h.lines:
            tag, body = line[:1], line[1:]
            if tag in (" ", "-"):
                found = old_lines[line_no] if line_no < len(old_lines) else None
                if found != body:
                    got = "end of file" if found is None else repr(found)
                    raise PatchError(
                        f"{where}: hunk {n} ({h.header.split(' @@')[0]} @@) does not apply: "
                        f"line {line_no + 1} should be {body!r} but is {got}. The upstream file "
                        "changed under the patch: re-create the change on the new code "
                        "(vllm-overlay edit, then export) or rebase."
                    )
                line_no += 1
                if tag == " ":
                    out.append(body)
            else:
                out.append(body)
        pos = line_no
        if h.old_no_newline and pos == len(old_lines) and ends_nl:
            raise PatchError(
                f"{where}: hunk {n} expects no newline at end of file, but there is one."
            )
        if pos == len(old_lines):
            new_ends_nl = (
                not h.new_no_newline if (h.new_no_newline or h.old_no_newline) else ends_nl
            )
    out.extend(old_lines[pos:])
    if not out:
        return b""
    text = "\n".join(out) + ("\n" if new_ends_nl else "")
    return text.encode("utf-8", errors="surrogateescape")


def canonical_diff(raw: str) -> str:
    """Normalise ``git diff`` output for one file: drop the ``index`` line (it holds blob ids)."""
    return "".join(line for line in raw.splitlines(keepends=True) if not line.startswith("index "))
