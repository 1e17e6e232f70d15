"""``Pipeline.generate`` through processes over gloo: greedy tokens equal the unsplit model's
(the built-in GPT's sampler on 2 and 4 processes, Llama cut by its plan against Hugging Face's
``generate``), with and without chunked prefill; a seed samples the same tokens whatever the
groups in flight and the process count; sequences end at the end of text while prompts wait;
bad input and models without a cache are refused in one line on every rank."""

import numpy as np
import pytest
import torch

from gpipe.engine.generation.checks import checked_prompts, checked_settings

from ..workers import run
from . import generation_cases as cases


def test_greedy_through_two_stages_equals_the_gpts_own_sampler():
    assert run(cases.gpt_pipeline, 2, (2,), threads=1) == {0: 4, 1: 4}


def test_greedy_through_four_stages_equals_the_gpts_own_sampler():
    assert set(run(cases.gpt_pipeline, 4, (4,), threads=1).values()) == {4}


@pytest.mark.parametrize("failing", [0, 1])
def test_a_call_that_failed_on_one_rank_stops_the_others_and_leaves_nothing_for_the_next(failing):
    """The failing rank raises its own error; its peer, at once, a StageError naming the stage
    that failed and its error (not a timeout); a step and the next call are exact."""
    found = run(cases.gpt_after_a_failed_call, 2, (failing,), threads=1)
    assert found[failing] == ["RuntimeError: a fault of this layer", "the same"]
    peer = 1 - failing
    assert found[peer] == [
        f"StageError: stage {peer}: generating: stage {failing} failed: RuntimeError: a fault "
        "of this layer",
        "the same",
    ]


def test_a_seed_samples_alike_whatever_the_groups_in_flight_and_the_stages():
    two = run(cases.gpt_sampled, 2, threads=1)
    four = run(cases.gpt_sampled, 4, threads=1)
    found = [*two.values(), *four.values()]
    first = found[0][0]
    assert all(runs == [first] * 3 for runs in found)
    assert all(len(tokens) == cases.NEW for tokens in first)
    assert first != cases.gpt_greedy()


def test_sequences_end_at_the_end_of_text_and_free_their_place_for_waiting_prompts():
    assert run(cases.gpt_ends_and_waits, 2, threads=1) == {0: 3, 1: 3}


def test_llama_cut_by_its_plan_generates_what_hugging_face_generates():
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    assert run(cases.llama_pipeline, 2, threads=1) == {0: 2, 1: 2}


def test_bad_input_is_refused_in_one_line_on_every_rank():
    found = run(cases.refusals, 2, threads=1)
    assert found[0] == found[1]
    assert all("\n" not in message for message in found[0])
    assert found[0] == [
        "ValueError: prompt 0 has 41 tokens, more than the model's context of 40",
        "ValueError: prompt 0 has 35 tokens and max_new_tokens=10 more would feed the model "
        "44 (all but the last new one), more than its context of 40",
        "ValueError: prompt 1 is empty: give at least one token id",
        "ValueError: max_new_tokens must be a positive integer, got 0",
        "ValueError: prompt 0 holds token id 64 at position 1, outside the model's "
        "vocabulary of 64 ids (0 to 63)",
        "ValueError: temperature must be a number >= 0 (0: greedy), got -1.0",
        "ValueError: top_p must be a number in (0, 1] or None, got 0.0",
        "ValueError: in_flight must be a positive integer or None, got 0",
        "ValueError: prefill_chunk must be a positive integer or None, got 0",
        "TypeError: prompt 0 is a str: each prompt is a list of token ids",
        "TypeError: prompt 0 is a dict: each prompt is a list of token ids",
        "ValueError: rows_per_lane must be a positive integer or None, got -1",
    ]


def test_numpy_and_torch_numbers_are_taken_as_python_ones():
    """An id or a setting held as a numpy or torch scalar means what the Python number
    means; a temperature that is no finite number is refused."""

    def settings(new, temperature, top_k, top_p, eos, seed):
        return checked_settings(
            new,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos,
            seed=seed,
            in_flight=None,
            prefill_chunk=None,
            n_stages=2,
            vocab=64,
        )

    plain = settings(3, 0.5, 5, 0.5, 5, 3)
    assert (
        settings(np.int64(3), np.float32(0.5), np.int64(5), np.float32(0.5), np.int64(5), 3)
        == plain
    )
    assert (
        settings(3, torch.tensor(0.5), torch.tensor(5), 0.5, torch.tensor(5), np.int64(3)) == plain
    )
    for temperature in (float("inf"), float("nan"), "0.5"):
        with pytest.raises(ValueError, match="temperature must be a number >= 0"):
            settings(3, temperature, None, None, None, 3)
    with pytest.raises(ValueError, match="eos_token_id must be a token id of the vocabulary"):
        settings(3, 0.0, None, None, np.int64(64), 3)
    for flag in (np.True_, torch.tensor(True), torch.tensor([5])):  # no bools, one number
        with pytest.raises(ValueError, match="top_k must be a positive integer or None"):
            settings(3, 0.0, flag, None, None, 3)


def test_prompts_whose_ids_have_no_order_or_that_are_one_number_are_refused():
    """A dict or a set iterates, but not over a prompt's ids in order (a dict's keys would
    have been generated from); a 0-d tensor or array is one number, which used to fail as
    "iteration over a 0-d tensor", naming no prompt."""
    for prompt, what in (
        ({5: 6}, "a dict"),
        ({5, 6}, "a set"),
        (torch.tensor(5), "a 0-d Tensor"),
        (np.array(5), "a 0-d ndarray"),
    ):
        with pytest.raises(TypeError, match=f"^prompt 1 is {what}: each prompt is a list of"):
            checked_prompts([[1, 2], prompt], 3, 64, 40)
    ids = [range(1, 3), (1, 2), torch.tensor([1, 2]), np.array([1, 2]), iter([1, 2])]
    assert checked_prompts(ids, 3, 64, 40) == [[1, 2]] * 5  # in order: taken


def test_settings_past_any_float_and_bad_rows_per_lane_are_refused_by_name():
    """An int too large for a float was an OverflowError from inside the check; a
    ``rows_per_lane`` below 1 let no sequence into a lane, and every one came back empty."""

    def settings(**given):
        base = {"temperature": 0.0, "top_k": None, "top_p": None, "eos_token_id": None}
        base |= {"seed": 1, "in_flight": None, "prefill_chunk": None}
        return checked_settings(3, **{**base, **given}, n_stages=2, vocab=64)

    with pytest.raises(ValueError, match="^temperature must be a number >= 0"):
        settings(temperature=10**400)
    with pytest.raises(ValueError, match=r"^top_p must be a number in \(0, 1\]"):
        settings(top_p=10**400)
    for rows in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="^rows_per_lane must be a positive integer or None"):
            settings(rows_per_lane=rows)
    assert settings(rows_per_lane=np.int64(2)).rows_per_lane == 2
    assert settings().rows_per_lane is None


def test_models_without_a_cache_are_refused_on_every_rank():
    found = run(cases.no_cache, 2, threads=1)
    assert found[0] == found[1] and len(found[0]) == 2
    assert all(m.startswith("generate() needs layers that keep a KV cache") for m in found[0])
    assert "stage 0's layer '0' (Embedding)" in found[0][0]
    assert "stage 0's layer '0' (SplitStage)" in found[0][1]


def test_replicas_side_by_side_each_generate_their_own_prompts():
    assert run(cases.replicas, 4, threads=1) == {r: 1 for r in range(4)}


def test_sample_continues_past_the_context_from_the_last_half_of_a_full_window():
    assert run(cases.windows, 2, threads=1) == {0: True, 1: True}
