"""Stream coalescing (`client.coalesce`): a request's outputs waiting together reach its
stream as one, in order, with nothing lost or reordered; errors and ends are never merged past."""

from __future__ import annotations

from stride.decoders.sampling import TokenLogprob
from stride.scheduler.outputs import EngineError, RequestOutput
from stride.scheduler.submission import coalesce


def _out(rid: str, tokens: list[int], text: str, **kw) -> RequestOutput:
    lps = [TokenLogprob(t, -float(t), [], []) for t in tokens]
    return RequestOutput(rid, token_ids=tokens, text=text, logprobs=lps, **kw)


def test_one_output_or_none_passes_as_it_is():
    one = [_out("a", [1], "x")]
    assert coalesce([]) == [] and coalesce(one) is one


def test_a_requests_consecutive_outputs_become_one_carrying_the_end():
    outs = [
        _out("a", [1], "he", num_prompt_tokens=3, num_output_tokens=1),
        _out("a", [2, 3], "llo", num_prompt_tokens=3, num_output_tokens=3),
        _out("a", [4], "!", finish_reason="stop", stop_reason="?", num_prompt_tokens=3,
             num_output_tokens=4, num_cached_tokens=2, decoder_stats={"decoder": "ar"},
             timings={"e2e": 1.0}),  # fmt: skip
    ]
    (merged,) = coalesce(outs)
    assert merged.request_id == "a"
    assert merged.token_ids == [1, 2, 3, 4] and merged.text == "hello!"
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merged.finish_reason == "stop" and merged.stop_reason == "?"
    assert (merged.num_prompt_tokens, merged.num_output_tokens, merged.num_cached_tokens) == (
        3, 4, 2
    )  # fmt: skip
    assert merged.decoder_stats == {"decoder": "ar"} and merged.timings == {"e2e": 1.0}


def test_interleaved_requests_merge_apart_in_order_of_first_output():
    outs = [_out("a", [1], "a1"), _out("b", [7], "b1"), _out("a", [2], "a2"),
            _out("c", [9], "c1", finish_reason="length"), _out("b", [8], "b2")]  # fmt: skip
    merged = coalesce(outs)
    assert [(o.request_id, o.token_ids, o.text) for o in merged] == [
        ("a", [1, 2], "a1a2"), ("b", [7, 8], "b1b2"), ("c", [9], "c1")
    ]  # fmt: skip
    assert merged[2].finish_reason == "length" and not merged[0].finished


def test_an_error_stays_apart_so_the_tokens_before_it_still_arrive():
    error = EngineError("internal_error", "boom")
    outs = [_out("a", [1], "x"), _out("a", [2], "y"), RequestOutput("a", error=error)]
    merged = coalesce(outs)
    want = [([1, 2], "xy", None), ([], "", error)]
    assert [(o.token_ids, o.text, o.error) for o in merged] == want


def test_nothing_is_merged_into_an_output_that_ended():
    outs = [_out("a", [1], "x", finish_reason="stop"), _out("a", [2], "y")]
    assert [o.token_ids for o in coalesce(outs)] == [[1], [2]]
