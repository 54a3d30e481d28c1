"""Train a tiny Qwen2-VL from scratch on CPU on the synthetic visual-QA task (DESIGN §6).

The model is the real ``Qwen2VLForConditionalGeneration`` architecture (so SGLang serves the
checkpoint), trained with transformers on endless fresh items of the ``train`` split. Inputs come
from the Qwen2-VL processor and the chat template (user turn: image, then question; assistant
turn: the answer); the loss covers only the answer tokens and the closing ``<|im_end|>``. An
auxiliary per-cell classification loss on the merged vision features (colour and shape of the
cell each merged token covers, background included) makes the vision side learn fast; its heads
are dropped at save time.

Validation accuracy is greedy exact match, computed in one teacher-forced pass: greedy decoding
reproduces the answer and stops iff at every answer position the argmax is the next answer token
(``<|im_end|>`` last). The saved checkpoint has the layout ``build_tiny_qwen2_vl`` writes.

    python -m benchmarks.quality.train_tiny_vlm --out runs/tiny-vqa-qwen2-vl --steps 3000

``--task grid`` trains on the second task (positional and background questions, see
:mod:`benchmarks.quality.vqa_data`); there the auxiliary loss also classifies each merged
token's row and column (``--aux-position``), so the vision side reads the coordinate shading.
``--attn-weight`` adds attention supervision: at the question's last number word (the row of a
row question, the column of a cell question; ``--attn-query``), heads ``--attn-heads`` of layer
``--attn-layer`` are pulled towards a uniform spread over the cells the question is about
(``VQAItem.region``: its row, or its cell). Without it the LM did not find the asked row in
1,500 steps (validation stayed at the answer prior; supervising the answer position instead
stayed at a uniform spread over the image); it teaches where to look, not what is there. With
the number word supervised the LM still did not carry what that word had gathered to the answer
(1,500 steps at the prior), so ``--relay-layer`` supervises that hop too.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.quality.hf_reference import hf_answers
from benchmarks.quality.vqa_data import (
    COLOURS,
    NUMBERS,
    SHAPES,
    TASKS,
    VOCAB_WORDS,
    VQAItem,
    default_qtypes,
    iter_items,
    make_split,
)
from tests.support.tiny_vlm import (
    CHAT_TEMPLATE,
    build_config,
    build_tokenizer,
    save_checkpoint,
)

VOCAB_SIZE = 1024  # BPE budget: every dataset word becomes one token


def build_processor(tokenizer, image_size: int):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    pixels = image_size * image_size
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=pixels),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=pixels),
        chat_template=CHAT_TEMPLATE,
    )


def prompt_text(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": question}]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode(processor, items: list[VQAItem]) -> dict:
    """Processor inputs for prompt + answer + ``<|im_end|>``, right-padded, with ``labels``
    (-100 except the answer tokens and the closing ``<|im_end|>``)."""
    return encode_conversations(processor, [[it] for it in items])


def conversation_text(tokenizer, items: list[VQAItem]) -> str:
    """One chat about one image: the first user turn holds the image and ``items[0]``'s question,
    each later turn one more question; every assistant turn is closed by ``<|im_end|>``."""
    text = ""
    for k, it in enumerate(items):
        content = [{"type": "text", "text": it.question}]
        if k == 0:
            content.insert(0, {"type": "image"})
        turn = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)
        text += ("\n" if k else "") + turn + it.answer + tokenizer.eos_token
    return text


def encode_conversations(processor, chats: list[list[VQAItem]], attn_query: str = "answer",
                         number_ids: frozenset[int] = frozenset(), relay: bool = False) -> dict:
    """Processor inputs for one conversation per image (see :func:`conversation_text`),
    right-padded, with ``labels`` on every answer and its closing ``<|im_end|>`` (-100 elsewhere).
    A batch of one-question chats is exactly the single-turn serving prompt plus its answer.

    ``attn_targets`` lists, for each question with a ``region``, the sequence, the query position
    of the attention supervision, the image positions of the region and the target group 0: the
    query is the position predicting the answer's first token (``attn_query="answer"``) or the
    question's last number word (``"number"``: the row of a row question, the column of a cell
    question; ``number_ids`` are their token ids). With ``relay`` (and ``"number"``) a group-1
    target joins each: the position predicting the answer's first token attends to that number
    word."""
    tok = processor.tokenizer
    tok.padding_side = "right"
    texts = [conversation_text(tok, chat) for chat in chats]
    batch = processor(text=texts, images=[chat[0].image for chat in chats], padding=True,
                      return_tensors="pt")
    ids = batch["input_ids"]
    labels = torch.full_like(ids, -100)
    marker = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    image_token = tok.convert_tokens_to_ids("<|image_pad|>")
    # (sequence, query position, key positions, target group): see the docstring
    attn_targets: list[tuple[int, int, list[int], int]] = []
    for b, chat in enumerate(chats):
        row = ids[b].tolist()
        image_pos = [i for i, t in enumerate(row) if t == image_token]
        starts = [i + len(marker) for i in range(len(row) - len(marker) + 1)
                  if row[i:i + len(marker)] == marker]
        if len(starts) != len(chat):
            raise ValueError(f"{len(starts)} assistant turns found for {len(chat)} questions")
        for start, it in zip(starts, chat, strict=True):
            answer_ids = tok(it.answer + tok.eos_token, add_special_tokens=False)["input_ids"]
            got = row[start:start + len(answer_ids)]
            if got != answer_ids:  # the answer must tokenize the same in context and alone
                raise ValueError(f"answer tokenization differs in context: {got} vs {answer_ids}")
            labels[b, start:start + len(answer_ids)] = ids[b, start:start + len(answer_ids)]
            if it.region and len(image_pos) == it.scene.grid ** 2:
                query = start - 1
                if attn_query == "number":
                    query = next(i for i in range(start - 1, -1, -1) if row[i] in number_ids)
                    if relay:
                        attn_targets.append((b, start - 1, [query], 1))
                attn_targets.append((b, query, [image_pos[k] for k in it.region], 0))
    batch["labels"] = labels
    batch["attn_targets"] = attn_targets
    return dict(batch)


def next_chats(stream, batch: int, questions: int) -> list[list[VQAItem]]:
    """``batch`` conversations of up to ``questions`` turns, each about one fresh image."""
    chats: list[list[VQAItem]] = []
    current: list[VQAItem] = []
    while len(chats) < batch:
        item = next(stream)
        if current and item.image_id != current[0].image_id:
            chats.append(current)
            current = []
        current.append(item)
        if len(current) == questions:
            chats.append(current)
            current = []
    return chats


class AuxHeads(torch.nn.Module):
    """Per-merged-token colour and shape classifiers (class 0 = background).

    With ``embeddings`` (the LM's input embedding and the token ids of the colour / shape words
    as questions spell them), the object classes score a cell's feature against those word
    embeddings, so a cell holding a red circle is pulled towards ``" red"`` and ``" circle"``
    in the LM's own input space: question words then find their cell by a plain key match and
    attention copies a word-like value (the text-recall circuit a small LM learns fast). Without
    it the heads are free linear classifiers.
    """

    def __init__(self, hidden: int, embeddings: tuple | None = None, positions: int = 0,
                 row_ids: torch.Tensor | None = None):
        super().__init__()
        self.tied = embeddings
        # Row and column of each merged token (grid task: ``positions`` = grid). With ``row_ids``
        # (and tied embeddings) the row classes are the LM's embeddings of the row-number words
        # (" one" for the top row), so "row three" finds its cells by the same word match as
        # colours; the column classifier stays free (tying it to the same number words would
        # make cell (3, 5) look like (5, 3)).
        self.positions = positions
        self.row_ids = row_ids if embeddings is not None else None
        if positions:
            if self.row_ids is None:
                self.row = torch.nn.Linear(hidden, positions)
            else:
                self.row_bias = torch.nn.Parameter(torch.zeros(positions))
            self.col = torch.nn.Linear(hidden, positions)
        if embeddings is None:
            self.colour = torch.nn.Linear(hidden, 1 + len(COLOURS))
            self.shape = torch.nn.Linear(hidden, 1 + len(SHAPES))
        else:
            self.background = torch.nn.Parameter(torch.zeros(2, hidden))
            self.bias = torch.nn.Parameter(torch.zeros(2))

    def logits(self, which: int, feats: torch.Tensor) -> torch.Tensor:
        if self.tied is None:
            return (self.colour, self.shape)[which](feats)
        embed, ids = self.tied[0], self.tied[1 + which]
        classes = torch.cat([self.background[which:which + 1], embed.weight[ids]])
        return feats @ classes.T + self.bias[which]

    def loss(self, feats: torch.Tensor, items: list[VQAItem]) -> tuple[torch.Tensor, float]:
        colour = torch.cat([torch.from_numpy(it.scene.cell_targets()[0]) for it in items])
        shape = torch.cat([torch.from_numpy(it.scene.cell_targets()[1]) for it in items])
        if feats.shape[0] != colour.shape[0]:
            raise ValueError(f"{feats.shape[0]} merged tokens for {colour.shape[0]} cells")
        obj = colour > 0
        total = feats.new_zeros(())
        for which, target in ((0, colour), (1, shape)):
            ce = F.cross_entropy(self.logits(which, feats), target, reduction="none")
            # Balanced: background and object cells weigh the same (objects are ~2% of cells).
            total = total + ce[~obj].mean() + (ce[obj].mean() if obj.any() else 0.0)
        if self.positions:
            g = self.positions
            cells = torch.arange(g * g).repeat(len(items))
            if self.row_ids is None:
                row_logits = self.row(feats)
            else:
                row_logits = feats @ self.tied[0].weight[self.row_ids].T + self.row_bias
            total = total + F.cross_entropy(row_logits, cells // g) \
                + F.cross_entropy(self.col(feats), cells % g)
        with torch.no_grad():
            pred = self.logits(0, feats).argmax(-1)
            obj_acc = (pred[obj] == colour[obj]).float().mean().item() if obj.any() else 1.0
        return total, obj_acc


def word_ids(tokenizer, words) -> torch.Tensor:
    """Token ids of ``words`` as they appear inside a question (after a space), one token each."""
    ids = [tokenizer(" " + w, add_special_tokens=False)["input_ids"] for w in words]
    if any(len(i) != 1 for i in ids):
        spelled = dict(zip(words, ids, strict=True))
        raise ValueError(f"dataset words must be one token each: {spelled}")
    return torch.tensor([i[0] for i in ids])


def forward(model, batch: dict, capture: dict,
            attn: list[tuple[int, list[int]]] | None = None):
    """LM loss, logits, labels and the merged vision features; with ``attn`` ((layer, heads) per
    target group) and a batch that has ``attn_targets``, also the attention-supervision loss
    (else 0): the mean over targets and heads of the cross-entropy between a uniform spread over
    the target keys and the head's attention from the target position."""
    supervise = attn is not None and bool(batch.get("attn_targets"))
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                mm_token_type_ids=batch["mm_token_type_ids"], use_cache=False,
                output_attentions=supervise)
    logits = out.logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100)
    attn_loss = torch.zeros(())
    if supervise:
        terms = []
        for b, q, keys, group in batch["attn_targets"]:
            if group >= len(attn):
                continue
            layer, heads = attn[group]
            weights = out.attentions[layer][b, heads, q]  # (heads, key)
            terms.append(-torch.log(weights[:, keys].float() + 1e-6).mean())
        attn_loss = torch.stack(terms).mean()
    capture["attn_loss"] = attn_loss
    return loss, logits, labels, capture.pop("vision")


@torch.no_grad()
def evaluate(model, processor, items: list[VQAItem], batch_size: int, capture: dict) -> dict:
    """Greedy exact-match accuracy (teacher-forced, see the module doc), overall and per qtype."""
    model.eval()
    right: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        batch = encode(processor, chunk)
        _, logits, labels, _ = forward(model, batch, capture)
        mask = labels != -100
        ok = ((logits.argmax(-1) == labels) | ~mask).all(-1)
        for it, good in zip(chunk, ok.tolist(), strict=True):
            total[it.qtype] += 1
            right[it.qtype] += int(good)
    model.train()
    acc = {q: right[q] / total[q] for q in sorted(total)}
    acc["overall"] = sum(right.values()) / max(1, sum(total.values()))
    return acc


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=8, help="conversations (images) per step")
    p.add_argument("--turns", type=int, default=1,
                   help="questions per training conversation (one image, one answer per turn)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="model init and data seed")
    p.add_argument("--grid", type=int, default=16, help="cells per side (image = grid*28 px)")
    p.add_argument("--task", choices=TASKS, default="vqa",
                   help="vqa: the bundled task; grid: positional / background questions")
    p.add_argument("--qtypes", default="",
                   help="question types of validation (and of training, unless "
                        "--train-qtypes); default: the task's")
    p.add_argument("--train-qtypes", default="",
                   help="question types drawn for training; a type listed k times is drawn k "
                        "times as often (weights the types the model still gets wrong)")
    p.add_argument("--data-start", type=int, default=0,
                   help="first training image index (a continued run starts past the images "
                        "its --init checkpoint saw)")
    p.add_argument("--init", default="",
                   help="start from this checkpoint's weights (same architecture) instead of "
                        "a random init; the model flags are then taken from it")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-images", type=int, default=50, help="validation images")
    p.add_argument("--eval-questions", type=int, default=4, help="questions per val image")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vision-dim", type=int, default=64)
    p.add_argument("--vision-depth", type=int, default=3)
    p.add_argument("--vision-heads", type=int, default=2)
    p.add_argument("--aux-weight", type=float, default=1.0, help="0 disables the per-cell loss")
    p.add_argument("--aux-tied", action=argparse.BooleanOptionalAction, default=True,
                   help="score cells against the LM's word embeddings (see AuxHeads)")
    p.add_argument("--aux-position", action=argparse.BooleanOptionalAction, default=None,
                   help="also classify each merged token's row and column (default: on for "
                        "--task grid)")
    p.add_argument("--aux-row-tied", action=argparse.BooleanOptionalAction, default=True,
                   help="with --aux-position and --aux-tied: score rows against the row-number "
                        "words' embeddings (see AuxHeads)")
    p.add_argument("--attn-weight", type=float, default=0.0,
                   help="weight of the attention supervision (0: off; see the module doc)")
    p.add_argument("--attn-layer", type=int, default=1, help="supervised layer (0-based)")
    p.add_argument("--attn-query", choices=("number", "answer"), default="number",
                   help="supervised query position: the question's last number word (row or "
                        "column) or the position predicting the answer's first token")
    p.add_argument("--attn-heads", default="0", help="supervised heads of that layer")
    p.add_argument("--relay-layer", type=int, default=-1,
                   help="with --attn-query number: also supervise this layer's --relay-heads "
                        "at the position predicting the answer to attend to that number word "
                        "(-1: off)")
    p.add_argument("--relay-heads", default="0")
    p.add_argument("--save-dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--check", type=int, default=3,
                   help="after saving, reload the checkpoint and answer this many val items")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.qtypes:
        args.qtypes = ",".join(default_qtypes(args.task))
    if args.aux_position is None:
        args.aux_position = args.task == "grid"
    qtypes = tuple(dict.fromkeys(q for q in args.qtypes.split(",") if q))
    train_qtypes = tuple(q for q in (args.train_qtypes or args.qtypes).split(",") if q)
    image_size = args.grid * 28
    save_dtype = torch.bfloat16 if args.save_dtype == "bf16" else torch.float32

    tokenizer = build_tokenizer(VOCAB_SIZE, extra_words=VOCAB_WORDS)
    processor = build_processor(tokenizer, image_size)
    config = build_config(tokenizer, hidden=args.hidden, layers=args.layers,
                          vision_dim=args.vision_dim, heads=args.heads, kv_heads=args.kv_heads,
                          vision_depth=args.vision_depth, vision_heads=args.vision_heads)
    from transformers import Qwen2VLForConditionalGeneration

    # Attention supervision reads the attention weights: the eager implementation returns them.
    attn_kwargs = {"attn_implementation": "eager"} if args.attn_weight > 0 else {}
    if args.init:
        model = Qwen2VLForConditionalGeneration.from_pretrained(args.init, dtype=torch.float32,
                                                                **attn_kwargs)
        for sub in (model.config.text_config, model.config.vision_config):
            sub.dtype = save_dtype  # as saved (loading in fp32 would record float32 here)
        text = model.config.text_config
        args.hidden, args.layers = text.hidden_size, text.num_hidden_layers
        args.heads, args.kv_heads = text.num_attention_heads, text.num_key_value_heads
        args.vision_dim = model.config.vision_config.embed_dim
        args.vision_depth = model.config.vision_config.depth
        args.vision_heads = model.config.vision_config.num_heads
    else:
        if attn_kwargs:
            config._attn_implementation = "eager"
        model = Qwen2VLForConditionalGeneration(config)
    model.train()
    attn = None
    number_ids = frozenset(word_ids(tokenizer, NUMBERS[1:]).tolist())
    if args.attn_weight > 0:
        attn = [(args.attn_layer, [int(h) for h in args.attn_heads.split(",") if h])]
        if args.relay_layer >= 0 and args.attn_query == "number":
            attn.append((args.relay_layer, [int(h) for h in args.relay_heads.split(",") if h]))
    tied = None
    if args.aux_tied:
        tied = (model.get_input_embeddings(), word_ids(tokenizer, list(COLOURS)),
                word_ids(tokenizer, SHAPES))
    row_ids = None
    if args.aux_position and args.aux_row_tied:
        row_ids = word_ids(tokenizer, [NUMBERS[r + 1] for r in range(args.grid)])
    aux = AuxHeads(args.hidden, tied, positions=args.grid if args.aux_position else 0,
                   row_ids=row_ids)
    capture: dict = {}
    model.model.visual.register_forward_hook(
        lambda _m, _i, o: capture.__setitem__("vision", o.pooler_output))
    params = list(dict.fromkeys([*model.parameters(), *aux.parameters()]))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                            betas=(0.9, 0.98))

    train = iter_items("train", args.seed, start=args.data_start, grid=args.grid,
                       questions_per_image=args.turns, qtypes=train_qtypes, task=args.task)
    val = make_split("validation", args.eval_images, args.eval_questions, seed=args.seed,
                     grid=args.grid, qtypes=qtypes, task=args.task)
    log_path = out / "training_log.jsonl"
    log = log_path.open("w")
    print(f"params {n_params / 1e6:.2f} M, image {image_size} px = {args.grid ** 2} tokens, "
          f"task {args.task}, qtypes {','.join(qtypes)}, {len(val)} validation items, "
          f"threads {torch.get_num_threads()}", flush=True)

    t0 = time.time()
    window: list[float] = []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        chats = next_chats(train, args.batch, args.turns)
        items = [chat[0] for chat in chats]  # one scene per sequence (the auxiliary targets)
        batch = encode_conversations(processor, chats, args.attn_query, number_ids,
                                     relay=attn is not None and len(attn) > 1)
        loss, _, _, feats = forward(model, batch, capture, attn)
        total = loss + args.attn_weight * capture["attn_loss"]
        aux_loss, cell_acc = torch.zeros(()), float("nan")
        if args.aux_weight > 0:
            aux_loss, cell_acc = aux.loss(feats, items)
            total = total + args.aux_weight * aux_loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        window.append(loss.item())
        done = step + 1
        if done % args.log_every == 0 or done == 1 or done == args.steps:
            elapsed = time.time() - t0
            rec = {"step": done, "loss": sum(window) / len(window), "aux": aux_loss.item(),
                   "attn": capture["attn_loss"].item(),
                   "cell_colour_acc": cell_acc, "lr": lr_at(step, args),
                   "s_per_step": elapsed / done, "elapsed_s": elapsed}
            window.clear()
            print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v
                              for k, v in rec.items()}), flush=True)
            log.write(json.dumps(rec) + "\n")
        if done % args.eval_every == 0 or done == args.steps:
            acc = evaluate(model, processor, val, args.batch, capture)
            rec = {"step": done, "val": acc}
            print(json.dumps({"step": done, "val": {k: round(v, 3) for k, v in acc.items()}}),
                  flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            # A servable snapshot at every evaluation: a long run cut short still leaves one.
            snapshot = copy.deepcopy(model).eval().to(save_dtype)
            save_checkpoint(snapshot, tokenizer, out, image_size=image_size)
            model.train()
    log.close()
    train_s = time.time() - t0

    model.eval()
    model.to(save_dtype)
    save_checkpoint(model, tokenizer, out, image_size=image_size)
    (out / "training_args.json").write_text(json.dumps(vars(args), indent=2))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved {out} ({size / 1e6:.1f} MB) after {train_s:.0f} s "
          f"({train_s / max(1, args.steps):.2f} s/step)", flush=True)

    if args.check:
        items = val[:args.check]
        for it, got in zip(items, hf_answers(out, items), strict=True):
            print(f"[check] {it.image_id} Q: {it.question} | expected: {it.answer} | "
                  f"model: {got}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
