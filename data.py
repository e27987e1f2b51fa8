"""data.py: from a URL to batches.

The data path of the project, in the order the bytes travel through this file:

  1. Sources     DATASETS names a few public files (URL, sha256, license, path in the offline mirror).
                 download() fetches one into the cache: streamed, retried, resumed, checksummed, atomic.
                 With DATA_MIRROR (or mirror=/--mirror) it copies from a local mirror folder instead.
  2. Tokenizers  get_tokenizer(): byte, gpt2, cl100k_base, o200k_base and llama3 as tiktoken Encodings,
                 all carrying the Llama 3 special tokens (<|begin_of_text|>, <|end_of_text|>, ...).
  3. Documents   read_documents(): a .txt file is one document, a .jsonl file one document per line.
  4. Shards      write_shard() / read_shard(): a 256-byte header, then uint16 or uint32 tokens.
  5. prepare()   documents -> BOS + tokens + EOS -> train_*.bin, val_*.bin, and meta.json written last
                 as the completion marker. resolve_data() is what train.py calls with its --data value.
  6. Loader      shards -> one deterministic sequence of windows -> (inputs, targets) for each data-parallel
                 rank. Its whole position is one global counter, so a run resumes exactly under any dp.
  7. CLI         python data.py prepare | download | info

Every failure a user can cause ends in DataError, whose message is one line saying what to do.
"""
import argparse
import base64
import binascii
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np
import requests
import tiktoken
import torch


class DataError(Exception):
    """A problem with the data or its sources; train.py prints it as one line and exits."""


def cache_dir() -> Path:
    return Path(os.environ.get("DATA_CACHE") or "~/.cache/llama3-train").expanduser()


def _mirror_root(mirror=None):
    root = mirror or os.environ.get("DATA_MIRROR")
    return Path(root).expanduser() if root else None


def _one_line(error) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:200]


# ======== 1. Sources and download =================================================================
# Each entry: a public URL, the sha256 that URL must deliver, the license, where the same file lies in
# a mirror folder laid out like shared/data (see its MANIFEST.md), and how to cut it into documents.
# URLs are pinned to the commits MANIFEST.md names, so the content (and its hash) cannot drift; the
# TinyShakespeare file has never changed on char-rnn's master branch.

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
DATASETS.update({  # Project Gutenberg books from a repository snapshot: Windows-1252 text, CRLF, PG header
    name: dict(url=f"{_GUTENBERG}/{book}.txt", sha256=sha256, format="text", encoding="cp1252",
               license="public domain in the USA", mirror=f"text/gutenberg/{book}.txt")
    for name, book, sha256 in [
        ("pride_and_prejudice", "pg1342", "f0247a0f5038e95d94fb4284ff9d24f07c812058536f6152115e1f9a92260517"),
        ("moby_dick", "pg2701", "eb1a1ca16369a025021459cf71bf5c4de1e05852bc1d83160c08484adffab73f"),
        ("frankenstein", "pg84", "4eaa0bd8cf407530e42d99ed95b61b9a4bb8492a3a9c0c9a41cd017bfed7bcd7")]})

LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
TOKENIZER_FILES = {  # files a tokenizer needs; fetched through the same machinery as the datasets
    "llama3": dict(
        url=f"{_GH}/meta-llama/llama-models/a9c89c471f793423afd4cc3ca8671d6e56fe64cb/models/llama3/tokenizer.model",
        sha256=LLAMA3_SHA256, license="Meta Llama 3 Community License", mirror="llama3/tokenizer.model"),
}


def fetch(name: str, mirror=None) -> Path:
    """A registry name (dataset or tokenizer file) -> the verified file in <cache>/downloads."""
    if "/" in name or "\\" in name or ".." in name or not name:
        raise DataError(f"bad dataset name {name!r}: registry names may not contain path separators or '..'")
    entry = DATASETS.get(name) or TOKENIZER_FILES.get(name)
    if entry is None:
        raise DataError(f"unknown dataset {name!r}; known names: {', '.join([*DATASETS, *TOKENIZER_FILES])}")
    if Path(entry["mirror"]).is_absolute() or ".." in Path(entry["mirror"]).parts:
        raise DataError(f"registry entry {name!r} has a mirror path outside the mirror: {entry['mirror']}")
    dest = cache_dir() / "downloads" / (name + Path(entry["mirror"]).suffix)
    return download(entry["url"], entry["sha256"], dest, mirror=mirror, mirror_path=entry["mirror"])


def download(url, sha256, dest, mirror=None, mirror_path=None, *, retries=4, timeout=30.0, backoff=1.0,
             allow_http=False) -> Path:
    """Put the file at `url` (or `mirror/mirror_path`) into `dest`, verified against `sha256`.

    Only a complete, verified file is ever renamed to `dest`, so an existing `dest` is a cache hit.
    Bytes arrive in `dest.part`; a later call resumes it with an HTTP Range request.
    """
    if not (url.startswith("https://") or allow_http):
        raise DataError(f"refusing to download {url}: only https URLs are accepted")
    dest = Path(dest)
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    root = _mirror_root(mirror)
    wanted = mirror_path or dest.name
    hint = f"to work offline, set DATA_MIRROR or --mirror to a folder holding {wanted}"
    if root is not None and mirror_path:
        if (root / mirror_path).is_file():
            print(f"copying {root / mirror_path} -> {dest}", file=sys.stderr)
            shutil.copyfile(root / mirror_path, part)
            return _verify_and_place(part, dest, sha256, f"{url} (mirror copy {root / mirror_path})", hint)
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
        # identity encoding: byte ranges and Content-Length must count the bytes we store, not gzip bytes
        headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
        try:
            with requests.get(url, headers=headers, stream=True, timeout=timeout) as r:
                if r.status_code == 416 and have:  # nothing left to send: the partial file is complete
                    return
                if r.status_code not in (200, 206):
                    if r.status_code < 500 and r.status_code not in (408, 429):  # retrying will not help
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
            print(f"  try {attempt + 1}/{retries} failed: {_one_line(e)}", file=sys.stderr)
    raise DataError(f"could not download {url} after {retries} tries ({_one_line(error)}); {hint}")


def _sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _verify_and_place(part, dest, sha256, origin, hint):
    got = _sha256_file(part)
    if got != sha256:
        part.unlink()  # a wrong file must not be resumed from either
        raise DataError(f"checksum mismatch for {origin}: expected sha256 {sha256}, got {got} "
                        f"(deleted the download); {hint}")
    os.replace(part, dest)
    return dest


# ======== 2. Tokenizers ===========================================================================
# Every tokenizer speaks the same special tokens, so the rest of the code only knows their names.
# Llama 3 has 256 of them above its 128,000 ranks; the others get the first 12 above their own vocab.

SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>",
]
LLAMA3_SPECIAL_TOKENS = SPECIAL_TOKENS + [f"<|reserved_special_token_{i}|>" for i in range(2, 246)]  # Llama 3.1
LLAMA3_RANKS = 128_000
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TOKENIZERS = ("byte", "gpt2", "cl100k_base", "o200k_base", "llama3")


@functools.lru_cache(maxsize=16)
def get_tokenizer(name_or_path, mirror=None) -> tiktoken.Encoding:
    """byte | gpt2 | cl100k_base | o200k_base | llama3 | a path to a Llama 3 tokenizer.model."""
    name = str(name_or_path)
    if name == "byte":  # 256 single-byte ranks and no merges: a character-level model for UTF-8 bytes
        return _with_specials("byte", {bytes([i]): i for i in range(256)}, GPT2_PAT, {})
    if name in ("gpt2", "cl100k_base", "o200k_base"):
        base = _openai_encoding(name, mirror)
        return _with_specials(name, base._mergeable_ranks, base._pat_str, base._special_tokens)
    if name == "llama3":
        path = fetch("llama3", mirror)
    elif Path(name).expanduser().is_file():
        path = Path(name).expanduser()
    else:
        raise DataError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)} "
                        f"or a path to a Llama 3 tokenizer.model")
    ranks = _read_rank_file(path)
    specials = {token: LLAMA3_RANKS + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
    return tiktoken.Encoding("llama3", pat_str=LLAMA3_PAT, mergeable_ranks=ranks, special_tokens=specials)


def _with_specials(name, ranks, pat_str, own_specials):
    base_vocab = max(max(ranks.values()), max(own_specials.values(), default=0)) + 1
    specials = {**own_specials, **{token: base_vocab + i for i, token in enumerate(SPECIAL_TOKENS)}}
    return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)


def _openai_encoding(name, mirror):
    # tiktoken reads its rank files from TIKTOKEN_CACHE_DIR (read-only is fine for get_encoding); if that
    # is unset but a mirror is configured, borrow the mirror's copy of tiktoken's cache for this call.
    unset = "TIKTOKEN_CACHE_DIR" not in os.environ
    root = _mirror_root(mirror)
    if unset and root is not None and (root / "tiktoken_cache").is_dir():
        os.environ["TIKTOKEN_CACHE_DIR"] = str(root / "tiktoken_cache")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:
        raise DataError(f"could not load the {name} tokenizer ({_one_line(e)}); offline, set TIKTOKEN_CACHE_DIR "
                        f"or DATA_MIRROR/--mirror to a folder holding tiktoken's cache files") from None
    finally:
        if unset:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)


def _read_rank_file(path) -> dict:
    # Parsed by hand: tiktoken.load.load_tiktoken_bpe(local_path) writes a copy into TIKTOKEN_CACHE_DIR,
    # which fails when that folder is read-only (GUIDE section 4).
    raw = Path(path).read_bytes()
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
        raise DataError(f"{path} holds {len(ranks):,} ranks, but a Llama 3 tokenizer.model has 128,000 (0..127,999)")
    return ranks


def bos_id(enc) -> int:
    return enc.encode_single_token("<|begin_of_text|>")


def eos_id(enc) -> int:  # ends a document
    return enc.encode_single_token("<|end_of_text|>")


def eot_id(enc) -> int:  # ends a chat turn
    return enc.encode_single_token("<|eot_id|>")


# ======== 3. Documents ============================================================================

def resolve_source(source, mirror=None) -> list:
    """A registry name, a file, a folder or a glob -> [(path, format, encoding)]; format: text|lines|jsonl."""
    source = str(source)
    if source in DATASETS:
        entry = DATASETS[source]
        return [(fetch(source, mirror), entry["format"], entry.get("encoding", "utf-8"))]
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"no data found at {source!r}: not a dataset name ({', '.join(DATASETS)}), "
                        f"a file, a folder of .txt/.jsonl files or a glob that matches files")
    return [(p, "jsonl" if p.suffix == ".jsonl" else "text", "utf-8") for p in files]


def read_documents(path, fmt="text", text_field="text", encoding="utf-8") -> list:
    """text: the whole file is one document; lines: one per non-empty line; jsonl: record[text_field].

    Read in text mode, like nanoGPT, so CRLF and CR line ends become "\n".
    """
    try:
        text = Path(path).read_text(encoding=encoding)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not {encoding} text ({e.reason} at byte {e.start:,})") from None
    if fmt == "text":
        return [text] if text else []
    lines = text.split("\n")  # not splitlines(): it also breaks at U+2028, which JSON strings may hold raw
    if fmt == "lines":
        return [line for line in lines if line.strip()]
    docs = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            fields = list(record)[:8] if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{lineno}: no string field {text_field!r} (fields: {fields}); "
                            f"pick one with --text-field")
        if value:
            docs.append(value)
    return docs


def split_documents(docs, val_fraction):
    """-> (train_docs, val_docs). One document: split its text like nanoGPT; many: the last ones validate."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0:
        return docs, []
    if len(docs) == 1:  # nanoGPT: data[:int(n * 0.9)] trains, the rest validates
        cut = int(len(docs[0]) * (1 - val_fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    n_val = max(1, int(len(docs) * val_fraction))
    return docs[:-n_val], docs[-n_val:]


# ======== 4. Token shards =========================================================================
# Layout (little-endian), 256-byte header, then `count` tokens of `itemsize` bytes:
#   offset  0  8 bytes  magic b"L3TOKENS"
#   offset  8  uint32   format version (1)
#   offset 12  uint32   token itemsize / dtype code: 2 = uint16, 4 = uint32
#   offset 16  uint64   token count
#   offset 24  64 bytes tokenizer name, utf-8, zero padded (byte, gpt2, cl100k_base, o200k_base, llama3)
#   offset 88  zeros up to 256 (reserved; also keeps the token array aligned)

SHARD_MAGIC = b"L3TOKENS"
SHARD_VERSION = 1
HEADER_BYTES = 256
_HEADER = struct.Struct("<8sIIQ64s")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def write_shard(path, tokens, tokenizer_name, vocab_size=None) -> Path:
    """uint16 when every id fits (vocab_size <= 65,536, else the largest token decides), else uint32."""
    path, tokens = Path(path), np.asarray(tokens)
    top = vocab_size - 1 if vocab_size else int(tokens.max(initial=0))
    dtype = _DTYPES[2] if top <= 0xFFFF else _DTYPES[4]
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise DataError(f"{path}: token ids outside [0, {np.iinfo(dtype).max}] cannot be stored as {dtype.name}")
    name = tokenizer_name.encode("utf-8")
    if len(name) > 64:
        raise DataError(f"tokenizer name {tokenizer_name!r} is longer than the 64 bytes a shard header holds")
    header = _HEADER.pack(SHARD_MAGIC, SHARD_VERSION, dtype.itemsize, tokens.size, name).ljust(HEADER_BYTES, b"\0")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:  # a crash leaves a .tmp file, never a short shard under the real name
        f.write(header)
        tokens.astype(dtype, copy=False).tofile(f)
    os.replace(tmp, path)
    return path


def shard_info(path) -> dict:
    """Read and check a shard header: {"tokenizer", "tokens", "dtype", "version"}."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:8] != SHARD_MAGIC:
        raise DataError(f"{path} is not a token shard (bad magic {head[:8]!r}, expected {SHARD_MAGIC!r})")
    _, version, itemsize, count, name = _HEADER.unpack_from(head)
    if version != SHARD_VERSION or itemsize not in _DTYPES:
        raise DataError(f"{path}: unsupported shard format version {version} / dtype code {itemsize}")
    size, expected = path.stat().st_size, HEADER_BYTES + count * itemsize
    if size != expected:
        raise DataError(f"{path} is truncated or corrupt: its header says {count:,} tokens ({expected:,} bytes), "
                        f"the file has {size:,} bytes; re-run prepare")
    return {"tokenizer": name.rstrip(b"\0").decode("utf-8"), "tokens": count, "dtype": _DTYPES[itemsize],
            "version": version}


def read_shard(path, tokenizer_name=None) -> np.memmap:
    """Memory-map a shard's tokens, refusing it if it was written with another tokenizer."""
    info = shard_info(path)
    if tokenizer_name is not None and info["tokenizer"] != tokenizer_name:
        raise DataError(f"{path} was tokenized with {info['tokenizer']!r}, but {tokenizer_name!r} is expected; "
                        f"prepare the data again with --tokenizer {tokenizer_name}")
    if info["tokens"] == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=info["dtype"])
    return np.memmap(path, dtype=info["dtype"], mode="r", offset=HEADER_BYTES, shape=(info["tokens"],))


# ======== 5. prepare: documents -> shards =========================================================

DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB (uint16) or 400 MB (uint32) per shard
PIECE_CHARS = 1 << 20  # long documents are cut into pieces of about this size so threads can share them
PARALLEL_BYTES = 1 << 20  # below this, one thread is faster than starting several


def prepare(source, tokenizer, out_dir=None, mirror=None, val_fraction=0.1, workers=None, text_field="text",
            shard_tokens=DEFAULT_SHARD_TOKENS) -> Path:
    """Tokenize a source into <out_dir>/train_*.bin, val_*.bin, meta.json; a finished folder is reused."""
    enc = tokenizer if isinstance(tokenizer, tiktoken.Encoding) else get_tokenizer(tokenizer, mirror)
    inputs = resolve_source(source, mirror)
    out = Path(out_dir) if out_dir else cache_dir() / "shards" / f"{_slug(source)}-{enc.name}"
    settings = {"source": str(source), "tokenizer": enc.name, "val_fraction": val_fraction,
                "text_field": text_field, "shard_tokens": shard_tokens,
                "inputs": [{"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                           for p, *_ in inputs]}
    meta_path = out / "meta.json"
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if all(old.get(key) == value for key, value in settings.items()):
        print(f"{out}: already prepared", file=sys.stderr)
        return out

    # meta.json is the completion marker: remove it first, write it last, so a crash is always redone
    out.mkdir(parents=True, exist_ok=True)
    for stale in [meta_path, *out.glob("train_*.bin"), *out.glob("val_*.bin")]:
        stale.unlink(missing_ok=True)
    docs = [doc for path, fmt, encoding in inputs for doc in read_documents(path, fmt, text_field, encoding)]
    if not docs:
        raise DataError(f"{source}: no documents (empty files, or no non-empty {text_field!r} fields)")
    splits = {}
    for split, part in zip(("train", "val"), split_documents(docs, val_fraction)):
        if part:
            splits[split] = _tokenize_split(part, enc, out, split, workers, shard_tokens)
    meta = {**settings, "n_vocab": enc.n_vocab, "splits": splits,
            "input_sha256": {str(p.resolve()): _sha256_file(p) for p, *_ in inputs}}
    tmp = meta_path.with_name("meta.json.tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    return out


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
    progress = _Progress(split, total_bytes, workers)
    bos, eos = np.array([bos_id(enc)], np.uint32), np.array([eos_id(enc)], np.uint32)
    shards, buffer, buffered, total = [], [], 0, 0

    def write(n):  # the first n buffered tokens become the next shard
        nonlocal buffer, buffered
        flat = np.concatenate(buffer)
        path = out / f"{split}_{len(shards):06d}.bin"
        shards.append(write_shard(path, flat[:n], enc.name, vocab_size=enc.n_vocab).name)
        buffer, buffered = [flat[n:]], len(flat) - n

    # a document becomes BOS + its tokens + EOS; encode_ordinary never turns "<|...|>" in raw text into a special
    for first, last, ids in _encode_pieces(docs, enc, workers, progress):
        for tokens in ([bos] if first else []) + [np.asarray(ids, np.uint32)] + ([eos] if last else []):
            buffer.append(tokens)
            buffered += len(tokens)
            total += len(tokens)
        while buffered >= shard_tokens:
            write(shard_tokens)
    if buffered:
        write(buffered)
    progress.close(total)
    return {"tokens": total, "documents": len(docs), "shards": shards}


def _encode_pieces(docs, enc, workers, progress):
    """Yield (is_first_piece, is_last_piece, token ids) for every piece of every document, in order.

    tiktoken releases the GIL while it encodes, so a thread pool (encode_ordinary_batch) keeps all cores
    busy without copying the tokenizer into other processes. Pieces go out in batches of about
    workers * PIECE_CHARS characters, which bounds the memory held as Python lists of ids.
    """
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
    encoded = enc.encode_ordinary_batch(texts, num_threads=workers) if workers > 1 else map(enc.encode_ordinary, texts)
    for (first, last, text), ids in zip(batch, encoded):
        progress.update(len(text.encode("utf-8")))
        yield first, last, ids


def split_text(text, size=None) -> list:
    """Cut text into pieces of about `size` characters, only right after a newline that sits between two
    non-space characters ("x\\n|y"). Every supported pat_str ends a pre-token there and starts a new one,
    so encoding the pieces one by one gives exactly the tokens of encoding the whole text."""
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


class _Progress:
    """Start and end lines always; a live percent / MB/s line in between when stderr is a terminal."""

    def __init__(self, label, total_bytes, workers):
        self.label, self.total, self.done, self.t0, self.shown = label, total_bytes, 0, time.time(), 0.0
        self.live = sys.stderr.isatty()
        print(f"{label}: tokenizing {total_bytes / 1e6:,.1f} MB with {workers} thread(s)", file=sys.stderr)

    def update(self, n):
        self.done += n
        now = time.time()
        if self.live and now - self.shown > 0.25:
            self.shown = now
            rate = self.done / 1e6 / max(now - self.t0, 1e-9)
            print(f"\r{self.label}: {100 * self.done / max(self.total, 1):5.1f}%  {rate:6.1f} MB/s",
                  end="", file=sys.stderr, flush=True)

    def close(self, tokens):
        seconds, start = max(time.time() - self.t0, 1e-9), "\r" if self.live else ""
        print(f"{start}{self.label}: {tokens:,} tokens from {self.total / 1e6:,.1f} MB "
              f"in {seconds:.1f}s ({self.total / 1e6 / seconds:.1f} MB/s)", file=sys.stderr)


def _tokenizer_name(tokenizer):
    """The name a shard header stores, without loading a tokenizer when a known name is given."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, tiktoken.Encoding):
        return tokenizer.name
    return str(tokenizer) if str(tokenizer) in TOKENIZERS else get_tokenizer(tokenizer).name


def resolve_data(data, tokenizer, mirror=None, **prepare_kwargs) -> Path:
    """train.py's --data: a folder of prepared shards is checked and used as is; anything else is prepared."""
    name, folder = _tokenizer_name(tokenizer), Path(str(data)).expanduser()
    shards = sorted(folder.glob("train_*.bin")) + sorted(folder.glob("val_*.bin")) if folder.is_dir() else []
    if not shards:
        return prepare(data, tokenizer, mirror=mirror, **prepare_kwargs)
    if not (folder / "meta.json").is_file():
        raise DataError(f"{folder} has shards but no meta.json (an interrupted prepare?); prepare it again")
    for shard in shards:
        read_shard(shard, name)
    return folder


# ======== 6. Loader: shards -> batches ============================================================

class Loader:
    """(inputs, targets) batches of shape (batch_size, seq_len) for one data-parallel rank.

    The data is one deterministic sequence of windows of seq_len + 1 tokens:
      * A shard of n tokens holds c = max(n // seq_len - 1, 1) windows (0 if n <= seq_len), placed with
        stride seq_len: window j covers tokens [shift + j*seq_len, shift + (j+1)*seq_len], the last token of
        one window being the first of the next, so each token is a target once per epoch (bar < 2*seq_len
        at a shard's ends). Windows never cross shard ends. The shift is drawn per (epoch, shard) in
        [0, min(slack, seq_len - 1)], c leaving a full seq_len of slack where the shard is long enough, so
        every epoch sees other context boundaries.
      * The windows of all shards share one index space of len(self) windows. Global sequence i is window
        perm_e[i % len(self)] of epoch e = i // len(self), where perm_e is a permutation seeded by (seed, e)
        (8 bytes a window: 1B tokens at seq_len 1024 take 8 MB).
      * Rank r reads global sequences consumed + r*batch_size + arange(batch_size); after every next() on
        every rank, consumed += batch_size * dp_size. So an optimizer step always covers the same global
        sequences whatever the split into dp ranks and micro-batches, and {"consumed", "seed", "seq_len"}
        is the whole, rank-independent position (GUIDE section 4).
    """

    def __init__(self, data_dir, split, batch_size, seq_len, dp_rank=0, dp_size=1, seed=0, tokenizer=None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        paths = sorted(Path(data_dir).glob(f"{split}_*.bin"))
        if not paths:
            raise DataError(f"no {split} shards ({split}_*.bin) in {data_dir}; run: python data.py prepare ...")
        name = _tokenizer_name(tokenizer)
        self.shards = [read_shard(p, name) for p in paths]
        n = np.array([len(s) for s in self.shards], dtype=np.int64)
        counts = np.where(n > seq_len, np.maximum(n // seq_len - 1, 1), 0)
        self.max_shift = np.clip(np.minimum(n - 1 - counts * seq_len, seq_len - 1), 0, None)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])  # window index where each shard starts
        self.num_windows, self.num_tokens = int(self.offsets[-1]), int(n.sum())
        if self.num_windows == 0:
            raise DataError(f"the {split} split in {data_dir} has {self.num_tokens:,} tokens (largest shard "
                            f"{int(n.max()):,}), too few for one sequence of seq_len + 1 = {seq_len + 1:,} tokens; "
                            f"lower seq_len or use more data")
        self.consumed = 0
        self._epochs = {}  # epoch -> (window order, per-shard shift); a batch touches at most two epochs
        self._cols = np.arange(seq_len + 1)

    def __len__(self):
        return self.num_windows

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_windows

    def _epoch(self, epoch):
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, epoch])
            order, shift = rng.permutation(self.num_windows), rng.integers(0, self.max_shift + 1)
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (order, shift)
        return self._epochs[epoch]

    def _locate(self, seqs):
        """Global sequence indices -> (shard index, start token) of their windows."""
        epochs, within = np.divmod(seqs, self.num_windows)
        shard, start = np.empty_like(seqs), np.empty_like(seqs)
        for e in np.unique(epochs):
            rows = epochs == e
            order, shift = self._epoch(int(e))
            window = order[within[rows]]
            k = np.searchsorted(self.offsets, window, side="right") - 1
            shard[rows], start[rows] = k, shift[k] + (window - self.offsets[k]) * self.seq_len
        return shard, start

    def next(self):
        seqs = self.consumed + self.dp_rank * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        self.consumed += self.batch_size * self.dp_size
        shard, start = self._locate(seqs)
        batch = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        for k in np.unique(shard):  # one fancy-indexing read per shard touched
            rows = shard == k
            batch[rows] = self.shards[k][start[rows, None] + self._cols]
        return torch.from_numpy(batch[:, :-1].copy()), torch.from_numpy(batch[:, 1:].copy())

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state):
        if (state["seed"], state["seq_len"]) != (self.seed, self.seq_len):
            raise DataError(f"loader state is for seed {state['seed']}, seq_len {state['seq_len']}, but this loader "
                            f"has seed {self.seed}, seq_len {self.seq_len}; resume with the same values")
        self.consumed = int(state["consumed"])


# ======== 7. Command line =========================================================================

def _print_info(path):
    path = Path(path)
    for shard in sorted(path.glob("*.bin")) if path.is_dir() else [path]:
        info = shard_info(shard)
        print(f"{shard}: {info['tokens']:,} tokens, {info['dtype'].name}, tokenizer {info['tokenizer']}, "
              f"format v{info['version']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Download, tokenize and inspect training data.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize a source into train/val shards")
    p.add_argument("--source", required=True, help=f"{' | '.join(DATASETS)} | a file, folder or glob")
    p.add_argument("--tokenizer", default="byte", help=f"{' | '.join(TOKENIZERS)} | path to tokenizer.model")
    p.add_argument("--out", help="output folder (default: <DATA_CACHE>/shards/<source>-<tokenizer>)")
    p.add_argument("--mirror", help="local mirror folder laid out like shared/data (or env DATA_MIRROR)")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl records")
    p.add_argument("--workers", type=int, help="tokenizer threads (default: all cores)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    d = commands.add_parser("download", help="fetch a registry file into the cache")
    d.add_argument("name", help=" | ".join([*DATASETS, *TOKENIZER_FILES]))
    d.add_argument("--mirror")
    i = commands.add_parser("info", help="print the header of a shard, or of every shard in a folder")
    i.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            out = prepare(args.source, args.tokenizer, out_dir=args.out, mirror=args.mirror, workers=args.workers,
                          val_fraction=args.val_fraction, text_field=args.text_field, shard_tokens=args.shard_tokens)
            meta = json.loads((out / "meta.json").read_text())
            print(f"shards in {out} (tokenizer {meta['tokenizer']}, vocab {meta['n_vocab']:,})")
            for split, s in meta["splits"].items():
                print(f"  {split:<5} {s['tokens']:>14,} tokens {s['documents']:>9,} documents "
                      f"{len(s['shards']):>4} shard(s)")
        elif args.command == "download":
            print(fetch(args.name, args.mirror))
        else:
            _print_info(args.path)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
