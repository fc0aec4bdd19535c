"""Speculative sampling end to end: through generate(), with a ragged batch and a stop token, the joint
law of the first new tokens is exactly the target's own, as enumerated from the target model.

A tiny random target (vocabulary 8) makes the law enumerable: at most 8^3 continuations of 3 tokens,
fewer once a continuation ends at the stop token (a row ends after its first stop token, so an
outcome is a tuple of up to 3 tokens, ending early only at the stop). Each case draws some tens of
thousands of rows through generate(..., drafter=...) and compares the outcome counts with the exact
law: a chi-square test over the outcomes (rare ones pooled), and no outcome of probability 0 at all.
The bound is on a p-value; the seed only makes a run reproducible.
"""

import dataclasses
import itertools
import math
import zlib
from collections import Counter

import pytest
import torch

from fastllama import decode, speculative
from fastllama.generate import generate
from fastllama.model import ModelArgs, Transformer
from fastllama.speculative import DraftHead, DraftModel, HeadDrafter, PromptLookup

V = 8
CONFIG = ModelArgs(vocab_size=V, n_layer=2, n_head=4, n_local_heads=2, dim=32, block_size=64,
                   intermediate_size=64)  # a small feed-forward: cheap on CPU for 10000 rows a call
HEAD_SCALE = 2.0  # sharpens the random head: next-token laws far from uniform, yet no token near 0
HORIZON = 3  # new tokens a row: the law of (t1, t2, t3)
STOP = 4  # each row ends after its first 4: a quarter to a third of the rows end early
# Two prompts of different lengths (a ragged batch) that repeat themselves, so that prompt lookup
# finds the last n-gram earlier in the text and drafts (the second only once its text goes on with
# 4: then "5 4" recurs); it holds the stop token, which must not end a row when it is in the prompt.
# Short prompts: prefilling 10000 rows is most of a generate() call's time.
PROMPTS = ([1, 2, 3, 1, 2], [5, 4, 5])
ROWS = 5000  # rows per prompt in one generate() call: a batch of 10000, interleaving the two prompts
CALLS = 3  # generate() calls per case: 15000 rows per prompt, 30000 per case
MIN_EXPECTED = 5  # outcomes expected fewer times than this are pooled into one bin
ALPHA = 1e-4

PLAIN = dict(temperature=1.0)
FILTERED = dict(temperature=0.7, top_k=5, top_p=0.9)


def tiny_model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(CONFIG).eval()
    with torch.no_grad():
        model.output.weight.mul_(HEAD_SCALE)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small ops on many rows: one thread runs them fastest, and two can crawl (5-70x slower here, on
    2 cores shared with other work, where the threads wait for each other at every op)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def draft():
    """Another random model: it proposes what the target often would not, so drafts are both kept
    and rejected, and the residual distribution is sampled often."""
    return tiny_model(1)


# ---------------------------------------------------------------------------------------------
# The exact law, enumerated


@torch.no_grad()
def next_token_logits(model: Transformer, sequences: list[list[int]]) -> torch.Tensor:
    """The model's logits (B, V) for the token after each sequence (all of one length), fp32, no
    cache reuse: each sequence is prefilled from position 0."""
    model.setup_caches(max_batch_size=len(sequences), max_seq_length=CONFIG.block_size)
    x = torch.tensor(sequences)
    return model(x, torch.arange(x.shape[1]))[:, -1].float()


def filter_margin(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                  top_p: float | None = None) -> float:
    """How far these logits are from flipping a top-k or top-p decision (in scaled logits for top-k,
    in probability for top-p): the batched and speculative forwards round differently from the
    enumeration's, and a token kept on one side and dropped on the other would be a false alarm."""
    margin = math.inf
    z = ((logits - logits.amax(-1, keepdim=True)) / temperature).sort(-1, descending=True).values
    if top_k is not None and top_k < V:
        margin = min(margin, float((z[:, top_k - 1] - z[:, top_k]).min()))
        z[:, top_k:] = -math.inf
    if top_p is not None and top_p < 1:
        probs = z.softmax(-1)
        margin = min(margin, float(((probs.cumsum(-1) - probs) - top_p).abs().min()))
    return margin


def exact_law(model: Transformer, prompt: list[int], sampling: dict, stop: int = STOP,
              horizon: int = HORIZON) -> dict[tuple[int, ...], float]:
    """P(outcome | prompt) for every outcome of nonzero probability: an outcome is the new tokens up
    to `horizon` of them, ending early at the first stop token. The product of the filtered
    next-token probabilities (decode.logits_to_probs, as generate samples them) along the way."""
    law, frontier = {}, {(): 1.0}
    for step in range(horizon):
        prefixes = list(frontier)
        logits = next_token_logits(model, [prompt + list(s) for s in prefixes])
        assert filter_margin(logits, **sampling) > 1e-3, "a filtering decision is too close to call"
        probs = decode.logits_to_probs(logits, **sampling).double()
        extended = {}
        for prefix, row in zip(prefixes, probs.tolist()):
            for token, p in enumerate(row):
                if p == 0:
                    continue  # absent from the law: probability 0
                outcome = prefix + (token,)
                if token == stop or step == horizon - 1:
                    law[outcome] = frontier[prefix] * p
                else:
                    extended[outcome] = frontier[prefix] * p
        frontier = extended
    assert abs(sum(law.values()) - 1) < 1e-6
    return law


# ---------------------------------------------------------------------------------------------
# The statistic


def chi_square(counts: Counter, law: dict[tuple, float]) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom for counts of outcomes against their law: one
    bin per outcome expected at least MIN_EXPECTED times, and one for all the others together."""
    n = sum(counts.values())
    bins, pooled_expected, pooled_count = [], 0.0, 0
    for outcome, p in law.items():
        if n * p >= MIN_EXPECTED:
            bins.append((counts[outcome], n * p))
        else:
            pooled_expected += n * p
            pooled_count += counts[outcome]
    if pooled_expected > 0:
        if pooled_expected < MIN_EXPECTED and bins:  # too small a bin alone: merge the smallest other into it
            smallest = min(range(len(bins)), key=lambda i: bins[i][1])
            count, expected = bins.pop(smallest)
            pooled_count, pooled_expected = pooled_count + count, pooled_expected + expected
        bins.append((pooled_count, pooled_expected))
    chi2 = sum((c - e) ** 2 / e for c, e in bins)
    return chi2, len(bins) - 1


def p_value(chi2: float, dof: int) -> float:
    """P(X >= chi2) for X chi-square with dof degrees of freedom: the regularized upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def goodness_of_fit(samples: list[Counter], laws: list[dict]) -> tuple[float, float, int]:
    """One test over all prompts together (each prompt's bins against its own law, each prompt's
    total fixed, so one degree of freedom fewer per prompt). Asserts first that nothing of probability
    0 occurred. Returns the p-value, the statistic and its degrees of freedom."""
    chi2, dof = 0.0, 0
    for i, (counts, law) in enumerate(zip(samples, laws)):
        impossible = {o: c for o, c in counts.items() if o not in law}
        assert not impossible, f"prompt {i}: outcomes of probability 0 occurred: {impossible}"
        c, d = chi_square(counts, law)
        chi2, dof = chi2 + c, dof + d
    return p_value(chi2, dof), chi2, dof


def draw(model: Transformer, sampling: dict, drafter=None, speculate_k: int = 5, rows: int = ROWS,
         calls: int = CALLS, stats: list | None = None) -> list[Counter]:
    """Outcome counts per prompt from `calls` generate() calls on a ragged batch: the prompts
    interleaved, `rows` rows each."""
    counts = [Counter() for _ in PROMPTS]
    prompts = [torch.tensor(PROMPTS[i % len(PROMPTS)]) for i in range(rows * len(PROMPTS))]
    for _ in range(calls):
        call_stats = {}
        outputs = generate(model, prompts, HORIZON, **sampling, stop_ids=[STOP], drafter=drafter,
                           speculate_k=speculate_k, stats=call_stats)
        if stats is not None:
            stats.append(call_stats)
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            assert output[: len(prompt)].tolist() == prompt.tolist()
            counts[i % len(PROMPTS)][tuple(output[len(prompt):].tolist())] += 1
    return counts


@pytest.fixture(scope="module")
def laws(target):
    return {name: [exact_law(target, p, sampling) for p in PROMPTS]
            for name, sampling in (("plain", PLAIN), ("filtered", FILTERED))}


# ---------------------------------------------------------------------------------------------
# The tests


class LookupEveryOtherRound(PromptLookup):
    """Prompt lookup that leaves every other round to two plain steps of the target: within a row's
    3 tokens, verify rounds and plain steps follow one another, and a stop token may come between
    the two plain steps of a round."""

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        self.round = 0

    def propose(self, tokens, lengths, k, **sampling):
        self.round += 1
        return 2 if self.round % 2 == 0 else super().propose(tokens, lengths, k, **sampling)


def random_head() -> DraftHead:
    """A draft head with random weights over 6 of the 8 tokens: tokens 4 and 6 are never drafted."""
    torch.manual_seed(2)
    return DraftHead(DraftHead.config_for(CONFIG, 6), torch.tensor([0, 1, 2, 3, 5, 7])).eval()


def other_shape_draft() -> Transformer:
    """A draft model of another shape than the target's: it keeps caches of its own."""
    torch.manual_seed(3)
    return Transformer(dataclasses.replace(CONFIG, n_layer=1)).eval()


DRAFTERS = {"draft-model": lambda draft: DraftModel(draft), "prompt-lookup": lambda draft: PromptLookup(),
            "draft-model-other-shape": lambda draft: DraftModel(other_shape_draft()),
            "lookup-every-other-round": lambda draft: LookupEveryOtherRound(),
            "draft-head": lambda draft: HeadDrafter(random_head()),
            "draft-model-alternatives": lambda draft: DraftModel(draft, alternatives=2),
            "draft-head-alternatives": lambda draft: HeadDrafter(random_head(), alternatives=1)}
CASES = [  # drafter, sampling, speculate_k: k varies so that a row's 3 tokens take 1 to 3 rounds
    pytest.param("draft-model", "plain", 2, id="draft-model-T1-k2"),
    pytest.param("draft-model", "filtered", 3, id="draft-model-T0.7-topk5-topp0.9-k3"),
    pytest.param("draft-model-other-shape", "plain", 3, id="draft-model-of-another-shape-T1-k3"),
    pytest.param("prompt-lookup", "plain", 4, id="prompt-lookup-T1-k4"),
    pytest.param("prompt-lookup", "filtered", 1, id="prompt-lookup-T0.7-topk5-topp0.9-k1"),
    pytest.param("lookup-every-other-round", "plain", 2, id="lookup-every-other-round-T1-k2"),
    pytest.param("draft-head", "plain", 2, id="draft-head-T1-k2"),
    pytest.param("draft-head", "filtered", 3, id="draft-head-T0.7-topk5-topp0.9-k3"),
    pytest.param("draft-model-alternatives", "plain", 2, id="draft-model-2-alternatives-T1-k2"),
    pytest.param("draft-head-alternatives", "filtered", 3, id="draft-head-1-alternative-T0.7-topk5-topp0.9-k3"),
]


def worst_outcomes(samples: list[Counter], laws: list[dict], n: int = 8) -> list[tuple]:
    """For a failure message: the outcomes whose counts stray furthest from their expectation, as
    (prompt, outcome, count, expected)."""
    rows = [(i, o, counts[o], sum(counts.values()) * law[o]) for i, (counts, law) in enumerate(zip(samples, laws))
            for o in law]
    return sorted(rows, key=lambda r: -abs(r[2] - r[3]) / math.sqrt(r[3]))[:n]


@pytest.mark.parametrize("drafter_name, sampling_name, k", CASES)
def test_speculative_sampling_has_the_targets_joint_law(drafter_name, sampling_name, k, target, draft, laws):
    sampling = {"plain": PLAIN, "filtered": FILTERED}[sampling_name]
    torch.manual_seed(zlib.crc32(f"{drafter_name} {sampling_name} {k}".encode()))  # one seed a case
    stats = []
    samples = draw(target, sampling, DRAFTERS[drafter_name](draft), speculate_k=k, stats=stats)

    # the drafts were verified, and both kept and rejected: rejection sampling is what is under test
    accepted = [sum(column) for column in zip(*(s["accepted_counts"] for s in stats))]
    plain_steps = sum(s["plain_steps"] for s in stats)
    assert accepted[0] > 0 and sum(accepted[1:]) > 0, stats
    if drafter_name == "lookup-every-other-round":
        assert plain_steps > 0, stats
    if drafter_name.endswith("alternatives"):  # and alternatives stood in for rejected drafts
        assert sum(s["alternatives_kept"] for s in stats) > 0.05 * CALLS * ROWS * len(PROMPTS), stats
    ended_early = sum(c for counts in samples for o, c in counts.items() if len(o) < HORIZON)
    assert ended_early > 0.1 * CALLS * ROWS * len(PROMPTS)  # the stop token ended many rows early

    p, chi2, dof = goodness_of_fit(samples, laws[sampling_name])
    print(f"{drafter_name} {sampling_name} k={k}: chi2 {chi2:.1f}, dof {dof}, p {p:.4f}; verify rounds by "
          f"accepted drafts {accepted}, plain steps {plain_steps}")
    assert p > ALPHA, (p, chi2, dof, worst_outcomes(samples, laws[sampling_name]))


# ---------------------------------------------------------------------------------------------
# The test can fail: the same machinery rejects draws from another law


def multinomial_outcomes(law: dict[tuple, float], n: int) -> Counter:
    outcomes = list(law)
    draws = torch.multinomial(torch.tensor([law[o] for o in outcomes]), n, replacement=True)
    return Counter(outcomes[i] for i in draws.tolist())


def test_the_statistic_rejects_another_law_and_accepts_the_law(target, laws):
    """Exact draws at temperature 1.1 (as many a prompt as a case draws) are rejected against the law
    at temperature 1.0; exact draws at 1.0 are accepted."""
    torch.manual_seed(7)
    n = CALLS * ROWS
    hotter = [exact_law(target, p, dict(temperature=1.1)) for p in PROMPTS]
    p, chi2, dof = goodness_of_fit([multinomial_outcomes(law, n) for law in hotter], laws["plain"])
    print(f"temperature 1.1 against 1.0: chi2 {chi2:.1f}, dof {dof}, p {p:.3g}")
    assert p < ALPHA, (p, chi2, dof)
    p, chi2, dof = goodness_of_fit([multinomial_outcomes(law, n) for law in laws["plain"]], laws["plain"])
    print(f"exact draws: chi2 {chi2:.1f}, dof {dof}, p {p:.4f}")
    assert p > ALPHA, (p, chi2, dof)
    # a single outcome of probability 0 fails, whatever the rest: a token the filters drop, or a row
    # that ends early without a stop token
    dropped = next(o for o in itertools.product(range(V), repeat=HORIZON)
                   if STOP not in o[:-1] and o not in laws["filtered"][0])
    no_stop = (STOP + 1,)
    for outcome in (dropped, no_stop):
        with pytest.raises(AssertionError, match="probability 0"):
            goodness_of_fit([Counter({outcome: 1}) for _ in PROMPTS], laws["filtered"])


def test_the_end_to_end_test_catches_a_wrong_residual(target, draft, laws, monkeypatch):
    """The classic bug: at a rejection, sample from the target's p instead of normalize(max(0, p - q)).
    The output then follows min(p, q) + (1 - sum min(p, q)) p, not p, and the end-to-end statistic
    says so, on a sixth of a case's rows."""
    accept_sampled = speculative.accept_sampled

    def resample_from_target(target_probs, draft_probs, drafts, alternatives=None):
        n, _, node = accept_sampled(target_probs, draft_probs, drafts)
        rows = torch.arange(len(n), device=n.device)
        return n, decode.sample_from(target_probs[rows, n])[:, 0], node

    monkeypatch.setattr(speculative, "accept_sampled", resample_from_target)
    torch.manual_seed(11)
    samples = draw(target, PLAIN, DraftModel(draft), speculate_k=2, rows=ROWS // 2, calls=1)
    p, chi2, dof = goodness_of_fit(samples, laws["plain"])
    print(f"residual sampled from p: chi2 {chi2:.1f}, dof {dof}, p {p:.3g}")
    assert p < ALPHA, (p, chi2, dof)
