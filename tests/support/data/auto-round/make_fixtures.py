"""Writes the auto-round 0.16.1 exports under this folder (run once; the outputs are committed).

Each is auto-round's own exporter on a tiny random bf16 Mixtral (tests/support/mixtral_fixture.py), RTN with one
tuning step on CPU, scheme MXFP4 or NVFP4 (auto_round/schemes.py 685-775), saved with
``quantize_and_save(format=...)``:

- ``mxfp4``: ``format="auto_round"`` (export/formats/backends/autoround.py 200-207 ->
  export_to_autoround/export_to_nvfp_mx.py ``save_quantized_as_fp``: ``quant_method "auto-round"``,
  ``packing_format "auto_round:llm_compressor"``);
- ``nvfp4``: the same format, NVFP4 scheme;
- ``nvfp4-llm-compressor``: ``format="llm_compressor"`` (compressed-tensors ``nvfp4-pack-quantized``).

Needs auto-round 0.16.1 and accelerate (``pip install --no-deps --target DIR auto-round==0.16.1 accelerate``,
then ``AR_DISABLE_META_LOAD=1 PYTHONPATH=DIR python tests/support/data/auto-round/make_fixtures.py``). Only
config.json, quantization_config.json and model.safetensors are kept.
"""
import glob
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))   # tests/
SIZES = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=2, vocab_size=32)
KEEP = ("config.json", "quantization_config.json", "model.safetensors")


def base_model(root: str) -> str:
    from mixtral_fixture import tiny_mixtral
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(root, "base")
    tiny_mixtral(seed=7, **SIZES).save_pretrained(path)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t1", eos_token="t2").save_pretrained(path)
    return path


def export(base: str, scheme: str, fmt: str, dst: str) -> None:
    from auto_round import AutoRound

    ar = AutoRound(base, scheme=scheme, iters=1, dataset=[" ".join(f"t{i}" for i in range(3, 20))] * 4,
                   nsamples=2, seqlen=8, batch_size=1, device_map="cpu", enable_torch_compile=False)
    with tempfile.TemporaryDirectory() as tmp:
        ar.quantize_and_save(tmp, format=fmt)
        out = tmp if os.path.exists(os.path.join(tmp, "config.json")) else glob.glob(os.path.join(tmp, "*", ""))[0]
        os.makedirs(dst, exist_ok=True)
        for f in KEEP:
            shutil.copy(os.path.join(out, f), os.path.join(dst, f))


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        base = base_model(root)
        for name, scheme, fmt in (("mxfp4", "MXFP4", "auto_round"), ("nvfp4", "NVFP4", "auto_round"),
                                  ("nvfp4-llm-compressor", "NVFP4", "llm_compressor")):
            export(base, scheme, fmt, os.path.join(HERE, name))


if __name__ == "__main__":
    main()
