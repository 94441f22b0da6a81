"""coordinator.jobs.engine's generation loop (stop rules, detokenising, accounting) and LocalEngine."""

from __future__ import annotations

import pytest
import torch
import trio

from coordinator.jobs.engine import Finished, IncrementalDetokenizer, StopMatcher, TextChunk, collect_text, encode_chat, open_generation
from coordinator.errors import EmptyPromptError, PromptTooLongError
from coordinator.spec.sampling import SamplingParams

EOS = 2  # tests/conftest.py's tiny tokenizer: </s>


def collect(engine, prompt_ids, params):
    return trio.run(collect_text, engine, prompt_ids, params)


def test_eos_inside_a_block_truncates_exactly_and_counts_through_eos(scripted):
    # Bug guarded: a speculative block [.., EOS, x, y] leaking x, y into the text or the
    # count. Sound: the block carries tokens after EOS that must not appear.
    engine = scripted(["ab", "cd"])
    engine.blocks[1] = engine.ids("cd") + [EOS] + engine.ids("zz")
    text, fin = collect(engine, [5, 6], SamplingParams(temperature=0))
    assert (text, fin.finish_reason, fin.completion_tokens, fin.prompt_tokens) == ("abcd", "stop", 5, 2)
    assert engine.jobs[0].closed


def test_stop_string_spanning_blocks_is_cut_and_counted_to_its_last_token(scripted):
    # Bug guarded: a stop string split across two traversals ("EN" | "D") being missed, or
    # its first half already emitted. Sound: each block alone lacks the stop string.
    engine = scripted(["hello EN", "D world", "more"])
    text, fin = collect(engine, [5], SamplingParams(temperature=0, stop=("END",)))
    assert (text, fin.finish_reason) == ("hello ", "stop")
    assert fin.completion_tokens == len("hello END")


def test_earliest_of_several_stop_strings_wins(scripted):
    engine = scripted(["one, two; three"])
    text, fin = collect(engine, [5], SamplingParams(temperature=0, stop=(";", ",")))
    # Bug guarded: picking the first stop string in the list rather than the earliest match.
    assert (text, fin.finish_reason) == ("one", "stop")


def test_max_tokens_inside_a_block(scripted):
    # Bug guarded: a 4-token block overshooting max_tokens=6. Sound: 8 tokens are offered.
    engine = scripted(["abcd", "efgh"])
    text, fin = collect(engine, [5], SamplingParams(temperature=0, max_tokens=6))
    assert (text, fin.finish_reason, fin.completion_tokens) == ("abcdef", "length", 6)


def test_held_stop_prefix_is_released_when_generation_ends(scripted):
    # Bug guarded: text held back as a possible stop-string start ("EN") lost at the end.
    engine = scripted(["abEN"])
    text, fin = collect(engine, [5], SamplingParams(temperature=0, max_tokens=4, stop=("END",)))
    assert (text, fin.finish_reason) == ("abEN", "length")


def test_context_bound_limits_the_completion(scripted):
    # Bug guarded: generating past the context. Sound: 64-token context, 60-token prompt.
    engine = scripted(["abcdefgh"], max_context_tokens=64)
    text, fin = collect(engine, list(range(3, 63)), SamplingParams(temperature=0))
    assert (text, fin.completion_tokens, fin.finish_reason) == ("abcd", 4, "length")
    with pytest.raises(PromptTooLongError) as info:
        trio.run(open_generation, engine, list(range(3, 67)), SamplingParams())
    assert (info.value.prompt_tokens, info.value.max_context_tokens) == (64, 64)


def test_streamed_chunks_concatenate_to_the_whole_text_with_multibyte_characters(scripted):
    # Bug guarded: a UTF-8 character split over two byte tokens streamed as U+FFFD.
    # Sound: the byte-level tiny tokenizer spells "é" and "日" as 2 and 3 tokens.
    engine = scripted(["h\u00e9", "\u65e5!"])
    engine.blocks = [[t] for block in engine.blocks for t in block]  # one token per block

    async def main():
        gen = await open_generation(engine, [5], SamplingParams(temperature=0))
        return [e async for e in gen.events()]

    events = trio.run(main)
    chunks = [e.text for e in events if isinstance(e, TextChunk)]
    assert "".join(chunks) == "h\u00e9\u65e5!" and all("\ufffd" not in c for c in chunks)
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length"


@pytest.mark.parametrize("cut", [1, 2])
def test_output_cut_inside_a_character_never_ends_in_a_replacement_character(scripted, cut):
    # Bug guarded (issue 23): max_tokens=1 answered "\ufffd", and outputs cut by max_tokens
    # ended in a broken character. Sound: the byte-level tiny tokenizer spells "日" as 3
    # tokens, so max_tokens = 1 + cut stops inside it; the complete "a" must come out
    # and nothing the model did not write.
    engine = scripted(["a\u65e5"])
    text, fin = collect(engine, [5], SamplingParams(temperature=0, max_tokens=1 + cut))
    assert (text, fin.completion_tokens, fin.finish_reason) == ("a", 1 + cut, "length")
    detok = IncrementalDetokenizer(engine.tokenizer, [5])
    assert [detok.push(t) for t in engine.ids("\u65e5")[:1]] == [""] and detok.flush() == ""


def test_empty_prompt_is_refused_before_any_job(scripted):
    # Bug guarded (issue 23): an empty prompt reached the ring job, which had no root to
    # verify and failed with an AttributeError (HTTP 500). Sound: no job may be opened.
    engine = scripted(["abc"])
    with pytest.raises(EmptyPromptError):
        trio.run(open_generation, engine, [], SamplingParams())
    assert engine.jobs == []


def test_incremental_detokenizer_matches_full_decode(tiny_tokenizer):
    ids = tiny_tokenizer.encode("Grüße, 世界! ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_tokenizer, [5, 6])
    assert "".join(detok.push(t) for t in ids) + detok.flush() == tiny_tokenizer.decode(ids)


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["abc", "xy"])
    assert m.push("hello a") == ("hello ", False)  # "a" might start "abc"
    assert m.push("b") == ("", False)
    assert m.push("d x") == ("abd ", False)
    assert m.push("y tail") == ("", True)


def test_chat_template_is_applied(tiny_tokenizer):
    ids = encode_chat(tiny_tokenizer, [{"role": "user", "content": "hi"}])
    assert tiny_tokenizer.decode(ids) == "<s>user\nhi</s><s>assistant\n"


def test_local_engine_greedy_equals_transformers_generate(local_engine, tiny_llama, tiny_tokenizer):
    # Bug guarded: an off-by-one in cache positions or the fed token, which would still
    # produce text but not the model's. Sound: generate() is the reference decoder.
    prompt = tiny_tokenizer.encode("The quick brown fox", add_special_tokens=False)
    ref = tiny_llama.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()

    async def main():
        gen = await open_generation(local_engine, prompt, SamplingParams(temperature=0, max_tokens=12))
        out = []
        async for block in gen.job.next_tokens():
            out += block
            if len(out) >= 12:
                break
        await gen.aclose()
        return out

    assert trio.run(main) == ref


def test_local_engine_loads_a_local_hf_dir_without_network(tiny_llama, local_engine):
    # Bug guarded: from_pretrained loading something other than the saved weights (or
    # reaching for the hub). Sound: greedy output must equal the in-memory model's.
    from coordinator.jobs.local_engine import LocalEngine

    loaded = LocalEngine.from_pretrained(str(tiny_llama.path), model_id="tiny")
    params = SamplingParams(temperature=0, max_tokens=8)
    assert loaded.model_id == "tiny" and loaded.max_context_tokens == 256
    assert collect(loaded, [5, 6, 7], params)[0] == collect(local_engine, [5, 6, 7], params)[0]


def test_local_engine_seeded_sampling_is_reproducible(local_engine):
    # Bug guarded: a shared or unseeded generator making `seed` meaningless. Sound: two
    # jobs with one seed agree, a third with another seed differs over 20 tokens.
    def run(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=20)
        return collect(local_engine, [5, 6, 7], params)[0]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert local_engine.open_jobs == 0
