"""Replay greedy replies through speculation's planning with a table of pass costs in place of
a model: what prompt lookup's plans would cost on a machine, without the machine.

At temperature 0 the reply is the same whatever is drafted, so a draft's fate is known from
the reply alone (its tokens are accepted up to the first that differs). This runs the
engine's loop for one sequence on the real Speculator and LookupDrafter: each step asks for
drafts, pays the table's seconds for the pass it asked for (or for steps chained on the
device, where it asks for none and --chain-steps allows), and tells the plans what it paid.
The replies come from a model run here (--model, greedy, on the CPU: near ties may go
another way than on the GPU, which changes a reply's length, not its kind) or from a JSON
file that --save wrote.

    python scripts/spec_replay.py --model smollm2-135m-instruct --save /tmp/replies.json
    python scripts/spec_replay.py --replies /tmp/replies.json \\
        --costs 1:0.85,2:1.11,3:1.37,4:1.17,6:1.51,15:2.30,16:1.82 --chained 0.70

Costs in ms: a pass of n tokens as the plans measured it (`spec_bench.py` prints them:
"ms of target passes"), --chained one step of a chain of greedy steps. Sizes between the
table's are interpolated; plain decoding is every step chained (--chain-steps > 1) or not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fastrun.runner.generate import Completion  # noqa: E402
from fastrun.runner.speculative import (  # noqa: E402
    LookupDrafter,
    PassCosts,
    SpeculativeSettings,
    Speculator,
)


class CostTable:
    def __init__(self, text: str):
        pairs = [item.split(":") for item in text.split(",") if item]
        self.ms = {int(n): float(t) for n, t in pairs}

    def seconds(self, n: int) -> float:
        sizes = sorted(self.ms)
        if n in self.ms:
            return self.ms[n] / 1e3
        lo = max((m for m in sizes if m < n), default=sizes[0])
        hi = min((m for m in sizes if m > n), default=sizes[-1])
        if lo == hi:
            return self.ms[lo] / 1e3
        return (self.ms[lo] + (self.ms[hi] - self.ms[lo]) * (n - lo) / (hi - lo)) / 1e3


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Cache:
    free_slots: int = 1 << 20


@dataclass
class Params:
    max_tokens: int


@dataclass(eq=False)  # hashed by identity, as the engine's requests
class ReplayRequest:
    """What the Speculator reads of an engine request."""

    prompt: list[int]
    params: Params
    cache: Cache = field(default_factory=Cache)
    completion: Completion = field(default_factory=Completion)
    speculation: object = None


def replay(spec, clock: Clock, costs: CostTable, chained_ms: float, prompt, reply, chain_steps,
           captured: set, capture_ms: float = 0.0):  # fmt: skip
    """One request's decode through the plans: seconds from its first token to its last.
    captured: the pass sizes ("chain": the chain's) run before, in this process; a size's
    first pass costs capture_ms more (a CUDA graph's capture)."""

    def capture(size) -> float:
        new = size not in captured
        captured.add(size)
        return capture_ms / 1e3 if new else 0.0

    request = ReplayRequest(list(prompt), Params(max_tokens=len(reply) + 1))
    spec.start(request)
    request.completion.tokens.append(reply[0])  # the prompt's pass gave the first
    started = clock.now
    chains = 0
    host = []
    while len(request.completion.tokens) < len(reply):
        done = len(request.completion.tokens)
        t0 = time.perf_counter()
        drafts = spec.drafts([request], budget=64, chainable=chain_steps > 1)
        host.append(time.perf_counter() - t0)
        draft = drafts.get(request)
        if draft is None:
            steps = 1
            if chain_steps > 1:
                steps = spec.quiet_steps([request], min(chain_steps, len(reply) - done))
            if steps > 1:
                seconds = steps * chained_ms / 1e3 + capture("chain")
                clock.now += seconds
                spec.chained([request], steps, seconds)
                chains += 1
            else:
                seconds = costs.seconds(1) + capture(1)
                clock.now += seconds
                spec.step_done(1, seconds)
            request.completion.tokens.extend(reply[done : done + steps])
            continue
        truth = reply[done:]
        accepted = 0
        while (
            accepted < min(len(draft.tokens), len(truth))
            and draft.tokens[accepted] == truth[accepted]
        ):
            accepted += 1
        seconds = costs.seconds(1 + len(draft.tokens)) + capture(1 + len(draft.tokens))
        clock.now += seconds
        spec.checked(request, draft, accepted)
        spec.step_done(1 + len(draft.tokens), seconds)
        request.completion.tokens.extend(truth[: accepted + 1])
    elapsed = clock.now - started
    out = request.completion
    return {
        "tokens": len(reply),
        "seconds": elapsed,
        "acceptance": out.acceptance_rate,
        "rounds": out.draft_rounds,
        "chains": chains,
        "host_ms": 1e3 * sum(host) / max(len(host), 1),  # the plans' own time a step
    }


def plain_seconds(costs: CostTable, chained_ms: float, reply, chain_steps: int, captures: int):
    steps = len(reply) - 1
    return steps * (chained_ms / 1e3 if chain_steps > 1 else costs.seconds(1)) + captures


def model_replies(name: str, n: int, threads: int) -> dict:
    from spec_bench import PROMPTS

    from fastrun.runner.api import Model
    from fastrun.runner.registry import resolve_model

    model = Model(resolve_model(name), backend="cpu", n_ctx=2048, parallel=1, threads=threads)
    replies = {}
    for p, text in PROMPTS.items():
        rendered = model.template.render(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        done = model.complete(rendered, max_tokens=n, temperature=0)
        replies[p] = {
            "prompt": model.tokenize(rendered, special=True),
            "reply": [int(t) for t in done.tokens],
        }
    model.close()
    return replies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="make the replies with this model (CPU, greedy)")
    ap.add_argument("--replies", help="a JSON file of replies (--save wrote it)")
    ap.add_argument("--save", help="write the replies here")
    ap.add_argument("-n", "--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--costs", default="1:0.85,2:1.11,3:1.37,4:1.17,6:1.51,15:2.30,16:1.82")
    ap.add_argument("--chained", type=float, default=0.70, help="ms of a chained step")
    ap.add_argument("--chain-steps", type=int, default=8, help="1: no chains (the CPU)")
    ap.add_argument("--rounds", type=int, default=4, help="each prompt's requests in turn")
    ap.add_argument("--draft-max", type=int, default=15)
    ap.add_argument("--capture", type=float, default=0.0, help="ms of a size's first pass more")
    ap.add_argument("--cold", action="store_true", help="each request a fresh process")
    args = ap.parse_args()
    if args.model:
        replies = model_replies(args.model, args.tokens, args.threads)
        if args.save:
            Path(args.save).write_text(json.dumps(replies))
    elif args.replies:
        replies = json.loads(Path(args.replies).read_text())
    else:
        sys.exit("--model or --replies")
    costs = CostTable(args.costs)
    captures = args.capture > 0
    clock = Clock()

    def fresh():  # a process's costs and captured graphs
        return PassCosts(clock=clock, one_time=captures), PassCosts(clock=clock), set()

    target, chained, captured = fresh()
    print(f"{'round':>5} {'prompt':<12} {'tokens':>6} {'vs plain':>8} {'accepted':>8} "
          f"{'rounds':>6} {'chains':>6} {'plan ms':>7}")  # fmt: skip
    for r in range(args.rounds):
        for name, item in replies.items():
            # a Speculator a request, the costs kept (as `Model.speculate` and spec_bench.py)
            if args.cold:
                target, chained, captured = fresh()
            settings = SpeculativeSettings(draft_max=args.draft_max)
            spec = Speculator(LookupDrafter(), settings, 1 << 20, target, chained)
            reply = item["reply"]
            plain_captures = 0.0 if r and not args.cold else args.capture / 1e3  # the chain's
            result = replay(spec, clock, costs, args.chained, item["prompt"], reply,
                            args.chain_steps, captured, args.capture)  # fmt: skip
            plain = plain_seconds(costs, args.chained, reply, args.chain_steps, plain_captures)
            vs_plain = plain / result["seconds"] if result["seconds"] else 1.0
            print(
                f"{r + 1:>5} {name:<12} {result['tokens']:>6} {vs_plain:>8.2f} "
                f"{result['acceptance']:>8.2f} {result['rounds']:>6} {result['chains']:>6} "
                f"{result['host_ms']:>7.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
