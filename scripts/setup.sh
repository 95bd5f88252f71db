#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv. Idempotent.
#   scripts/setup.sh               # CPU torch where there is no NVIDIA GPU, CUDA torch where there is
#   scripts/setup.sh --colossalai  # also the optional ColossalAI strategies (CUDA machines; see README)
# TORCH_SPEC overrides the torch requirement; TORCH_INDEX_URL points pip at a torch index
# (e.g. https://download.pytorch.org/whl/cpu on a laptop, to skip the multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    spec=${TORCH_SPEC:-torch>=2.11}
  else
    spec=${TORCH_SPEC:-torch==2.13.0}   # the CPU build where one lies on disk / on the index given
  fi
  echo "setup: installing $spec"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then pip install "$spec" --index-url "$TORCH_INDEX_URL"; else pip install "$spec"; fi
fi
echo "setup: installing the project and its test tools"
pip install -e ".[test]"
if [ "${1:-}" = "--colossalai" ]; then
  # ColossalAI 0.5.0 pins torch<=2.5.1, transformers==4.51.3, peft<=0.13.2: its import closure
  # (tasks/ppo/group.py COLOSSALAI_DISTRIBUTIONS, every dependency of which is already here) goes
  # in with --no-deps, so this environment's pins stay; then the exact imports the strategy runs.
  reqs=$(.venv/bin/python -c "from tasks.ppo.group import COLOSSALAI_DISTRIBUTIONS as d; print(' '.join(d.values()))")
  echo "setup: installing (--no-deps) $reqs"
  pip install --no-deps $reqs
  .venv/bin/python -c "
import sys
from tasks.ppo.group import colossalai_imports, colossalai_problem, import_failure
if f := import_failure(colossalai_imports()):
    sys.exit('setup: ' + colossalai_problem('colossalai_zero2', f))
print('setup: ColossalAI imports ok:', ', '.join(f'{m}.{n}' if n else m for m, n in colossalai_imports()))"
fi
.venv/bin/python -c "import torch, ray, prefect, peft, transformers; print('setup: ok  torch', torch.__version__, '| ray', ray.__version__, '| prefect', prefect.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"
