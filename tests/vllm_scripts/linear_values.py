"""Run in a vLLM venv: build vLLM's own model class from a k3convert output (as
moe_model_quant_methods.py does, TP 1 on the CPU), load the output's tensors with the class's own
``load_weights``, and write, as JSON, whether every linear holds the output's values.

    python linear_values.py {ling|mimo_v2} OUT.json DIR

For each ``LinearBase`` module (and ``lm_head``) the checkpoint shards vLLM stacks into it are read
from DIR (the class's ``packed_modules_mapping``, checkpoint ``attention.`` mapped to ``self_attn.``
for Ling as its ``hf_to_vllm_mapper`` does). A layer that registered ``weight_scale`` (the FP8 block
method) must hold the shards' e4m3 bytes and fp32 scales stacked; any other must hold the shards'
values: bf16 as written, an FP8 shard as e4m3 x its block scale (what it means). The routed experts
load too (their method is checked by test_vllm_*), and are left out here: they are not linears.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_model_quant_methods as mq  # noqa: E402


def checkpoint(dst: str):
    from safetensors import safe_open
    index = os.path.join(dst, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors"))
    out = {}
    for name in files:
        with safe_open(os.path.join(dst, name), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def value(tensors: dict, module: str):
    """The values an output linear means: bf16 as is, FP8 block e4m3 x its scale per 128-block."""
    import torch
    w = tensors[f"{module}.weight"]
    s = tensors.get(f"{module}.weight_scale")
    if s is None:
        return w.float()
    r = torch.arange(w.shape[0]) // -(-w.shape[0] // s.shape[0])
    c = torch.arange(w.shape[1]) // -(-w.shape[1] // s.shape[1])
    return w.float() * s.float()[r][:, c]


def main() -> int:
    import torch
    family, out_path, dst = sys.argv[1], sys.argv[2], sys.argv[3]
    import vllm  # noqa: F401
    from vllm.model_executor.layers.linear import LinearBase
    if family == "ling":
        mq.register_ling_config()
    mq.k3qm.record_oracle()
    mq.record_fp8_linear()
    root = os.path.dirname(os.path.abspath(out_path))
    model = build(mq.tiny_dir(dst, root, family), family)
    tensors = checkpoint(dst)
    rename = (lambda n: n.replace(".attention.", ".self_attn.")) if family == "ling" else (lambda n: n)
    model.load_weights((n, t) for n, t in tensors.items())
    by_vllm = {rename(n)[: -len(".weight")]: n[: -len(".weight")] for n in tensors if n.endswith(".weight")}
    packed = getattr(type(model), "packed_modules_mapping", {})
    results = {}
    for name, mod in model.named_modules():
        if not (isinstance(mod, LinearBase) or name == "lm_head") or ".experts" in name:
            continue
        parent, _, leaf = name.rpartition(".")
        shards = [by_vllm.get(f"{parent}.{s}") for s in packed.get(leaf, [leaf])]
        shards = [s for s in shards if s is not None] or [by_vllm.get(name)]
        if shards == [None]:
            results[name] = {"ok": False, "why": "no checkpoint tensor for it"}
            continue
        params = dict(mod.named_parameters(recurse=False))
        w = params["weight"].data
        if "weight_scale" in params:
            want_w = torch.cat([tensors[f"{s}.weight"] for s in shards]).view(torch.uint8)
            want_s = torch.cat([tensors[f"{s}.weight_scale"] for s in shards])
            ok = w.view(torch.uint8).shape == want_w.shape and torch.equal(w.view(torch.uint8), want_w) \
                and torch.equal(params["weight_scale"].data.float(), want_s.float())
            results[name] = {"ok": bool(ok), "kind": "fp8", "shards": shards}
            continue
        want = torch.cat([value(tensors, s) for s in shards]).reshape(w.shape)
        got = w.float()
        ok = bool(torch.equal(got, want.to(w.dtype).float())) and bool(torch.equal(want.to(w.dtype).float(), want))
        ratio = float(want.norm() / got.norm()) if float(got.norm()) else float("inf")
        results[name] = {"ok": ok, "kind": str(w.dtype), "shards": shards, "norm_ratio": ratio,
                         "source_dtypes": [str(tensors[f"{s}.weight"].dtype) for s in shards]}
    with open(out_path, "w") as f:
        json.dump({"vllm": vllm.__version__, "class": type(model).__name__, "linears": results}, f, indent=1)
    return 0


def build(model_dir: str, family: str):
    """vLLM's class built as moe_model_quant_methods.build builds it, returned (not summarised)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cls = mq.model_class(family, json.load(f))
    vllm_config = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                             load_format="dummy", max_model_len=256, enable_prefix_caching=False,
                             trust_remote_code=False).create_engine_config()
    if vllm_config.quant_config is not None:
        from vllm.model_executor.model_loader.utils import configure_quant_config
        configure_quant_config(vllm_config.quant_config, cls)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{mq.k3qm.free_port()}")
        initialize_model_parallel(1, 1)
        return cls(vllm_config=vllm_config, prefix="")


if __name__ == "__main__":
    sys.exit(main())
