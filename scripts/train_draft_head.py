"""Train an EAGLE-style draft head (speculative.DraftHead) for a model: minutes on a CPU.

    python scripts/train_draft_head.py [--checkpoint_path X] [--text FILE] [--minutes 14]
    python generate.py --compile --draft head --prompt "..."    # then draft with it

The target reads the text once, in windows, and its last layer's output at every position is kept.
The head then learns, at each position, what the target will do one token later: from the target's
state at position i - 1 and the embedding of token i, it predicts the target's state at i
(regression, as EAGLE does, in units of the states' RMS) and, through its output layer, the target's next-token distribution
over the head's vocabulary (cross-entropy against the target's own probabilities there). That
vocabulary is the `--vocab` tokens most frequent in the text. The input states get a little noise,
as EAGLE's do (in the same units), since when drafting the head reads its own predictions after the first step.

The default text is the documentation every Python ships (pydoc's topics and the standard library's
docstrings), and about --own_answers tokens of the target's own chats: prompts made from that text
(explain or summarize a paragraph, a story or a poem about one of its words), answers sampled. The
head drafts the target's answers, which read unlike documentation, so it learns from them too
(self-distillation, as Medusa-2 does; what that gained: benchmarks/RESULTS.md, "The draft head on the
target's own chats"). The head computes in bf16 when the target does (but on a CPU without fast bf16
matmuls), its weights and optimizer in fp32. Training stops at --epochs or --minutes, whichever comes
first, and the learning rate falls to zero by then. The head is saved beside the checkpoint as draft_head.safetensors, with
its config and the target's shape in its metadata.
"""

import argparse
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastllama import cpu_decode  # noqa: E402
from fastllama.checkpoint import resolve_output  # noqa: E402
from fastllama import generate as gen  # noqa: E402
from fastllama.errors import UserError, refuse, run_cli  # noqa: E402
from fastllama.model import Transformer, softcap  # noqa: E402
from fastllama.quantize import python_docs_text  # noqa: E402
from fastllama.speculative import HEAD_NAME, DraftHead, save_head  # noqa: E402


def default_text() -> str:
    """English and code every CPython ships: pydoc's topics, then the standard library's docstrings
    (of modules, classes and functions; tests left out)."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    docstrings = []
    for path in sorted([*root.glob("*.py"), *root.glob("*/*.py")]):
        if "test" in path.relative_to(root).as_posix() or "idlelib" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if (doc := ast.get_docstring(node)) and len(doc) > 200:  # a line or two teaches little
                    docstrings.append(doc)
    return "\n\n".join([python_docs_text("calibration"), python_docs_text("held-out"), *docstrings])


# chat prompts for --own_answers: {paragraph} is a paragraph of the text, {word} one of its words
OWN_PROMPTS = ("Explain this in simple words:\n\n{paragraph}",
               "Summarize this in two or three sentences:\n\n{paragraph}",
               "What are the key points of this text?\n\n{paragraph}",
               "Write a short story about {word}.",
               "Write a short poem about {word}.",
               "Tell me something interesting about {word}.")
ANSWERS_AT_ONCE = 32  # chats the target writes in one batch of ragged prompts


@torch.no_grad()
def own_answers(target: Transformer, tokenizer, text: str, n_tokens: int, batch: int = ANSWERS_AT_ONCE,
                max_new_tokens: int = 256) -> list[Tensor]:
    """About n_tokens of the target's own chats: prompts made from the text (OWN_PROMPTS), each followed
    by the target's answer, sampled at temperature 0.7 so that answers vary (seeded). Up to `batch` chats
    at a time, fewer where fewer full-length answers would reach n_tokens."""
    from tqdm import tqdm

    rng = random.Random(0)
    torch.manual_seed(0)
    paragraphs = [p.strip() for p in text.split("\n\n") if 200 <= len(p.strip()) <= 1200]
    if not paragraphs:
        raise UserError("--own_answers needs a text with paragraphs (200 to 1200 characters between blank lines)")
    words = sorted({w.lower() for p in paragraphs for w in re.findall(r"\b[A-Za-z]{5,12}\b", p)})
    chats, written = [], 0
    with tqdm(total=n_tokens, desc="the target writes its own answers", unit="tok") as bar:
        while written < n_tokens:
            chats_left = -(-(n_tokens - written) // max_new_tokens)  # as many as answers of full length take
            prompts = [torch.tensor(tokenizer.encode_prompt(rng.choice(OWN_PROMPTS).format(
                paragraph=rng.choice(paragraphs), word=rng.choice(words)), chat=True))
                for _ in range(min(batch, chats_left))]
            for chat in gen.generate(target, prompts, max_new_tokens, temperature=0.7, stop_ids=tokenizer.stop_ids):
                chats.append(chat)
                written += len(chat)
                bar.update(len(chat))
    return chats


@torch.no_grad()
def target_states(target: Transformer, windows: Tensor, batch: int) -> Tensor:
    """The target's last-layer output at every position of each window (n, W) -> (n, W, dim)."""
    from tqdm import tqdm

    n, W = windows.shape
    target.setup_caches(batch, W)
    device = target.tok_embeddings.weight.device
    states = torch.empty(n, W, target.config.dim, dtype=target.tok_embeddings.weight.dtype)  # kept on the host
    pos = torch.arange(W, device=device).expand(batch, -1)
    for i in tqdm(range(0, n, batch), desc="reading the text with the target", unit="batch"):
        rows = windows[i: i + batch].to(device)
        if len(rows) < batch:  # the cache's batch size is fixed: pad the last batch
            rows = torch.cat([rows, rows[:1].expand(batch - len(rows), -1)])
        states[i: i + batch] = target.hidden_states(rows, pos)[: min(batch, n - i)].cpu()
    return states


def losses(head: DraftHead, target: Transformer, tokens: Tensor, states: Tensor, scale: float, noise: float = 0.0
           ) -> tuple[Tensor, Tensor, Tensor]:
    """tokens (B, W), states (B, W, dim): the head at positions 1..W-1 predicts the states at those
    positions and the target's next-token distributions from them. Returns the state regression loss
    (in units of `scale`, the states' RMS: a model's states may be large), the cross-entropy against
    the target's probabilities over the head's vocabulary, and the share of positions where the
    head's top token is the target's top token among that vocabulary."""
    device = target.tok_embeddings.weight.device
    tokens, states = tokens.to(device), states.to(device)
    B, W = tokens.shape
    inputs = states[:, :-1].float()
    if noise:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise * scale
    pos = torch.arange(1, W, device=device).expand(B, -1)
    logits, predicted = head(target, tokens[:, 1:], inputs, pos)  # at positions 1..W-1
    for layer in head.layers:  # the cache's writes must not tie one step's graph to the next
        layer.attention.kv_cache.k_cache.detach_()
        layer.attention.kv_cache.v_cache.detach_()
    goal = states[:, 1:].float()
    with torch.no_grad():  # the target's own distribution over the head's vocabulary
        target_logits = softcap(F.linear(target.norm(goal), target.output.weight[head.vocab].float()),
                                target.config.logit_softcap)
        probs = target_logits.softmax(-1)
    cross_entropy = -(probs * logits.float().log_softmax(-1)).sum(-1).mean()
    agree = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return F.smooth_l1_loss(predicted.float() / scale, goal / scale), cross_entropy, agree


def training_windows(args, target: Transformer, tokenizer) -> tuple[Tensor, Tensor]:
    """The training text's tokens (with the target's own answers last, so that the held-out windows are
    those) and the windows of --window tokens cut from them, (n, window), the last --max_windows."""
    if args.text is not None:
        if not Path(args.text).is_file():
            raise UserError(f"{args.text} does not exist: give a text file, or leave out --text for Python's docs")
        text = Path(args.text).read_text(errors="replace")
    else:
        text = default_text()
    ids = torch.tensor(tokenizer.encode(text))
    if args.own_answers:
        ids = torch.cat([ids, *own_answers(target, tokenizer, text, args.own_answers)])
    W = args.window
    if len(ids) < 4 * W:
        raise UserError(f"the text has {len(ids)} tokens; training needs at least {4 * W} (--window {W} x 4)")
    windows = ids[len(ids) % W:].view(-1, W)
    return ids, windows[-args.max_windows:] if args.max_windows else windows


def held_out(windows: int) -> int:
    """Windows kept from training, the text's last 5%: the agreement reported at the end."""
    return max(1, windows // 20)


def train(args) -> list[float]:
    """Train and save the head; returns the training loss at each step."""
    from tqdm import tqdm

    torch.manual_seed(0)
    target = gen.load_model(args.checkpoint_path, args.device, args.precision).requires_grad_(False)
    if not target.output.weight.is_floating_point():  # the head starts from, and learns, the output layer's rows
        raise UserError(f"{gen.find_checkpoint(args.checkpoint_path)} is quantized: train the head on the "
                        f"checkpoint it was quantized from (the head drafts for its quantized copies too)")
    if args.window > target.config.block_size:
        raise UserError(f"--window {args.window} is longer than the model's context, {target.config.block_size}")
    tokenizer = gen.get_tokenizer(args.checkpoint_path)
    if args.own_answers and not tokenizer.can_chat:
        raise UserError("this model has no chat template, so it cannot write its own chats to train on: "
                        "pass --own_answers 0")
    ids, windows = training_windows(args, target, tokenizer)
    train_rows, B = len(windows) - held_out(len(windows)), args.batch_size
    if train_rows < B:
        raise UserError(f"{len(windows)} windows of {args.window} tokens leave fewer than --batch_size {B} to "
                        f"train on after {held_out(len(windows))} held out: give more text, or a larger --max_windows")
    vocab_size, counts = min(args.vocab, target.config.vocab_size), ids.bincount(minlength=target.config.vocab_size)
    vocab = counts.topk(vocab_size).indices.sort().values
    print(f"{len(windows)} windows of {args.window} tokens; the head's vocabulary: the {vocab_size} most frequent "
          f"tokens, {counts[vocab].sum() / len(ids):.1%} of the text", file=sys.stderr)
    states = target_states(target, windows, B)
    scale = states[:64].float().pow(2).mean().sqrt().item()

    head = DraftHead(DraftHead.config_for(target.config, vocab_size), vocab).to(args.device)
    with torch.no_grad():  # start from the target's own final norm and output rows
        head.norm.weight.copy_(target.norm.weight)
        head.output.weight.copy_(target.output.weight[vocab])
    head.setup_caches(B, args.window)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    per_epoch = train_rows // B
    steps, start, seconds = args.epochs * per_epoch, time.monotonic(), 60 * args.minutes

    def done(step: int) -> float:  # the share of the run behind us, by steps or by time, whichever is further
        return max(step / steps, (time.monotonic() - start) / seconds)

    # a linear warm-up over the first 5% of the run, then linearly down to zero at its end
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, min(20 * done(step), 1 - done(step))))
    weight = target.tok_embeddings.weight  # bf16 autocast where the target is bf16, but on a CPU without bf16 matmuls
    bf16 = weight.dtype == torch.bfloat16 and not (weight.device.type == "cpu" and cpu_decode.SLOW_BF16_MATMUL)
    bar = tqdm(range(steps), desc="training the draft head", unit="step")
    history = []
    for step in bar:
        if step % per_epoch == 0:
            order = torch.randperm(train_rows)
        batch = order[step % per_epoch * B:][:B]
        with torch.autocast(weight.device.type, torch.bfloat16, enabled=bf16):
            regression, cross_entropy, agree = losses(head, target, windows[batch], states[batch], scale, args.noise)
        loss = regression + args.cross_entropy_weight * cross_entropy
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        history.append(loss.item())
        bar.set_postfix(state=f"{regression.item():.3f}", xent=f"{cross_entropy.item():.3f}", top1=f"{agree.item():.2f}")
        if done(step + 1) >= 1:
            if step + 1 < steps:
                print(f"\nstopped at the time limit (--minutes {args.minutes}), step {step + 1} of {steps}",
                      file=sys.stderr)
            break
    with torch.no_grad():
        agreement = [losses(head, target, windows[i: i + B], states[i: i + B], scale)[2]
                     for i in range(train_rows, len(windows) - B + 1, B)]
    if agreement:
        print(f"held-out: the head's top token is the target's {torch.stack(agreement).mean():.1%} of the time "
              f"(one step ahead, over its vocabulary)", file=sys.stderr)
    else:
        print(f"held-out: not measured ({len(windows) - train_rows} windows held out, fewer than --batch_size {B})",
              file=sys.stderr)
    output = args.output or gen.find_checkpoint(args.checkpoint_path).parent / HEAD_NAME
    save_head(head.to(target.tok_embeddings.weight.dtype), output, target.config)
    print(f"wrote {output}", file=sys.stderr)
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--checkpoint_path", type=Path, default=None, help="the target (default: the bundled model)")
    p.add_argument("--text", type=Path, default=None, help="training text (default: Python's documentation)")
    p.add_argument("--output", type=Path, default=None,
                   help=f"the file to write, or a folder for {HEAD_NAME} (default: beside the checkpoint)")
    p.add_argument("--vocab", type=int, default=8192, help="the head's vocabulary: this many most frequent tokens")
    p.add_argument("--window", type=int, default=512, help="tokens the target reads at once")
    p.add_argument("--max_windows", type=int, default=None, help="use at most this many windows: the text's last")
    p.add_argument("--own_answers", type=int, default=50000, metavar="N",
                   help="train on about N tokens of the target's own answers too (written before training, placed last; 0: none)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--minutes", type=float, default=14, help="stop training after this long")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--noise", type=float, default=0.05, help="uniform noise on the input states, +-this times their RMS")
    p.add_argument("--cross_entropy_weight", type=float, default=0.1)
    p.add_argument("--device", default=gen.default_device())
    p.add_argument("--precision", choices=gen.PRECISIONS, default="bf16", help="the target's")
    args = p.parse_args(argv)
    for name in ("vocab", "batch_size", "epochs"):
        if getattr(args, name) < 1:
            refuse(f"--{name} must be at least 1")
    if args.window < 2:
        refuse("--window must be at least 2 (a window's first token predicts the next)")
    if args.minutes <= 0 or args.own_answers < 0:
        refuse("--minutes must be more than 0, and --own_answers 0 or more")
    if args.output:  # a folder that is not there found now, not after the training
        try:
            args.output = resolve_output(args.output, HEAD_NAME)
        except UserError as e:
            refuse(str(e))
    if args.max_windows is not None and args.max_windows - held_out(args.max_windows) < args.batch_size:
        refuse(f"--max_windows {args.max_windows} leaves fewer than --batch_size {args.batch_size} windows to train "
               f"on after {held_out(args.max_windows)} held out")
    return args


if __name__ == "__main__":
    run_cli(train, parse_args())
