#!/usr/bin/env bash
# ColossalAI's PPO strategies on the GPU machine (issue 19), from the project root there, with
#   .devcarry/flow-lean.tar.xz    ../shared/device/pack-flow.sh (prefect, ray, ... for the flow)
#   .devcarry/colossalai.tar.xz   bench/pack_colossalai.sh (colossalai 0.5.0 + galore-torch + bitsandbytes
#                                 with the cuda130 library only + contexttimer; about 4 MB)
# both in the run's carry (`carry: [".devcarry"]`). Steps, each writing its logs into $OUT/logs.tgz:
#   bash bench/gpu_colossalai.sh probe zero2      # one device call (kernel builds + one flow run: ~5 min)
#   bash bench/gpu_colossalai.sh gemini ddp       # a second call: Gemini and the DDP baseline beside it
#   bash bench/gpu_colossalai.sh resume_zero2     # kill -9 after the first checkpoint, rerun, compare with `zero2`
# probe = bench/colossalai_probe.py (imports, launch, kernel build, 3 steps, full_state, rollout per plugin);
# zero2 / gemini / ddp = `rlhf run` on the built-in model with ppo.strategy colossalai_zero2 /
# colossalai_gemini / ddp, its own store each, summarised by bench/gpu_summary.py (samples/s, memory).
# EXTRA="--set k=v ..." is added to the flow runs (e.g. the 0.3B model's config).
set -uo pipefail
FLOW_TIMEOUT_DEFAULT=420; source "$(dirname "$0")/gpu_common.sh"   # bundle, /tmp/site, gpumon, flow
[ -d /tmp/site-colossalai/colossalai ] || { mkdir -p /tmp/site-colossalai && tar -C /tmp/site-colossalai -xJf .devcarry/colossalai.tar.xz; }
# the ColossalAI site last: it also holds a top-level package named `extensions` (colossalai's wheel ships one)
export PYTHONPATH=/tmp/site:$PWD:/tmp/site-colossalai
# HybridAdam's kernels are JIT-built at first use (torch.utils.cpp_extension + ninja + nvcc): Hopper only, all cores
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
# ... into ~/.cache/colossalai; the probe sends that folder back (colossalai-kernels.tar.xz, 3.8 MB; 9.4 MB as .tgz, too much
# beside the flow's packages) for later calls to carry. The
# whole folder: with the .so files alone, ninja rebuilt them in the role processes (cpu_adam 37.9 s, seen 2026-12-03)
KERNELS=.devcarry/colossalai-kernels.tar.xz
if [ -f $KERNELS ]; then tar -C ~ -xJf $KERNELS && echo "kernels: carried"; else KERNELS=; fi
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__)"
python3 -m pip list 2>/dev/null | grep -iE "^(colossalai|bitsandbytes|galore|einops|contexttimer) " ; nvcc --version | tail -2
strategy_of() { case $1 in zero2) echo colossalai_zero2 ;; gemini) echo colossalai_gemini ;; *) echo "$1" ;; esac; }
adapter_sha() {  # the final PPO adapter's sha256 from its manifest
  python3 -c "import json, glob; m = [json.load(open(p)) for p in glob.glob('$1/ppo/*/MANIFEST.json')]; m = [x for x in m if x['kind'] == 'ppo_actor']; print(m[0]['files']['adapter/adapter_model.safetensors']['sha256'] if m else 'no ppo_actor')"
}
seed_store() {  # a new store starts with the first run's data, SFT and RM (the strategy changes only PPO's key): runs after the first time only PPO
  local base; base=$(ls -d /tmp/art-{zero2,gemini,ddp} 2>/dev/null | grep -v "^$1\$" | head -1)
  [ -n "$base" ] && [ -d "$base/rm" ] && { mkdir -p "$1"; for d in "$base"/*; do [ "$(basename "$d")" = ppo ] || cp -r "$d" "$1/"; done; }
  return 0
}
for step in "$@"; do
  echo "== $step $(date +%T)"
  case $step in
    probe) timeout "${PROBE_TIMEOUT:-480}" python3 bench/colossalai_probe.py --out "$OUT/probe.json" > "$OUT/probe.log" 2>&1; echo "rc=$?"
           grep -E "^probe:|^\{" "$OUT/probe.log" | cut -c1-1500
           [ -n "$KERNELS" ] || [ ! -d ~/.cache/colossalai ] || tar -C ~ -cJf "$DEST/colossalai-kernels.tar.xz" .cache/colossalai ;;
    zero2|gemini|ddp) rm -rf "/tmp/art-$step"; seed_store "/tmp/art-$step"
           flow "$step" --set store.uri="file:///tmp/art-$step" --set ppo.strategy="$(strategy_of "$step")" ${EXTRA:-}
           python3 bench/gpu_summary.py "/tmp/art-$step" "$OUT/gpu_$step.csv" > "$OUT/summary_$step.json"; cat "$OUT/summary_$step.json" ;;
    resume_zero2|resume_gemini) s=${step#resume_}; store=/tmp/art-$step; rm -rf "$store"
           seed_store "$store"; args=(--set store.uri="file://$store" --set ppo.strategy="$(strategy_of "$s")")
           setsid python3 -m flows.cli run "${args[@]}" ${EXTRA:-} > "$OUT/run_${step}_killed.log" 2>&1 & pid=$!
           for _ in $(seq 300); do compgen -G "$store/ppo/*-ckpt/iter-*/MANIFEST.json" > /dev/null && break; sleep 1; done
           kill -9 -- -"$pid" 2>/dev/null; wait "$pid" 2>/dev/null
           echo "killed after checkpoint(s): $(ls -d "$store"/ppo/*-ckpt/iter-* 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
           flow "$step" "${args[@]}" ${EXTRA:-}; grep -iE "resum" "$OUT/run_$step.log" | head -3
           echo "adapter sha resumed:       $(adapter_sha "$store")"
           echo "adapter sha uninterrupted: $(adapter_sha "/tmp/art-$s") (step $s in the same call, if it ran)" ;;
    *) echo "unknown step $step (probe zero2 gemini ddp resume_zero2 resume_gemini)" ;;
  esac
  bundle
done
