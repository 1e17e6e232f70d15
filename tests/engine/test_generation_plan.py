"""The first stage's plan of a generation (``engine.generation.scheduler``) and the tokens the
last stage picks (``engine.generation.sampling``): pure bookkeeping, checked without
processes."""

import math

import pytest
import torch

from gpipe.engine.generation import Piece, Sampler, Sampling, Scheduler, Task
from gpipe.engine.generation.messages import plan_of, task_tensor
from gpipe.engine.generation.sampling import filtered_logits


def test_prompts_spread_over_the_lanes_and_are_prefilled_whole_without_a_chunk():
    plan = Scheduler([[1, 2], [3], [4, 5, 6]], 2, lanes=2)
    first, second = plan.task(0), plan.task(1)
    assert first == Task(0, pieces=(Piece(0, 0, (1, 2), True), Piece(1, 0, (3,), True)))
    assert second == Task(1, pieces=(Piece(2, 0, (4, 5, 6), True),))
    assert plan.task(1) is None  # nothing left for it before its tokens come back


def test_no_more_lanes_than_prompts_are_kept():
    """A lane beyond one per prompt never holds a sequence: ``in_flight=10**9`` kept a
    billion of them (minutes, and gigabytes) for two prompts."""
    plan = Scheduler([[1, 2], [3]], 2, lanes=1000)
    assert plan.lanes == 2
    assert plan.task(0) == Task(0, pieces=(Piece(0, 0, (1, 2), True),))
    assert plan.task(1) == Task(1, pieces=(Piece(1, 0, (3,), True),))
    assert Scheduler([], 2, lanes=3).lanes == 1  # no prompt: one lane, idle


def test_a_prefilled_prompt_joins_its_lane_with_its_first_token_and_leaves_when_done():
    plan = Scheduler([[1, 2, 3]], 2, lanes=1)
    plan.task(0)
    plan.take(0, [0], [7])
    assert plan.task(0) == Task(0, joins=(0,), rows=(0,), inputs=(7,))
    plan.take(0, [0], [8])
    assert plan.done and plan.tokens == [[7, 8]]
    assert plan.task(0) == Task(0, leaves=(0,))  # the stages drop its rows
    assert plan.task(0) is None


def test_chunks_interleave_a_long_prompt_with_the_rows_that_decode():
    plan = Scheduler([[1], [2, 3, 4, 5, 6]], 3, lanes=1, prefill_chunk=2)
    assert plan.task(0) == Task(0, pieces=(Piece(0, 0, (1,), True), Piece(1, 0, (2,), False)))
    plan.take(0, [0], [9])
    step = plan.task(0)
    assert step == Task(0, joins=(0,), rows=(0,), inputs=(9,), pieces=(Piece(1, 1, (3, 4), False),))
    plan.take(0, [0], [10])
    assert plan.task(0) == Task(0, rows=(0,), inputs=(10,), pieces=(Piece(1, 3, (5, 6), True),))


def test_an_ended_sequence_frees_its_place_for_a_waiting_prompt():
    plan = Scheduler([[1], [2], [3]], 5, lanes=1, rows_per_lane=1, eos_token_id=0)
    assert plan.task(0) == Task(0, pieces=(Piece(0, 0, (1,), True),))
    plan.take(0, [0], [4])
    assert plan.task(0) == Task(0, joins=(0,), rows=(0,), inputs=(4,))  # no room for 1
    plan.take(0, [0], [0])  # the end of text
    assert plan.task(0) == Task(0, leaves=(0,), pieces=(Piece(1, 0, (2,), True),))
    plan.take(0, [1], [0])  # ends with its first token: never joins
    assert plan.task(0) == Task(0, leaves=(1,), pieces=(Piece(2, 0, (3,), True),))
    assert plan.tokens[:2] == [[4, 0], [0]] and not plan.done


def test_a_task_travels_as_int64_words():
    task = Task(3, (1,), (2, 5), (2, 5, 7), (0, 0, 0), (Piece(4, 6, (1, 2), True),))
    back = plan_of(task_tensor(task, run=9))
    assert back == (9, Task(3, (1,), (2, 5), (2, 5, 7), (), (Piece(4, 6, (), True),)))


def test_greedy_is_the_first_largest_logit():
    logits = torch.tensor([[0.0, 2.0, 2.0], [3.0, 1.0, 0.0]])
    assert Sampler(Sampling()).pick(logits, [0, 1]) == [1, 0]


def test_a_tiny_temperature_draws_the_greedy_token():
    """Logits over 1e-310 overflow to inf unless taken from the largest: all would then be
    equally likely, and the draw fell on the last id."""
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 0.0]])
    assert Sampler(Sampling(temperature=1e-310, seed=3)).pick(logits, [0, 1]) == [1, 0]


def test_a_seed_draws_each_sequence_alike_however_they_are_grouped():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    how = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=11)
    together = [Sampler(how).pick(logits, [0, 1, 2]) for _ in range(2)]
    apart = Sampler(how)
    alone = [apart.pick(logits[i : i + 1], [i])[0] for i in (2, 0, 1)]
    assert together[0] == together[1] == [alone[1], alone[2], alone[0]]
    other = Sampler(Sampling(temperature=0.8, seed=12))
    draws = [tuple(other.pick(logits, [0, 1, 2])) for _ in range(4)]
    assert len(set(draws)) > 1  # the generators move on with every token


def test_top_k_and_top_p_leave_out_the_unlikely_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    assert torch.isinf(filtered_logits(logits, 2, None)).tolist() == [False, False, True, True]
    kept = ~torch.isinf(filtered_logits(logits, None, 0.75))
    assert kept.tolist() == [True, True, False, False]  # 0.5 + 0.3 reach 0.75
    assert (~torch.isinf(filtered_logits(logits, None, 0.1))).sum() == 1
    sampler = Sampler(Sampling(temperature=1.0, top_k=1, seed=0))
    assert sampler.pick(logits[None], [0]) == [0]


@pytest.mark.parametrize("p", [0.5, 1.0])
def test_draws_follow_the_probabilities(p):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    sampler = Sampler(Sampling(temperature=1.0, top_p=p, seed=3))
    counts = [0, 0, 0]
    for _ in range(2000):
        counts[sampler.pick(logits, [0])[0]] += 1
    expected = [1.0, 0.0, 0.0] if p == 0.5 else [0.5, 0.3, 0.2]
    found = [c / 2000 for c in counts]
    assert all(math.isclose(f, e, abs_tol=0.04) for f, e in zip(found, expected, strict=True))
