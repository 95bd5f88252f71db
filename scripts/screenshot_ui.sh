#!/usr/bin/env bash
# Screenshots of what a user looks at after `rlhf run`, the way a user sees them: headless Chromium
# on the Prefect UI's page of the PPO card (curves, samples table) and on TensorBoard's scalars.
#
#   scripts/screenshot_ui.sh [OUT_DIR]      # default docs/; writes prefect-ppo-artifact.png, tensorboard-ppo.png
#
# Starts its own Prefect server (UI on) and TensorBoard on 127.0.0.1, runs a short pipeline into
# a temporary store, and stops everything it started. Needs chromium (apt-get install -y chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs}
PY=${PY:-.venv/bin/python}
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome)}
WORK=$(mktemp -d /tmp/rlhf-shot-XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 300); do curl -sf "$1" >/dev/null && return 0; sleep 0.3; done; echo "no answer from $1" >&2; return 1; }
shoot() {  # URL PNG WIDTH HEIGHT: the UIs are JS apps, so give them virtual time to fetch and render
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
    --window-size="$3,$4" --virtual-time-budget=20000 --screenshot="$2" "$1" 2>"$WORK/chromium.log"
  echo "screenshot: $2 ($1)"
}

export PREFECT_HOME=$WORK/prefect RLHF_CACHE=$WORK/cache RAY_TMPDIR=$WORK PREFECT_SERVER_ANALYTICS_ENABLED=false
P=$(port)
# The UI asks the API at PREFECT_UI_API_URL, which defaults to port 4200 whatever --port says.
PREFECT_UI_API_URL=http://127.0.0.1:$P/api "$PY" -m prefect server start --host 127.0.0.1 --port "$P" >"$WORK/prefect.log" 2>&1 &
PIDS+=($!)
export PREFECT_API_URL=http://127.0.0.1:$P/api
wait_http "$PREFECT_API_URL/health"

STORE=file://$WORK/store
"$PY" -m flows.cli run --set store.uri="$STORE" --set ppo.num_iterations=20 --set ppo.eval_every=5 >"$WORK/run.log" 2>&1 \
  || { tail -40 "$WORK/run.log"; exit 1; }
tail -5 "$WORK/run.log"

ARTIFACT=$("$PY" - <<'EOF'
import json, os, urllib.request
req = urllib.request.Request(os.environ["PREFECT_API_URL"] + "/artifacts/filter", method="POST",
                             data=json.dumps({"artifacts": {"key": {"any_": ["rlhf-ppo"]}}, "sort": "CREATED_DESC", "limit": 1}).encode(),
                             headers={"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req))[0]["id"])
EOF
)
mkdir -p "$OUT"
shoot "http://127.0.0.1:$P/artifacts/artifact/$ARTIFACT" "$OUT/prefect-ppo-artifact.png" 1600 1500

T=$(port)
"$PY" -m tensorboard.main --logdir "$WORK/store/ppo" --host 127.0.0.1 --port "$T" >"$WORK/tensorboard.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$T/"
shoot "http://127.0.0.1:$T/?darkMode=false#scalars&_ignoreYOutliers=false&tagFilter=ppo%2F(reward_mean%7Ckl%7Cresponse_length)" \
  "$OUT/tensorboard-ppo.png" 1400 1100
