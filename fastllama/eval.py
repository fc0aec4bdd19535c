"""Accuracy of a checkpoint: EleutherAI's lm-evaluation-harness tasks, or perplexity on a text.

    python eval.py --checkpoint_path checkpoints/X --tasks hellaswag,arc_easy [--limit 100] [--batch_size 8] [--compile]
    python eval.py --tasks tasks/pydoc_cloze.yaml,tasks/pydoc_complete.yaml   # offline: data in the repo
    python eval.py --checkpoint_path checkpoints/X/fastllama_int4.g32.safetensors [--text_file notes.txt]  # perplexity

Harness tasks go through its Python API (`pip install -e ".[eval]"`): `HarnessModel` is its `LM`
interface over our Transformer, whatever the checkpoint (quantized, any family, under torchrun with
rank 0 reporting), and nothing else of the harness is used, so that its internals can move. A task
is a name the harness knows (its datasets then download) or the path of a task YAML; the data files
a YAML names are found beside it. The repo's own tasks (tasks/) run with no download.

Without --tasks: perplexity over consecutive windows of the held-out half of the documentation that
ships with Python (the other half calibrates GPTQ), so every machine can compare schemes.
"""

import argparse
import importlib.metadata
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import cpu_decode
from .checkpoint import read_json, write_json
from .errors import UserError, refuse, run_cli
from .decode import key_positions
from .generate import (KV_CACHE_DTYPES, NO_FILTER, PRECISIONS, HelpFormatter, find_checkpoint, generate, get_tokenizer,
                      load_model)
from .model import Transformer
from .quantize import python_docs_text
from .tokenizer import Tokenizer
from .tp import maybe_init_distributed

# the harness versions this adapter is tested with (tests/test_eval.py); others are refused
TESTED_HARNESS = ((0, 4, 5), (0, 5))  # from 0.4.5 up to, not including, 0.5
# The head's fp32 log-probabilities are made a slice of rows at a time, at most this many bytes. On CPU,
# few enough for glibc's malloc to reuse the memory (it maps a block over 32 MiB afresh each time, then
# faults it in page by page); on a GPU, rows enough for the head's product to read its weight once for
# hundreds of them (2,000 of a 128k vocabulary).
HEAD_SLICE_BYTES = dict(cpu=8 << 20, cuda=1 << 30)

try:
    from lm_eval.api.model import LM as HarnessLM
except ImportError:  # --tasks says what to install; perplexity needs none of it
    HarnessLM = object


@torch.no_grad()
def perplexity(model: Transformer, tokens: torch.Tensor, seq_len: int = 512, batch_size: int = 4,
               progress: bool = False, kv_cache_dtype: torch.dtype | None = None) -> float:
    """exp(mean next-token loss) over consecutive windows of seq_len tokens, the keys and values each
    window attends to stored in kv_cache_dtype (None: the model's dtype)."""
    if seq_len > model.config.block_size:
        raise UserError(f"windows of {seq_len} tokens exceed the model's context of {model.config.block_size}: "
                        f"shorten them (--seq_len)")
    n_windows = len(tokens) // seq_len
    if n_windows == 0:
        raise UserError(f"the text has {len(tokens)} tokens, fewer than one window of {seq_len}: score more "
                        f"(--max_tokens, --text_file) or shorten the window (--seq_len)")
    windows = tokens[: n_windows * seq_len].view(n_windows, seq_len)
    device = next(model.parameters()).device
    total = 0.0
    for batch in tqdm(windows.split(batch_size), desc="perplexity", unit="batch", disable=not progress):
        model.setup_caches(len(batch), seq_len, kv_cache_dtype=kv_cache_dtype)  # the last batch may be short
        batch = batch.to(device)
        logits = model(batch, torch.arange(seq_len, device=device))  # (B, T, V)
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").item()
    return math.exp(total / (n_windows * (seq_len - 1)))


class HarnessModel(HarnessLM):
    """The harness's LM interface over our Transformer: log-likelihoods of continuations, of whole
    texts in rolling windows, and greedy generation up to stop strings. Requests are batched by length
    (longest first), ragged rows right-padded into the static cache. With chat, the harness renders
    each context through apply_chat_template first, and a template's rendering brings its own BOS."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, name: str, batch_size: int = 8,
                 max_length: int | None = None, chat: bool = False, compile: bool = False,
                 kv_cache_dtype: torch.dtype | None = None, generation_config: dict | None = None):
        super().__init__()
        self.model, self.tokenizer, self.name, self.batch_size = model, tokenizer, name, batch_size
        self.generation_config = generation_config or {}  # the checkpoint's: its sampling filters
        self.chat, self.kv_cache_dtype = chat, kv_cache_dtype  # the cache's dtype (None: the model's)
        # compile: the scoring forward compiled once for rows of any length (its first batch compiles,
        # a minute or more on a small CPU; with a sliding window, rows longer than it once more); every
        # batch then takes batch_size rows, the last padded with empty ones, since a new row count would
        # compile again (batches)
        self.compiled = compile
        self.hidden_states = torch.compile(model.hidden_states, dynamic=True) if compile else model.hidden_states
        self.max_length = max_length or model.config.block_size
        # the longest row of several requests: where the model has sliding-window layers, one that lies
        # in the window, so that their rings mask as its tree does (Transformer.blocks)
        self.tree_length = min(self.max_length, model.config.sliding_window or self.max_length)
        # what an empty context is scored after, as the harness's HF backend does
        self.prefix_token_id = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id

    # -- the LM interface

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(*request.args) for request in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Each text's log-likelihood, every token predicted once, windows of the model's length."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for i, request in enumerate(requests):
            for window in get_rolling_token_windows(self.tokenizer.encode(request.args[0]), self.prefix_token_id,
                                                    self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.score(windows)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests) -> list[str]:
        """Greedy (or sampled, if the task asks: generation_options) continuations, each cut before the
        first of its stop strings; requests that share generation settings go together in ragged batches."""
        results = [""] * len(requests)
        groups = {}
        for i, request in enumerate(requests):
            context, settings = request.args
            groups.setdefault(json.dumps(settings, sort_keys=True, default=str), []).append((i, context))
        for settings, members in groups.items():
            settings = json.loads(settings)
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else until
            max_new, sampling = generation_options(settings, self.generation_config)
            if max_new >= self.max_length:
                raise UserError(f"a task asks for {max_new} new tokens, but a request may take {self.max_length} "
                                f"positions in all (--max_length): raise --max_length, or lower the task's max_gen_toks")
            for batch in batched(members, self.batch_size):
                prompts = [torch.tensor(self.encode_context(context)[-(self.max_length - max_new):])
                           for _, context in batch]
                outputs = generate(self.model, prompts, max_new, stop_ids=self.tokenizer.stop_ids,
                                   kv_cache_dtype=self.kv_cache_dtype, **sampling)
                for (i, _), prompt, output in zip(batch, prompts, outputs):
                    results[i] = cut_at_stops(self.tokenizer.decode(output[len(prompt):].tolist()), until)
        return results

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.dialog_text(chat_history)

    @property
    def tokenizer_name(self) -> str:
        return self.name

    # -- scoring

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of the context and of the continuation after it, split as the harness's HF backend
        splits them: the context's trailing spaces move to the continuation, and the continuation's
        ids are those of the whole text past the context's."""
        if not context:
            return [self.prefix_token_id], self.tokenizer.encode(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode_context(context + continuation)
        n_context = len(self.encode_context(context))
        return whole[:n_context], whole[n_context:]

    def encode_context(self, text: str) -> list[int]:
        """Ids of a request's text: as a chat rendering with chat, else as a plain prompt."""
        return self.tokenizer.encode_rendered(text) if self.chat else self.tokenizer.encode_prompt(text)

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-probability of the continuation after the context, whether greedy decoding gives it)
        for each pair of token lists. A text longer than the model keeps its last max_length tokens.

        Requests that share a prefix, the text up to the token that predicts the continuation's first
        (the choices of one question), share a row: the prefix once, then each one's other tokens as a
        branch of a tree over it, which sees the prefix and its own earlier tokens only (the tree mask
        of Transformer.blocks). So a question's prefix runs once and its choices need no padding to the
        longest of them. (The harness's HF backend shares a forward only between one-token choices.)
        With sliding-window layers, a row of several requests fits in the window (tree_length)."""
        by_prefix = {}  # prefix -> [(request, the tokens it scores)]
        results = [None] * len(pairs)
        for i, (context, continuation) in enumerate(pairs):
            if not continuation:  # nothing to score: probability 1, which greedy decoding gives (as the HF backend)
                results[i] = (0.0, True)
                continue
            tokens = (context + continuation)[-(self.max_length + 1):]
            split = max(1, len(tokens) - len(continuation))
            by_prefix.setdefault(tuple(tokens[:split]), []).append((i, tokens[split:]))
        cpu_decode.pack(self.model, many_rows=True)  # a bf16 model on CPU scores through oneDNN's copy of its weights
        for batch in tqdm(self.batches(self.rows(by_prefix)), desc="scoring", unit="batch", leave=False):
            members = [member for _, row in batch for member in row]
            logprob, greedy = self.scored_tokens(batch)  # (n,) each: the members' tokens, in order
            owner = torch.repeat_interleave(torch.tensor([len(targets) for _, targets in members]))
            sums = torch.zeros(len(members), dtype=torch.float64).index_add_(0, owner, logprob.double())
            misses = torch.zeros(len(members), dtype=torch.long).index_add_(0, owner, (~greedy).long())
            for (i, _), total, missed in zip(members, sums.tolist(), misses.tolist()):
                results[i] = (total, missed == 0)
        return results

    def rows(self, by_prefix: dict) -> list[tuple[list[int], list]]:
        """(prefix, requests) a row: each prefix with as many of its requests' branches as fit in
        tree_length positions (a request longer than that alone)."""
        rows = []
        for prefix, members in by_prefix.items():
            row, length = [], len(prefix)
            for i, targets in members:
                if row and length + len(targets) - 1 > self.tree_length:
                    rows.append((list(prefix), row))
                    row, length = [], len(prefix)
                row.append((i, targets))
                length += len(targets) - 1
            rows.append((list(prefix), row))
        return rows

    def batches(self, rows: list) -> list[list]:
        """The rows, longest first, in groups of at most batch_size rows whose padded tokens are no more
        than batch_size requests of the group's longest take without sharing (the HF backend's batch;
        compiled, batch_size rows whatever they take), and that are no longer than tree_length or all
        hold one request (scored_tokens)."""
        batches = []
        for row in sorted(rows, key=row_length, reverse=True):
            if batches and self.fits(batches[-1] + [row]):
                batches[-1].append(row)
            else:
                batches.append([row])
        return batches

    def fits(self, batch: list) -> bool:
        """Whether one forward may take these rows, the longest first (batches)."""
        longest_request = max(len(prefix) + len(targets) for prefix, members in batch for _, targets in members)
        trees = row_length(batch[0]) <= self.tree_length or all(len(members) == 1 for _, members in batch)
        within_hf_batch = len(batch) * row_length(batch[0]) <= self.batch_size * longest_request
        return trees and len(batch) <= self.batch_size and (within_hf_batch or self.compiled)

    def scored_tokens(self, batch: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token the batch's requests score, row by row and request by request: its
        log-probability and whether it is the greedy choice, (n,) each, from one forward. The rows go
        right-padded, each a tree (a padding token sees itself only; rows longer than tree_length, each
        one request, causal by position instead), and the output head runs only at the positions that
        predict a scored token: a row's last prefix position (every request's first token), then its
        branches' tokens (each request's next ones)."""
        R = self.batch_size if self.compiled else len(batch)  # rows past the batch's: empty, no score
        empty = [0] * (R - len(batch))
        lengths = torch.tensor([row_length(row) for row in batch] + empty)
        T = int(lengths.max())
        idx = torch.zeros(R, T, dtype=torch.long)
        tree = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1)  # (R, T, T)
        prefix_lengths = torch.tensor([len(prefix) for prefix, _ in batch] + empty)
        predicted_at, scored = [], []  # each scored token: the head's output that predicts it, and the token
        head_outputs = 0  # of the rows before this one
        for r, (prefix, members) in enumerate(batch):
            P = len(prefix)
            idx[r, :P] = torch.tensor(prefix)
            tree[r, :P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
            start = P
            for _, targets in members:
                end = start + len(targets) - 1
                idx[r, start:end] = torch.tensor(targets[:-1], dtype=torch.long)
                tree[r, start:end, :P] = True
                tree[r, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
                # the first token after the prefix's last position, the others after the branch's own
                predicted_at += [head_outputs] + [head_outputs + p - (P - 1) for p in range(start, end)]
                scored += targets
                start = end
            head_outputs += start - (P - 1)
        device = next(self.model.parameters()).device
        # one forward whatever the length (a chunk of max_length): sliding-window rings then hold every
        # position of the rows, padding included, and mask a tree within the window as a full cache does
        self.model.setup_caches(R, T, chunk=self.max_length, kv_cache_dtype=self.kv_cache_dtype)
        positions = torch.arange(T).expand(R, T)
        x = self.hidden_states(idx.to(device), positions.to(device), key_positions(self.model, T),
                               tree.to(device) if T <= self.tree_length else None)
        columns = torch.arange(T)
        wanted = (columns >= prefix_lengths[:, None] - 1) & (columns < lengths[:, None])  # (R, T)
        x = x[wanted.to(device)]  # (head_outputs, dim)
        at, tokens = torch.tensor(predicted_at, device=device), torch.tensor(scored, device=device)
        logprob = torch.empty(len(scored), device=device)
        greedy = torch.empty(len(scored), dtype=torch.bool, device=device)
        slice_rows = max(1, HEAD_SLICE_BYTES.get(device.type, 1 << 30) // (4 * self.model.config.vocab_size))
        for start in range(0, len(x), slice_rows):  # the head on a slice of the rows at a time
            logprobs = self.model.logits(x[start: start + slice_rows]).float().log_softmax(-1)  # (rows, V)
            mine = (at >= start) & (at < start + slice_rows)
            rows = at[mine] - start
            logprob[mine] = logprobs[rows, tokens[mine]]
            greedy[mine] = logprobs.argmax(-1)[rows] == tokens[mine]
        return logprob.cpu(), greedy.cpu()


def row_length(row: tuple[list[int], list]) -> int:
    """Positions a row of score() takes: its prefix and every branch of its requests."""
    prefix, members = row
    return len(prefix) + sum(len(targets) - 1 for _, targets in members)


def batched(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start: start + size]


# the filters HF's generate samples with where neither the request nor the checkpoint's
# generation_config.json names one (transformers' GenerationConfig defaults); top_k 0 and top_p 1 are none
HF_FILTERS = dict(top_k=50, top_p=1.0)


def generation_options(settings: dict, generation_config: dict | None = None) -> tuple[int, dict]:
    """The new tokens and generate()'s sampling options a request's generation settings ask for, read
    as the harness reads them (lm_eval.models.utils.normalize_gen_kwargs, in the versions that have
    it): the length under any of its names, first found first; sampling where do_sample says so or,
    unsaid, where the temperature is above 0. A sampled request's temperature, top_k and top_p as
    transformers' generate fills them in: the request's own (a null filter: none), else the
    checkpoint's generation_config.json's, else transformers' defaults (temperature 1.0, HF_FILTERS).
    The harness's HF backend passes temperature 0.0 where do_sample comes without one, which
    transformers refuses; this reads it as unsaid. Only these: the file's other settings (a
    repetition penalty) are not applied."""
    lengths = [settings[name] for name in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
               if settings.get(name) is not None]
    recommended = generation_config or {}
    said = settings.get("temperature")  # null: unsaid
    sampled = settings.get("do_sample", said is not None and float(said) > 0)
    default = recommended.get("temperature") or 1.0
    temperature = float(default if said is None else said) if sampled else 0.0
    sampling = dict(temperature=temperature, top_k=None, top_p=None)
    if temperature > 0:
        for name, default in HF_FILTERS.items():
            if name in settings:
                value = settings[name]
            else:  # the file's null is unsaid
                value = default if recommended.get(name) is None else recommended[name]
            sampling[name] = None if value in (None, NO_FILTER[name]) else value
    return int(lengths[0]) if lengths else 256, sampling


def cut_at_stops(text: str, stops: list[str]) -> str:
    """text up to, not including, the earliest of the stop strings in it."""
    return text[: min((text.find(s) for s in stops if s and s in text), default=len(text))]


# ---------------------------------------------------------------------------------------------
# The harness's side


def harness():
    """lm_eval, if installed in a version this adapter is tested with; a one-line error otherwise."""
    try:
        import lm_eval
    except ImportError:
        raise UserError("--tasks needs EleutherAI's lm-evaluation-harness: pip install -e '.[eval]'")
    version = importlib.metadata.version("lm_eval")
    numbers = tuple(int(part) for part in version.split(".")[:3] if part.isdigit())
    low, high = TESTED_HARNESS
    if not low <= numbers < high:
        raise UserError(f"lm_eval {version} is not a version this adapter is tested with: "
                        f"pip install 'lm_eval>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}'")
    return lm_eval


def task_specs(tasks: str) -> list[str | dict]:
    """--tasks' comma-separated entries: a task name as is, a YAML file as its config, with the data
    files it names found beside it."""
    import yaml

    specs = []
    for entry in filter(None, (t.strip() for t in tasks.split(","))):
        path = Path(entry)
        if path.suffix not in (".yaml", ".yml"):
            specs.append(entry)
            continue
        if not path.is_file():
            raise UserError(f"no task file at {path}")
        try:
            config = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise UserError(f"{path} does not parse as YAML: {str(e).splitlines()[0]}")
        if not isinstance(config, dict) or "task" not in config:
            raise UserError(f"{path} is not a harness task (it names no `task:`)")
        dataset = config.get("dataset_kwargs") or {}
        files = dataset.get("data_files")
        if isinstance(files, str):
            dataset["data_files"] = str(path.parent / files)
        elif isinstance(files, dict):
            dataset["data_files"] = {split: str(path.parent / name) for split, name in files.items()}
        specs.append(config)
    return specs


def evaluate_tasks(model: HarnessModel, tasks: str, limit: float | None = None, num_fewshot: int | None = None,
                   apply_chat_template: bool = False) -> dict:
    """The harness's results for the tasks (simple_evaluate's dict); unknown names are one line."""
    lm_eval = harness()
    from lm_eval.tasks import TaskManager

    manager = TaskManager()
    specs = task_specs(tasks)
    unknown = [s for s in specs if isinstance(s, str) and s not in manager.all_tasks]
    if unknown:
        raise UserError(f"unknown task(s) {', '.join(unknown)}: give a name the harness lists "
                        f"(lm_eval ls tasks) or the path of a task YAML")
    return lm_eval.simple_evaluate(model=model, tasks=specs, limit=limit, num_fewshot=num_fewshot,
                                   task_manager=manager, apply_chat_template=apply_chat_template,
                                   log_samples=False)


def main(args):
    if args.tasks:  # a missing harness or a bad task file fails before the model loads
        harness()
        task_specs(args.tasks)
    rank, world = maybe_init_distributed(args.device)
    model = load_model(args.checkpoint_path, args.device, args.precision, rank, world)
    tokenizer = get_tokenizer(args.checkpoint_path)
    kv_cache_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype or args.precision]
    if not args.tasks:
        text = Path(args.text_file).read_text(errors="replace") if args.text_file else python_docs_text("held-out")
        tokens = torch.tensor(tokenizer.encode(text)[: args.max_tokens])
        ppl = perplexity(model, tokens, args.seq_len, args.batch_size, progress=rank == 0,
                         kv_cache_dtype=kv_cache_dtype)
        if rank == 0:
            scored = len(tokens) // args.seq_len * args.seq_len  # whole windows only
            left = f" (the last {len(tokens) - scored}, short of a window, not scored)" if scored < len(tokens) else ""
            print(f"{args.checkpoint_path or 'bundled model'}: perplexity {ppl:.3f} over {scored} tokens in windows "
                  f"of {args.seq_len}{left}, KV cache {args.kv_cache_dtype or args.precision}")
        return ppl
    name = str(args.checkpoint_path or "bundled SmolLM2-135M-Instruct")
    generation_config = read_json(find_checkpoint(args.checkpoint_path).parent / "generation_config.json")
    lm = HarnessModel(model, tokenizer, name, args.batch_size, args.max_length, chat=args.apply_chat_template,
                      compile=args.compile, kv_cache_dtype=kv_cache_dtype, generation_config=generation_config)
    results = evaluate_tasks(lm, args.tasks, args.limit, args.num_fewshot, args.apply_chat_template)
    if rank == 0:
        from lm_eval.utils import make_table

        print(make_table(results))
        if args.output:
            write_json(args.output, results["results"])
    return results


def cli():
    """python eval.py's command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--checkpoint_path", type=Path, default=None, help="default: the bundled model")
    p.add_argument("--tasks", default=None,
                   help="comma-separated harness task names or task YAML paths (default: perplexity instead)")
    p.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1)")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--apply_chat_template", action="store_true", help="prompts in the model's chat template")
    p.add_argument("--max_length", type=int, default=None, help="tokens a request may take (default: the context)")
    p.add_argument("--output", type=Path, default=None, help="with --tasks: write the results as JSON")
    p.add_argument("--text_file", type=Path, default=None, help="perplexity: default held-out Python documentation")
    p.add_argument("--max_tokens", type=int, default=16384, help="perplexity: tokens of the text to score")
    p.add_argument("--seq_len", type=int, default=512, help="perplexity: window length")
    p.add_argument("--batch_size", type=int, default=4, help="windows (perplexity) or rows (tasks) a forward")
    p.add_argument("--compile", action="store_true",
                   help="harness tasks: compile the scoring forward once (minutes on a small CPU), which then "
                        "scores faster (benchmarks/RESULTS.md, 'Scoring: short attention written out, and a compiled "
                        "forward'): worth it where scoring takes many minutes")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="activations and unquantized weights")
    p.add_argument("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=None, help="default: --precision's")
    args = p.parse_args()
    if args.text_file and not args.text_file.is_file():
        refuse(f"{args.text_file} does not exist")
    if args.tasks and args.text_file:
        refuse("--text_file is for perplexity; harness tasks bring their own data")
    if args.compile and not args.tasks:
        refuse("--compile is for harness tasks (--tasks)")
    if args.seq_len < 2:
        refuse("--seq_len must be at least 2 (a window's first token predicts the next)")
    if args.batch_size < 1:
        refuse("--batch_size must be at least 1")
    if args.output and not args.tasks:
        refuse("--output writes harness results: it goes with --tasks")
    if args.output and not args.output.resolve().parent.is_dir():  # found now, not after hours of scoring
        refuse(f"--output {args.output}: its folder does not exist")
    run_cli(main, args)


if __name__ == "__main__":
    cli()
