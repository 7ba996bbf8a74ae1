"""File formats: safetensors shards, the HF checkpoint directory, MXFP4 and int4 layouts."""
