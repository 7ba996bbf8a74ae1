"""Run by the llm-compressor environment ($K3CONVERT_LLMC_PYTHON), not by pytest: a tiny random Mixtral
quantized by llm-compressor's own ``oneshot`` (scheme NVFP4A16, experts only) and saved by its
``save_pretrained`` (transformers' sharding, ``save_compressed=True``) twice: ``DST/one`` in one file and
``DST/sharded`` cut at ``max_shard_size`` (argv[2]), where a module's ``weight_global_scale``, written before
its ``weight_packed``, lands in the previous shard (tests/formats/test_nvfp4_shards.py)."""
import os
import sys

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

IGNORE = ["lm_head", "re:.*self_attn.*", r"re:.*block_sparse_moe\.gate.*", r"re:.*mlp\.gate$"]


def main(dst: str, shard_size: str) -> None:
    torch.manual_seed(42)
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, tie_word_embeddings=False)
    base = os.path.join(dst, "base")
    MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(base)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t1", eos_token="t2").save_pretrained(base)
    model = MixtralForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=IGNORE))
    for name, size in (("one", "1GB"), ("sharded", shard_size)):
        model.save_pretrained(os.path.join(dst, name), save_compressed=True, max_shard_size=size)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
