#!/usr/bin/env bash
# The main job: builds Hilum, installs on first use what it needs, and analyses a radiograph.
#   scripts/run.sh [IMAGE] [QUESTION]
# Model choice: $HILUM_LLM if set; else GPT-4o when OPENAI_API_KEY is set; else the local model
# when installed; else a scripted demo turn list (it says so).
set -euo pipefail
cd "$(dirname "$0")/.."
image=${1:-../shared/data/cxr/images/nih_00000001_000_cardiomegaly.png}
question=${2:-"How large are the lungs in this image, and is the heart enlarged?"}

cargo build --release -p hilum-cli
bin=target/release/hilum

# First-use installs contributed by the crates (models, runtimes); each is idempotent.
for step in scripts/install_*.sh; do
  [ -e "$step" ] || continue
  # shellcheck disable=SC1090
  source "$step"
done

llm_args=()
if [ -n "${HILUM_LLM:-}" ]; then
  llm_args=(--llm "$HILUM_LLM")
elif [ -n "${OPENAI_API_KEY:-}" ]; then
  llm_args=(--llm openai:gpt-4o)
elif [ -n "${HILUM_LOCAL_GGUF:-}" ] && [ -f "${HILUM_LOCAL_GGUF}" ]; then
  llm_args=(--llm "local:${HILUM_LOCAL_GGUF}")
else
  echo "hilum: no OPENAI_API_KEY and no local model: running the scripted demo (scripts/demo_script.json)" >&2
  llm_args=(--llm script:scripts/demo_script.json)
fi
exec "$bin" analyze "$image" --question "$question" "${llm_args[@]}" --out hilum-out
