"""k3convert: requantize Kimi K3's MXFP4 routed experts to int4 group 32, once, offline."""

__version__ = "0.1.0"
