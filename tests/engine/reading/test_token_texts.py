"""TokenTexts.pieces_of: a step's pieces at once, the same as `piece` of each id, unknown ids decoded in order."""

from kvtui.engine.reading.token_texts import TokenTexts


def _texts():
    asked: list[list[int]] = []

    def resolve(ids: list[int]) -> dict[int, str]:
        asked.append(list(ids))
        return {i: f"<{i}>" for i in ids if i != 7}  # 7: a tokenizer that cannot decode it

    return TokenTexts(resolve, lazy=True), asked


def test_pieces_of_is_piece_of_each_id():
    ids = [3, 5, 3, -1, 7, 9, -2, 5]
    fast, asked_fast = _texts()
    slow, asked_slow = _texts()
    assert (
        fast.pieces_of(ids)
        == [slow.piece(i) for i in ids]
        == [
            "<3>",
            "<5>",
            "<3>",
            "<embeds>",
            "#7",
            "<9>",
            "?",
            "<5>",
        ]
    )
    assert asked_slow == [[3], [5], [7], [9]]  # each unknown id decoded once, in the order met
    assert asked_fast == [[3, 5, 7, 9]]  # the same ids in the same order, in one call
    assert fast.take_fresh() == slow.take_fresh()
    assert fast.pieces_of([9, 3]) == ["<9>", "<3>"]  # known now: nothing decoded again
    assert len(asked_fast) == 1


def test_pieces_of_without_a_tokenizer():
    texts = TokenTexts()  # nothing to decode with (a server's texts before /detokenize answered)
    assert texts.pieces_of([4, -1]) == ["#4", "<embeds>"]
    texts.learn({4: "four"})
    assert texts.pieces_of([4]) == ["four"]
