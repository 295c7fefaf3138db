"""Staging figure: the bytes the hidden-states connector gathers out of the KV cache at once
for one finished request, before and after ``hidden-states-connector-bounded-staging``.

vllm#49310: the connector gathered all of a request's rows into one tensor (on a GPU, one
device allocation of the request's whole size, made when it finishes), which failed at
49,152 tokens of a 7168-wide verifier. This bench runs the connector's own copy path, not a
formula: the connector module as the series leaves it before the change (``before``: after
``hidden-states-connector-confined-paths``) and as the whole series leaves it (``after``),
each a worker-role connector (TP rank 0 of a one-process gloo group) on a KV cache in host
memory (vLLM's CPU backend, the path the engine tests run), with the module's
``extract_from_kv_cache`` wrapped to count every gather. One request of ``--tokens`` tokens
of ``--layers`` x ``--hidden`` bf16 (default: 65,536 tokens of 4 x 7168, a DeepSeek-V3-sized
verifier with speculators' four layers) finishes and is saved; its blocks reuse a few
blocks of cache, so the cache itself stays small. Prints per side: gathers, the most bytes
gathered at once, the bytes in all, the cap; the saved files must be equal (their sha256).

    python bench/bench_staging.py [--tokens 65536] [--layers 4] [--hidden 7168]
        [--cap BYTES (default: the connector's, 256 MiB)]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_connector import prepare_sides, run_child  # noqa: E402

SIDES = (
    ("before", "hidden-states-connector-confined-paths"),
    ("after", "hidden-states-connector-atomic-files"),
)
CACHE_BLOCKS = 64  # the request's block ids cycle through these


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=65536, help="the request's tokens")
    p.add_argument("--layers", type=int, default=4, help="extracted layers (default 4)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    p.add_argument("--cap", type=int, help="max_device_staging_bytes (default: the connector's)")
    p.add_argument("--work", type=Path, default=REPO / ".work" / "bench-staging",
                   help="the pristine tree and the connector's versions (kept)")  # fmt: skip
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(json.loads(args.child.read_text()))
    work = args.work.absolute()
    sides, env, tree = prepare_sides(SIDES, work)
    with tempfile.TemporaryDirectory() as storage:
        spec = {"sides": sides, "storage": storage, "tokens": args.tokens,
                "layers": args.layers, "hidden": args.hidden, "cap": args.cap}  # fmt: skip
        figures = run_child(__file__, spec, work, env, tree)
    row = args.layers * args.hidden * 2
    print(f"one request of {args.tokens:,} tokens x {args.layers} layers x {args.hidden} bf16 "
          f"({row:,} bytes a row, {args.tokens * row / 2**30:.3f} GiB in all)")  # fmt: skip
    print(f"{'side':8} {'gathers':>8} {'most at once (bytes)':>21} {'GiB':>7} {'all (bytes)':>15}")
    for side, f in figures["sides"].items():
        print(f"{side:8} {f['gathers']:8,} {f['max_bytes']:21,} {f['max_bytes'] / 2**30:7.3f} "
              f"{f['bytes']:15,}")  # fmt: skip
    print(f"cap (max_device_staging_bytes): {figures['cap']:,} bytes; files equal: "
          f"{figures['files_equal']}")  # fmt: skip
    return 0 if figures["files_equal"] else 1


def _child(spec: dict) -> int:
    import gc

    import torch
    from connector_sides import BLOCK_SIZE, LAYER, _configs, init_rank_zero, load_module
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

    init_rank_zero()
    layers, hidden, tokens = spec["layers"], spec["hidden"], spec["tokens"]
    torch.manual_seed(0)
    cache = torch.randn(CACHE_BLOCKS, layers, BLOCK_SIZE, hidden).to(torch.bfloat16)
    blocks = [i % CACHE_BLOCKS for i in range(-(-tokens // BLOCK_SIZE))]
    out: dict = {"sides": {}}
    saved = {}
    for name, path in spec["sides"].items():
        module = load_module(f"_bench_staging_{name}", path)
        seen = {"gathers": 0, "bytes": 0, "max_bytes": 0}
        extract = module.extract_from_kv_cache

        def counted(kv, slots, n, extract=extract, seen=seen):
            rows = extract(kv, slots, n)
            seen["gathers"] += 1
            seen["bytes"] += rows.nbytes
            seen["max_bytes"] = max(seen["max_bytes"], rows.nbytes)
            return rows

        module.extract_from_kv_cache = counted
        storage = Path(spec["storage"]) / name
        config, kv_config = _configs(storage, layers, hidden)
        config.model_config.max_model_len = tokens + 1
        if spec["cap"]:
            extra = config.kv_transfer_config.kv_connector_extra_config
            extra["max_device_staging_bytes"] = spec["cap"]
        config.compilation_config.static_forward_context[LAYER] = CacheOnlyAttentionLayer.__new__(
            CacheOnlyAttentionLayer
        )
        worker = module.ExampleHiddenStatesConnector(config, KVConnectorRole.WORKER, kv_config)
        worker.register_kv_caches({LAYER: cache})
        out["cap"] = getattr(worker, "_max_staging_bytes", out.get("cap"))
        pending = module.PendingSave(req_id=f"staging-{name}",
                                     filename=str(storage / f"staging-{name}.safetensors"),
                                     token_ids=torch.arange(tokens), block_ids=blocks)  # fmt: skip
        meta = module.ExampleHiddenStatesConnectorMetadata(pending_saves=[pending])
        worker.bind_connector_metadata(meta)
        worker.get_finished({pending.req_id})
        worker.clear_connector_metadata()
        worker.get_finished(set())
        worker._executor.shutdown(wait=True)
        saved[name] = _digest(pending.filename)
        Path(pending.filename).unlink()
        out["sides"][name] = seen
        del worker
        gc.collect()
    out["files_equal"] = len(set(saved.values())) == 1
    print(json.dumps(out))
    return 0


def _digest(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    sys.exit(main())
