"""tasks/ppo/decode_linear.py (the split-K skinny GEMM of the decode step) against the matmul.

As tests/test_decode_attention.py: natively on CUDA, else in a fresh process in Triton's
interpreter (``_run``), one result line asserted on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.test_decode_attention import _run, fast_generators_decode_alike

# (M, K, N): the decode batch from one row to 64, K and N off the tiles (a partial K step, a
# partial column tile), the 0.4b layer's shapes scaled down
CASES = [(1, 128, 16), (5, 300, 70), (33, 1024, 48), (64, 256, 96), (64, 352, 200), (8, 200, 1000)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def check_equals_matmul(device: str) -> str:
    """Every case in fp32 and bf16, with the kernel's own (block_n, splits) and forced ones (one
    split, more splits than K steps would give, 16-column tiles): the partials sum to x @ w.T, and
    fast_generate's ``_linear`` (the sum, the bias, the cast) equals F.linear."""
    import tasks.ppo.decode_linear as dl
    from tasks.ppo.fast_generate import Dims, _linear

    d = Dims(1, 1, 16, 1.0, 1e-6, "sdpa", "triton")
    g = torch.Generator().manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.bfloat16):
        for M, K, N in CASES:
            x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * K ** -0.5, torch.randn(N, generator=g)
            x, w, b = x.to(device, dtype), w.to(device, dtype), b.to(device, dtype)
            want = x.float() @ w.float().T
            # the rule's, forced (block_n, splits), and measured (block_n, splits, block_k, stages) for this shape
            for config, tuned in ((None, {}), ((32, 1), {}), ((16, 64), {}), (None, {(N, K): (64, 3, 64, 2)})):
                dl.CONFIG, dl.TUNED = config, tuned
                try:
                    p = dl.decode_linear_partials(x, w)
                    got = _linear(x[:, None], w, b, d, decode=True)[:, 0]
                finally:
                    dl.CONFIG, dl.TUNED = None, {}
                assert p.dtype == torch.float32 and p.shape[1:] == (M, N), (p.shape, M, N)
                torch.testing.assert_close(p.sum(0), want, **TOL[dtype], msg=lambda m: f"{(M, K, N, dtype, config, tuned)}: {m}")
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), **TOL[dtype],
                                           msg=lambda m: f"_linear {(M, K, N, dtype, config, tuned)}: {m}")
                n += 1
    return f"{n} products equal"


def check_fast_generator_triton_linear_equals_cublas(device: str) -> str:
    """FastGenerator with linear='triton' decodes as with 'cublas' (the prefill runs F.linear
    either way)."""
    return fast_generators_decode_alike(device, "linear", ("triton", "cublas"))


def check_pdl_launch_equals_plain(device: str) -> str:
    """``decode_linear_partials_pdl`` (a programmatic dependent launch that prefetches its weight
    slice into the L2 before waiting on the kernel before it; on CPU a plain launch) gives the
    plain op's partials bit for bit: eagerly, under torch.compile (its fake's shape) and, on CUDA,
    as a chain of dependent launches replayed from a CUDA graph."""
    import tasks.ppo.decode_linear as dl

    g = torch.Generator().manual_seed(0)
    n = 0
    for M, K, N in CASES[2:4]:
        x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
        w1 = torch.randn(N, K, generator=g).to(device, torch.bfloat16) * 0.05  # K -> N
        w2 = torch.randn(K, N, generator=g).to(device, torch.bfloat16) * 0.05  # N -> K

        def chain(op):  # two linears, the second reading the first's product (dependent launches)
            h = op(x, w1).sum(0).relu().to(x.dtype)
            return op(h, w2)

        want = chain(torch.ops.rlhf.decode_linear_partials)
        assert torch.equal(chain(torch.ops.rlhf.decode_linear_partials_pdl), want)
        compiled = torch.compile(chain, fullgraph=True)
        assert torch.equal(compiled(torch.ops.rlhf.decode_linear_partials_pdl), want)
        if device == "cuda":
            compiled(torch.ops.rlhf.decode_linear_partials_pdl)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = compiled(torch.ops.rlhf.decode_linear_partials_pdl)
            for _ in range(3):
                out.zero_()
                graph.replay()
                assert torch.equal(out, want)
        n += 1
    assert dl.INTERPRETED or device == "cuda", "the interpreter runs the CPU checks"
    return f"{n} chains equal"


def test_partials_sum_to_the_matmul_at_every_split():
    assert _run(check_equals_matmul) == f"{2 * 4 * len(CASES)} products equal"


def test_fast_generator_with_triton_linears_decodes_as_with_cublas():
    assert _run(check_fast_generator_triton_linear_equals_cublas) == "4 rollouts equal"


def test_tiles_and_splits_keep_every_split_a_whole_k_step():
    """The launch choice (host side): programs up to ``PROGRAMS_PER_SM`` an SM, never a split
    shorter than one K step, partials within a quarter of the weight's bytes, 64-column tiles only
    where they alone fill the GPU."""
    from tasks.ppo.decode_linear import BLOCK_K, MAX_ROWS, MAX_SPLITS, PROGRAMS_PER_SM, choose

    sms = 132
    # the 0.4b layer (qkv, o, gate/up, down), an 8B-class one, the LM head, a tiny model
    for n, k in [(3072, 1024), (1024, 1024), (5632, 1024), (1024, 2816), (6144, 4096), (28672, 4096), (4096, 14336),
                 (32000, 1024), (16, 64), (256, 65536)]:
        block_n, splits = choose(n, k, sms)
        tiles = -(-n // block_n)
        assert block_n == (64 if -(-n // 64) >= sms else 32), (n, k, block_n)
        assert splits == 1 or (splits <= MAX_SPLITS and tiles * splits <= PROGRAMS_PER_SM * sms and -(-k // splits) >= BLOCK_K
                               and splits * MAX_ROWS * 4 * 4 <= k * 2), (n, k, splits)
        more = 2 * splits  # no more split fits
        assert more > MAX_SPLITS or tiles * more > PROGRAMS_PER_SM * sms or -(-k // more) < BLOCK_K or more * MAX_ROWS * 4 * 4 > k * 2, (n, k, splits)
    assert choose(1024, 2816, sms) == (32, 4)  # 0.4b down: 32 column tiles x 4 splits of 704 (partials 1 MB, weight 5.8)
    assert choose(3072, 1024, sms) == (32, 2)  # 0.4b q/k/v
    assert choose(32000, 1024, sms) == (64, 1)  # the head: 500 tiles already


def test_measured_settings_come_before_the_rule_and_a_forced_config_before_both():
    import tasks.ppo.decode_linear as dl

    assert dl.settings(1024, 2816, 132) == (32, 4, dl.BLOCK_K, dl.NUM_STAGES)
    try:
        dl.TUNED = {(1024, 2816): (128, 2, 64, 3)}
        assert dl.settings(1024, 2816, 132) == (128, 2, 64, 3)
        assert dl.settings(3072, 1024, 132) == (32, 2, dl.BLOCK_K, dl.NUM_STAGES)  # another shape: the rule
        dl.CONFIG = (64, 1)
        assert dl.settings(1024, 2816, 132) == (64, 1, dl.BLOCK_K, dl.NUM_STAGES)
    finally:
        dl.TUNED, dl.CONFIG = {}, None


def test_prefill_and_batches_past_64_rows_take_f_linear():
    """Only a decode step of at most 64 rows goes to the kernel: a prefill, or a decode of 65
    rows, is F.linear's result bit for bit (here without Triton's interpreter, where the kernel
    could not run on CPU at all)."""
    from tasks.ppo.fast_generate import Dims, _linear

    d = Dims(1, 1, 16, 1.0, 1e-6, "sdpa", "triton")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    for x, decode in ((torch.randn(65, 1, 32, generator=g), True), (torch.randn(2, 40, 32, generator=g), False),
                      (torch.randn(4, 3, 32, generator=g), False)):
        assert torch.equal(_linear(x, w, b, d, decode), F.linear(x, w, b)), (x.shape, decode)


def test_programmatic_dependent_launch_gives_the_plain_partials():
    assert _run(check_pdl_launch_equals_plain) == "2 chains equal"
