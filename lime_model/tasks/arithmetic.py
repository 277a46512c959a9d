"""The Arithmetic Expression Task (LIMe paper, Sec. 5.4.2 and Appendices A-B).

A sample is an expression over ``+ - × ÷`` and parentheses, followed by its step-by-step
solution, one reduction per line::

    (7+5)÷(6+4×3-2×7)=12÷(6+4×3-2×7)
    =12÷(6+12-2×7)
    =12÷(18-2×7)
    =12÷(18-14)
    =12÷4
    =3

The prompt is everything up to and including the first ``=``; the model must write the rest.
Each step computes the *leftmost legal* operation: one whose two operands are plain numbers and
which precedence and left-associativity allow to run now; a parenthesised group that has shrunk
to one number loses its parentheses. Every intermediate value is a non-negative integer no larger
than ``max_value`` (division is exact), so every line is an ordinary expression of naturals.
Expressions are random trees filtered by that rule (rejection sampling), so ``-`` and ``÷``,
which fail it more often, are rarer than ``+`` and ``×`` (about 2:1 and 3.5:1 with 4 operators).

Difficulty tiers count *operators*, as Feng et al. (whose task the paper follows) do and as the
paper's Appendix B example shows: ``(7+5)÷(6+4×3-2×7)`` has 7 numbers and 6 operators, a sample of
tier 6. An expression of ``k`` operators has ``k + 1`` numbers. This is a reading: Sec. 5.4.2's text
speaks of 4, 5 and 6 "operands".
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

OPS = "+-×÷"
PREC = {"+": 1, "-": 1, "×": 2, "÷": 2}
CHARS = "0123456789" + OPS + "()=\n"  # the character vocabulary of the task


@dataclass(frozen=True)
class Sample:
    """One expression of ``n_operators`` operators: ``prompt`` (ends with ``=``), ``solution`` (the
    steps), ``answer``."""

    n_operators: int
    prompt: str
    solution: str
    answer: int

    @property
    def text(self) -> str:
        return self.prompt + self.solution


# ---------------------------------------------------------------------------------------------
# expression trees: a leaf is an int, a node is (op, left, right)


def _value(tree) -> int | None:
    """Value of ``tree`` if every node is a natural number that divides exactly, else None."""
    if isinstance(tree, int):
        return tree
    op, left, right = tree
    a, b = _value(left), _value(right)
    if a is None or b is None:
        return None
    if op == "+":
        return a + b
    if op == "-":
        return a - b if a >= b else None
    if op == "×":
        return a * b
    return a // b if b != 0 and a % b == 0 else None


def _in_range(tree, max_value: int) -> bool:
    if isinstance(tree, int):
        return True
    value = _value(tree)
    return (
        value is not None
        and value <= max_value
        and _in_range(tree[1], max_value)
        and _in_range(tree[2], max_value)
    )


def _render(tree) -> str:
    """Infix text with only the parentheses needed to parse back to the same tree."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    left_s, right_s = _render(left), _render(right)
    if not isinstance(left, int) and PREC[left[0]] < PREC[op]:
        left_s = f"({left_s})"
    if not isinstance(right, int) and PREC[right[0]] <= PREC[op]:
        right_s = f"({right_s})"
    return left_s + op + right_s


def _random_tree(rng: random.Random, n_leaves: int, max_operand: int):
    """A random tree of ``n_leaves`` numbers in 1..``max_operand`` (so ``n_leaves - 1`` operators)."""
    if n_leaves == 1:
        return rng.randint(1, max_operand)
    n_left = rng.randint(1, n_leaves - 1)
    return (
        rng.choice(OPS),
        _random_tree(rng, n_left, max_operand),
        _random_tree(rng, n_leaves - n_left, max_operand),
    )


# ---------------------------------------------------------------------------------------------
# step-by-step reduction on token lists: ints, operator characters and parentheses


def tokenize_expression(text: str) -> list[int | str]:
    """``"12÷(6+4)"`` -> ``[12, "÷", "(", 6, "+", 4, ")"]``."""
    tokens: list[int | str] = []
    number = ""
    for ch in text:
        if ch.isdigit():
            number += ch
            continue
        if number:
            tokens.append(int(number))
            number = ""
        if ch not in OPS + "()":
            raise ValueError(f"unexpected character {ch!r} in expression {text!r}")
        tokens.append(ch)
    if number:
        tokens.append(int(number))
    return tokens


def _is_legal(tokens: list[int | str], k: int) -> bool:
    """Whether the operator at ``tokens[k]`` may be computed now."""
    if (
        k < 1
        or k + 1 >= len(tokens)
        or not (isinstance(tokens[k - 1], int) and isinstance(tokens[k + 1], int))
    ):
        return False
    before = tokens[k - 2] if k >= 2 else "("
    after = tokens[k + 2] if k + 2 < len(tokens) else ")"
    if PREC[str(tokens[k])] == 2:  # × ÷ run unless a × ÷ on their left must run first
        return before not in ("×", "÷")
    # + - run only as the first operation of their group and when no × ÷ binds their right operand
    return before == "(" and after not in ("×", "÷")


def reduce_once(tokens: list[int | str]) -> list[int | str]:
    """Compute the leftmost legal operation; drop parentheses left around a lone number."""
    k = next(k for k, t in enumerate(tokens) if t in PREC and _is_legal(tokens, k))
    a, op, b = tokens[k - 1], tokens[k], tokens[k + 1]
    assert isinstance(a, int) and isinstance(op, str) and isinstance(b, int)  # `_is_legal`
    value = {"+": lambda: a + b, "-": lambda: a - b, "×": lambda: a * b, "÷": lambda: a // b}[op]()
    out = tokens[: k - 1] + [value] + tokens[k + 2 :]
    i = k - 1
    if 0 < i < len(out) - 1 and out[i - 1] == "(" and out[i + 1] == ")":
        out = out[: i - 1] + [value] + out[i + 2 :]
    return out


def solution_steps(expression: str) -> list[str]:
    """Every line of the solution of ``expression``, ending with the bare answer."""
    tokens = tokenize_expression(expression)
    steps = []
    while len(tokens) > 1:
        tokens = reduce_once(tokens)
        steps.append("".join(str(t) for t in tokens))
    return steps


def make_sample(expression: str) -> Sample:
    """The sample (prompt, solution, answer) of one expression."""
    n_operators = sum(t in PREC for t in tokenize_expression(expression))
    steps = solution_steps(expression)
    return Sample(n_operators, expression + "=", "\n=".join(steps), int(steps[-1]))


# ---------------------------------------------------------------------------------------------
# data sets


def generate(
    n_operators: int,
    n_samples: int,
    seed: int = 0,
    max_operand: int = 9,
    max_value: int = 1000,
    exclude: set[str] | None = None,
) -> list[Sample]:
    """``n_samples`` distinct random expressions with ``n_operators`` operators (so one more number).

    Numbers are drawn from 1..``max_operand``; trees whose intermediate values are not naturals
    <= ``max_value`` are rejected. Expressions in ``exclude`` are skipped (to keep splits disjoint).
    """
    if n_operators < 1:
        raise ValueError(f"n_operators must be >= 1, got {n_operators}")
    n_leaves = n_operators + 1
    rng = random.Random(f"arithmetic-{seed}-{n_leaves}")  # keyed by the number count, as tiers once were
    seen = set(exclude or ())
    samples: list[Sample] = []
    tries = 0
    while len(samples) < n_samples:
        tries += 1
        if tries > 200 * n_samples + 10_000:
            raise ValueError(
                f"could only find {len(samples)} of {n_samples} distinct {n_operators}-operator expressions; "
                "raise max_operand or max_value"
            )
        tree = _random_tree(rng, n_leaves, max_operand)
        if not _in_range(tree, max_value):
            continue
        expression = _render(tree)
        if expression in seen:
            continue
        seen.add(expression)
        samples.append(make_sample(expression))
    return samples


def make_splits(
    operators: Sequence[int],
    train_per_tier: int,
    test_per_tier: int,
    seed: int = 0,
    max_operand: int = 9,
    max_value: int = 1000,
) -> tuple[list[Sample], list[Sample]]:
    """Disjoint (train, test) sets, ``*_per_tier`` samples of each operator count in ``operators``;
    the test expressions are drawn first and excluded from train."""
    train: list[Sample] = []
    test: list[Sample] = []
    for n in operators:
        test_n = generate(
            n, test_per_tier, seed=seed + 1_000_003, max_operand=max_operand, max_value=max_value
        )
        test += test_n
        train += generate(
            n,
            train_per_tier,
            seed=seed,
            max_operand=max_operand,
            max_value=max_value,
            exclude={s.prompt[:-1] for s in test_n},
        )
    return train, test


def recipe_splits(recipe, with_train: bool = True) -> tuple[list[Sample], list[Sample]]:
    """The (train, test) samples of a training recipe (`lime_model.recipes.Recipe`: its ``arithmetic``
    settings and ``seed``); train is empty unless ``with_train``, so the test set costs no training set."""
    cfg = recipe.arithmetic
    return make_splits(
        cfg.operators,
        cfg.train_per_tier if with_train else 0,
        cfg.test_per_tier,
        seed=recipe.seed,
        max_operand=cfg.max_operand,
        max_value=cfg.max_value,
    )


def encode(samples: Sequence[Sample], tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, labels)``, each (n_samples, seq_len) int64.

    A row is ``bos prompt solution eos pad...``; labels are -100 on the prompt and the padding,
    so the loss is on the solution and the eos only.
    """
    input_ids = torch.full((len(samples), seq_len), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), seq_len), -100, dtype=torch.long)
    for i, s in enumerate(samples):
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(s.prompt, add_special_tokens=False)
        target = tokenizer.encode(s.solution, add_special_tokens=False) + [tokenizer.eos_token_id]
        row = prompt + target
        if len(row) > seq_len:
            raise ValueError(f"sample of {len(row)} tokens does not fit seq_len={seq_len}: {s.prompt}")
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(prompt) : len(row)] = torch.tensor(target)
    return input_ids, labels


def extract_answer(generated: str) -> int | None:
    """The final answer in a generated solution: the number after its last ``=``, else None."""
    last = generated.rsplit("=", 1)[-1].strip()
    return int(last) if last.isdigit() else None


@torch.no_grad()
def generate_solutions(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 256,
    progress: bool = False,
) -> list[str]:
    """Greedy continuations of ``prompts`` (with the KV cache), cut at eos, special tokens dropped.

    Prompts get a bos and are left-padded into batches of ``batch_size``.
    """
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    texts: list[str] = []
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc="generate", disable=not progress):
            batch = [tokenizer.bos_token + p for p in prompts[start : start + batch_size]]
            enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                use_cache=True,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return texts


def evaluate(
    model,
    tokenizer,
    samples: Sequence[Sample],
    batch_size: int = 256,
    max_new_tokens: int | None = None,
    progress: bool = False,
) -> dict[int, float]:
    """Accuracy of the final answer per operator count (tier), by greedy open-ended generation.

    ``max_new_tokens`` defaults to the longest reference solution plus 8 characters.
    """
    if not samples:
        raise ValueError("evaluate needs at least one sample")
    if max_new_tokens is None:
        max_new_tokens = max(len(s.solution) for s in samples) + 8
    texts = generate_solutions(
        model, tokenizer, [s.prompt for s in samples], max_new_tokens, batch_size, progress
    )
    correct: dict[int, int] = {}
    total: dict[int, int] = {}
    for s, text in zip(samples, texts, strict=True):
        total[s.n_operators] = total.get(s.n_operators, 0) + 1
        correct[s.n_operators] = correct.get(s.n_operators, 0) + (extract_answer(text) == s.answer)
    return {n: correct[n] / total[n] for n in sorted(total)}
