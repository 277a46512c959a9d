"""What the fused routed-read backward's Triton kernel (``lime_model.kv_kernels``) needs of a GPU, found
without one: each specialization the 1B shapes launch, compiled ahead of time for a CUDA target by
Triton's own compiler, with its registers per thread, the bytes it spills to the stack (local memory:
any at all costs a memory-bound kernel dearly), and its shared memory, as Triton's ``cuobjdump`` reads
them off the binary.

Layer ``j`` of ``--layers`` has ``layers - j`` readers under full routing, so the kernel is specialized
for every power of two of readers up to ``layers``; ``--sm`` names the target (90: H100 and H200).

    python bench/kernel_resources.py
    python bench/kernel_resources.py --sm 80 --warps 4
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from lime_model import kv_kernels
from lime_model.command_line import POSITIVE_INT, OneLineParser

SHAPES = {"gqa": 8, "mha": 32}  # K/V heads of the 1B shapes
SIGNATURE = ("kept", "columns", "source", "grad", "partial", "ROWS", "N", "TILES")


def resources(kv: int, readers: int, dtype: str, sm: int, warps: int, head_dim: int = 64) -> dict[str, Any]:
    """Compile the kernel for ``readers`` consecutive readers of ``kv`` heads (their rows padded to a
    power of two) and read its resources: ``registers``, ``stack_bytes``, ``shared_bytes``, and the
    tile's ``block``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    padded, rows = max(16, 1 << (kv - 1).bit_length()), max(16, 1 << (readers * kv - 1).bit_length())
    block = max(16, min(kv_kernels.MAX_BLOCK, kv_kernels.TILE_ELEMENTS // rows))
    pointer = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[dtype]
    types = [pointer, pointer, pointer, pointer, "*fp32", "i32", "i32", "i32"]
    constants = {"KV": kv, "KVP": padded, "HD": head_dim, "RPK": rows, "BLOCK": block,
                 "PRECISION": "ieee" if dtype == "float32" else "tf32", "ACCUMULATE": False}  # fmt: skip
    signature = dict(zip(SIGNATURE, types, strict=True)) | dict.fromkeys(constants, "constexpr")
    source = ASTSource(
        fn=kv_kernels._kernel(False),
        signature=signature,
        constexprs={(list(signature).index(name),): value for name, value in constants.items()},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", sm, 32), options={"num_warps": warps})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as binary:
        binary.write(compiled.asm["cubin"])
        binary.flush()
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", binary.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise SystemExit(f"kernel_resources.py: no resource usage in cuobjdump's output: {usage[-300:]}")
    registers, stack = (int(v) for v in found.groups())
    return {
        "registers": registers,
        "stack_bytes": stack,
        "shared_bytes": compiled.metadata.shared,
        "block": block,
    }


def main() -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=POSITIVE_INT, default=16)
    parser.add_argument("--sm", type=POSITIVE_INT, default=90, help="compute capability x 10 (default: 90)")
    parser.add_argument("--warps", type=POSITIVE_INT, default=kv_kernels.WARPS)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if importlib.util.find_spec("triton") is None:
        parser.error("Triton is not installed (pip install triton, or the dev extra)")
    print(f"kv_kernels' kernel for sm_{args.sm}, {args.dtype}, {args.warps} warps, head_dim 64")
    print(f"{'shape':<5} {'readers':>7} {'block':>5} {'registers':>9} {'spilled B':>9} {'shared B':>9}")
    for shape, kv in SHAPES.items():
        readers = 1
        while readers <= args.layers:
            r = resources(kv, readers, args.dtype, args.sm, args.warps)
            print(f"{shape:<5} {readers:>7} {r['block']:>5} {r['registers']:>9} {r['stack_bytes']:>9} "
                  f"{r['shared_bytes']:>9}")  # fmt: skip
            readers *= 2


if __name__ == "__main__":
    main()
