"""ColossalAI's CPU Adam kernel and exact resume, on a CPU machine (issue 19).

    mkdir -p /tmp/cs && tar -C /tmp/cs -xJf .devcarry/colossalai.tar.xz   # bench/pack_colossalai.sh's closure
    pip download einops --no-deps -d /tmp/w && unzip -q /tmp/w/einops-*.whl -d /tmp/cs   # colossalai.booster imports it
    PYTHONPATH=/tmp/cs:$PYTHONPATH python bench/cpu_adam_resume.py --out bench/results/cpu_adam_resume.json

ZeRO-2 (cpu_offload) and Gemini step their fp32 masters with HybridAdam's C++ CPU Adam. That
kernel object caches ``beta ** step`` between calls, so a resumed run (a new kernel object) steps
its first tensor with a bias correction that differs in the last bits: on the H200 the probe's
resume_exact found 1 of 16 LoRA tensors off. This builds the real x86 kernel from ColossalAI's
source (the CUDA headers it includes but does not use on this path are replaced by empty ones),
then runs 4 tensors x 5 steps, saves, 4 more steps (the uninterrupted run), and again from the
saved state with a fresh optimizer (the resumed run), plain and with ``prime_cpu_adam`` before
each step (what the learners do). Writes which tensors of the resumed run equal the uninterrupted one.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HALF_STUB = ("#pragma once\n#include <cstdint>\n"
             "struct __half { uint16_t x; __half() = default; __half(float) : x(0) {} operator float() const { return 0.f; } };\n")


def build_kernel(work: str):
    """ColossalAI's x86 CPU Adam, built with torch.utils.cpp_extension (ninja + g++)."""
    import colossalai
    import torch.utils.cpp_extension as ce

    src = os.path.join(os.path.dirname(colossalai.__file__), "kernel/extensions/csrc/kernel/x86/cpu_adam.cpp")
    for h in ("cublas_v2.h", "cuda.h", "cuda_runtime_api.h"):
        open(os.path.join(work, h), "w").write("#pragma once\n")
    open(os.path.join(work, "cuda_fp16.h"), "w").write(HALF_STUB)  # the fp16 paths are not taken: fp32 tensors
    return ce.load("cpu_adam_bench", [src], extra_include_paths=[work], build_directory=work,
                   extra_cflags=["-O3", "-std=c++17", "-fopenmp", "-march=native", "-Wno-reorder"], extra_ldflags=["-fopenmp"])


def run(primed: bool) -> list[bool]:
    from colossalai.nn.optimizer.cpu_adam import CPUAdam

    from tasks.ppo.group import prime_cpu_adam

    def make():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(37)) for _ in range(4)]
        return ps, CPUAdam(ps, lr=1e-2)

    def step(ps, opt, k):
        g = torch.Generator().manual_seed(k)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        if primed:
            prime_cpu_adam(opt)
        opt.step()

    ps, opt = make()
    for k in range(5):
        step(ps, opt, k)
    saved_w, saved_o = [p.detach().clone() for p in ps], copy.deepcopy(opt.state_dict())
    for k in range(5, 9):
        step(ps, opt, k)
    ps2, opt2 = make()  # a new process's optimizer: a new kernel object
    with torch.no_grad():
        for p, w in zip(ps2, saved_w):
            p.copy_(w)
    opt2.load_state_dict(saved_o)
    for k in range(5, 9):
        step(ps2, opt2, k)
    return [torch.equal(a, b) for a, b in zip(ps, ps2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import colossalai.kernel.kernel_loader as kl

    kernel = build_kernel(tempfile.mkdtemp(prefix="cpu-adam-"))
    kl.CPUAdamLoader.load = lambda self: kernel  # its loader wants CUDA for this kernel; the kernel itself is CPU code
    res = {"command": "bench/cpu_adam_resume.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
           "resumed_equals_uninterrupted": {"plain": run(False), "prime_cpu_adam": run(True)}}
    print(json.dumps(res))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
