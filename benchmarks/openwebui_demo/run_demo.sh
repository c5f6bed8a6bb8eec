#!/usr/bin/env bash
# Open-WebUI in front of the tutel-jax server, end to end, in a headless Chromium:
#   1. builds the chat checkpoint (tests/fixtures/make_chat_checkpoint.py: the qwen3_moe fixture + a tokenizer
#      and a ChatML template),
#   2. starts the tutel-jax server on it, the recording proxy (record_proxy.py) in front of it, and Open-WebUI
#      pointed at the proxy (no login, no Ollama, offline),
#   3. chats once in the browser (browser_chat.py): screenshot of the streamed answer,
#   4. writes the recorded requests as the replay fixture (record_proxy.py reduce).
# Everything it started is stopped at the end.
#
#   benchmarks/openwebui_demo/run_demo.sh [--install]
#
# --install first creates the Open-WebUI environment (its own venv, never the project's):
#   python3 -m venv $OWUI_VENV; pip install "torch==2.13.0+cpu" (a CPU build first, else open-webui's
#   dependencies pull a multi-GB CUDA one); pip install open-webui playwright
# The browser is the system's Chromium (Debian: apt-get install chromium); `playwright install` is not needed.
#
# Settings (environment variables; defaults in brackets):
#   OWUI_VENV     the Open-WebUI environment [/tmp/owui-venv]
#   PYTHON        the project's Python (with the `serve` extra and httpx) [.venv/bin/python, else python3]
#   WORK          scratch folder: checkpoint, Open-WebUI data, logs [/tmp/owui-demo]
#   SERVER_PORT, PROXY_PORT, WEBUI_PORT   [8011, 8012, 8080]
#   MODEL_NAME    the model id the server serves [tutel-jax-chat]
#   MAX_TOKENS    the server's --max-tokens; Open-WebUI's title generation asks for max_tokens 1000 [1024]
#   SCREENSHOT    [docs/images/openwebui_chat.png]
#   RECORDING     [tests/fixtures/openwebui_requests.json]
#   CHROMIUM      [/usr/bin/chromium]
#   MESSAGE       what is typed into the chat ["Hello! Who are you?"]
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"

OWUI_VENV=${OWUI_VENV:-/tmp/owui-venv}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WORK=${WORK:-/tmp/owui-demo}
SERVER_PORT=${SERVER_PORT:-8011}
PROXY_PORT=${PROXY_PORT:-8012}
WEBUI_PORT=${WEBUI_PORT:-8080}
MODEL_NAME=${MODEL_NAME:-tutel-jax-chat}
MAX_TOKENS=${MAX_TOKENS:-1024}
SCREENSHOT=${SCREENSHOT:-docs/images/openwebui_chat.png}
RECORDING=${RECORDING:-tests/fixtures/openwebui_requests.json}
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
MESSAGE=${MESSAGE:-Hello! Who are you?}

if [[ "${1:-}" == "--install" ]]; then
  python3 -m venv "$OWUI_VENV"
  "$OWUI_VENV/bin/pip" install -q "torch==2.13.0+cpu" || "$OWUI_VENV/bin/pip" install -q "torch==2.13.0"
  "$OWUI_VENV/bin/pip" install -q open-webui playwright
fi
[[ -x "$OWUI_VENV/bin/open-webui" ]] || { echo "no open-webui in $OWUI_VENV (run with --install)" >&2; exit 2; }
[[ -x "$CHROMIUM" ]] || { echo "no Chromium at $CHROMIUM (apt-get install chromium)" >&2; exit 2; }

rm -rf "$WORK/ckpt" "$WORK/data" "$WORK/requests.jsonl"
mkdir -p "$WORK"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

wait_http() {  # URL SECONDS NAME LOG
  local deadline=$((SECONDS + $2))
  until curl -sf -o /dev/null "$1"; do
    if ((SECONDS > deadline)); then echo "$3 did not come up; the end of $4:" >&2; tail -30 "$4" >&2; exit 1; fi
    sleep 1
  done
}

echo "== checkpoint"
"$PYTHON" tests/fixtures/make_chat_checkpoint.py "$WORK/ckpt"

echo "== tutel-jax server on :$SERVER_PORT"
JAX_PLATFORMS=cpu PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m tutel_jax.serving.server "$WORK/ckpt" \
  --host 127.0.0.1 --port "$SERVER_PORT" --served-model-name "$MODEL_NAME" --max-tokens "$MAX_TOKENS" \
  > "$WORK/server.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$SERVER_PORT/health" 180 server "$WORK/server.log"

echo "== recording proxy on :$PROXY_PORT"
"$PYTHON" benchmarks/openwebui_demo/record_proxy.py serve --upstream "http://127.0.0.1:$SERVER_PORT" \
  --port "$PROXY_PORT" --log "$WORK/requests.jsonl" > "$WORK/proxy.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$PROXY_PORT/health" 60 proxy "$WORK/proxy.log"
rm -f "$WORK/requests.jsonl"  # the proxy's health check is not part of the recording

echo "== Open-WebUI on :$WEBUI_PORT (the first start takes a minute or more)"
# no login, no Ollama, nothing fetched from the internet (no version check, no embedding-model download,
# no telemetry); the one OpenAI-style connection is the proxy
(cd "$WORK" && exec env DATA_DIR="$WORK/data" WEBUI_AUTH=False WEBUI_SECRET_KEY=tutel-jax-demo \
  ENABLE_OLLAMA_API=False ENABLE_OPENAI_API=True \
  OPENAI_API_BASE_URL="http://127.0.0.1:$PROXY_PORT/v1" OPENAI_API_KEY=none \
  OFFLINE_MODE=true HF_HUB_OFFLINE=1 ENABLE_VERSION_UPDATE_CHECK=false \
  RAG_EMBEDDING_MODEL="" RAG_EMBEDDING_MODEL_AUTO_UPDATE=False RAG_RERANKING_MODEL_AUTO_UPDATE=False \
  ANONYMIZED_TELEMETRY=False DO_NOT_TRACK=true SCARF_NO_ANALYTICS=true \
  "$OWUI_VENV/bin/open-webui" serve --host 127.0.0.1 --port "$WEBUI_PORT") > "$WORK/openwebui.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$WEBUI_PORT/health" 300 Open-WebUI "$WORK/openwebui.log"

echo "== chat in headless Chromium"
"$OWUI_VENV/bin/python" benchmarks/openwebui_demo/browser_chat.py --url "http://127.0.0.1:$WEBUI_PORT" \
  --model "$MODEL_NAME" --message "$MESSAGE" --out "$SCREENSHOT" --chromium "$CHROMIUM" \
  --wait-log "$WORK/requests.jsonl" --wait-posts 4

echo "== recording -> $RECORDING"
version=$("$OWUI_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("open-webui"))')
"$PYTHON" benchmarks/openwebui_demo/record_proxy.py reduce "$WORK/requests.jsonl" "$RECORDING" --source \
  "Open-WebUI $version (pip, Python $("$OWUI_VENV/bin/python" -c 'import sys; print(sys.version.split()[0])')), \
recorded $(date -u +%Y-%m-%d) by benchmarks/openwebui_demo/run_demo.sh: Open-WebUI pointed at the tutel-jax server \
(model $MODEL_NAME, --max-tokens $MAX_TOKENS) through record_proxy.py, one message sent in headless Chromium. \
In the order sent: the model listing, the chat (streamed) and Open-WebUI's task completions (title, follow-ups, \
tags). Headers: content-type and accept only; recorded_status is what the server answered then."
"$PYTHON" - "$RECORDING" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["requests"]:
    b = r["body"] or {}
    print(r["recorded_status"], r["method"], r["path"], {k: v for k, v in b.items() if k not in ("messages", "tools")})
EOF
echo "done: $SCREENSHOT, $RECORDING (logs in $WORK)"
