"""Incremental detokenization (edge_client/model/sampling.py TextStream): the deltas add up to the full decode,
multi-byte characters are never split, and a stop string is found across token boundaries, on the tiny model's
byte-level BPE and on SmolLM2's tokenizer."""

import pytest

from collm.edge_client.model.sampling import TextStream

TEXTS = ["Plain words, then numbers 12345 and symbols #$%&.",
         "Unicode: café, naïve, 中文字符, emoji 🚀🎉 and more — done.",
         "  leading spaces\n\nnew lines\tand tabs   trailing  ",
         "a" * 300 + " long run " + "ab" * 200]


def stream(tok, ids, stop=()):
    ts = TextStream(tok, list(stop))
    deltas = [ts.push(i) for i in ids]
    return "".join(deltas) + ts.flush(), ts


def check(tok):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids, skip_special_tokens=True)
        out, _ = stream(tok, ids)
        assert out == full, (text, out)
        for a, b in ((5, 9), (len(full) // 2, len(full) // 2 + 7), (len(full) - 6, len(full) - 1)):
            stop = full[a:b]
            if not stop.strip():
                continue
            out, ts = stream(tok, ids, [stop, "never-in-this-text"])
            assert ts.stopped and out == full[:full.index(stop)], (text, stop, out)


def test_tiny_tokenizer(tiny_lm):
    check(tiny_lm.tokenizer)


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2_lm):
    check(smollm2_lm.tokenizer)
