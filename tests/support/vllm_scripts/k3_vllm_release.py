"""Run in a venv holding a released vLLM wheel (vllm 0.34.0 or 0.33.0: the CUDA build over torch's CPU build):
the plugin inside THAT release's own code, from k3convert's output, on a simulated ROCm MI300X.

    python k3_vllm_release.py OUT.json K3_DST K31_DST

What is simulated, and nothing else: ``amdsmi`` (answers one gfx942 MI300X, so vLLM's own platform
detection picks its ``RocmPlatform`` and its own ``on_gfx942()`` is true) and ``aiter`` (a package
whose layout helpers are aiter's released ``shuffle_weight`` with this release's own FlyDSL packer
and scale relayout, and whose MoE is tests/support/aiter_sim.py: bf16 stages that decode what they are given
by inverting those helpers, never the plugin's code). Tensors stay on the CPU (the platform says
device ``cuda``; every tensor here is built on the CPU).

Per model (K3, K3.1) and per parallel case (TP 1; rank r of TP 8; rank r of TP 8 + EP 8):
1. ``EngineArgs.create_engine_config``: vLLM's ModelConfig asks every registered config, the plugin
   claims the checkpoint (``ModelConfig._verify_quantization``).
2. The model class from vLLM's registry (``ModelRegistry.resolve_model_cls``), built whole on the CPU
   under that config at this rank (vLLM's TP group coordinator told the world size and rank: one process).
3. ``model.load_weights`` over every shard's tensors of the MoE blocks (router, latent projections,
   shared and routed experts; K3.1's DSA indexer too): the routed experts through
   ``RoutedExperts.weight_loader`` (TP/EP split by vLLM). The fixture's attention, norm and vision
   tensors are stand-ins shaped for the converter, not for vLLM's MLA/KDA modules: not fed (counted).
4. The plugin's ``process_weights_after_loading`` on every routed-experts layer, self-test included,
   with vLLM's real kernel build (``make_mxfp4_moe_kernel``: ``FusedMoEKernel`` around
   ``AiterMxfp4Experts``) whose one call into aiter (``rocm_aiter_ops.fused_moe``) is simulated.
5. One MoE forward of a layer (``quant_method.apply``, what the MoE runner calls) against a float32
   MoE from compressed-tensors' own decoding of the checkpoint (this rank's slice and experts).
A ``wrong`` case replaces the plugin's layout step by one that lays the weights out wrongly (self-test
off, so that what sees it is step 5 of this harness, and once with the self-test on).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]      # tests/ (aiter_sim, server_sources), this folder

import aiter_sim  # noqa: E402
import k3_plugin_e2e as e2e  # noqa: E402 - the 0.32/0.33 harness: its reference MoE and findings
import server_sources  # noqa: E402
import torch  # noqa: E402

from converter.vllm_plugin.route import SILU_INT4_MODULE  # noqa: E402 - torch- and vLLM-free

MOE = ".block_sparse_moe."
INDEXER = ".self_attn.indexer."
TP8 = 8
CALLS: list[dict] = []      # what vLLM handed the simulated aiter MoE, per call


def simulate_amdsmi() -> None:
    """One MI300X (gfx942): what vLLM's platform detection and platforms/rocm.py ask amdsmi."""
    smi = types.ModuleType("amdsmi")
    smi.AmdSmiException = type("AmdSmiException", (Exception,), {})
    smi.AmdSmiMemoryType = types.SimpleNamespace(VRAM=0)
    smi.amdsmi_init = smi.amdsmi_shut_down = lambda *a, **k: None
    smi.amdsmi_get_processor_handles = lambda: [0]
    smi.amdsmi_get_gpu_asic_info = lambda h: {"target_graphics_version": "gfx942",
                                              "market_name": "AMD Instinct MI300X"}
    smi.amdsmi_get_gpu_device_uuid = lambda h: "simulated-0"
    smi.amdsmi_get_gpu_memory_total = lambda h, kind: 192 * 2**30
    smi.amdsmi_topo_get_link_type = lambda a, b: {"hops": 1, "type": 2}
    smi.amdsmi_topo_get_numa_node_number = lambda h: 0
    sys.modules["amdsmi"] = smi


def package(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)   # find_spec finds it
    mod.__path__ = []
    sys.modules[name] = mod
    return mod


def simulate_aiter() -> aiter_sim.Helpers:
    """An installed aiter with the SiTUv2 packed-int4 a16w4 kernel, simulated (see the docstring)."""
    vllm_dir = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    shuffle = server_sources.aiter_shuffle(Path(os.environ["K3CONVERT_AITER_SRC"], "ops/shuffle.py"))
    ns = server_sources.vllm_flydsl(vllm_dir / server_sources.FLYDSL, shuffle.shuffle_weight)
    helpers = aiter_sim.Helpers(shuffle.shuffle_weight, ns["_pack_shuffled_int8_to_packed_int4_no_perm"],
                                server_sources.vllm_scale_relayout(ns))
    aiter = package("aiter")
    for name in ("aiter.ops", "aiter.ops.flydsl", "aiter.ops.flydsl.kernels"):
        package(name)
    aiter.dtypes = types.SimpleNamespace(i4x2=torch.uint8, i8=torch.int8)
    aiter.__getattr__ = NotSimulated("aiter").__getattr__
    sys.meta_path.insert(0, StubFinder())

    def flydsl_a16w4_gemm1(*, a_bf16, act="silu", situ_beta=1.0, situ_linear_beta=1.0, w_dtype="int4"):
        raise NotImplementedError("simulated: the MoE is aiter_sim.moe")
    sys.modules["aiter.ops.flydsl.kernels.moe_2stage_a16wmix"] = types.SimpleNamespace(
        flydsl_a16w4_gemm1=flydsl_a16w4_gemm1)
    sys.modules["aiter.ops.flydsl.moe_common"] = types.SimpleNamespace(GateMode=GateMode)
    sys.modules["aiter.ops.shuffle"] = types.SimpleNamespace(
        shuffle_weight=helpers.shuffle_weight, pack_int8_to_packed_int4=helpers.pack_int8_to_packed_int4,
        shuffle_scale_for_int4=helpers.shuffle_scale_for_int4)
    return helpers


# vLLM's compiled ops that layers take a handle on while built (the dense MLP's and shared experts'
# SiTU): vllm._C is built for torch 2.14's CUDA build and does not load here; none is called
NO_C_OPS = ("situ_and_mul",)


class NotSimulated:
    """Any other aiter name (its attention, KDA, routing and quant kernels, which vLLM's ROCm layers
    import while the model is built): usable as a name, raises if called. Only the routed experts
    compute here."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return NotSimulated(f"{self._name}.{attr}")

    def __call__(self, *a, **k):
        raise NotImplementedError(f"{self._name} is not simulated")


class StubFinder:
    """Imports of aiter modules that are not simulated give modules of NotSimulated names."""

    def find_spec(self, name, path=None, target=None):
        # aiter v0.1.20+ has no module of the SiLU-int4 window (#4502..#4646) the plugin refuses
        if name.startswith("aiter.") and name not in sys.modules and name != SILU_INT4_MODULE:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = NotSimulated(spec.name).__getattr__
        return mod

    def exec_module(self, module):
        pass


class GateMode:   # aiter.ops.flydsl.moe_common.GateMode's two values vLLM reads
    SEPARATED = types.SimpleNamespace(value="separated")
    INTERLEAVE = types.SimpleNamespace(value="interleave")


def simulate_fused_moe(helpers: aiter_sim.Helpers) -> None:
    """aiter's fused_moe as vLLM calls it (``rocm_aiter_ops.fused_moe``), computed by aiter_sim.moe."""
    from vllm._aiter_ops import rocm_aiter_ops

    def fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation_method=0,
                  quant_method=0, doweight_stage1=False, w1_scale=None, w2_scale=None, gate_mode="",
                  beta=None, linear_beta=None, intermediate_pad=0, hidden_pad=0, **_):
        CALLS.append({"gate_mode": gate_mode, "beta": beta, "linear_beta": linear_beta,
                      "activation_method": getattr(activation_method, "_name", str(activation_method)),
                      "quant_method": str(quant_method),
                      "pads": [hidden_pad, intermediate_pad], "tokens": int(hidden_states.shape[0])})
        if gate_mode != GateMode.SEPARATED.value or beta is None or linear_beta is None:
            raise RuntimeError(f"the simulated int4 kernel takes SiTU, [gate; up] separated; got {CALLS[-1]}")
        return aiter_sim.moe(helpers, w1.view(torch.uint8), w1_scale, w2.view(torch.uint8), w2_scale,
                             hidden_states, topk_weight, topk_ids, expert_mask, beta, linear_beta)
    rocm_aiter_ops.fused_moe = staticmethod(fused_moe)


# --------------------------------------------------------------------- layouts the plugin must not write

def wrong_layout(kind: str):
    """The plugin's layout step with one part wrong (its own building blocks otherwise)."""
    from converter.vllm_plugin import layout

    def convert(words, scales, chunk=None):
        e, n, _ = words.shape
        codes = layout.ct_words_to_codes(words)
        shuffled = codes if kind == "unshuffled" else layout.shuffle_16x16(codes)
        packed = layout.pack_i4x2(shuffled)
        if kind == "nibbles-swapped":
            packed = (packed << 4) | (packed >> 4)
        flat = scales.contiguous().view(-1) if kind == "scales-n-first" else layout.scales_to_aiter(scales).reshape(-1)
        return packed.view(e, n, -1), flat.clone()
    return convert


# --------------------------------------------------------------------- the harness

def fed_to_vllm(name: str) -> bool:
    """The MoE blocks' tensors (and K3.1's DSA indexer): the fixture's others are stand-ins shaped for
    the converter, not for vLLM's MLA/KDA modules."""
    return MOE in name or INDEXER in name


def tensors_of(dst: str) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """Every shard's tensors that ``fed_to_vllm`` takes, in file order, and how many it leaves."""
    from safetensors import safe_open

    index = json.loads(Path(dst, "model.safetensors.index.json").read_text())["weight_map"]
    out = []
    for shard in sorted(set(index.values())):
        with safe_open(str(Path(dst, shard)), "pt") as f:
            out += [(k, f.get_tensor(k)) for k in f.keys() if fed_to_vllm(k)]
    return out, len(index) - len(out)


def set_rank(tp: int, rank: int, ep: bool, vllm_config) -> None:
    """This process as rank ``rank`` of ``tp``: vLLM's TP group coordinator (what
    get_tensor_model_parallel_world_size/rank read) and the expert-parallel switch."""
    import vllm.distributed.parallel_state as ps

    ps._TP.world_size, ps._TP.rank_in_group = tp, rank
    vllm_config.parallel_config.tensor_parallel_size = tp
    vllm_config.parallel_config.enable_expert_parallel = ep


def run_case(vllm_config, model_cls, dst: str, tp: int, rank: int, ep: bool, wrong: str = "",
             selftest_on: bool = True) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from converter.vllm_plugin import moe_method, route, selftest

    set_rank(tp, rank, ep, vllm_config)
    moe_method.K3Int4AiterMoEMethod.self_tested = False
    moe_method.K3Int4AiterMoEMethod.repair_minus8 = False
    os.environ[selftest.ENV] = "1" if selftest_on else "0"
    correct = moe_method.layout.convert_experts_
    if wrong:
        moe_method.layout = types.SimpleNamespace(**{**vars(moe_method.layout),
                                                     "convert_experts_": wrong_layout(wrong)})
    CALLS.clear()
    out: dict = {}
    try:
        vllm_config.compilation_config.static_forward_context.clear()
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)        # as vLLM's model loader builds a bf16 model
        try:
            with set_current_vllm_config(vllm_config):
                model = model_cls(vllm_config=vllm_config, prefix="")
        finally:
            torch.set_default_dtype(default)
        experts = {n: m for n, m in model.named_modules() if isinstance(m, RoutedExperts)}
        out["model_class"] = f"{type(model).__module__}.{type(model).__name__}"
        out["methods"] = sorted({type(m.quant_method).__name__ for m in experts.values()})
        first = next(iter(experts.values()))
        par = first.quant_method.moe.moe_parallel_config
        out.update(tp_size=par.tp_size, tp_rank=par.tp_rank, ep_size=par.ep_size, ep_rank=par.ep_rank,
                   local_experts=int(first.w13_weight_packed.shape[0]),
                   per_rank=int(first.w13_weight_packed.shape[1] // 2))
        fed, out["not_fed"] = tensors_of(dst)
        out["fed"] = len(fed)
        loads = []
        for layer in experts.values():          # count RoutedExperts.weight_loader calls
            for p in (layer.w13_weight_packed, layer.w2_weight_packed, layer.w13_weight_scale,
                      layer.w2_weight_scale):
                inner = p.weight_loader

                def counted(*a, inner=inner, **k):
                    loads.append(1)
                    return inner(*a, **k)
                p.weight_loader = counted
        with set_current_vllm_config(vllm_config):
            try:
                model.load_weights(iter(fed))
            except Exception as exc:   # a finding (K3.1 on ROCm), not a crash of the harness
                out["load_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                return out
            out["expert_loads"] = len(loads)
            for layer in experts.values():       # what vLLM's loader then does for each quantized module
                layer.quant_method.process_weights_after_loading(layer)
        out["kernel"] = type(first.quant_method.moe_kernel).__name__
        out["experts_class"] = type(first.quant_method.moe_kernel.fused_experts).__name__
        out["selftest_calls"] = len(CALLS)
        name = f"{e2e.PREFIX}.experts.routed_experts"      # layer 1, the checkpoint's name for it
        layer = experts[name]
        out["layer"] = name
        cfg = vllm_config.model_config.hf_text_config
        gen = torch.Generator().manual_seed(tp * 100 + rank)
        e, k, tokens = cfg.num_experts, cfg.num_experts_per_token, 16
        topk_ids = torch.stack([torch.roll(torch.arange(e), -t)[:k] for t in range(tokens)]).to(torch.int32)
        topk_weights = 0.5 + torch.rand(tokens, k, generator=gen)
        x = (torch.randn(tokens, cfg.routed_expert_hidden_size, generator=gen) * 0.5).to(torch.bfloat16)
        with set_current_vllm_config(vllm_config):
            got = layer.quant_method.apply(layer, x, topk_weights, topk_ids, None, None).float()
        out["forward_call"] = CALLS[-1]
        emap = layer.expert_map
        vals = [] if emap is None else [int(v) for v in emap.view(-1)]
        # an AITER kernel gets the 0/1 expert mask (consumes_expert_mask), others the local-id map
        mask = bool(vals) and min(vals) >= 0
        local = set(range(e)) if emap is None else {g for g, v in enumerate(vals) if (v > 0 if mask else v >= 0)}
        # under EP the experts are whole (vLLM folds TP into EP): this rank's share is its experts
        want = e2e.reference(e2e.expert_tensors(dst), x, topk_weights, topk_ids, local,
                             cfg.moe_intermediate_size, 1 if ep else tp, 0 if ep else rank,
                             cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        hit = want.norm(dim=1) > 0
        out["local"] = sorted(local)
        out["tokens_compared"] = int(hit.sum())
        out["rel_error"] = float(((got - want).norm(dim=1)[hit] / want.norm(dim=1)[hit]).max())
        out["remote_rows_zero"] = bool((got[~hit] == 0).all())
    except route.Refused as exc:
        out["refused"] = str(exc)
    except Exception as exc:
        out.update(e2e.finding(exc))
    finally:
        moe_method.layout = sys.modules["converter.vllm_plugin.layout"]
        assert moe_method.layout.convert_experts_ is correct
        os.environ.pop(selftest.ENV, None)
        set_rank(1, 0, False, vllm_config)
    return out


TINY_HEADS = 8   # attention heads divisible by TP 8 (k3_quant_methods.TINY_TEXT has 2)


def engine_config(dst: str, root: str):
    from k3_quant_methods import TINY_TEXT, tiny_model_dir
    from vllm.engine.arg_utils import EngineArgs

    spec = json.loads(Path(dst, "config.json").read_text())["text_config"]
    tiny = {**TINY_TEXT, "num_attention_heads": TINY_HEADS, "num_key_value_heads": TINY_HEADS,
            "intermediate_size": spec["moe_intermediate_size"],
            "linear_attn_config": {**TINY_TEXT["linear_attn_config"], "num_heads": TINY_HEADS}}
    model_dir = tiny_model_dir(dst, root, tiny)
    return EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                      load_format="dummy", max_model_len=256, enable_prefix_caching=False).create_engine_config()


def model(dst: str, root: str, first: bool, cases: dict) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.registry import ModelRegistry

    from converter.vllm_plugin import route

    try:
        vllm_config = engine_config(dst, root)
    except route.Refused as exc:
        return {"config_refused": str(exc)}
    except Exception as exc:       # a release that cannot read this config (0.33.0 and kimi_k31)
        return {"config_error": f"{type(exc).__name__}: {exc}"[:600]}
    mc = vllm_config.model_config
    result: dict = {"quantization": mc.quantization, "quant_config": type(vllm_config.quant_config).__name__,
                    "architectures": list(mc.architectures), "model_type": mc.hf_config.model_type}
    model_cls, arch = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    result["registry"] = {"arch": arch, "class": f"{model_cls.__module__}.{model_cls.__name__}"}
    if first:
        from k3_quant_methods import free_port
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            initialize_model_parallel(1, 1)
    for name, kw in cases.items():
        result[name] = run_case(vllm_config, model_cls, dst, **kw)
    return result


K3_CASES = {
    "tp1": dict(tp=1, rank=0, ep=False),
    "tp8-rank0": dict(tp=TP8, rank=0, ep=False), "tp8-rank5": dict(tp=TP8, rank=5, ep=False),
    "tp8-ep8-rank0": dict(tp=TP8, rank=0, ep=True), "tp8-ep8-rank6": dict(tp=TP8, rank=6, ep=True),
    **{f"tp1-wrong-{w}": dict(tp=1, rank=0, ep=False, wrong=w, selftest_on=False)
       for w in ("unshuffled", "nibbles-swapped", "scales-n-first")},
    "tp8-ep8-rank6-wrong-unshuffled": dict(tp=TP8, rank=6, ep=True, wrong="unshuffled", selftest_on=False),
    "tp1-wrong-unshuffled-selftest": dict(tp=1, rank=0, ep=False, wrong="unshuffled"),
}
K31_CASES = {"tp1": dict(tp=1, rank=0, ep=False)}


def main() -> int:
    out_path, k3, k31 = sys.argv[1:4]
    os.environ.update(VLLM_ROCM_USE_AITER="1", VLLM_ROCM_USE_AITER_MOE="1")   # as the plugin requires
    simulate_amdsmi()
    helpers = simulate_aiter()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm
    from vllm.platforms import current_platform, rocm

    simulate_fused_moe(helpers)
    for name in NO_C_OPS:      # vllm._C is built for torch 2.14's CUDA build: it does not load here
        setattr(torch.ops._C, name, NotSimulated(f"vllm._C.{name}"))
    # the device questions vLLM's ROCm classes ask torch.cuda, answered for one MI300X (304 CUs);
    # its tensors stay on the CPU
    current_platform.current_device = lambda: torch.device("cpu")
    current_platform.num_compute_units = lambda *a, **k: 304
    import vllm.model_executor.layers.fused_moe.runner.shared_experts as shared
    shared.aux_stream = lambda: None      # no second CUDA stream: shared experts run inline
    from vllm.v1.worker.workspace import init_workspace_manager
    init_workspace_manager(torch.device("cpu"))   # what vLLM's GPU worker does at start-up
    torch.accelerator.empty_cache = lambda: None  # the workspace frees the GPU cache as it grows
    root = os.path.dirname(out_path)
    result = {"vllm": vllm.__version__, "vllm_file": vllm.__file__, "torch": torch.__version__,
              "platform": type(current_platform).__name__, "gfx942": bool(rocm.on_gfx942())}
    for name, dst, cases in (("k3", k3, K3_CASES), ("k31", k31, K31_CASES)):
        try:
            result[name] = model(dst, root, name == "k3", cases)
        except Exception as exc:
            result[name] = e2e.finding(exc)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
