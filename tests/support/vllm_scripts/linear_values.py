"""Run in a vLLM venv: build vLLM's own model class from a k3convert output (as
moe_model_quant_methods.py does, TP 1 on the CPU), load the output's tensors with the class's own
``load_weights``, and write, as JSON, whether every linear holds the output's values.

    python linear_values.py {ling|mimo_v2|kimi_k3} OUT.json DIR [REFERENCE]

For each ``LinearBase`` module (and ``lm_head``) the checkpoint shards vLLM stacks into it are read
from DIR (the class's ``packed_modules_mapping``, checkpoint ``attention.`` mapped to ``self_attn.``
for Ling as its ``hf_to_vllm_mapper`` does), or from REFERENCE when given (the same names: a
changed tensor in DIR must then show). A shard the checkpoint lacks is listed with the shape vLLM
wants (``missing``), so a test can add it. A layer that registered ``weight_scale`` (the FP8 block
method) must hold the shards' e4m3 bytes and fp32 scales stacked; any other must hold the shards'
values: bf16 as written, an FP8 shard as e4m3 x its block scale (what it means). The routed experts
load too (their method is checked by test_vllm_*), and are left out here: they are not linears.

``kimi_k3`` builds the ROCm K3 class (``models/kimi_k3/amd``) as k3_quant_methods.py binds it, on
its tiny fields except the KDA attention, made 2 heads of 128 on every layer (K3_TINY_TEXT) so that
the fixture's ``self_attn.{q,k,v,o}_proj`` (hidden x hidden) have a place in it; K3.1 as
k3_quant_methods.register_k31 says. Its tensors are loaded one at a time through the class's own
``load_weights``, so a tensor the class has no place for is listed (``refused``, with vLLM's error)
instead of ending the run. Checked: the language model's linears, ``embed_tokens`` and ``lm_head``
(not KDA's ``conv1d``, a convolution vLLM keeps in a linear; not the vision tower, a one-tensor
stand-in in the fixture).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_model_quant_methods as mq  # noqa: E402

# every layer KDA with 2 heads of 128 (= the fixture's hidden 256); MLA fields stay k3qm's
K3_TINY_TEXT = {**mq.k3qm.TINY_TEXT,
                "linear_attn_config": {**mq.k3qm.TINY_TEXT["linear_attn_config"], "kda_layers": [1, 2, 3, 4],
                                       "full_attn_layers": [], "head_dim": 128, "num_heads": 2}}
# the K3 class's fused linears: its load_weights' stacked_params_mapping (amd/linear.py 933-951), in
# shard order (b_proj is shard 5 under the full-rank gate K3 uses)
K3_FUSED = {"in_proj_qkvgfab": ["q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"],
            "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"], "gate_up_proj": ["gate_proj", "up_proj"]}


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


def load(model, tensors: dict, one_at_a_time: bool) -> dict[str, str]:
    """The class's own load_weights over TENSORS; one at a time: {tensor: vLLM's error} for those refused."""
    if not one_at_a_time:
        model.load_weights((n, t) for n, t in tensors.items())
        return {}
    refused = {}
    for n, t in tensors.items():
        try:
            model.load_weights([(n, t)])
        except Exception as e:   # a finding to report (which tensor, vLLM's words), not a crash
            refused[n] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return refused


def checked(name: str, mod, family: str) -> bool:
    from vllm.model_executor.layers.linear import LinearBase
    if ".experts" in name:
        return False
    if family != "kimi_k3":
        return isinstance(mod, LinearBase) or name == "lm_head"
    return name.startswith("language_model.") and not name.endswith(".conv1d") and \
        (isinstance(mod, LinearBase) or name.rpartition(".")[2] in ("lm_head", "embed_tokens"))


def main() -> int:
    import torch
    family, out_path, dst = sys.argv[1], sys.argv[2], sys.argv[3]
    reference = sys.argv[4] if len(sys.argv) > 4 else dst
    import vllm  # noqa: F401
    if family == "ling":
        mq.register_ling_config()
    mq.k3qm.record_oracle()
    mq.record_fp8_linear()
    root = os.path.dirname(os.path.abspath(out_path))
    if family == "kimi_k3":
        mq.k3qm.register_k31(mq.k3qm.bind_classes("amd"))
        with open(os.path.join(dst, "config.json"), encoding="utf-8") as f:   # the fixture's dense MLP is as wide
            wide = json.load(f)["text_config"].get("moe_intermediate_size")           # as its experts
        tiny = {**K3_TINY_TEXT, **({"intermediate_size": wide} if wide else {})}
        model = build(mq.k3qm.tiny_model_dir(dst, root, tiny), family)
    else:
        model = build(mq.tiny_dir(dst, root, family), family)
    tensors = checkpoint(dst)
    rename = (lambda n: n.replace(".attention.", ".self_attn.")) if family == "ling" else (lambda n: n)
    refused = load(model, tensors, one_at_a_time=family == "kimi_k3")
    if reference != dst:
        tensors = checkpoint(reference)
    by_vllm = {rename(n)[: -len(".weight")]: n[: -len(".weight")] for n in tensors if n.endswith(".weight")}
    packed = K3_FUSED if family == "kimi_k3" else getattr(type(model), "packed_modules_mapping", {})
    results = {}
    for name, mod in model.named_modules():
        if not checked(name, mod, family):
            continue
        parent, _, leaf = name.rpartition(".")
        params = dict(mod.named_parameters(recurse=False))
        w = params["weight"].data
        parts = [f"{parent}.{p}" if parent else p for p in packed.get(leaf, [leaf])]
        shards = [by_vllm.get(p) for p in parts]
        if None in shards:   # name -> [rows, cols] vLLM wants for each shard the checkpoint lacks
            sizes = getattr(mod, "output_sizes", None) or [w.shape[0]] * len(parts)
            results[name] = {"ok": False, "why": "no checkpoint tensor for a shard of it",
                             "missing": {p: [int(r), int(w.shape[1])]
                                         for p, r, s in zip(parts, sizes, shards) if s is None}}
            continue
        if "weight_scale" in params:
            want_w = torch.cat([tensors[f"{s}.weight"] for s in shards]).view(torch.uint8)
            want_s = torch.cat([tensors[f"{s}.weight_scale"] for s in shards])
            ok = w.view(torch.uint8).shape == want_w.shape and torch.equal(w.view(torch.uint8), want_w) \
                and torch.equal(params["weight_scale"].data.float(), want_s.float())
            results[name] = {"ok": bool(ok), "kind": "fp8", "shards": shards}
            continue
        want = torch.cat([value(tensors, s) for s in shards])
        got = w.float()
        pad = got.shape[0] - want.shape[0] if got.dim() == want.dim() == 2 else 0
        if pad > 0:   # rows vLLM pads the fused layer with (K3's in_proj_qkvgfab, to 16): must stay 0
            got, tail = got[: want.shape[0]], got[want.shape[0]:]
        if want.numel() != got.numel():
            results[name] = {"ok": False, "why": f"vLLM holds {list(w.shape)}, the checkpoint {list(want.shape)}",
                             "shards": shards}
            continue
        want = want.reshape(got.shape)
        ok = bool(torch.equal(got, want.to(w.dtype).float())) and bool(torch.equal(want.to(w.dtype).float(), want)) \
            and (pad <= 0 or not bool(tail.any()))
        ratio = float(want.norm() / got.norm()) if float(got.norm()) else float("inf")
        results[name] = {"ok": ok, "kind": str(w.dtype), "shards": shards, "norm_ratio": ratio,
                         "source_dtypes": [str(tensors[f"{s}.weight"].dtype) for s in shards]}
    with open(out_path, "w") as f:
        json.dump({"vllm": vllm.__version__, "class": type(model).__name__, "linears": results,
                   "refused": refused, "experts": experts(model), "oracle_asked": mq.k3qm.ASKED}, f, indent=1)
    return 0


def experts(model) -> dict[str, dict]:
    """Each routed-expert layer: its quant method and the activation and betas its FusedMoEConfig
    hands the kernel (what k3qm.record_oracle sees asked, here per layer)."""
    out = {}
    for name, mod in model.named_modules():
        moe = getattr(getattr(mod, "quant_method", None), "moe", None)
        if type(mod).__name__ == "RoutedExperts" and moe is not None:
            out[name] = {"method": type(mod.quant_method).__name__,
                         "activation": str(getattr(moe.activation, "value", moe.activation)),
                         **{k: getattr(moe, k, None) for k in ("activation_situ_beta", "activation_situ_linear_beta",
                                                               "swiglu_limit")}}
    return out


def build(model_dir: str, family: str):
    """vLLM's class built as moe_model_quant_methods.build builds it, returned (not summarised)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    cls = mq.k3qm.bind_classes("amd").KimiK3ForConditionalGeneration if family == "kimi_k3" \
        else mq.model_class(family, config)
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
