"""Tests for the Llama 3 chat format and its loss mask (data.py), the SFT (sft.py) and preference (dpo.py)
readers
(crafted files and the mirror's Alpaca, Self-Instruct and HH-RLHF files), the length rule, and the SFT /
preference loaders: targets, document ids, packing, data-parallel split, resume. No test touches the
network."""
import collections
import gzip
import hashlib
import json
import socket

import numpy as np
import pytest
import torch

import config
import data
import dpo
from chat import PreferenceLoader, SFTLoader, encode_chat, preference_examples, read_preferences, read_sft
from chat import sft_examples, split_examples
from data import IGNORE_INDEX, DataError, get_tokenizer


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(sock, address):
        raise AssertionError(f"a test tried to open a connection: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi. <|eot_id|>"},  # special-token text in content must stay text
    {"role": "assistant", "content": "Hi."},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ----------------------------------------------------------------------------------------------------
# encode_chat

def test_encode_chat_llama3_exact_ids(mirror):
    enc = get_tokenizer("llama3")
    # the ids MANIFEST.md lists for one user turn, independent of this code
    assert encode_chat(enc, [{"role": "user", "content": "hello world"}])[0] == [
        128000, 128006, 882, 128007, 271, 15339, 1917, 128009]

    special, text = enc.encode_single_token, enc.encode_ordinary

    def header(role):
        return [special("<|start_header_id|>"), *text(role), special("<|end_header_id|>"), *text("\n\n")]

    expected, expected_mask = [special("<|begin_of_text|>")], [False]
    for m in CONVERSATION:
        body = text(m["content"]) + [special("<|eot_id|>")]
        expected += header(m["role"]) + body
        expected_mask += [False] * len(header(m["role"])) + [m["role"] == "assistant"] * len(body)
    ids, mask = encode_chat(enc, CONVERSATION)
    assert ids == expected and mask == expected_mask and len(ids) == len(mask)
    assert ids.count(128000) == 1 and ids[0] == 128000  # BOS once
    # the "<|eot_id|>" text is not eot
    assert ids.count(128006) == ids.count(128007) == ids.count(128009) == 3
    assert header("assistant") == [128006, 78191, 128007, 271]
    learned = [t for t, m in zip(ids, mask) if m]
    assert learned == text("Hi.") + [128009] and enc.decode(learned) == "Hi.<|eot_id|>"
    assert mask[-len(learned):] == [True] * len(learned) and not any(mask[:-len(learned)])

    gen_ids, gen_mask = encode_chat(enc, CONVERSATION[:2], add_generation_prompt=True)
    prompt_ids, prompt_mask = encode_chat(enc, CONVERSATION[:2])
    assert gen_ids == prompt_ids + [128006, 78191, 128007, 271] and gen_mask == prompt_mask + [False] * 4
    assert not any(gen_mask)


def test_encode_chat_byte_exact_ids():
    enc = get_tokenizer("byte")
    ids, mask = encode_chat(enc, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert ids == [256, 262, *b"user", 263, 10, 10, *b"hi", 265, 262, *b"assistant", 263, 10, 10, *b"yo", 265]
    assert mask == [False] * 25 + [True] * 3
    ids, mask = encode_chat(enc, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids[-13:] == [262, *b"assistant", 263, 10, 10] and not any(mask)


@pytest.mark.parametrize("name", ["byte", "gpt2", "cl100k_base", "o200k_base", "llama3"])
def test_encode_chat_every_tokenizer(name, mirror):
    enc = get_tokenizer(name)
    ids, mask = encode_chat(enc, CONVERSATION)
    assert enc.decode(ids) == "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in CONVERSATION)
    assert enc.decode([t for t, m in zip(ids, mask) if m]) == "Hi.<|eot_id|>"
    assert ids.count(data.eot_id(enc)) == 3 and ids.count(data.bos_id(enc)) == 1


def test_encode_chat_validates():
    enc = get_tokenizer("byte")
    with pytest.raises(DataError, match="'tool'"):
        encode_chat(enc, [{"role": "tool", "content": "x"}])
    with pytest.raises(DataError, match="assistant.*not a string"):
        encode_chat(enc, [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}])
    with pytest.raises(DataError, match="list of messages"):
        encode_chat(enc, "hello")


# ----------------------------------------------------------------------------------------------------
# read_sft

def test_read_sft_formats_and_errors(tmp_path):
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Add.", "input": "2 3", "output": "5"},
                                  {"instruction": "Greet.", "input": "", "output": "Hello"}], indent=1))
    assert read_sft(alpaca) == [
        [{"role": "user", "content": "Add.\n\n2 3"}, {"role": "assistant", "content": "5"}],
        [{"role": "user", "content": "Greet."}, {"role": "assistant", "content": "Hello"}]]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": messages}, {"prompt": "p", "response": "r"}])
    assert read_sft(mixed) == [messages, [{"role": "user", "content": "p"}, {"role": "assistant",
                                                                             "content": "r"}]]

    bad = tmp_path / "bad.jsonl"
    for text, message in [  # each error names the file and the line (or record) at fault
            ('{"prompt": "p", "response": "r"}\n\n{"prompt": "p", \n', r"bad.jsonl:3: malformed JSON"),
            ('{"prompt": "p", "response": "r"}\n{"text": "t"}\n',
             r"bad.jsonl:2: unknown SFT record \['text'\]"),
            ('{"messages": [{"role": "bot", "content": "x"}]}\n', r"bad.jsonl:1: .*'bot'"),
            ('[{"instruction": "i", "output": "o"},\n {"instruction": "i", "output": 3}]',
             r"bad.jsonl: record 1: .*output"),
            ('[{"instruction": "i", "output": "o"},\n {"instruction": }]', r"bad.jsonl:2: malformed JSON")]:
        bad.write_text(text)
        with pytest.raises(DataError, match=message):
            read_sft(bad)
    with pytest.raises(DataError, match="not a registered name.*alpaca_5000"):
        read_sft(tmp_path / "missing.jsonl")


def test_read_sft_mirror_files(mirror):
    alpaca = read_sft("alpaca_5000")  # through the registry: copied from the mirror and checksummed
    raw = json.loads((mirror / "sft" / "alpaca_5000.json").read_text())
    assert len(alpaca) == 5000 == len(raw)
    assert all(len(c) == 2 and c[1] == {"role": "assistant", "content": r["output"]} for c, r in zip(alpaca,
                                                                                                     raw))
    with_input = next(i for i, r in enumerate(raw) if r["input"])
    expected = raw[with_input]["instruction"] + "\n\n" + raw[with_input]["input"]
    assert alpaca[with_input][0]["content"] == expected

    seed = read_sft("self_instruct_seed")
    tasks = [json.loads(line) for line in (mirror / "sft" / "self_instruct_seed_tasks.jsonl").open()]
    assert len(seed) == 175 == len(tasks)
    k = next(i for i, t in enumerate(tasks) if t["instances"][0]["input"])
    assert seed[k] == [
        {"role": "user", "content": tasks[k]["instruction"] + "\n\n" + tasks[k]["instances"][0]["input"]},
        {"role": "assistant", "content": tasks[k]["instances"][0]["output"]}]
    assert read_sft(mirror / "sft" / "self_instruct_seed_tasks.jsonl") == seed  # a path works the same way


# ----------------------------------------------------------------------------------------------------
# preferences

def test_read_preferences_strings_and_message_lists(tmp_path, capsys):
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    bot = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    path = write_jsonl(tmp_path / "prefs.jsonl", [
        {"prompt": "Q1", "chosen": "good", "rejected": "bad"},
        {"prompt": "Q2", "chosen": " ", "rejected": "bad"},  # empty reply: skipped
        {"prompt": "Q3", "chosen": "same", "rejected": "same"},  # identical: skipped
        {"prompt": [user("Q4"), bot("A"), user("Q5")], "chosen": [bot("good")], "rejected": [bot("bad")]},
        {"prompt": "Q6", "chosen": [user("Q6"), bot("good")], "rejected": [user("Q6"), bot("bad")]},
        {"chosen": [user("Q7"), bot("good")], "rejected": [user("Q7"), bot("bad")]},
        # prompts differ: skipped
        {"chosen": [user("Q8"), bot("good")], "rejected": [user("other"), bot("bad")]},
    ])
    pairs = read_preferences(path)
    assert pairs == [
        {"prompt": [user("Q1")], "chosen": "good", "rejected": "bad"},
        {"prompt": [user("Q4"), bot("A"), user("Q5")], "chosen": "good", "rejected": "bad"},
        {"prompt": [user("Q6")], "chosen": "good", "rejected": "bad"},
        {"prompt": [user("Q7")], "chosen": "good", "rejected": "bad"}]
    assert ("4 preference pairs; skipped 1 with different prompts, 1 with an empty reply, "
            "1 with identical replies" in capsys.readouterr().err)

    hh = write_jsonl(tmp_path / "hh.jsonl", [{
        "chosen": "\n\nHuman: Hi\n\nAssistant: Hello.\n\nAssistant: More.\n\nHuman: Bye\n\nAssistant:  See "
        "you! ",
        "rejected": "\n\nHuman: Hi\n\nAssistant: Hello.\n\nAssistant: More.\n\nHuman: Bye\n\nAssistant: "
        "No."}])
    # turns joined
    assert read_preferences(hh) == [{"prompt": [user("Hi"), bot("Hello.\n\nMore."), user("Bye")],
                                     "chosen": "See you!", "rejected": "No."}]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Q", "chosen": "a", "rejected": "b"},
                                               {"chosen": "a"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: unknown preference record"):
        read_preferences(bad)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Q", "chosen": [user("a")], "rejected": "b"}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: .*end with an assistant message"):
        read_preferences(bad)


def test_read_preferences_hh_rlhf_mirror(mirror, capsys):
    pairs = read_preferences("hh_rlhf_harmless_test")
    assert sum(1 for _ in (mirror / "dpo" / "hh_rlhf_harmless_base_test.jsonl").open()) == 2312
    assert ("2,303 preference pairs; skipped 5 with different prompts, 4 with an empty reply, "
            "0 with identical" in capsys.readouterr().err)
    assert len(pairs) == 2303
    first = pairs[0]
    roles = [m["role"] for m in first["prompt"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert first["prompt"][0]["content"] == "what are some pranks with a pen i can do?"
    assert first["chosen"] != first["rejected"] and first["chosen"] == first["chosen"].strip()
    for pair in pairs:  # every prompt alternates user/assistant, starting and ending with the user
        roles = [m["role"] for m in pair["prompt"]]
        assert roles[0] == roles[-1] == "user" and all(a != b for a, b in zip(roles, roles[1:]))
        assert pair["chosen"].strip() and pair["rejected"].strip()
        assert "\n\nHuman:" not in pair["prompt"][-1]["content"]


def test_gzip_registry_entry_is_unpacked(tmp_path, monkeypatch):
    """Without a mirror copy, a gzip_sha256 entry fetches the .gz, checks both hashes and keeps the
    unpacked file."""
    raw = b'{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b", "rejected": "\\n\\nHuman: a\\n\\nAssistant: c"}\n'
    packed = gzip.compress(raw)
    monkeypatch.setitem(data.PREFERENCE_DATASETS, "tiny_gz", dict(
        url="https://example.invalid/tiny.jsonl.gz", gzip_sha256=hashlib.sha256(packed).hexdigest(),
        sha256=hashlib.sha256(raw).hexdigest(), license="test", mirror="dpo/tiny.jsonl"))
    monkeypatch.setattr(data, "_fetch_url", lambda url, part, *args: part.write_bytes(packed))
    path = data.fetch("tiny_gz", mirror=tmp_path)  # an empty mirror: falls back to the (faked) URL
    assert path.read_bytes() == raw and not path.with_name(path.name + ".gz").exists()
    assert read_preferences("tiny_gz", mirror=tmp_path) == [
        {"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}]


# ---------------------------------------------------------------------------------------------------- length
# rule

def chat(user_chars, assistant_chars):
    return [{"role": "user", "content": "u" * user_chars}, {"role": "assistant",
                                                            "content": "a" * assistant_chars}]


def test_sft_examples_length_rule():
    enc = get_tokenizer("byte")  # one token a byte: 24 tokens of chat markup around user + assistant text
    seq_len = 64
    conversations = [
        chat(5, 5),  # 34 tokens: kept as is
        chat(10, 31),  # exactly seq_len + 1 = 65 tokens: kept as is
        # 134 tokens: truncated to 65; the reply starts at token 33, so 32 are learned (no eot)
        chat(10, 100),
        chat(100, 10),  # the assistant starts after token 65: dropped
        [{"role": "user", "content": "no answer"}],  # nothing to learn: dropped
    ]
    examples, counts = sft_examples(enc, conversations, seq_len)
    assert [len(ids) for ids, _ in examples] == [34, 65, 65]
    assert [int(mask.sum()) for _, mask in examples] == [6, 32, 32]
    assert counts == {"examples": 3, "truncated": 1, "dropped": 2, "tokens": 34 + 65 + 65,
                      "target_tokens": 70}
    assert all(ids.dtype == np.int32 and mask.dtype == bool and not mask[0] for ids, mask in examples)
    assert examples[2][0][-1] == ord("a")  # truncated inside the reply: no eot at the end
    # the same rule for preference pairs: a pair goes if either side goes
    pairs = [{"prompt": [{"role": "user", "content": "q"}], "chosen": "a" * 5, "rejected": "b" * 200},
             {"prompt": [{"role": "user", "content": "q" * 100}], "chosen": "a", "rejected": "b"}]
    pref, counts = preference_examples(enc, pairs, seq_len)
    assert len(pref) == 1 and [len(pref[0][k][0]) for k in ("chosen", "rejected")] == [30, 65]
    # the rejected reply starts at token 24 (after BOS, the user turn and the assistant header): 41 learned
    assert counts == {"examples": 1, "truncated": 1, "dropped": 1, "tokens": 30 + 65, "target_tokens": 6 + 41,
                      "identical": 0}


# ----------------------------------------------------------------------------------------------------
# SFTLoader

SEQ_LEN, PAD = 128, 260  # byte tokenizer: <|finetune_right_pad_id|> is 260


@pytest.fixture(scope="module")
def examples():
    rng = np.random.default_rng(0)
    conversations = []
    for i in range(60):
        turns = [{"role": "system", "content": "sys"}] if i % 3 == 0 else []
        for _ in range(1 + (i % 5 == 0)):  # 28 to 112 tokens
            turns += [{"role": "user", "content": f"q{i}" + "x" * int(rng.integers(0, 12))},
                      {"role": "assistant", "content": f"a{i}" + "y" * int(rng.integers(0, 20))}]
        conversations.append(turns)
    examples, _ = sft_examples(get_tokenizer("byte"), conversations, SEQ_LEN)
    assert len(examples) == 60 and all(len(ids) <= SEQ_LEN + 1 for ids, _ in examples)
    return examples


def epoch_rows(loader):
    """All rows of one epoch, in the loader's order: (inputs, targets, doc_ids) numpy arrays (len, T)."""
    batches = [loader.next() for _ in range(len(loader) // loader.batch_size)]
    return [torch.cat(parts).numpy() for parts in zip(*batches)]


def learned_tokens(examples):
    return collections.Counter(int(t) for ids, mask in examples for t in ids[mask])


@pytest.mark.parametrize("pack", [True, False])
def test_sft_loader_targets_and_doc_ids(examples, pack):
    assert all(not mask[0] for _, mask in examples)  # BOS is never learned: no target crosses a boundary
    loader = SFTLoader(examples, 1, SEQ_LEN, seed=3, pack=pack, pad_id=PAD)
    inputs, targets, doc_ids = epoch_rows(loader)
    assert inputs.shape == targets.shape == doc_ids.shape == (len(loader), SEQ_LEN)
    if not pack:
        assert len(loader) == len(examples)
    else:
        tokens = sum(len(ids) for ids, _ in examples)
        assert -(-tokens // (SEQ_LEN + 1)) <= len(loader) < 0.7 * len(examples)  # packing fills rows

    assert (doc_ids[:, 0] == 0).all() and np.isin(np.diff(doc_ids, axis=1), [0, 1]).all()  # 0, 1, 2, ...
    starts = np.diff(doc_ids, axis=1) == 1  # a new document starts at column i + 1
    # a new document is a new example (starting with BOS) or the padding (all PAD)
    for r, c in zip(*np.nonzero(starts)):
        doc = inputs[r][doc_ids[r] == doc_ids[r, c + 1]]
        assert doc[0] == 256 or (doc == PAD).all()
    assert (targets[:, :-1][starts] == IGNORE_INDEX).all()  # the last token of a document predicts nothing
    # a learned target is the next input, inside the same document
    inner = targets[:, :-1] != IGNORE_INDEX
    assert (targets[:, :-1][inner] == inputs[:, 1:][inner]).all() and not starts[inner].any()
    assert (targets[inputs == PAD] == IGNORE_INDEX).all()
    # every example exactly once per epoch, and exactly its learned tokens as targets
    assert (inputs == 256).sum() == len(examples)
    got = collections.Counter(targets[targets != IGNORE_INDEX].tolist())
    assert got == learned_tokens(examples) and sum(got.values()) == sum(int(m.sum()) for _, m in examples)
    if not pack:  # one example per row: the targets are exactly the mask's
        by_inputs = {tuple(ids[:SEQ_LEN].tolist()): (ids, mask) for ids, mask in examples}
        for row_inputs, row_targets in zip(inputs, targets):
            ids, mask = by_inputs[tuple(row_inputs[row_inputs != PAD].tolist())]
            expected = np.full(SEQ_LEN, IGNORE_INDEX)
            expected[:len(ids) - 1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
            assert (row_targets == expected).all() and (row_inputs[len(ids):] == PAD).all()


def test_sft_loader_packing_rule(examples):
    """Greedy in the seeded order: an example starts a new row only if it does not fit the current one."""
    loader = SFTLoader(examples, 1, SEQ_LEN, seed=5, pad_id=PAD)
    order = np.random.default_rng(5).permutation(len(examples))
    rows, used = [[]], [0]
    for i in order:
        n = len(examples[i][0])
        if used[-1] + n > SEQ_LEN + 1:
            rows, used = rows + [[]], used + [0]
        rows[-1].append(i)
        used[-1] += n
    assert len(loader) == len(rows)
    for r, row in enumerate(rows):  # the rows, in construction order (internal arrays), hold those examples
        flat = np.concatenate([examples[i][0] for i in row])
        assert (loader.inputs[r][:min(len(flat), SEQ_LEN)] == flat[:SEQ_LEN]).all()
        assert (loader.inputs[r][len(flat):] == PAD).all() and (used[r] < SEQ_LEN) == (loader.inputs[r]
                                                                                       == PAD).any()
        assert loader.doc_ids[r].max() == len(row) - 1 + (used[r] < SEQ_LEN)  # padding: a document of its own


def test_sft_loader_data_parallel_and_resume(examples):
    B = 4
    single = SFTLoader(examples, 2 * B, SEQ_LEN, seed=1, pad_id=PAD)
    ranks = [SFTLoader(examples, B, SEQ_LEN, dp_rank=r, dp_size=2, seed=1, pad_id=PAD) for r in range(2)]
    for _ in range(5):  # crosses an epoch: len(loader) rows < 5 * 8
        whole = single.next()
        parts = [rank.next() for rank in ranks]
        for k in range(3):
            assert torch.equal(whole[k], torch.cat([parts[0][k], parts[1][k]]))
    fresh = [SFTLoader(examples, B, SEQ_LEN, dp_rank=r, dp_size=2, seed=1, pad_id=PAD) for r in range(2)]
    rows0, rows1 = ({tuple(row.tolist()) for row in f.next()[0]} for f in fresh)
    assert len(rows0) == len(rows1) == B and not rows0 & rows1  # disjoint rows in one step

    state = single.state_dict()
    assert state == {"consumed": 5 * 2 * B, "seed": 1, "seq_len": SEQ_LEN, "pack": True}
    expected = single.next()
    resumed = SFTLoader(examples, 2 * B, SEQ_LEN, seed=1, pad_id=PAD)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(a, b) for a, b in zip(resumed.next(), expected))
    as_dp2 = [SFTLoader(examples, B, SEQ_LEN, dp_rank=r, dp_size=2, seed=1, pad_id=PAD) for r in range(2)]
    for rank in as_dp2:  # the same position resumed under another dp split
        rank.load_state_dict(state)
    assert torch.equal(torch.cat([rank.next()[1] for rank in as_dp2]), expected[1])
    with pytest.raises(DataError, match="pack"):
        SFTLoader(examples, B, SEQ_LEN, seed=1, pack=False).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        SFTLoader(examples, B, SEQ_LEN, seed=2).load_state_dict(state)


def test_sft_loader_deterministic_and_dtypes(examples):
    a, b = (SFTLoader(examples, 3, SEQ_LEN, seed=7, pad_id=PAD) for _ in range(2))
    for _ in range(4):
        batch_a, batch_b = a.next(), b.next()
        assert all(torch.equal(x, y) and x.dtype == torch.int64 and x.shape == (3, SEQ_LEN)
                   for x, y in zip(batch_a, batch_b))
    other = SFTLoader(examples, 3, SEQ_LEN, seed=8, pad_id=PAD)
    loader = SFTLoader(examples, 1, SEQ_LEN, seed=7, pad_id=PAD)
    first, second = ([tuple(loader.next()[0][0].tolist()) for _ in range(len(loader))] for _ in range(2))
    # reshuffled per epoch
    assert set(first) == set(second) and len(set(first)) == len(loader) and first != second
    assert not torch.equal(SFTLoader(examples, 3, SEQ_LEN, seed=7, pad_id=PAD).next()[0], other.next()[0])
    with pytest.raises(DataError, match="does not fit"):
        SFTLoader(examples, 2, 16)
    with pytest.raises(DataError, match="no examples"):
        SFTLoader([], 2, SEQ_LEN)


def test_split_examples(examples):
    train, val = split_examples(examples, 0.1, seed=0)
    assert len(val) == 6 and len(train) == 54
    again = split_examples(examples, 0.1, seed=0)
    assert [id(e) for e in again[0]] == [id(e) for e in train] and [id(e) for e in again[1]] == [id(e)
                                                                                                 for e in val]
    assert sorted(map(id, train + val)) == sorted(map(id, examples))
    assert [id(e) for e in split_examples(examples, 0.1, seed=1)[1]] != [id(e) for e in val]
    assert split_examples(examples, 0.0, seed=0) == (examples, [])
    with pytest.raises(DataError):
        split_examples(examples[:1], 0.5, seed=0)


# ----------------------------------------------------------------------------------------------------
# preferences

def test_preference_loader(mirror):
    enc = get_tokenizer("llama3")
    pairs = [{"prompt": [{"role": "user", "content": f"question {i}" + " really" * i}],
              "chosen": f"good answer {i}", "rejected": f"bad {i}" + " answer" * (i % 4)} for i in range(10)]
    pairs[3]["prompt"] += [{"role": "assistant", "content": "earlier reply"}, {"role": "user",
                                                                               "content": "more"}]
    examples, counts = preference_examples(enc, pairs, 48)
    assert counts["examples"] == 10 and counts["dropped"] == counts["truncated"] == 0
    B = 4
    loader = PreferenceLoader(examples, B, 48, seed=2, pad_id=data.pad_id(enc))
    assert len(loader) == 10
    seen = set()
    for _ in range(2):
        inputs, targets = loader.next()
        assert inputs.shape == targets.shape == (2 * B, 48) and inputs.dtype == targets.dtype == torch.int64
        for i in range(B):
            chosen, rejected = enc.decode(inputs[i].tolist()), enc.decode(inputs[B + i].tolist())
            prompt = chosen.split("<|start_header_id|>assistant")[0]
            k = int(prompt.split("question ")[1].split()[0].split("<")[0])
            assert rejected.startswith(prompt)  # the same pair in row i and row B + i
            for row, reply in ((i, f"good answer {k}"), (B + i, pairs[k]["rejected"])):
                learned = targets[row][targets[row] != IGNORE_INDEX].tolist()
                assert enc.decode(learned) == reply + "<|eot_id|>"  # the reply only, not "earlier reply"
            seen.add(k)
    assert len(seen) == 2 * B  # eight different pairs in the first eight global sequences
    state = loader.state_dict()
    assert state == {"consumed": 2 * B, "seed": 2, "seq_len": 48}
    expected = loader.next()
    resumed = PreferenceLoader(examples, B, 48, seed=2, pad_id=data.pad_id(enc))
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(resumed.next(), expected))
    ranks = [PreferenceLoader(examples, B // 2, 48, dp_rank=r, dp_size=2, seed=2) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(state)
    halves = [rank.next()[1] for rank in ranks]  # rank r: chosen of its pairs, then their rejected
    assert torch.equal(torch.cat([halves[0][:2], halves[1][:2], halves[0][2:], halves[1][2:]]), expected[1])


def test_preference_pairs_that_are_the_same_once_cut_are_dropped_and_counted(tmp_path, capsys):
    """Two replies that differ only past --seq-len are the same sequence once cut: no preference is left,
    and the pair would train with zero signal. They are dropped and counted; none left is refused."""
    enc = get_tokenizer("byte")
    prompt = [{"role": "user", "content": "q"}]
    pairs = [{"prompt": prompt, "chosen": "a" * 80 + "yes", "rejected": "a" * 80 + "no"},
             {"prompt": prompt, "chosen": "short", "rejected": "other"}]
    examples, counts = preference_examples(enc, pairs, 64)
    assert counts["identical"] == 1 and counts["examples"] == len(examples) == 1
    assert not np.array_equal(examples[0]["chosen"][0], examples[0]["rejected"][0])  # the pair that differs
    same = tmp_path / "same.jsonl"
    same.write_text((json.dumps({"prompt": "q", "chosen": "a" * 80 + "yes", "rejected": "a" * 80 + "no"})
                     + "\n") * 10)
    with pytest.raises(SystemExit) as stop:
        config.run(dpo.main, ["--model", "tiny", "--data", str(same), "--seq-len", "64", "--max-steps", "1",
                             "--warmup", "1", "--out-dir", str(tmp_path / "o"), "--sample-prompt", ""])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "no usable preference pair (all dropped" in err and "'identical': 10" in err
    assert not (tmp_path / "o").exists()
    mixed = tmp_path / "mixed.jsonl"  # with some left, the run says how many it dropped, and trains on the rest
    distinct = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(10)]
    mixed.write_text(same.read_text() + "".join(json.dumps(r) + "\n" for r in distinct))
    dpo.main(["--model", "tiny", "--data", str(mixed), "--seq-len", "64", "--max-steps", "1", "--warmup", "1",
              "--micro-batch", "2", "--out-dir", str(tmp_path / "o"), "--sample-prompt", "", "--eval-batches",
              "1"])
    assert "10 dropped as the same on both sides once cut" in capsys.readouterr().out


@pytest.mark.parametrize("record", [
    {"chosen": "Yes.", "rejected": "No."},
    {"chosen": [{"role": "assistant", "content": "Yes."}],
     "rejected": [{"role": "assistant", "content": "No."}]},
    {"prompt": [], "chosen": "Yes.", "rejected": "No."},
    {"prompt": [{"role": "system", "content": "Be brief."}], "chosen": "Yes.", "rejected": "No."},
])
def test_a_pair_without_a_prompt_is_refused_naming_its_line(tmp_path, record):
    """A reply that answers nothing: no prompt field, and chosen/rejected neither message lists with a user
    turn nor HH-RLHF dialogues (this used to be called an HH-RLHF dialogue without its marker)."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Hi.", "chosen": "Yes.", "rejected": "No."}) + "\n"
                    + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=r"p.jsonl:2: a pair needs a prompt"):
        read_preferences(str(path))
