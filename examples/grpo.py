"""Reinforcement learning in the training layout: group-relative policy optimization (GRPO)
of a small GPT on a task whose reward is checked, not learned.

The task: a prompt ``a + b =`` of two digits (0 to 4), and the answer the sum's digit followed
by the end of text. The reward is checked against the sum: 1 for the right digit, a quarter
less for each unit it is off, 0 for a token that is no digit. The model starts from random
weights, so its first answers are guesses (about one in sixteen right), and it learns from
its own rewards alone.

Each step, in the same two processes and with the same weights throughout (no copy to a
rollout engine):

1. **Rollouts**: ``Pipeline.generate`` samples ``--group`` completions of each of
   ``--prompts`` prompts (temperature 1, a seed per step), through both stages, a KV cache per
   group in flight. Every rank gets the completions and scores them alike.
2. **Advantages**: each completion's reward less its group's mean, over the group's standard
   deviation (GRPO: the group is the baseline, no value model).
3. **Old log-probabilities**: ``Pipeline.forward_only`` gives each completion token's
   log-probability under the weights that sampled it.
4. **Update**: ``Pipeline.step(microbatches=...)`` with per-token weights (the advantage on
   completion tokens, 0 on the prompt and padding), the clipped ratio of new to old
   probabilities as PPO's, for ``--epochs`` passes over the rollouts.

The mean reward rises from what guesses score to most answers right (docs/generation.md shows
the curve, drawn by ``--plot FILE.png``; ``--curve FILE.json`` keeps the numbers).

    python examples/grpo.py --steps 100 --plot docs/grpo-reward.png
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import gpipe
from gpipe import Pipeline
from gpipe.engine import token_logprobs
from gpipe.models import GPTConfig, build_gpt

PLUS, EQUALS, EOS, PAD = 10, 11, 12, 13
VOCAB = 16
PROMPT = 4  # a + b =
NEW = 2  # the answer and the end of text
CLIP = 0.2


def prompts(step: int, count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of the step, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    digits = torch.randint(0, 5, (count, 2), generator=g).tolist()
    return [[a, PLUS, b, EQUALS] for a, b in digits]


def reward(prompt: list[int], completion: list[int]) -> float:
    """1 when the completion starts with the sum's digit, a quarter less for each unit off."""
    if not completion or completion[0] > 9:
        return 0.0
    return max(0.0, 1.0 - abs(completion[0] - (prompt[0] + prompt[2])) / 4)


def advantages(rewards: list[float], group: int) -> list[float]:
    """Each reward less its group's mean, over the group's standard deviation (0 where every
    completion of the group scored alike)."""
    out = []
    for start in range(0, len(rewards), group):
        scores = rewards[start : start + group]
        mean, spread = statistics.fmean(scores), statistics.pstdev(scores)
        out += [(r - mean) / spread if spread > 0 else 0.0 for r in scores]
    return out


def rows(
    given: list[list[int]], completions: list[list[int]], scores: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[rows, PROMPT + NEW - 1]`` of each prompt and completion, and each
    target token's weight: its completion's advantage over the tokens of all completions,
    0 on the prompt and the padding."""
    width = PROMPT + NEW
    seqs = torch.full((len(given), width), PAD, dtype=torch.long)
    weights = torch.zeros(len(given), width - 1)
    total = sum(len(c) for c in completions)
    for i, (p, c, a) in enumerate(zip(given, completions, scores, strict=True)):
        seqs[i, : len(p) + len(c)] = torch.tensor(p + c)
        weights[i, len(p) - 1 : len(p) - 1 + len(c)] = a / total
    return seqs[:, :-1], seqs[:, 1:], weights


def clipped_loss(logits: torch.Tensor, target: dict) -> torch.Tensor:
    """PPO's clipped surrogate, summed over the weighted tokens (the weights carry the
    advantages): the gradient of the advantage-weighted log-probabilities while the ratio to
    the sampling weights stays within 1 +- CLIP."""
    logp = token_logprobs(logits, target["targets"])
    ratio = torch.exp(logp - target["old"])
    weights = target["weights"]
    surrogate = torch.minimum(ratio * weights, ratio.clamp(1 - CLIP, 1 + CLIP) * weights)
    return -surrogate.sum()


def train(args: argparse.Namespace) -> list[tuple[float, float]] | None:
    """Every rank runs this; the first returns each step's mean reward and share of answers
    right."""
    torch.manual_seed(args.seed)
    config = GPTConfig(n_layer=4, d_model=64, n_head=4, seq_len=8, vocab_size=VOCAB, tied=False)
    pipe = Pipeline(build_gpt(config), loss_fn=clipped_loss, loss_reduction="sum")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.0)
    curve = []
    for step in range(args.steps):
        given = [p for p in prompts(step, args.prompts, args.seed) for _ in range(args.group)]
        completions = pipe.generate(
            given, NEW, temperature=1.0, eos_token_id=EOS, seed=args.seed * 7919 + step
        )
        scores = [reward(p, c) for p, c in zip(given, completions, strict=True)]
        x, y, weights = rows(given, completions, advantages(scores, args.group))
        chunks = (t.chunk(args.chunks) for t in (x, y, weights))
        parts = list(zip(*chunks, strict=True))
        old = pipe.forward_only(microbatches=[(xs, ys) for xs, ys, _ in parts])
        microbatches = [
            (xs, {"targets": ys, "weights": ws, "old": old[i] if old else torch.zeros_like(ws)})
            for i, (xs, ys, ws) in enumerate(parts)
        ]
        for _ in range(args.epochs):
            optimizer.zero_grad()
            pipe.step(microbatches=microbatches)
            optimizer.step()
        right = statistics.fmean(float(s == 1.0) for s in scores)
        curve.append((statistics.fmean(scores), right))
        if pipe.is_first and (step % 5 == 0 or step == args.steps - 1):
            said = f"step {step + 1:3d}: mean reward {curve[-1][0]:.3f}, {right:.0%} right"
            print(said, flush=True)
    return curve if pipe.is_first else None


def plot(curve: list[tuple[float, float]], path: str) -> None:
    """The mean reward and the share of right answers, step by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    steps = range(1, len(curve) + 1)
    ax.plot(steps, [r for r, _ in curve], label="mean reward")
    ax.plot(steps, [a for _, a in curve], label="answers right", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("GRPO through a 2-stage pipeline (examples/grpo.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=16, help="prompts a step")
    parser.add_argument("--group", type=int, default=8, help="completions of each prompt")
    parser.add_argument("--epochs", type=int, default=2, help="updates on each step's rollouts")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches of an update")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--curve", help="write each step's mean reward to this JSON file")
    parser.add_argument("--plot", help="draw the curve into this PNG file (matplotlib)")
    args = parser.parse_args()
    curve = gpipe.launch(train, 2, (args,))[0]
    assert curve is not None
    rewards = [r for r, _ in curve]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    print(f"mean reward {first:.3f} -> {last:.3f} (first and last 5 steps)")
    if args.curve:
        with open(args.curve, "w") as f:
            json.dump({"mean_reward": rewards, "right": [a for _, a in curve]}, f, indent=1)
    if args.plot:
        plot(curve, args.plot)


if __name__ == "__main__":
    main()
