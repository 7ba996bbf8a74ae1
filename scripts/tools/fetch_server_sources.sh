#!/usr/bin/env bash
# Fetch the few server source files the tests compare our code against (vLLM's and aiter's own code;
# never copied into this repo), from their released PyPI wheels, one folder per release:
#   vllm 0.33.0, 0.34.0    model_executor/layers/quantization/mxfp4.py and
#                          .../compressed_tensors_moe/compressed_tensors_moe_w4a16_flydsl.py (the
#                          plugin's layout), fused_moe/config.py, fused_moe/expert_map_manager.py,
#                          distributed/utils.py (how DP/EP/PP split the MoE: tests/servers/test_serving.py),
#                          compressed_tensors/utils.py and utils/config_utils.py (the target matcher:
#                          tests/formats/test_match.py), model_executor/utils.py (0.34's route:
#                          tests/vllm_plugin/test_layout_kernel.py), and for 0.34 the files the upstream patches
#                          apply to (tests/servers/test_upstream_patch.py); the model registry, config and
#                          tokenizer files docs/deploy.md cites (tests/project/test_deploy_doc.py)
#   amd-aiter 0.1.7.post2.dev18  aiter/ops/shuffle.py
#   sglang 0.5.23          the WNA16 MoE and model files that decide how Ling's and GLM's swiglu
#                          clamp reaches its kernels (tests/servers/test_clamp_serving.py)
# Usage: eval "$(bash scripts/tools/fetch_server_sources.sh [DEST])"   (prints the export lines)
# DEST defaults to $K3CONVERT_SERVER_SOURCES, else ~/.cache/k3convert/server-sources. Idempotent:
# once the files are there nothing is downloaded. Each vllm wheel is ~340 MB; it is deleted after.
set -euo pipefail

dest="${1:-${K3CONVERT_SERVER_SOURCES:-${XDG_CACHE_HOME:-$HOME/.cache}/k3convert/server-sources}}"
py="${PYTHON:-python3}"
CT=vllm/model_executor/layers/quantization/compressed_tensors
VLLM_FILES=(
  vllm/model_executor/layers/quantization/mxfp4.py
  $CT/compressed_tensors_moe/compressed_tensors_moe_w4a16_flydsl.py
  vllm/model_executor/layers/fused_moe/config.py
  vllm/model_executor/layers/fused_moe/expert_map_manager.py
  vllm/distributed/utils.py
  $CT/utils.py
  $CT/compressed_tensors.py
  vllm/model_executor/layers/quantization/utils/config_utils.py
  vllm/model_executor/utils.py
  vllm/model_executor/models/registry.py
  vllm/transformers_utils/config.py
  vllm/tokenizers/registry.py
  vllm/tokenizers/hf.py
)
VLLM034_FILES=(
  "${VLLM_FILES[@]}"
  $CT/compressed_tensors_moe/compressed_tensors_moe.py
  $CT/compressed_tensors_moe/compressed_tensors_moe_wna16.py
  $CT/schemes/compressed_tensors_wNa16.py
  vllm/model_executor/layers/fused_moe/activation.py
  vllm/model_executor/layers/fused_moe/oracle/int_wna16.py
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
  for f in "${VLLM034_FILES[@]}"; do [ -f "$dest/vllm034/$f" ] || return 1; done
  for f in "${AITER_FILES[@]}"; do [ -f "$dest/aiter/$f" ] || return 1; done
  for f in "${SGLANG_FILES[@]}"; do [ -f "$dest/sglang0523/$f" ] || return 1; done
}

if ! have_all; then
  mkdir -p "$dest/wheels"
  # one release per pip call: two vllm versions in one call are a resolver conflict
  for req in vllm==0.33.0 vllm==0.34.0 amd-aiter==0.1.7.post2.dev18 sglang==0.5.23; do
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dest/wheels" "$req" >&2
  done
  "$py" - "$dest" "${VLLM_FILES[*]}" "${VLLM034_FILES[*]}" "${AITER_FILES[*]}" "${SGLANG_FILES[*]}" <<'PY'
import glob, hashlib, os, sys, zipfile
dest, vllm_files, vllm034_files, aiter_files, sglang_files = sys.argv[1], *(a.split() for a in sys.argv[2:6])
for pattern, sub, files in (("vllm-0.33.0-*.whl", "vllm033", vllm_files),
                            ("vllm-0.34.0-*.whl", "vllm034", vllm034_files),
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
echo "export K3CONVERT_VLLM034_SRC=$dest/vllm034/vllm"
echo "export K3CONVERT_AITER_SRC=$dest/aiter/aiter"
echo "export K3CONVERT_SGLANG0523_SRC=$dest/sglang0523/sglang"
