#!/usr/bin/env bash
# The GPU checks of the flow in one device call (issue 13): run from the project root on the GPU
# machine with the packages of ../shared/device/pack-flow.sh in .devcarry/ (see bench/RESULTS.md).
#   bash bench/gpu_run.sh tests default 1.5b 8b grpo   # each step writes its logs into $OUT/logs.tgz
#   bash bench/gpu_run.sh rollout match               # issue 18: realistic rollouts; the stage beside the bench
#   bash bench/gpu_run.sh attn                        # issue 18: cuDNN's SDPA backward on left-pad rows (the stage's NaN), off and on
#   bash bench/gpu_run.sh decode                      # issue 18: the split-K Triton decode attention (tests natively; 0.4B decode step beside SDPA)
#   bash bench/gpu_run.sh default triton              # issue 18: the embedded default flow, then again with ppo.decode_attention=triton
#   bash bench/gpu_run.sh mfu                         # issue 18: useful-token MFU of the learn phase on ragged rollouts, 0.4B and 1.5B
#   bash bench/gpu_run.sh parts                       # issue 18: the decode step's parts (GEMMs, attention launch settings, step variants)
#   PARTS_ARGS="--parts gemm,steps --no-autotune --steps triton,triton+tlinear,triton+tuned" bash bench/gpu_run.sh parts
#                                                     # issue 18: the split-K Triton linears (tasks/ppo/decode_linear.py) beside cuBLAS
#                                                     # (PARTS_SHAPES="0.4b 1.5b 8b" for more shapes)
#   bash bench/gpu_run.sh varlen                      # issue 18: tasks/ppo/varlen_kernel.py (tests natively; alone beside aten's flash,
#                                                     # 0.4b / 1.5b / 8b heads; the chosen settings, 64-row backward tiles, two more)
#   bash bench/gpu_run.sh mt                          # issue 18: MasterAdamW's steps (tests natively; the 0.4B epoch with either step and
#                                                     # either packed-attention kernel, interleaved, profiled)
#   bash bench/gpu_run.sh nan stage                   # issue 18: which forward turns NaN on the GPU (bench/nan_probe.py); the
#                                                     # 0.3b stage (fast and plain rollouts), stopping at the first non-finite number
# grpo = bench/grpo_iteration.py (GRPO n=8 vs PPO, 0.4B shape) and the embedded default with GRPO and the rule as reward.
# default = the README's first command (`rlhf run`, embedded default, GPU by default); 1.5b / 8b =
# bench/gpu_shapes.py's shapes through the flow; EXTRA="--set k=v ..." is added to their runs.
set -uo pipefail
FLOW_TIMEOUT_DEFAULT=540; source "$(dirname "$0")/gpu_common.sh"   # bundle, /tmp/site, gpumon, flow
export PYTHONPATH=/tmp/site:$PWD
for step in "$@"; do
  echo "== $step"
  case $step in
    tests) timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -m "not slow" --durations=12 tests/test_placement.py tests/test_memory.py \
             tests/test_chat_models.py tests/test_fast_generate.py tests/test_attention_backward.py tests/test_decode_attention.py tests/test_decode_linear.py tests/test_varlen.py > "$OUT/tests.log" 2>&1; tail -6 "$OUT/tests.log" ;;
    default) rm -rf /tmp/art-default; flow default --set store.uri=file:///tmp/art-default
             python3 bench/gpu_summary.py /tmp/art-default "$OUT/gpu_default.csv" > "$OUT/summary_default.json"; cat "$OUT/summary_default.json" ;;
    triton)  # the embedded default with ppo.decode_attention=triton; its data / SFT / RM from `default` when that ran first
             rm -rf /tmp/art-triton; mkdir -p /tmp/art-triton; for d in /tmp/art-default/*; do [ "$(basename "$d")" = ppo ] || cp -r "$d" /tmp/art-triton/; done 2>/dev/null
             flow triton --set store.uri=file:///tmp/art-triton --set ppo.decode_attention=triton ${EXTRA:-}
             python3 bench/gpu_summary.py /tmp/art-triton "$OUT/gpu_triton.csv" > "$OUT/summary_triton.json"; cat "$OUT/summary_triton.json" ;;
    1.5b|8b) [ -f /tmp/s-$step/rlhf.yaml ] || python3 bench/gpu_shapes.py --shape "$step" --out /tmp/s-$step > "$OUT/shape_$step.log" 2>&1
             flow "$step" --config /tmp/s-$step/rlhf.yaml ${EXTRA:-}
             python3 bench/gpu_summary.py /tmp/s-$step/artifacts "$OUT/gpu_$step.csv" > "$OUT/summary_$step.json"; cat "$OUT/summary_$step.json" ;;
    nan) timeout 240 python3 bench/nan_probe.py --out "$OUT/nan_probe.json" > "$OUT/nan_probe.log" 2>&1; grep -E "^(critic|actor) " "$OUT/nan_probe.log" ;;
    stage) timeout 400 python3 bench/ppo_stage_gpu.py --runs ${STAGE_RUNS:-0.3b,0.3b-plain} ${STAGE_ITERS:+--iters $STAGE_ITERS} --out "$OUT/ppo_stage_gpu.json" > "$OUT/stage.log" 2>&1
           grep -E "FloatingPointError|not finite|gradient norm|loss is|anomaly|Error detected in|returned nan" "$OUT/stage.log" | cut -c1-1200 | sort | uniq -c | head; tail -8 "$OUT/stage.log" ;;
    attn) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_attention_backward.py > "$OUT/attn_test.log" 2>&1; tail -3 "$OUT/attn_test.log"
          timeout 120 python3 bench/cudnn_attention_nan.py --out "$OUT/cudnn_attention_nan.json" > "$OUT/cudnn_attention_nan.log" 2>&1; tail -13 "$OUT/cudnn_attention_nan.log" ;;
    parts) for sh in ${PARTS_SHAPES:-0.4b}; do timeout ${PARTS_TIMEOUT:-420} python3 bench/decode_parts.py --shape "$sh" ${PARTS_ARGS:-} \
             --out "$OUT/decode_parts_$sh.json" > "$OUT/decode_parts_$sh.log" 2>&1; grep -vE "^ +[0-9]" "$OUT/decode_parts_$sh.log" | tail -40; done ;;
    mfu) for sh in ${MFU_SHAPES:-0.4b 1.5b}; do timeout 280 python3 bench/useful_mfu.py --shape "$sh" ${MFU_ARGS:---profile} --out "$OUT/useful_mfu_$sh.json" > "$OUT/mfu_$sh.log" 2>&1
           tail -14 "$OUT/mfu_$sh.log"; done ;;
    varlen) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_varlen.py > "$OUT/varlen_test.log" 2>&1; tail -3 "$OUT/varlen_test.log"
            timeout 150 python3 bench/varlen_attention.py --settings ${VARLEN_SETTINGS:-0,0,0,0,0,0,0,0,0,64,0,0,128,64,8,0,0,3,0,0,0,0,4,0} --out "$OUT/varlen_attention.json" > "$OUT/varlen_attention.log" 2>&1; tail -18 "$OUT/varlen_attention.log" ;;
    mt) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_optim.py > "$OUT/optim_test.log" 2>&1; tail -3 "$OUT/optim_test.log"
        # the 0.4B epoch with each master step and packed-attention kernel, their epochs in turn (the machine's speed drifts)
        timeout 240 python3 bench/useful_mfu.py --shape 0.4b --minibatch 64 --weights bf16 --master-step triton \
          --variants packed1024,packed1024-tvarlen,packed1024-mt,packed1024-tvarlen-mt --interleave --reps 16 --profile \
          --profile-variants packed1024,packed1024-tvarlen,packed1024-mt --profile-top 25 --out "$OUT/useful_mfu_interleaved.json" > "$OUT/mfu_interleaved.log" 2>&1
        grep -v "^ \{5,\}[0-9]" "$OUT/mfu_interleaved.log" | tail -14 ;;
    decode) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py > "$OUT/decode_test.log" 2>&1; tail -3 "$OUT/decode_test.log"
            timeout 300 python3 bench/ppo_iteration.py --shape 0.4b --attention sdpa,triton --skip-rollout-baselines --skip-eager-learn \
              --out "$OUT/decode_attention_0.4b.json" > "$OUT/decode_attention.log" 2>&1; grep -E "^attention|decode step|Error" "$OUT/decode_attention.log" | head ;;
    rollout) for sh in ${ROLLOUT_SHAPES:-0.4b}; do timeout 300 python3 bench/rollout_realistic.py --shape "$sh" --attention ${ROLLOUT_ATTENTION:-sdpa,triton} ${ROLLOUT_ARGS:-} \
               --out "$OUT/rollout_realistic_$sh.json" > "$OUT/rollout_$sh.log" 2>&1; tail -12 "$OUT/rollout_$sh.log"; done ;;
    match)  # issue 18: the PPO stage and the in-process iteration on one workload (bench/ppo_stage_gpu.py's 0.3b run; both bf16 learners)
            timeout 240 python3 bench/ppo_iteration.py --batch 64 --prompt-len 11 --new-tokens 64 --vocab 512 --lora-actor 32 \
              --epochs 2 --minibatch 16 --pack-tokens 1024 --weights bf16 --skip-rollout-baselines --skip-eager-learn --out "$OUT/ppo_iteration_match.json" > "$OUT/match_iteration.log" 2>&1
            tail -4 "$OUT/match_iteration.log"
            timeout 330 python3 bench/ppo_stage_gpu.py --runs 0.3b --iters 8 --pack-tokens 1024 --out "$OUT/ppo_stage_gpu.json" > "$OUT/match_stage.log" 2>&1; tail -8 "$OUT/match_stage.log" ;;
    grpo) timeout 500 python3 bench/grpo_iteration.py --shape 0.4b --batch 64 --prompt-len 128 --new-tokens 128 --n 8 \
            --out "$OUT/grpo_iteration.json" > "$OUT/grpo_iteration.log" 2>&1; tail -4 "$OUT/grpo_iteration.log"
          rm -rf /tmp/art-grpo; flow grpo_default --set store.uri=file:///tmp/art-grpo --set ppo.advantage=grpo \
            --set ppo.n_samples_per_prompt=8 --set "ppo.rewards=[{kind: function, function: 'tasks.common.builtin:sentiment_reward'}]" ;;
  esac
  bundle
done
