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
import re
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

README = "README.md"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
    if _REPO_ID.match(name):
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
           endpoint: str | None = None, api: Any = None) -> UploadResult:
    """Check DST, write its model card if it has none, and upload it to ``repo_id`` (a model repo).

    Refuses (VerifyFailed, exit 5) unless the manifest says complete, the structural checks
    pass and every file's bytes are the manifest's (read once, and those bytes are what is
    committed); BadInput (exit 2) for a missing or refused token, checked once DST verifies and
    before anything is written or hashed; OutputError (exit 4) while a run changes DST (its read
    lock) or when the Hub cannot be reached. ``dry_run``: only list what would be sent; nothing
    is written, nothing is sent, no lock is taken, and shards are hashed only with
    ``verify_checksums``.
    """
    dst = os.path.abspath(dst)
    if not _REPO_ID.match(repo_id):
        raise BadInput(f"repo id {repo_id!r} is not of the form owner/name")
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
        _authorize(api)  # before the card is written and hours of hashing (issue 33 §3)
        result = _with_card(dst, *verified, repo_id, revision, False, base)
        in_memory = {MANIFEST: manifest_bytes}
        readme = result.card.encode() if result.card is not None else _read_regular(os.path.join(dst, README))
        if readme is None:
            raise OutputError("README.md cannot be read", file=dst)
        in_memory[README] = readme
        checked = publish.check(dst, [p for p, _ in result.files], manifest, in_memory)  # T1
        _send(result, dst, checked, private, api)
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


def _authorize(api: Any) -> None:
    """The token, checked with the Hub before anything is hashed or sent: missing or refused is
    exit 2, a read-only token too; the Hub out of reach is exit 4, with the cause."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    endpoint = getattr(api, "endpoint", None) or "the Hub"
    login = "log in with `hf auth login`, set HF_TOKEN, or pass --token"
    try:
        who = api.whoami()
    except LocalTokenNotFoundError:
        raise BadInput(f"no Hugging Face token: {login}") from None
    except Exception as e:
        if isinstance(e, HfHubHTTPError) and getattr(e.response, "status_code", None) == 401:
            raise BadInput(f"the Hub refused the token ({one_line(e)}): {login}") from None
        if _network(e):
            raise OutputError(f"cannot reach {endpoint}: {one_line(e)}") from None
        if isinstance(e, (HfHubHTTPError, ValueError)):
            raise ConvertError(f"cannot check the token with {endpoint}: {one_line(e)}") from None
        raise
    token = ((who or {}).get("auth") or {}).get("accessToken") or {}
    if token.get("role") == "read":
        name = f" {token['displayName']!r}" if isinstance(token.get("displayName"), str) else ""
        raise BadInput(f"the token{name} is read-only: upload needs a write token; {login}")


def _send(result: UploadResult, dst: str, checked: list[publish.Checked], private: bool, api: Any) -> None:
    """Create the repository (and branch), upload exactly ``checked`` and commit it once, after
    each large file's SHA-256 as sent is found to be the one checked (``publish.confirm``). A
    Hub failure is one line saying how to resume (exit 1); the network's is exit 4."""
    repo_id, revision = result.repo_id, result.revision

    def hub(step):
        try:
            return step()
        except Exception as e:  # the Hub or the network: one line and how to resume; anything else is a bug
            from huggingface_hub.errors import HfHubHTTPError
            if not isinstance(e, (HfHubHTTPError, ValueError)) and not _network(e):
                raise
            error = OutputError if _network(e) else ConvertError
            raise error(f"upload to {repo_id} failed: {one_line(e)}. Run the same command again to resume") \
                from None

    result.url = str(hub(lambda: api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)))
    if revision and revision != "main":
        hub(lambda: api.create_branch(repo_id, repo_type="model", branch=revision, exist_ok=True))
    ops = publish.operations(dst, checked)
    if not _xet_available():
        result.notes.append("hf_xet is not installed (or HF_HUB_DISABLE_XET is set): files went by the LFS "
                            "protocol, which resumes file by file; `pip install hf_xet` for large uploads")
    hub(lambda: api.preupload_lfs_files(repo_id, additions=ops, repo_type="model", revision=revision))
    publish.confirm(checked, ops)  # T2: what the commit names is what was checked
    hub(lambda: api.create_commit(repo_id, operations=ops, repo_type="model", revision=revision,
                                  commit_message=f"int4 group-32 experts converted by k3convert {__version__}"))
    result.method = "create_commit"
