"""Publish a finished DST on the Hugging Face Hub: refuse unfinished or broken output, write a
model card that states what a server must know (int4 g32 symmetric, the expert activation as
the config states it), then upload. The card is ours: the source's README.md is kept beside it
as README.source.md (converter.plan) and never published as the int4 model's card.

The upload goes through huggingface_hub's resumable large-folder path: ``upload_folder`` where
the installed version streams it (``huggingface_hub._upload_pipeline``: multi-commit, resumable
by re-running when hf_xet is installed; from then on ``upload_large_folder`` is deprecated and
prints a banner), else ``upload_large_folder`` where it exists (0.x, early 1.x), else
``upload_folder``. Either way re-running the same command resumes an interrupted upload.

While it reads DST the upload holds DST's read lock (``manifest.reading``): a run that would
change DST (a redo, ``--overwrite``, finalize) is refused meanwhile, and an upload is refused
while such a run holds it, so what is sent is what verify accepted.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Any

from . import __version__
from .errors import BadInput, ConvertError, OutputError, VerifyFailed
from .formats import checkpoint as ckpt
from .manifest import MANIFEST, STATE_DIR, atomic_write, read_json, reading
from .outputs import accepted, listing
from .plan import README_SOURCE
from .safepath import read_regular
from .verify import REPORT, verify

IGNORE = [f"{STATE_DIR}/**", "*.partial"]  # never sent either way: what is sent is named (allow_patterns)
README = "README.md"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class UploadResult:
    repo_id: str
    revision: str | None
    files: list[tuple[str, int]]      # (path in repo, bytes), what is (or would be) sent
    dry_run: bool
    readme: str                       # "written", "kept" (the user's own) or "would write"
    card: str | None = None           # the model card written (or that would be)
    method: str | None = None         # the HfApi method used
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
                    f"| {_fmt(r['rel_rmse_worst'])} | {_fmt(r['snr_db_worst'], '.2f')} | {_fmt(r.get('out_rel_worst'))} |")
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
    source_card = (f"\nThe source model's own card is kept beside this one as `{README_SOURCE}`.\n"
                   if os.path.exists(os.path.join(dst, README_SOURCE)) else "")
    bf16 = [m for m in (manifest.get("source") or {}).get("dequantized") or [] if isinstance(m, str)]
    others = (f"The source's {len(bf16)} other MXFP4 linear(s) (e.g. `{bf16[0]}`) are plain bf16 weights "
              "holding exactly their MXFP4 values; everything else" if bf16 else "Everything else")
    body = f"""# {name.split('/')[-1]} — int4 (group 32) routed experts

An int4 version of **{name}**: the routed-expert weights, published as MXFP4, requantized to
int4 with one bf16 scale per 32 weights, in the compressed-tensors `pack-quantized` format that
vLLM and SGLang load directly. {others} is byte-identical to the source.
{source_card}
## Quantization

- Routed experts (`...experts.{{E}}.{{w1,w2,w3}}`): int4, **group size 32, symmetric**, one **bf16 scale**
  per group (dequantized value = q × scale, q in [-8, 7]); no activation quantization (W4A16).
- Tensors per expert matrix: `weight_packed` int32 `[out, in/8]` (eight q+8 nibbles per word, least
  significant first), `weight_scale` bf16 `[out, in/32]`, `weight_shape` int64 `[out, in]`.
- `quantization_config`: `quant_method: compressed-tensors`, `format: pack-quantized`, stated at {where}
  (every block that described MXFP4 was replaced, top-level and nested; the `ignore` list is kept).
- Attention, shared experts, router, embeddings, norms, vision tower: unchanged from the source{
    ' (MXFP4 ones decoded to bf16, exactly)' if bf16 else ''}.
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

## Serving (vLLM, SGLang)

- The server must support this model's architecture (`{config.get('model_type')}`,
  {', '.join(config.get('architectures') or []) or '-'}){serving_act}.
- It must read the quantization config where it sits ({where}) and support
  compressed-tensors **W4A16 MoE with group size 32, symmetric** (vLLM: the compressed-tensors
  W4A16 MoE path, Marlin on CUDA; on ROCm gfx942 its W4A16 MoE path).
- Pass `--trust-remote-code` if the architecture is served from the repository's code, and shard across
  enough GPUs for {_size(size)} of weights plus KV cache (e.g. `--tensor-parallel-size 8` / `--tp 8`).

```
vllm serve {repo} --trust-remote-code --tensor-parallel-size 8
python -m sglang.launch_server --model-path {repo} --trust-remote-code --tp 8
```
"""
    return "\n".join(front) + body


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

def streams_upload_folder() -> bool:
    """Whether the installed huggingface_hub's ``upload_folder`` is its streamed, multi-commit,
    resumable path (``_upload_pipeline``; 1.3x on), which it then recommends over the deprecated
    ``upload_large_folder``. Decided by what the installed code holds, not by its warning."""
    try:
        return importlib.util.find_spec("huggingface_hub._upload_pipeline") is not None
    except (ImportError, ValueError):
        return False


def upload_method(api: Any) -> str:
    """The HfApi method that sends a large folder resumably with the installed huggingface_hub."""
    if streams_upload_folder() and hasattr(api, "upload_folder") or not hasattr(api, "upload_large_folder"):
        return "upload_folder"
    return "upload_large_folder"


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
    if isinstance(status, int):
        try:
            url = f" on {response.request.method} {response.request.url}"
        except Exception:  # a response built without its request
            url = ""
        said = getattr(e, "server_message", None)
        text = f"HTTP {status} {getattr(response, 'reason_phrase', '') or ''}".rstrip() + url + (f": {said}" if said else "")
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


def upload(dst: str, repo_id: str, *, private: bool = False, revision: str | None = None, dry_run: bool = False,
           token: str | None = None, verify_checksums: bool = False, base: str | None = None,
           endpoint: str | None = None, api: Any = None) -> UploadResult:
    """Check DST, write its model card if it has none, and upload it to ``repo_id`` (a model repo).

    Refuses (VerifyFailed, exit 5) unless the manifest says complete and the structural checks
    pass; OutputError (exit 4) while a run changes DST (its read lock). ``dry_run``: only list
    what would be sent; nothing is written, nothing is sent, no lock is taken.
    """
    dst = os.path.abspath(dst)
    if not _REPO_ID.match(repo_id):
        raise BadInput(f"repo id {repo_id!r} is not of the form owner/name")
    try:
        manifest = read_json(os.path.join(dst, MANIFEST)) if os.path.isdir(dst) else None
    except ConvertError:
        raise BadInput(f"{MANIFEST} is not valid JSON", file=dst) from None
    if manifest is None:
        raise BadInput(f"no {MANIFEST}: not a k3convert output directory", file=dst)
    if manifest.get("complete") is not True:
        raise VerifyFailed(f"the manifest says the conversion is not complete (status {manifest.get('status')!r}): "
                           "finish it before uploading", file=dst)
    if dry_run:  # nothing written, nothing sent: what it lists is a snapshot, no lock needed
        return _checked(dst, manifest, repo_id, revision, True, verify_checksums, base)
    with reading(dst):  # DST unchanged from verify to the last byte sent (S14)
        result = _checked(dst, manifest, repo_id, revision, False, verify_checksums, base)
        _send(result, dst, private, token, endpoint, api)
    if private:
        result.notes.append("an existing repository keeps its visibility: --private applies to a new one")
    return result


def _checked(dst: str, manifest: dict, repo_id: str, revision: str | None, dry_run: bool,
             verify_checksums: bool, base: str | None) -> UploadResult:
    """Verify DST and write (or, dry, compose) its card: what the upload sends, by name and size."""
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
    files = _sized(dst, [p for p in verified.files if p != README])  # exactly what verify accepted
    card = None
    if README in verified.files and not _source_card(dst, theirs):
        readme = "kept"
    else:
        card = model_card(dst, base, repo_id)
        readme = "would write" if dry_run else "written"
        if not dry_run:
            atomic_write(readme_path, card.encode())
    size = len(card.encode()) if card is not None else os.path.getsize(readme_path)
    return UploadResult(repo_id, revision, sorted(files + [(README, size)]), dry_run, readme, card)


def _send(result: UploadResult, dst: str, private: bool, token: str | None, endpoint: str | None,
          api: Any) -> None:
    """Create the repository (and branch) and send exactly ``result.files``; a Hub or network
    failure is one line (ConvertError) saying how to resume."""
    if api is None:
        from huggingface_hub import HfApi
        api = HfApi(endpoint=endpoint, token=token)
    from huggingface_hub.errors import HfHubHTTPError
    repo_id, revision = result.repo_id, result.revision
    allow = [glob.escape(p) for p, _ in result.files]  # by exact name: nothing verify did not accept
    try:
        result.url = str(api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True))
        if revision and revision != "main":
            api.create_branch(repo_id, repo_type="model", branch=revision, exist_ok=True)
        result.method = upload_method(api)
        if result.method == "upload_large_folder":  # before the streamed upload_folder: its resumable path
            api.upload_large_folder(repo_id=repo_id, folder_path=dst, repo_type="model", revision=revision,
                                    private=private, allow_patterns=allow, ignore_patterns=IGNORE)
        else:
            if not _xet_available():
                result.notes.append("hf_xet is not installed (or HF_HUB_DISABLE_XET is set): upload_folder made a "
                                    "single commit, which does not resume; `pip install hf_xet` for large uploads")
            api.upload_folder(repo_id=repo_id, folder_path=dst, repo_type="model", revision=revision,
                              allow_patterns=allow, ignore_patterns=IGNORE,
                              commit_message=f"int4 group-32 experts converted by k3convert {__version__}")
    except Exception as e:  # the Hub or the network: one line and how to resume; anything else is a bug
        network = type(e).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")
        if not (isinstance(e, (HfHubHTTPError, OSError, ValueError)) or network):
            raise
        raise ConvertError(f"upload to {repo_id} failed: {one_line(e)}. Run the same command again to resume") \
            from None
