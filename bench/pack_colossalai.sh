#!/usr/bin/env bash
# Packs ColossalAI's import closure (tasks/ppo/group.py COLOSSALAI_DISTRIBUTIONS) for the GPU
# machine, which has no package registry, into one small xz tarball beside the flow pack:
#
#   bench/pack_colossalai.sh .devcarry/colossalai.tar.xz      # from the project root, after scripts/setup.sh
#
# Then bench/gpu_colossalai.sh runs with it there (carry .devcarry). What goes in: colossalai 0.5.0
# and contexttimer (sdists only on the index: built into pure-python wheels here), galore-torch,
# bitsandbytes with only the native libraries for CUDA_TAG (default 130: the GPU image's torch is
# 2.11.0+cu130) and the CPU one: its wheel holds one per CUDA version (129 MB unpacked). einops
# and ninja are already in the GPU image, so they are left out (EINOPS=1 packs them). All --no-deps: torch,
# transformers, peft, numpy there are the image's own. Python 3.12 / Linux x86-64 (the GPU
# machine's, see ../shared/device/pack-flow.sh).
set -euo pipefail
out=$1
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
cuda=${CUDA_TAG:-130}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
reqs=$(PYTHONPATH=$PWD "$PY" -c "
from tasks.ppo.group import COLOSSALAI_DISTRIBUTIONS as d
print(' '.join(v for k, v in d.items() if k not in ('einops', 'ninja') or '${EINOPS:-0}' == '1'))")
echo "pack-colossalai: $reqs (bitsandbytes: cuda$cuda + cpu libraries only)"
pure=() binary=()
for r in $reqs; do case $r in colossalai==*|contexttimer==*) pure+=("$r") ;; *) binary+=("$r") ;; esac; done
# sdists -> wheels with no compiled part (colossalai builds its CUDA kernels at first use, on the GPU)
python3 -m pip wheel -q --no-deps -w "$work/whl" "${pure[@]}" 2> >(grep -v '^WARNING: Location' >&2)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$work/whl" "${binary[@]}" 2> >(grep -v '^WARNING: Location' >&2)
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do (cd "$work/site" && unzip -qo "$w"); done
have=$(ls "$work"/site/bitsandbytes/libbitsandbytes_cuda"$cuda".so)   # fails loudly when that CUDA is not in the wheel
find "$work/site/bitsandbytes" -maxdepth 1 -name 'libbitsandbytes_*.so' ! -name "$(basename "$have")" ! -name libbitsandbytes_cpu.so -delete
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
ls "$work/site" | sed 's/^/pack-colossalai:   /'
mkdir -p "$(dirname "$out")"
tar -C "$work/site" -cJf "$out" .
ls -la "$out"
