"""Train sparrow-copy: a tiny Qwen3 model that copies text it has seen, for the n-gram speculation benchmark.

    python scripts/train_copy_model.py --out /tmp/sparrow-copy [--steps 300] [--layers 4] [--hidden 256]

The built-in ``sparrow-tiny`` has random weights, so its greedy output never copies from its prompt
and n-gram speculation (prompt lookup) has nothing to find. A trained LLM does copy when it rewrites,
edits or summarises its input; this script gives a tiny model that one skill on the CPU:

* every training sequence is a source chunk A (a span of framework/tiny/corpus.txt, or random
  tokens, half and half), then ``SEPARATOR`` and A again, repeated to fill the sequence; about half
  of the copies carry a few small edits (a span of 1-3 tokens replaced by 0-3 others), as code
  edits do;
* the loss is on the copies (not on edited tokens, which cannot be predicted), plus a little
  language-model loss on the first occurrence of corpus text.

Copying needs two attention layers (heads that look one or more tokens back, then an induction
head that finds where the last tokens occurred before and copies what followed). From
transformers' random initialisation that circuit forms only after a long plateau: 800 steps
(~4 minutes) left 1-3 layer models at the ~20 % accuracy of unigram guesses. So by default the
circuit is written into the weights first (``induction_init``, matching the last three tokens:
~95 % on held-out prose and random tokens before any step) and training refines it (the other
heads and layers start with zero output projections and learn to use more context). The model:
sparrow-tiny's Qwen3 layout and 4096-token BPE (``build_model_dir``), 4 layers, hidden 256, 3 heads
of 256, MLP 768, tied embeddings, rope_theta 1e6 (Qwen3's value; its slowest rotary pairs barely
turn over a few hundred positions, which the induction head needs to match tokens at any
distance): 6.6 M parameters; 300 steps take 5-10 minutes on one core (1.5-2.4 s a step, depending
on what else runs). Training runs on transformers' ``Qwen3ForCausalLM`` with plain torch and a
fixed seed, and ends with ``save_pretrained`` in bfloat16, so the directory loads in Sparrow and in
``AutoModelForCausalLM``. The last lines printed are the greedy next-token accuracy on the copies
of held-out sequences (the last 10 % of the corpus, and fresh random tokens), measured on the
saved model.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Between the source text and each copy. Starts and ends with a newline, so the byte-level BPE
# splits words at its edges the same way whether it tokenizes the pieces or the whole string.
SEPARATOR = "\n=====\n"
# Ids below this are the special tokens (sparrow.tiny.tokenizer.SPECIAL_TOKENS): never drawn.
FIRST_ORDINARY_ID = 3
LM_WEIGHT = 0.1  # weight of the language-model loss on the first occurrence of corpus text
EDIT_PROB = 0.5  # share of copies that carry edits
HELD_OUT = 0.1  # the corpus tail kept for evaluation


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="model directory to write")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=3, help="attention heads (and as many KV heads)")
    parser.add_argument("--head-dim", type=int, default=256, help="size of each head (even: rotary embeddings)")
    parser.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (AdamW, cosine decay)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", choices=("circuit", "random"), default="circuit",
                        help="circuit: start from a hand-set induction circuit (see induction_init); random: "
                             "transformers' initialisation (copying does not emerge within minutes on a CPU)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 by default: on a shared two-core machine two threads wait on "
                             "each other at every op and run 3-6x slower than one")
    parser.add_argument("--eval-seqs", type=int, default=64, help="held-out sequences of each kind")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "layers", "hidden", "heads", "head_dim", "threads", "eval_seqs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.init == "circuit" and (args.layers < 2 or args.hidden != 256 or args.head_dim != 256 or args.heads < 3):
        raise ValueError("--init circuit needs --layers >= 2, --hidden 256, --head-dim 256 and --heads >= 3 (got "
                         f"{args.layers}, {args.hidden}, {args.head_dim}, {args.heads})")
    if args.head_dim % 2:
        raise ValueError(f"--head-dim must be even (rotary embeddings), got {args.head_dim}")
    if args.seq_len < 64:
        raise ValueError(f"--seq-len must be >= 64, got {args.seq_len}")
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    return args


class CopyData:
    """Draws training and evaluation sequences: token ids, and per-position loss weights.

    ``weights[i]`` weighs the loss of predicting ``ids[i]`` from ``ids[:i]``.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, seq_len: int) -> None:
        from sparrow.tiny.tokenizer import CORPUS_PATH

        ids = tokenizer.encode(CORPUS_PATH.read_text(), add_special_tokens=False, verbose=False)
        corpus = np.array(ids, dtype=np.int64)
        cut = int(len(corpus) * (1 - HELD_OUT))
        self.train_text, self.eval_text = corpus[:cut], corpus[cut:]
        self.sep = np.array(tokenizer.encode(SEPARATOR, add_special_tokens=False), dtype=np.int64)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        # Long enough that a chunk is copied at least once in full within the sequence.
        self.max_chunk = min((seq_len - 2 * len(self.sep)) // 2, len(self.eval_text) - 1)
        self.min_chunk = min(8, self.max_chunk)

    def _chunk(self, rng: np.random.Generator, text: np.ndarray, from_text: bool) -> np.ndarray:
        length = int(rng.integers(self.min_chunk, self.max_chunk + 1))
        if from_text:
            start = int(rng.integers(0, len(text) - length))
            return text[start:start + length]
        return rng.integers(FIRST_ORDINARY_ID, self.vocab_size, length)

    def _edit(self, rng: np.random.Generator, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A copy of ``chunk`` with 1-3 span replacements; the mask is 0 on the inserted tokens."""
        ids, mask = list(chunk), [1.0] * len(chunk)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, len(ids)))
            cut = int(rng.integers(1, 4))
            new = rng.integers(FIRST_ORDINARY_ID, self.vocab_size, int(rng.integers(0, 4))).tolist()
            ids[at:at + cut] = new
            mask[at:at + cut] = [0.0] * len(new)
        return np.array(ids, dtype=np.int64), np.array(mask, dtype=np.float32)

    def sequence(self, rng: np.random.Generator, from_text: bool, train: bool) -> tuple[np.ndarray, np.ndarray]:
        chunk = self._chunk(rng, self.train_text if train else self.eval_text, from_text)
        first_weight = LM_WEIGHT if from_text and train else 0.0
        ids = [chunk, self.sep]
        # The separator after the source cannot be predicted (the chunk ends anywhere); those after
        # a copy can (the copy ends where the source did).
        weights = [np.full(len(chunk), first_weight, np.float32), np.zeros(len(self.sep), np.float32)]
        total = len(chunk) + len(self.sep)
        while total < self.seq_len:
            if train and rng.random() < EDIT_PROB:
                copy, mask = self._edit(rng, chunk)
            else:
                copy, mask = chunk, np.ones(len(chunk), np.float32)
            ids += [copy, self.sep]
            weights += [mask, np.ones(len(self.sep), np.float32)]
            total += len(copy) + len(self.sep)
            if not train:
                break  # evaluation: exactly one clean copy
        out_ids = np.concatenate(ids)[: self.seq_len]
        out_weights = np.concatenate(weights)[: self.seq_len]
        out_weights[0] = 0.0  # nothing predicts the first token
        return out_ids, out_weights

    def batch(self, rng: np.random.Generator, size: int, train: bool = True,
              from_text: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.sequence(rng, bool(rng.random() < 0.5) if from_text is None else from_text, train)
                for _ in range(size)]
        length = max(len(ids) for ids, _ in rows)
        ids = torch.zeros(size, length, dtype=torch.long)
        weights = torch.zeros(size, length)
        for row, (row_ids, row_weights) in enumerate(rows):
            ids[row, : len(row_ids)] = torch.from_numpy(row_ids)
            weights[row, : len(row_weights)] = torch.from_numpy(row_weights)
        return ids, weights


def build_untrained(args: argparse.Namespace, out: Path) -> tuple[Any, Any]:
    """Write config, tokenizer and generation config (sparrow-tiny's recipe) and return the
    transformers model, freshly initialised in float32, and the tokenizer."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from sparrow.tiny.model import build_model_dir

    sizes = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                 num_key_value_heads=args.heads, head_dim=args.head_dim,
                 intermediate_size=3 * args.hidden, tie_word_embeddings=True, rope_theta=1e6)
    # The random weights it writes are replaced by save_pretrained below; the initialisation that
    # trains is transformers' own (std 0.02), not sparrow-tiny's (scaled to keep logits spread).
    build_model_dir(out, arch="qwen3", preset="tiny", seed=args.seed, vocab_size=4096, **sizes)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(out))
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    return model, AutoTokenizer.from_pretrained(str(out))


# The residual stream of the hand-set circuit, in blocks of 64 dims: block 0 holds the token's
# code (and the constant), block b the code of the token b places back (written by layer 0).
MATCH = 3  # the induction head matches the last three tokens: two are often ambiguous in prose
CODE_DIMS = 40  # 3 x 40 code dims fit the 64 slowest rotary pairs of a 256-wide head
CONST = CODE_DIMS


def _block(back: int) -> slice:
    return slice(64 * back, 64 * back + CODE_DIMS)


CONTENT = _block(0)
# Rotary pairs the position heads use (fast-turning) and their weights: a constant query and a key
# turned back by d positions score sum_p w_p cos((i - j - d) f_p), which peaks at j = i - d and
# stays >= 0.27 of the peak below it at every other offset up to 700 (weights found by a random
# search, for rope_theta 1e6 and head_dim 256).
POSITION_PAIRS = (0, 2, 4, 6, 8, 12, 16, 20, 24, 28)
POSITION_WEIGHTS = (0.41, 0.21, 0.05, 0.04, 0.08, 0.02, 0.04, 0.04, 0.02, 0.09)


def _position_head(attn: Any, head: int, offset: int, inv_freq: torch.Tensor, src: slice, dst: slice,
                   out_scale: float) -> None:
    """Head ``head`` of ``attn`` attends ``offset`` tokens back and writes the ``src`` dims found
    there into the ``dst`` dims of the residual stream."""
    hd = attn.head_dim
    rows = slice(head * hd, (head + 1) * hd)
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        proj.weight[rows] = 0.0
    attn.o_proj.weight[:, rows] = 0.0
    for pair, weight in zip(POSITION_PAIRS, POSITION_WEIGHTS):
        angle = offset * float(inv_freq[pair])
        attn.q_proj.weight[head * hd + pair, CONST] = math.sqrt(weight)
        attn.k_proj.weight[head * hd + pair, CONST] = math.sqrt(weight) * math.cos(angle)
        attn.k_proj.weight[head * hd + pair + hd // 2, CONST] = math.sqrt(weight) * math.sin(angle)
    for i in range(src.stop - src.start):
        attn.v_proj.weight[head * hd + i, src.start + i] = 1.0
        attn.o_proj.weight[dst.start + i, head * hd + i] = out_scale


@torch.no_grad()
def induction_init(model: Any, generator: torch.Generator) -> None:
    """Write a copying circuit into the weights: layer 0 head b - 1 looks b tokens back (b = 1..3)
    and writes that token's code into block b; layer 1 head 0 is an induction head that finds the
    earlier positions whose three previous tokens best match the last three, and copies the token
    there. Every other head, MLP and layer starts with a zero output projection (trainable), so
    that it adds nothing until training gives it a use."""
    config = model.config
    hd, hidden = config.head_dim, config.hidden_size
    inv_freq = model.model.rotary_emb.inv_freq.float()
    # Embeddings (tied: the LM head too): a random unit code per token, and the constant.
    emb = model.model.embed_tokens.weight
    codes = torch.randn(emb.shape[0], CODE_DIMS, generator=generator)
    emb.zero_()
    emb[:, CONTENT] = codes / codes.norm(dim=1, keepdim=True)
    emb[:, CONST] = 1.0
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    for layer in model.model.layers:
        layer.mlp.down_proj.weight.zero_()
        layer.self_attn.o_proj.weight.zero_()
    # Layer 0: its input is an embedding, RMS sqrt(2 / hidden); the written codes get norm 1.
    rms0 = math.sqrt(2.0 / hidden)
    for back in range(1, MATCH + 1):
        _position_head(layer0.self_attn, back - 1, back, inv_freq, CONTENT, _block(back), rms0)
    layer0.self_attn.q_norm.weight.fill_(2.24)  # peak score 16 g^2 = 80 logits
    layer0.self_attn.k_norm.weight.fill_(2.24)
    # Layer 1: query = codes of blocks 0..2 (this token and the two before), key = blocks 1..3 (the
    # three before), on the slowest-turning pairs (under 1e-3 rad per position: the match holds
    # across the context).
    a1 = layer1.self_attn
    for proj in (a1.q_proj, a1.k_proj, a1.v_proj):
        proj.weight[:hd] = 0.0
    first_pair = hd // 2 - MATCH * CODE_DIMS // 2
    for n in range(MATCH * CODE_DIMS):
        pair, back, code = first_pair + n // 2, n // CODE_DIMS, n % CODE_DIMS
        dim = pair + (hd // 2 if n % 2 else 0)
        a1.q_proj.weight[dim, _block(back).start + code] = 1.0
        a1.k_proj.weight[dim, _block(back + 1).start + code] = 1.0
    a1.q_norm.weight.fill_(1.94)  # all three codes match: 60 logits; two: 40
    a1.k_norm.weight.fill_(1.94)
    rms1 = math.sqrt((MATCH + 2) / hidden)  # the code, the constant, the codes before
    alpha = 4.0  # the copied code outweighs the current token's own
    for i in range(CODE_DIMS):
        a1.v_proj.weight[i, CONTENT.start + i] = 1.0
        a1.o_proj.weight[CONTENT.start + i, i] = alpha * rms1
    for norm in (layer0.input_layernorm, layer1.input_layernorm):
        norm.weight.fill_(1.0)
    model.model.norm.weight.fill_(2.0)


def weighted_loss(model: Any, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    # The LM head and softmax over 4096 ids cost as much as the layers: run them only where the
    # loss has weight (the first occurrence of random tokens and the separators after it have none).
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    target_weights = weights[:, 1:]
    scored = target_weights > 0
    logits = model.lm_head(hidden[scored]).float()
    per_token = torch.nn.functional.cross_entropy(logits, ids[:, 1:][scored], reduction="none")
    return (per_token * target_weights[scored]).sum() / target_weights.sum().clamp(min=1.0)


@torch.no_grad()
def copy_accuracy(model: Any, ids: torch.Tensor, weights: torch.Tensor) -> float:
    """Greedy next-token accuracy over the positions with weight 1 (the copies)."""
    scored = weights[:, 1:] == 1.0
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    predictions = model.lm_head(hidden[scored]).argmax(-1)
    return float((predictions == ids[:, 1:][scored]).float().mean())


def train(model: Any, data: CopyData, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    probe_rng = np.random.default_rng(args.seed + 2)  # held-out probes, for the log only
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98))
    warmup = max(1, min(50, args.steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        ids, weights = data.batch(rng, args.batch_size)
        loss = weighted_loss(model, ids, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            model.eval()
            probe = copy_accuracy(model, *data.batch(probe_rng, 8, train=False))
            model.train()
            print(f"step {step:5d}  loss {loss.item():.3f}  copy accuracy {100 * probe:5.1f} %  "
                  f"lr {lr_at(step):.2e}  {time.perf_counter() - start:4.0f} s", flush=True)
    model.eval()


def evaluate(model: Any, data: CopyData, args: argparse.Namespace) -> dict[str, float]:
    """Copy accuracy on held-out sequences, one clean copy each: corpus tail and random tokens."""
    rng = np.random.default_rng(args.seed + 1)  # not the training stream
    return {kind: copy_accuracy(model, *data.batch(rng, args.eval_seqs, train=False, from_text=kind == "text"))
            for kind in ("text", "random")}


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    out = Path(args.out)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = build_untrained(args, out)
    data = CopyData(tokenizer, model.config.vocab_size, args.seq_len)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters / 1e6:.1f} M parameters; {args.steps} steps of {args.batch_size} x {args.seq_len} tokens",
          flush=True)
    if args.init == "circuit":
        induction_init(model, torch.Generator().manual_seed(args.seed))
        before = evaluate(model, data, args)
        print("copy accuracy of the hand-set circuit: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in before.items()),
              flush=True)
    train(model, data, args)
    # save_pretrained would write a generation config derived from config.json (one EOS id);
    # keep the recipe's (EOS and pad both stop).
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(str(out))
    model.to(torch.bfloat16).save_pretrained(str(out))
    # Evaluate what was written, through the loader everyone else uses.
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    accuracy = evaluate(saved, data, args)
    for kind, value in accuracy.items():
        print(f"held-out copy accuracy ({kind}): {100 * value:.1f} %", flush=True)
    print(f"wrote {out}")
    return accuracy


if __name__ == "__main__":
    main()
