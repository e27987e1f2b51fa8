"""Tests for data.py: tokenizers, downloads (against a local HTTP server), the mirror, shards, prepare,
the Loader's determinism / data-parallel split / exact resume, and the CLI. No test touches the network."""
import contextlib
import errno
import hashlib
import http.server
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import data
from data import DataError, Loader, download, get_tokenizer, prepare, read_shard, write_shard

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail any test that opens a connection to anything but this machine."""
    connect = socket.socket.connect

    def local_only(sock, address):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"a test tried to reach the network: {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)


LLAMA3_GOLDEN = [128000, 2028, 374, 264, 1296, 11914, 13, 128001]
SHAKESPEARE_CHARS = 1_115_394


# ----------------------------------------------------------------------------------------------------
# tokenizers

def test_llama3_golden(mirror):
    enc = get_tokenizer("llama3")  # through the registry: copied from <mirror>/llama3/tokenizer.model
    ids = [data.bos_id(enc)] + enc.encode_ordinary("This is a test sentence.") + [data.eos_id(enc)]
    assert ids == LLAMA3_GOLDEN
    assert enc.n_vocab == 128_256 and enc.name == "llama3"
    assert (data.eot_id(enc), enc.encode_single_token("<|start_header_id|>"),
            enc.encode_single_token("<|end_header_id|>")) == (128009, 128006, 128007)
    assert enc.encode_single_token("<|reserved_special_token_245|>") == 128255
    # special tokens written in raw text stay text
    assert 128009 not in enc.encode_ordinary("hi <|eot_id|>")


def test_llama3_from_path(mirror, tmp_path):
    lines = (mirror / "llama3" / "tokenizer.model").read_bytes().splitlines()
    shuffled = tmp_path / "reordered.model"  # another hash, same ranks: accepted by its rank count
    shuffled.write_bytes(b"\n".join(reversed(lines)) + b"\n")
    enc = get_tokenizer(str(shuffled))
    assert [data.bos_id(enc)] + enc.encode("This is a test sentence.") + [data.eos_id(enc)] == LLAMA3_GOLDEN
    short = tmp_path / "short.model"
    short.write_bytes(b"\n".join(lines[:1000]))
    with pytest.raises(DataError, match="holds 1,000 ranks.*128,000"):
        get_tokenizer(str(short))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x0a\x08\x00\xffsentencepiece\x12\x00 junk junk\n")
    with pytest.raises(DataError, match=r"garbage.model:\d+: not a tiktoken rank file"):
        get_tokenizer(str(garbage))
    with pytest.raises(DataError, match="unknown tokenizer 'nope'"):
        get_tokenizer("nope")


def test_byte_tokenizer():
    enc = get_tokenizer("byte")
    text = "Héllo, wörld! ✓ 日本語 🙂\n"
    ids = enc.encode_ordinary(text)
    assert ids == list(text.encode("utf-8")) and enc.decode(ids) == text
    assert enc.n_vocab == 268 and enc.name == "byte"
    assert [enc.encode_single_token(t) for t in data.SPECIAL_TOKENS] == list(range(256, 268))
    assert (data.bos_id(enc), data.eos_id(enc), data.eot_id(enc)) == (256, 257, 265)


@pytest.mark.parametrize("name, base_vocab, hello", [
    ("gpt2", 50_257, [31373, 995]), ("cl100k_base", 100_277, [15339, 1917]), ("o200k_base", 200_019, [24912,
                                                                                                      2375])])
def test_openai_tokenizers(name, base_vocab, hello, mirror):
    enc = get_tokenizer(name)
    assert enc.name == name and enc.encode_ordinary("hello world") == hello
    assert enc.n_vocab == base_vocab + 12
    assert [enc.encode_single_token(t) for t in data.SPECIAL_TOKENS] == list(range(base_vocab, base_vocab
                                                                                   + 12))
    assert "<|endoftext|>" in enc.special_tokens_set  # its own specials are kept


def test_split_text_keeps_tokens_identical(mirror):
    text = (mirror / "text" / "tinyshakespeare.txt").read_text()[:300_000]
    text += (mirror / "text" / "wiki_demo.txt").read_text()[:300_000]
    pieces = data.split_text(text, 5_000)
    assert len(pieces) > 50 and "".join(pieces) == text
    for name in ["byte", "gpt2", "cl100k_base", "o200k_base", "llama3"]:
        enc = get_tokenizer(name)
        assert sum((enc.encode_ordinary(p) for p in pieces), []) == enc.encode_ordinary(text), name


# ----------------------------------------------------------------------------------------------------
# download

class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves server.files; honours "Range: bytes=N-"; paths in server.truncate promise all, send half."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body, wanted = self.server.files.get(self.path), self.headers.get("Range")
        self.server.log.append((self.path, wanted))
        if body is None:
            return self.send_error(404)
        if self.path in self.server.truncate:  # Content-Length lies: the connection closes early
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            return
        start = int(wanted.removeprefix("bytes=").rstrip("-")) if wanted else 0
        if start >= len(body):
            self.send_response(416)
            self.send_header("Content-Length", "0")
            return self.end_headers()
        self.send_response(206 if wanted else 200)
        if wanted:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        self.wfile.write(body[start:])


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.files, srv.log, srv.truncate = {}, [], set()
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv, f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


BLOB = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
BLOB_SHA = hashlib.sha256(BLOB).hexdigest()
FAST = dict(retries=3, timeout=5, backoff=0.01, allow_http=True)  # http only for the local test server


def test_download_and_cache_hit(server, tmp_path):
    srv, base = server
    srv.files["/blob"] = BLOB
    dest = download(f"{base}/blob", BLOB_SHA, tmp_path / "cache" / "blob.bin", **FAST)
    assert dest.read_bytes() == BLOB and srv.log == [("/blob", None)]
    assert download(f"{base}/blob", BLOB_SHA, dest, **FAST) == dest and len(srv.log) == 1  # no second request
    assert not (tmp_path / "cache" / "blob.bin.part").exists()


def test_download_resumes_partial_file(server, tmp_path):
    srv, base = server
    srv.files["/blob"] = BLOB
    dest = tmp_path / "blob.bin"
    (tmp_path / "blob.bin.part").write_bytes(BLOB[:123_456])
    download(f"{base}/blob", BLOB_SHA, dest, **FAST)
    assert srv.log == [("/blob", "bytes=123456-")] and dest.read_bytes() == BLOB


def test_download_wrong_checksum(server, tmp_path):
    srv, base = server
    srv.files["/blob"] = BLOB
    with pytest.raises(DataError) as err:
        download(f"{base}/blob", "0" * 64, tmp_path / "blob.bin", mirror_path="text/blob.bin", **FAST)
    message = str(err.value)
    assert "checksum mismatch" in message and f"{base}/blob" in message and BLOB_SHA in message
    assert "DATA_MIRROR or --mirror" in message and "text/blob.bin" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []  # neither the file nor a .part is kept


def test_download_truncated_is_retried_then_fails(server, tmp_path):
    srv, base = server
    srv.files["/blob"], srv.truncate = BLOB, {"/blob"}
    with pytest.raises(DataError,
                       match=r"could not download .*/blob after 3 tries .*DATA_MIRROR or --mirror"):
        download(f"{base}/blob", BLOB_SHA, tmp_path / "blob.bin", **FAST)
    assert len(srv.log) == 3 and not (tmp_path / "blob.bin").exists()


def test_download_unreachable_and_404(server, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.time()
    with pytest.raises(DataError,
                       match=rf"could not download http://127.0.0.1:{port}/x after 3 tries.*--mirror"):
        download(f"http://127.0.0.1:{port}/x", BLOB_SHA, tmp_path / "x", **FAST)
    assert time.time() - start < 5
    srv, base = server
    with pytest.raises(DataError, match="HTTP 404"):  # permanent: not retried
        download(f"{base}/missing", BLOB_SHA, tmp_path / "y", **FAST)
    assert len(srv.log) == 1


def test_download_rules_and_mirror(tmp_path):
    with pytest.raises(DataError, match="only https"):
        download("http://example.com/x", BLOB_SHA, tmp_path / "x")
    for bad in ["../evil", "a/b", "..", ""]:
        with pytest.raises(DataError, match="path separators"):
            data.fetch(bad)
    with pytest.raises(DataError, match="unknown dataset 'nope'.*tinyshakespeare"):
        data.fetch("nope")
    mirror = tmp_path / "mirror"
    (mirror / "sub").mkdir(parents=True)
    (mirror / "sub" / "blob.bin").write_bytes(BLOB)  # the URL is never contacted when the mirror has the file
    dest = download("https://unreachable.invalid/blob", BLOB_SHA, tmp_path / "c" / "blob", mirror=mirror,
                    mirror_path="sub/blob.bin")
    assert dest.read_bytes() == BLOB
    with pytest.raises(DataError,
                       match=r"checksum mismatch for https://unreachable.invalid/blob \(mirror copy"):
        download("https://unreachable.invalid/blob", "1" * 64, tmp_path / "c" / "other", mirror=mirror,
                 mirror_path="sub/blob.bin")


# ---------------------------------------------------------------------------------------------------- prepare

def test_prepare_tinyshakespeare_matches_nanogpt_split(mirror):
    out = prepare("tinyshakespeare", "byte")
    text = (mirror / "text" / "tinyshakespeare.txt").read_text()
    assert len(text) == SHAKESPEARE_CHARS
    n = len(text)
    train_text, val_text = text[:int(n * 0.9)], text[int(n * 0.9):]  # nanoGPT's prepare.py
    train, val = read_shard(out / "train_000000.bin", "byte"), read_shard(out / "val_000000.bin", "byte")
    assert (len(train), len(val)) == (1_003_854 + 2, 111_540 + 2)
    assert train.dtype == np.uint16 and train[0] == 256 and train[-1] == 257
    assert val[0] == 256 and val[-1] == 257
    assert np.array_equal(train[1:-1], np.frombuffer(train_text.encode(), np.uint8))
    assert np.array_equal(val[1:-1], np.frombuffer(val_text.encode(), np.uint8))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] == 1_003_856 and meta["splits"]["val"]["tokens"] == 111_542
    assert list(meta["input_sha256"].values()) == [data.DATASETS["tinyshakespeare"]["sha256"]]
    assert out == data.cache_dir() / "shards" / "tinyshakespeare-byte"

    stamp = (out / "train_000000.bin").stat().st_mtime_ns
    start = time.time()
    assert prepare("tinyshakespeare", "byte") == out  # cached: nothing rewritten
    assert time.time() - start < 1 and (out / "train_000000.bin").stat().st_mtime_ns == stamp

    (out / "meta.json").unlink()  # an interrupted run (no completion marker, a half-written shard) is redone
    with open(out / "train_000000.bin", "r+b") as f:
        f.truncate(1000)
    assert prepare("tinyshakespeare",
                   "byte") == out and len(read_shard(out / "train_000000.bin")) == 1_003_856


def test_prepare_parallel_pieces_and_shards(mirror, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "PIECE_CHARS", 50_000)  # many pieces, several threads, several shards
    monkeypatch.setattr(data, "PARALLEL_BYTES", 0)
    enc = get_tokenizer("gpt2")
    out = prepare("tinyshakespeare", "gpt2", out_dir=tmp_path / "s", workers=2, shard_tokens=100_000)
    text = (mirror / "text" / "tinyshakespeare.txt").read_text()
    expected = [data.bos_id(enc)] + enc.encode_ordinary(text[:int(len(text) * 0.9)]) + [data.eos_id(enc)]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["shards"] == [f"train_{i:06d}.bin" for i in range(4)]
    got = np.concatenate([read_shard(out / name, "gpt2") for name in meta["splits"]["train"]["shards"]])
    assert got.tolist() == expected and meta["splits"]["train"]["tokens"] == len(expected)


def test_prepare_lines_dataset(mirror):
    out = prepare("wiki_demo", "byte")
    articles = [line for line in (mirror / "text" / "wiki_demo.txt").read_text().split("\n") if line.strip()]
    meta = json.loads((out / "meta.json").read_text())
    assert len(articles) == 30
    assert (meta["splits"]["train"]["documents"], meta["splits"]["val"]["documents"]) == (27, 3)
    val = read_shard(out / "val_000000.bin")
    assert len(val) == sum(len(a.encode()) + 2 for a in articles[27:]) and (val == 256).sum() == 3


def test_prepare_gutenberg_cp1252(mirror):
    out = prepare("frankenstein", "byte", val_fraction=0)
    text = (mirror / "text" / "gutenberg" / "pg84.txt").read_bytes().decode("cp1252").replace("\r\n", "\n")
    train = read_shard(out / "train_000000.bin", "byte")
    assert "St. Petersburgh, Dec. 11th, 17\u2014." in text and not (out / "val_000000.bin").exists()
    assert 13 not in train  # CRLF line ends were read as "\n"
    assert np.array_equal(train[1:-1], np.frombuffer(text.encode("utf-8"), np.uint8))


def test_prepare_jsonl(tmp_path, mirror):
    docs = ["first doc", "second <|end_of_text|> doc", "third", "fourth one"]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)) + "\n")
    out = prepare(str(path), "cl100k_base", val_fraction=0.25, text_field="body")
    enc = get_tokenizer("cl100k_base")
    train = read_shard(out / "train_000000.bin", "cl100k_base")
    assert train.dtype == np.uint32  # vocab 100,289 does not fit uint16
    expected = sum(([data.bos_id(enc)] + enc.encode_ordinary(d) + [data.eos_id(enc)] for d in docs[:3]), [])
    assert train.tolist() == expected and data.eos_id(enc) not in enc.encode_ordinary(docs[1])
    assert json.loads((out / "meta.json").read_text())["splits"]["val"]["documents"] == 1
    with pytest.raises(DataError, match=r"corpus.jsonl:1: no string field 'text'.*--text-field"):
        prepare(str(path), "byte")


def test_malformed_jsonl_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken\n{"text": "ok"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: malformed JSON"):
        prepare(str(path), "byte")
    with pytest.raises(DataError, match="no data found at"):
        prepare(str(tmp_path / "nothing*.txt"), "byte")


def test_resolve_data(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("some text " * 100)
    out = data.resolve_data(str(path), "byte")
    assert (out / "meta.json").is_file() and data.resolve_data(out, "byte") == out  # a shard folder as is
    with pytest.raises(DataError,
                       match=r"train_000000.bin was tokenized with 'byte', but 'gpt2' is expected"):
        data.resolve_data(out, "gpt2")
    (out / "meta.json").unlink()
    with pytest.raises(DataError, match="no meta.json"):
        data.resolve_data(out, "byte")


# ---------------------------------------------------------------------------------------------------- shards

def test_shard_dtype_and_round_trip(tmp_path):
    small, big = np.array([0, 5, 65535]), np.array([0, 5, 65536, 128255])
    for tokens, vocab, dtype in [(small, None, np.uint16), (big, None, np.uint32), (small, 128_256,
                                                                                    np.uint32),
                                 (small, 268, np.uint16)]:
        path = write_shard(tmp_path / "s.bin", tokens, "llama3", vocab_size=vocab)
        shard = read_shard(path, "llama3")
        assert shard.dtype == dtype and shard.tolist() == tokens.tolist()
        assert path.stat().st_size == data.HEADER_BYTES + len(tokens) * np.dtype(dtype).itemsize
    assert data.shard_info(path) == {"tokenizer": "llama3", "tokens": 3, "dtype": np.dtype("<u2"),
                                     "version": 2, "max_id": 65535}
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_shards_are_refused(tmp_path):
    path = write_shard(tmp_path / "s.bin", np.arange(1000), "byte")
    with pytest.raises(DataError, match=r"s.bin was tokenized with 'byte', but 'llama3' is expected"):
        read_shard(path, "llama3")
    with open(path, "r+b") as f:
        f.truncate(data.HEADER_BYTES + 1998)
    with pytest.raises(DataError, match=r"s.bin is truncated or corrupt: its header says 1,000 tokens"):
        read_shard(path)
    path.write_bytes(b"GPT2SHRD" + bytes(300))
    with pytest.raises(DataError, match="s.bin is not a token shard"):
        read_shard(path)
    raw = bytearray(write_shard(path, np.arange(10), "byte").read_bytes())
    raw[8] = 9  # format version 9
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="unsupported shard format version 9"):
        read_shard(path)


# ---------------------------------------------------------------------------------------------------- loader

@pytest.fixture
def shard_dir(tmp_path):
    # token values = positions, so every window shows where it came from; shard 2 is tiny (50 tokens)
    for i, (lo, n) in enumerate([(0, 1000), (5000, 600), (9000, 50)]):
        write_shard(tmp_path / f"train_{i:06d}.bin", np.arange(lo, lo + n), "byte")
    return tmp_path


def take(loader, steps):
    return [loader.next() for _ in range(steps)]


def test_loader_windows_cover_an_epoch(shard_dir):
    loader = Loader(shard_dir, "train", batch_size=9, seq_len=16, seed=1)
    assert len(loader) == (1000 // 16 - 1) + (600 // 16 - 1) + (50 // 16 - 1) == 99
    assert loader.num_tokens == 1650
    batches = take(loader, 11)  # 99 sequences: exactly one epoch
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert x.shape == (99, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, x + 1)  # windows are contiguous: none crosses a shard end
    starts = sorted(x[:, 0].tolist())
    assert len(set(starts)) == 99 and all(b - a >= 16 for a, b in zip(starts, starts[1:]))
    assert loader.epoch == 1 and loader.state_dict() == {"consumed": 99, "seed": 1, "seq_len": 16}
    again = torch.cat([b[0] for b in take(loader, 11)])  # epoch 2: another order and other offsets
    assert not torch.equal(again, x)


def test_loader_deterministic(shard_dir):
    a, b, c = (Loader(shard_dir, "train", 4, 16, seed=s) for s in (3, 3, 4))
    for (xa, ya), (xb, yb), (xc, _) in zip(take(a, 40), take(b, 40), take(c, 40)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.next()[0], c.next()[0])


def test_loader_data_parallel_split(shard_dir):
    one = Loader(shard_dir, "train", 8, 16, seed=0)
    ranks = [Loader(shard_dir, "train", 4, 16, dp_rank=r, dp_size=2, seed=0) for r in range(2)]
    accum = Loader(shard_dir, "train", 4, 16, seed=0)  # dp 1, two micro-batches of 4
    for _ in range(30):  # crosses epoch boundaries
        x, y = one.next()
        (x0, y0), (x1, y1) = ranks[0].next(), ranks[1].next()
        assert not set(map(tuple, x0.tolist())) & set(map(tuple, x1.tolist()))
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert torch.equal(torch.cat([accum.next()[0], accum.next()[0]]), x)
    assert ranks[0].state_dict() == ranks[1].state_dict() == one.state_dict()


def test_loader_resume_exact_and_across_dp(shard_dir):
    straight = Loader(shard_dir, "train", 4, 16, seed=7)
    take(straight, 13)
    state = straight.state_dict()
    expected = take(straight, 20)
    fresh = Loader(shard_dir, "train", 4, 16, seed=7)
    fresh.load_state_dict(state)
    for (x, y), (ex, ey) in zip(take(fresh, 20), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)

    ranks = [Loader(shard_dir, "train", 2, 16, dp_rank=r, dp_size=2, seed=7) for r in range(2)]
    for _ in range(13):
        [r.next() for r in ranks]
    single = Loader(shard_dir, "train", 4, 16, seed=7)  # resumed with dp 1 and the batch doubled
    single.load_state_dict(ranks[0].state_dict())
    for _ in range(20):
        x, _ = single.next()
        assert torch.equal(torch.cat([r.next()[0] for r in ranks]), x)
    with pytest.raises(DataError, match="seed 7, seq_len 16.*seed 8"):
        Loader(shard_dir, "train", 4, 16, seed=8).load_state_dict(state)


def test_loader_errors(shard_dir):
    with pytest.raises(DataError, match=r"1,650 tokens \(largest shard 1,000\), too few for one sequence of "
                                        r"seq_len \+ 1 = 1,001 tokens"):
        Loader(shard_dir, "train", 2, 1000)
    assert len(Loader(shard_dir, "train", 2, 999)) == 1  # exactly seq_len + 1 tokens is enough
    with pytest.raises(DataError, match="no val shards"):
        Loader(shard_dir, "val", 2, 16)
    with pytest.raises(DataError, match="tokenized with 'byte', but 'gpt2' is expected"):
        Loader(shard_dir, "train", 2, 16, tokenizer="gpt2")


def test_loader_is_fast(tmp_path):
    write_shard(tmp_path / "train_000000.bin", np.random.default_rng(0).integers(0, 268, 1_000_000), "byte")
    loader = Loader(tmp_path, "train", 64, 256, tokenizer=get_tokenizer("byte"))
    loader.next()
    start = time.perf_counter()
    for _ in range(100):
        loader.next()
    assert (time.perf_counter() - start) / 100 < 0.01  # well under a CPU step of ~20 ms


# ---------------------------------------------------------------------------------------------------- CLI

def test_cli(mirror, capsys):
    assert data.main(["prepare", "--source", "tinyshakespeare", "--tokenizer", "byte"]) == 0
    out = capsys.readouterr().out
    assert "1,003,856 tokens" in out and "111,542 tokens" in out and "tinyshakespeare-byte" in out
    assert data.main(["info", str(data.cache_dir() / "shards" / "tinyshakespeare-byte")]) == 0
    assert "train_000000.bin: 1,003,856 tokens, uint16, tokenizer byte" in capsys.readouterr().out
    assert data.main(["download", "../escape"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: bad dataset name") and err.count("\n") == 1


def test_a_clone_alone_without_internet_says_what_the_tests_need(tmp_path):
    """A fresh clone with no mirror beside it and DATA_MIRROR unset fetches the data files through the
    project's downloader; with no internet either (here: a proxy that refuses every connection), the session
    stops at once with one line saying what to provide."""
    clone = tmp_path / "clone"
    (clone / "tests").mkdir(parents=True)
    for f in REPO.glob("*.py"):
        shutil.copy(f, clone)
    shutil.copy(REPO / "tests" / "conftest.py", clone / "tests")
    (clone / "tests" / "test_placeholder.py").write_text("def test_placeholder():\n    assert 1 + 1 == 2\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_MIRROR", "TIKTOKEN_CACHE_DIR")}
    env.update(DATA_CACHE=str(tmp_path / "cache"), HTTPS_PROXY="http://127.0.0.1:9",
               HTTP_PROXY="http://127.0.0.1:9", NO_PROXY="")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests"], cwd=clone, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout[-2000:]
    said = [line for line in (p.stdout + p.stderr).splitlines() if "the tests need the data files" in line]
    assert len(said) == 1
    assert "set DATA_MIRROR to a folder holding them, or run with internet access" in said[0]
    assert "1 passed" not in p.stdout


# ---------------------------------------------------------------------------------------------------
# Mixtures


MIX = "c4_demo:0.5,wiki_demo:0.3,tinyshakespeare:0.2"


def mixture_loader(batch_size=8, dp_rank=0, dp_size=1, seed=3, anneal=None, seq_len=64):
    mix = data.parse_mixture(MIX)
    sources = [(name, data.resolve_data(name, "byte"), w) for name, w in mix]
    return data.MixtureLoader(sources, "train", batch_size, seq_len, dp_rank, dp_size, seed, "byte", anneal)


def test_a_mixture_gives_each_source_its_share_and_dp_ranks_split_the_single_process_order(mirror):
    one = mixture_loader()
    batches = [one.next() for _ in range(250)]  # 2,000 sequences
    seen = one.tokens_seen()
    total = sum(seen.values())
    for name, weight in data.parse_mixture(MIX):
        assert abs(seen[name] / total - weight) <= 0.02, (name, seen)
    # each row is the next sequence of the source the schedule names, read by that source's own loader
    first = torch.cat([b[0] for b in batches[:2]])  # global sequences 0-15
    rows = [k for k in range(16) if one.source(k) == 2]
    assert rows and torch.equal(first[rows], one.loaders[2].batch_at(np.arange(len(rows)))[0])
    # dp 2, 4 sequences each: disjoint halves of the same global order
    ranks = [mixture_loader(4, r, 2) for r in range(2)]
    for k in range(20):
        a, b = (r.next()[0] for r in ranks)
        assert torch.equal(torch.cat([a, b]), batches[k][0])
    assert ranks[0].state_dict() == ranks[1].state_dict() == {**one.state_dict(), "consumed": 160}


def test_a_short_source_starts_its_next_epoch_without_disturbing_the_others(mirror, tmp_path):
    """A source of a few sequences goes round its epochs while the long ones read straight on: each
    source's k-th sequence is the k-th of its own order, however often the others wrapped around."""
    short = tmp_path / "short.txt"
    short.write_text("a short source. " * 40)  # 640 bytes: 8 windows of 64 tokens in train
    mix = [("tinyshakespeare", 0.5), (str(short), 0.5)]
    sources = [(name, data.resolve_data(name, "byte", val_fraction=0.0) if name == str(short) else
                data.resolve_data(name, "byte")) for name, _ in mix]
    loader = data.MixtureLoader([(*s, 0.5) for s in sources], "train", 8, 64, seed=1, tokenizer="byte")
    alone = data.Loader(sources[0][1], "train", 8, 64, seed=1, tokenizer="byte")
    n_short = len(loader.loaders[1])
    ts_rows = []
    for _ in range(40):  # 320 sequences: the short source around its epochs many times
        x, _ = loader.next()
        ts_rows += [x[k] for k in range(8) if loader.source(loader.consumed - 8 + k) == 0]
    assert loader.counts(loader.consumed)[1] > 5 * n_short
    want = torch.cat([alone.next()[0] for _ in range(len(ts_rows) // 8 + 1)])[:len(ts_rows)]
    assert torch.equal(torch.stack(ts_rows), want)


@pytest.mark.parametrize("spec,message", [
    ("c4_demo:0.5,wiki_demo:0", "wiki_demo has weight 0; weights must be positive"),
    ("c4_demo:-1", "c4_demo has weight -1"),
    ("c4_demo:1,c4_demo:2", "names a source twice"),
    (":2", "a part names no source"),
    (" , ", "names no source"),
])
def test_bad_mixtures_are_one_line(spec, message):
    with pytest.raises(DataError, match=message):
        data.parse_mixture(spec)


def test_annealing_switches_the_mixture_and_each_source_goes_on_where_it_was(mirror):
    plain, annealed = mixture_loader(), mixture_loader(anneal=(96, [0.0, 1.0, 0.0]))
    for _ in range(12):  # the first 96 sequences: the same mixture
        assert torch.equal(plain.next()[0], annealed.next()[0])
    before = annealed.counts(96)
    for _ in range(4):  # then wiki_demo only, from where it was
        x, _ = annealed.next()
    assert (annealed.counts(128) - before).tolist() == [0, 32, 0]
    wiki = annealed.loaders[1]
    assert torch.equal(x, wiki.batch_at(np.arange(before[1] + 24, before[1] + 32))[0])
    assert annealed.state_dict()["anneal"] == [96, [0.0, 1.0, 0.0]]


# ----------------------------------------------------------------------------------------------------
# Hostile inputs: ids past the vocabulary, files that are not files, cut headers, JSON Python cannot read,
# mixture specs, a moved / read-only / full cache, SIGTERM during prepare, fingerprints, loader state

def poke(path, index, value):
    """Overwrite token `index` of a shard in place, leaving its header (and its max_id) as it was."""
    info = data.shard_info(path)
    with open(path, "r+b") as f:
        f.seek(data.HEADER_BYTES + index * info["dtype"].itemsize)
        f.write(np.array([value], info["dtype"]).tobytes())


@pytest.mark.parametrize("reader, message", [
    ("encoding", r"train_000001.bin holds token id 1,000, but the byte tokenizer has 268 ids"),
    ("name", r"train_000001.bin holds token id 1,000, above the largest id its header records \(199\)"),
    ("mixture", r"train_000001.bin holds token id 1,000, but the byte tokenizer has 268 ids"),
])
def test_ids_beyond_the_vocabulary_behind_an_intact_header_are_refused_when_read(tmp_path, reader, message):
    for i in range(2):
        write_shard(tmp_path / f"train_{i:06d}.bin", np.arange(2000) % 200, "byte")  # max_id 199 < 268
    poke(tmp_path / "train_000001.bin", 1234, 1000)
    assert data.shard_info(tmp_path / "train_000001.bin")["max_id"] == 199  # the header still says 199
    if reader == "mixture":
        loader = data.MixtureLoader([("a", tmp_path, 1.0)], "train", 8, 16, tokenizer=get_tokenizer("byte"))
    else:
        loader = Loader(tmp_path, "train", 8, 16, tokenizer=get_tokenizer("byte") if reader == "encoding"
                        else "byte")
    with pytest.raises(DataError, match=message):
        for _ in range(len(loader) // 8 + 1):  # one epoch reads every window
            loader.next()


@contextlib.contextmanager
def fifo_released(path, every=2.0):
    """A FIFO at `path`. Code that opens it to read waits for a writer: one comes every `every` seconds and
    leaves at once, so such code reads an empty file and the test fails instead of hanging."""
    os.mkfifo(path)
    stop = threading.Event()

    def release():
        while not stop.wait(every):
            with contextlib.suppress(OSError):  # ENXIO: nobody is reading
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()


def _refusal_of_info(folder):
    def run():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            if data.main(["info", str(folder)]):
                raise DataError(err.getvalue())
    return run


def _site(name, tmp, bad):
    """-> what reads `bad` (a FIFO or a folder where a file should be) at each place data.py opens a file."""
    text = tmp / "a.txt"
    text.write_text("some text " * 50)
    if name in ("loader", "resolve_data shard", "resolve_data meta.json"):
        write_shard(tmp / "val_000000.bin", np.arange(100), "byte")
        if name != "resolve_data meta.json":
            (tmp / "meta.json").write_text("{}")
    return {
        "loader": lambda: Loader(tmp, "train", 2, 16),
        "resolve_data shard": lambda: data.resolve_data(tmp, "byte"),
        "resolve_data meta.json": lambda: data.resolve_data(tmp, "byte"),
        "info": _refusal_of_info(tmp),
        "prepared meta.json": lambda: prepare(str(text), "byte", out_dir=tmp),
        "source in a folder": lambda: prepare(str(bad.parent), "byte", out_dir=tmp / "out"),
        "read_documents": lambda: data.read_documents(bad, "jsonl"),
        "json_records": lambda: data.json_records(bad),
        "named_file": lambda: data.named_file(str(bad), {}, None),
        "tokenizer": lambda: get_tokenizer(str(bad)),
        "mirror file": lambda: download("https://127.0.0.1:9/x", BLOB_SHA, tmp / "c" / "x", mirror=tmp,
                                        mirror_path=bad.name, retries=1, timeout=1),
        "cached download": lambda: download("https://127.0.0.1:9/x", BLOB_SHA, bad, retries=1, timeout=1),
    }[name]


BAD_FILES = {"loader": "train_000000.bin", "resolve_data shard": "train_000000.bin",
             "resolve_data meta.json": "meta.json", "info": "x.bin", "prepared meta.json": "meta.json",
             "source in a folder": "docs/b.txt", "read_documents": "d.jsonl", "json_records": "r.json",
             "named_file": "r.jsonl", "tokenizer": "tokenizer.model", "mirror file": "m.txt",
             "cached download": "blob.bin"}


@pytest.mark.parametrize("site, kind", [(site, kind) for site in BAD_FILES for kind in ("fifo", "folder")
                                        # a folder in a folder of documents is looked into, not read
                                        if (site, kind) != ("source in a folder", "folder")])
def test_a_fifo_or_folder_where_a_file_should_be_is_refused_in_one_line(tmp_path, site, kind):
    bad = tmp_path / BAD_FILES[site]
    bad.parent.mkdir(exist_ok=True)
    if site == "source in a folder":
        (bad.parent / "a.txt").write_text("fine " * 50)
    said = {"fifo": r"is a FIFO \(named pipe\), not a regular file",
            "folder": "is a folder, not a regular file"}
    with fifo_released(bad) if kind == "fifo" else contextlib.nullcontext(bad.mkdir()):
        run = _site(site, tmp_path, bad)
        with pytest.raises(DataError, match=said[kind]) as refused:
            run()
    message = str(refused.value).strip()
    assert str(bad) in message and "\n" not in message


def test_a_symlink_to_a_shard_is_a_shard(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "real" / "t.bin", np.arange(1000) % 200, "byte")
    (tmp_path / "data" / "train_000000.bin").symlink_to(tmp_path / "real" / "t.bin")
    loader = Loader(tmp_path / "data", "train", 4, 16, tokenizer=get_tokenizer("byte"))
    assert loader.next()[0].shape == (4, 16)


@pytest.mark.parametrize("cut", [0, 5, 8, 100, 255])
def test_a_shard_cut_inside_its_header_says_it_is_cut_short(tmp_path, cut):
    path = write_shard(tmp_path / "s.bin", np.arange(1000), "byte")
    with open(path, "r+b") as f:
        f.truncate(cut)
    with pytest.raises(DataError, match=rf"s.bin is cut short: it holds {cut} of the 256 bytes of a shard "
                                        "header; re-run prepare"):
        read_shard(path)
    path.write_bytes(b"GPT2")  # short, and what there is of it is not the magic: bad magic
    with pytest.raises(DataError, match=r"s.bin is not a token shard \(bad magic b'GPT2'"):
        read_shard(path)


DEEP = "[" * 100_000 + "]" * 100_000  # nested far deeper than the recursion limit: RecursionError
LONG_INT = "1" * 5_000  # more digits than int() reads by default: a plain ValueError


@pytest.mark.parametrize("payload, reason", [
    pytest.param(DEEP, "nested too deeply", id="deep"),
    pytest.param(LONG_INT, r"an integer of more than 4,300 digits", id="long_int")])
@pytest.mark.parametrize("reader", ["read_documents", "json_records array", "json_records lines"])
def test_json_that_python_cannot_read_is_malformed_json(tmp_path, payload, reason, reader):
    path = tmp_path / "d.jsonl"
    if reader == "json_records array":
        path.write_text(f"[{payload}]")
    else:
        path.write_text('{"text": "fine"}\n' + payload + "\n")
    where = "d.jsonl: malformed JSON" if reader == "json_records array" else "d.jsonl:2: malformed JSON"
    with pytest.raises(DataError, match=rf"{where} \({reason}\)"):
        data.read_documents(path, "jsonl") if reader == "read_documents" else data.json_records(path)


def test_a_meta_json_python_cannot_read_is_prepared_again(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some text " * 50)
    out = prepare(str(text), "byte", out_dir=tmp_path / "out")
    (out / "meta.json").write_text(DEEP)
    assert prepare(str(text), "byte", out_dir=out) == out
    assert json.loads((out / "meta.json").read_text())["splits"]["train"]["tokens"] > 0


def test_mixture_weights_whose_sum_overflows_or_whose_share_is_nothing():
    assert data.parse_mixture("c4_demo:1e308,wiki_demo:1e308") == [("c4_demo", 0.5), ("wiki_demo", 0.5)]
    names, shares = zip(*data.parse_mixture("c4_demo:3e307,wiki_demo:1e308,tinyshakespeare:1e308"))
    assert names == ("c4_demo", "wiki_demo", "tinyshakespeare")
    assert shares == pytest.approx([3 / 23, 10 / 23, 10 / 23])
    with pytest.raises(DataError, match=r"wiki_demo has weight 1e-300, 1e-300 of the mixture: too little "
                                        r"for one of every 1,000 sequences"):
        data.parse_mixture("c4_demo:1,wiki_demo:1e-300")
    with pytest.raises(DataError, match="wiki_demo has weight 0.0001"):
        data.parse_mixture("c4_demo:1,wiki_demo:0.0001")
    # ordinary weights come out exactly as they always did (a mixture's weights are part of its saved state)
    assert data.parse_mixture(MIX) == [("c4_demo", 0.5), ("wiki_demo", 0.3), ("tinyshakespeare", 0.2)]


def test_a_file_name_with_a_colon_is_one_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("x:2", "x"):
        Path(name).write_text("text")
    assert data.parse_mixture("x:2") == [("x:2", 1.0)]  # the whole part names a file: that file
    assert data.parse_mixture("x:2:3,x") == [("x:2", 0.75), ("x", 0.25)]
    assert data.parse_mixture("x:3,c4_demo") == [("x", 0.75), ("c4_demo", 0.25)]  # no file "x:3"


@pytest.mark.parametrize("spelling", ["dot", "symlink", "absolute", "folder"])
def test_one_source_under_two_spellings_is_refused(tmp_path, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)
    Path("x.txt").write_text("text")
    Path("d").mkdir()
    Path("link.txt").symlink_to("x.txt")
    other = {"dot": "./x.txt", "symlink": "link.txt", "absolute": str(tmp_path / "x.txt"),
             "folder": "d/../x.txt"}
    spec = f"x.txt:1,{other[spelling]}:2"
    with pytest.raises(DataError, match=rf"names a source twice \('x.txt' and '{other[spelling]}' are one "
                                        r"source\)"):
        data.parse_mixture(spec)


@pytest.mark.parametrize("how", ["copied", "moved"])
def test_a_moved_or_copied_cache_is_still_prepared_and_a_changed_file_is_not(tmp_path, monkeypatch, capsys,
                                                                            how, mirror):
    monkeypatch.setenv("DATA_CACHE", str(tmp_path / "one"))
    first = data.resolve_data("wiki_demo", "byte")
    text = tmp_path / "mine.txt"
    text.write_text("my own text " * 100)
    mine = prepare(str(text), "byte")
    (shutil.copytree if how == "copied" else shutil.move)(tmp_path / "one", tmp_path / "two")
    monkeypatch.setenv("DATA_CACHE", str(tmp_path / "two"))
    capsys.readouterr()
    second = data.resolve_data("wiki_demo", "byte")
    assert second == tmp_path / "two" / first.relative_to(tmp_path / "one")
    assert f"{second}: already prepared" in capsys.readouterr().err
    assert prepare(str(text), "byte") == tmp_path / "two" / mine.relative_to(tmp_path / "one")
    assert "already prepared" in capsys.readouterr().err  # the user's file did not change
    text.write_text("my own text, edited " * 100)
    prepare(str(text), "byte")
    assert "already prepared" not in capsys.readouterr().err


def _read_only(monkeypatch, folder):
    """Make os.mkdir refuse inside `folder`, as a read-only folder does (chmod does not stop root)."""
    mkdir = os.mkdir

    def refuse(path, *args, **kwargs):
        if Path(path).is_relative_to(folder):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)


@pytest.mark.parametrize("what", ["prepare --out", "DATA_CACHE prepare", "DATA_CACHE download"])
def test_a_read_only_cache_or_out_folder_is_one_line(tmp_path, monkeypatch, mirror, what):
    text = tmp_path / "a.txt"
    text.write_text("some text " * 50)
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setenv("DATA_CACHE", str(locked / "cache"))
    _read_only(monkeypatch, locked)
    with pytest.raises(DataError, match=r"cannot write into .*locked.*Permission denied.*point DATA_CACHE "
                                        r"\(or --out\) at a folder"):
        if what == "prepare --out":
            prepare(str(text), "byte", out_dir=locked / "out")
        elif what == "DATA_CACHE prepare":
            data.resolve_data(str(text), "byte")
        else:
            data.fetch("wiki_demo")
    assert list(locked.iterdir()) == []


def test_a_read_only_mount_is_one_line_though_it_refuses_the_cleanup_too(tmp_path, monkeypatch):
    """On a read-only mount even unlinking a missing partial file fails (EROFS): still one DataError."""
    part = tmp_path / "x.part"

    def refuse(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.raises(DataError, match=r"cannot write into .*Read-only file system.*make it writable"):
        with data.writing(tmp_path, tmp_path / "x", cleanup=[part]):
            raise OSError(errno.EROFS, "Read-only file system", str(part))


class _FullDisk:
    """A file whose first write puts 10 bytes down and then finds the disk full."""

    def __init__(self, f):
        self.f = f

    def write(self, b):
        self.f.write(b[:10])
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.parametrize("where", ["mirror copy", "url download", "tokenizing", "tokenizing over a prepared "
                                                                                  "folder"])
def test_a_full_disk_is_one_line_and_leaves_nothing_behind(tmp_path, monkeypatch, server, mirror, where):
    monkeypatch.setenv("DATA_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "a.txt"
    text.write_text("some text " * 50)
    out = tmp_path / "new" / "out"
    if where.endswith("prepared folder"):
        prepare(str(text), "byte", out_dir=out)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    if where == "mirror copy":
        def copyfile(src, dst):
            Path(dst).write_bytes(b"half a file")
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(shutil, "copyfile", copyfile)
    else:  # every file data.py opens for writing finds the disk full
        monkeypatch.setattr(data, "open", lambda path, mode="r", *a, **k: (
            _FullDisk(open(path, mode, *a, **k)) if set(mode) & set("wa") else open(path, mode, *a, **k)),
            raising=False)
    srv, base = server
    srv.files["/blob"] = BLOB
    with pytest.raises(DataError, match="no space left on device while writing") as refused:
        if where == "mirror copy":
            data.fetch("wiki_demo")
        elif where == "url download":
            download(f"{base}/blob", BLOB_SHA, tmp_path / "cache" / "blob.bin", **FAST)
        else:
            prepare(str(text), "byte", out_dir=out, val_fraction=0.2)
    assert {"mirror copy": "wiki_demo.txt", "url download": "blob.bin"}.get(where, "the shards of") \
        in str(refused.value)
    left = [p.name for p in tmp_path.rglob("*") if p.name.endswith((".part", ".tmp")) or ".prepare" in p.name]
    assert left == []
    if where.startswith("tokenizing"):  # not even the out folder made for them; a prepared one as it was
        assert sorted(p.name for p in tmp_path.rglob("*")) == before


SLOW_PREPARE = """
import sys, time, data
def slow(*args):
    print("tokenizing", flush=True)
    time.sleep(120)
    yield
data._encode_batch = slow
args = dict(out_dir=sys.argv[2], val_fraction=0.2)
if sys.argv[3] == "cli":
    sys.exit(data.main(["prepare", "--source", sys.argv[1], "--out", sys.argv[2], "--val-fraction", "0.2"]))
data.prepare(sys.argv[1], "byte", **args)
"""


@pytest.mark.parametrize("entry", ["prepare", "cli"])
@pytest.mark.parametrize("out_was", ["missing", "prepared"])
def test_sigterm_while_tokenizing_cleans_up_and_says_so(tmp_path, entry, out_was):
    text = tmp_path / "a.txt"
    text.write_text("some text " * 50)
    out = tmp_path / "new" / "out"
    if out_was == "prepared":
        prepare(str(text), "byte", out_dir=out)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    p = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE, str(text), str(out), entry], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "tokenizing\n", p.stderr.read()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode != 0 and (entry == "prepare" or p.returncode == 130)
    assert f"interrupted while tokenizing {text}: nothing was written" in err
    if entry == "cli":
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no .prepare-* folder, no empty out folder


def test_prepare_gives_sigterm_back_as_it_found_it(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some text " * 50)
    prepare(str(text), "byte", out_dir=tmp_path / "one")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    mine = lambda signum, frame: None
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        prepare(str(text), "byte", out_dir=tmp_path / "two")
        assert signal.getsignal(signal.SIGTERM) is mine  # someone else's handler is left alone
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_fingerprint_names_the_content_not_the_folder(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_shard(tmp_path / name / "train_000000.bin", np.arange(5000) % 200, "byte")
        write_shard(tmp_path / name / "train_000001.bin", np.arange(3_000_000) % 200, "byte")  # 6 MB
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    fp = lambda folder: Loader(tmp_path / folder, "train", 4, 16).fingerprint()
    assert len(fp("a")) == 16 and int(fp("a"), 16) >= 0
    assert fp("a") == fp("copy") == fp("b")
    poke(tmp_path / "b" / "train_000000.bin", 10, 7)  # one token near the start of a shard
    poke(tmp_path / "copy" / "train_000001.bin", 2_999_999, 7)  # the last token of a large one
    assert len({fp("a"), fp("b"), fp("copy")}) == 3
    mix = lambda folders, weights: data.MixtureLoader(
        [(f"s{i}", tmp_path / f, w) for i, (f, w) in enumerate(zip(folders, weights))], "train", 4,
        16).fingerprint()
    assert mix(["a", "a"], [0.5, 0.5]) == mix(["a", "a"], [0.5, 0.5]) != mix(["a", "a"], [0.25, 0.75])
    assert mix(["a", "b"], [0.5, 0.5]) != mix(["a", "a"], [0.5, 0.5])


@pytest.mark.parametrize("consumed", [-1, 2.5, "3", None, True])
def test_a_loader_state_with_a_bad_consumed_is_refused(shard_dir, consumed):
    loader = Loader(shard_dir, "train", 4, 16, seed=7)
    with pytest.raises(DataError, match=rf"loader state has consumed {consumed!r}, not a number"):
        loader.load_state_dict({"consumed": consumed, "seed": 7, "seq_len": 16})


def test_progress_is_silent_on_a_short_job_and_says_where_a_long_one_is(capsys, monkeypatch):
    """data.Progress in a log (stderr no terminal): nothing before `every` seconds, then one line with
    the share done, the total and the rate; nothing at all where quiet (the other ranks)."""
    clock = [100.0]
    monkeypatch.setattr(data.time, "time", lambda: clock[0])
    loud, quiet = (data.Progress("piqa", 200, "sequences", quiet=q) for q in (False, True))
    for p in (loud, quiet):
        p.update(50)
    assert capsys.readouterr().err == ""
    clock[0] += 31
    for p in (loud, quiet):
        p.update(50)
    assert capsys.readouterr().err == "piqa:  50.0% of 200 sequences (3.2 sequences/s, 31 s)\n"
    loud.close("piqa: 200 sequences")
    assert capsys.readouterr().err == "piqa: 200 sequences\n"
