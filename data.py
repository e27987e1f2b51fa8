"""data.py: from a URL to batches, in the order the bytes travel through this file.

  1. Sources     DATASETS names a few public files (URL, sha256, license, mirror path); download()
                 fetches one into the cache (streamed, retried, resumed, checksummed, atomic), or
                 copies it from a local mirror folder (DATA_MIRROR, mirror=, --mirror).
  2. Tokenizers  get_tokenizer(): byte, gpt2, cl100k_base, o200k_base and llama3 as tiktoken
                 Encodings, all with the Llama 3 special tokens (<|begin_of_text|>, ...).
  3. Documents   read_documents(): a .txt file is one document, a .jsonl file one per line.
  4. Shards      write_shard() / read_shard(): a 256-byte header, then uint16 or uint32 tokens.
  5. prepare()   documents -> BOS + tokens + EOS -> train_*.bin, val_*.bin, then meta.json, the
                 completion marker. resolve_data() is what train.py calls with its --data.
  6. Loader      Positions: the order every loader reads its items in; one global counter is the
                 whole position, so a run resumes exactly under any dp. Loader: shards -> windows
                 -> (inputs, targets) per dp rank. MixtureLoader: several sources, each its share
                 (parse_mixture, MixtureSchedule), and annealing's switch to another mix.
  7. Records     json_records, named_file: the JSON and JSONL files chat.py reads records from.
  8. Failures    a failure a user causes is a one-line DataError saying what to do: regular_file
                 checks a named file before it is opened, JSON goes through load_json, cache writes
                 through writing(), and prepare() cleans up on SIGTERM (as KeyboardInterrupt).
  9. CLI         python data.py prepare | download | info
"""
import argparse
import base64
import binascii
import contextlib
import errno
import functools
import glob
import gzip
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import requests
import tiktoken
import torch


class DataError(Exception):
    """A problem with the data or its sources; train.py prints it as one line and exits."""


# ----------------------------------------------------------------------------------------------------
# 1. Sources and download
# Each entry: a public URL, the sha256 it must deliver, the license, the same file's path in a local
# mirror folder (DATA_MIRROR) and how to cut it into documents. URLs are pinned to commits, so the
# content (and its hash) cannot drift; TinyShakespeare has never changed on char-rnn's master.

_GH = "https://raw.githubusercontent.com"
_LLAMA_FACTORY = f"{_GH}/hiyouga/LLaMA-Factory/ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30/data"
_GUTENBERG = f"{_GH}/Tahsan-Alam/Word-Ladder/0f3ccefd05fbf8b7c382f33aaaa0defe4ef1020c"

DATASETS = {
    "tinyshakespeare": dict(
        url=f"{_GH}/karpathy/char-rnn/master/data/tinyshakespeare/input.txt", format="text",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        license="text public domain (Shakespeare); char-rnn repo MIT", mirror="text/tinyshakespeare.txt"),
    "wiki_demo": dict(  # 30 Wikipedia articles, one per line
        url=f"{_LLAMA_FACTORY}/wiki_demo.txt", format="lines",
        sha256="69c0c4d067a95a1a65022f2ae1efff9654b1953b09f206f8832620ebbffa0daf",
        license="CC BY-SA 3.0/4.0 (Wikipedia)", mirror="text/wiki_demo.txt"),
    "c4_demo": dict(  # 300 web documents, {"text": ...} per line
        url=f"{_LLAMA_FACTORY}/c4_demo.jsonl", format="jsonl",
        sha256="f51528081ef22279f2840c02c4cd7cdfc372138be0817c5b8714d200af692b78",
        license="ODC-BY 1.0 (C4)", mirror="text/c4_demo.jsonl"),
}
DATASETS.update({  # Project Gutenberg books, from a repository snapshot: cp1252, CRLF, PG header
    name: dict(url=f"{_GUTENBERG}/{book}.txt", sha256=sha256, format="text", encoding="cp1252",
               license="public domain in the USA", mirror=f"text/gutenberg/{book}.txt")
    for name, book, sha256 in [
        ("pride_and_prejudice", "pg1342", "f0247a0f5038e95d94fb4284ff9d24f07c812058536f6152115e1f9a92260517"),
        ("moby_dick", "pg2701", "eb1a1ca16369a025021459cf71bf5c4de1e05852bc1d83160c08484adffab73f"),
        ("frankenstein", "pg84", "4eaa0bd8cf407530e42d99ed95b61b9a4bb8492a3a9c0c9a41cd017bfed7bcd7")]})

# Chat data: read by chat.read_sft and chat.read_preferences, not by prepare (not plain text).
SFT_DATASETS = {
    "alpaca_5000": dict(  # a random 5,000 of Alpaca's 52k, from a pull request to its repository
        url=f"{_GH}/tatsu-lab/stanford_alpaca/5e69c50054c48cd3b919c46d13bb2d92a62f4498/data/alpaca_5000.json",
        sha256="fc1add24c93c9fbbe585a64a6c9bf6165eb110225f4470efbff382a913558ec0",
        license="CC BY-NC 4.0 (non-commercial; outputs of text-davinci-003)", mirror="sft/alpaca_5000.json"),
    "self_instruct_seed": dict(  # the 175 human-written Self-Instruct seed tasks
        url=f"{_GH}/yizhongw/self-instruct/0b26ccaa415992100fa32df62d41b994cf928e23/data/seed_tasks.jsonl",
        sha256="7779004fa198fdf27cf70a159363879d8a26c53329e11b436af17b3941875f48",
        license="Apache-2.0", mirror="sft/self_instruct_seed_tasks.jsonl"),
}
PREFERENCE_DATASETS = {
    "hh_rlhf_harmless_test": dict(  # red-teaming dialogues, offensive by design; paired replies
        url=f"{_GH}/anthropics/hh-rlhf/354e5c3cb8960630860dd5774a6ac2a58313bf4d/harmless-base/test.jsonl.gz",
        gzip_sha256="ebfaaed21162a4de120ae85366075b34425e2a6303fac59b99555002f7016f03",
        # gzip_sha256: the .gz the URL serves; sha256: the file unpacked, as in the mirror and cache
        sha256="14d765196c9f18d84f9bb3a78bac608c8f2915110ebcbd74ec95db7b7198b008",
        license="MIT (Anthropic)", mirror="dpo/hh_rlhf_harmless_base_test.jsonl"),
}

LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
TOKENIZER_FILES = {  # files a tokenizer needs; fetched through the same machinery as the datasets
    "llama3": dict(
        url=f"{_GH}/meta-llama/llama-models/a9c89c471f793423afd4cc3ca8671d6e56fe64cb"
            "/models/llama3/tokenizer.model",
        sha256=LLAMA3_SHA256, license="Meta Llama 3 Community License", mirror="llama3/tokenizer.model"),
}


def cache_dir() -> Path:
    path = Path(os.environ.get("DATA_CACHE") or "~/.cache/llama3-train").expanduser()
    if os.path.exists(path) and not os.path.isdir(path):
        raise DataError(f"the data cache {path} is not a folder; point DATA_CACHE at a folder")
    return path


def _mirror_root(mirror=None):
    root = mirror or os.environ.get("DATA_MIRROR")
    return Path(root).expanduser() if root else None


def registry() -> dict:
    """Every name fetch() knows: pretraining text, chat data and tokenizer files."""
    return {**DATASETS, **SFT_DATASETS, **PREFERENCE_DATASETS, **TOKENIZER_FILES}


def fetch(name: str, mirror=None) -> Path:
    """A registry name (dataset or tokenizer file) -> the verified file in <cache>/downloads."""
    if "/" in name or "\\" in name or ".." in name or not name:
        raise DataError(f"bad dataset name {name!r}: registry names may not contain path separators or '..'")
    entry = registry().get(name)
    if entry is None:
        raise DataError(f"unknown dataset {name!r}; known names: {', '.join(registry())}")
    if Path(entry["mirror"]).is_absolute() or ".." in Path(entry["mirror"]).parts:
        raise DataError(f"registry entry {name!r} has a mirror path outside the mirror: {entry['mirror']}")
    dest = cache_dir() / "downloads" / (name + Path(entry["mirror"]).suffix)
    root = _mirror_root(mirror)
    in_mirror = root is not None and os.path.exists(root / entry["mirror"])
    if "gzip_sha256" in entry and not os.path.exists(dest) and not in_mirror:
        packed = download(entry["url"], entry["gzip_sha256"], dest.with_name(dest.name + ".gz"))
        part = dest.with_name(dest.name + ".part")
        with writing(dest.parent, dest, cleanup=[part]), gzip.open(packed, "rb") as src, \
                open(part, "wb") as out:
            shutil.copyfileobj(src, out)
        packed.unlink()
        return _verify_and_place(part, dest, entry["sha256"], f"{entry['url']} (unpacked)", "fetch it again")
    return download(entry["url"], entry["sha256"], dest, mirror=mirror, mirror_path=entry["mirror"])


def download(url, sha256, dest, mirror=None, mirror_path=None, *, retries=4, timeout=30.0, backoff=1.0,
             allow_http=False) -> Path:
    """Put the file at `url` (or `mirror/mirror_path`) into `dest`, verified against `sha256`. Only
    a complete, verified file is ever renamed to `dest`, so an existing `dest` is a cache hit. Bytes
    arrive in `dest.part`; a later call resumes it with an HTTP Range request."""
    if not (url.startswith("https://") or allow_http):
        raise DataError(f"refusing to download {url}: only https URLs are accepted")
    dest = Path(dest)
    if os.path.exists(dest):
        return regular_file(dest, "cached download")
    part = dest.with_name(dest.name + ".part")
    if os.path.exists(part):  # open() of a FIFO there would wait forever
        regular_file(part, "partial download")
    root = _mirror_root(mirror)
    wanted = mirror_path or dest.name
    hint = f"to work offline, set DATA_MIRROR or --mirror to a folder holding {wanted}"
    with writing(dest.parent, dest, cleanup=[part]):
        dest.parent.mkdir(parents=True, exist_ok=True)
        if root is not None and mirror_path:
            if os.path.exists(root / mirror_path):
                src = regular_file(root / mirror_path, "mirror file")
                if not os.access(src, os.R_OK):  # (or the refusal below would blame the cache)
                    raise DataError(f"cannot read the mirror file {src}: permission denied; make it readable "
                                    "or point DATA_MIRROR (or --mirror) at another mirror")
                print(f"copying {src} -> {dest}", file=sys.stderr)
                shutil.copyfile(src, part)
                return _verify_and_place(part, dest, sha256, f"{url} (mirror copy {src})", hint)
            hint = f"the mirror {root} has no {mirror_path}; {hint}"
        print(f"downloading {url} -> {dest}", file=sys.stderr)
        _fetch_url(url, part, retries, timeout, backoff, hint)
        return _verify_and_place(part, dest, sha256, url, hint)


def _fetch_url(url, part, retries, timeout, backoff, hint):
    error = None
    for attempt in range(retries):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        have = part.stat().st_size if part.exists() else 0
        # identity encoding: Range and Content-Length must count the bytes we store, not gzip bytes
        headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
        try:
            with requests.get(url, headers=headers, stream=True, timeout=timeout) as r:
                if r.status_code == 416 and have:  # nothing left to send: the partial file is whole
                    return
                if r.status_code not in (200, 206):
                    if r.status_code < 500 and r.status_code not in (408, 429):  # no use retrying
                        raise DataError(f"could not download {url}: HTTP {r.status_code}; {hint}")
                    raise requests.HTTPError(f"HTTP {r.status_code}")
                if r.status_code == 200:  # the server ignored the Range header: start over
                    have = 0
                length = r.headers.get("Content-Length")
                expected = have + int(length) if length is not None else None
                with open(part, "ab" if have else "wb") as f:
                    for chunk in r.iter_content(1 << 20):
                        f.write(chunk)
            got = part.stat().st_size
            if expected is not None and got != expected:
                raise requests.ConnectionError(f"connection closed after {got:,} of {expected:,} bytes")
            return
        except requests.RequestException as e:
            error = e
            print(f"  try {attempt + 1}/{retries} failed: {one_line(e)}", file=sys.stderr)
    raise DataError(f"could not download {url} after {retries} tries ({one_line(error)}); {hint}")


def fsync(path: Path):
    """path's contents (a file) or its entries (a folder: Linux syncs them this way, so a rename into it
    lasts) on disk. A folder that a system cannot open or sync is as durable as that system makes it;
    a file that cannot be synced is an error."""
    folder = os.path.isdir(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if folder:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not folder:
            raise
    finally:
        os.close(fd)


def swap_folder(new: Path, path: Path, replacing: bool, what: str):
    """Rename folder `new` to `path` (the one folder swap of exports and checkpoints). What is at
    `path` (replacing: an earlier copy) is renamed aside first and deleted only once `new` is in place;
    if the second rename fails, it is put back. Without replacing, a folder that appeared at `path`
    while `what` was written (another writer) is never replaced: the rename onto it fails, said so."""
    appeared = (f"{path} appeared while {what} was written (another writer to it at the same time?); "
                f"it is left as it is, and {what} was not written")
    if path.exists() and not replacing:
        raise FileExistsError(appeared)
    if replacing and (path.exists() or path.is_symlink()):
        old = path.parent / f".old-{path.name}-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        try:
            os.rename(new, path)
        except BaseException:
            os.rename(old, path)
            raise
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    else:
        try:
            os.rename(new, path)  # (onto a folder that appeared since the check above: fails unless empty)
        except OSError as e:
            raise FileExistsError(f"{appeared} ({e.strerror})") from None
    fsync(path.parent)  # the rename itself on disk


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _verify_and_place(part, dest, sha256, origin, hint):
    got = sha256_file(part)
    if got != sha256:
        part.unlink()  # a wrong file must not be resumed from either
        raise DataError(f"checksum mismatch for {origin}: expected sha256 {sha256}, got {got} "
                        f"(deleted the download); {hint}")
    os.replace(part, dest)
    return dest


# ----------------------------------------------------------------------------------------------------
# 2. Tokenizers
# Every tokenizer speaks the same special tokens, so the rest of the code only knows their names.
# Llama 3 has 256 of them above its 128,000 ranks; the others get the first 12 above their own.

SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>",
]
# Llama 3.1
LLAMA3_SPECIAL_TOKENS = SPECIAL_TOKENS + [f"<|reserved_special_token_{i}|>" for i in range(2, 246)]
LLAMA3_RANKS = 128_000
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TOKENIZERS = ("byte", "gpt2", "cl100k_base", "o200k_base", "llama3")


@functools.lru_cache(maxsize=16)
def get_tokenizer(name_or_path, mirror=None) -> tiktoken.Encoding:
    """A TOKENIZERS name or a path to a Llama 3 tokenizer.model. The Encoding's name (in shard
    headers and the shard cache's folder name) says what it encodes: 'llama3' for the official ranks
    from any file, 'llama3-<digest>' for others."""
    name = str(name_or_path)
    if name == "byte":  # 256 single-byte ranks, no merges: a character-level model for UTF-8 bytes
        return _with_specials("byte", {bytes([i]): i for i in range(256)}, GPT2_PAT, {})
    if name in ("gpt2", "cl100k_base", "o200k_base"):
        base = _openai_encoding(name, mirror)
        return _with_specials(name, base._mergeable_ranks, base._pat_str, base._special_tokens)
    if name == "llama3":
        path = fetch("llama3", mirror)
    elif os.path.exists(Path(name).expanduser()):  # a folder or FIFO: refused by _read_rank_file
        path = Path(name).expanduser()
    else:
        raise DataError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)} "
                        f"or a path to a Llama 3 tokenizer.model")
    ranks = _read_rank_file(path)
    specials = {token: LLAMA3_RANKS + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
    digest = _ranks_digest(ranks)
    name = "llama3" if digest == LLAMA3_SHA256 else f"llama3-{digest[:16]}"
    return tiktoken.Encoding(name, pat_str=LLAMA3_PAT, mergeable_ranks=ranks, special_tokens=specials)


def _ranks_digest(ranks: dict) -> str:
    """sha256 of the ranks written in rank order as '<base64> <rank>' lines: the official file's own
    bytes for the official ranks, whatever order or line ends another copy of them uses."""
    h = hashlib.sha256()
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        h.update(base64.b64encode(token) + b" %d\n" % rank)
    return h.hexdigest()


def _with_specials(name, ranks, pat_str, own_specials):
    base_vocab = max(max(ranks.values()), max(own_specials.values(), default=0)) + 1
    specials = {**own_specials, **{token: base_vocab + i for i, token in enumerate(SPECIAL_TOKENS)}}
    return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)


def _openai_encoding(name, mirror):
    # tiktoken reads its rank files from TIKTOKEN_CACHE_DIR (read-only is fine for get_encoding); if
    # that is unset, this call borrows a configured mirror's copy of tiktoken's cache.
    unset = "TIKTOKEN_CACHE_DIR" not in os.environ
    root = _mirror_root(mirror)
    if unset and root is not None and os.path.isdir(root / "tiktoken_cache"):
        os.environ["TIKTOKEN_CACHE_DIR"] = str(root / "tiktoken_cache")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:
        raise DataError(f"could not load the {name} tokenizer ({one_line(e)}); offline, set "
                        "TIKTOKEN_CACHE_DIR "
                        f"or DATA_MIRROR/--mirror to a folder holding tiktoken's cache files") from None
    finally:
        if unset:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)


def _read_rank_file(path) -> dict:
    # Parsed by hand: tiktoken.load.load_tiktoken_bpe(local_path) writes a copy into
    # TIKTOKEN_CACHE_DIR, which fails when that folder is read-only (a shared mirror, a CI's data).
    raw = regular_file(path, "tokenizer file").read_bytes()
    official = hashlib.sha256(raw).hexdigest() == LLAMA3_SHA256
    ranks = {}
    for lineno, line in enumerate(raw.splitlines(), 1):
        try:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise DataError(f"{path}:{lineno}: not a tiktoken rank file ('<base64> <rank>' per line); "
                            f"note a Llama 2 SentencePiece tokenizer.model does not work here") from None
    # A file other than the official one is accepted if it has the Llama 3 shape: ranks 0..127,999.
    if not official and sorted(ranks.values()) != list(range(LLAMA3_RANKS)):
        raise DataError(f"{path} holds {len(ranks):,} ranks, but a Llama 3 tokenizer.model has 128,000 "
                        "(0..127,999)")
    return ranks


def bos_id(enc) -> int:
    return enc.encode_single_token("<|begin_of_text|>")


def eos_id(enc) -> int:  # ends a document
    return enc.encode_single_token("<|end_of_text|>")


def eot_id(enc) -> int:  # ends a chat turn
    return enc.encode_single_token("<|eot_id|>")


def pad_id(enc) -> int:  # fills the tail of an SFT or DPO row; never a target
    return enc.encode_single_token("<|finetune_right_pad_id|>")


def format_ids(enc) -> list[int]:
    """The chat format's own tokens (encode_chat): each turn's header and the <|eot_id|> that ends it."""
    return [enc.encode_single_token(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")]


# ----------------------------------------------------------------------------------------------------
# 3. Documents

def resolve_source(source, mirror=None) -> list:
    """A registry name, file, folder or glob -> [(path, text|lines|jsonl, encoding)]."""
    source = str(source)
    if source in DATASETS:
        entry = DATASETS[source]
        return [(fetch(source, mirror), entry["format"], entry.get("encoding", "utf-8"))]
    path = Path(source).expanduser()
    if os.path.isdir(path):
        found = [p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl")]
    elif os.path.exists(path):
        found = [path]
    else:
        found = [Path(p) for p in glob.glob(str(path), recursive=True)]
    # folders are skipped (rglob looks inside them); a FIFO, device or socket is refused
    files = sorted(regular_file(p, "document file") for p in found if not os.path.isdir(p))
    if not files:
        raise DataError(f"no data found at {source!r}: not a dataset name ({', '.join(DATASETS)}), "
                        f"a file, a folder of .txt/.jsonl files or a glob that matches files")
    return [(p, "jsonl" if p.suffix == ".jsonl" else "text", "utf-8") for p in files]


def read_documents(path, fmt="text", text_field="text", encoding="utf-8") -> list:
    """text: the whole file is one document; lines: each non-empty line; jsonl: record[text_field].
    Read in text mode, like nanoGPT, so CRLF and CR line ends become "\n"."""
    try:
        text = regular_file(path, "document file").read_text(encoding=encoding)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not {encoding} text ({e.reason} at byte {e.start:,})") from None
    if fmt == "text":
        return [text] if text else []
    lines = text.split("\n")  # not splitlines(): it also splits at U+2028, which JSON may hold raw
    if fmt == "lines":
        return [line for line in lines if line.strip()]
    docs = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = load_json(line)
        except json.JSONDecodeError as e:
            raise jsonl_error(path, lineno, line, text, e) from None
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            fields = list(record)[:8] if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{lineno}: no string field {text_field!r} (fields: {fields}); "
                            f"pick one with --text-field")
        if value:
            docs.append(value)
    return docs


def jsonl_error(path, lineno, line, text, e: json.JSONDecodeError) -> DataError:
    """A JSONL line that does not parse: where and why, or that the file is pretty-printed JSON."""
    try:
        whole = load_json(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, (dict, list)) or line.strip() in ("{", "["):
        what = {dict: "one JSON object", list: "a JSON array"}.get(type(whole), "JSON records")
        return DataError(f"{path}: {what} spread over several lines (pretty-printed), not JSON Lines: write "
                         "one record per line")
    return DataError(f"{path}:{lineno}: malformed JSON ({json_reason(e)})")


def split_documents(docs, val_fraction):
    """-> (train_docs, val_docs). One document is cut in two; of several, the last validate."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0:
        return docs, []
    if len(docs) == 1:  # nanoGPT: data[:int(n * 0.9)] trains, the rest validates
        cut = int(len(docs[0]) * (1 - val_fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    n_val = max(1, int(len(docs) * val_fraction))
    return docs[:-n_val], docs[-n_val:]


# ----------------------------------------------------------------------------------------------------
# 4. Token shards
# Layout (little-endian), 256-byte header, then `count` tokens of `itemsize` bytes:
#   offset  0  8 bytes  magic b"L3TOKENS"
#   offset  8  uint32   format version (2; version 1 is read too)
#   offset 12  uint32   token itemsize / dtype code: 2 = uint16, 4 = uint32
#   offset 16  uint64   token count
#   offset 24  64 bytes the tokenizer's Encoding name (llama3, gpt2, ...), utf-8, zero padded
#   offset 88  uint64   the largest token id (version 2; 0 for an empty shard), so a shard whose
#                       ids the tokenizer lacks is refused before training, not inside the embedding
#   offset 96  zeros up to 256 (reserved; also keeps the token array aligned)

SHARD_MAGIC = b"L3TOKENS"
SHARD_VERSION = 2
HEADER_BYTES = 256
_HEADER = struct.Struct("<8sIIQ64sQ")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def write_shard(path, tokens, tokenizer_name, vocab_size=None) -> Path:
    """uint16 if every id fits (by vocab_size <= 65,536, else by the largest token), else uint32."""
    path, tokens = Path(path), np.asarray(tokens)
    top = vocab_size - 1 if vocab_size else int(tokens.max(initial=0))
    dtype = _DTYPES[2] if top <= 0xFFFF else _DTYPES[4]
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise DataError(f"{path}: token ids outside [0, {np.iinfo(dtype).max}] cannot be stored as "
                        f"{dtype.name}")
    name = tokenizer_name.encode("utf-8")
    if len(name) > 64:
        raise DataError(f"tokenizer name {tokenizer_name!r} is longer than the 64 bytes a shard header holds")
    header = _HEADER.pack(SHARD_MAGIC, SHARD_VERSION, dtype.itemsize, tokens.size, name,
                          int(tokens.max(initial=0))).ljust(HEADER_BYTES, b"\0")
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:  # a crash leaves a .tmp, never a short shard under the real name
            f.write(header)
            tokens.astype(dtype, copy=False).tofile(f)
        os.replace(tmp, path)
    except BaseException:  # a full disk, an interrupt: no .tmp left behind either
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return path


def shard_info(path) -> dict:
    """Read and check a shard header -> {"tokenizer", "tokens", "dtype", "version", "max_id"}."""
    path = regular_file(path, "token shard")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[:8] != SHARD_MAGIC[:len(head)]:  # a file shorter than the magic is checked that far
        raise DataError(f"{path} is not a token shard (bad magic {head[:8]!r}, expected {SHARD_MAGIC!r})")
    if len(head) < HEADER_BYTES:  # what there is of the magic is right: the file was cut short
        raise DataError(f"{path} is cut short: it holds {len(head)} of the {HEADER_BYTES} bytes of a shard "
                        "header; re-run prepare")
    _, version, itemsize, count, name, max_id = _HEADER.unpack_from(head)
    if version not in (1, SHARD_VERSION) or itemsize not in _DTYPES:
        raise DataError(f"{path}: unsupported shard format version {version} / dtype code {itemsize}")
    size, expected = path.stat().st_size, HEADER_BYTES + count * itemsize
    if size != expected:
        raise DataError(f"{path} is truncated or corrupt: its header says {count:,} tokens ({expected:,} "
                        f"bytes), the file has {size:,} bytes; re-run prepare")
    return {"tokenizer": name.rstrip(b"\0").decode("utf-8", errors="replace"), "tokens": count,
            "dtype": _DTYPES[itemsize], "version": version, "max_id": max_id if version >= 2 else None}


def read_shard(path, tokenizer_name=None, n_vocab=None) -> np.memmap:
    """Memory-map a shard's tokens, refused if written with another tokenizer or if (given n_vocab)
    its header's largest id is one the tokenizer lacks. The header is trusted here (checking every
    id would read the whole shard); the ids are checked as they are read (check_token_ids)."""
    info = shard_info(path)
    if tokenizer_name is not None and info["tokenizer"] != tokenizer_name:
        raise DataError(f"{path} was tokenized with {info['tokenizer']!r}, but {tokenizer_name!r} is "
                        f"expected; prepare the data again with --tokenizer {tokenizer_name}")
    if info["tokens"] == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=info["dtype"])
    tokens = np.memmap(path, dtype=info["dtype"], mode="r", offset=HEADER_BYTES, shape=(info["tokens"],))
    if n_vocab is not None:
        top = info["max_id"] if info["max_id"] is not None else int(tokens.max())  # version 1: read them all
        check_token_ids(np.array([top]), path, info["tokenizer"], n_vocab)
    return tokens


def check_token_ids(ids: np.ndarray, path, tokenizer: str, n_vocab=None, max_id=None) -> None:
    """Refuse ids read from the shard at `path` that the tokenizer (n_vocab ids) lacks, or above its
    header's max_id (then the data behind an intact header is damaged). One max: cheap enough for
    every batch. Under tensor parallelism an id past the vocabulary would train silently (each rank
    looks up only its slice of the embedding); here the shard can be named (parallel.py's
    vocab-parallel layers refuse it too, nameless)."""
    top = int(ids.max(initial=0))
    if n_vocab is not None and top >= n_vocab:
        raise DataError(f"{path} holds token id {top:,}, but the {tokenizer} tokenizer has {n_vocab:,} ids "
                        f"(0..{n_vocab - 1:,}): the shard is corrupt or was not written by this tokenizer; "
                        "prepare the data again")
    if max_id is not None and top > max_id:
        raise DataError(f"{path} holds token id {top:,}, above the largest id its header records "
                        f"({max_id:,}): the shard is corrupt; prepare the data again")


# ----------------------------------------------------------------------------------------------------
# 5. prepare: documents -> shards

DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB (uint16) or 400 MB (uint32) per shard
PIECE_CHARS = 1 << 20  # long documents are cut into pieces of about this size, for threads to share
PARALLEL_BYTES = 1 << 20  # below this, one thread is faster than starting several


def prepare(source, tokenizer, out_dir=None, mirror=None, val_fraction=0.1, workers=None, text_field="text",
            shard_tokens=DEFAULT_SHARD_TOKENS) -> Path:
    """Tokenize a source into <out_dir>/train_*.bin, val_*.bin, meta.json, reusing a finished
    folder. All is read, checked and written into a temporary folder in out_dir first, so a bad
    setting or source leaves a prepared folder as it was. A failure or interrupt removes the folders
    this call made; an interrupt says on stderr what it stopped, then goes on up."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise DataError(f"shard_tokens must be a positive number of tokens, got {shard_tokens}")
    with sigterm_raises_keyboard_interrupt():
        doing = f"reading {source}: no shards were written"
        try:
            enc = tokenizer if isinstance(tokenizer, tiktoken.Encoding) else get_tokenizer(tokenizer, mirror)
            inputs = resolve_source(source, mirror)
            out = Path(out_dir) if out_dir else cache_dir() / "shards" / f"{_slug(source)}-{enc.name}"
            if os.path.exists(out) and not os.path.isdir(out):
                raise DataError(f"{out} exists and is not a folder")
            settings = {"source": str(source), "tokenizer": enc.name, "val_fraction": val_fraction,
                        "text_field": text_field, "shard_tokens": shard_tokens, "format": SHARD_VERSION,
                        "inputs": _input_records(source, inputs)}
            if _prepared(out, settings):
                print(f"{out}: already prepared", file=sys.stderr)
                return out
            docs = [doc for path, fmt, encoding in inputs
                    for doc in read_documents(path, fmt, text_field, encoding)]
            if not docs:
                raise DataError(f"{source}: no documents (empty files, or no non-empty {text_field!r} "
                                "fields)")
            doing = f"tokenizing {source}: nothing was written"
            with writing(out, f"the shards of {source} into {out}"), _scratch_folder(out) as tmp:
                parts = zip(("train", "val"), split_documents(docs, val_fraction))
                splits = {split: _tokenize_split(part, enc, tmp, split, workers, shard_tokens)
                          for split, part in parts if part}
                meta = {**settings, "n_vocab": enc.n_vocab, "splits": splits,
                        "input_sha256": _input_sha256(source, inputs)}
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
                doing = f"replacing the shards in {out}: they are prepared again on the next run"
                _move_shards_in(tmp, out)
            return out
        except KeyboardInterrupt:
            print(f"interrupted while {doing}", file=sys.stderr)
            raise


def _input_records(source, inputs) -> list:
    """What the reuse test compares: a registry dataset's name and sha256 (fetch checked the file),
    not its path, so a moved or copied cache is still prepared; a user file's path, size and mtime,
    so an edited file is prepared again."""
    if str(source) in DATASETS:
        return [{"dataset": str(source), "sha256": DATASETS[str(source)]["sha256"]}]
    return [{"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
            for p, *_ in inputs]


def _input_sha256(source, inputs) -> dict:
    if str(source) in DATASETS:
        return {str(source): DATASETS[str(source)]["sha256"]}
    return {str(p.resolve()): sha256_file(p) for p, *_ in inputs}


def _prepared(out, settings) -> bool:
    """Whether `out` holds a finished preparation with these settings: its meta.json (written last)
    says so, and every shard it lists is there."""
    old = _read_json_object(out / "meta.json", "meta.json of a prepared folder")
    if any(old.get(key) != value for key, value in settings.items()):
        return False
    try:
        return isinstance(old["n_vocab"], int) and all(
            isinstance(split["tokens"], int) and isinstance(split["documents"], int)
            and all((out / name).is_file() for name in split["shards"]) for split in old["splits"].values())
    except (KeyError, TypeError, AttributeError, OSError, ValueError):  # a damaged meta.json: redo
        return False


@contextlib.contextmanager
def _scratch_folder(out):
    """A fresh temporary folder inside `out` (made, with parents, if missing), removed on the way
    out; after a failure or an interrupt, so are the folders made for it, if still empty. It lies
    beside the old shards, so the swap is a rename, and is named by host and pid, so two jobs
    preparing into one shared cache never share it."""
    made = [folder for folder in [out, *out.parents] if not os.path.exists(folder)]  # innermost first
    tmp = out / f".prepare-{socket.gethostname()}-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:
            with contextlib.suppress(OSError):  # only an empty folder goes: another job's stays
                folder.rmdir()
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_shards_in(tmp, out):
    # meta.json is the completion marker: removed first, moved in last, so a crash is always redone
    (out / "meta.json").unlink(missing_ok=True)
    for stale in [*out.glob("train_*.bin"), *out.glob("val_*.bin")]:
        stale.unlink(missing_ok=True)  # (another process preparing the same shards may be here too)
    for shard in sorted(tmp.glob("*.bin")):
        os.replace(shard, out / shard.name)
    os.replace(tmp / "meta.json", out / "meta.json")


def _read_json_object(path, what="JSON file") -> dict:
    """A JSON object from a file; {} when it is missing, unreadable or not an object (then it is
    redone). Anything but a regular file there is refused (regular_file)."""
    if not os.path.exists(path):
        return {}
    try:
        found = load_json(regular_file(path, what).read_text())
    except (OSError, ValueError):  # ValueError: json.JSONDecodeError, UnicodeDecodeError
        return {}
    return found if isinstance(found, dict) else {}


def _slug(source) -> str:
    source = str(source)
    if source in DATASETS:
        return source
    # a file name plus a hash of the full source string, so two different "input.txt" never collide
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(source.rstrip("/*")).stem or "data")[:40]
    return f"{stem}-{hashlib.sha1(str(Path(source).expanduser().absolute()).encode()).hexdigest()[:8]}"


def _tokenize_split(docs, enc, out, split, workers, shard_tokens) -> dict:
    total_bytes = sum(len(doc.encode("utf-8")) for doc in docs)
    workers = 1 if total_bytes < PARALLEL_BYTES else (workers or os.cpu_count() or 1)
    print(f"{split}: tokenizing {total_bytes / 1e6:,.1f} MB with {workers} thread(s)", file=sys.stderr)
    progress = Progress(split, total_bytes, "MB", scale=1e6)
    bos, eos = np.array([bos_id(enc)], np.uint32), np.array([eos_id(enc)], np.uint32)
    shards, buffer, buffered, total = [], [], 0, 0

    def write(n):  # the first n buffered tokens become the next shard
        nonlocal buffer, buffered
        flat = np.concatenate(buffer)
        path = out / f"{split}_{len(shards):06d}.bin"
        shards.append(write_shard(path, flat[:n], enc.name, vocab_size=enc.n_vocab).name)
        buffer, buffered = [flat[n:]], len(flat) - n

    # encode_ordinary never turns "<|...|>" in raw text into a special token
    for first, last, ids in _encode_pieces(docs, enc, workers, progress):
        for tokens in ([bos] if first else []) + [np.asarray(ids, np.uint32)] + ([eos] if last else []):
            buffer.append(tokens)
            buffered += len(tokens)
            total += len(tokens)
        while buffered >= shard_tokens:
            write(shard_tokens)
    if buffered:
        write(buffered)
    progress.close(f"{split}: {total:,} tokens from {total_bytes / 1e6:,.1f} MB in {progress.seconds():.1f}s "
                   f"({total_bytes / 1e6 / progress.seconds():.1f} MB/s)")
    return {"tokens": total, "documents": len(docs), "shards": shards}


def _encode_pieces(docs, enc, workers, progress):
    """Yield (is_first_piece, is_last_piece, ids) for every piece of every document, in order.
    tiktoken releases the GIL while it encodes, so a thread pool (encode_ordinary_batch) keeps all
    cores busy without copying the tokenizer into other processes. Batches of about
    workers * PIECE_CHARS characters bound the memory held as Python lists of ids."""
    batch, chars = [], 0
    for doc in docs:
        pieces = split_text(doc)
        for i, piece in enumerate(pieces):
            batch.append((i == 0, i == len(pieces) - 1, piece))
            chars += len(piece)
            if chars >= workers * PIECE_CHARS:
                yield from _encode_batch(batch, enc, workers, progress)
                batch, chars = [], 0
    yield from _encode_batch(batch, enc, workers, progress)


def _encode_batch(batch, enc, workers, progress):
    texts = [text for _, _, text in batch]
    if workers > 1:
        encoded = enc.encode_ordinary_batch(texts, num_threads=workers)
    else:
        encoded = map(enc.encode_ordinary, texts)
    for (first, last, text), ids in zip(batch, encoded):
        progress.update(len(text.encode("utf-8")))
        yield first, last, ids


def split_text(text, size=None) -> list:
    """Cut text into pieces of about `size` characters, only right after a newline between two
    non-space characters ("x\\n|y"). Every supported pat_str ends a pre-token there, so the pieces
    encode to exactly the tokens of the whole text."""
    size = size or PIECE_CHARS
    pieces, start = [], 0
    while len(text) - start > size:
        cut = text.find("\n", start + size)
        while cut != -1 and (cut + 1 >= len(text) or text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        pieces.append(text[start:cut + 1])
        start = cut + 1
    pieces.append(text[start:])
    return pieces


class Progress:
    """A long job's progress on stderr (tokenizing, scoring a benchmark): on a terminal a live line
    redrawn four times a second, elsewhere (a log file) a line every `every` seconds, so a short job
    prints none; nothing where quiet (every rank but one). `unit` counts `scale` of update()'s n."""

    def __init__(self, label: str, total: float, unit: str, scale: float = 1.0, quiet: bool = False,
                 every: float = 30.0):
        self.label, self.total, self.unit, self.scale, self.quiet = label, total, unit, scale, quiet
        self.live, self.done, self.t0 = sys.stderr.isatty(), 0, time.time()
        self.every = 0.25 if self.live else every
        self.next = self.t0 + self.every

    def update(self, n):
        self.done += n
        now = time.time()
        if now >= self.next and not self.quiet:
            self.next = now + self.every
            rate, cr = self.done / self.scale / max(now - self.t0, 1e-9), "\r" if self.live else ""
            total = f"{self.total / self.scale:,.{1 if self.scale != 1 else 0}f}"  # (1.1 MB, 1,838 sequences)
            print(f"{cr}{self.label}: {100 * self.done / max(self.total, 1):5.1f}% of {total} {self.unit} "
                  f"({rate:,.1f} {self.unit}/s, {now - self.t0:.0f} s)", end="" if self.live else "\n",
                  file=sys.stderr, flush=True)

    def seconds(self) -> float:
        return max(time.time() - self.t0, 1e-9)

    def close(self, line: str):
        """The closing line, over the live one."""
        if not self.quiet:
            print(("\r" if self.live else "") + line, file=sys.stderr)


def _tokenizer_name(tokenizer):
    """The name a shard header stores, without loading a tokenizer when a known name is given."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, tiktoken.Encoding):
        return tokenizer.name
    return str(tokenizer) if str(tokenizer) in TOKENIZERS else get_tokenizer(tokenizer).name


def resolve_data(data, tokenizer, mirror=None, **prepare_kwargs) -> Path:
    """train.py's --data: a prepared folder is checked and used as is; anything else is prepared."""
    name, folder = _tokenizer_name(tokenizer), Path(str(data)).expanduser()
    shards = sorted(folder.glob("train_*.bin")) + sorted(folder.glob("val_*.bin")) if os.path.isdir(folder) \
        else []
    if not shards:
        return prepare(data, tokenizer, mirror=mirror, **prepare_kwargs)
    if not os.path.exists(folder / "meta.json"):
        raise DataError(f"{folder} has shards but no meta.json (an interrupted prepare?); prepare it again")
    regular_file(folder / "meta.json", "meta.json of a prepared folder")
    for shard in shards:
        read_shard(shard, name)
    return folder


# ----------------------------------------------------------------------------------------------------
# 6. Loader: shards -> batches

def _ends_sha256(path, size=1 << 12) -> str:
    """sha256 of a file's first and last `size` bytes (of the whole file, once, when shorter than
    2 * size): cheap, and it sees the header and both ends of a shard."""
    h = hashlib.sha256()
    with open(regular_file(path, "token shard"), "rb") as f:
        length = os.fstat(f.fileno()).st_size
        h.update(f.read(size if length > 2 * size else length))
        if length > 2 * size:
            f.seek(length - size)
            h.update(f.read(size))
    return h.hexdigest()


class Positions:
    """A loader's position in its n items (token windows, or fixed rows), read in an order drawn per
    epoch: global sequence i is item perm_e[i % n] of epoch e = i // n, perm_e seeded by (seed, e).
    Rank r reads global sequences consumed + r*batch_size + arange(batch_size); every next() on
    every rank adds batch_size * dp_size to consumed. So an optimizer step covers the same sequences
    however dp ranks and micro-batches split it, and {"consumed", "seed", "seq_len"} plus a
    subclass's settings is the whole position: a checkpoint resumes it under any dp."""

    def __init__(self, n, batch_size, seq_len, dp_rank, dp_size, seed, empty: str):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if n == 0:
            raise DataError(empty)
        self.n, self.batch_size, self.seq_len, self.seed = n, batch_size, seq_len, seed
        self.dp_rank, self.dp_size, self.consumed = dp_rank, dp_size, 0
        self._epochs = {}  # epoch -> its draws; a batch touches at most two epochs

    def __len__(self):
        return self.n

    @property
    def epoch(self) -> int:
        return self.consumed // self.n

    def _draw(self, rng) -> tuple:
        """An epoch's random draws: the order of the items, then whatever a subclass adds."""
        return (rng.permutation(self.n),)

    def _epoch(self, epoch: int) -> tuple:
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = self._draw(np.random.default_rng([self.seed, epoch]))
        return self._epochs[epoch]

    def _next_seqs(self) -> np.ndarray:
        """This rank's next batch_size global sequences; every rank moves on by the global batch."""
        seqs = self.consumed + self.dp_rank * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        self.consumed += self.batch_size * self.dp_size
        return seqs

    def _next_items(self) -> tuple[np.ndarray, np.ndarray]:
        return self._items(self._next_seqs())

    def _items(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sequence numbers -> (item index, epoch) arrays."""
        epochs, within = np.divmod(seqs, self.n)
        items = np.empty_like(seqs)
        for e in np.unique(epochs):
            items[epochs == e] = self._epoch(int(e))[0][within[epochs == e]]
        return items, epochs

    def _settings(self) -> dict:
        return {"seed": self.seed, "seq_len": self.seq_len}

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, **self._settings()}

    def load_state_dict(self, state):
        if not isinstance(state, dict):
            raise DataError(f"loader state is a {type(state).__name__}, not a dict: the saved state is "
                            "damaged")
        saved, mine = {key: state.get(key) for key in self._settings()}, self._settings()
        if saved != mine:
            say = lambda s: ", ".join(f"{k} {v}" for k, v in s.items())
            raise DataError(f"loader state is for {say(saved)}, but this loader has {say(mine)}; "
                            f"resume with the same values")
        consumed = state.get("consumed")
        if isinstance(consumed, bool) or not isinstance(consumed, (int, np.integer)) or consumed < 0:
            raise DataError(f"loader state has consumed {consumed!r}, not a number of sequences (a whole "
                            "number >= 0): the saved state is damaged; resume from another checkpoint")
        self.consumed = int(consumed)


class Loader(Positions):
    """(inputs, targets) batches of shape (batch_size, seq_len) for one dp rank. The items are
    windows of seq_len + 1 tokens:
      * A shard of n tokens holds c = max(n // seq_len - 1, 1) windows (0 if n <= seq_len) at stride
        seq_len: window j covers tokens [shift + j*seq_len, shift + (j+1)*seq_len], its last token
        the next one's first, so each token is a target once per epoch (bar < 2*seq_len at a shard's
        ends). Windows never cross shard ends. The shift is drawn per (epoch, shard) in
        [0, min(slack, seq_len - 1)], c leaving a full seq_len of slack where the shard is long
        enough, so every epoch sees other context boundaries.
      * All shards' windows share one index space of len(self), read in Positions' order (8 bytes a
        window: 1B tokens at seq_len 1024 take 8 MB).
      * Every read is checked by check_token_ids, which names the shard.
    fingerprint(), for resume checks and computed once: a 16-digit hex digest of each shard's file
    name, token count, tokenizer and _ends_sha256. A moved or copied cache gives the same one, other
    data another; a change mid-shard that keeps its size goes unseen, the price of reading only
    8 KiB a shard at every rank's start (1.2 GB for the 150,000 shards of 15T tokens)."""

    def __init__(self, data_dir, split, batch_size, seq_len, dp_rank=0, dp_size=1, seed=0, tokenizer=None,
                 bos=None):
        """tokenizer: a name, or an Encoding (then every id must also be below its n_vocab). bos
        (--doc-mask): batches with a document boundary inside a row carry document ids (with_documents)."""
        paths = sorted(Path(data_dir).glob(f"{split}_*.bin")) if os.path.isdir(data_dir) else []
        if not paths:
            raise DataError(f"no {split} shards ({split}_*.bin) in {data_dir}; run: python data.py prepare "
                            "...")
        name = _tokenizer_name(tokenizer)
        self.n_vocab = tokenizer.n_vocab if isinstance(tokenizer, tiktoken.Encoding) else None
        self.paths, self.shards = paths, [read_shard(p, name, self.n_vocab) for p in paths]
        self.infos = [shard_info(p) for p in paths]
        n = np.array([len(s) for s in self.shards], dtype=np.int64)
        counts = np.where(n > seq_len, np.maximum(n // seq_len - 1, 1), 0)
        self.max_shift = np.clip(np.minimum(n - 1 - counts * seq_len, seq_len - 1), 0, None)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])  # each shard's first window index
        self.num_tokens = int(n.sum())
        super().__init__(int(self.offsets[-1]), batch_size, seq_len, dp_rank, dp_size, seed, empty=(
            f"the {split} split in {data_dir} has {self.num_tokens:,} tokens (largest shard "
            f"{int(n.max()):,}), too few for one sequence of seq_len + 1 = {seq_len + 1:,} tokens; lower "
            "seq_len or use more data"))
        self._cols, self.bos = np.arange(seq_len + 1), bos

    def _draw(self, rng) -> tuple:
        return rng.permutation(self.n), rng.integers(0, self.max_shift + 1)  # order, shard shifts

    def next(self):
        return with_documents(self.batch_at(self._next_seqs()), self.bos)

    def batch_at(self, seqs: np.ndarray):
        """(inputs, targets) rows of these global sequences (how a mixture reads a source)."""
        window, epochs = self._items(seqs)
        shard = np.searchsorted(self.offsets, window, side="right") - 1
        start = (window - self.offsets[shard]) * self.seq_len
        for e in np.unique(epochs):
            start[epochs == e] += self._epoch(int(e))[1][shard[epochs == e]]
        batch = np.empty((len(seqs), self.seq_len + 1), dtype=np.int64)
        for k in np.unique(shard):  # one fancy-indexing read per shard touched, one max over it
            rows = shard == k
            ids = self.shards[k][start[rows, None] + self._cols]
            info = self.infos[k]
            check_token_ids(ids, self.paths[k], info["tokenizer"], self.n_vocab, info["max_id"])
            batch[rows] = ids
        return torch.from_numpy(batch[:, :-1].copy()), torch.from_numpy(batch[:, 1:].copy())

    @functools.cached_property
    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for path, info in zip(self.paths, self.infos):
            h.update(json.dumps([path.name, info["tokens"], info["tokenizer"], _ends_sha256(path)]).encode())
        return h.hexdigest()[:16]

    def fingerprint(self) -> str:
        return self._fingerprint


# ----------------------------------------------------------------------------------------------------
# 6b. Mixtures: several sources, each its share of the sequences
# Llama 3 pretrained on a mix (about half general text, a quarter math and reasoning, 17% code, 8%
# multilingual) and annealed on a higher-quality mix at the end; MixtureLoader does both.


def parse_mixture(spec) -> list[tuple[str, float]]:
    """--data "c4_demo:0.5,wiki_demo:0.3,tinyshakespeare:0.2" -> [(source, weight)], weights summing
    to 1; a source is anything resolve_data takes (a name, file, glob or shard folder). Each
    comma-separated part is, by the first rule that fits:
      * a whole part naming an existing file or folder: it, weight 1 ("x:2" is that file, never x);
      * a part whose text after the last ":" reads as a number: the source before it at that weight
        (the file "x:2" at weight 0.5 is "x:2:0.5");
      * else the whole part, weight 1 (C:\\data, https://...).
    Two parts naming one source are refused: one name twice, or two spellings of one existing path
    (./x.txt and x.txt, a symlink and its target, relative and absolute). A weight must be positive,
    finite and large enough to give its source some of every MixtureSchedule.BLOCK sequences."""
    parts = [part.strip() for part in str(spec).split(",") if part.strip()]
    if not parts:
        raise DataError(f"--data {spec!r} names no source")
    mixture = [_mixture_part(spec, part) for part in parts]
    _refuse_repeats(spec, [source for source, _ in mixture])
    weights = [w for _, w in mixture]
    total = sum(weights)
    if not np.isfinite(total):  # each finite, their sum not (1e308 + 1e308): scale the largest to 1
        weights = [w / max(weights) for w in weights]
        total = sum(weights)
    shares = [w / total for w in weights]
    counts = MixtureSchedule(shares, seed=0).counts
    for (source, weight), share, count in zip(mixture, shares, counts):
        if count == 0:  # it would be prepared and never read
            raise DataError(f"--data {spec!r}: {source} has weight {weight:g}, {share:.2g} of the mixture: "
                            f"too little for one of every {MixtureSchedule.BLOCK:,} sequences; raise its "
                            "weight or leave it out")
    return [(source, share) for (source, _), share in zip(mixture, shares)]


def _mixture_part(spec, part) -> tuple[str, float]:
    """One part of --data -> (source, weight), by parse_mixture's rules."""
    if os.path.exists(Path(part).expanduser()):
        return part, 1.0
    source, _, weight = part.rpartition(":")
    try:
        w = float(weight)
    except ValueError:  # no weight, or a ":" inside the source (C:\..., https://...)
        return part, 1.0
    if not source:
        raise DataError(f"--data {spec!r}: a part names no source")
    if not (w > 0 and np.isfinite(w)):
        raise DataError(f"--data {spec!r}: {source} has weight {weight}; weights must be positive numbers")
    return source, w


def _refuse_repeats(spec, sources):
    """parse_mixture's repeat rule; paths compare resolved where they exist, else normalized."""
    seen = {}
    for source in sources:
        path = Path(source).expanduser()
        if source in DATASETS:
            key = source
        elif os.path.exists(path):
            key = str(path.resolve())
        else:
            key = os.path.normpath(path.absolute())
        if key in seen:
            said = repr(source) if seen[key] == source else f"{seen[key]!r} and {source!r} are one source"
            raise DataError(f"--data {spec!r} names a source twice ({said}); give each source once")
        seen[key] = source


class MixtureSchedule:
    """Which source each global sequence comes from, in blocks of BLOCK sequences: every block holds
    each source's share (largest remainders, exact to 1/BLOCK) in an order drawn from (seed, block).
    So the source of sequence i, and how many sequences each source gave before it, take one block's
    draw: nothing is stored, and the loader's position stays one number."""

    BLOCK = 1000

    def __init__(self, weights: list[float], seed: int):
        quota = np.asarray(weights, dtype=np.float64) * self.BLOCK
        counts = np.floor(quota).astype(np.int64)
        counts[np.argsort(counts - quota, kind="stable")[:self.BLOCK - counts.sum()]] += 1
        self.counts, self.seed = counts, seed
        self._block = (None, None)

    def _order(self, block: int) -> np.ndarray:
        if self._block[0] != block:
            rng = np.random.default_rng([self.seed, 0x6D6978, block])  # 0x6D6978: "mix"
            self._block = (block, rng.permutation(np.repeat(np.arange(len(self.counts)), self.counts)))
        return self._block[1]

    def source(self, i: int) -> int:
        return int(self._order(i // self.BLOCK)[i % self.BLOCK])

    def before(self, i: int) -> np.ndarray:
        """How many of sequences 0 .. i-1 each source gave."""
        block, within = divmod(i, self.BLOCK)
        return self.counts * block + np.bincount(self._order(block)[:within], minlength=len(self.counts))


class MixtureLoader(Positions):
    """(inputs, targets) batches from a mixture of prepared sources, for one dp rank. Global
    sequence i (numbered as in Positions) is sequence j of source s = schedule.source(i), j = how
    many sequences s gave before i, read by s's own Loader: each source goes through its epochs at
    its own pace. With anneal = (i0, weights), sequences from i0 on follow a second schedule, each
    source going on from where the first left it; the position is still `consumed`."""

    def __init__(self, sources: list[tuple[str, Path, float]], split: str, batch_size: int, seq_len: int,
                 dp_rank=0, dp_size=1, seed=0, tokenizer=None, anneal=None, bos=None):
        # sources: (name, prepared folder, weight) each
        self.names, self.bos = [name for name, _, _ in sources], bos
        self.loaders = [Loader(path, split, batch_size, seq_len, seed=seed, tokenizer=tokenizer)
                        for _, path, _ in sources]
        self.weights, self.anneal = [w for _, _, w in sources], anneal
        self.schedules = [MixtureSchedule(self.weights, seed)] + ([MixtureSchedule(anneal[1], seed + 1)]
                                                             if anneal else [])
        self.num_tokens = sum(loader.num_tokens for loader in self.loaders)
        super().__init__(sum(len(loader) for loader in self.loaders), batch_size, seq_len, dp_rank, dp_size,
                         seed, empty=f"the {split} splits of {', '.join(self.names)} hold no sequence")

    def _settings(self) -> dict:
        return {**super()._settings(), "mixture": [[n, w] for n, w in zip(self.names, self.weights)],
                "anneal": None if self.anneal is None else [self.anneal[0], list(self.anneal[1])]}

    def counts(self, i: int) -> np.ndarray:
        """How many of global sequences 0 .. i-1 each source gave."""
        start = self.anneal[0] if self.anneal else i
        first = self.schedules[0].before(min(i, start))
        return first if i <= start else first + self.schedules[1].before(i - start)

    def source(self, i: int) -> int:
        start = self.anneal[0] if self.anneal else i + 1
        return self.schedules[0].source(i) if i < start else self.schedules[1].source(i - start)

    def tokens_seen(self) -> dict[str, int]:
        """Target tokens each source has given so far, over every dp rank."""
        return {name: int(n) * self.seq_len for name, n in zip(self.names, self.counts(self.consumed))}

    def fingerprint(self) -> str:
        """A short hex digest of each source's name, weight and Loader.fingerprint(); never reads
        whole shards. (The annealing switch is a setting, checked by load_state_dict.)"""
        sources = [[name, float(weight), loader.fingerprint()]
                   for name, weight, loader in zip(self.names, self.weights, self.loaders)]
        return hashlib.sha256(json.dumps(sources).encode()).hexdigest()[:16]

    def next(self):
        seqs = self._next_seqs()
        sources = np.array([self.source(int(i)) for i in seqs])
        local = np.array([self.counts(int(i))[s] for i, s in zip(seqs, sources)], dtype=np.int64)
        inputs = torch.empty(len(seqs), self.seq_len, dtype=torch.int64)
        targets = torch.empty_like(inputs)
        for s in np.unique(sources):
            rows = torch.from_numpy(np.flatnonzero(sources == s))
            inputs[rows], targets[rows] = self.loaders[s].batch_at(local[sources == s])
        return with_documents((inputs, targets), self.bos)


def with_documents(batch: tuple, bos: int | None) -> tuple:
    """(inputs, targets) -> (inputs, targets, doc_ids (B, T)), each <|begin_of_text|> starting the next
    document (the tokens before a row's first one end a document begun in an earlier row), where a row
    has a document boundary after its first token; else the batch unchanged, whose plain causal
    attention is then the same and needs no mask kernel. Decided on the host: the step waits for no
    device."""
    inputs = batch[0]
    if bos is None or not (inputs[:, 1:] == bos).any():
        return batch
    return (*batch, (inputs == bos).cumsum(dim=-1))


# ----------------------------------------------------------------------------------------------------
# 7. Records: the JSON and JSONL files a recipe names

IGNORE_INDEX = -100  # an unlearned target: torch.nn.functional.cross_entropy's default ignore_index


def named_file(path_or_name, registered, mirror) -> Path:
    name = str(path_or_name)
    if name in registered:
        return fetch(name, mirror)
    path = Path(name).expanduser()
    if not os.path.exists(path):
        raise DataError(f"no file {name!r}, and it is not a registered name ({', '.join(registered)})")
    return regular_file(path, "data file")


def json_records(path) -> list:
    """A JSON array or JSONL file -> [(where, record)]: "file:line" or "file: record i" (from 0)."""
    try:
        text = regular_file(path, "data file").read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not utf-8 text ({e.reason} at byte {e.start:,})") from None
    if text.lstrip().startswith("["):  # one JSON array, as Alpaca ships
        try:
            records = load_json(text)
        except json.JSONDecodeError as e:
            where = f"{path}:{e.lineno}" if e.lineno else str(path)
            raise DataError(f"{where}: malformed JSON ({json_reason(e)})") from None
        return [(f"{path}: record {i}", record) for i, record in enumerate(records)]
    records = []
    for lineno, line in enumerate(text.split("\n"), 1):  # split("\n"): see read_documents
        if line.strip():
            try:
                records.append((f"{path}:{lineno}", load_json(line)))
            except json.JSONDecodeError as e:
                raise jsonl_error(path, lineno, line, text, e) from None
    return records


# ----------------------------------------------------------------------------------------------------
# 8. Failures a user can cause, each said in one line

def one_line(error) -> str:
    """An exception's message on one line (its type's name if it has none). A pickle refused by
    torch.load(weights_only=True) is said so, with torch's reason but not its advice to load the
    file unsafely."""
    text = str(error)
    if text.startswith("Weights only load failed"):
        # torch's reason follows its advice; the marker before it differs between torch versions.
        for marker in ("WeightsUnpickler error:", "from a trusted source."):
            text = text.split(marker)[-1]
        reason = " ".join(text.split("Check the documentation")[0].split())
        return (f"refused to unpickle it (weights_only=True loads tensors and plain containers only, never "
                f"code): {reason}")
    return " ".join(text.split()) or type(error).__name__


_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFDIR: "a folder", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def regular_file(path, what: str) -> Path:
    """`path` if it is a regular file (or a symlink to one), else DataError saying what it is.
    Checked before opening any file a user names: open() on a FIFO waits forever for a writer, and a
    folder, device or socket is no data. (Elsewhere this file probes a user's path with
    os.path.exists / isdir: False for a name too long or with a NUL byte, where pathlib raises.)"""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        dangling = " (a symlink to nothing)" if path.is_symlink() else ""
        raise DataError(f"no {what} at {path}{dangling}") from None
    except OSError as e:  # a symlink loop, a folder we may not enter
        raise DataError(f"cannot read the {what} {path}: {one_line(e)}") from None
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a plain file")
        raise DataError(f"the {what} {path} is {kind}, not a regular file; replace it with a regular "
                        "file (a symlink to one is fine)")
    return path


def load_json(text: str):
    """json.loads, failing only with json.JSONDecodeError, where json raises RecursionError for
    nesting past the recursion limit ([[[[...]]]]) and ValueError for an integer of more than
    sys.get_int_max_str_digits() digits; those two carry no position (lineno and colno are None)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        reason = "nested too deeply"
    except ValueError as e:
        reason = (f"an integer of more than {sys.get_int_max_str_digits():,} digits"
                  if "integer string conversion" in str(e) else one_line(e))
    error = json.JSONDecodeError(reason, text, 0)
    error.lineno = error.colno = None
    raise error from None


def json_reason(e: json.JSONDecodeError) -> str:
    return f"{e.msg} at column {e.colno}" if e.colno else e.msg


# read-only, not ours, disk or quota full, or no folder possible (name too long, a file in the way)
_WRITE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG,
                 errno.ENOTDIR}


@contextlib.contextmanager
def writing(folder, target, cleanup=()):
    """Turns the write failures a user must fix outside the program (_WRITE_ERRNOS: a read-only
    folder, a full disk, ...) into one DataError line naming `folder`, or `target` for a full disk,
    after removing `cleanup` (partial files, temporary folders) so nothing half-written stays."""
    try:
        yield
    except OSError as e:
        if e.errno not in _WRITE_ERRNOS:
            raise
        for path in map(Path, cleanup):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:  # a read-only mount refuses even to unlink a missing file (EROFS): nothing to clean
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"no space left on device while writing {target} ({one_line(e)}); free some "
                            "space or point DATA_CACHE (or --out) at a disk with room") from None
        raise DataError(f"cannot write into {folder} ({one_line(e)}); make it writable or point DATA_CACHE "
                        "(or --out) at a folder you can write to") from None


@contextlib.contextmanager
def sigterm_raises_keyboard_interrupt():
    """Within it, SIGTERM (what `kill` and schedulers send) raises KeyboardInterrupt as Ctrl-C does,
    so `finally` blocks clean up; the previous handler is restored afterwards. Only in the main
    thread (the only one Python lets set handlers) and while SIGTERM has its default action: a
    handler someone else installed (train.py's preemption flag) is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------------------------------
# 9. Command line

def _print_info(path):
    path = Path(path)
    if not os.path.exists(path):
        raise DataError(f"no file or folder {path}")  # a FIFO or device: refused by shard_info
    shards = sorted(path.glob("*.bin")) if os.path.isdir(path) else [path]
    if not shards:
        raise DataError(f"{path} holds no token shards (*.bin)")
    for shard in shards:
        info = shard_info(shard)
        print(f"{shard}: {info['tokens']:,} tokens, {info['dtype'].name}, tokenizer {info['tokenizer']}, "
              f"format v{info['version']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Download, tokenize and inspect training data.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize a source into train/val shards")
    p.add_argument("--source", required=True, help=f"{' | '.join(DATASETS)} | a file, folder or glob")
    p.add_argument("--tokenizer", default="byte",
                   help=f"{' | '.join(TOKENIZERS)} | path to tokenizer.model (default: %(default)s)")
    p.add_argument("--out", help="output folder (default: <DATA_CACHE>/shards/<source>-<tokenizer>)")
    p.add_argument("--mirror",
                   help="local mirror folder holding the registry's files (default: $DATA_MIRROR)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of documents held out (default: %(default)s)")
    p.add_argument("--text-field", default="text",
                   help="field holding the text in .jsonl records (default: %(default)s)")
    p.add_argument("--workers", type=int, help="tokenizer threads (default: all cores)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help="tokens per shard file (default: %(default)s)")
    d = commands.add_parser("download", help="fetch a registry file into the cache")
    d.add_argument("name", help=" | ".join(registry()))
    d.add_argument("--mirror", help="local mirror folder (default: $DATA_MIRROR)")
    i = commands.add_parser("info", help="print the header of a shard, or of every shard in a folder")
    i.add_argument("path", help="a shard (.bin) or a folder of them")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            out = prepare(args.source, args.tokenizer, out_dir=args.out, mirror=args.mirror,
                          workers=args.workers,
                          val_fraction=args.val_fraction, text_field=args.text_field,
                          shard_tokens=args.shard_tokens)
            meta = _read_json_object(out / "meta.json", "meta.json")  # complete: prepare checked it
            print(f"shards in {out} (tokenizer {meta['tokenizer']}, vocab {meta['n_vocab']:,})")
            for split, s in meta["splits"].items():
                print(f"  {split:<5} {s['tokens']:>14,} tokens {s['documents']:>9,} documents "
                      f"{len(s['shards']):>4} shard(s)")
        elif args.command == "download":
            print(fetch(args.name, args.mirror))
        else:
            _print_info(args.path)
    except (DataError, OSError) as e:  # OSError: a folder that cannot be written or read
        print(f"error: {e if isinstance(e, DataError) else one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; prepare has said what it stopped
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
