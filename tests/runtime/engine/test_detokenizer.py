"""Incremental detokenisation: no broken UTF-8, stop strings held back and cut."""

from tiny_models import byte_tokenizer

from plimsoll.runtime.engine.detokenizer import IncrementalDetokenizer


def feed(text: str, stop: list[str]) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    tok = byte_tokenizer()
    det = IncrementalDetokenizer(tok, [1], stop)
    deltas: list[str] = []
    found = None
    for tid in tok(text, add_special_tokens=False).input_ids:
        new = det.append(tid)
        found = det.find_stop(len(new))
        deltas.append(det.take_delta(found is not None))
        if found:
            break
    else:
        deltas.append(det.take_delta(True))
    return deltas, det, found


def test_multibyte_characters_are_never_split() -> None:
    text = "héllo € 🚢 plimsoll"
    deltas, det, _ = feed(text, [])
    assert "".join(deltas) == text == det.text
    assert all("\ufffd" not in d for d in deltas)
    assert len(byte_tokenizer()(text, add_special_tokens=False).input_ids) > len(text)  # really multi-token


def test_stop_string_is_cut_and_never_streamed() -> None:
    deltas, det, found = feed("the ship is loaded to the line", ["to the", "zzz"])
    assert found == "to the"
    assert det.text == "the ship is loaded "
    assert "".join(deltas) == det.text
