"""Triton kernels compiled for an H100 (sm90) on a machine without a GPU: Triton carries its own
ptxas, so what the compiler makes of a kernel (PTX, registers, spills) can be checked by the CPU
tests; timing it cannot."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path


def signature(fn, types: dict | None = None) -> dict:
    """``fn``'s arguments as ``compile_sm90`` wants them: 'constexpr' for its constants, ``types``
    where given, else an upper-case name a bf16 tensor and the rest i32 (strides, sizes)."""
    types = types or {}
    return {name: "constexpr" if i in fn.constexprs else types.get(name) or ("*bf16" if name.isupper() else "i32")
            for i, name in enumerate(fn.arg_names)}


def launch_divisible(fn, sig: dict, exclude: tuple[str, ...] = ()) -> tuple[int, ...]:
    """The places of ``fn``'s pointer and integer arguments (but ``exclude``) that Triton's
    launcher specialises as multiples of 16 on a usual call: aligned addresses, strides and sizes
    of whole 16s."""
    return tuple(i for i, name in enumerate(fn.arg_names) if sig[name] != "constexpr" and not sig[name].startswith("fp")
                 and name not in exclude)


def compile_sm90(fn, signature: dict, constexprs: dict, warps: int = 4, stages: int = 2, divisible: tuple[int, ...] = ()):
    """``fn`` (a ``triton.jit`` function) compiled for sm90: ``signature`` maps every argument to
    its Triton type ('*bf16', 'i32', 'fp32', 'constexpr', ...), ``constexprs`` gives the constants;
    the arguments at ``divisible`` taken as multiples of 16, as Triton's launcher specialises
    addresses and sizes that are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def resources(kernel) -> dict:
    """{'regs', 'spill_bytes'} a thread of a compiled kernel, from cuobjdump's resource usage of its cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return {"regs": regs, "spill_bytes": stack}


def global_accesses(kernel) -> dict:
    """How many of each global load / store instruction the kernel's PTX holds, by its form
    ('ld.global.v4.b32': 16-byte vector loads, 'ld.global.b16': 2-byte scalar loads, ...)."""
    found: dict = {}
    for op in re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)*", kernel.asm["ptx"]):
        found[op] = found.get(op, 0) + 1
    return found
