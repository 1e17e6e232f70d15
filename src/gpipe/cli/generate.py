"""``gpipe generate``: completions of a file of prompts from a run's checkpoint, through its
stages (one process per stage, as it trained)."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from gpipe.cli.common import UsageError, positive
from gpipe.errors import counted

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="complete a file of prompts from a checkpoint, through the pipeline",
        description="Complete every prompt of a JSON-lines file from a gpipe checkpoint (a "
        "run folder or one of its checkpoints), through the run's stages, one process per "
        "stage, a KV cache per group of sequences in flight. Each line is an object with "
        "'prompt' (text, through the run's tokenizer) or 'ids' (token ids); each line of "
        "--out is that object with 'completion_ids' and 'completion' (the text) added.",
    )
    p.add_argument("path", metavar="RUN", help="run folder or checkpoint folder")
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="the prompts")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="where completions go")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="of the sampling (default 0)")
    p.add_argument(
        "--eos-token-id",
        type=int,
        default=None,
        help="a sequence ends at this token (default: the tokenizer's end of text, if any)",
    )
    p.add_argument("--no-eos", action="store_true", help="always generate N tokens")
    p.add_argument("--in-flight", type=int, default=None, help="groups in flight (default: stages)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences in flight in all (default: every prompt); finished ones make room",
    )
    p.add_argument("--tokenizer", metavar="PATH", help="default: the run's --tokenizer")
    p.add_argument("--model", help="the run's --model, needed for a module of your own")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per process")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(command=_generate)


def _read_prompts(
    path: Path, tokenizer: Any
) -> tuple[list[dict[str, Any]], list[list[int]], list[int]]:
    """Each line's object, its prompt's token ids, and the line's number."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"--prompts {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"--prompts {path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    objects: list[dict[str, Any]] = []
    ids: list[list[int]] = []
    numbers: list[int] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--prompts {path}, line {number}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("ids" in item):
            raise UsageError(
                f"--prompts {path}, line {number}: expected an object with 'prompt' (text) "
                "or 'ids' (token ids), one of them"
            )
        if "prompt" in item:
            if not isinstance(item["prompt"], str):
                raise UsageError(f"--prompts {path}, line {number}: 'prompt' must be text")
            ids.append(tokenizer.encode(item["prompt"]))
        else:
            given = item["ids"]
            if not isinstance(given, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in given
            ):
                raise UsageError(f"--prompts {path}, line {number}: 'ids' must be a list of ints")
            ids.append(given)
        objects.append(item)
        numbers.append(number)
    return objects, ids, numbers


def _at_its_line(refusal: str, path: Path, numbers: list[int]) -> str:
    """``generate``'s refusal of prompt i, said of the line of ``path`` that holds it."""
    found = re.match(r"prompt (\d+) (.*)", refusal)
    if found is None or int(found[1]) >= len(numbers):
        return refusal
    return f"--prompts {path}, line {numbers[int(found[1])]}: the prompt {found[2]}"


_FLAGS = ("temperature", "top_k", "top_p", "eos_token_id", "in_flight", "prefill_chunk")


def _in_flag_words(refusal: str, eos_default: bool) -> str:
    """``generate``'s refusal of one of its arguments (one the stages check against the
    model, such as an end of text outside its vocabulary), said of the flag that set it."""
    found = re.match(r"(\w+) must (.*)", refusal)
    if found is None or found[1] not in _FLAGS:
        return refusal
    flag = "--" + found[1].replace("_", "-")
    if found[1] == "eos_token_id" and eos_default:
        flag += " (by default the tokenizer's end of text; --no-eos turns it off)"
    return f"{flag} must {found[2].replace(' or None', '')}"


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling flags that need no model, refused by their own names before the stages
    start (the stages would refuse them by ``generate``'s argument names, after loading)."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a number >= 0 (0: greedy), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:  # NaN is no number in (0, 1]
        raise UsageError(f"--top-p must be a number in (0, 1], got {args.top_p}")
    if args.eos_token_id is not None and args.eos_token_id < 0:
        raise UsageError(f"--eos-token-id must be a token id (>= 0), got {args.eos_token_id}")


def _generate(args: argparse.Namespace) -> int:
    from gpipe.training.checkpoints.format import read_run_record
    from gpipe.training.data.tokenizer import IdTokenizer, load_tokenizer
    from gpipe.training.generation_job import GenerateJob, generate_from_run
    from gpipe.training.models.trained import checkpoint_at

    for flag in ("max_new_tokens", "top_k", "in_flight", "prefill_chunk", "batch_size", "threads"):
        positive(flag.replace("_", "-"), getattr(args, flag))
    _check_sampling(args)
    try:
        checkpoint = checkpoint_at(args.path)
        train = read_run_record(checkpoint).get("train") or {}
        where = args.tokenizer or train.get("tokenizer")
        data = str(train.get("data") or "")
        ids_only = where is None and data.endswith((".bin", ".npy"))
        tokenizer = IdTokenizer() if ids_only else load_tokenizer(where)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    objects, prompts, numbers = _read_prompts(Path(args.prompts), tokenizer)
    out = Path(args.out)
    if not out.parent.is_dir():  # found now, not after generating
        raise UsageError(f"--out {out}: the folder {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(f"--out {out}: a folder, not a file to write")
    eos = None if args.no_eos else args.eos_token_id
    if eos is None and not args.no_eos:
        eos = tokenizer.eos_id
    options = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "eos_token_id": eos,
        "in_flight": args.in_flight,
        "prefill_chunk": args.prefill_chunk,
    }
    job = GenerateJob(
        str(checkpoint),
        prompts,
        args.max_new_tokens,
        options,
        batch=args.batch_size,
        code=args.model,
        progress=not args.quiet,
    )
    try:
        found = generate_from_run(job, args.threads)
    except ValueError as exc:
        raise UsageError(str(exc).splitlines()[-1]) from None
    if found.refused is not None:
        refused = _in_flag_words(found.refused, args.eos_token_id is None and eos is not None)
        raise UsageError(_at_its_line(refused, Path(args.prompts), numbers))
    try:
        with out.open("w") as f:
            for item, tokens in zip(objects, found.tokens, strict=True):
                text = tokenizer.decode(tokens)
                f.write(json.dumps({**item, "completion_ids": tokens, "completion": text}) + "\n")
    except OSError as exc:  # such as no permission to write there
        raise UsageError(f"--out {out}: {exc.strerror or exc}") from None
    total = sum(len(t) for t in found.tokens)
    rate = total / found.seconds if found.seconds > 0 else float("inf")
    print(
        f"{counted(total, 'token')} for {counted(len(prompts), 'prompt')} in "
        f"{found.seconds:.2f} s: "
        f"{rate:.1f} tokens/s; written to {out}"
    )
    return 0
