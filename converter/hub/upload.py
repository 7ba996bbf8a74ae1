"""Publish a finished DST on the Hugging Face Hub: refuse unfinished or broken output, write a
model card that states what a server must know (int4 g32 symmetric, the expert activation as
the config states it), then upload. The card is ours: the source's README.md is kept beside it
as README.source.md (converter.run.plan) and never published as the int4 model's card.

Once DST verifies, the token is checked (``whoami``), before anything is written or hashed.
Then every file is read once and checked against the manifest's size and digest
(``publish``), and sent with huggingface_hub's operation API: ``preupload_lfs_files`` uploads the large files
(through hf_xet where installed, else LFS), the SHA-256 it computed of what it sent is compared with the
one checked, and only then ``create_commit`` makes one commit; small files are committed from
the bytes that were checked. Re-running the same command resumes: what the Hub already holds
is not sent again. (``upload_folder``/``upload_large_folder`` read DST on their own, after any
check of ours, and commit as they go: a changed byte would be published, and a partial upload
would show as a partial model.)

While it reads DST the upload holds DST's read lock (``locks.reading``): a run that would
change DST (a redo, ``--overwrite``, finalize) is refused meanwhile, and an upload is refused
while such a run holds it. Any other writer is caught by the checks above.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ..errors import BadInput, ConvertError, OutputError, VerifyFailed
from ..formats import checkpoint as ckpt, json_input
from ..run.outputs import accepted, listing
from ..run.plan import README_SOURCE
from ..safepath import open_regular, read_regular
from ..servers import headers, launches
from ..state.atomic import atomic_write
from ..state.files import MANIFEST
from ..state.locks import reading
from ..state.records import read_json
from ..verify import REPORT, verify
from . import publish
from .source import REPO_RULES, repo_id_ok

README = "README.md"
# what a loader may take for the model's weights: files of these kinds that this upload does not write are
# refused in the repository (or deleted in the same commit with --delete-stale): docs/publish.md
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz",
                   ".index.json")


@dataclass
class UploadResult:
    repo_id: str
    revision: str | None
    files: list[tuple[str, int]]      # (path in repo, bytes), what is (or would be) sent
    dry_run: bool
    readme: str                       # "written", "kept" (the user's own), "would write" or NOT_WRITTEN
    card: str | None = None           # the model card written (or that would be)
    method: str | None = None         # the HfApi method that committed
    url: str | None = None
    notes: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)   # other weight files removed by the commit (--delete-stale)

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.files)


def upload_files(dst: str) -> list[tuple[str, int]]:
    """Files of DST the upload sends, with sizes: those verify accepts (``outputs.accepted``)."""
    return _sized(dst, accepted(listing(dst), read_json(os.path.join(dst, MANIFEST)) or {}))


def _sized(dst: str, names: list[str]) -> list[tuple[str, int]]:
    return [(p, os.path.getsize(os.path.join(dst, p))) for p in names]


# --------------------------------------------------------------------------- model card

def base_model(dst: str, manifest: dict, override: str | None = None) -> str:
    """The source's ``_name_or_path`` (its config, else DST's copy of it), else the source dir's name."""
    if override:
        return override
    src = (manifest.get("source") or {}).get("path") or ""
    configs = ([os.path.join(src, "config.json")] if src else []) + [os.path.join(dst, "config.json")]
    for cfg in configs:
        try:
            name = (read_json(cfg) or {}).get("_name_or_path")
        except ConvertError:
            name = None
        if name:
            return str(name)
    return os.path.basename(src.rstrip("/")) or "unknown"


def _fmt(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def error_table(report: dict, limit: int = 10) -> str:
    """The worst ``limit`` layers by worst relative RMSE, as a markdown table, plus the totals."""
    layers = sorted(report.get("layers") or [], key=lambda r: -r["rel_rmse_worst"])
    rows = ["| layer | tensors | rel. RMSE mean | rel. RMSE worst | SNR dB (min) | output rel. err (worst) |",
            "|---:|---:|---:|---:|---:|---:|"]
    for r in layers[:limit]:
        rows.append(f"| {'-' if r['layer'] is None else r['layer']} | {r['tensors']} | {_fmt(r['rel_rmse_mean'])} "
                    f"| {_fmt(r['rel_rmse_worst'])} | {_fmt(r['snr_db_worst'], '.2f')} "
                    f"| {_fmt(r.get('out_rel_worst'))} |")
    worst = report.get("worst") or {}
    snr = min((r["snr_db_worst"] for r in layers), default=None)
    head = (f"Overall: {report.get('tensors')} converted tensors, relative RMSE mean "
            f"**{_fmt(report.get('rel_rmse_mean'))}**, worst **{_fmt(worst.get('rel_rmse'))}** "
            f"(`{worst.get('tensor')}`), lowest SNR {_fmt(snr, '.2f')} dB. "
            f"{'The' if len(layers) <= limit else f'The {limit} worst of {len(layers)}'} layers:")
    return head + "\n\n" + "\n".join(rows)


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def model_card(dst: str, base: str | None = None, repo_id: str | None = None) -> str:
    """README.md for DST, from its manifest, report and config."""
    manifest = read_json(os.path.join(dst, MANIFEST)) or {}
    report = read_json(os.path.join(dst, REPORT)) or {}
    config = read_json(os.path.join(dst, "config.json")) or {}
    name = base_model(dst, manifest, base)
    act = manifest.get("activation") or {}
    where = ", ".join(f"`{'.'.join(p)}`" for p, _ in ckpt.quant_blocks(config)) or "-"
    size = sum(int(r.get("bytes", 0)) for r in (manifest.get("shards") or {}).values())
    src = (manifest.get("source") or {}).get("path", "SRC")
    opts = manifest.get("options") or {}
    cmd = f"k3convert mxfp4-to-int4 {os.path.basename(src.rstrip('/'))} -o {os.path.basename(dst.rstrip('/'))}"
    if report.get("max_rel_rmse") is not None:
        cmd += f" --max-rel-rmse {report['max_rel_rmse']}"
    if opts.get("sample_experts") is not None:
        cmd += f" --sample-experts {opts['sample_experts']}"
    repo = repo_id or "<repo>"
    front = ["---"]
    if repo_id_ok(name):
        front += [f"base_model: {name}", "base_model_relation: quantized"]
    front += ["tags:", "- compressed-tensors", "- int4", "- w4a16", "- k3convert", "---", ""]
    activation, serving_act = activation_section(act)
    serving = launches.section(*headers.load(dst), repo, custom_tokenizer=_custom_tokenizer(dst))
    source_card = (f"\nThe source model's own card is kept beside this one as `{README_SOURCE}`.\n"
                   if os.path.exists(os.path.join(dst, README_SOURCE)) else "")
    bf16 = [m for m in (manifest.get("source") or {}).get("dequantized") or [] if isinstance(m, str)]
    others = (f"The source's {len(bf16)} other MXFP4 linear(s) (e.g. `{bf16[0]}`) are plain bf16 weights "
              "holding exactly their MXFP4 values; everything else" if bf16 else "Everything else")
    body = f"""# {name.split('/')[-1]} — int4 (group 32) routed experts

An int4 version of **{name}**: the routed-expert weights, published as MXFP4, requantized to
int4 with one bf16 scale per 32 weights, in the compressed-tensors `pack-quantized` format. Which
servers run it, and with which command, is under *Serving*: each line there was checked against
this checkpoint. {others} is byte-identical to the source.
{source_card}
## Quantization

- Routed experts (`...experts.{{E}}.{{w1,w2,w3}}`): int4, **group size 32, symmetric**, one **bf16 scale**
  per group (dequantized value = q × scale, q in [-8, 7]); no activation quantization (W4A16).
- Tensors per expert matrix: `weight_packed` int32 `[out, in/8]` (eight q+8 nibbles per word, least
  significant first), `weight_scale` bf16 `[out, in/32]`, `weight_shape` int64 `[out, in]`.
- `quantization_config`: `quant_method: compressed-tensors`, `format: pack-quantized`, stated at {where}
  (every block that described MXFP4 was replaced, top-level and nested; the `ignore` list is kept).
- Attention, shared experts, router, embeddings, norms, vision tower: unchanged from the source{
    ' (MXFP4 ones decoded to bf16, exactly)' if bf16 else ''}.{_fp8_bf16_line(manifest)}
- Size: {_size(size)} in {len(manifest.get('shards') or {})} shard(s).

{activation}
These are stated in `config.json`, in every shard's safetensors metadata, and in `{MANIFEST}`.

## How it was converted

- Tool: k3convert {manifest.get('version', __version__)} (`{manifest.get('source_format')}` →
  `{manifest.get('target_format')}`), finished {manifest.get('finished_at', '-')}.
- Command (reconstructed from the manifest): `{cmd}`
- Each MXFP4 block of 32 weights is mapped to the int4 group with the least squared error over every
  bf16 scale (an exact search, not round-to-nearest with amax/7.5).
- `{MANIFEST}` holds a digest of every shard (SHA-256 over its 64 MiB chunks); `k3convert verify`
  re-checks them and the structure.

## Error against the MXFP4 weights

Relative RMSE = ‖W_int4 − W_mxfp4‖ / ‖W_mxfp4‖ per tensor; output error = the same on y = W x for a fixed
random x (sampled experts). Per-tensor figures: `{report.get('tensor_table', 'k3convert_tensors.jsonl.zst')}`.

{error_table(report)}

{serving}
### Any other server

- It must support this model's architecture (`{config.get('model_type')}`,
  {', '.join(config.get('architectures') or []) or '-'}){serving_act}.
- It must read the quantization config where it sits ({where}) and support
  compressed-tensors **W4A16 MoE with group size 32, symmetric**, and hold {_size(size)} of weights plus
  the KV cache across its GPUs.
"""
    return "\n".join(front) + body


def _fp8_bf16_line(manifest: dict) -> str:
    """A card bullet for the FP8 linears written as bf16 (formats/fp8_mxfp4.py ``fp8_to_bf16``), or ''."""
    rec = (((manifest.get("source") or {}).get("quantization") or {}).get("fp8_to_bf16") or {})
    mods = [m for m in rec.get("modules") or [] if isinstance(m, str)]
    if not mods:
        return ""
    why = "; ".join(w for w in rec.get("why") or [] if isinstance(w, str))
    return (f"\n- Except {len(mods)} FP8 linear(s) (e.g. `{mods[0]}`) written as bf16 ({why}): "
            f"{rec.get('values', '')}.")


def _custom_tokenizer(dst: str) -> bool:
    """Whether DST's tokenizer_config.json maps a class to the repository's code (``auto_map``), which
    vLLM then loads only with --trust-remote-code. Untrusted: anything unreadable counts as no."""
    data = _read_regular(os.path.join(dst, "tokenizer_config.json"))
    try:
        cfg = json_input.loads(data.decode(), constants=True) if data else None
    except (ValueError, UnicodeDecodeError):
        cfg = None
    return isinstance(cfg, dict) and "auto_map" in cfg


def activation_section(act: dict) -> tuple[str, str]:
    """The card's activation section and its serving caveat, as the config states the activation
    (the manifest's ``activation``): SiTU with its betas, or whatever else it names."""
    name = act.get("hidden_act")
    fields = ", ".join(f"`{k}: {v}`" for k, v in act.items())
    if name == "situ":
        return (f"""## Expert activation: SiTU, not SiLU

The experts use SiTU: `a = beta * tanh(g / beta) * sigmoid(g)`, `u = linear_beta * tanh(u / linear_beta)`,
`out = a * u` (g = w1 x, u = w3 x), with {fields}.
A kernel that assumes SiLU loads this checkpoint without complaint and produces garbage.""",
                " **including the SiTU expert activation** with the parameters above; check that its logs do "
                "not fall back to SiLU")
    return (f"""## Expert activation: {name}

The experts use the activation the source's config names, unchanged by the conversion: {fields or '-'}.""",
            f" with its `{name}` expert activation")


def _read_regular(path: str) -> bytes | None:
    """A regular file's bytes; None if it is missing, unreadable or anything else (a FIFO is
    never waited on: the path may come from DST's manifest, which is untrusted)."""
    try:
        return read_regular(path)
    except (ConvertError, OSError):
        return None


def _source_card(dst: str, theirs: bytes | None) -> bool:
    """Whether DST's README.md is the source's card ``theirs`` (earlier k3convert versions copied it there)."""
    return theirs is not None and _read_regular(os.path.join(dst, README)) == theirs


# --------------------------------------------------------------------------- upload

CARD_LINES = 24  # lines of the model card `upload --dry-run` shows


def card_preview(card: str, lines: int = CARD_LINES) -> str:
    """The first ``lines`` of the model card, indented, and how many more there are."""
    text = card.splitlines()
    more = f"\n    ... ({len(text) - lines} more lines)" if len(text) > lines else ""
    return f" (the model card, {len(text)} lines):\n" + "\n".join(f"    {t}".rstrip() for t in text[:lines]) + more


def one_line(e: BaseException, limit: int = 400) -> str:
    """An exception's message on one line. huggingface_hub's HTTP errors span several (status,
    a documentation link, the server's words): for them, the status, the URL and the server's message."""
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    if response is not None and isinstance(status, int):
        try:
            url = f" on {response.request.method} {response.request.url}"
        except Exception:  # a response built without its request
            url = ""
        said = getattr(e, "server_message", None)
        text = (f"HTTP {status} {getattr(response, 'reason_phrase', '') or ''}".rstrip() + url
                + (f": {said}" if said else ""))
    else:
        text = str(e)
    text = " ".join(text.split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _xet_available() -> bool:
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:  # private module moved: cannot tell, say nothing
        return True
    return bool(is_xet_available())


NOT_WRITTEN = "sent, not written to DST (DST is read-only)"


def _manifest(dst: str) -> tuple[dict, bytes]:
    """DST's manifest, parsed from the bytes that are published with it."""
    manifest, data = None, None
    if os.path.isdir(dst):
        try:
            with os.fdopen(open_regular(os.path.join(dst, MANIFEST), missing_ok=True), "rb") as f:
                data = f.read()
            manifest = json_input.loads(data.decode(), constants=True)
        except FileNotFoundError:
            pass
        except (ConvertError, OSError, ValueError, UnicodeDecodeError):  # a FIFO or device too
            raise BadInput(f"{MANIFEST} is not valid JSON", file=dst) from None
    if data is None:
        raise BadInput(f"no {MANIFEST}: not a k3convert output directory", file=dst)
    if not isinstance(manifest, dict):
        raise BadInput(f"{MANIFEST} is not valid JSON", file=dst)
    return manifest, data


def upload(dst: str, repo_id: str, *, private: bool = False, revision: str | None = None, dry_run: bool = False,
           token: str | None = None, verify_checksums: bool = False, base: str | None = None,
           endpoint: str | None = None, api: Any = None, delete_stale: bool = False) -> UploadResult:
    """Check DST, write its model card if it has none, and upload it to ``repo_id`` (a model repo).

    Refuses (VerifyFailed, exit 5) unless the manifest says complete, the structural checks
    pass and every file's bytes are the manifest's (read once, and those bytes are what is
    committed); BadInput (exit 2) for a repo id the Hub would refuse (first), a missing or
    refused token, one that cannot write to ``repo_id``, or a repository that holds other weight
    files (``delete_stale``: they are deleted in the same commit), all checked once DST verifies
    and before anything is written or hashed; OutputError (exit 4) while a run changes DST (its
    read lock) or when the Hub cannot be reached. ``dry_run``: only list what would be sent;
    nothing is written, nothing is sent, no lock is taken, and shards are hashed only with
    ``verify_checksums``.
    """
    dst = os.path.abspath(dst)
    if not repo_id_ok(repo_id):
        raise BadInput(f"{repo_id!r} is not a Hub repo id OWNER/NAME ({REPO_RULES})")
    manifest, manifest_bytes = _manifest(dst)
    if manifest.get("complete") is not True:
        raise VerifyFailed(f"the manifest says the conversion is not complete (status {manifest.get('status')!r}): "
                           "finish it before uploading", file=dst)
    if dry_run:  # nothing written, nothing sent: what it lists is a snapshot, no lock needed
        return _with_card(dst, *_verified(dst, manifest, True, verify_checksums), repo_id, revision, True, base)
    if api is None:
        from huggingface_hub import HfApi
        api = HfApi(endpoint=endpoint, token=token)
    with reading(dst):  # DST unchanged by our own runs from verify to the last byte sent (S14)
        # the shards' digests are checked below, as they are read for sending: not twice
        verified = _verified(dst, manifest, False, False)  # a broken DST is refused offline
        # the token and the repository, before the card is written and hours of hashing (issue 33 §3, H8, H12)
        _authorize(api, repo_id)
        target = _target(api, repo_id, revision, {README, *verified[0].files}, delete_stale)
        result = _with_card(dst, *verified, repo_id, revision, False, base)
        result.deleted = target.stale
        in_memory = {MANIFEST: manifest_bytes}
        readme = result.card.encode() if result.card is not None else _read_regular(os.path.join(dst, README))
        if readme is None:
            raise OutputError("README.md cannot be read", file=dst)
        in_memory[README] = readme
        checked = publish.check(dst, [p for p, _ in result.files], manifest, in_memory)  # T1
        _send(result, dst, checked, private, api, target)
    if private:
        result.notes.append("an existing repository keeps its visibility: --private applies to a new one")
    return result


def _verified(dst: str, manifest: dict, dry_run: bool, verify_checksums: bool) -> tuple[Any, bytes | None]:
    """DST verified (VerifyFailed otherwise), and the source's card as read (None: none)."""
    readme_path = os.path.join(dst, README)
    src = (manifest.get("source") or {}).get("path")
    theirs = _read_regular(os.path.join(src, README)) if isinstance(src, str) and src else None  # read once
    if not dry_run and _source_card(dst, theirs) and not os.path.exists(os.path.join(dst, README_SOURCE)):
        try:  # the source's card is not ours to publish: back to the name the manifest records it by
            os.replace(readme_path, os.path.join(dst, README_SOURCE))
        except OSError as e:
            raise OutputError(f"cannot rename README.md to {README_SOURCE}: {e.strerror}", file=dst) from None
    # the publishing gate: the config's selection decided by compressed-tensors' own matcher too
    verified = verify(dst, checksums=verify_checksums, loader_matcher=True)
    verified.raise_if_failed()  # only regular files pass (a FIFO README.md included: S16)
    return verified, theirs


def _with_card(dst: str, verified: Any, theirs: bytes | None, repo_id: str, revision: str | None, dry_run: bool,
               base: str | None) -> UploadResult:
    """Write (or, dry or on a read-only DST, compose) DST's card: what the upload sends, by name and size."""
    readme_path = os.path.join(dst, README)
    files = _sized(dst, [p for p in verified.files if p != README])  # exactly what verify accepted
    card = None
    if README in verified.files and not _source_card(dst, theirs):
        readme = "kept"
    else:
        card = model_card(dst, base, repo_id)
        if dry_run:
            readme = "would write"
        elif not os.access(dst, os.W_OK):  # read-only storage (T17): published from memory
            readme = NOT_WRITTEN
        else:
            readme = "written"
            atomic_write(readme_path, card.encode())
    size = len(card.encode()) if card is not None else os.path.getsize(readme_path)
    return UploadResult(repo_id, revision, sorted(files + [(README, size)]), dry_run, readme, card)


def _network(e: BaseException) -> bool:
    """Whether ``e`` is the network's (a refused connection, a timeout, offline mode), not the Hub's answer."""
    from huggingface_hub.errors import HfHubHTTPError

    module = type(e).__module__.split(".")[0]
    return not isinstance(e, HfHubHTTPError) and (module in ("httpx", "httpx2", "requests", "urllib3")
                                                  or isinstance(e, OSError))


def _hub_call(endpoint: str, what: str, step: Any) -> Any:
    """``step()``, a question to the Hub before any work: the network's failure is exit 4, the Hub's
    answer (other than the ones the caller handles) one line, exit 1; neither is a resume."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return step()
    except Exception as e:
        if _network(e):
            raise OutputError(f"cannot reach {endpoint}: {one_line(e)}") from None
        if isinstance(e, (HfHubHTTPError, ValueError)):
            raise ConvertError(f"cannot {what} with {endpoint}: {one_line(e)}") from None
        raise


def _authorize(api: Any, repo_id: str) -> None:
    """The token, checked with the Hub before anything is hashed or sent: missing or refused is
    exit 2, a read-only token too, and a fine-grained one that cannot write to ``repo_id``; the
    Hub out of reach is exit 4, with the cause."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    endpoint = getattr(api, "endpoint", None) or "the Hub"
    login = "log in with `hf auth login`, set HF_TOKEN, or pass --token"

    def whoami():
        try:
            return api.whoami()
        except LocalTokenNotFoundError:
            raise BadInput(f"no Hugging Face token: {login}") from None
        except HfHubHTTPError as e:
            if getattr(e.response, "status_code", None) == 401:
                raise BadInput(f"the Hub refused the token ({one_line(e)}): {login}") from None
            raise

    token = ((_hub_call(endpoint, "check the token", whoami) or {}).get("auth") or {}).get("accessToken") or {}
    name = f" {token['displayName']!r}" if isinstance(token.get("displayName"), str) else ""
    if token.get("role") == "read":
        raise BadInput(f"the token{name} is read-only: upload needs a write token; {login}")
    if token.get("role") == "fineGrained" and not can_write(token.get("fineGrained"), repo_id):
        raise BadInput(f"the fine-grained token{name} cannot write to {repo_id} (it has no repo.write on "
                       f"{repo_id.split('/')[0]} or on the repository): grant it that, or use a write token; {login}")


def can_write(grants: Any, repo_id: str) -> bool:
    """Whether a fine-grained token's grants (whoami's ``accessToken.fineGrained``) include writing to
    ``repo_id``: ``repo.write`` on its owner (a user or an organization), on the repository itself, or
    everywhere. Anything unreadable counts as no."""
    if not isinstance(grants, dict):
        return False
    owner = repo_id.split("/")[0]
    if "repo.write" in (grants.get("global") or []):
        return True
    for scope in grants.get("scoped") or []:
        entity = scope.get("entity") if isinstance(scope, dict) else None
        if not isinstance(entity, dict) or "repo.write" not in (scope.get("permissions") or []):
            continue
        kind, name = entity.get("type"), entity.get("name")
        if (kind in ("user", "org") and name == owner) or name == repo_id:
            return True
    return False


@dataclass(frozen=True)
class Target:
    """The branch the commit lands on, as listed before any work: its commit (None: no repository
    yet) and the weight files in it that the upload does not write (``stale``: deleted by the commit)."""

    parent: str | None
    stale: list[str]


def weight_file(path: str) -> bool:
    """Whether a loader may take ``path`` for the model's weights (``WEIGHT_SUFFIXES``)."""
    return path.lower().endswith(WEIGHT_SUFFIXES)


def _target(api: Any, repo_id: str, revision: str | None, ours: set[str], delete_stale: bool) -> Target:
    """What ``repo_id`` holds on ``revision`` (a branch to be made: on the default branch it starts
    from). Weight files that this upload does not write are refused (BadInput, exit 2) unless
    ``delete_stale``: a loader may take them beside the new model (H8, docs/decisions.md)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    endpoint = getattr(api, "endpoint", None) or "the Hub"

    def listing():
        try:
            try:
                return api.model_info(repo_id, revision=revision)
            except RevisionNotFoundError:  # a new branch: made from the default one
                return api.model_info(repo_id)
        except RepositoryNotFoundError:
            return None

    info = _hub_call(endpoint, f"list {repo_id}", listing)
    if info is None:
        return Target(None, [])
    held = sorted(s.rfilename for s in (getattr(info, "siblings", None) or []))
    stale = [p for p in held if weight_file(p) and p not in ours]
    if stale and not delete_stale:
        shown = ", ".join(stale[:5]) + (f" (and {len(stale) - 5} more)" if len(stale) > 5 else "")
        raise BadInput(f"{repo_id}{f'@{revision}' if revision else ''} holds weight files this upload does not "
                       f"replace: {shown}; a loader may load them beside the new model. Pass --delete-stale to "
                       "delete them in the same commit, or upload to another repository or --revision")
    return Target(getattr(info, "sha", None), stale)


def _send(result: UploadResult, dst: str, checked: list[publish.Checked], private: bool, api: Any,
          target: Target) -> None:
    """Create the repository (and branch), upload exactly ``checked`` and commit it once (deleting
    ``target.stale`` in it), after each large file is proven to be what was sent (``publish.confirm``).
    A Hub failure that a rerun may get past (the network, HTTP 408/429/5xx) says how to resume; one
    that it cannot (any other refusal) does not."""
    from huggingface_hub import CommitOperationDelete

    repo_id, revision = result.repo_id, result.revision
    xet = _xet_available()
    sending = publish.operations(dst, checked, xet)

    def hub(step):
        try:
            return step()
        except Exception as e:  # the Hub or the network: one line; anything else is a bug
            sending.raise_if_changed()  # a file found changed as it was sent: that, not huggingface_hub's wrapping
            raise _hub_error(e, repo_id) from None

    try:
        result.url = str(hub(lambda: api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)))
        if revision and revision != "main":
            hub(lambda: api.create_branch(repo_id, repo_type="model", branch=revision, exist_ok=True))
        if not xet:
            result.notes.append("hf_xet is not installed (or HF_HUB_DISABLE_XET is set): files went by the LFS "
                                "protocol, which resumes file by file; `pip install hf_xet` for large uploads")
        hub(lambda: api.preupload_lfs_files(repo_id, additions=sending.ops, repo_type="model", revision=revision))
        publish.confirm(checked, sending)  # T2, H6: what the commit names is what was checked and sent
        deletes = [CommitOperationDelete(path_in_repo=p) for p in target.stale]
        hub(lambda: api.create_commit(repo_id, operations=[*sending.ops, *deletes], repo_type="model",
                                      revision=revision, parent_commit=target.parent,
                                      commit_message=f"int4 group-32 experts converted by k3convert {__version__}"))
    finally:
        sending.close()
    result.method = "create_commit"
    if target.stale:
        result.notes.append(f"deleted {len(target.stale)} other weight file(s) in the same commit (--delete-stale): "
                            + ", ".join(target.stale))


RESUMABLE = (408, 429)  # and 5xx: the Hub's own trouble, which a rerun may get past


def _hub_error(e: BaseException, repo_id: str) -> BaseException:
    """One line for a failed Hub call of the upload: the network's is exit 4 and a rerun resumes; an
    HTTP 408/429/5xx answer is exit 1 and a rerun may resume; any other answer is a refusal a rerun
    would meet again (401/403: the token, exit 2). Anything else is a bug, raised as it is."""
    from huggingface_hub.errors import HfHubHTTPError

    while isinstance(e, RuntimeError) and e.__cause__ is not None:  # "Error while uploading X" around the cause
        e = e.__cause__
    if not isinstance(e, (HfHubHTTPError, ValueError)) and not _network(e):
        return e
    said = f"upload to {repo_id} failed: {one_line(e)}"
    if _network(e):
        return OutputError(f"{said}. Run the same command again to resume")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(status, int) and (status in RESUMABLE or status >= 500):
        return ConvertError(f"{said}. Run the same command again to resume")
    if status in (401, 403):
        return BadInput(f"{said}: the token cannot write there")
    return ConvertError(said)
