"""File formats: safetensors shards, the HF checkpoint directory, MXFP4 and int4 layouts.

Source dialects are modules of their own (``compressed_tensors``, ``quark``), each registering a
``dialect.Dialect`` by name; a profile's ``source`` names the one that reads a checkpoint.
``dialect`` holds what they share and imports neither; ``checkpoint`` imports both.
"""
