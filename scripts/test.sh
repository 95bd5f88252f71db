#!/usr/bin/env bash
# The test command (README): the whole suite, slow end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
