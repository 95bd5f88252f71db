"""tasks/ppo/decode_attention.py (split-K flash decoding in Triton) against SDPA.

With CUDA the checks run natively. Without, they run in Triton's interpreter, which must be on
(TRITON_INTERPRET=1) before triton makes its JIT functions: each check runs in a fresh Python
process with that variable set and prints one line, which the test asserts on. The interpreter
runs the kernels' code program by program on the CPU (torch's ``wrap_triton`` takes its kernels
from torch 2.12 on, pytorch/pytorch#185597; the CPU build here is 2.13); what it cannot check
(register and shared memory limits, tl.dot's layouts, torch.compile and CUDA-graph capture) the
CUDA run does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]
# (b, n_kv, g, head_dim, L): GQA groups of 1..8 heads, head_dim 64 and 128 (and 80: a padded
# head dimension), L of one tile, of one column, and not a multiple of the 64-column tile
CASES = [(3, 2, 1, 64, 300), (4, 2, 2, 64, 130), (2, 3, 4, 64, 64), (3, 1, 8, 64, 37), (2, 2, 1, 128, 200),
         (3, 2, 4, 128, 77), (2, 2, 8, 128, 1), (2, 1, 2, 80, 90)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def ragged_bias(b: int, L: int, dtype, device, seed: int = 0) -> torch.Tensor:
    """(b, 1, 1, L): 0 on each row's visible columns, the dtype's minimum elsewhere. As in a
    rollout, a run of columns (left padding before it, columns not yet decoded after it), with
    rows that see one, two or three columns only; the last row sees a scattered set."""
    g = torch.Generator().manual_seed(seed)
    seen = torch.zeros(b, L, dtype=torch.bool)
    for r in range(b):
        width = [1, 2, 3][r] if r < 3 else int(torch.randint(1, L + 1, (1,), generator=g))
        width = min(width, L)
        lo = int(torch.randint(0, L - width + 1, (1,), generator=g))
        seen[r, lo:lo + width] = True
    if b > 3:
        seen[-1] = torch.rand(L, generator=g) < 0.3
        seen[-1, -1] = True
    return torch.zeros(b, 1, 1, L, dtype=dtype).masked_fill(~seen[:, None, None], torch.finfo(dtype).min).to(device)


def inputs(b, n_kv, g, hd, L, dtype, device, seed=0):
    """q (b, n_kv, g, hd) and the cache as a [:b] slice of a larger buffer (the generator's)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n_kv, g, hd, generator=gen)
    kc, vc = (torch.randn(b + 2, n_kv, L, hd, generator=gen) for _ in range(2))
    return q.to(device, dtype), kc.to(device, dtype)[:b], vc.to(device, dtype)[:b], ragged_bias(b, L, dtype, device, seed)


def sdpa(q, kc, vc, bias, scale):
    """The reference: torch's SDPA on the same numbers in fp32."""
    return F.scaled_dot_product_attention(q.float(), kc.float(), vc.float(), attn_mask=bias.float(), scale=scale)


# -- the checks (run natively on CUDA, in the interpreter on CPU) --------------------------------------
def check_equals_sdpa(device: str) -> str:
    """Every case, fp32 and bf16, with the split count chosen from the shape, one split (no
    combine kernel) and three: the kernel equals SDPA to the dtype's tolerance."""
    from tasks.ppo.decode_attention import decode_attention

    n = 0
    for dtype in (torch.float32, torch.bfloat16):
        for b, n_kv, g, hd, L in CASES:
            q, kc, vc, bias = inputs(b, n_kv, g, hd, L, dtype, device)
            want = sdpa(q, kc, vc, bias, hd ** -0.5)
            for splits in (0, 1, 3):
                got = decode_attention(q, kc, vc, bias, hd ** -0.5, splits)
                assert got.dtype == dtype and got.shape == (b, n_kv, g, hd)
                torch.testing.assert_close(got.float(), want, **TOL[dtype], msg=lambda m: f"{(b, n_kv, g, hd, L, dtype, splits)}: {m}")
                n += 1
    return f"{n} cases equal SDPA"


def check_masked_columns_contribute_nothing(device: str) -> str:
    """Masked columns are never read: NaN in their K and V changes no bit of the output; a row
    that sees one column returns that column's V exactly (its softmax weight is exactly 1)."""
    from tasks.ppo.decode_attention import decode_attention

    n = 0
    for dtype in (torch.float32, torch.bfloat16):
        for b, n_kv, g, hd, L in CASES:
            q, kc, vc, bias = inputs(b, n_kv, g, hd, L, dtype, device, seed=1)
            hidden = (bias[:, 0, 0] < 0)[:, None, :, None]
            for splits in (0, 1, 3):
                clean = decode_attention(q, kc.masked_fill(hidden, 0.0), vc.masked_fill(hidden, 0.0), bias, 0.1, splits)
                nan = float("nan")
                dirty = decode_attention(q, kc.masked_fill(hidden, nan), vc.masked_fill(hidden, nan), bias, 0.1, splits)
                assert torch.equal(dirty, clean), (b, n_kv, g, hd, L, dtype, splits)
            col = int((bias[0, 0, 0] == 0).nonzero()[0, 0])  # row 0 sees one column
            assert torch.equal(clean[0], vc[0, :, col, None].expand(n_kv, g, hd)), (b, n_kv, g, hd, L, dtype)
            n += 1
    return f"{n} cases: masked columns contribute nothing"


def fast_generators_decode_alike(device: str, option: str, values: tuple[str, str], **fixed) -> str:
    """FastGenerators that differ in one option (``option`` = each of ``values``; ``fixed`` the
    same for both) decode the same greedy tokens, on the tiny GQA Llama and Qwen2 (q/k/v biases)
    of tests/test_fast_generate.py; on CUDA compiled and captured in a CUDA graph, at two batch
    sizes (the second compiles with a symbolic batch). Each reports the value it took in ``info()``."""
    from tasks.ppo.fast_generate import FastGenerator
    from tests.test_fast_generate import fast, left_padded, tiny

    n = 0
    for kind in ("llama", "qwen2"):
        model = tiny(kind).to(device)
        ids, mask = (t.to(device) for t in left_padded())
        fg = {v: FastGenerator(model, max_batch=4, max_len=32, **fixed, **{option: v}) for v in values}
        assert all(fg[v].info()[option] == v for v in values), [fg[v].info() for v in values]
        for rows in (slice(0, 4), slice(1, 3)):
            got, want = (fast(fg[v], ids[rows], mask[rows], eos=-1, greedy=True) for v in values)
            assert torch.equal(got.sequences, want.sequences), (kind, rows, got.sequences, want.sequences)
            n += 1
    return f"{n} rollouts equal"


def check_fast_generator_triton_equals_sdpa(device: str) -> str:
    """FastGenerator with attention='triton' decodes as with 'sdpa'."""
    return fast_generators_decode_alike(device, "attention", ("triton", "sdpa"))


def check_rope_in_attention_equals_separate_ops(device: str) -> str:
    """``decode_attention_rope`` (RoPE and the cache writes in the kernel) against the separate
    steps it replaces: the parts summed and cast, rotate_half RoPE on q and k, ``index_copy_`` of
    k and v at the column, ``decode_attention`` (the columns after the new one masked, as a decode
    step has them). Parts of the cache dtype (one) and fp32 partials (three); every split count;
    the written column equals, no other column changes. ``decode_attention_rope_pdl`` gives the
    same output and cache bit for bit, eagerly and compiled. Then FastGenerators decode with it
    (their default with either linears; with cuBLAS's: ``check_fast_generator_triton_equals_sdpa``)
    as with SDPA, with the split-K linears, and with the separate ops (``ATTENTION_ROPE`` off, as
    for Qwen3's q/k norms) too."""
    import tasks.ppo.fast_generate as fgm
    from tasks.ppo.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(2)
    pdl_op = torch.ops.rlhf.decode_attention_rope_pdl
    compiled_pdl_op = torch.compile(lambda *args: pdl_op(*args), fullgraph=True)
    n = 0
    for dtype in (torch.float32, torch.bfloat16):
        for b, n_kv, g, hd, L in CASES[:5]:
            _, kc, vc, bias = inputs(b, n_kv, g, hd, L, dtype, device, seed=3)
            col = int(torch.randint(0, L, (1,), generator=gen))
            bias[:, :, :, col] = 0.0  # the new column is visible and the ones after it are not, as the decode step makes them
            bias[:, :, :, col + 1:] = torch.finfo(dtype).min
            cos, sin = (torch.randn(b, hd, generator=gen).to(device, dtype) for _ in range(2))
            n_out = (n_kv * g + 2 * n_kv) * hd
            # multiples of 1/32 below 2: their fp32 sum is exact in any order and a bfloat16
            small = lambda p: ((torch.randn(p, b, n_out, generator=gen) * 4).round().clamp(-20, 20) / 32).to(device)  # noqa: E731
            for parts in (small(1).to(dtype), small(3)):
                y = parts.sum(0).to(dtype)
                q, k, v = y.split([n_kv * g * hd, n_kv * hd, n_kv * hd], dim=-1)
                q, k, v = q.view(b, n_kv * g, 1, hd), k.view(b, n_kv, 1, hd), v.view(b, n_kv, 1, hd)
                c, s = cos[:, None, None].float(), sin[:, None, None].float()
                q, k = (fgm._rope(t.float(), c, s).to(dtype) for t in (q, k))
                cols = torch.tensor([col], device=device)
                for splits in (0, 1, 3):
                    k_want, v_want = kc.clone().index_copy_(2, cols, k), vc.clone().index_copy_(2, cols, v)
                    want = decode_attention(q.reshape(b, n_kv, g, hd), k_want, v_want, bias, hd ** -0.5, splits)
                    k_got, v_got = kc.clone(), vc.clone()
                    got = torch.ops.rlhf.decode_attention_rope(parts, cos, sin, k_got, v_got, cols, bias, hd ** -0.5, n_kv * g, splits)
                    tol = TOL[dtype] if parts.shape[0] > 1 or dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
                    where = (b, n_kv, g, hd, L, dtype, parts.shape[0], splits)
                    torch.testing.assert_close(k_got, k_want, **tol, msg=lambda m: f"k {where}: {m}")
                    assert torch.equal(v_got, v_want), where
                    others = torch.arange(L, device=device) != col
                    assert torch.equal(k_got[:, :, others], kc[:, :, others]) and torch.equal(v_got[:, :, others], vc[:, :, others])
                    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"out {where}: {m}")
                    if splits == 0:  # its programmatic-dependent launch (CPU: a plain one), eagerly and (first case) compiled
                        for call in (pdl_op, compiled_pdl_op) if (b, n_kv, g, hd, L) == CASES[0] else (pdl_op,):
                            k_pdl, v_pdl = kc.clone(), vc.clone()
                            assert torch.equal(call(parts, cos, sin, k_pdl, v_pdl, cols, bias, hd ** -0.5, n_kv * g), got), where
                            assert torch.equal(k_pdl, k_got) and torch.equal(v_pdl, v_got), where
                    n += 1
    from tasks.ppo.fast_generate import FastGenerator
    from tests.test_fast_generate import tiny

    model = tiny("llama").to(device)
    assert [FastGenerator(model, max_batch=4, max_len=32, attention="triton", linear=lin).info()["attention_rope"]
            for lin in ("triton", "cublas")] == [True, True]
    rollouts = fast_generators_decode_alike(device, "attention", ("triton", "sdpa"), linear="triton")
    fgm.ATTENTION_ROPE = False
    try:
        assert not FastGenerator(model, max_batch=4, max_len=32, attention="triton").info()["attention_rope"]
        separate = fast_generators_decode_alike(device, "attention", ("triton", "sdpa"))
    finally:
        fgm.ATTENTION_ROPE = True
    return f"{n} steps equal, {rollouts}, {separate} (separate ops)"


def _run(check) -> str:
    """``check`` natively on CUDA, else in a fresh interpreter-mode process; its result line."""
    if DEVICE == "cuda":
        return check(DEVICE)
    module = f"tests.{Path(check.__code__.co_filename).stem}"  # the check's own test file
    code = f"from {module} import {check.__name__} as c; print('RESULT', c('cpu'))"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:]
    return lines[-1].removeprefix("RESULT ")


def test_kernel_equals_sdpa_on_ragged_rows_gqa_and_head_dims():
    assert _run(check_equals_sdpa) == f"{2 * 3 * len(CASES)} cases equal SDPA"


def test_masked_columns_contribute_nothing():
    assert _run(check_masked_columns_contribute_nothing) == f"{2 * len(CASES)} cases: masked columns contribute nothing"


def test_fast_generator_with_triton_attention_decodes_as_with_sdpa():
    assert _run(check_fast_generator_triton_equals_sdpa) == "4 rollouts equal"


# -- host-side choices (no kernel runs) ---------------------------------------------------------------
def test_split_count_fills_the_gpu_and_leaves_no_split_without_a_tile():
    from tasks.ppo.decode_attention import choose_splits, tile_columns

    assert tile_columns(64, 2) == 128 and tile_columns(128, 2) == 64 and tile_columns(64, 4) == 64  # 16 KB tiles
    assert tile_columns(80, 2) == 64 and tile_columns(8, 2) == 256 and tile_columns(256, 4) == 16
    assert choose_splits(64 * 16, 256, 132, 128) == 1  # 0.4b, batch 64: 1024 programs already, no combine
    assert choose_splits(64 * 2, 256, 132, 64) == 4  # 2 KV heads: 4 x 128 programs (5 wanted, 4 tiles)
    assert choose_splits(64 * 2, 256, 132, 128) == 2  # the same in 128-column tiles: 2 tiles
    assert choose_splits(32 * 16, 256, 132, 64) == 2  # 512 programs, 528 wanted
    assert choose_splits(4 * 2, 4096, 132, 64) == 64  # a small batch over a long cache: 66 wanted, 64 tiles
    assert choose_splits(4 * 2, 300, 132, 64) == 8  # 5 tiles (the last one partial): decode_attention runs 5
    assert choose_splits(1, 1, 132, 64) == 1


@pytest.mark.parametrize("option, library", [("attention", "sdpa"), ("linear", "cublas")])
def test_kernel_choice_names_the_value_and_the_way_out(option, library):
    from tasks.ppo.fast_generate import pick_kernel

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_kernel(option, library, cuda) == library
    assert pick_kernel(option, "triton", cuda) == "triton"  # triton is in the test extra
    assert pick_kernel(option, "auto", cuda) == "triton"  # the default: the kernel on a GPU
    assert pick_kernel(option, "auto", cpu) == library  # and the library's elsewhere, interpreter or not
    # the split-K linears only in small models, where they won (bench/RESULTS.md); the attention at any size
    assert pick_kernel(option, "auto", cuda, hidden_size=1024) == "triton"
    assert pick_kernel(option, "auto", cuda, hidden_size=1536) == ("triton" if option == "attention" else library)
    assert pick_kernel(option, "triton", cuda, hidden_size=4096) == "triton"  # asked for by name: taken at any size
    # and decoding in half precision (fp32 weights read twice the bytes: not measured)
    assert pick_kernel(option, "auto", cuda, hidden_size=1024, dtype=torch.bfloat16) == "triton"
    assert pick_kernel(option, "auto", cuda, hidden_size=1024, dtype=torch.float32) == ("triton" if option == "attention" else library)
    assert pick_kernel(option, "triton", cuda, dtype=torch.float32) == "triton"
    with pytest.raises(ValueError, match=f"{option} 'flash' is not one of"):
        pick_kernel(option, "flash", cpu)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match=rf"'triton' needs a CUDA device \(this one is cpu\).*use {option} '{library}'"):
            pick_kernel(option, "triton", cpu)


def test_triton_kernels_without_the_triton_package_are_refused_with_the_package_named():
    """Where triton is not installed (no wheel for the platform), FastGenerator(attention='triton')
    or (linear='triton') stops at construction with the package and the way out named; 'sdpa' /
    'cublas' still build and 'auto' (the default) takes them. Run in a
    process where ``import triton`` fails."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\nfrom tasks.ppo.fast_generate import KERNELS, pick_kernel\n"
            "for option, (library, _) in KERNELS.items():\n"
            "    assert pick_kernel(option, library, torch.device('cpu')) == library\n"
            "    assert pick_kernel(option, 'auto', torch.device('cuda')) == library\n"
            "    try:\n        pick_kernel(option, 'triton', torch.device('cuda'))\n"
            "    except ValueError as e:\n        print('RESULT', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for option, library in (("attention", "sdpa"), ("linear", "cublas")):
        assert f"RESULT FastGenerator: {option} 'triton' needs the triton package" in proc.stdout
        assert f"install it or use {option} '{library}'" in proc.stdout


def test_rope_and_cache_writes_in_the_attention_kernel_equal_the_separate_ops():
    assert _run(check_rope_in_attention_equals_separate_ops) == f"{2 * 5 * 2 * 3} steps equal, 4 rollouts equal, 4 rollouts equal (separate ops)"
