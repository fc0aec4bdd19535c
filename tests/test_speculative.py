"""Speculative decoding: exactly the target's output, greedy token for token and sampled in distribution."""

import copy
import dataclasses

import pytest
import torch

from fastllama import cpu_decode, decode, speculative
from fastllama.errors import UserError
from fastllama.generate import compiled_steps, generate, get_tokenizer, load_model
from fastllama.model import ModelArgs, Transformer
from fastllama.speculative import DraftModel, PromptLookup

PROMPTS = ["Once upon a time, in a small village by the sea,",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "The three primary colors are red, blue and"]
REPEATING = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"  # its continuation repeats what came before


@pytest.fixture(scope="module")
def prompts(bundled_checkpoint):
    tokenizer = get_tokenizer(bundled_checkpoint)
    return [torch.tensor(tokenizer.encode(p)) for p in PROMPTS + [REPEATING]]


@pytest.fixture(scope="module")
def int4_draft(int4_checkpoint):
    return load_model(int4_checkpoint, "cpu", "fp32")


@pytest.fixture(scope="module")
def random_draft(model_fp32):
    """A tiny draft with random weights: it proposes nonsense, so nearly everything is rejected."""
    config = ModelArgs(vocab_size=model_fp32.config.vocab_size, n_layer=2, n_head=4, dim=64, block_size=2048)
    torch.manual_seed(0)
    return Transformer(config).eval()


@pytest.fixture(scope="module")
def plain_greedy(model_fp32, prompts):
    batches = ([prompts[0]], prompts[:3])  # one prompt, and prompts of different lengths together
    return [(batch, generate(model_fp32, batch, 24, temperature=0)) for batch in batches]


@pytest.mark.parametrize("drafter", ["int4", "random", "prompt-lookup"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_speculative_equals_plain_greedy(drafter, k, model_fp32, prompts, plain_greedy, int4_draft,
                                                random_draft):
    kwargs = {"int4": dict(drafter=DraftModel(int4_draft)), "random": dict(drafter=DraftModel(random_draft)),
              "prompt-lookup": dict(drafter=PromptLookup())}[drafter]
    for batch, plain in plain_greedy:
        stats = {}
        spec = generate(model_fp32, batch, 24, temperature=0, speculate_k=k, stats=stats, **kwargs)
        assert [s.tolist() for s in spec] == [p.tolist() for p in plain]
    if drafter == "int4":  # the int4 copy of this Q4_1-born model agrees with it almost always
        assert stats["accepted_counts"][-1] > sum(stats["accepted_counts"][:-1])
    if drafter == "prompt-lookup":  # on text that repeats itself, drafts are verified and kept
        repeating = prompts[-1]
        stats = {}
        spec = generate(model_fp32, repeating, 24, temperature=0, speculate_k=k, stats=stats, **kwargs)
        assert spec.tolist() == generate(model_fp32, repeating, 24, temperature=0).tolist()
        kept = sum(i * c for i, c in enumerate(stats["accepted_counts"]))
        assert kept >= 23 * k / (k + 1) / 2, stats  # half of what drafting can give (k of each k + 1 tokens)


def test_stop_tokens_and_lengths(model_fp32, bundled_checkpoint, int4_draft):
    tokenizer = get_tokenizer(bundled_checkpoint)
    prompt = torch.tensor(tokenizer.encode_prompt("What is 2+2?", chat=True))
    plain = generate(model_fp32, prompt, 40, temperature=0, stop_ids=tokenizer.stop_ids)
    spec = generate(model_fp32, prompt, 40, temperature=0, stop_ids=tokenizer.stop_ids, drafter=DraftModel(int4_draft))
    assert spec.tolist() == plain.tolist()
    short = generate(model_fp32, prompt, 7, temperature=0, drafter=DraftModel(int4_draft), speculate_k=5)
    assert len(short) == len(prompt) + 7


def test_speculative_sampling_is_seeded_and_decodes_every_token_asked_for(model_fp32, prompts, int4_draft):
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append([o.tolist() for o in generate(model_fp32, prompts[:3], 20, temperature=0.9, top_k=100, top_p=0.95,
                                                  drafter=DraftModel(int4_draft), speculate_k=4)])
    assert runs[0] == runs[1]
    assert all(len(o) == len(p) + 20 for o, p in zip(runs[0], prompts[:3], strict=True))


def test_streamed_tokens_are_the_output(model_fp32, bundled_checkpoint, int4_draft):
    """callback works when speculating: each row's stream is its new tokens, ending at its stop token."""
    tokenizer = get_tokenizer(bundled_checkpoint)
    prompts = [torch.tensor(tokenizer.encode_prompt(q, chat=True)) for q in ("What is 2+2?", "Repeat: a b c a b c")]
    for drafter in (DraftModel(int4_draft), PromptLookup()):
        streamed = [[], []]
        outputs = generate(model_fp32, prompts, 30, temperature=0, stop_ids=tokenizer.stop_ids, drafter=drafter,
                           callback=lambda rows: [seen.extend(new) for seen, new in zip(streamed, rows)])
        assert [o[len(p):].tolist() for p, o in zip(prompts, outputs)] == streamed
        assert streamed[0][-1] in tokenizer.stop_ids


@pytest.mark.parametrize("max_new_tokens", [15, 20])
def test_lengths_up_to_the_context_run_speculatively(max_new_tokens):
    """A context that is no multiple of 64 (100 here): 80 tokens of prompt and up to 20 new ones fill
    it exactly, plain and speculative alike (a verify step's drafts past the end are discarded)."""
    torch.manual_seed(0)
    config = ModelArgs(vocab_size=64, n_layer=2, n_head=4, dim=32, block_size=100)
    target, draft = Transformer(config).eval(), Transformer(config).eval()
    prompt = torch.randint(0, 64, (80,))
    plain = generate(target, prompt, max_new_tokens, temperature=0)
    assert len(plain) == 80 + max_new_tokens
    for drafter in (DraftModel(target), DraftModel(draft), PromptLookup()):
        for k in (1, 5, 8):
            assert generate(target, prompt, max_new_tokens, temperature=0, drafter=drafter,
                            speculate_k=k).tolist() == plain.tolist()
    with pytest.raises(UserError, match="context length"):
        generate(target, prompt, 21, drafter=PromptLookup())
    for k in (1, 5):  # a tree's alternatives take k more slots while they are verified
        tree = DraftModel(draft, alternatives=1)
        if 80 + max_new_tokens + k <= 100:
            assert generate(target, prompt, max_new_tokens, temperature=0, drafter=tree,
                            speculate_k=k).tolist() == plain.tolist()
        else:
            with pytest.raises(UserError, match="positions of room"):
                generate(target, prompt, max_new_tokens, drafter=tree, speculate_k=k)
    with pytest.raises(UserError, match="lower --draft_alternatives"):  # as many alternatives as tokens
        generate(target, prompt[:20], 4, drafter=DraftModel(draft, alternatives=64), speculate_k=1)


# ---------------------------------------------------------------------------------------------
# Drafts with alternatives, verified as a tree


def near_copy(model: Transformer, noise: float) -> Transformer:
    """The model with noise on its output layer: its top token is often not the model's, and the
    model's is often among its next few, where alternatives find it."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        draft.output.weight.add_(torch.randn_like(draft.output.weight) * noise * draft.output.weight.std())
    return draft


def test_each_token_of_a_tree_sees_its_path():
    """A tree forward's logits at each token are those of a plain forward of the path to it (fp32)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, n_head=4, n_local_heads=2, dim=32, block_size=128)).eval()
    k, m, L = 3, 2, 7  # a text of L tokens, its last the root
    text, nodes = torch.randint(0, 64, (1, L)), torch.randint(0, 64, (1, k + k * m))
    tree = speculative.draft_tree(k, m)
    with torch.no_grad():
        model.setup_caches(1, 64)
        model(text[:, :-1], torch.arange(L - 1))
        x = torch.cat([text[:, -1:], nodes], dim=1)
        logits = model.logits(model.hidden_states(x, L - 1 + torch.arange(x.shape[1])[None], tree=tree))
        for i in range(x.shape[1]):
            path = x[:, tree[i]]  # its ancestors in order, then itself
            model.setup_caches(1, 64)
            plain = model(torch.cat([text[:, :-1], path], dim=1), torch.arange(L - 1 + path.shape[1]))
            torch.testing.assert_close(logits[:, i], plain[:, -1], rtol=1e-5, atol=1e-5)
        # compiled with the CPU forms, as the verify step runs: the same logits
        cpu_decode.apply(model)
        model.setup_caches(1, 64)
        model(text[:, :-1], torch.arange(L - 1))
        pos = L - 1 + torch.arange(x.shape[1])[None]
        step = torch.compile(decode.target_step, fullgraph=True, dynamic=False)
        compiled, _ = step(model, x, pos, decode.key_positions(model, L + x.shape[1]), tree)
        torch.testing.assert_close(compiled, logits, rtol=1e-4, atol=1e-4)


def test_greedy_acceptance_with_alternatives():
    k, m, V = 2, 2, 9
    best = torch.tensor([[5, 0, 0, 0, 1, 0, 0],  # d1 falls (5 is wanted): its second alternative stands
                         [3, 5, 6, 0, 0, 0, 0],  # d1 and d2 stand
                         [3, 4, 8, 0, 0, 0, 0],  # d1 stands, d2 falls, no alternative is 4
                         [3, 4, 7, 0, 0, 2, 0]])  # d1 stands, d2 falls, its first alternative is 4 and stands
    logits = torch.full((4, 1 + k + k * m, V), -1.0).scatter_(2, best[..., None], 1.0)
    drafts = torch.tensor([[1, 2], [3, 5], [3, 6], [3, 6]])
    alternatives = torch.tensor([[[4, 5], [7, 8]]] * 4)  # at depth 1: 4, 5; at depth 2: 7, 8
    alternatives[3, 1] = torch.tensor([4, 8])
    n, next_token, node = speculative.accept_greedy(logits, drafts, alternatives)
    assert n.tolist() == [1, 2, 1, 2] and node.tolist() == [4, 2, 1, 5] and next_token.tolist() == [1, 6, 4, 2]


@pytest.mark.parametrize("m", [1, 2])
def test_sampling_with_alternatives_draws_from_the_target(m):
    """The first token's law is the target's p at the root, and the token after a kept alternative
    follows the target's law at that alternative (chi-square). The draft drafts 0 most often and
    the target wants 1 or 2 more often: each rejected 0 offers 1, then 2, as alternatives; with one
    alternative, the token after a refused 1 comes from the residual."""
    torch.manual_seed(4321)
    k, V, N = 1, 5, 60000
    p = torch.distributions.Dirichlet(torch.ones(V)).sample((1 + k + k * m,))  # after the root, d1, alternatives
    p[0] = torch.tensor([0.1, 0.35, 0.3, 0.15, 0.1])
    q = torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]])
    drafts = torch.multinomial(q[0], N, replacement=True)[:, None]  # (N, 1)
    alternatives = speculative.with_alternatives(drafts, q.expand(N, V), m)[:, None, 1:]  # (N, 1, m)
    n, t, node = speculative.accept_sampled(p.expand(N, -1, -1), q.expand(N, k, V), drafts, alternatives)
    first = torch.where(n == 0, t, drafts[:, 0])
    kept_alternative = node > k
    first[kept_alternative] = alternatives[kept_alternative, 0].gather(1, (node - k - 1)[kept_alternative, None])[:, 0]
    groups = [(torch.ones(N, dtype=torch.bool), first, p[0])]
    groups += [(node == k + 1 + i, t, p[k + 1 + i]) for i in range(m)]  # after each alternative
    for rows, token, law in groups:
        assert rows.sum() > 3000
        counts = torch.bincount(token[rows], minlength=V).double()
        expected = law.double() * rows.sum()
        chi2 = ((counts - expected) ** 2 / expected).sum()
        p_value = torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64), chi2 / 2)
        assert p_value > 1e-4, (counts.tolist(), expected.tolist())


@pytest.mark.parametrize("m, kv_cache_dtype", [(1, None), (3, None), (3, torch.int8)])
def test_greedy_with_alternatives_is_plain_greedy(m, kv_cache_dtype):
    """A ragged batch; with an int8 cache, a kept alternative's levels and scales both move."""
    torch.manual_seed(0)
    target = Transformer(ModelArgs(vocab_size=64, n_layer=2, n_head=4, n_local_heads=2, dim=32, block_size=256)).eval()
    draft = near_copy(target, 0.6)
    prompts = [torch.randint(0, 64, (n,)) for n in (5, 9, 3)]
    plain = [o.tolist() for o in generate(target, prompts, 40, temperature=0, kv_cache_dtype=kv_cache_dtype)]
    for k in (1, 3, 5):
        stats = {}
        spec = generate(target, prompts, 40, temperature=0, drafter=DraftModel(draft, alternatives=m), speculate_k=k,
                        stats=stats, kv_cache_dtype=kv_cache_dtype)
        assert [o.tolist() for o in spec] == plain
        assert stats["alternatives_kept"] > 5, stats


@torch.no_grad()
def test_a_draft_of_the_targets_shape_drafts_in_its_caches_rings_included():
    """A draft model of the target's shape reads and writes the target's caches (sliding-window rings
    included), another draft keeps its own: both give plain greedy, prompts longer than the window;
    a copy of the target drafting in the target's caches has every draft kept."""
    torch.manual_seed(0)
    config = ModelArgs(vocab_size=64, n_layer=3, n_head=4, n_local_heads=2, dim=32, block_size=256,
                       sliding_window=8, sliding_layers=[0, 2])
    target, same_shape = Transformer(config).eval(), Transformer(config).eval()
    other_shape = Transformer(dataclasses.replace(config, n_layer=1)).eval()
    prompts = [torch.randint(0, 64, (40,)), torch.randint(0, 64, (13,))]
    plain = generate(target, prompts, 30, temperature=0)
    twin = copy.deepcopy(target)  # the target's weights in a model of its own
    for draft, shares in ((same_shape, True), (twin, True), (other_shape, False)):
        drafter = DraftModel(draft)
        for k, chunk in ((1, 8), (4, 256), (7, 8)):
            stats = {}
            spec = generate(target, prompts, 30, temperature=0, drafter=drafter, speculate_k=k, prefill_chunk=chunk,
                            stats=stats)
            assert [s.tolist() for s in spec] == [p.tolist() for p in plain]
            if draft is twin:
                assert sum(stats["accepted_counts"][:-1]) == 0, stats
        assert drafter.shares_caches == shares


@torch.no_grad()
def test_the_tokens_a_verify_step_adds_stop_at_max_new_tokens():
    """A twin of the target has all 5 drafts right, but 4 new tokens leave room for 3 after the first
    (the prefill's): the round counts 5 drafts found right and 3 tokens added, and says so."""
    torch.manual_seed(0)
    target = Transformer(ModelArgs(vocab_size=64, n_layer=2, n_head=4, dim=32, block_size=256)).eval()
    stats, prompt = {}, torch.tensor([1, 2, 3])
    spec = generate(target, prompt, 4, temperature=0, drafter=DraftModel(copy.deepcopy(target)), speculate_k=5,
                    stats=stats)
    assert len(spec) == 3 + 4
    assert stats["accepted_counts"] == [0, 0, 0, 0, 0, 1] and stats["verify_tokens"] == 3, stats
    assert "mean tokens per verify step 3.00" in speculative.format_stats(stats, 5)


@torch.no_grad()
def test_a_draft_in_the_targets_caches_follows_them_when_they_are_made_anew():
    """The target's caches remade smaller (another batch size) between two speculative calls: the
    draft then reads the new ones through their own position table, and needs none of its own."""
    torch.manual_seed(0)
    config = ModelArgs(vocab_size=100, n_layer=2, n_head=4, n_local_heads=2, dim=32, block_size=1024)
    target = Transformer(config).eval()
    drafter, prompt = DraftModel(copy.deepcopy(target)), torch.tensor([1, 2, 3, 4])
    generate(target, prompt, 300, temperature=0, drafter=drafter)
    generate(target, [prompt, prompt], 10, temperature=0)  # the target's caches: 2 rows, 64 positions
    spec = generate(target, prompt, 10, temperature=0, drafter=drafter)
    assert spec.tolist() == generate(target, prompt, 10, temperature=0).tolist()
    assert drafter.model.positions is target.positions
    assert drafter.model.layers[0].attention.kv_cache is target.layers[0].attention.kv_cache


def test_alternatives_on_a_sliding_window_model_are_refused():
    config = ModelArgs(vocab_size=64, n_layer=2, n_head=4, dim=32, block_size=128, sliding_window=16)
    model = Transformer(config).eval()
    with pytest.raises(UserError, match="sliding-window"):
        generate(model, torch.tensor([1, 2, 3]), 4, drafter=DraftModel(model, alternatives=1))


def test_a_new_drafter_is_one_class():
    """The loop knows no drafter's details: a drafter that always proposes the same tokens works, and
    one that leaves every other round to `steps` plain steps of the target (1 to k + 1)."""
    class Constant(speculative.Drafter):
        def __init__(self, steps: int = 0):
            self.steps, self.rounds = steps, 0

        def propose(self, tokens, lengths, k, **sampling):
            self.rounds += 1
            if self.steps and self.rounds % 2:
                return self.steps
            return torch.full((len(lengths), k), 7, device=tokens.device), None

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, n_head=4, dim=32, block_size=128)).eval()
    prompts = [torch.randint(0, 64, (n,)) for n in (5, 9)]
    plain = [o.tolist() for o in generate(model, prompts, 12, temperature=0)]
    for steps in (0, 1, 4):
        stats = {}
        out = generate(model, prompts, 12, temperature=0, drafter=Constant(steps), speculate_k=3, stats=stats)
        assert [o.tolist() for o in out] == plain, steps
        assert (stats["plain_steps"] > 0) == (steps > 0), stats
    with pytest.raises(UserError, match="drafter must be"):
        generate(model, prompts, 4, drafter="prompt_lookup")
    with pytest.raises(UserError, match="a round takes 1 to speculate_k"):
        generate(model, prompts, 4, drafter=Constant(5), speculate_k=3)


def test_draft_with_another_vocabulary_is_refused(model_fp32, prompts):
    other = Transformer(ModelArgs(vocab_size=1000, n_layer=1, n_head=2, dim=32, block_size=256))
    with pytest.raises(UserError, match="vocabulary"):
        generate(model_fp32, prompts[0], 8, drafter=DraftModel(other))


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 0, 0, 0], [1, 2, 3, 4, 1, 2, 3, 0, 0, 0]])
    lengths = torch.tensor([7, 7])
    drafts, found = speculative.prompt_lookup(tokens, lengths, k=2)
    assert found.tolist() == [True, True]
    assert drafts.tolist() == [[7, 8], [4, 1]]
    drafts, found = speculative.prompt_lookup(torch.tensor([[1, 2, 3, 4, 0]]), torch.tensor([4]), k=2)
    assert found.tolist() == [False]
    # periodic text: the period goes on past the end of the text, never into its padding
    drafts, found = speculative.prompt_lookup(torch.tensor([[5, 5, 5, 5, 0, 0], [1, 2, 1, 2, 1, 0]]),
                                              torch.tensor([4, 5]), k=4)
    assert found.tolist() == [True, True] and drafts.tolist() == [[5, 5, 5, 5], [2, 1, 2, 1]]


def test_prompt_lookup_backs_off_after_rejected_proposals():
    """After a verify step in which no row kept two drafts, plain steps before the next proposal: 2,
    8, 32, then 64 each time; a round that keeps two drafts drafts again at once."""
    drafter, tokens, length = PromptLookup(), torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]]), torch.tensor([8])
    drafter.start(None, tokens, length, 16)  # its last 2-gram repeats: every search finds it
    active, pauses = torch.tensor([True]), []
    proposal = drafter.propose(tokens, length, k=3)
    for _ in range(5):
        assert not isinstance(proposal, int)
        drafter.accepted(torch.tensor([1]), active, None)  # one draft kept of three
        steps = 0
        while isinstance(proposal := drafter.propose(tokens, length, k=3), int):
            steps += proposal
        pauses.append(steps)
    assert pauses == [2, 8, 32, 64, 64]
    drafter.accepted(torch.tensor([2]), active, None)
    assert not isinstance(drafter.propose(tokens, length, k=3), int)


def test_prompt_lookup_searches_less_while_it_finds_nothing(monkeypatch):
    searched_at = []  # the steps at which it searched
    search = speculative.prompt_lookup
    monkeypatch.setattr(speculative, "prompt_lookup",
                        lambda tokens, lengths, *a: searched_at.append(int(lengths) - 4) or search(tokens, lengths, *a))
    drafter = PromptLookup()
    tokens = torch.arange(40)[None]  # no n-gram repeats
    drafter.start(None, tokens, torch.tensor([4]), 40)
    step, rounds = 0, []
    while step < 30:  # a round: plain steps, the search's own and its pause's, at most k + 1 = 4
        rounds.append(drafter.propose(tokens, torch.tensor([4 + step]), k=3))
        step += rounds[-1]
    assert searched_at == [0, 2, 5, 9, 14, 20, 27]  # each pause one step longer
    assert rounds == [2, 3, 4, 4, 1, 4, 2, 4, 3, 4]
    tokens[0, 30:32] = tokens[0, 10:12]  # a repeat: found at the next search, which resets the pause
    assert drafter.skip > 0  # still pausing
    for _ in range(3):  # no pause is longer than 8 steps, 4 a round
        if not isinstance(proposal := drafter.propose(tokens, torch.tensor([32]), k=3), int):
            break
    assert proposal[0].tolist() == [[12, 13, 14]] and drafter.misses == 0


def test_greedy_acceptance():
    logits = torch.full((2, 4, 6), -1.0)
    best = torch.tensor([[3, 1, 2, 5], [0, 4, 4, 1]])  # the target's argmax after cur, d1, d2, d3
    logits.scatter_(2, best[..., None], 1.0)
    drafts = torch.tensor([[3, 1, 0], [1, 4, 4]])
    n, next_token, node = speculative.accept_greedy(logits, drafts)
    assert n.tolist() == [2, 0] and next_token.tolist() == [2, 0] and node.tolist() == [2, 0]


# ---------------------------------------------------------------------------------------------
# Rejection sampling reproduces the target's distribution: chi-square per position


def one_hot(i, V):
    return torch.nn.functional.one_hot(torch.tensor(i), V).float()


CASES = {  # (target p, draft q) per position, vocabulary of 5
    "p equals q": lambda g: (lambda p: (p, p[:-1]))(torch.distributions.Dirichlet(torch.ones(5)).sample((4,))),
    "disjoint supports": lambda g: (torch.tensor([[0.5, 0.5, 0, 0, 0]] * 4), torch.tensor([[0, 0, 0.3, 0.3, 0.4]] * 3)),
    "one-hot draft": lambda g: (torch.distributions.Dirichlet(torch.ones(5)).sample((4,)),
                                torch.stack([one_hot(1, 5), one_hot(3, 5), one_hot(0, 5)])),
    "draft zero where target is not": lambda g: (torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0]] * 4),
                                                 torch.tensor([[0.0, 0.0, 0.5, 0.5, 0.0]] * 3)),
    "target zero where draft is not": lambda g: (torch.tensor([[0.0, 0.0, 0.6, 0.4, 0.0]] * 4),
                                                 torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0]] * 3)),
}


@pytest.mark.parametrize("case", CASES)
def test_speculative_sampling_reproduces_the_target_distribution(case):
    torch.manual_seed(1234)  # reproducible; the bound is on a p-value, not on these draws
    p, q = CASES[case](None)  # p: (k + 1, V), q: (k, V)
    N, k, V = 40000, q.shape[0], p.shape[1]
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True) for j in range(k)], dim=1)  # (N, k)
    n, t, _ = speculative.accept_sampled(p.expand(N, k + 1, V), q.expand(N, k, V), drafts)
    for j in range(k + 1):  # the token emitted at position j, in the rows that reach it
        reached = n >= j
        token = torch.where(n > j, drafts[:, min(j, k - 1)], t) if j < k else t
        counts = torch.bincount(token[reached], minlength=V).double()
        expected = p[j].double() * reached.sum()
        assert (counts[expected == 0] == 0).all(), (case, j, counts)
        support = expected > 0
        chi2 = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
        dof = int(support.sum()) - 1
        if dof > 0 and reached.sum() > 1000:
            p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2)
            assert p_value > 1e-4, (case, j, counts.tolist(), expected.tolist())


@torch.no_grad()
def test_compiled_steps_give_plain_greedy():
    """What `generate.py --compile --draft ...` runs on CPU: the compiled decode, draft and verify steps
    (fp32) give plain greedy's tokens, with prompt lookup and with a draft model in the target's caches."""
    torch.manual_seed(0)
    target = Transformer(ModelArgs(vocab_size=64, n_layer=2, n_head=4, n_local_heads=2, dim=32, block_size=256)).eval()
    cpu_decode.apply(target)  # as load_model gives it
    prompts = [torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 1, 2]), torch.randint(0, 64, (13,))]
    plain = generate(target, prompts, 24, temperature=0)
    steps = compiled_steps()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for drafter in (PromptLookup(), DraftModel(copy.deepcopy(target))):
        spec = generate(target, prompts, 24, temperature=0, drafter=drafter, speculate_k=3, steps=steps)
        assert [s.tolist() for s in spec] == [p.tolist() for p in plain], drafter
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= graphs + 3  # plain, verify and draft steps
