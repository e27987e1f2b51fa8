"""Chat data: the Llama 3 chat format, the records fine-tuning reads and the rows they become.
sft.py, dpo.py, reward.py and rl.py read their data here.

  1. Format    encode_chat: messages -> token ids, and the mask of those the model learns to say
               (each assistant message's content and its <|eot_id|>, as an export's Jinja template,
               weights.LLAMA3_CHAT_TEMPLATE, has it too); reply: a model's answer to a conversation
  2. Records   conversations (Alpaca, Self-Instruct, {messages}, {prompt, response}), preference
               pairs (prompt, chosen, rejected; HH-RLHF dialogues), prompts (any of these, up to the
               last user turn)
  3. Rows      the length rule (keep an example's first seq_len + 1 tokens if a learned token is
               among them, else drop it), the validation split, and the rows of seq_len + 1 tokens a
               loader serves: SFT packs examples several to a row (attention never crosses between
               them), a preference pair's two sides take a row each (PreferenceLoader)
A row gives seq_len (input, target) pairs, as in data.Loader; an unlearned target is
data.IGNORE_INDEX, which the loss skips.
"""

from __future__ import annotations

import hashlib
import re
import sys

import numpy as np
import torch

import data
import model as M


# ----------------------------------------------------------------------------------------------------
# 1. The chat format


CHAT_ROLES = ("system", "user", "assistant")


def check_messages(messages):
    if not isinstance(messages, list):
        raise data.DataError(f"a conversation must be a list of messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in CHAT_ROLES:
            raise data.DataError(f"message {i} has role {role!r}; the roles are {', '.join(CHAT_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise data.DataError(f"message {i} ({role}) has content of type "
                            f"{type(message.get('content')).__name__}, not a string")


def encode_chat(enc, messages, add_generation_prompt=False) -> tuple:
    """Messages -> (token ids, mask): mask[t] is True where token t is learned. BOS is written
    here, once; do not add another. Content goes through encode_ordinary, so "<|eot_id|>" inside a
    message stays text. Header and content are encoded separately, as Meta's reference does, so one
    message's tokens never depend on its neighbours."""
    check_messages(messages)
    start, end = enc.encode_single_token("<|start_header_id|>"), enc.encode_single_token("<|end_header_id|>")
    ids, mask = [data.bos_id(enc)], [False]
    for message in messages + ([{"role": "assistant"}] if add_generation_prompt else []):
        header = [start, *enc.encode_ordinary(message["role"]), end, *enc.encode_ordinary("\n\n")]
        ids += header
        mask += [False] * len(header)
        if "content" in message:  # the generation prompt is a header with nothing after it
            body = enc.encode_ordinary(message["content"]) + [data.eot_id(enc)]
            ids += body
            mask += [message["role"] == "assistant"] * len(body)
    return ids, mask


@torch.no_grad()
def reply(model, tok, messages: list[dict], max_new_tokens: int = 200, temperature: float = 0.7,
         top_p: float | None = 0.9, seed: int = 0) -> str:
    """The assistant's reply, sampled after a generation prompt until <|eot_id|>."""
    ids, _ = encode_chat(tok, messages, add_generation_prompt=True)
    room = model.args.max_seq_len - len(ids)
    device = model.tok_embeddings.weight.device
    g = torch.Generator(device=device).manual_seed(seed)
    new = M.generate(model, ids, min(max_new_tokens, room), temperature=temperature, top_p=top_p,
                     eos_id=data.eot_id(tok), generator=g, n_vocab=tok.n_vocab)[0].tolist()
    if data.eot_id(tok) in new:
        new = new[:new.index(data.eot_id(tok))]
    return tok.decode(new)


# ----------------------------------------------------------------------------------------------------
# 2. What a record says: a conversation, a preference pair, a prompt


def _strings(record, *keys):
    # input: optional
    values = [(record.get(key) or "") if key == "input" else record.get(key) for key in keys]
    bad = [key for key, value in zip(keys, values) if not isinstance(value, str)]
    if bad:
        raise data.DataError(f"field(s) {', '.join(bad)} must be strings")
    return values


def conversation(record) -> list:
    """One SFT record, in any of the layouts read_sft accepts -> a list of messages."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
    elif isinstance(record, dict) and "instances" in record and "instruction" in record:
        # a Self-Instruct seed task: the instruction and its first instance's input -> the output
        instances = record["instances"]
        if not (isinstance(instances, list) and instances and isinstance(instances[0], dict)):
            raise data.DataError("'instances' must be a non-empty list of {input, output}")
        [instruction], [task_input, output] = _strings(record, "instruction"), _strings(instances[0], "input",
                                                                                        "output")
        messages = [{"role": "user", "content": instruction + (f"\n\n{task_input}" if task_input else "")},
                    {"role": "assistant", "content": output}]
    elif isinstance(record, dict) and "instruction" in record and "output" in record:  # Alpaca
        instruction, task_input, output = _strings(record, "instruction", "input", "output")
        messages = [{"role": "user", "content": instruction + (f"\n\n{task_input}" if task_input else "")},
                    {"role": "assistant", "content": output}]
    elif isinstance(record, dict) and "prompt" in record and "response" in record:
        prompt, response = _strings(record, "prompt", "response")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        fields = list(record)[:8] if isinstance(record, dict) else type(record).__name__
        raise data.DataError(f"unknown SFT record {fields}: expected {{messages}}, "
                             f"{{instruction, input, output}}, "
                        f"{{prompt, response}} or a Self-Instruct task {{instruction, instances}}")
    check_messages(messages)
    return messages


def read_sft(path_or_name, mirror=None) -> list:
    """A registered name (data.SFT_DATASETS) or a JSON array / JSONL file -> conversations."""
    path = data.named_file(path_or_name, data.SFT_DATASETS, mirror)
    conversations = []
    for where, record in data.json_records(path):
        try:
            conversations.append(conversation(record))
        except data.DataError as e:
            raise data.DataError(f"{where}: {e}") from None
    if not conversations:
        raise data.DataError(f"{path}: no conversations")
    return conversations


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def _parse_hh(text) -> tuple:
    """An HH-RLHF dialogue -> (the messages before its last reply, the last reply)."""
    cut = text.rfind("\n\nAssistant:")
    if cut < 0:
        raise data.DataError('an HH-RLHF dialogue without "\\n\\nAssistant:"')
    pieces = _HH_TURN.split(text[:cut])  # ["", "Human", " text", "Assistant", " text", ...]
    if pieces[0].strip():
        raise data.DataError('an HH-RLHF dialogue must start with "\\n\\nHuman:"')
    messages = []
    for speaker, content in zip(pieces[1::2], pieces[2::2]):
        role = "user" if speaker == "Human" else "assistant"
        if messages and messages[-1]["role"] == role:  # a few dialogues repeat a speaker: join them
            messages[-1]["content"] += "\n\n" + content.strip()
        else:
            messages.append({"role": role, "content": content.strip()})
    return messages, text[cut + len("\n\nAssistant:"):].strip()


NO_PROMPT = ('a pair needs a prompt: a "prompt" field (a string or messages), or "chosen" and "rejected" as '
             'whole conversations (message lists, or HH-RLHF dialogues "\n\nHuman: ...\n\nAssistant: ...")')


def _preference_side(value, prompt) -> tuple:
    """A "chosen" or "rejected" value -> (the conversation before the reply, the reply). A reply
    with no user message before it answers nothing: refused (NO_PROMPT)."""
    if isinstance(value, str):
        if prompt is None and "\n\nAssistant:" not in value:
            raise data.DataError(NO_PROMPT)
        before, reply = (prompt, value) if prompt is not None else _parse_hh(value)
    else:
        check_messages(value)
        if not value or value[-1]["role"] != "assistant":
            raise data.DataError("a chosen/rejected message list must end with an assistant message")
        prefix, prompt = value[:-1], prompt or []
        # the list may repeat the prompt ([user, assistant]) or continue it ([assistant])
        before, reply = (prefix if prefix[:len(prompt)] == prompt else prompt + prefix), value[-1]["content"]
    if not any(m["role"] == "user" for m in before):
        raise data.DataError(NO_PROMPT)
    return before, reply


def pair_sides(record) -> tuple:
    """A preference record -> ((prompt, chosen reply), (prompt, rejected reply)), each prompt a
    message list; a pair whose two prompts differ is the caller's to skip."""
    if not (isinstance(record, dict) and "chosen" in record and "rejected" in record):
        fields = list(record)[:8] if isinstance(record, dict) else type(record).__name__
        raise data.DataError(f"unknown preference record {fields}: expected {{prompt, chosen, rejected}} or "
                             "HH-RLHF {chosen, rejected}")
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif prompt is not None:
        check_messages(prompt)
    return tuple(_preference_side(record[k], prompt) for k in ("chosen", "rejected"))


def read_preferences(path_or_name, mirror=None) -> list:
    """A registered name (data.PREFERENCE_DATASETS) or a JSONL file -> [{"prompt": messages,
    "chosen", "rejected"}]. A record is {"prompt", "chosen", "rejected"}, each a string (a prompt
    string is one user message) or a message list, or HH-RLHF's {"chosen", "rejected"} dialogues.
    Pairs with differing prompts, an empty reply or identical replies are skipped, and counted."""
    path = data.named_file(path_or_name, data.PREFERENCE_DATASETS, mirror)
    pairs, skipped = [], {"different prompts": 0, "an empty reply": 0, "identical replies": 0}
    for where, record in data.json_records(path):
        try:
            (prompt, chosen), (other, rejected) = pair_sides(record)
        except data.DataError as e:
            raise data.DataError(f"{where}: {e}") from None
        if prompt != other:
            skipped["different prompts"] += 1
        elif not (chosen.strip() and rejected.strip()):
            skipped["an empty reply"] += 1
        elif chosen == rejected:  # no preference to learn from
            skipped["identical replies"] += 1
        else:
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    print(f"{path}: {len(pairs):,} preference pairs; skipped " +
          ", ".join(f"{n:,} with {reason}" for reason, n in skipped.items()), file=sys.stderr)
    if not pairs:
        raise data.DataError(f"{path}: no usable preference pairs")
    return pairs


def prompt_of(record) -> list:
    """One record -> its prompt's messages, ending with a user turn: a string (one user message),
    {"prompt": a string or messages}, a preference pair (its prompt), or an SFT record (its
    conversation up to the last user turn: a fine-tuning set's instructions are prompts)."""
    if isinstance(record, str):
        messages = [{"role": "user", "content": record}]
    elif isinstance(record, dict) and "chosen" in record:
        messages = pair_sides(record)[0][0]
    elif isinstance(record, dict) and "prompt" in record and "response" not in record:
        prompt = record["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        check_messages(messages)
    else:
        messages = conversation(record)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise data.DataError("a prompt needs a user message")
    return messages[:users[-1] + 1]


def read_prompts(path_or_name, mirror=None) -> list[tuple[str, list]]:
    """Prompts -> [(where, messages ending with a user turn)], each record read by prompt_of."""
    path = data.named_file(path_or_name, {**data.SFT_DATASETS, **data.PREFERENCE_DATASETS}, mirror)
    prompts = []
    for where, record in data.json_records(path):
        try:
            prompts.append((where, prompt_of(record)))
        except data.DataError as e:
            raise data.DataError(f"{where}: {e}") from None
    if not prompts:
        raise data.DataError(f"{path}: no prompts")
    return prompts


def with_room(prompts, tok, seq_len: int, say) -> list[int]:
    """The indices of the prompts that leave a token for a reply under seq_len; the others are left
    out and counted, the first named, as the length rule drops examples. None left is an error."""
    lengths = [len(encode_chat(tok, prompt, add_generation_prompt=True)[0]) for _, prompt in prompts]
    long = [(where, n) for (where, _), n in zip(prompts, lengths) if n >= seq_len]
    if long:
        (where, n), what = long[0], f"{len(long):,} of {len(prompts):,} prompt(s)"
        first = f"the first, {where}, is {n:,} tokens with its chat headers"
        if len(long) == len(prompts):
            raise data.DataError(f"{what} leave no room for a reply under --seq-len {seq_len} ({first}): "
                                 "shorten them, or raise --seq-len up to the models' context")
        say(f"left out: {what} that leave no room for a reply under --seq-len {seq_len} ({first})")
    return [i for i, n in enumerate(lengths) if n < seq_len]


# ----------------------------------------------------------------------------------------------------
# 3. Examples and the rows they become


def fit_example(ids, mask, seq_len):
    """The length rule: (ids, mask) cut to seq_len + 1 tokens, or None if none is learned."""
    ids, mask = np.asarray(ids, dtype=np.int32)[:seq_len + 1], np.asarray(mask, dtype=bool)[:seq_len + 1]
    return (ids, mask) if mask.any() else None


def example_counts(kept, truncated, dropped) -> dict:
    return {"examples": len(kept), "truncated": truncated, "dropped": dropped,
            "tokens": sum(len(ids) for ids, _ in kept), "target_tokens": sum(int(mask.sum()) for _,
                                                                             mask in kept)}


def sft_examples(enc, conversations, seq_len) -> tuple:
    """Conversations -> ([(ids int32, mask bool)], counts) by the length rule, which drops one with
    no assistant message; counts: examples, truncated, dropped, tokens, target_tokens."""
    examples, truncated, dropped = [], 0, 0
    for conversation in conversations:
        ids, mask = encode_chat(enc, conversation)
        example = fit_example(ids, mask, seq_len)
        if example is None:
            dropped += 1
            continue
        truncated += len(ids) > seq_len + 1
        examples.append(example)
    return examples, example_counts(examples, truncated, dropped)


def reply_example(enc, prompt, reply, seq_len) -> tuple:
    """A prompt (messages) and a reply -> (fit_example's (ids, mask) or None, whether it was cut).
    The mask covers the reply and its <|eot_id|> only: the prompt's assistant turns are context."""
    prompt_len = len(encode_chat(enc, prompt)[0])
    ids, mask = encode_chat(enc, prompt + [{"role": "assistant", "content": reply}])
    mask[:prompt_len] = [False] * prompt_len
    return fit_example(ids, mask, seq_len), len(ids) > seq_len + 1


def preference_examples(enc, pairs, seq_len) -> tuple:
    """Pairs -> ([{"chosen": (ids, mask), "rejected": (ids, mask)}], counts), each side by
    reply_example. A pair is dropped if either side is, or if its sides are the same once cut:
    replies that differ only after the cut leave no preference to learn and would dilute the batch's
    mean. counts: sft_examples', over both sides, plus "identical" (the pairs dropped so)."""
    examples, truncated, dropped, identical = [], 0, 0, 0
    for pair in pairs:
        sides = {key: reply_example(enc, pair["prompt"], pair[key], seq_len) for key in ("chosen", "rejected")}
        if any(example is None for example, _ in sides.values()):
            dropped += 1
            continue
        (chosen, _), (rejected, _) = sides["chosen"], sides["rejected"]
        if np.array_equal(chosen[0], rejected[0]) and np.array_equal(chosen[1], rejected[1]):
            identical += 1
            continue
        truncated += any(cut for _, cut in sides.values())
        examples.append({key: example for key, (example, _) in sides.items()})
    both = [side for example in examples for side in example.values()]
    return examples, {**example_counts(both, truncated, dropped), "examples": len(examples),
                      "identical": identical}


def split_examples(examples, val_fraction, seed) -> tuple:
    """-> (train, val), val a seeded random val_fraction of the examples (at least one if > 0)."""
    if not 0 <= val_fraction < 1:
        raise data.DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = max(1, int(len(examples) * val_fraction)) if val_fraction else 0
    if not examples or n_val >= len(examples):
        raise data.DataError(f"{len(examples)} example(s) are too few to split off a validation fraction of "
                             f"{val_fraction}")
    is_val = np.zeros(len(examples), dtype=bool)
    is_val[np.random.default_rng(seed).permutation(len(examples))[:n_val]] = True
    return [e for e, v in zip(examples, is_val) if not v], [e for e, v in zip(examples, is_val) if v]


def split_and_report(what: str, n_read: int, examples, counts, args, mesh):
    """Train/val split of tokenized examples, with the length rule's counts printed once."""
    if not examples:
        raise data.DataError(f"{args.data}: no usable {what} (all dropped: {counts})")
    train_ex, val_ex = split_examples(examples, args.val_fraction, args.seed)
    if mesh.rank == 0:
        same = (f", {counts['identical']:,} dropped as the same on both sides once cut"
                if counts.get("identical") else "")  # (preference pairs)
        print(f"{args.data}: {n_read:,} {what}s -> {counts['examples']:,} examples ({counts['truncated']:,} "
              f"truncated to {args.seq_len + 1} tokens keeping their first targets, {counts['dropped']:,} "
              f"dropped with no target left{same}), {counts['target_tokens']:,} target tokens; "
              f"{len(train_ex):,} train / {len(val_ex):,} val", flush=True)
    return train_ex, val_ex


def pack_rows(examples, seq_len, pad_id, pack) -> tuple:
    """(ids, mask) examples -> inputs, targets, doc_ids arrays of shape (rows, seq_len), int32. A
    row holds seq_len + 1 tokens: whole examples in the order given (as many as fit when packing,
    else one), then padding. doc_ids number a row's examples 0, 1, ... and the padding next. Targets
    follow the mask; BOS is never learned, so none crosses from one example into the next."""
    rows, row, used = [], [], 0
    for ids, mask in examples:
        if len(ids) > seq_len + 1:
            raise data.DataError(f"an example of {len(ids):,} tokens does not fit seq_len + 1 = "
                                 f"{seq_len + 1:,}; "
                            f"make the examples with sft_examples / preference_examples and the same seq_len")
        if row and (not pack or used + len(ids) > seq_len + 1):
            rows.append(row)
            row, used = [], 0
        row.append((ids, mask))
        used += len(ids)
    rows += [row] if row else []
    ids = np.full((len(rows), seq_len + 1), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), seq_len + 1), dtype=bool)
    doc = np.empty((len(rows), seq_len + 1), dtype=np.int32)
    for r, row in enumerate(rows):
        start = 0
        for k, (example_ids, example_mask) in enumerate(row):
            end = start + len(example_ids)
            ids[r, start:end], mask[r, start:end], doc[r, start:end] = example_ids, example_mask, k
            start = end
        doc[r, start:] = len(row)  # the padding: a document of its own
    targets = np.where(mask[:, 1:], ids[:, 1:], data.IGNORE_INDEX).astype(np.int32)
    targets[doc[:, 1:] != doc[:, :-1]] = data.IGNORE_INDEX  # a guard for examples made elsewhere
    return ids[:, :-1], targets, doc[:, :-1]


NO_EXAMPLES = "no examples to load (all dropped? see the counts of sft_examples / preference_examples)"


def as_int64(array):
    return torch.from_numpy(array.astype(np.int64))


def rows_fingerprint(*arrays) -> str:
    """A short digest of token rows (every byte of them: fine-tuning sets fit in memory)."""
    h = hashlib.sha256()
    for array in arrays:
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:16]


class SFTLoader(data.Positions):
    """(inputs, targets, doc_ids) int64 batches of shape (batch_size, seq_len) for one dp rank.
    pack=True: the examples, in an order drawn once from the seed, fill rows greedily and are never
    split; pack=False: one example a row. doc_ids tell the model where each example begins (attend
    within it, restart positions). The rows are then fixed and read in data.Positions' order; state:
    consumed, seed, seq_len, pack. pad_id only fills row tails (never a target, its own document):
    pass data.pad_id(enc)."""

    def __init__(self, examples, batch_size, seq_len, dp_rank=0, dp_size=1, seed=0, pack=True, pad_id=0):
        order = np.random.default_rng(seed).permutation(len(examples)) if pack else range(len(examples))
        self.pack = pack
        self.inputs, self.targets, self.doc_ids = pack_rows([examples[i] for i in order], seq_len, pad_id,
                                                            pack)
        super().__init__(len(self.inputs), batch_size, seq_len, dp_rank, dp_size, seed, empty=NO_EXAMPLES)

    def next(self):
        rows, _ = self._next_items()
        return as_int64(self.inputs[rows]), as_int64(self.targets[rows]), as_int64(self.doc_ids[rows])

    def _settings(self) -> dict:
        return {**super()._settings(), "pack": self.pack}

    def fingerprint(self) -> str:
        """A digest of the rows: a checkpoint records it, and --resume refuses other data."""
        return rows_fingerprint(self.inputs, self.targets, self.doc_ids)


class PreferenceLoader(data.Positions):
    """(inputs, targets) int64 batches of shape (2B, seq_len), B = batch_size: rows 0..B-1 hold B
    pairs' chosen sides, rows B..2B-1 their rejected sides, each padded at the end. One global
    sequence is one pair; positions and state as in SFTLoader."""

    def __init__(self, examples, batch_size, seq_len, dp_rank=0, dp_size=1, seed=0, pad_id=0,
                 with_index=False, index_offset=0):
        self.chosen = pack_rows([e["chosen"] for e in examples], seq_len, pad_id, pack=False)[:2]
        self.rejected = pack_rows([e["rejected"] for e in examples], seq_len, pad_id, pack=False)[:2]
        self.with_index, self.index_offset = with_index, index_offset
        super().__init__(len(examples), batch_size, seq_len, dp_rank, dp_size, seed, empty=NO_EXAMPLES)

    def pairs(self, rows):
        """The (2B, T) inputs and targets of the given pairs (rows), chosen first."""
        inputs, targets = (np.concatenate([c[rows], r[rows]]) for c, r in zip(self.chosen, self.rejected))
        return as_int64(inputs), as_int64(targets)

    def next(self):
        """(inputs, targets), plus with with_index the (B,) pair indices + index_offset, by which
        dpo.py looks up its cached reference log-probs."""
        rows, _ = self._next_items()
        batch = self.pairs(rows)
        return (*batch, torch.from_numpy(rows + self.index_offset)) if self.with_index else batch

    def fingerprint(self) -> str:
        """As SFTLoader.fingerprint: a digest of the rows."""
        return rows_fingerprint(*self.chosen, *self.rejected)


def preference_data(a, tok, mesh, with_index: bool = False, keep=None):
    """A recipe's data (train.Pretraining.data) for preference pairs: --data read, encoded and split
    into this dp rank's training and validation PreferenceLoaders (validation's pair indices follow
    training's, for a cache by pair index), and a description. keep(pairs, examples) -> examples is
    the recipe's own filter (reward.py's: the replies' ends)."""
    pairs = read_preferences(a.data, mirror=a.mirror)
    examples, counts = preference_examples(tok, pairs, a.seq_len)
    if keep is not None:
        examples = keep(pairs, examples)
    train_ex, val_ex = split_and_report("preference pair", len(pairs), examples, counts, a, mesh)
    make = lambda ex, seed, offset: PreferenceLoader(
        ex, a.micro_batch, a.seq_len, dp_rank=mesh.dp_rank, dp_size=mesh.dp, seed=seed,
        pad_id=data.pad_id(tok), with_index=with_index, index_offset=offset)
    return make(train_ex, a.seed, 0), lambda: make(val_ex, 0, len(train_ex)), f"{len(train_ex):,} train pairs"
