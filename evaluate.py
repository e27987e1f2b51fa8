"""Evaluate a model: perplexity, multiple-choice benchmarks, generation, and benchmark contamination.

    python evaluate.py --init out --task tinyshakespeare             # val loss, perplexity, bits per byte
    python evaluate.py --init out --task hellaswag --task piqa --limit 500 --json
    torchrun --standalone --nproc_per_node=8 evaluate.py --init Llama-3.2-1B --tokenizer llama3 \
        --task hellaswag
    python evaluate.py --init out-sft --chat --prompt "How do I make tea?" --temperature 0
    python evaluate.py --contamination piqa --train ~/.cache/llama3-train/shards/c4_demo-gpt2
    python evaluate.py --diff out out-sft --diff-plot sft.png          # what SFT changed in the weights

Read top to bottom:
  1. Model           --init (a checkpoint, Hugging Face or Meta folder) -> an eval-mode Transformer
  2. Log-likelihood  token_logprobs: log p(token | the tokens before it), the primitive of 3 and 5
  3. Perplexity      token shards or raw text -> loss, perplexity, bits per byte
  4. Benchmarks      a small registry (URL, sha256, mirror path, as in data.py) and readers: generic
                     JSONL, HellaSwag, PIQA and ARC -> items {"context", "choices", "label"}
  5. Multiple choice every choice scored by its log-likelihood after the context: acc, acc_norm,
                     acc_token; also in training (train.py --eval-tasks); reward models' scores
  6. Generation      prompts from the command line or a file, plain or in the chat template
  7. Contamination   which benchmark items share an n-gram with the training data (hashed, streamed)
  8. A run's picture --plot: a PNG of train and validation loss against tokens, the benchmarks
                     scored during training and the learning rate
  9. Weight changes  --diff A B: how far each matrix moved between two checkpoints of one model, and
                     in how many directions (the effective rank of the difference)
 10. Command line    every task prints a summary; --json prints one JSON object per task instead

Sections 3 and 5 split their work over data-parallel ranks (torchrun): rank r takes the windows
or items i with i % world == r; all-reduced sums make any process count give the same numbers."""

from __future__ import annotations

import argparse
import bz2
import contextlib
import functools
import hashlib
import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import chat
import checkpoint
import config
import data
import launch
import loss
import model as M
import parallel as P

# ----------------------------------------------------------------------------------------------------
# 1. The model


def load_model(path, tok, device, dtype, mesh: P.Mesh) -> M.Transformer:
    """--init -> the Transformer on `device` in `dtype`, in eval mode, gradients off."""
    # load_init may report a grown vocabulary; stdout is for results
    with contextlib.redirect_stdout(sys.stderr):
        if checkpoint.is_checkpoint(path):
            # each rank verifies a share of the shards; rank 0 says what it passed over
            path = checkpoint.resolve(path, say=lambda msg: print(msg) if mesh.rank == 0 else None,
                             check=checkpoint.shared_check(mesh))
        margs, state = checkpoint.load_init(path, tok, verify=False)
    with torch.device("meta"):
        model = M.Transformer(margs)  # no random initialization: every weight comes from the state dict
    model.load_state_dict(state, assign=True)
    if margs.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------------
# 2. Log-likelihood


@torch.no_grad()
def token_logprobs(model, seqs, last: list[int] | None = None) -> list[np.ndarray]:
    """Token sequences -> for each, log p(seq[t] | seq[:t]) for t = 1 .. len - 1, as float64 arrays;
    with `last`, only for its last last[i] tokens. Sequences are right-padded to the longest: a
    causal model's output at a position never depends on later ones, so padding changes nothing read
    back. The output layer and the softmax over the vocabulary, the costliest part of a small model
    with a large vocabulary, run only at the positions read back."""
    width = max(len(s) for s in seqs)
    batch = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))
    batch = batch.to(model.tok_embeddings.weight.device)
    last = last or [len(s) - 1 for s in seqs]
    h = model.tok_embeddings(batch[:, :-1])  # (B, T, dim)
    cos, sin, _ = model.attention_inputs(width - 1, batch.device)
    h = model.norm(model.run_layers(h, cos, sin))
    rows = torch.tensor([i for i, n in enumerate(last) for _ in range(n)], device=batch.device)
    cols = torch.tensor([len(s) - n - 1 + j for s, n in zip(seqs, last) for j in range(n)],
                        device=batch.device)  # positions predicting each sequence's last n tokens
    logits = model.output(h[rows, cols])  # (scored tokens, vocab)
    logp = -loss.token_losses(logits, batch[rows, cols + 1], model.args.vocab_size, P.Mesh())  # fp32
    return np.split(logp.double().cpu().numpy(), np.cumsum(last)[:-1])


def _all_reduce(values: list[float], mesh, device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    P.all_reduce(t, mesh, "dp")  # every rank scored its own share; no-op for one process
    return t.tolist()


# ----------------------------------------------------------------------------------------------------
# 3. Perplexity and bits per byte
#
# Windows of seq_len + 1 tokens at stride seq_len: every token but each array's first is predicted
# once, from the tokens before it in its window, as in training. Loss and perplexity average over
# every target token, as train.py's validation loss does. Bits per byte, the tokenizer-independent
# measure, is (loss in nats of the targets that stand for text) / (ln 2 * the UTF-8 bytes they
# decode to). Special tokens (BOS, EOS, ...) are markup: no bytes, and their losses are left out.


@functools.lru_cache(maxsize=4)
def token_bytes(tok) -> tuple:
    """The UTF-8 bytes each id stands for; b"" for special tokens and ids the tokenizer leaves unused."""
    specials = {tok.encode_single_token(s) for s in tok.special_tokens_set}
    out = []
    for i in range(tok.n_vocab):
        try:
            out.append(b"" if i in specials else tok.decode_single_token_bytes(i))
        except KeyError:  # a gap in the ranks (cl100k_base, o200k_base)
            out.append(b"")
    return tuple(out)


def shard_paths(source) -> list[Path]:
    """A folder of token shards or one .bin file -> the shard paths; [] for anything else."""
    path = Path(str(source)).expanduser()
    return sorted(path.glob("*.bin")) if path.is_dir() else [path] if path.suffix == ".bin" else []


def text_tokens(docs, tok) -> np.ndarray:
    """Documents -> one token array laid out like a shard: BOS tokens EOS per document."""
    bos, eos = data.bos_id(tok), data.eos_id(tok)
    return np.concatenate([np.array([bos, *tok.encode_ordinary(doc), eos], dtype=np.int64) for doc in docs])


def perplexity(model, tok, arrays, seq_len, batch_size, mesh, limit=None) -> dict:
    """Token arrays (shards or text_tokens) -> {"loss", "perplexity", "bits_per_byte", counts}."""
    spans = [(a, s) for a, tokens in enumerate(arrays) for s in range(0, len(tokens) - 1, seq_len)][:limit]
    if not spans:
        raise data.DataError("nothing to evaluate: the data has fewer than two tokens")
    nbytes = np.zeros(model.args.vocab_size, dtype=np.int64)
    nbytes[:tok.n_vocab] = [len(b) for b in token_bytes(tok)]
    sums = np.zeros(4)  # loss of all targets, their number, loss of the text targets, their bytes
    by_pos = np.zeros((2, seq_len))  # loss and count of the targets at each position of a window
    mine = spans[mesh.dp_rank::mesh.dp]
    for i in range(0, len(mine), batch_size):
        seqs = [np.asarray(arrays[a][s:s + seq_len + 1], dtype=np.int64) for a, s in mine[i:i + batch_size]]
        top = max(int(seq.max()) for seq in seqs)  # a shard's ids: its header may not tell the truth
        if top >= tok.n_vocab:
            raise data.DataError(f"the evaluated data holds token id {top:,}, but the {tok.name} tokenizer "
                                 f"has {tok.n_vocab:,} ids: a shard is corrupt or not of this tokenizer")
        for seq, logp in zip(seqs, token_logprobs(model, seqs)):
            b = nbytes[seq[1:]]
            sums += [-logp.sum(), len(logp), -logp[b > 0].sum(), b.sum()]
            by_pos[:, :len(logp)] += [-logp, np.ones(len(logp))]
    totals = _all_reduce(sums.tolist() + by_pos.ravel().tolist(), mesh, model.tok_embeddings.weight.device)
    loss_all, n, loss_text, n_bytes = totals[:4]
    return {"loss": loss_all / n, "perplexity": math.exp(loss_all / n),
            "bits_per_byte": loss_text / (n_bytes * math.log(2)) if n_bytes else float("nan"),
            "tokens": int(n), "bytes": int(n_bytes), "windows": len(spans), "seq_len": seq_len,
            "loss_by_position": position_buckets(np.array(totals[4:]).reshape(2, seq_len))}


def position_buckets(by_pos: np.ndarray) -> dict:
    """Per-position loss and count -> {"first-last": mean loss} over positions 0, 1-2, 3-6, 7-14,
    ... (a target at position t has t + 1 tokens of context): does the model use far context?"""
    out, lo = {}, 0
    while lo < by_pos.shape[1]:
        hi = min(2 * lo + 1, by_pos.shape[1])
        loss, count = by_pos[:, lo:hi].sum(axis=1)
        if count:
            out[f"{lo}-{hi - 1}"] = loss / count
        lo = hi
    return out


# ----------------------------------------------------------------------------------------------------
# 4. Benchmarks: where the files come from, and readers that turn each format into items
#    {"context": str, "choices": [str, ...], "label": index of the right choice}

_GH = "https://raw.githubusercontent.com"
_PIQA = f"{_GH}/ybisk/ybisk.github.io/21edab439af693b961be2f069e8690a88d3b4e37/piqa/data"
BENCHMARKS = {  # pinned URLs, sha256, and the path of the same file in a local mirror (DATA_MIRROR)
    # validation, 10,042 items: klosax's 6-line text form of rowanz/hellaswag, markup removed
    "hellaswag": dict(
        url=f"{_GH}/klosax/hellaswag_text_data/1105d370f8340eac3c63a91fd1fa58e8999f9505"
            "/hellaswag_val_full.txt.bz2",
        sha256="50b637899e4263c2bc456c2dc726c95d2c8cd8e2a552ea5bd7719ce3cb03fe5b",
        mirror="eval/hellaswag_val_full.txt.bz2", license="MIT"),
    "piqa": dict(  # validation, 1,838 items; the gold labels are a separate file
        url=f"{_PIQA}/valid.jsonl", sha256="93503cc97c679e459b065c3d13e848282e44b2a25213985bed3e5d458abef72d",
        mirror="eval/piqa_valid.jsonl", license="AFL-3.0",
        labels=dict(url=f"{_PIQA}/valid-labels.lst", mirror="eval/piqa_valid-labels.lst",
                    sha256="b4192dc3a2a0363d9d60ccf79800cbbe2f32ebb17726efdde6970e0b8131bceb")),
    "arc_easy": dict(  # ARC-Easy dev, 570 items
        url=f"{_GH}/allyouneed-code/llm-eval/5774277dd88e5bdb43d8cb345999e3b1a0a0a551/ARC-Easy-Dev.jsonl",
        sha256="f4364b808a68df6bf500ce1070fb0105d40cacd2391c210deb00ff83ba75d1f4",
        mirror="eval/arc_easy_dev.jsonl", license="CC BY-SA 4.0"),
}


def fetch_benchmark(entry, mirror=None) -> Path:
    """data.download's cache, mirror and checksum, into <cache>/eval."""
    dest = data.cache_dir() / "eval" / Path(entry["mirror"]).name
    return data.download(entry["url"], entry["sha256"], dest, mirror=mirror, mirror_path=entry["mirror"])


def _arc(r):  # {question: {stem, choices: [{text, label}]}, answerKey}; the keys are A-E or 1-5
    keys = [c["label"] for c in r["question"]["choices"]]
    return (f"Question: {r['question']['stem']}\nAnswer:", [c["text"] for c in r["question"]["choices"]],
            keys.index(r["answerKey"]) if r["answerKey"] in keys else None)


def _hellaswag(r):  # rowanz/hellaswag's jsonl, its context joined as lm-evaluation-harness does
    context = f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}"
    return _unmarked(context), [_unmarked(e) for e in r["endings"]], r.get("label")


def _unmarked(text: str) -> str:
    """HellaSwag's WikiHow markup removed as lm-evaluation-harness removes it: ' [title]' becomes
    '. ', any other [tag] goes, double spaces become one."""
    text = re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". "))
    return text.replace("  ", " ")


# The fields that identify a format -> (context, choices, label) of one record; the first that fits
# wins. Prompts are written as lm-evaluation-harness writes them. HellaSwag's text form (the
# registry's) and jsonl with one "ctx" hold the context as one string, its second fragment's first
# letter as written; rowanz's jsonl (ctx_a, ctx_b) gives lm-eval's.
FORMATS = {
    ("context", "choices", "label"): lambda r: (r["context"], r["choices"], r["label"]),
    ("activity_label", "ctx_a", "ctx_b", "endings"): _hellaswag,
    ("ctx", "endings", "label"): lambda r: (r["ctx"], r["endings"], r["label"]),  # HellaSwag: "activity: ctx"
    ("goal", "sol1", "sol2"):  # PIQA: the labels are in a separate file
        lambda r: (f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], r.get("label")),
    ("question", "answerKey"): _arc,
}


def _item(context, choices, label, where) -> dict:
    label = int(label) if isinstance(label, str) and label.isdigit() else label
    if not (isinstance(context, str) and isinstance(choices, list) and len(choices) >= 2
            and all(isinstance(c, str) for c in choices)):
        raise data.DataError(f"{where}: needs a string context and a list of at least two string choices")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise data.DataError(f"{where}: label {label!r} is not the index of one of {len(choices)} choices")
    return {"context": context, "choices": choices, "label": label}


def read_items(task, mirror=None) -> list[dict]:
    """A benchmark name, a JSON(L) file in one of FORMATS or HellaSwag's .bz2 text form -> items."""
    if task in BENCHMARKS:
        entry = BENCHMARKS[task]
        path = fetch_benchmark(entry, mirror)
        labels = fetch_benchmark(entry["labels"], mirror) if "labels" in entry else None
    else:
        path = Path(task).expanduser()
        if not path.is_file():
            raise config.ConfigError(f"{task!r} is neither a benchmark ({', '.join(BENCHMARKS)}) nor a file")
        # where PIQA keeps them: valid.jsonl, valid-labels.lst
        labels = path.with_name(path.stem + "-labels.lst")
    if path.suffix == ".bz2":  # 6 lines per item: context, gold label, 4 endings
        with bz2.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")
        return [_item(lines[i], lines[i + 2:i + 6], lines[i + 1], f"{path}:{i + 1}")
                for i in range(0, len(lines) - 5, 6)]
    records = data.json_records(path)
    first = records[0][1] if records else {}
    keys = next((k for k in FORMATS if isinstance(first, dict) and set(k) <= set(first)), None)
    if keys is None:
        raise data.DataError(f"{path}: unknown benchmark record, expected the fields of one of "
                             f"{list(FORMATS)}")
    gold = [None] * len(records)
    if keys == ("goal", "sol1", "sol2") and "label" not in first:
        if not (labels and labels.is_file()):
            raise data.DataError(f"{path}: PIQA records carry no labels, and there is no {labels}")
        gold = labels.read_text().split()  # "0" / "1"; _item makes them numbers
        if len(gold) != len(records):
            raise data.DataError(f"{labels}: {len(gold)} labels for {len(records)} items")
    items = []
    for (where, record), label in zip(records, gold):
        try:
            context, choices, own = FORMATS[keys](record)
        except (KeyError, TypeError, AttributeError) as e:
            raise data.DataError(f"{where}: a record unlike the first ({type(e).__name__}: {e})") from None
        items.append(_item(context, choices, own if label is None else label, where))
    return items


def resolve_task(task, tok, mirror=None) -> tuple[str, list]:
    """--task -> ("multiple_choice", items) or ("perplexity", token arrays): a benchmark name or
    file gives items; a dataset name (data.DATASETS) the validation shards that training on it used
    (prepared on first use); a folder of shards its val_*.bin (every *.bin if it has none); a .bin
    shard, a .txt file (one document) or a .jsonl of {"text"} records their tokens."""
    path = Path(task).expanduser()
    if task == "needle":
        return "needle", None
    if task in BENCHMARKS or (path.is_file() and path.suffix == ".bz2"):
        return "multiple_choice", read_items(task, mirror)
    if task in data.DATASETS or path.is_dir() or (path.is_file() and path.suffix == ".bin"):
        shards = shard_paths(data.resolve_data(task, tok, mirror=mirror) if task in data.DATASETS else path)
        shards = [p for p in shards if p.name.startswith("val_")] or shards
        if not shards:
            raise data.DataError(f"no token shards (*.bin) at {path}")
        return "perplexity", [data.read_shard(p, tok.name) for p in shards]
    if path.is_file() and path.suffix == ".txt":
        return "perplexity", [text_tokens(data.read_documents(path), tok)]
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        records = data.json_records(path)
        if path.suffix == ".jsonl" and records and isinstance(records[0][1],
                                                              dict) and "text" in records[0][1]:
            return "perplexity", [text_tokens(data.read_documents(path, "jsonl"), tok)]
        return "multiple_choice", read_items(path)
    raise config.ConfigError(f"unknown --task {task!r}: not needle, a benchmark ({', '.join(BENCHMARKS)}), a "
                             f"dataset ({', '.join(data.DATASETS)}), a folder of shards or a "
                             ".bin/.txt/.jsonl/.bz2 file")


# ----------------------------------------------------------------------------------------------------
# 4b. Needle in a haystack: pass-key retrieval (Mohtashami & Jaggi 2023), one of the tests Llama 3
#     moved its long-context stages on with. A 5-digit key stated once at a given depth of filler
#     text, asked for at the end; scored by whether greedy decoding gives it back, and by its
#     tokens' log-probability (which a model too small to retrieve still moves).

NEEDLE_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def needle_prompt(tok, length: int, depth: float, key: str) -> tuple[list[int], list[int]]:
    """(prompt ids, key ids): BOS, filler with the needle at `depth` (0: first, 1: last), more
    filler, the question; prompt and key total `length` tokens (the filler cut to fit)."""
    needle = tok.encode_ordinary(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tok.encode_ordinary(" What is the pass key? The pass key is")
    answer = tok.encode_ordinary(f" {key}")
    room = length - 1 - len(needle) - len(question) - len(answer)
    if room < 0:
        raise config.ConfigError(f"--seq-len {length} is too short for the pass-key question ({length - room} "
                                 "tokens)")
    filler = tok.encode_ordinary(NEEDLE_FILLER * (room // 10 + 1))[:room]
    cut = round(depth * room)
    return [data.bos_id(tok), *filler[:cut], *needle, *filler[cut:], *question], answer


@torch.no_grad()
def needle(model, tok, length: int, depth: float, trials: int, seed: int) -> dict:
    """Pass-key retrieval over `trials` keys: {"accuracy", "key_logprob" (mean per key token)}."""
    rng, hits, logp = np.random.default_rng(seed), 0, []
    for _ in range(trials):
        key = str(rng.integers(10000, 100000))
        prompt, answer = needle_prompt(tok, length, depth, key)
        logp.append(token_logprobs(model, [prompt + answer], [len(answer)])[0].mean())
        got = M.generate(model, prompt, len(answer), temperature=0, n_vocab=tok.n_vocab)[0].tolist()
        hits += got == answer
    return {"length": length, "depth": depth, "trials": trials, "accuracy": hits / trials,
            "key_logprob": float(np.mean(logp))}


# ----------------------------------------------------------------------------------------------------
# 5. Multiple choice by log-likelihood
#
# The context is BOS + encode_ordinary(context), the choice encode_ordinary(" " + choice) after it:
# encoded apart, the choice's tokens are the same whatever the context (and with a space in front,
# its first word is tokenized as in running text). A sequence over seq_len + 1 tokens loses its
# first (context) tokens; a choice over seq_len keeps its last seq_len tokens, and the run says how
# many items had one (lm-evaluation-harness refuses them). Scores, as lm-evaluation-harness:
#   acc        argmax of the summed log-probability of the choice's tokens
#   acc_norm   the same divided by the number of characters of the choice (not counting the space)
#   acc_token  the same divided by the number of its tokens (the mean log-probability per token)


def multiple_choice(model, tok, items, seq_len, batch_size, mesh, name="") -> dict:
    mine = range(mesh.dp_rank, len(items), mesh.dp)
    requests, cut = choice_requests(tok, items, mine, seq_len)
    scores = score_by_length(model, requests, batch_size,
                             data.Progress(f"{name} (this rank)", len(requests), "sequences", quiet=mesh.rank != 0))
    result = choice_result(choice_tally(items, mine, requests, scores, cut), seq_len, mesh,
                           model.tok_embeddings.weight.device)
    if mesh.rank == 0:
        say_cut(name or "multiple choice", result["choices_cut"], result["items"], seq_len)
    return result


def choice_requests(tok, items, mine, seq_len) -> tuple[list, int]:
    """Every choice of the items `mine` as a request (tokens, the number of choice tokens at their
    end), and how many of those items have a choice longer than seq_len."""
    requests, cut = [], 0
    for i in mine:
        context = [data.bos_id(tok)] + tok.encode_ordinary(items[i]["context"])
        conts = [tok.encode_ordinary(" " + choice) for choice in items[i]["choices"]]
        cut += any(len(cont) > seq_len for cont in conts)
        requests += [((context + cont)[-(seq_len + 1):], min(len(cont), seq_len)) for cont in conts]
    return requests, cut


def choice_tally(items, mine, requests, scores, cut) -> list[float]:
    """Each request's summed log-prob (`scores`) -> [items right by acc, by acc_norm, by acc_token,
    items, items with a choice cut short]: the sums choice_result turns into accuracies."""
    sums, k = np.zeros(5), 0
    for i in mine:
        choices, label = items[i]["choices"], items[i]["label"]
        logp = np.array(scores[k:k + len(choices)])
        n_tokens = np.array([n for _, n in requests[k:k + len(choices)]])
        n_chars = np.array([max(len(c), 1) for c in choices])
        k += len(choices)
        sums += [logp.argmax() == label, (logp / n_chars).argmax() == label, (logp / n_tokens).argmax()
                 == label, 1, 0]
    sums[4] = cut
    return sums.tolist()


def choice_result(sums, seq_len, mesh, device) -> dict:
    """Every dp rank's choice_tally summed -> acc, acc_norm, acc_token and the counts."""
    right, right_norm, right_token, n, cut = _all_reduce(sums, mesh, device)
    return {"acc": right / n, "acc_norm": right_norm / n, "acc_token": right_token / n, "items": int(n),
            "seq_len": seq_len, "choices_cut": int(cut)}


def say_cut(name: str, cut: int, n: int, seq_len: int):
    if cut:
        print(f"{name}: {cut:,} of {n:,} items have a choice longer than the {seq_len}-token window; each such "
              f"choice is scored on its last {seq_len} tokens only", file=sys.stderr, flush=True)


def score_by_length(model, requests, batch_size, progress) -> list[float]:
    """The summed log-prob of each request's last n tokens, scored longest first, batch_size at a
    time: batches of about one length need little padding (as lm-evaluation-harness does)."""
    order = sorted(range(len(requests)), key=lambda r: -len(requests[r][0]))
    scores = [0.0] * len(requests)
    for k in range(0, len(order), batch_size):
        batch = [requests[r] for r in order[k:k + batch_size]]
        logps = token_logprobs(model, [seq for seq, _ in batch], [n for _, n in batch])
        for r, logp in zip(order[k:k + batch_size], logps):
            scores[r] = logp.sum()
        progress.update(len(batch))
    return scores


# ----------------------------------------------------------------------------------------------------
# 5b. Benchmarks during training (train.py --eval-tasks): section 5's multiple-choice scoring (the
#     same requests and tallies), run through the training run's own layout, since under tp, cp and
#     pp no rank holds the whole model. `run` is train.py's Run.


def check_benchmarks(args, kind: str):
    """Check --eval-tasks (benchmarks or item files, for a language model) before processes talk."""
    if args.eval_tasks and kind == "reward":
        raise config.ConfigError("--eval-tasks scores the choices of a language model; a reward model's head "
                                 "has one output: score its pairs instead (reward.py score)")
    for name, _ in config.eval_tasks(args.eval_tasks):
        if name not in BENCHMARKS and not Path(name).expanduser().is_file():
            raise config.ConfigError(f"--eval-tasks {name}: not a benchmark ({', '.join(BENCHMARKS)}) nor a "
                                     "file of multiple-choice items")


def load_benchmarks(args, tok, mesh) -> list[tuple[str, list]]:
    """[(name, its first N items)], read by rank 0 first (a download fills a cache folder); rank 0
    says once how many have a choice cut to the window."""
    read = lambda: [(name, read_items(name, args.mirror)[:limit])
                    for name, limit in config.eval_tasks(args.eval_tasks)]
    tasks = P.on_rank0_first(read, mesh) if args.eval_tasks else []
    for name, items in tasks if mesh.rank == 0 else []:
        cut = choice_requests(tok, items, range(len(items)), args.seq_len)[1]
        say_cut(name, cut, len(items), args.seq_len)
    return tasks


def benchmarks(run) -> dict:
    """Each --eval-tasks benchmark's acc and acc_norm ({"hellaswag/acc": ...}): each replica's ranks
    score its items (i % dp == dp_rank) together; the counts are summed over dp."""
    results, mesh = {}, run.mesh
    for name, items in run.benchmarks:
        mine = range(mesh.dp_rank, len(items), mesh.dp)
        requests, cut = choice_requests(run.tok, items, mine, run.args.seq_len)
        tally = choice_tally(items, mine, requests, request_logprobs(run, requests), cut)
        result = choice_result(tally, run.args.seq_len, mesh, run.device)
        results.update({f"{name}/{k}": result[k] for k in ("acc", "acc_norm")})
    return results


@torch.no_grad()
def request_logprobs(run, requests: list) -> list[float]:
    """The summed log-prob of each request's last n tokens (choice_requests), through the pipeline:
    requests packed into rows of seq_len, each its own document (mask and RoPE positions restart, so
    it scores as it would alone), micro_batch rows at a time; the head runs only at the scored
    positions. Every dp rank runs as many micro-batches (ZeRO-3 gathers weights over dp)."""
    mesh, args, device, B = run.mesh, run.args, run.device, run.args.micro_batch
    rows = pack_requests(requests, args.seq_len, data.pad_id(run.tok))  # (4, rows, T)
    n = torch.tensor([math.ceil(rows.shape[1] / B)], device=device)
    P.all_reduce(n, mesh, "dp", op=dist.ReduceOp.MAX)
    rows = torch.cat([rows, pack_requests([], args.seq_len, 0, int(n) * B - rows.shape[1])], dim=1).to(device)
    inputs, targets, docs, index = rows
    batches = [P.context_chunks((inputs[i:i + B], targets[i:i + B], docs[i:i + B]), mesh)
               for i in range(0, len(inputs), B)]
    pos = P.context_positions(args.seq_len, mesh.cp, mesh.cp_rank, device) if mesh.cp > 1 else slice(None)
    at = iter([index[i:i + B, pos] for i in range(0, len(inputs), B)])  # per micro-batch, in order
    scores = torch.zeros(len(requests), dtype=torch.float64, device=device)

    def score(h, targets):  # h: (B, T/cp, dim), the final norm's output on the last stage
        keep, where = targets != data.IGNORE_INDEX, next(at)
        logp = -loss.token_losses(run.model.output(h[keep]), targets[keep], run.margs.vocab_size, mesh)
        scores.index_add_(0, where[keep], logp.double())

    run.model.eval()
    P.pipeline_forward(run.model, batches, mesh, args.seq_len, score, run.dtype, head=False)
    run.model.train()
    for dim in ("cp", "pp"):  # each cp rank scored its chunks; the last stage holds the scores
        P.all_reduce(scores, mesh, dim)
    return scores.tolist()


def pack_requests(requests: list, seq_len: int, pad: int, empty: int = 0) -> torch.Tensor:
    """Requests (tokens, n) -> (4, rows, seq_len): inputs, targets, document ids, request index. A
    request's tokens but the last are inputs and its last n targets (the rest data.IGNORE_INDEX); it
    has its own document id, and its index at each position (-1 in padding, whose document comes
    last). Filled in order, a request to a row while it fits; then `empty` rows of padding."""
    blank = lambda: torch.tensor([pad, data.IGNORE_INDEX, seq_len, -1])[:, None].repeat(1, seq_len)  # (4, T)
    rows, used, doc = [], seq_len, 0
    for r, (seq, n) in enumerate(requests):
        L = len(seq) - 1  # positions it takes: every token but the last predicts the next
        if used + L > seq_len:
            rows.append(blank())
            used, doc = 0, 0
        row = rows[-1]
        row[0, used:used + L] = torch.as_tensor(seq[:-1])
        row[1, used + L - n:used + L] = torch.as_tensor(seq[-n:])
        row[2, used:used + L], row[3, used:used + L] = doc, r
        used, doc = used + L, doc + 1
    rows += [blank() for _ in range(empty)]
    return torch.stack(rows, dim=1) if rows else torch.empty(4, 0, seq_len, dtype=torch.long)


# ----------------------------------------------------------------------------------------------------
# 5c. Reward models (reward.py): a conversation's score, read at its reply's end, and what scores
#     say of preference pairs. reward.py trains on these scores; rl.py rewards rollouts with them.

PAIR_METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")  # means over pairs


def score_positions(targets: torch.Tensor) -> torch.Tensor:
    """(rows, T) targets -> (rows,) the input position holding each row's last token: one past the
    last learned target (the reply's <|eot_id|>), or the last position for a row cut by seq_len."""
    T = targets.shape[-1]
    after = (targets != data.IGNORE_INDEX).long() * torch.arange(1, T + 1, device=targets.device)  # t + 1
    return after.max(dim=-1).values.clamp(max=T - 1)


def scores(logits, targets, mesh) -> torch.Tensor:
    """A reward model's logits (rows, T, its head's columns on this tp rank) -> (rows,) r(x, y)."""
    out = P.head_outputs(logits, 1, mesh)[..., 0].float()  # (rows, T): the score after every token
    return out.gather(1, score_positions(targets)[:, None])[:, 0]


def pair_sums(r_chosen, r_rejected) -> torch.Tensor:
    """The sums behind PAIR_METRICS: pairs ranked right, margins, the two scores."""
    return torch.stack([(r_chosen > r_rejected).float().sum(), (r_chosen - r_rejected).sum(),
                        r_chosen.sum(), r_rejected.sum()])


def load_reward_model(path, device, mirror=None, dtype=torch.float32, mesh=None):
    """--reward: a reward model's checkpoint or Hugging Face folder -> (model in eval mode,
    tokenizer). Under a job (mesh), its ranks check a checkpoint's shards together."""
    checkpoint.check_head(path, "--reward", reward=True)
    tok = checkpoint.tokenizer_for(path, None, mirror)
    return load_model(path, tok, device, dtype, mesh or P.Mesh()), tok


@torch.no_grad()
def score_replies(reward_model, tok, prompt, replies: list[str], seq_len: int) -> torch.Tensor:
    """(K,) scores r(prompt, reply), read as training and reward.py score read them
    (chat.reply_example's rows, the score at the reply's <|eot_id|>), all K in one batch padded to
    the longest. A row has as many input positions as the longest example has tokens, so its
    <|eot_id|> is an input, not only a target; at most seq_len: an example of seq_len + 1 tokens (or
    cut there) is read at its last input token, as a PreferenceLoader's rows of seq_len read it."""
    examples = [chat.reply_example(tok, prompt, reply, seq_len)[0] for reply in replies]
    width = min(max(len(ids) for ids, _ in examples), seq_len)
    x, y, _ = chat.pack_rows(examples, width, data.pad_id(tok), pack=False)
    device = reward_model.tok_embeddings.weight.device
    x, y = chat.as_int64(x).to(device), chat.as_int64(y).to(device)
    return scores(reward_model(x), y, P.Mesh())


@torch.no_grad()
def score_pairs(model, loader: chat.PreferenceLoader, batch_size: int) -> dict:
    """Every pair of a loader: {"pairs", "accuracy", "margin", "rewards/chosen", ...} (means)."""
    device, sums = model.tok_embeddings.weight.device, torch.zeros(4)
    for lo in range(0, len(loader), batch_size):
        x, y = (t.to(device) for t in loader.pairs(list(range(lo, min(lo + batch_size, len(loader))))))
        rc, rr = scores(model(x), y, P.Mesh()).chunk(2)
        sums += pair_sums(rc, rr).cpu()
    return {"pairs": len(loader), **dict(zip(PAIR_METRICS, (sums / len(loader)).tolist()))}


# ----------------------------------------------------------------------------------------------------
# 6. Generation


def complete(model, tok, prompt, as_chat=False, max_new_tokens=200, seq_len=None, **sampling) -> dict:
    """A prompt's continuation. Plain: BOS + the prompt, until <|end_of_text|>. as_chat: the prompt
    as a user message in the chat template with the assistant's header after it, until <|eot_id|>."""
    if as_chat:
        ids, _ = chat.encode_chat(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        ids = [data.bos_id(tok)] + tok.encode_ordinary(prompt)
    stop = data.eot_id(tok) if as_chat else data.eos_id(tok)
    limit = seq_len or model.args.max_seq_len
    if len(ids) >= limit:
        raise config.ConfigError(f"a prompt of {len(ids)} tokens leaves no room to generate under --seq-len "
                                 f"{limit}")
    new = M.generate(model, ids, min(max_new_tokens, limit - len(ids)), eos_id=stop, n_vocab=tok.n_vocab,
                     **sampling)
    new = new[0].tolist()
    stopped = stop in new
    new = new[:new.index(stop)] if stopped else new
    return {"prompt": prompt, "completion": tok.decode(new), "tokens": new, "stopped": stopped, "chat": as_chat}


# ----------------------------------------------------------------------------------------------------
# 7. Contamination: which benchmark items share an n-gram with the training data
#
# An item's text is its context and right answer. Each n-gram of words (lowercased \w+ runs) and of
# tokens is hashed to 64 bits: ids mixed (splitmix64), then combined by a polynomial rolling hash
# mod 2^64 (uint64 arithmetic wraps). The benchmark's hashes form a small sorted array; the training
# data streams past in pieces whose hashes are looked up in it (searchsorted) and dropped, so its
# n-grams are never all in memory. An item is contaminated if any of its n-grams occurs.

CHUNK = 1 << 20  # tokens (shards) or characters (text) per training piece: bounds the memory used
_BASE = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def ngram_hashes(ids, n) -> np.ndarray:
    """(L,) ids -> (L - n + 1,) uint64 hashes of every window of n ids."""
    x = _mix(np.asarray(ids, dtype=np.uint64))
    h = np.zeros(max(len(x) - n + 1, 0), dtype=np.uint64)
    for k in range(n):
        h = h * _BASE + x[k:k + len(h)]
    return h


@functools.lru_cache(maxsize=1 << 18)
def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")


def word_ids(text: str) -> np.ndarray:
    return np.fromiter((_word_hash(w) for w in re.findall(r"\w+", text.lower())), dtype=np.uint64)


class NgramIndex:
    """The n-gram hashes of every benchmark item, and which ones the training stream has shown."""

    def __init__(self, sequences, n):
        grams = [np.unique(ngram_hashes(s, n)) for s in sequences]
        self.table = np.unique(np.concatenate(grams))  # sorted; the only n-grams held in memory
        # each item's n-grams, as table indices
        self.of_item = [np.searchsorted(self.table, g) for g in grams]
        self.found = np.zeros(len(self.table), dtype=bool)
        self.n, self.carry = n, np.zeros(0, dtype=np.uint64)

    def feed(self, ids):
        """The next piece of the stream; its last n - 1 ids are kept for n-grams across pieces."""
        ids = np.concatenate([self.carry, np.asarray(ids, dtype=np.uint64)])
        self.carry = ids[max(len(ids) - self.n + 1, 0):]
        if len(self.table):
            h = ngram_hashes(ids, self.n)
            idx = np.minimum(np.searchsorted(self.table, h), len(self.table) - 1)
            self.found[idx[self.table[idx] == h]] = True

    def report(self, texts, examples) -> dict:
        hit = [i for i, g in enumerate(self.of_item) if self.found[g].any()]
        return {"n": self.n, "contaminated": len(hit), "share": len(hit) / len(texts),
                "checkable": sum(len(g) > 0 for g in self.of_item), "indices": hit,
                "examples": [{"index": i, "overlap": float(self.found[self.of_item[i]].mean()),
                              "text": texts[i][:300]} for i in hit[:examples]]}


def training_pieces(source, tok, mirror=None):
    """Training data -> (token ids, text) pieces of about CHUNK tokens or characters, in order.
    Shards are cut just before a token that starts with whitespace (or is special), so no word is
    split between pieces; specials become newlines in the text. Text files are cut at line ends."""
    shards = shard_paths(source)
    if shards:
        table = token_bytes(tok)
        breaks = np.array([not b or b[:1].isspace() for b in table])
        text_id = np.array([i if table[i] else tok.encode_ordinary("\n")[0] for i in range(len(table))])
        for shard in shards:
            tokens, start = data.read_shard(shard, tok.name), 0
            data.check_token_ids(tokens, shard, tok.name, tok.n_vocab)  # (read whole here anyway)
            while start < len(tokens):
                end = min(start + CHUNK, len(tokens))
                cut = np.flatnonzero(breaks[tokens[start + 1:end]]) if end < len(tokens) else []
                end = start + 1 + int(cut[-1]) if len(cut) else end
                ids = np.asarray(tokens[start:end], dtype=np.int64)
                yield ids, tok.decode(text_id[ids].tolist())
                start = end
        return
    for file, fmt, encoding in data.resolve_source(source, mirror):
        with open(file, encoding=encoding) as f:
            while lines := f.readlines(CHUNK):  # whole lines, about CHUNK characters
                try:
                    text = "".join(json.loads(line)["text"] + "\n" if fmt == "jsonl" and line.strip()
                                   else line for line in lines)
                except (ValueError, KeyError, TypeError, RecursionError):  # (deep nesting: not a ValueError)
                    raise data.DataError(f"{file}: a line is not a JSON record with a \"text\" "
                                         "field") from None
                yield np.array(tok.encode_ordinary(text), dtype=np.int64), text


def contamination(items, source, tok, n_words=13, n_tokens=8, examples=3, mirror=None) -> dict:
    texts = [f"{it['context']} {it['choices'][it['label']]}" for it in items]
    index = {"words": NgramIndex([word_ids(t) for t in texts], n_words),
             "tokens": NgramIndex([tok.encode_ordinary(t) for t in texts], n_tokens)}
    train_tokens = train_words = 0
    for ids, text in training_pieces(source, tok, mirror):
        words = word_ids(text)
        index["words"].feed(words)
        index["tokens"].feed(ids)
        train_tokens, train_words = train_tokens + len(ids), train_words + len(words)
    return {"train": str(source), "items": len(items), "train_tokens": train_tokens,
            "train_words": train_words,
            "tokenizer": tok.name, **{kind: ix.report(texts, examples) for kind, ix in index.items()}}


# ----------------------------------------------------------------------------------------------------
# 8. A picture of a run, from the records train.py, sft.py and dpo.py write to metrics.jsonl


def plot_run(out_dir) -> Path:
    """<out-dir>/loss.png (run_figure). matplotlib is needed for this alone."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no window, no global backend to pick
    except ImportError:
        raise config.ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        raise config.ConfigError(f"--plot {out_dir}: no metrics.jsonl there (a train.py, sft.py or dpo.py "
                                 "--out-dir)")
    records = [r for _, r in data.json_records(path) if isinstance(r, dict)]
    if not any("loss" in r or "val_loss" in r for r in records):
        raise data.DataError(f"{path}: no loss recorded yet")
    run_figure(Figure(figsize=(8, 6)), records, str(out_dir)).savefig(Path(out_dir) / "loss.png", dpi=120,
                                                                      bbox_inches="tight")
    return Path(out_dir) / "loss.png"


def run_figure(fig, records: list[dict], title: str):
    """Train and validation loss against tokens (steps for runs that did not record tokens); below,
    the --eval-tasks benchmarks' acc_norm if any were scored; the learning rate last."""
    train, val = [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]
    tasks = sorted({k.removesuffix("/acc_norm") for r in val for k in r if k.endswith("/acc_norm")})
    x = "tokens" if all("tokens" in r for r in train + val) else "step"
    axes = fig.subplots(3 if tasks else 2, 1, sharex=True, height_ratios=[3, 2, 1] if tasks else [3, 1])
    top, bottom = axes[0], axes[-1]
    top.plot([r[x] for r in train], [r["loss"] for r in train], label="train")
    top.plot([r[x] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    top.set(ylabel="loss", title=title)
    top.legend()
    for task in tasks:
        scored = [r for r in val if f"{task}/acc_norm" in r]
        axes[1].plot([r[x] for r in scored], [r[f"{task}/acc_norm"] for r in scored], "o-", label=task)
    if tasks:
        axes[1].set(ylabel="acc_norm")
        axes[1].legend()
    bottom.plot([r[x] for r in train], [r["lr"] for r in train], color="gray")
    bottom.set(xlabel=x, ylabel="learning rate")
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig


# ----------------------------------------------------------------------------------------------------
# 9. What training changed in the weights. Post-training moves a pretrained model a little, and in
#    few directions (the premise of LoRA, Hu et al. 2021): for each matrix, ||B - A|| / ||A|| and
#    the number of singular directions of B - A that carry 90% of its squared norm.


ENERGY = 0.9  # the share of a difference's squared norm its effective rank's directions carry


def kind_of(name: str) -> str:
    """A parameter's kind: "layers.3.attention.wq.weight" -> "attention.wq", "tok_embeddings.weight"
    -> "tok_embeddings"."""
    parts = name.split(".")[:-1]
    return ".".join(parts[2:] if parts[0] == "layers" else parts)


def spectrum(delta: torch.Tensor) -> torch.Tensor:
    """The squared singular values of a matrix, largest first: the eigenvalues of its Gram matrix on
    the smaller side, in fp64 (an embedding's (V, dim) needs only a (dim, dim) one)."""
    small = (delta if delta.shape[0] <= delta.shape[1] else delta.T).double()
    return torch.linalg.eigvalsh(small @ small.T).clamp(min=0).flip(0)


def matrix_change(a: torch.Tensor, b: torch.Tensor) -> dict:
    """The relative change, and for a matrix the difference's rank (singular values above numpy's
    default tolerance) and effective rank (how many directions carry ENERGY of its squared norm)."""
    delta = b.float() - a.float()
    out = {"shape": list(a.shape),
           "relative_change": (delta.norm() / a.float().norm().clamp(min=1e-30)).item()}
    if a.dim() == 2:
        sq = spectrum(delta)
        tol = (sq[0].sqrt() * max(a.shape) * torch.finfo(torch.float32).eps) ** 2
        cum = sq.cumsum(0) / sq.sum().clamp(min=1e-300)
        out.update(rank=int((sq > tol).sum()), full_rank=min(a.shape),
                   effective_rank=int((cum < ENERGY).sum()) + 1 if sq.sum() else 0)
    return out


def weight_shape(margs: M.ModelArgs) -> dict:
    """What decides a model's weights' names and shapes: the dense FFN's size only where a layer is dense,
    a mixture's experts where there are any."""
    keys = ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "tie_embeddings", "num_labels",
            "n_experts"]
    keys += ["hidden_dim"] if margs.moe_layers < margs.n_layers else []
    keys += ["expert_dim", "moe_every"] if margs.n_experts else []
    return {k: getattr(margs, k) for k in keys}


def weight_diff(a_path, b_path, mirror=None) -> dict:
    """--diff A B, two checkpoints or exports of one model: each parameter's change and the layers
    and kinds that moved most. A is read with B's tokenizer: where B grew the vocabulary (SFT's chat
    tokens), A's new rows are what B started from (their mean, checkpoint.grow_vocab)."""
    tok_a, tok_b = (checkpoint.tokenizer_for(p, None, mirror, grows=True) for p in (a_path, b_path))
    if tok_a.name != tok_b.name:
        raise config.ConfigError(f"--diff: {a_path} reads the tokenizer {tok_a.name} and {b_path} "
                                 f"{tok_b.name}: their rows mean different tokens")
    with contextlib.redirect_stdout(sys.stderr):
        (margs_a, a), (margs_b, b) = checkpoint.load_init(a_path, tok_b), checkpoint.load_init(b_path, tok_b)
    # compare what shapes the weights: a preset's FFN rule and an export's hidden_dim are one model
    shape_a, shape_b = weight_shape(margs_a), weight_shape(margs_b)
    differ = ", ".join(f"{k} {shape_a.get(k)} vs {shape_b.get(k)}" for k in {**shape_a, **shape_b}
                       if shape_a.get(k) != shape_b.get(k))
    if differ:
        raise config.ConfigError(f"--diff: {a_path} and {b_path} are different models ({differ})")
    tied = {"output.weight"} if margs_b.tie_embeddings else set()  # the embedding's own numbers
    rows = {name: matrix_change(a[name], b[name]) for name in b
            if not name.startswith(M.TRAINING_ONLY) and name not in tied}
    mean = lambda key: {k: sum(v) / len(v) for k, v in grouped(rows, key).items()}
    return {"kind": "diff", "task": "diff", "a": str(a_path), "b": str(b_path), "params": rows,
            "by_kind": mean(kind_of), "by_layer": mean(lambda n: n.split(".")[1] if n.startswith("layers.")
                                                       else None)}


def grouped(rows: dict, key) -> dict[str, list[float]]:
    """The relative changes of the parameters, by key(name) (None: left out)."""
    out = {}
    for name, r in rows.items():
        if key(name) is not None:
            out.setdefault(key(name), []).append(r["relative_change"])
    return out


def plot_diff(r: dict, path) -> Path:
    """--diff-plot FILE: relative change and effective rank by layer, a line per kind of matrix."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise config.ConfigError("--diff-plot needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(9, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    layered = {n: v for n, v in r["params"].items() if n.startswith("layers.") and "rank" in v}
    for kind in sorted({kind_of(n) for n in layered}):
        mine = sorted((int(n.split(".")[1]), v) for n, v in layered.items() if kind_of(n) == kind)
        top.plot([i for i, _ in mine], [v["relative_change"] for _, v in mine], "o-", label=kind)
        bottom.plot([i for i, _ in mine], [v["effective_rank"] / v["full_rank"] for _, v in mine], "o-")
    top.set(ylabel="||B - A|| / ||A||", yscale="log", title=f"{r['a']} -> {r['b']}")
    bottom.set(xlabel="layer", ylabel=f"effective rank / full ({ENERGY:.0%} of the change)")
    top.legend(fontsize=8, ncol=4)
    bottom.set_xticks(sorted({int(n.split(".")[1]) for n in layered}))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return Path(path)


# ----------------------------------------------------------------------------------------------------
# 10. Command line


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=launch.HelpFormatter)
    p.add_argument("--init",
                   help="a train.py/sft.py/dpo.py --out-dir or step folder, a Hugging Face or a Meta folder")
    p.add_argument("--task", action="append", default=[],
                   help=f"repeatable: a benchmark ({', '.join(BENCHMARKS)}) or a {{context, choices, label}} "
                        f"JSONL; a dataset ({', '.join(data.DATASETS)}: its val split), a folder of shards, "
                        f"a .bin, .txt or {{text}} .jsonl file (loss, perplexity, bits per byte)")
    p.add_argument("--tokenizer", help="default: the one --init records (llama3 for a Hugging Face or Meta "
                                       "Llama 3 folder); any other is refused")
    p.add_argument("--seq-len", type=int,
                   help="longest sequence; default: the training --seq-len, else max_seq_len")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--limit", type=int, help="only the first N items (benchmarks) or windows (text); "
                                              "--task needle: its number of keys (default 20)")
    p.add_argument("--needle-depth", type=float, default=0.5,
                   help="--task needle (pass-key retrieval in --seq-len tokens): where the key stands, 0 to 1")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per task (summaries go to stderr)")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=[], help="repeatable")
    g.add_argument("--prompts-file", help="one prompt per line")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the chat template; stop at <|eot_id|>")
    g.add_argument("--max-new-tokens", type=int, default=200,
                   help="per prompt (fewer if --seq-len ends first)")
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    g.add_argument("--top-k", type=int, help="sample among the k likeliest tokens only")
    g.add_argument("--top-p", type=float, help="sample among the likeliest tokens holding this probability")
    g.add_argument("--seed", type=int, default=1337, help="of the sampling")
    g = p.add_argument_group("contamination")
    g.add_argument("--contamination", help="a benchmark name or file to look for in --train")
    g.add_argument("--train",
                   help="training data: a dataset name, .txt/.jsonl files (glob, folder) or shards")
    g.add_argument("--ngram-words", type=int, default=13, help="n of the word n-grams (lowercased \\w+ runs)")
    g.add_argument("--ngram-tokens", type=int, default=8,
                   help="in --tokenizer's tokens (the shards' own for shards)")
    g.add_argument("--examples", type=int, default=3, help="contaminated items shown per kind")
    add_weights_and_pictures_args(p.add_argument_group("weights and pictures"))
    g = p.add_argument_group("system")
    g.add_argument("--mirror", help="local mirror folder for downloads (default: $DATA_MIRROR)")
    g.add_argument("--device", help="cuda, cpu, ... (default: cuda if available)")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: bf16 on CUDA, fp32 elsewhere")
    return p


def add_weights_and_pictures_args(g):
    g.add_argument("--diff", nargs=2, metavar=("A", "B"),
                   help="how each matrix changed from checkpoint A to checkpoint B of one model (e.g. "
                        "pretrained and SFT'd): relative change, the effective rank of the difference, by "
                        "layer and kind")
    g.add_argument("--diff-plot", metavar="FILE",
                   help="with --diff: a PNG of the changes by layer (matplotlib)")
    g.add_argument("--plot", metavar="OUT_DIR", help="a PNG of a run's losses and learning rate (matplotlib)")


def describe(r) -> str:
    """The one-paragraph summary of a task's result."""
    if r["kind"] == "perplexity":
        return (f"{r['task']}: loss {r['loss']:.4f} | perplexity {r['perplexity']:.3f} | bits per byte "
                f"{r['bits_per_byte']:.4f} | {r['tokens']:,} tokens, {r['bytes']:,} bytes, {r['windows']:,} "
                "windows\n  loss by target position: "
                + " | ".join(f"{k} {v:.3f}" for k, v in r["loss_by_position"].items()))
    if r["kind"] == "multiple_choice":
        return (f"{r['task']}: acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f} | acc_token "
                f"{r['acc_token']:.4f} | {r['items']:,} items")
    if r["kind"] == "needle":
        return (f"needle (pass key in {r['length']:,} tokens at depth {r['depth']:.2f}): accuracy "
                f"{r['accuracy']:.3f} over {r['trials']} keys | key log-prob per token {r['key_logprob']:.3f}")
    if r["kind"] == "generate":
        return f"prompt: {r['prompt']}\n{r['completion']}" + ("" if r["stopped"] else " [...]")
    if r["kind"] == "diff":
        return describe_diff(r)
    lines = [f"contamination of {r['task']} ({r['items']:,} items) in {r['train']} "
             f"({r['train_words']:,} words, {r['train_tokens']:,} {r['tokenizer']} tokens):"]
    for kind in ("words", "tokens"):
        c = r[kind]
        lines.append(f"  {c['n']}-{kind[:-1]} n-grams: {c['contaminated']:,} items ({100 * c['share']:.2f}%) "
                     f"contaminated; {c['checkable']:,} items long enough to check")
        lines += [f"    #{e['index']} ({100 * e['overlap']:.0f}% of its n-grams): {e['text'][:100]!r}"
                  for e in c["examples"]]
    return "\n".join(lines)


def describe_diff(r: dict) -> str:
    by = lambda d: " | ".join(f"{k} {v:.4f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))
    lines = [f"weights from {r['a']} to {r['b']}: ||B - A|| / ||A||, and the difference's rank and effective "
             f"rank (the directions holding {ENERGY:.0%} of it)",
             f"  by kind, most moved first: {by(r['by_kind'])}", f"  by layer: {by(r['by_layer'])}"]
    for name, v in sorted(r["params"].items(), key=lambda kv: -kv[1]["relative_change"]):
        ranks = f"rank {v['rank']:>5}, effective {v['effective_rank']:>5} of {v['full_rank']}" if "rank" in v \
            else ""
        lines.append(f"  {name:42s} {'x'.join(map(str, v['shape'])):>12} {v['relative_change']:10.5f}  {ranks}")
    return "\n".join(lines)


def check_flags(args) -> list[str]:
    """Refuse flags that make no job together or are out of range; return the prompts to complete
    (--prompt, then --prompts-file's non-empty lines)."""
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            prompts += [line for line in data.regular_file(args.prompts_file, "--prompts-file").read_text()
                        .split("\n") if line.strip()]
        except OSError as e:
            raise config.ConfigError(f"--prompts-file: {e}") from None
    if not (args.task or prompts or args.contamination or args.plot or args.diff):
        raise config.ConfigError("nothing to do: give --task, --prompt / --prompts-file, --contamination, "
                                 "--diff or --plot")
    if args.diff and (args.task or prompts):
        raise config.ConfigError("--diff compares the weights of two models, --task and --prompt use one (--init):"
                                 " run them as two commands")
    if args.diff_plot and not args.diff:
        raise config.ConfigError("--diff-plot draws --diff's changes: give --diff A B")
    if (args.task or prompts) and not args.init:
        raise config.ConfigError("--init (a checkpoint, Hugging Face or Meta folder) is needed for --task and "
                                 "--prompt")
    if args.contamination and not args.train:
        raise config.ConfigError("--contamination needs --train: the training data to search")
    for flag in ("batch_size", "limit", "seq_len", "max_new_tokens", "ngram_words", "ngram_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise config.ConfigError(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.needle_depth <= 1:
        raise config.ConfigError(f"--needle-depth must be in [0, 1], got {args.needle_depth}")
    try:
        M.check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise config.ConfigError(f"sampling: {e} (--temperature, --top-k, --top-p)") from None
    return prompts


def run_task(task: str, kind: str, payload, model, tok, seq_len: int, args, mesh) -> dict:
    """One --task's result, by its kind (resolve_task)."""
    if kind == "perplexity":
        return perplexity(model, tok, payload, seq_len, args.batch_size, mesh, args.limit)
    if kind == "needle":
        return needle(model, tok, seq_len, args.needle_depth, args.limit or 20, args.seed)
    return multiple_choice(model, tok, payload[:args.limit], seq_len, args.batch_size, mesh, task)


def seq_len_for(args, recorded: dict, model) -> int:
    """--seq-len, else the length the model was trained at (if recorded), at most its own."""
    seq_len = args.seq_len or min(recorded.get("seq_len") or model.args.max_seq_len, model.args.max_seq_len)
    if seq_len > model.args.max_seq_len:
        raise config.ConfigError(f"--seq-len {seq_len} exceeds the model's max_seq_len "
                                 f"{model.args.max_seq_len}")
    return seq_len


def run_diff(args):
    """--diff A B (and --diff-plot FILE): the table, or with --json the object."""
    diff = weight_diff(*args.diff, args.mirror)
    print(json.dumps(diff) if args.json else describe_diff(diff), flush=True)
    if args.diff_plot:
        print(f"wrote {plot_diff(diff, args.diff_plot)}", file=sys.stderr if args.json else sys.stdout)


def main(argv=None):
    args = get_parser().parse_args(argv)
    prompts = check_flags(args)
    if args.task or prompts:  # perplexity, benchmarks, needle, generation: a language model's
        checkpoint.check_head(args.init, "--init")
    if args.plot:
        print(f"wrote {plot_run(args.plot)}", flush=True)
    if args.diff:
        run_diff(args)
    recorded = checkpoint.recorded(args.init) if args.init else {}
    tok = (checkpoint.tokenizer_for(args.init, args.tokenizer, args.mirror) if args.init
           else data.get_tokenizer(args.tokenizer or "byte", args.mirror))
    mesh = P.Mesh(rank=int(os.environ.get("RANK", "0")))

    def emit(result):
        if mesh.rank == 0:
            print(json.dumps(result) if args.json else describe(result), flush=True)
            if args.json:
                print(describe(result), file=sys.stderr, flush=True)

    if args.task or prompts:
        launch.exit_with_agent()
        device, precision = config.pick_device_and_precision(args)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # kernels, NCCL and new tensors default to this GPU
        dtype = M.DTYPES[precision]
        mesh = P.init_mesh(device=device)
        tasks = P.on_rank0_first(lambda: {task: resolve_task(task, tok, args.mirror) for task in args.task},
                                 mesh)
        model = load_model(args.init, tok, device, dtype, mesh)
        seq_len = seq_len_for(args, recorded, model)
        for task, (kind, payload) in tasks.items():
            emit({"task": task, "kind": kind, **run_task(task, kind, payload, model, tok, seq_len, args, mesh)})
        if mesh.rank == 0:
            g = torch.Generator(device=device).manual_seed(args.seed)
            for prompt in prompts:
                emit({"task": "generate", "kind": "generate",
                      **complete(model, tok, prompt, args.chat, args.max_new_tokens, seq_len,
                                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 generator=g)})
    if args.contamination and mesh.rank == 0:
        items = read_items(args.contamination, args.mirror)[:args.limit]
        shards = shard_paths(args.train)  # token n-grams must be in the shards' own tokenizer
        train_tok = data.get_tokenizer(data.shard_info(shards[0])["tokenizer"],
                                       args.mirror) if shards else tok
        emit({"task": args.contamination, "kind": "contamination",
              **contamination(items, args.train, train_tok, args.ngram_words, args.ngram_tokens,
                              args.examples, args.mirror)})
    if mesh.world > 1:
        launch.leave_job()


if __name__ == "__main__":
    config.run(main)
