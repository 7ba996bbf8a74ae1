"""What a server does with a k3convert checkpoint, per family and release.

`verify --serving SERVER` asks one question, a ``rules.ServingRequest`` (server, release, topology),
and gets one ``Check`` from ``check.serving_check``, the one entry. Inside: ``headers`` reads what DST says (config
and shard headers only), ``rules`` names the requirements, ``vllm`` and ``sglang`` decide each family's kernel,
``loaders`` and ``fp8_tp`` what a model's loader refuses at a topology, ``topology`` how vLLM splits
the MoE; ``converter.releases`` holds what is true of each release (its citations and facts), below
this package because the vLLM plugin reads it too.
"""
