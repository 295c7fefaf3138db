"""What differs between two vllm-cpu wheels: our build from source against our repack of the
official wheel (or any two). Prints figures, asserts nothing.

- the files: size, members, members only in one, Python members that differ;
- each native extension (``*.so``): its size in each, the shared libraries it needs
  (``readelf -d``), and the torch operators it registers (the schema strings of
  ``ops.def(...)``, e.g. ``rms_norm(Tensor! result, ...) -> ()``), with the operators only
  one of them has: which kernels a build left out;
- the ISA variants each wheel ships (``_C`` for AVX512 with BF16/VNNI/AMX, ``_C_AVX512``,
  ``_C_AVX2``: vLLM picks one at run time).

    python bench/compare_cpu_wheels.py OURS.whl OFFICIAL.whl
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# An operator schema as vLLM's torch_bindings.cpp defines it: name(args) -> returns.
# Arguments may carry alias annotations with parentheses of their own: Tensor(a!).
SCHEMA = re.compile(rb"^[a-z_][a-z0-9_.]*\((?:[A-Z][^\x00]*)?\) -> [^\x00]{1,200}$")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="the first wheel (ours, say)")
    p.add_argument("b", type=Path, help="the second wheel (the official one, say)")
    args = p.parse_args()
    za, zb = zipfile.ZipFile(args.a), zipfile.ZipFile(args.b)
    ma, mb = _members(za), _members(zb)
    print(f"A: {args.a.name}: {args.a.stat().st_size / 1e6:.1f} MB, {len(ma)} members")
    print(f"B: {args.b.name}: {args.b.stat().st_size / 1e6:.1f} MB, {len(mb)} members")
    only_a, only_b = sorted(set(ma) - set(mb)), sorted(set(mb) - set(ma))
    print(f"members only in A ({len(only_a)}): {', '.join(only_a[:20])}")
    print(f"members only in B ({len(only_b)}): {', '.join(only_b[:20])}")
    common = sorted(set(ma) & set(mb))
    py = [n for n in common if n.endswith(".py")]
    differ = [n for n in py if za.read(ma[n]) != zb.read(mb[n])]
    print(f"Python members in both: {len(py)}, differing: {len(differ)}: {', '.join(differ[:20])}")
    sos = sorted(n for n in set(ma) | set(mb) if n.endswith(".so"))
    with tempfile.TemporaryDirectory() as tmp:
        for name in sos:
            print(f"\n{name}")
            ops = {}
            for label, z, m in (("A", za, ma), ("B", zb, mb)):
                if name not in m:
                    print(f"  {label}: absent")
                    continue
                path = Path(tmp) / label / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(z.read(m[name]))
                ops[label] = _schemas(path)
                print(f"  {label}: {path.stat().st_size / 1e6:.1f} MB, {len(ops[label])} operator "
                      f"schemas, needs {', '.join(_needed(path)) or '-'}")  # fmt: skip
            if len(ops) == 2:
                for x, y in (("A", "B"), ("B", "A")):
                    gone = sorted(ops[x] - ops[y])
                    if gone:
                        names = sorted({s.split("(")[0] for s in gone})
                        print(f"  operators only in {x} ({len(gone)}): {', '.join(names)}")
    return 0


def _members(z: zipfile.ZipFile) -> dict[str, str]:
    """Member names with the .dist-info directory's name made generic (its version differs)."""
    out = {}
    for info in z.infolist():
        if info.is_dir():
            continue
        generic = re.sub(r"^[^/]+\.dist-info/", "DIST-INFO/", info.filename)
        out[generic] = info.filename
    return out


def _schemas(path: Path) -> set[str]:
    data = path.read_bytes()
    return {s.decode() for s in data.split(b"\x00") if SCHEMA.match(s)}


def _needed(path: Path) -> list[str]:
    try:
        out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                             check=False).stdout  # fmt: skip
    except OSError:
        return ["(readelf missing)"]
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


if __name__ == "__main__":
    sys.exit(main())
