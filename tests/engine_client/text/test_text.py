"""The vocabulary (DeepSeek-V3.2's tokenizer, chat format, model vocabulary size) and the
incremental detokenizer: UTF-8 characters split across tokens, stop strings across tokens."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from engine_client.text import vocabulary
from engine_client.text.chat import PLAIN, ChatMessage
from engine_client.text.detokenizer import TextStream

VOCAB = vocabulary.load()
# Byte-level BPE splits these characters across tokens: 🙃 is 'ðŁĻ' + 'ĥ', ÿ is 'ĠÃ' + '¿'.
SPLIT_TEXT = "héllo 你好世界 🙂🙃 ÿ"


def stream_all(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.push(t) for t in ids] + [stream.finish()]


def test_default_vocabulary_is_deepseek_v32() -> None:
    assert VOCAB.size == 129_280
    assert VOCAB.model_vocab_size == 129_280
    assert vocabulary.padded_size(50_257) == 50_304
    ids = VOCAB.encode("hello world")
    assert len(ids) == 2 and VOCAB.decode(ids) == "hello world"


def test_chat_uses_deepseek_role_tokens() -> None:
    msgs = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "Hello."),
        ChatMessage("user", "Again"),
    ]
    ids = VOCAB.encode_chat(msgs)
    special = {VOCAB.token_id(t): t for t in ("<｜begin▁of▁sentence｜>", "<｜User｜>")}
    assert ids[0] == VOCAB.token_id("<｜begin▁of▁sentence｜>")
    assert ids.count(VOCAB.token_id("<｜User｜>")) == 2
    assert ids.count(VOCAB.token_id("<｜Assistant｜>")) == 2
    assert ids[-1] == VOCAB.token_id("</think>")  # non-thinking answer opens
    assert None not in special
    assert VOCAB.decode(ids, skip_special_tokens=False).startswith(
        "<｜begin▁of▁sentence｜>Be brief."
    )
    with pytest.raises(ValueError, match="role"):
        ChatMessage("tool", "x")
    with pytest.raises(ValueError, match="end with a user"):
        VOCAB.encode_chat([ChatMessage("user", "a"), ChatMessage("assistant", "b")])


def test_split_characters_are_released_whole() -> None:
    ids = VOCAB.encode(SPLIT_TEXT)
    pieces = stream_all(TextStream(VOCAB), ids)
    assert "".join(pieces) == SPLIT_TEXT
    assert all("\ufffd" not in p for p in pieces)
    # Some token ends inside a character: it releases nothing, the next one the whole character.
    tokens = [VOCAB.tokenizer.id_to_token(i) for i in ids]
    cut = tokens.index("ðŁĻ")
    assert pieces[cut] == "" and pieces[cut + 1] == "🙃"


def test_random_tokens_match_a_whole_decode() -> None:
    """Random ids (what the random-weight model emits) hit invalid byte sequences and special
    tokens; the released text is still exactly the decode of all ids."""
    rng = random.Random(7)
    for _ in range(100):
        ids = [rng.randrange(VOCAB.size) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream_all(TextStream(VOCAB), ids)) == VOCAB.decode(ids)


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement() -> None:
    ids = VOCAB.encode(SPLIT_TEXT)
    cut = [VOCAB.tokenizer.id_to_token(i) for i in ids].index("ðŁĻ")
    stream = TextStream(VOCAB)
    assert "".join(stream.push(t) for t in ids[: cut + 1]) == "héllo 你好世界 🙂"
    assert stream.finish() == "\ufffd" == VOCAB.decode(ids[cut : cut + 1])


def _byte_tokens(vocab: vocabulary.Vocabulary) -> dict[bytes, int]:
    """The bytes of every byte-level BPE token of `vocab` -> its id (byte-level BPE spells a
    token's bytes with GPT-2's printable stand-ins: bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}
    out: dict[bytes, int] = {}
    for token, i in vocab.tokenizer.get_vocab(with_added_tokens=False).items():
        if all(c in byte_of for c in token):
            out.setdefault(bytes(byte_of[c] for c in token), i)
    return out


def test_no_piece_of_a_valid_text_is_a_replacement_however_its_bytes_are_split() -> None:
    """A model may emit any tokens that spell a text, not only the tokenizer's own split: over
    random splits of valid UTF-8 (2-, 3- and 4-byte characters cut anywhere, several cut
    characters in a row, cuts inside tokens that end one character and start the next), no
    released piece holds U+FFFD and the pieces add up to the whole decode."""
    tiny = vocabulary.load(vocabulary.TINY)
    tokens = _byte_tokens(tiny)
    rng = random.Random(37)
    chars = "aé ÿ€—你好世界日本語テキスト🙂🙃🎉"
    for _ in range(400):
        data = "".join(rng.choice(chars) for _ in range(rng.randrange(1, 10))).encode()
        ids, at = [], 0
        while at < len(data):
            n = rng.choice([n for n in range(1, 5) if data[at : at + n] in tokens])
            ids.append(tokens[data[at : at + n]])
            at += n
        pieces = stream_all(TextStream(tiny), ids)
        assert all("\ufffd" not in p for p in pieces), (data.decode(), pieces)
        assert "".join(pieces) == tiny.decode(ids) == data.decode()


def test_a_stop_string_across_tokens_ends_the_text_before_it() -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = VOCAB.encode(text)
    stream = TextStream(VOCAB, stop_strings=("ox jum", "zzz"))
    released = []
    for t in ids:
        released.append(stream.push(t))
        if stream.stopped:
            break
    assert "".join(released) == "The quick brown f" == stream.text
    # The token that completed the stop string is the last one pushed ("jumps" spans it).
    assert VOCAB.decode(ids[: len(released)]).endswith("ox jumps")
    # Nothing that could start the stop string was released early: " fox" released " f" and
    # held "ox" until the next token showed whether the stop string followed.
    assert released[ids.index(VOCAB.encode(" fox")[0])] == " f"
    assert stream.push(ids[-1]) == "" and stream.finish() == ""


def test_held_stop_prefix_is_released_when_no_stop_follows() -> None:
    ids = VOCAB.encode("a world apart")
    stream = TextStream(VOCAB, stop_strings=("world!",))
    pieces = stream_all(stream, ids)
    assert "".join(pieces) == "a world apart" and not stream.stopped
    with pytest.raises(ValueError):
        TextStream(VOCAB, stop_strings=("",))


def test_another_tokenizer_file(tmp_path: Path) -> None:
    """--tokenizer PATH: any tokenizer.json; no DeepSeek role tokens means the plain chat."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"[UNK]": 0, "hello": 1, "world": 2, "User:": 3}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    vocab = vocabulary.load(str(path))
    assert vocab.size == 4 and vocab.model_vocab_size == 128
    assert vocab.encode("hello world") == [1, 2]
    assert vocab.chat_format == PLAIN
    assert json.loads(path.read_text())["model"]["type"] == "WordLevel"
    with pytest.raises(FileNotFoundError):
        vocabulary.load(str(tmp_path / "missing.json"))


def test_tiny_vocabulary_is_current_and_splits_every_non_ascii_character() -> None:
    assert vocabulary.TINY_PATH.read_text(encoding="utf-8") == vocabulary.tiny_text(), (
        "run python -m engine_client.text.vocabulary"
    )
    tiny = vocabulary.load(vocabulary.TINY)
    assert tiny.size == tiny.model_vocab_size == 1024
    assert tiny.chat_format == VOCAB.chat_format  # DeepSeek's role tokens, renumbered
    ids = tiny.encode(SPLIT_TEXT)
    pieces = stream_all(TextStream(tiny), ids)
    assert "".join(pieces) == SPLIT_TEXT and all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= 8  # every 2-4 byte character waited for its last byte
    rng = random.Random(3)
    for _ in range(50):
        rand = [rng.randrange(tiny.size) for _ in range(rng.randrange(1, 30))]
        assert "".join(stream_all(TextStream(tiny), rand)) == tiny.decode(rand)


def test_a_resumed_request_gets_its_text_and_stop_strings_back(tmp_path: Path) -> None:
    """The state file keeps stop strings and text output; replaying the saved tokens rebuilds
    the text and finds a stop string again (serve --state-file, engine restart)."""
    from engine_client.client.control import HeldRequest
    from engine_client.loop import state_file
    from engine_client.loop.request import Finish, GenRequest, SamplingParams
    from engine_client.serve.restore import resumed

    tiny = vocabulary.load(vocabulary.TINY)
    ids = tiny.encode("one two three four")
    sampling = SamplingParams(stop_strings=("three",))
    req = GenRequest("r1", (5, 6), 32, sampling, text=TextStream(tiny, sampling.stop_strings))
    req.tokens = ids[:2]  # generated before the restart ("one two")
    path = str(tmp_path / "state.jsonl")
    state_file.StateFile(path).rewrite("s1", 1, [req])
    saved = state_file.load(path).requests["r1"]
    assert saved.text and saved.sampling.stop_strings == ("three",)
    held = HeldRequest("r1", slot=0, mode=1, seq_len=4, prompt_len=2, max_new_tokens=32)
    saved.tokens = ids  # the whole text came out before the restart
    again = resumed(held, saved, tiny)
    assert again is not None and again.finish is Finish.STOP
    assert "".join(again.texts) == "one two "


def test_a_request_revived_after_a_service_loss_streams_its_text_on() -> None:
    """A text request failed with its KV service (end: the held half character stays held, no
    tail) and revived on resume: its text goes on, and every token's text is the decode of all
    tokens."""
    from engine_client.loop.request import Finish, GenRequest, SamplingParams

    ids = VOCAB.encode(SPLIT_TEXT)
    cut = [VOCAB.tokenizer.id_to_token(i) for i in ids].index("ðŁĻ")  # half of 🙃
    req = GenRequest("r1", (5, 6), len(ids), SamplingParams(), text=TextStream(VOCAB))
    for t in ids[: cut + 1]:
        assert req.add_token(t, 0.0) is None
    req.lost_kv = True
    req.end(Finish.ERROR, "KV service lost")
    assert req.tail == ""  # the half character waits for the resumed stream
    req.revive()
    assert req.tail == "" and req.replayed == cut + 1
    for t in ids[cut + 1 :]:
        req.add_token(t, 0.0)
    assert "".join(req.texts) == SPLIT_TEXT and req.texts[cut + 1] == "🙃"


@pytest.mark.parametrize("cut_by", ["kv-loss", "engine-stop"])
def test_a_character_cut_by_a_resumable_end_comes_out_once_whole(cut_by, tmp_path) -> None:
    """Tokens cut in the middle of a character by an end the client resumes from (a KV loss;
    an engine stopped keeping its requests, resumed from the state file by the next one): the
    cut stream holds the half character back, the resumed stream releases it whole. Neither has
    a U+FFFD, and the text the client gets (the cut stream's, then the resumed one's from the
    cut on: it replays earlier indexes) is the uninterrupted text."""
    from engine_client.client.control import HeldRequest
    from engine_client.loop import state_file
    from engine_client.loop.request import Finish, GenRequest, SamplingParams
    from engine_client.serve.factory import build_engine
    from engine_client.serve.restore import resumed
    from tests.process_harness import engine_config

    tiny = vocabulary.load(vocabulary.TINY)
    data = "hi 🙂 you".encode()
    by_bytes = _byte_tokens(tiny)
    ids = [by_bytes[data[i : i + 1]] for i in range(len(data))]  # one byte a token
    cut = data.index("🙂".encode()) + 2  # two of 🙂's four bytes before the cut
    if cut_by == "kv-loss":
        req = GenRequest("r1", (5, 6), len(ids), SamplingParams(), text=TextStream(tiny))
        for t in ids[:cut]:
            req.add_token(t, 0.0)
        req.lost_kv = True
        req.end(Finish.ERROR, "KV service lost")
        cut_text = "".join(req.texts) + req.tail
        req.revive()
        again = req
    else:
        path = str(tmp_path / "engine.state")

        async def stop() -> GenRequest:
            engine = await build_engine(engine_config("baseline"))
            req = engine.api.submit((5, 6), len(ids), SamplingParams(), TextStream(tiny))
            for t in ids[:cut]:  # as the loop records generated tokens
                req.add_token(t, 0.0)
            await engine.stop(keep_requests=True)
            return req

        req = asyncio.run(stop())
        cut_text = "".join(req.texts) + req.tail
        state_file.StateFile(path).rewrite("s1", 1, [req])
        held = HeldRequest(req.request_id, 0, 1, 2 + cut, 2, len(ids))
        back = resumed(held, state_file.load(path).requests[req.request_id], tiny)
        assert back is not None
        again = back
    for t in ids[cut:]:
        again.add_token(t, 0.0)
    resumed_text = "".join(again.texts[cut:]) + again.tail
    assert "\ufffd" not in cut_text and "\ufffd" not in resumed_text, (cut_text, resumed_text)
    assert cut_text + resumed_text == data.decode() == tiny.decode(ids)
    assert (cut_text, again.texts[cut], again.texts[cut + 1]) == ("hi ", "", "🙂")
