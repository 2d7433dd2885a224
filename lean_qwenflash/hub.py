"""`lean-qwenflash pull REPO[:FILE_OR_QUANT]`: fetch a model from the Hugging Face Hub and pack it.

Downloads go through ``huggingface_hub`` (its cache, its resumable downloads and progress bars;
``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` are read by it). Two kinds of
repository:

* a GGUF repository (``*.gguf`` files): the file whose quant label (``Q4_K_M``, ``UD-Q4_K_XL``,
  ``BF16``...; case-insensitive) or name was asked for, with every shard of a
  ``-00001-of-0000N.gguf`` split; the pack copies its blocks as stored;
* a Hugging Face checkpoint (``config.json`` + ``*.safetensors``): the weights, config and
  tokenizer files, packed as they are or with ``--quant PRESET``.

Before anything is downloaded the repository listing's file sizes are compared with the free
space of the download cache and of the pack directory. The pack goes to
``~/.cache/lean-qwenflash/packs/OWNER--NAME--LABEL`` unless ``--out`` says otherwise; a pull of a
model already packed there does nothing but print the commands.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .common import format_size
from .store.gguf_io import _SHARD_RE

# A quant label at the end of a GGUF file's stem (llama.cpp's and the usual uploaders' names).
_LABEL_RE = re.compile(r"(?i)(?:^|[-_.])((?:UD-)?(?:I?Q\d+(?:_[0-9A-Z]+)*|T?Q\d_\d|BF16|F16|F32|FP16|FP32|"
                       r"MXFP4(?:_MOE)?))$")
# Top-level files an HF checkpoint needs to be packed and chatted with.
_HF_FILES = re.compile(r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|"
                       r"special_tokens_map\.json|chat_template\.jinja|chat_template\.json|vocab\.json|merges\.txt|"
                       r"tokenizer\.model|.*\.safetensors|.*\.safetensors\.index\.json)$")
DEFAULT_QUANT = "Q4_K_M"


class HubError(ValueError):
    """A pull that cannot go on; the message says why and what to do."""


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: Optional[int]          # from the listing (None: the hub did not say)


@dataclass
class Plan:
    repo_id: str
    kind: str                    # "gguf" or "hf"
    label: str                   # the quant label (GGUF) or the --quant preset / "hf" (checkpoint)
    files: list = field(default_factory=list)
    revision: str = "main"       # a commit hash once the listing came from the hub

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


def parse_ref(ref: str) -> tuple[str, Optional[str]]:
    """``owner/name[:FILE_OR_QUANT]`` -> (repo id, selector or None)."""
    repo, _, sel = ref.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo):
        raise HubError(f"pull: {ref!r} is not a repository name; write OWNER/NAME[:QUANT_OR_FILE], "
                       "e.g. Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M")
    return repo, (sel or None)


def quant_label(filename: str) -> Optional[str]:
    """``Qwen3-30B-A3B-Q4_K_M-00001-of-00002.gguf`` -> ``Q4_K_M`` (upper case); None when the name
    carries no label."""
    base = filename.rsplit("/", 1)[-1]
    m = _SHARD_RE.match(base)
    stem = m.group("stem") if m else (base[:-5] if base.lower().endswith(".gguf") else base)
    lab = _LABEL_RE.search(stem)
    return lab.group(1).upper() if lab else None


def _shard_set(files: list, chosen: RepoFile) -> list:
    """``chosen`` and, when it is one shard of a split, every shard (all must be listed)."""
    base = chosen.name.rsplit("/", 1)
    m = _SHARD_RE.match(base[-1])
    if not m:
        return [chosen]
    prefix = base[0] + "/" if len(base) == 2 else ""
    n = int(m.group("n"))
    by_name = {f.name: f for f in files}
    names = [f"{prefix}{m.group('stem')}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    missing = [x for x in names if x not in by_name]
    if missing:
        raise HubError(f"pull: {chosen.name} is a shard of {n}, but the repository lacks {', '.join(missing)}")
    return [by_name[x] for x in names]


def plan_gguf(repo_id: str, files: list, selector: Optional[str]) -> Plan:
    ggufs = [f for f in files if f.name.lower().endswith(".gguf")
             and not f.name.rsplit("/", 1)[-1].lower().startswith("mmproj")]
    groups: dict[str, list] = {}
    for f in ggufs:
        groups.setdefault(quant_label(f.name) or f.name, []).append(f)
    available = ", ".join(sorted(groups))
    if selector and selector.lower().endswith(".gguf"):
        match = [f for f in ggufs if f.name.lower() == selector.lower()
                 or f.name.rsplit("/", 1)[-1].lower() == selector.lower()]
        if not match:
            raise HubError(f"pull: {repo_id} has no file {selector!r}; its GGUF files: "
                           + ", ".join(f.name for f in ggufs))
        chosen = _shard_set(files, match[0])
        return Plan(repo_id, "gguf", quant_label(chosen[0].name) or Path(chosen[0].name).stem, chosen)
    want = (selector or "").upper()
    if not want:
        if len(groups) == 1:
            want = next(iter(groups))
        elif DEFAULT_QUANT in groups:
            want = DEFAULT_QUANT
        else:
            raise HubError(f"pull: {repo_id} has several quants; name one as {repo_id}:QUANT. Available: {available}")
    if want not in groups:
        raise HubError(f"pull: {repo_id} has no {selector or want} file. Available quants: {available}")
    members = groups[want]
    firsts = [f for f in members if not _SHARD_RE.match(f.name.rsplit("/", 1)[-1])
              or int(_SHARD_RE.match(f.name.rsplit("/", 1)[-1]).group("i")) == 1]
    if len(firsts) != 1:
        raise HubError(f"pull: {repo_id} has {len(firsts)} {want} models ({', '.join(f.name for f in firsts)}); "
                       f"name the file: {repo_id}:FILE.gguf")
    return Plan(repo_id, "gguf", want, _shard_set(files, firsts[0]))


def plan_hf(repo_id: str, files: list, quant: Optional[str]) -> Plan:
    top = [f for f in files if "/" not in f.name and _HF_FILES.match(f.name)]
    names = {f.name for f in top}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise HubError(f"pull: {repo_id} holds neither GGUF files nor a Hugging Face checkpoint "
                       "(config.json and *.safetensors at the top level); files: "
                       + ", ".join(sorted(f.name for f in files)[:20]))
    return Plan(repo_id, "hf", quant or "hf", top)


def plan(repo_id: str, files: list, selector: Optional[str], quant: Optional[str]) -> Plan:
    if any(f.name.lower().endswith(".gguf") for f in files):
        if quant:
            raise HubError("pull: --quant re-encodes a Hugging Face checkpoint; a GGUF repository's quant is "
                           f"picked by name instead ({repo_id}:Q4_K_M)")
        return plan_gguf(repo_id, files, selector)
    if selector:
        raise HubError(f"pull: {repo_id} is a Hugging Face checkpoint (no GGUF files), so ':{selector}' picks "
                       f"nothing; use --quant PRESET to encode it (e.g. --quant q4_k_m)")
    return plan_hf(repo_id, files, quant)


def default_pack_dir(p: Plan) -> Path:
    owner, name = p.repo_id.split("/", 1)
    return Path.home() / ".cache" / "lean-qwenflash" / "packs" / f"{owner}--{name}--{p.label}"


# -- talking to the hub --------------------------------------------------------------------------

def _endpoint() -> str:
    from huggingface_hub import constants
    return constants.ENDPOINT


def _explain(exc: Exception, repo_id: str) -> HubError:
    """A hub or network exception as a message that says what to do."""
    from huggingface_hub import errors
    ep = _endpoint()
    if isinstance(exc, errors.GatedRepoError):
        return HubError(f"pull: {repo_id} is gated: accept its terms at {ep}/{repo_id} with your account, then "
                        "set HF_TOKEN to a token of that account and retry")
    if isinstance(exc, errors.RepositoryNotFoundError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return HubError(f"pull: no repository {repo_id} at {ep} (HTTP {status}); check the name, or, if it is "
                        "private, set HF_TOKEN to a token that may read it")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"pull: {repo_id} has no such revision: {exc}")
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return HubError(f"pull: {ep} refused access to {repo_id} (HTTP {status}); set HF_TOKEN to a token "
                            "that may read it")
        return HubError(f"pull: {ep} answered HTTP {status} for {repo_id}: {str(exc).splitlines()[0]}")
    return HubError(f"pull: cannot reach {ep} ({type(exc).__name__}: {exc}); check the network (or HF_ENDPOINT), "
                    "or set HF_HUB_OFFLINE=1 to use what is already downloaded")


def _is_network_error(exc: Exception) -> bool:
    from huggingface_hub import errors
    mod = type(exc).__module__ or ""
    # (LocalEntryNotFoundError online: the HEAD failed after the hub's retries and nothing is cached.)
    return isinstance(exc, (ConnectionError, TimeoutError, errors.LocalEntryNotFoundError)) or mod.startswith(("httpx", "httpcore", "requests",
                                                                                "urllib3"))


def _hub_call(repo_id: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a huggingface_hub call) with its HTTP and network errors explained
    for ``repo_id``; offline mode's own error passes through."""
    from huggingface_hub import errors
    try:
        return fn(*args, **kwargs)
    except errors.OfflineModeIsEnabled:
        raise
    except errors.HfHubHTTPError as e:
        raise _explain(e, repo_id) from None
    except Exception as e:
        if _is_network_error(e):
            raise _explain(e, repo_id) from None
        raise


def list_remote(repo_id: str, revision: str, token) -> tuple[list, str]:
    """(files with sizes, commit hash) from the hub's model info."""
    from huggingface_hub import HfApi
    info = _hub_call(repo_id, HfApi(endpoint=_endpoint(), token=token).model_info, repo_id, revision=revision,
                     files_metadata=True)
    files = [RepoFile(s.rfilename, s.size) for s in (info.siblings or [])]
    return files, info.sha or revision


def list_cached(repo_id: str, revision: str) -> tuple[list, Path]:
    """Offline: the files of the cached snapshot (sizes from disk) and its folder."""
    from huggingface_hub import errors, snapshot_download
    try:
        root = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (errors.LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise HubError(f"pull: HF_HUB_OFFLINE is set and {repo_id} ({revision}) is not in the download cache "
                       "(huggingface_hub's, under HF_HOME); unset HF_HUB_OFFLINE to download it") from None
    files = [RepoFile(str(p.relative_to(root)), p.stat().st_size) for p in sorted(root.rglob("*")) if p.is_file()]
    return files, root


def _free_bytes(path: Path) -> tuple[int, Path]:
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free, p


def check_space(p: Plan, cache_dir: Path, pack_dir: Path, already: int = 0, free_fn=_free_bytes) -> None:
    """Refuse before downloading when the files (less what is cached) and the pack do not fit."""
    download = max(0, p.total_bytes - already)
    weights = sum(f.size or 0 for f in p.files if f.name.endswith((".gguf", ".safetensors")))
    free_c, where_c = free_fn(cache_dir)
    free_p, where_p = free_fn(pack_dir)
    same = os.stat(where_c).st_dev == os.stat(where_p).st_dev
    need = {where_c: download + (weights if same else 0)}
    if not same:
        need[where_p] = weights
    for where, n in need.items():
        free = free_c if where == where_c else free_p
        if n > free:
            raise HubError(f"pull: not enough disk space: {p.repo_id} needs {format_size(n)} on the filesystem of "
                           f"{where} ({format_size(download)} to download, about {format_size(weights)} for the "
                           f"pack) but {format_size(free)} is free; free some space, or set HF_HOME / --out to "
                           "another drive")


@dataclass
class PullResult:
    pack_dir: Path
    plan: Plan
    downloaded: list            # local paths
    packed: bool                # False when the pack already existed


def pull(ref: str, out_dir=None, quant: Optional[str] = None, revision: str = "main", force: bool = False,
         progress: bool = True, out=print, free_fn=_free_bytes) -> PullResult:
    """Resolve ``ref``, check space, download (resumably) and pack; returns where the pack is."""
    from huggingface_hub import constants, errors, hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    repo_id, selector = parse_ref(ref)
    token = os.environ.get("HF_TOKEN") or None
    offline_root = None
    try:
        if constants.is_offline_mode():
            raise errors.OfflineModeIsEnabled("HF_HUB_OFFLINE")
        files, commit = list_remote(repo_id, revision, token)
    except errors.OfflineModeIsEnabled:
        files, offline_root = list_cached(repo_id, revision)
        commit = revision
    p = plan(repo_id, files, selector, quant)
    p.revision = commit
    pack_dir = Path(out_dir).expanduser() if out_dir else default_pack_dir(p)
    if (pack_dir / "manifest.json").is_file() and not force:
        out(f"{repo_id}: already packed in {pack_dir} (--force packs it again)")
        return PullResult(pack_dir, p, [], False)
    if pack_dir.exists() and not force:
        # (checked before any download: a directory that is not a pack of ours is never replaced unasked)
        raise FileExistsError(f"{pack_dir} already exists and is not a pack; choose another --out or pass "
                              "--force to replace it")
    out(f"{repo_id}: {p.kind.upper() if p.kind == 'gguf' else 'Hugging Face checkpoint'} {p.label}, "
        f"{len(p.files)} file(s), {format_size(p.total_bytes)}"
        + (" (offline: from the download cache)" if offline_root else ""))

    cache_dir = Path(constants.HF_HUB_CACHE)
    if offline_root is None:
        from huggingface_hub import try_to_load_from_cache
        already = 0
        for f in p.files:
            hit = try_to_load_from_cache(repo_id, f.name, revision=commit)
            if isinstance(hit, str) and os.path.isfile(hit):
                already += os.path.getsize(hit)
        check_space(p, cache_dir, pack_dir, already, free_fn)
    paths = []
    if not progress:
        disable_progress_bars()
    try:
        for f in p.files:
            if offline_root is not None:
                paths.append(offline_root / f.name)
                continue
            # By the asked revision (a branch name is written to the cache's refs/, which offline mode
            # reads); the HEAD names the commit, the listing's.
            paths.append(Path(_hub_call(repo_id, hf_hub_download, repo_id, f.name, revision=revision, token=token,
                                        endpoint=_endpoint())))
    finally:
        if not progress:
            enable_progress_bars()

    from .store.packer import pack
    src = paths[0] if p.kind == "gguf" else paths[0].parent
    out(f"packing {src} into {pack_dir}")
    pack_dir.parent.mkdir(parents=True, exist_ok=True)
    pack(src, pack_dir, quant=quant, progress=progress, force=force)
    return PullResult(pack_dir, p, paths, True)


def next_steps(pack_dir: Path) -> list[str]:
    """The commands that use a pulled pack (what `pull` prints last)."""
    return [f"lean-qwenflash generate --model {pack_dir} --prompt \"Hello\"",
            f"lean-qwenflash run --model {pack_dir}",
            f"lean-qwenflash serve --model {pack_dir}    # then open http://127.0.0.1:8000/ui"]
