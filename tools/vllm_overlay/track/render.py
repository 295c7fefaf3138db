"""The outlook for people: a terminal matrix (rows: changes, columns: releases) and a
self-contained HTML page with the same matrix, each cell linking to its details."""

from __future__ import annotations

import html

from vllm_overlay.rebase import decide as classify
from vllm_overlay.rebase import walkdata
from vllm_overlay.track.outlook import GONE

SHORT = {
    classify.KEPT: "kept",
    classify.REFRESHED: "refresh",
    classify.DROPPED: "dropped",
    classify.CONFLICT: "CONFLICT",
    classify.MOVED: "MOVED",
    classify.COLLISION: "COLLIDE",
    walkdata.TESTS_FAILED: "UNPROVEN",
    walkdata.RECORD: "record",
    walkdata.WAITING: "waits",
    GONE: "\u00b7",
}
COLOUR = {
    classify.KEPT: "32",  # green
    classify.REFRESHED: "36",  # cyan
    classify.DROPPED: "34",  # blue
    classify.CONFLICT: "31;1",  # bold red
    classify.MOVED: "35;1",  # bold magenta
    classify.COLLISION: "33;1",  # bold yellow
    walkdata.TESTS_FAILED: "31;1",
    walkdata.RECORD: "36",
    walkdata.WAITING: "33",
    GONE: "2",
}
LEGEND = {
    classify.KEPT: "applies unchanged (the exported patch is byte-identical)",
    classify.REFRESHED: "merges cleanly, the patch gets new context",
    classify.DROPPED: "upstream has it (or drop_when holds): the rebase drops it, with proof",
    classify.CONFLICT: "the three-way merge leaves conflict markers: a person resolves them",
    classify.MOVED: "a file it patches was renamed or deleted upstream",
    classify.COLLISION: "a file it adds now exists upstream, different from ours",
    walkdata.TESTS_FAILED: "upstream has it, but its tests do not prove the drop there (--tests)",
    walkdata.RECORD: "conflicts, and a resolution record resolves it (as the rebase would)",
    walkdata.WAITING: "conflicts here, but a later release clears it: nobody is asked",
    GONE: "dropped at an earlier release",
}
# A record a person made with `rebase --continue --unproven` (its tests failed with it where it
# was made): the matrix marks the cell (the rebase applies it only where its tests pass).
UNPROVEN_MARK = "!"
UNPROVEN_LEGEND = ("a record made unproven (--unproven: its tests failed with it) resolves it; "
                   "the rebase applies it only where the change's tests pass with it")  # fmt: skip


def _short(o: dict) -> str:
    return SHORT[o["state"]] + (UNPROVEN_MARK if o.get("unproven") else "")


def _test_mark(col: dict, cid: str) -> str:
    t = (col.get("tests") or {}).get(cid)
    if not t or not t.get("ran"):
        return ""
    return " ok" if t["ok"] else " FAIL"


def terminal(data: dict, *, colour: bool = False) -> str:
    """The matrix, the legend, the reasons behind every stop, and the safe target."""
    cols = data["releases"]
    ids = [c["id"] for c in data["changes"]]
    tests = any(c.get("tests") for c in cols)
    cell_w = max([len(c["version"]) for c in cols] + [len(s) for s in SHORT.values()]) + (
        5 if tests else 0
    )
    id_w = max([len(i) for i in ids] + [len("change")])
    lines = [f"outlook: {data['name']} {data['pin']} (pinned) -> {len(cols)} newer release(s)"]
    if not cols:
        lines.append("no newer final release on the index.")
    else:
        lines.append(
            "  ".join([f"{'change':<{id_w}}", *(f"{c['version']:<{cell_w}}" for c in cols)])
        )
        for cid in ids:
            cells = []
            for col in cols:
                o = next(x for x in col["outcomes"] if x["id"] == cid)
                text = f"{_short(o) + _test_mark(col, cid):<{cell_w}}"
                if colour:
                    text = f"\x1b[{COLOUR[o['state']]}m{text}\x1b[0m"
                cells.append(text)
            lines.append("  ".join([f"{cid:<{id_w}}", *cells]))
        lines.append("")
        lines.append("legend:")
        for state, text in LEGEND.items():
            lines.append(f"  {SHORT[state]:<9} {text}")
        if any(o.get("unproven") for c in cols for o in c["outcomes"]):
            lines.append(f"  {SHORT[walkdata.RECORD] + UNPROVEN_MARK:<9} {UNPROVEN_LEGEND}")
        if tests:
            lines.append(
                "  ok/FAIL   the change's tests on that release (patched tree; pristine if dropped)"
            )
        reasons = _reasons(data)
        if reasons:
            lines.append("")
            lines.append("why:")
            lines += reasons
    for note in data.get("skipped", []):
        lines.append(f"note: {note}")
    lines += standing_lines(data)
    if data.get("targets"):
        lines.append("")
        lines.append("stops a person is asked about, per target: the walk | the direct jump")
        for t in data["targets"]:
            walked = ", ".join(f"{s['id']}@{s['release']}" for s in t["walk"]) or "-"
            lines.append(f"  {t['version']:<{cell_w}} {len(t['walk'])} | {len(t['direct'])}"
                         f"   {walked}")  # fmt: skip
    lines.append("")
    safe = data["safe_target"]
    if safe:
        lines.append(
            f"safe target: {data['name']} {safe} (the newest release the walk reaches without "
            "asking a person)"
        )
    elif cols:
        lines.append("safe target: none (every newer release needs a person)")
    return "\n".join(lines)


def standing_line(ch: dict) -> str:
    """Where a change stands upstream; ours not yet sent is flagged, with the releases it has
    been carried on."""
    fw = ch.get("forwarded")
    if fw is None:
        return ""
    carried = ch.get("carried") or []
    span = (
        f" ({carried[0]} .. {carried[-1]})"
        if len(carried) > 1
        else f" ({carried[0]})"
        if carried
        else ""
    )
    n = (
        f"carried on {len(carried)} release(s){span}"
        if carried
        else "carried since an unrecorded release"
    )
    security = "; a security fix: a private advisory" if ch.get("security") else ""
    if ch.get("flag"):
        return (f"NOT YET SENT: ours, {n}{security}; `vllm-overlay upstream {ch['id']}` "
                "prepares it")  # fmt: skip
    return fw["summary"] + (f"; {n}" if carried else "") + security


def standing_lines(data: dict) -> list[str]:
    rows = [(ch["id"], standing_line(ch)) for ch in data["changes"] if ch.get("forwarded")]
    if not rows:
        return []
    flagged = sum(1 for ch in data["changes"] if ch.get("flag"))
    out = ["", f"upstream standing ({flagged} of ours not yet sent):"]
    return out + [f"  {cid}: {text}" for cid, text in rows]


def _reasons(data: dict) -> list[str]:
    """One line per (change, reason), with the releases it holds for."""
    out = []
    for ch in data["changes"]:
        groups: dict[str, list[str]] = {}
        for col in data["releases"]:
            o = next(x for x in col["outcomes"] if x["id"] == ch["id"])
            if o["state"] in (classify.KEPT, GONE):
                continue
            generic = o["reason"].replace(f"{data['name']} {col['version']}", f"{data['name']} V")
            why = f"{o['state']}: {generic}"
            groups.setdefault(why, []).append(col["version"])
            t = (col.get("tests") or {}).get(ch["id"])
            if t and t.get("ran") and not t["ok"]:
                groups.setdefault(f"tests FAIL on {t['on']}: {t['summary']}", []).append(
                    col["version"]
                )
        for why, versions in groups.items():
            out.append(f"  {ch['id']} [{_span(versions)}]: {why}")
    return out


def _span(versions: list[str]) -> str:
    return (
        versions[0] if len(versions) == 1 else f"{versions[0]} .. {versions[-1]} ({len(versions)})"
    )


def cell_anchor(cid: str, version: str) -> str:
    return f"cell-{cid}-{version}".replace(".", "_")


CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table.matrix{border-collapse:collapse}
.matrix th,.matrix td{border:1px solid #ccc;padding:.35em .6em;text-align:center}
.matrix th.change{text-align:left}
td.kept{background:#d7f5dc}td.refreshed{background:#d4f1f4}td.dropped{background:#dde6fb}
td.conflict{background:#f9c9c9;font-weight:bold}td.moved{background:#efd0f5;font-weight:bold}
td.collision{background:#fbe8b5;font-weight:bold}td.record{background:#d4f1f4}
td.unproven{outline:2px dashed #b00020}td.waiting{background:#fdf3d0}td.gone{color:#999}td.tests-failed{background:#f9c9c9}
td a{color:inherit;text-decoration:none;display:block}
.t-ok{color:#11772b}.t-fail{color:#b00020;font-weight:bold}
th.clean{background:#d7f5dc}th.safe{outline:3px solid #11772b}
pre{background:#f6f6f6;padding:.6em;overflow:auto;max-height:30em}
section.cell{border-top:1px solid #ddd;margin-top:1em}
"""


def page(data: dict) -> str:
    """A self-contained HTML page: the matrix, the legend, and every cell's details."""
    e = html.escape
    cols = data["releases"]
    safe = data["safe_target"]
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(data['name'])} outlook from {e(data['pin'])}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{e(data['name'])} {e(data['pin'])}: outlook over {len(cols)} newer release(s)</h1>",
        f'<p id="safe-target">safe target: <b>{e(safe) if safe else "none"}</b> '
        "(the newest release the walk reaches without asking a person)</p>",
    ]
    out += _matrix(data)
    out += _legend(data)
    out.append("<h2>Details</h2>")
    for ch in data["changes"]:
        for col in cols:
            out += _cell(data, ch, col)
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _matrix(data: dict) -> list[str]:
    """The table: a row per change, a column per release, each cell linked to its details."""
    e = html.escape
    cols = data["releases"]
    safe = data["safe_target"]
    out = ['<table class="matrix" id="matrix"><thead><tr><th class="change">change</th>']
    for col in cols:
        cls = " ".join(
            x
            for x in ("clean" if col["clean"] else "", "safe" if col["version"] == safe else "")
            if x
        )
        out.append(f'<th class="{cls}" data-version="{e(col["version"])}">{e(col["version"])}</th>')
    out.append("</tr></thead><tbody>")
    for ch in data["changes"]:
        out.append(f'<tr><th class="change" title="{e(ch["title"])}">{e(ch["id"])}</th>')
        for col in cols:
            o = next(x for x in col["outcomes"] if x["id"] == ch["id"])
            t = (col.get("tests") or {}).get(ch["id"])
            mark = ""
            if t and t.get("ran"):
                mark = (' <span class="t-ok">tests ok</span>' if t["ok"]
                        else ' <span class="t-fail">tests FAIL</span>')  # fmt: skip
            unproven = " (unproven)" if o.get("unproven") else ""
            cls = o["state"] + (" unproven" if unproven else "")
            out.append(
                f'<td class="{cls}" data-state="{o["state"]}" data-change="{e(ch["id"])}" '
                f'data-version="{e(col["version"])}"><a href="#{cell_anchor(ch["id"], col["version"])}">'
                f"{e(o['state'])}{unproven}{mark}</a></td>"
            )
        out.append("</tr>")
    out.append("</tbody></table>")
    return out


def _legend(data: dict) -> list[str]:
    """The legend of the states, then the changes' upstream standing and the skipped
    releases, where there are any."""
    e = html.escape
    out = ["<h2>Legend</h2><dl>"]
    for state, text in LEGEND.items():
        out.append(f"<dt>{state}</dt><dd>{e(text)}</dd>")
    out.append(f"<dt>{walkdata.RECORD} (unproven)</dt><dd>{e(UNPROVEN_LEGEND)}</dd>")
    out.append("</dl>")
    if any(ch.get("forwarded") for ch in data["changes"]):
        out.append('<h2 id="standing">Upstream standing</h2><ul>')
        for ch in data["changes"]:
            if ch.get("forwarded"):
                cls = ' class="t-fail"' if ch.get("flag") else ""
                out.append(f"<li{cls}><b>{e(ch['id'])}</b>: {e(standing_line(ch))}</li>")
        out.append("</ul>")
    if data.get("skipped"):
        out.append("<h2>Skipped releases</h2><ul>")
        out += [f"<li>{e(n)}</li>" for n in data["skipped"]]
        out.append("</ul>")
    return out


def _cell(data: dict, ch: dict, col: dict) -> list[str]:
    """One cell's details: the state and its reason, notes, conflicts, the tests' result."""
    e = html.escape
    o = next(x for x in col["outcomes"] if x["id"] == ch["id"])
    out = [
        f'<section class="cell" id="{cell_anchor(ch["id"], col["version"])}">'
        f"<h3>{e(ch['id'])} on {e(data['name'])} {e(col['version'])}: {e(o['state'])}</h3>"
        f"<p>{e(o['reason'])}</p>"
    ]
    for note in o.get("notes", []):
        out.append(f"<p><i>{e(note)}</i></p>")
    for path, hunk in o.get("hunks", {}).items():
        out.append(f"<h4>conflict in {e(path)}</h4><pre>{e(hunk)}</pre>")
    t = (col.get("tests") or {}).get(ch["id"])
    if t:
        if t.get("ran"):
            out.append(
                f"<h4>tests on {e(t['on'])}: {'ok' if t['ok'] else 'FAIL'} "
                f"({e(t['counts'])})</h4><pre>{e(t.get('log_tail', ''))}</pre>"
            )
        else:
            out.append(f"<p>tests: {e(t['why'])}</p>")
    out.append('<p><a href="#matrix">back to the matrix</a></p></section>')
    return out
