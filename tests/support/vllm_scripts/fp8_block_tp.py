"""Run in a vLLM venv: build vLLM's own model class from a k3convert output under faked TP sizes and
record every FP8 block linear vLLM's compressed-tensors FP8 scheme refuses.

    python fp8_block_tp.py {ling|mimo_v2} OUT.json DIR TP [TP ...]

The model is built as moe_model_quant_methods.py builds it (same stand-ins), once per TP size, with
the TP size and rank faked in every module that reads them (one real process, as k3_plugin_e2e.py
fake_tp does). ``validate_fp8_block_shape`` (fp8_utils.py, called by compressed_tensors_w8a8_fp8.py
create_weights) is wrapped: it runs as released on vLLM's own layer, sizes and block, and its
ValueError is recorded under the layer's prefix instead of raised, so one build lists every refusal.
Anything else that raises ends that TP's build and is recorded as ``error``.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3_quant_methods as k3qm  # noqa: E402
import moe_model_quant_methods as mm  # noqa: E402

REFUSED: dict[str, str] = {}


def record_validation() -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w8a8_fp8 as w8a8
    real = w8a8.validate_fp8_block_shape

    def validate(layer, *args, **kwargs):
        try:
            real(layer, *args, **kwargs)
        except ValueError as e:
            REFUSED[getattr(layer, "prefix", "?")] = str(e)

    w8a8.validate_fp8_block_shape = validate


def fake_tp(size: int) -> None:
    """The TP size (rank 0) wherever the model's layers read it."""
    import vllm.distributed as dist
    import vllm.distributed.parallel_state as ps
    import vllm.model_executor.layers.fused_moe.config as moe_cfg
    import vllm.model_executor.layers.fused_moe.layer as moe_layer
    import vllm.model_executor.layers.linear as linear
    from vllm.model_executor.models import bailing_moe_v3, mimo_v2

    for mod in (dist, ps, moe_cfg, moe_layer, linear, bailing_moe_v3, mimo_v2):
        if hasattr(mod, "get_tensor_model_parallel_world_size"):
            mod.get_tensor_model_parallel_world_size = lambda size=size: size
        if hasattr(mod, "get_tensor_model_parallel_rank"):
            mod.get_tensor_model_parallel_rank = lambda: 0


def build(model_dir: str, family: str, tp: int, first: bool) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import configure_quant_config

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cls = mm.model_class(family, json.load(f))
    vllm_config = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                             load_format="dummy", max_model_len=256, enable_prefix_caching=False,
                             trust_remote_code=False).create_engine_config()
    configure_quant_config(vllm_config.quant_config, cls)
    REFUSED.clear()
    with set_current_vllm_config(vllm_config):
        if first:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{k3qm.free_port()}")
            initialize_model_parallel(1, 1)
        fake_tp(tp)
        try:
            cls(vllm_config=vllm_config, prefix="")
        except Exception as e:   # a refusal other than the block shape: ends this build
            return {"refused": dict(REFUSED), "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    return {"refused": dict(REFUSED), "quant_config": type(vllm_config.quant_config).__name__}


def main() -> int:
    family, out_path, model_dir, tps = sys.argv[1], sys.argv[2], sys.argv[3], [int(t) for t in sys.argv[4:]]
    import vllm
    if family == "ling":
        mm.register_ling_config()
    k3qm.record_oracle()
    mm.record_fp8_linear()
    record_validation()
    root = tempfile.mkdtemp(prefix="fp8tp-")
    tiny = mm.tiny_dir(model_dir, root, family)
    results = {str(tp): build(tiny, family, tp, i == 0) for i, tp in enumerate(tps)}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"vllm": vllm.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
