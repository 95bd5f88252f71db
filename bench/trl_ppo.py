"""TRL's PPO trainer (trl 1.12, ``trl.experimental.ppo``; later releases dropped it) on the same
shape, batch and lengths as bench/ppo_iteration.py, for the side-by-side samples/s.

    python bench/trl_ppo.py --shape 0.4b --batch 64 --prompt-len 128 --new-tokens 128 --iters 3 --out trl.json

One PPO epoch over the rollout in minibatches of ``--minibatch`` rows (default: the whole batch, as
ours); policy / ref / value / reward of the same Llama shape, fp32 weights with bf16 autocast
(``bf16=True``); ``--gradient-checkpointing`` where the activations do not fit. Iteration times come from
``on_step_end``; the first iteration is warm-up and is not counted.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import VOCAB, build_policy, build_scalar_model, machine, peak_gib, reset_peak, workload_args, write_json  # noqa: E402


def word_tokenizer():
    """A 32000-word tokenizer built offline (TRL needs a tokenizer for padding and ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", bos_token="w1", eos_token="w2", unk_token="w3")


def main() -> None:
    ap = workload_args(__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--minibatch", type=int, default=None, help="rows per optimizer step (TRL's num_mini_batches = batch / minibatch); "
                    "default: the whole batch")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    a = ap.parse_args()
    if a.minibatch is not None and (a.minibatch < 1 or a.batch % a.minibatch):
        ap.error(f"--minibatch {a.minibatch}: must be a positive divisor of --batch {a.batch} (TRL's num_mini_batches = batch / minibatch); "
                 f"e.g. --minibatch {next(m for m in range(min(max(a.minibatch, 1), a.batch), 0, -1) if a.batch % m == 0)}")

    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = build_policy(a.shape, device)
    ref = copy.deepcopy(policy)
    value = build_scalar_model(a.shape, device, seed=1)
    reward = build_scalar_model(a.shape, device, seed=2)
    g = torch.Generator().manual_seed(0)
    n_rows = a.batch * (a.iters + 1)
    ids = torch.randint(4, VOCAB, (n_rows, a.prompt_len), generator=g).tolist()
    import pyarrow as pa

    # a fingerprint given up front: datasets' default one pickles pyarrow types, which fails with
    # some dill / pyarrow pairs
    data = Dataset(pa.table({"input_ids": ids}), fingerprint="bench-prompts")

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize() if device == "cuda" else None
            stamps.append(time.perf_counter())

    cfg = PPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
        num_mini_batches=a.batch // (a.minibatch or a.batch), num_ppo_epochs=1, local_rollout_forward_batch_size=a.batch,
        gradient_checkpointing=a.gradient_checkpointing,
        response_length=a.new_tokens, total_episodes=n_rows, bf16=device == "cuda", report_to=[],
        save_strategy="no", num_sample_generations=0, logging_steps=10_000, stop_token=None,
        missing_eos_penalty=None, temperature=1.0, learning_rate=1e-6, dataloader_drop_last=True,
        use_cpu=device == "cpu", seed=0,
    )
    trainer = PPOTrainer(args=cfg, processing_class=word_tokenizer(), model=policy, ref_model=ref,
                         reward_model=reward, train_dataset=data, value_model=value, callbacks=[Clock()])
    reset_peak()
    t0 = time.perf_counter()
    trainer.train()
    steps = [t - s for s, t in zip([t0] + stamps[:-1], stamps)]
    timed = steps[1:] or steps
    per_iter = sorted(timed)[len(timed) // 2]
    res = {
        "machine": machine(), "trl": trl.__version__, "shape": a.shape, "batch": a.batch,
        "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "minibatch": a.minibatch or a.batch,
        "gradient_checkpointing": a.gradient_checkpointing, "iter_s_all": steps,
        "iter_s_median": per_iter, "samples_per_s": a.batch / per_iter,
        "new_tokens_per_s_end_to_end": a.batch * a.new_tokens / per_iter, "peak_gib": peak_gib(),
    }
    print(f"TRL PPO {a.shape} B={a.batch} {a.prompt_len}+{a.new_tokens}: {per_iter:.2f} s/iter, "
          f"{res['samples_per_s']:.2f} samples/s, peak {res['peak_gib']:.1f} GiB (iters {[round(s, 2) for s in steps]})")
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
