"""Supervised fine-tuning (SFT): turn a pretrained next-token predictor into an assistant.

    python sft.py --init out --data alpaca_5000                        # from a train.py checkpoint
    torchrun --nproc_per_node=8 sft.py --init Llama-3.2-1B --tokenizer llama3 --tp 2   # from HF weights
    python sft.py --init out --lora-rank 16                            # LoRA: the model frozen, adapters

The same training loop as train.py (its seven phases, flags, parallel layouts, checkpoints and --resume);
only its recipe differs (the SFT class):
  - the model: loaded from --init (a train.py/sft.py checkpoint folder, a Hugging Face folder, or a Meta
    folder); a tokenizer with more ids than the model grows its embedding and output rows;
  - the data: conversations in the Llama 3 chat format (data.py), whose targets are the assistant's tokens
    and their <|eot_id|> only (everything else is IGNORE_INDEX), packed several to a sequence with
    attention and positions that never cross from one example into another (--no-pack: one per row);
  - nothing else: the loss is the same sum of token cross-entropies over the global count of target tokens,
    so train and validation losses are the mean loss on response tokens.
With --lora-rank (here and in dpo.py, reward.py, rl.py) the model stays frozen and only LoRA's low-rank
updates train (model.add_lora); the checkpoints hold them alone, and read as a model they are merged in.
At the end it answers --sample-prompt in chat mode.
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np
import torch

import checkpoint as C
import config
import data
import model as M
import train as T


def get_parser() -> argparse.ArgumentParser:
    p = config.get_parser()
    p.description = "Supervised fine-tuning on conversations (targets: the assistant's tokens)."
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--init", default=None,
                   help="start from: a train.py/sft.py --out-dir or step folder, a Hugging Face folder "
                        "(config.json + *.safetensors) or a Meta folder (params.json + consolidated.*.pth)")
    g.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="pack several examples per sequence (attention never crosses examples)")
    g.add_argument("--val-fraction", type=float, default=0.05, help="share of conversations held out")
    g.add_argument("--sample-prompt", default="Give three tips for staying healthy.",
                   help="a user message answered in chat mode at the end ('' to skip)")
    p.set_defaults(tokenizer=None, data="alpaca_5000", out_dir="out-sft", lr=3e-4, warmup=20, max_steps=300,
                   eval_every=100, eval_batches=20, ckpt_every=300, log_every=20, seq_len=256, micro_batch=8)
    return p


# ----------------------------------------------------------------------------------------------------
# The model to start from


# ----------------------------------------------------------------------------------------------------
# The data: conversations in the Llama 3 chat format (data.encode_chat), whose targets are what the
# assistant says. A row of seq_len + 1 tokens gives seq_len (input, target) pairs, as in data.Loader; a
# target that is not learned is IGNORE_INDEX, which cross_entropy skips. dpo.py reuses the length rule,
# the split and the rows.


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
        # a Self-Instruct seed task: the instruction with its first instance's input, answered by its output
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
    data.check_messages(messages)
    return messages


def read_sft(path_or_name, mirror=None) -> list:
    """A registered name (data.SFT_DATASETS) or a JSON array / JSONL file -> a list of conversations."""
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


def fit_example(ids, mask, seq_len):
    """The length rule: keep the first seq_len + 1 tokens if a learned token is among them, else drop
    (None)."""
    ids, mask = np.asarray(ids, dtype=np.int32)[:seq_len + 1], np.asarray(mask, dtype=bool)[:seq_len + 1]
    return (ids, mask) if mask.any() else None


def example_counts(kept, truncated, dropped) -> dict:
    return {"examples": len(kept), "truncated": truncated, "dropped": dropped,
            "tokens": sum(len(ids) for ids, _ in kept), "target_tokens": sum(int(mask.sum()) for _,
                                                                             mask in kept)}


def sft_examples(enc, conversations, seq_len) -> tuple:
    """Conversations -> ([(ids int32, mask bool)], counts). An example longer than seq_len + 1 tokens keeps
    its first seq_len + 1 if a learned token survives; it is dropped if none does, or if it has no assistant
    message at all. counts: {"examples", "truncated", "dropped", "tokens", "target_tokens"}."""
    examples, truncated, dropped = [], 0, 0
    for conversation in conversations:
        ids, mask = data.encode_chat(enc, conversation)
        example = fit_example(ids, mask, seq_len)
        if example is None:
            dropped += 1
            continue
        truncated += len(ids) > seq_len + 1
        examples.append(example)
    return examples, example_counts(examples, truncated, dropped)


def split_examples(examples, val_fraction, seed) -> tuple:
    """-> (train, val): a seeded random val_fraction of the examples validates (at least one if > 0)."""
    if not 0 <= val_fraction < 1:
        raise data.DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = max(1, int(len(examples) * val_fraction)) if val_fraction else 0
    if not examples or n_val >= len(examples):
        raise data.DataError(f"{len(examples)} example(s) are too few to split off a validation fraction of "
                             f"{val_fraction}")
    is_val = np.zeros(len(examples), dtype=bool)
    is_val[np.random.default_rng(seed).permutation(len(examples))[:n_val]] = True
    return [e for e, v in zip(examples, is_val) if not v], [e for e, v in zip(examples, is_val) if v]


def pack_rows(examples, seq_len, pad_id, pack) -> tuple:
    """(ids, mask) examples -> inputs, targets, doc_ids arrays of shape (rows, seq_len), int32.

    Each row holds seq_len + 1 tokens: whole examples one after another (all of them that fit, in the order
    given, when packing; one otherwise), then padding. doc_ids number the examples of a row 0, 1, ... and give
    the padding the next number. A target is the next token where that token is learned, else
    data.IGNORE_INDEX;
    BOS is never learned, so no target crosses from one example into the next.
    """
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
    targets[doc[:, 1:] != doc[:, :-1]] = data.IGNORE_INDEX  # true already; kept for examples made elsewhere
    return ids[:, :-1], targets, doc[:, :-1]


NO_EXAMPLES = "no examples to load (all dropped? see the counts of sft_examples / preference_examples)"


def as_int64(array):
    return torch.from_numpy(array.astype(np.int64))


class SFTLoader(data.Positions):
    """(inputs, targets, doc_ids) int64 batches of shape (batch_size, seq_len) for one data-parallel rank.

    pack=True: the examples, in an order drawn once from the seed, fill rows of seq_len + 1 tokens greedily;
    an example that does not fit the current row starts the next, so none is ever split. pack=False: one
    example per row. doc_ids tell the model where each example begins (attend within it, restart positions).
    The list of rows is then fixed, and batches follow the Loader's scheme; state: consumed, seed, seq_len,
    pack.
    pad_id only fills the tails of rows (never a target, its own document): pass pad_id(enc).
    """

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
        """What identifies the data (a checkpoint records it; --resume refuses other data): its rows."""
        return rows_fingerprint(self.inputs, self.targets, self.doc_ids)


def rows_fingerprint(*arrays) -> str:
    """A short digest of token rows (every byte of them: fine-tuning sets fit in memory)."""
    h = hashlib.sha256()
    for array in arrays:
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:16]


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


# ----------------------------------------------------------------------------------------------------
# The recipe: train.py's loop with this model and this data


class SFT(T.Pretraining):
    """train.py's recipe with the model from --init and conversations as the data."""

    kind = "sft"
    chat = True
    unused_flags = {"ramp": "--ramp stages pretraining's token stream; fine-tuning reads whole examples",
                    "doc_mask": "fine-tuning gives each example of a row its own document always",
                    "anneal_data": "fine-tuning reads one dataset, --data (--anneal-tokens alone anneals the "
                                   "learning rate)"}
    scoring_init = False  # whether --init may be a reward model (reward.py's recipe: it starts from either)

    def masked_attention(self) -> str | None:
        return "fine-tuning keeps it within each example of a row"

    def tokenizer(self):
        """The one --init was trained with (--tokenizer may only repeat it); without --init, byte."""
        if self.args.init is None:
            self.tok = data.get_tokenizer(self.args.tokenizer or "byte", self.args.mirror)
        else:
            self.tok = C.tokenizer_for(self.args.init, self.args.tokenizer, self.args.mirror, grows=True)
        return self.tok

    def name(self) -> str:
        return self.args.init or self.args.model

    def model_args(self, tok) -> M.ModelArgs:
        """The shape at once; the weights (below) once the job's processes can talk. From a checkpoint the
        shape comes from meta.json alone, and no shard is opened until the job's ranks have checked them
        against the manifest, each a share of the files (one rank hashing a 405B checkpoint would take
        hours); each rank then reads only the weights it keeps, lazily."""
        args, self.state = self.args, None
        if args.init is None:
            print("no --init: fine-tuning a randomly initialized --model (useful for tests only)", flush=True)
            return super().model_args(tok)
        if not self.scoring_init:
            C.check_head(args.init, "--init")
        rows = C.recorded(args.init).get("vocab_size")
        if config.lora_of(args) and rows and tok.n_vocab > rows:
            raise config.ConfigError(f"--lora-rank: the tokenizer {tok.name} has {tok.n_vocab:,} ids, --init "
                                     f"{args.init} {rows:,} rows; LoRA keeps the embedding and the head "
                                     "frozen, so the rows added for them could never learn: fine-tune without "
                                     "LoRA")
        if not C.is_checkpoint(args.init):  # a Hugging Face or Meta folder: no manifest to check
            margs, self.state = C.load_init(args.init, tok)
            self.init_folder = args.init
            return config.init_model_args(args, margs)
        # rank 0 says what it skips, later
        self.picked = C.resolve(args.init, say=lambda msg: None, verify=False)
        try:
            self.margs = C.with_room_for(C.checkpoint_args(self.picked), tok.n_vocab)
        except ValueError as e:
            raise config.ConfigError(f"cannot read --init {self.picked}: {type(e).__name__}: "
                                     f"{data.one_line(e)}") from None
        return config.init_model_args(args, self.margs)

    def weights(self, mesh) -> dict | None:
        if self.args.init is None or not C.is_checkpoint(self.args.init):
            return self.state
        # every rank checks a share of the shards; may fall back past a damaged step
        verified = C.resolve(self.args.init, say=config.say, check=C.shared_check(mesh))
        verified_margs, state = C.load_init(verified, self.tok, verify=False)
        self.init_folder = verified  # (a LoRA run's checkpoints name this step, not an out-dir that grows)
        if verified_margs != self.margs:
            raise config.ConfigError(f"--init {self.args.init}: the intact checkpoint {verified.name} has "
                                     f"another model shape than {self.picked.name}; name the step folder to "
                                     "start from")
        return state

    def data(self, tok, mesh):
        args = self.args
        conversations = read_sft(args.data, mirror=args.mirror)
        examples, counts = sft_examples(tok, conversations, args.seq_len)
        train_ex, val_ex = split_and_report("conversation", len(conversations), examples, counts, args, mesh)
        make = lambda ex, seed: SFTLoader(ex, args.micro_batch, args.seq_len, dp_rank=mesh.dp_rank,
                                               dp_size=mesh.dp, seed=seed, pack=args.pack,
                                               pad_id=data.pad_id(tok))
        train = make(train_ex, args.seed)
        if val_ex:  # (none with --val-fraction 0, which turns validation off)
            make(val_ex, 0)  # fail now, not at the first evaluation
        return train, lambda: make(val_ex,
                                   0), f"{len(train):,} {'packed' if args.pack else 'padded'} train rows"


# ----------------------------------------------------------------------------------------------------
# Chatting with the result


@torch.no_grad()
def chat(model, tok, messages: list[dict], max_new_tokens: int = 200, temperature: float = 0.7,
         top_p: float | None = 0.9, seed: int = 0) -> str:
    """The assistant's reply to a conversation: the chat template with the generation prompt, then
    sampling until <|eot_id|>."""
    ids, _ = data.encode_chat(tok, messages, add_generation_prompt=True)
    room = model.args.max_seq_len - len(ids)
    device = model.tok_embeddings.weight.device
    g = torch.Generator(device=device).manual_seed(seed)
    new = M.generate(model, ids, min(max_new_tokens, room), temperature=temperature, top_p=top_p,
                     eos_id=data.eot_id(tok), generator=g, n_vocab=tok.n_vocab)[0].tolist()
    if data.eot_id(tok) in new:
        new = new[:new.index(data.eot_id(tok))]
    return tok.decode(new)


def post_train(args, recipe_of) -> T.Run:
    """The entry of sft.py and dpo.py: the process set up, the training loop run with the recipe
    recipe_of(args) makes, then the answer to --sample-prompt (rank 0 prints it)."""
    config.configure_process(args)
    run = T.train(args, recipe_of(args))
    if args.sample_prompt and T.samples_here(run):
        reply = chat(run.model, run.tok, [{"role": "user", "content": args.sample_prompt}], seed=args.seed)
        if run.mesh.rank == 0:
            print(f"user: {args.sample_prompt}\nassistant: {reply}", flush=True)
    if run.mesh.world > 1:
        torch.distributed.destroy_process_group()
    return run


def main(argv=None):
    post_train(get_parser().parse_args(argv), SFT)


if __name__ == "__main__":
    config.run(main)
