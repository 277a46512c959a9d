"""The arithmetic task, checked against Python's own parser and exact fractions."""

import ast
import re
from fractions import Fraction

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lime_model import LimeConfig, LimeForCausalLM
from lime_model.tasks import arithmetic as A
from lime_model.tokenization import char_tokenizer


def to_python(expr: str) -> str:
    return expr.replace("×", "*").replace("÷", "/")


def fraction_value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    ops = {
        ast.Add: lambda a, b: a + b,
        ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b,
    }
    return ops[type(node.op)](fraction_value(node.left), fraction_value(node.right))


def binops(tree: ast.AST) -> list[ast.BinOp]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.BinOp)]


def expected_next(line: str) -> str:
    """Reduce the leftmost operation whose operands are both numbers in Python's parse of ``line``."""
    py = to_python(line)
    tree = ast.parse(py, mode="eval")
    ready = [
        n for n in binops(tree) if isinstance(n.left, ast.Constant) and isinstance(n.right, ast.Constant)
    ]
    node = min(ready, key=lambda n: n.left.col_offset)
    value = fraction_value(node)
    assert value.denominator == 1 and value >= 0, f"non-natural intermediate {value} in {line}"
    start, end = node.left.col_offset, node.right.end_col_offset
    if start > 0 and end < len(py) and py[start - 1] == "(" and py[end] == ")":
        start, end = start - 1, end + 1
    return (py[:start] + str(value.numerator) + py[end:]).replace("*", "×").replace("/", "÷")


def check_sample(s: A.Sample) -> None:
    assert s.prompt.endswith("=") and s.prompt.count("=") == 1
    expr = s.prompt[:-1]
    assert len(re.findall(r"\d+", expr)) == s.n_operators + 1
    tree = ast.parse(to_python(expr), mode="eval")
    assert len(binops(tree)) == s.n_operators  # the tier, counted by Python's parser
    for node in binops(tree):  # every intermediate value of the original expression is a natural number
        v = fraction_value(node)
        assert v.denominator == 1 and v >= 0
    lines = [expr] + s.solution.split("\n=")
    assert len(lines) == s.n_operators + 1  # the expression, then one reduction per line
    for prev, nxt in zip(lines, lines[1:], strict=False):
        assert nxt == expected_next(prev), f"{prev!r} -> {nxt!r}"
        assert fraction_value(ast.parse(to_python(nxt), mode="eval").body) == fraction_value(tree.body)
    assert lines[-1] == str(s.answer) == str(fraction_value(tree.body).numerator)


APPENDIX_B = "(7+5)÷(6+4×3-2×7)"  # the paper's Appendix B example: 7 numbers, 6 operators


def test_issue_example_exact_format():
    s = A.make_sample(APPENDIX_B)
    assert s.n_operators == 6 and s.answer == 3
    assert s.text == "(7+5)÷(6+4×3-2×7)=12÷(6+4×3-2×7)\n=12÷(6+12-2×7)\n=12÷(18-2×7)\n=12÷(18-14)\n=12÷4\n=3"
    check_sample(s)


def to_tree(node: ast.AST):
    """Python's parse as the generator's tree: an int leaf or (op, left, right)."""
    if isinstance(node, ast.Constant):
        return node.value
    op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "×", ast.Div: "÷"}[type(node.op)]
    return (op, to_tree(node.left), to_tree(node.right))


def test_appendix_b_example_is_a_possible_sample_of_the_6_operator_tier():
    body = ast.parse(to_python(APPENDIX_B), mode="eval").body
    tree = to_tree(body)
    leaves = [n.value for n in ast.walk(body) if isinstance(n, ast.Constant)]
    assert len(binops(body)) == 6 and len(leaves) == 7 and all(1 <= v <= 9 for v in leaves)
    # the generator draws every tree of 7 leaves in 1..9 with any operators; it keeps this one
    # (all intermediate values natural and <= max_value) and writes it back as the paper does
    assert A._in_range(tree, max_value=1000)
    assert A._render(tree) == APPENDIX_B


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_every_step_is_the_leftmost_legal_reduction(n):
    samples = A.generate(n, 150, seed=3)
    for s in samples:
        check_sample(s)
    parsed = [len(binops(ast.parse(to_python(s.prompt[:-1]), mode="eval"))) for s in samples]
    assert parsed == [n] * len(samples)  # the tier counts operators
    text = "".join(s.prompt for s in samples)
    assert all(
        op in text for op in ("+-×÷()" if n > 1 else "+-×÷")
    )  # every operator (and parentheses) occurs
    assert len({s.prompt for s in samples}) == len(samples)


def test_seeded_and_disjoint_splits():
    train, test = A.make_splits([4, 5, 6], 200, 50, seed=7)
    assert [s.n_operators for s in test] == [4] * 50 + [5] * 50 + [6] * 50
    assert not {s.prompt for s in train} & {s.prompt for s in test}
    again, _ = A.make_splits([4, 5, 6], 200, 50, seed=7)
    assert [s.text for s in again] == [s.text for s in train]
    other, _ = A.make_splits([4, 5, 6], 200, 50, seed=8)
    assert [s.text for s in other] != [s.text for s in train]


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_operators"):
        A.generate(0, 5)
    with pytest.raises(ValueError, match="distinct"):
        A.generate(1, 5, max_operand=1)  # only 1+1, 1-1, 1×1, 1÷1 exist


def test_char_tokenizer_roundtrip_through_autotokenizer(tmp_path):
    char_tokenizer(A.CHARS).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    s = A.generate(6, 1, seed=0)[0]
    ids = tok.encode(s.text, add_special_tokens=False)
    assert len(ids) == len(s.text)  # one token per character, newlines included
    assert tok.decode(ids) == s.text
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


def test_encode_masks_prompt_and_padding():
    tok = char_tokenizer(A.CHARS)
    samples = A.generate(4, 3, seed=0)
    ids, labels = A.encode(samples, tok, seq_len=80)
    for i, s in enumerate(samples):
        n = len(s.text) + 2
        assert tok.decode(ids[i, :n].tolist()) == tok.bos_token + s.text + tok.eos_token
        assert (ids[i, n:] == tok.pad_token_id).all()
        target = labels[i][labels[i] != -100].tolist()
        assert tok.decode(target) == s.solution + tok.eos_token
        assert (labels[i, 1 + len(s.prompt) : n] == ids[i, 1 + len(s.prompt) : n]).all()
    with pytest.raises(ValueError, match="seq_len"):
        A.encode(samples, tok, seq_len=10)


def test_extract_answer():
    assert A.extract_answer("12÷4\n=3") == 3
    assert A.extract_answer("12÷4\n=") is None
    assert A.extract_answer("garbage") is None


def tiny_model(vocab: int, routing: str):
    """A random 3-layer LLaMA (transformers' own class) or LIMe."""
    torch.manual_seed(0)
    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    if routing == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    model = LimeForCausalLM(LimeConfig(routing=routing, **kw)).eval()
    with torch.no_grad():  # move routers off their identity init so that routing matters
        for name, p in model.named_parameters():
            if "router" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("routing", ["llama", "full", "none"])
def test_generation_matches_a_plain_greedy_loop_without_cache(routing):
    tok = char_tokenizer(A.CHARS)
    model = tiny_model(len(tok), routing)
    prompts = [s.prompt for s in A.generate(3, 2, seed=1) + A.generate(5, 2, seed=1)]
    got = A.generate_solutions(model, tok, prompts, max_new_tokens=12, batch_size=3)
    for prompt, text in zip(prompts, got, strict=True):
        ids = [tok.bos_token_id] + tok.encode(prompt, add_special_tokens=False)
        new = []
        with torch.no_grad():
            for _ in range(12):
                nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                new.append(nxt)
        assert text == tok.decode(new, skip_special_tokens=True)
    assert sum(len(t) for t in got) > 12  # real continuations, not immediate eos


class Oracle(torch.nn.Module):
    """Answers prompts it knows with the reference solution, others with a wrong one."""

    def __init__(self, tok, solutions: dict[str, str]):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tok, self.solutions = tok, solutions

    def generate(self, input_ids, attention_mask, max_new_tokens, **_):
        rows = []
        for row in input_ids:
            prompt = self.tok.decode(row, skip_special_tokens=True)
            new = self.tok.encode(self.solutions.get(prompt, "1+1\n=99999"), add_special_tokens=False)
            new = (new + [self.tok.eos_token_id] * max_new_tokens)[:max_new_tokens]
            rows.append(row.tolist() + new)
        return torch.tensor(rows)


def test_evaluate_counts_correct_answers_per_operator_count():
    tok = char_tokenizer(A.CHARS)
    four, five = A.generate(4, 8, seed=2), A.generate(5, 5, seed=2)
    known = four[:2] + five[:5]  # 2/8 and 5/5 right
    oracle = Oracle(tok, {s.prompt: s.solution for s in known})
    assert A.evaluate(oracle, tok, four + five, batch_size=4) == {4: 0.25, 5: 1.0}
