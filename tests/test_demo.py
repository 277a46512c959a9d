"""The demo: number occurrences are found as defined, and the whole pipeline runs end to end (quick)."""

from __future__ import annotations

import torch

from lime_probe.demo import number_positions, number_rows


def _scan(text: str, numbers) -> list[tuple[int, int]]:
    """Plain character loop: each maximal digit run, reported at its last character."""
    out, i = [], 0
    while i < len(text):
        if text[i].isdigit():
            j = i
            while j + 1 < len(text) and text[j + 1].isdigit():
                j += 1
            if int(text[i : j + 1]) in numbers:
                out.append((j, int(text[i : j + 1])))
            i = j + 1
        else:
            i += 1
    return out


def test_number_positions_on_characters_match_a_plain_scan():
    text = "(3+100)÷4=103÷4\n=1×2+12+1=41+101\n=3"
    numbers = {1, 2, 3, 4, 100, 101, 102, 103}
    got = number_positions(list(text), numbers)
    assert got == _scan(text, numbers)
    assert (12, 103) in got and all(n != 12 and n != 41 for _, n in got)  # 12, 41 are not asked for


def test_number_positions_with_multichar_tokens_pick_the_last_token():
    pieces = ["<s>", "x", "=", "10", "3", "+", "2", "!"]  # "103" split over two tokens
    assert number_positions(pieces, {103, 2}) == [(4, 103), (6, 2)]
    assert number_positions(pieces, {10, 3}) == []  # parts of a larger number do not count


def test_number_rows_maps_to_global_rows():
    from lime_model.tasks.arithmetic import CHARS
    from lime_model.tokenization import char_tokenizer

    tok = char_tokenizer(CHARS)
    texts = ["1+2=3", "100+3=103"]
    ids = [tok(t)["input_ids"] for t in texts]
    offsets = torch.tensor([0, len(ids[0]), len(ids[0]) + len(ids[1])])
    rows, labels = number_rows(offsets, torch.tensor(ids[0] + ids[1]), tok, {1, 3, 103})
    assert rows.tolist() == [0, 4, 5 + 4, 5 + 8] and labels.tolist() == [1, 3, 3, 103]
