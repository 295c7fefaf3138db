"""Connector benchmark: what our hidden-states connector changes cost per request, in one
process, so that 2% shows.

The engine bench (bench_engine.py) compares whole engines; their tokens/s vary by ±15% from
one engine to the next on this machine, so it cannot tell a change that costs 2%. This bench
measures the connector itself. vLLM is imported once, from the pristine tree of the pin (in
the CPU test environment, ``vllm-overlay testenv``); the connector module
(``example_hidden_states_connector.py``) is loaded four times under distinct module names,
as the series leaves it:

- ``without``: after ``hidden-states-connector-cpu-cache`` (the series without our
  changes for the connector's clients, as bench_engine's "without" wheel; the CPU cache
  change is what lets the connector copy from host memory at all);
- ``+aborted``: plus ``hidden-states-connector-aborted-leave-no-files``;
- ``+confined``: plus ``hidden-states-connector-confined-paths``;
- ``ours``: the whole series (plus ``hidden-states-connector-bounded-staging``, the copy
  out in chunks, and ``hidden-states-connector-atomic-files``, the write under a temporary
  name renamed into place).

Each side has a scheduler-role and a worker-role connector (TP rank 0 of a real one-process
gloo group), built as the engine builds them, and is driven through the calls the scheduler
and the worker make, on real vLLM requests with ids as the OpenAI server makes them
(``cmpl-<uuid>-0-<suffix>``, ``chatcmpl-…``, a client's X-Request-Id UUID), in batches of
``--batch`` per engine step:

- ``schedule``: build_connector_meta for the step that schedules them (the file path of
  each new request: confined-paths' percent-encoding);
- ``lock``: the worker's wait_for_save (the .lock file created and LOCK_EX taken);
- ``finish``: request_finished of a request that finished (the abort check);
- ``save``: the next step's build_connector_meta and the worker's get_finished, until the
  writer threads have written every file (a real safetensors write of ``--tokens`` rows of
  ``--layers`` x ``--hidden`` bf16 into ``--storage``);
- ``abort``, ``discard``: the same two for requests aborted once scheduled (one batch in
  ``--abort-every``): without our change the connector saves them, with it it removes the
  lock file;
- ``path``: the path alone, ``os.path.join(storage, <file name>)``, for every id.

The sides take turns batch by batch, in an order rotated at every batch (A B C, B C A,
C A B, ...), so a machine that other jobs load, or that warms up, favours none; a round is
the same ``--requests`` requests through every side. Prints, per operation, ns per request
for each side (median over rounds), and each side's ratio to ``without``: the median of the
per-round ratios with a bootstrap 95% interval and the min and max; then the whole path of a
finished request and of an aborted one. Files are removed after each batch, untimed (the
client's part).

    python bench/bench_connector.py [--rounds 40] [--requests 256] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
# (side, the last change of the series it includes)
SIDES = (
    ("without", "hidden-states-connector-cpu-cache"),
    ("+aborted", "hidden-states-connector-aborted-leave-no-files"),
    ("+confined", "hidden-states-connector-confined-paths"),
    ("ours", "hidden-states-connector-atomic-files"),
)
OPS = ("path", "schedule", "lock", "finish", "save", "abort", "discard")
FINISHED_PATH = ("schedule", "lock", "finish", "save")
ABORTED_PATH = ("schedule", "lock", "abort", "discard")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=40, help="counted rounds (default 40)")
    p.add_argument("--warmup", type=int, default=3, help="uncounted rounds first (default 3)")
    p.add_argument("--requests", type=int, default=256, help="per side and round (default 256)")
    p.add_argument("--batch", type=int, default=16, help="requests per engine step (default 16)")
    p.add_argument(
        "--abort-every", type=int, default=4, help="one batch in N is aborted (default 4)"
    )
    p.add_argument("--tokens", type=int, default=64, help="rows per saved file (default 64)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--layers", type=int, default=3, help="extracted layers (default 3)")
    p.add_argument(
        "--storage",
        type=Path,
        help="where the files go (default: a new directory in /dev/shm where it exists, so "
        "that the disk's own spread does not hide the connector's)",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=REPO / ".work" / "bench-connector",
        help="the pristine tree and the connector's versions (default .work/bench-connector; "
        "kept, so a second run reuses the tree)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's threads in the bench process (default 1: on a loaded machine its "
        "OpenMP threads made the copy out of the cache 10x slower and as noisy)",
    )
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(json.loads(args.child.read_text()))
    return _parent(args)


# --- the parent: the tool's venv --------------------------------------------------------


def _parent(args: argparse.Namespace) -> int:
    from vllm_overlay import util

    work = args.work.absolute()
    sides, env, tree = prepare_sides(SIDES, work)
    with tempfile.TemporaryDirectory(dir=_storage_parent(args.storage)) as storage:
        spec = {**vars(args), "sides": sides, "storage": storage}
        spec.pop("child"), spec.pop("work"), spec.pop("json")
        figures = run_child(__file__, spec, work, env, tree)
    print(report(figures, spec))
    if args.json:
        util.atomic_write_text(args.json, json.dumps(figures, indent=2))
    return 0


def prepare_sides(sides: tuple[tuple[str, str], ...], work: Path):
    """The connector module as the series leaves it after each side's change, written under
    ``work``; the pristine tree of the pin and its test environment. (side -> module path,
    the environment, the tree.)"""
    sys.path.insert(0, str(REPO / "tools"))
    os.environ.setdefault("VLLM_OVERLAY_PROJECT", str(REPO))
    from vllm_overlay import util
    from vllm_overlay.envs import testenv
    from vllm_overlay.gitrepo import show_bytes
    from vllm_overlay.overlay.checkout import apply_overlay, plan
    from vllm_overlay.overlay.project import find_project
    from vllm_overlay.pin.trees import upstream_repo

    project = find_project()
    lock, overlay = project.lock(), project.overlay()
    files = work / "connector"
    files.mkdir(parents=True, exist_ok=True)
    repo, base = upstream_repo(lock)
    content = {"pristine": show_bytes(repo, base, CONNECTOR)}
    for pc in plan(lock, overlay, repo, base):
        if CONNECTOR in pc.files:
            content[pc.change.id] = pc.files[CONNECTOR]
    order = [c.id for c in overlay.changes if CONNECTOR in c.files]
    wanted = [change for _, change in sides]
    at = [order.index(c) if c in order else -1 for c in wanted]
    if -1 in at or at != sorted(at) or wanted[-1] != order[-1]:
        raise SystemExit(
            f"bench: expected the series to change {CONNECTOR} with "
            f"{', '.join(wanted)}, in that order, the last last; it does with "
            f"{', '.join(order)}. Update its SIDES."
        )
    paths = {}
    for side, change in sides:
        path = files / f"{change}.py"
        util.atomic_write_bytes(path, content[change])
        paths[side] = str(path)
    tree = work / "pristine"
    apply_overlay(lock, None, tree, force=True)
    return paths, testenv.ensure_testenv(tree), tree


def run_child(script: str, spec: dict, work: Path, env, tree: Path) -> dict:
    """``script --child SPEC`` in the test environment ``env`` with ``tree`` on its path;
    the JSON it prints."""
    from vllm_overlay import process, util

    spec_file = work / "spec.json"
    util.atomic_write_text(spec_file, json.dumps(spec, indent=2))
    out = process.run(
        env.python, script, "--child", spec_file,
        env=env.environ(work / "scratch", tree), cwd=work,
        hint="the bench's child failed; its output is above.",
    )  # fmt: skip
    return json.loads(out.stdout)


def _storage_parent(storage: Path | None) -> str | None:
    if storage is not None:
        storage.mkdir(parents=True, exist_ok=True)
        return str(storage)
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def report(figures: dict, spec: dict) -> str:
    """The table: per operation, ns/request per side (median of rounds), each side's ratio
    to ``without`` (median of per-round ratios, bootstrap 95% interval, min..max)."""
    rounds = figures["rounds"]  # side -> op -> [ns/request per round]
    names = [s for s, _ in SIDES]
    lines = [
        f"connector, per request: {spec['rounds']} rounds (after {spec['warmup']} uncounted) "
        f"of {spec['requests']} requests per side, {spec['batch']} per step, one batch in "
        f"{spec['abort_every']} aborted; files of {spec['tokens']} x {spec['layers']} x "
        f"{spec['hidden']} bf16 in {figures['storage_fs']}; sides in rotated order each round",
        f"{'operation':10}" + "".join(f"{n + ' ns':>12}" for n in names)
        + "".join(f"  {n + '/without (95%; min..max)':>40}" for n in names[1:]),
    ]  # fmt: skip
    rows = list(OPS) + ["finished", "aborted"]
    for op in rows:
        per = {n: _op_rounds(rounds[n], op) for n in names}
        cells = "".join(f"{statistics.median(per[n]):12.0f}" for n in names)
        for n in names[1:]:
            ratios = [a / b for a, b in zip(per[n], per["without"], strict=True)]
            lo, hi = bootstrap_median(ratios)
            cells += (
                f"  {statistics.median(ratios):8.3f} ({lo:.3f}-{hi:.3f}; "
                f"{min(ratios):.2f}..{max(ratios):.2f})".rjust(40)
            )
        lines.append(f"{op:10}{cells}")
    lines.append(
        "finished = schedule + lock + finish + save; aborted = schedule + lock + abort + "
        "discard; path is inside schedule"
    )
    return "\n".join(lines)


def _op_rounds(side: dict[str, list[float]], op: str) -> list[float]:
    parts = {"finished": FINISHED_PATH, "aborted": ABORTED_PATH}.get(op, (op,))
    return [sum(v) for v in zip(*(side[p] for p in parts), strict=True)]


def bootstrap_median(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile bootstrap interval of the median (seeded: the same figures give the
    same interval)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def rotated(names: list[str], n: int) -> list[str]:
    """The sides' order in round n: A B C, B C A, C A B, ..."""
    k = n % len(names)
    return names[k:] + names[:k]


# --- the child: the test environment, vLLM from the pristine tree ------------------------


def _child(spec: dict) -> int:
    import gc
    import time

    import torch
    from connector_sides import Side, init_rank_zero, request_ids

    torch.set_num_threads(spec["torch_threads"])
    init_rank_zero()
    ids = request_ids(spec["requests"], seed=1)
    storage = Path(spec["storage"])
    names = [s for s, _ in SIDES]
    sides = {
        n: Side(n, spec["sides"][n], storage / n.strip("+"), spec) for n in names
    }  # fmt: skip
    rounds: dict[str, dict[str, list[float]]] = {n: {op: [] for op in OPS} for n in names}
    batches = [ids[i : i + spec["batch"]] for i in range(0, len(ids), spec["batch"])]
    for r in range(spec["warmup"] + spec["rounds"]):
        ns = {n: {op: [0, 0] for op in OPS} for n in names}
        gc.collect()
        gc.disable()
        try:
            for b, batch in enumerate(batches):
                aborted = b % spec["abort_every"] == spec["abort_every"] - 1
                for n in rotated(names, r + b):
                    for op, (t, k) in sides[n].batch(batch, aborted).items():
                        ns[n][op][0] += t
                        ns[n][op][1] += k
        finally:
            gc.enable()
        if r >= spec["warmup"]:
            for n in names:
                for op, (t, k) in ns[n].items():
                    rounds[n][op].append(t / k)
        print(f"round {r + 1}: {time.strftime('%H:%M:%S')}", file=sys.stderr)
    fs = os.statvfs(storage)
    kind = "tmpfs" if str(storage).startswith("/dev/shm") else f"{storage} ({fs.f_bsize} B blocks)"
    print(json.dumps({"rounds": rounds, "storage_fs": kind}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
