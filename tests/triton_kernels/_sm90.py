"""Ahead-of-time compilation for Hopper (sm_90) without a GPU, for the kernels' compile
tests: Triton compiles for a named target and ships ptxas and cuobjdump with its wheel."""
from __future__ import annotations

import subprocess
from pathlib import Path

SMEM_LIMIT = 227 * 1024


def compile_sm90(fn, sig: dict, const: dict, warps: int, stages: int, div16=(),
                 arch: int = 90, maxnreg: int | None = None):
    """``triton.compile`` of ``fn`` for sm_90 (or ``arch``: scripts/shared_memory_by_arch.py):
    ``sig`` the runtime arguments' types (pointers 16-byte aligned), ``const`` the constexprs,
    ``div16`` integer arguments a launch passes as multiples of 16 (Triton specializes them,
    which can change the binary). Constexprs the kernel does not have are dropped, so that the
    digests of an older checkout's kernels (scripts/moe_ptx_digest.py) compile with this
    harness. Constexprs not given take the kernel's defaults. ``maxnreg``: ptxas's register
    limit, as a launch's ``maxnreg`` option sets it (GemmConfig.max_regs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = {k: v for k, v in const.items() if k in fn.arg_names}
    # a constexpr left out takes the kernel's default, as a launch would (triton.compile
    # itself would leave it unset: session 49's probe compiled a default-True flag as False)
    for p in fn.params:
        if p.is_constexpr and p.has_default and p.name not in const:
            const[p.name] = p.default
    sig = dict(sig, **{k: "constexpr" for k in const})
    # in the kernel's argument order (constexprs may precede runtime arguments)
    sig = {n: sig[n] for n in fn.arg_names if n in sig}
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t[0] == "*" or n in div16}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


def resource_usage(kern, tmp_path: Path) -> str | None:
    """cuobjdump's resource usage line(s) of the compiled kernel (registers, stack, shared
    memory), or None where the wheel ships no cuobjdump."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return None
    cubin = Path(tmp_path) / "k.cubin"
    cubin.write_bytes(kern.asm["cubin"])
    return subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)],
                          capture_output=True, text=True).stdout


def registers(kern, tmp_path: Path) -> int | None:
    """Registers a thread of the compiled kernel uses (cuobjdump), or None without cuobjdump."""
    import re

    usage = resource_usage(kern, tmp_path)
    return None if usage is None else int(re.search(r"REG:(\d+)", usage).group(1))


def programs_by_registers(regs: int, warps: int) -> int:
    """Programs of ``warps`` warps an sm_90 SM's 65,536 registers hold, a thread's count
    rounded up to 8."""
    return 65536 // (-(-regs // 8) * 8 * 32 * warps)


def assert_no_spills(kern, tmp_path: Path) -> None:
    """No local-memory stack in the compiled kernel (cuobjdump's resource usage), where the
    wheel ships cuobjdump."""
    usage = resource_usage(kern, tmp_path)
    if usage is not None:
        assert "STACK:0" in usage, f"register spills: {usage.strip()[-200:]}"
