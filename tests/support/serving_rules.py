"""Tests' shorthand for the serving check: a server name and a TP size (or Topology) become the
ServingRequest that `verify --serving` builds at its edge (converter/servers)."""
from __future__ import annotations

from converter.servers import check
from converter.servers.context import Context
from converter.servers.headers import layer_sizes, load, matrices  # noqa: F401  (re-exported for tests)
from converter.servers.memory import experts_of
from converter.servers.rules import RuleResult, ServingRequest, Verdict  # noqa: F401
from converter.servers.topology import Topology

passing_tp = check.passing_tp


def request(server: str, tp: int | Topology = 1, vllm: str | None = None, verbose: bool = False) -> ServingRequest:
    return ServingRequest.parse(server, tp, vllm=vllm, verbose=verbose)


def rules(dst: str, server: str, tp: int | Topology = 1, vllm: str | None = None) -> list[RuleResult]:
    """Every rule's result for DST on disk."""
    return check.check_serving(dst, request(server, tp, vllm))


def rules_of(config, tensors, server: str, tp: int | Topology = 1, vllm: str | None = None) -> list[RuleResult]:
    return check.evaluate(config, tensors, request(server, tp, vllm))


def check_of(config, tensors, server: str, tp: int | Topology = 1, vllm: str | None = None, verbose: bool = False):
    """The "serving" Check verify prints."""
    return check.serving_check(config, tensors, request(server, tp, vllm, verbose))


def ctx_of(config, tensors, server: str, vllm: str | None = None) -> Context:
    return check.context(config, tensors, request(server, 1, vllm))


def kernel(server: str, config, mats, sizes, tp: int | Topology = 1, vllm: str | None = None) -> Verdict:
    """The kernel verdict for given matrices and layer sizes (no other rule)."""
    req = request(server, tp, vllm)
    ctx = Context(config, mats, dict(sizes), experts_of(mats, sizes, config), {}, req.server)
    return check.FAMILIES[req.server.family](ctx, req.topology)
