#!/usr/bin/env bash
# Fetch the few server source files tests/test_vllm_plugin.py compares the plugin's layout against
# (vLLM's and aiter's own code; never copied into this repo), from their released PyPI wheels:
#   vllm 0.33.0            model_executor/layers/quantization/mxfp4.py and
#                          .../compressed_tensors_moe/compressed_tensors_moe_w4a16_flydsl.py,
#                          fused_moe/config.py, fused_moe/expert_map_manager.py, distributed/utils.py
#                          (how DP/EP/PP split the MoE: tests/test_serving.py)
#   amd-aiter 0.1.7.post2.dev18  aiter/ops/shuffle.py
#   sglang 0.5.23          the WNA16 MoE and model files that decide how Ling's and GLM's swiglu
#                          clamp reaches its kernels (tests/test_clamp_serving.py)
# Usage: eval "$(bash scripts/fetch_server_sources.sh [DEST])"   (prints the three export lines)
# DEST defaults to $K3CONVERT_SERVER_SOURCES, else ~/.cache/k3convert/server-sources. Idempotent:
# once the files are there nothing is downloaded. The vllm wheel is ~340 MB; it is deleted after.
set -euo pipefail

dest="${1:-${K3CONVERT_SERVER_SOURCES:-${XDG_CACHE_HOME:-$HOME/.cache}/k3convert/server-sources}}"
py="${PYTHON:-python3}"
VLLM_FILES=(
  vllm/model_executor/layers/quantization/mxfp4.py
  vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w4a16_flydsl.py
  vllm/model_executor/layers/fused_moe/config.py
  vllm/model_executor/layers/fused_moe/expert_map_manager.py
  vllm/distributed/utils.py
)
AITER_FILES=(aiter/ops/shuffle.py)
SGLANG_FILES=(
  sglang/srt/models/bailing_moe_v3.py
  sglang/srt/models/glm5_next.py
  sglang/srt/models/deepseek_v2.py
  sglang/srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py
  sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py
)

have_all() {
  for f in "${VLLM_FILES[@]}"; do [ -f "$dest/vllm033/$f" ] || return 1; done
  for f in "${AITER_FILES[@]}"; do [ -f "$dest/aiter/$f" ] || return 1; done
  for f in "${SGLANG_FILES[@]}"; do [ -f "$dest/sglang0523/$f" ] || return 1; done
}

if ! have_all; then
  mkdir -p "$dest/wheels"
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dest/wheels" \
    vllm==0.33.0 amd-aiter==0.1.7.post2.dev18 sglang==0.5.23 >&2
  "$py" - "$dest" "${VLLM_FILES[*]}" "${AITER_FILES[*]}" "${SGLANG_FILES[*]}" <<'PY'
import glob, hashlib, os, sys, zipfile
dest, vllm_files, aiter_files, sglang_files = sys.argv[1], *(a.split() for a in sys.argv[2:5])
for pattern, sub, files in (("vllm-0.33.0-*.whl", "vllm033", vllm_files),
                            ("amd_aiter-0.1.7.post2.dev18-*.whl", "aiter", aiter_files),
                            ("sglang-0.5.23-*.whl", "sglang0523", sglang_files)):
    (wheel,) = glob.glob(os.path.join(dest, "wheels", pattern))
    with zipfile.ZipFile(wheel) as z:
        for name in files:
            out = os.path.join(dest, sub, name)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "wb") as f:
                f.write(z.read(name))
    with open(wheel, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(dest, sub, "WHEEL_SHA256"), "w") as f:
        f.write(f"{digest}  {os.path.basename(wheel)}\n")
    os.remove(wheel)
PY
  have_all || { echo "fetch_server_sources: files missing after extraction in $dest" >&2; exit 1; }
fi

echo "export K3CONVERT_VLLM033_SRC=$dest/vllm033/vllm"
echo "export K3CONVERT_AITER_SRC=$dest/aiter/aiter"
echo "export K3CONVERT_SGLANG0523_SRC=$dest/sglang0523/sglang"
