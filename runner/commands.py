"""Generation commands of the CLI: `run` (one-shot, for scripts) and `chat` (interactive)."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer

from fastrun.formats.errors import FastrunError
from fastrun.runner.app import app, render, resolve, start_up_done
from fastrun.runner.progress import DownloadProgress, stderr_console
from fastrun.runner.speculative import SpeculativeSettings

SPEC = SpeculativeSettings()  # the defaults of the speculative-decoding options

# Options shared by run and chat, declared once.
MaxTokens = Annotated[
    int, typer.Option("-n", "--max-tokens", min=1, help="Most tokens to generate.")
]
Temperature = Annotated[float, typer.Option("--temp", "--temperature", min=0.0, help="0 = greedy.")]
TopK = Annotated[int, typer.Option("--top-k", min=0, help="Keep the k most likely (0 = off).")]
TopP = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus mass (1 = off).")]
MinP = Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Drop below min-p x best.")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", min=0.0, help="1 = off.")]
PresencePenalty = Annotated[float, typer.Option("--presence-penalty")]
FrequencyPenalty = Annotated[float, typer.Option("--frequency-penalty")]
Seed = Annotated[int | None, typer.Option("--seed", help="Same seed, same output.")]
Stop = Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")]
CtxSize = Annotated[int | None, typer.Option("-c", "--ctx-size", min=2, help="Context length.")]
Threads = Annotated[int | None, typer.Option("-t", "--threads", min=1, help="CPU threads.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="cpu, cuda or auto.")]
System = Annotated[str | None, typer.Option("--system", help="System message (chat template).")]


Keep = Annotated[
    int,
    typer.Option("--keep", min=-1, help="Tokens kept on a context shift (-1: the prompt)."),
]
NoShift = Annotated[
    bool, typer.Option("--no-context-shift", help="Stop at a full context instead of shifting.")
]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Never stop at end-of-text.")]
BatchSize = Annotated[
    int, typer.Option("-b", "--batch-size", min=1, help="Tokens per forward pass at most.")
]
Draft = Annotated[
    str | None,
    typer.Option(
        "--draft",
        help="Speculative decoding with a small draft model of the same vocabulary (GGUF path "
        "or registry name; 'auto': the draft models.toml pairs with MODEL).",
    ),
]
Lookup = Annotated[
    bool,
    typer.Option(
        "--lookup",
        help="Speculative decoding by prompt lookup (n-gram drafts); with --draft, the draft "
        "model drafts where lookup finds no match.",
    ),
]
DraftMax = Annotated[
    int, typer.Option("--draft-max", min=0, help="Most tokens drafted per step (adaptive below).")
]
DraftMin = Annotated[
    int, typer.Option("--draft-min", min=0, help="Fewest drafted tokens worth checking.")
]
DraftPMin = Annotated[
    float,
    typer.Option(
        "--draft-p-min", min=0.0, max=1.0, help="The draft stops at a token it finds less likely."
    ),
]


def speculative(draft, lookup, draft_max, draft_min, draft_p_min) -> dict:
    """Model's speculative-decoding settings from the shared options."""
    return dict(
        draft=draft, lookup=lookup, draft_max=draft_max, draft_min=draft_min,
        draft_p_min=draft_p_min,
    )  # fmt: skip


def load_model(
    model: str, backend: str, ctx_size: int | None, threads: int | None, **engine
):  # fmt: skip
    """The Model with a progress bar for a GPU upload; engine: Model's engine settings (and
    speculative decoding's)."""
    from fastrun.backends.cpu.backend import kernels_cached
    from fastrun.backends.cuda import cuda_available, require_cuda
    from fastrun.runner.api import Model
    from fastrun.runner.registry import paired_draft

    path = resolve(model)
    draft = engine.get("draft")
    if draft is not None:  # pulled (with its bar) before anything loads
        engine["draft"] = resolve(paired_draft(model) if draft == "auto" else draft)
    if backend == "auto":
        backend = "cuda" if cuda_available() else "cpu"
    if backend == "cpu" and not kernels_cached():
        stderr_console.print("[dim]fastrun: compiling CPU kernels (first run only)...[/dim]")
    if backend != "cuda":
        m = Model(path, backend=backend, n_ctx=ctx_size, threads=threads, **engine)
        start_up_done()
        return m
    require_cuda()  # before the bar is drawn
    with DownloadProgress() as bar:  # weights go to the GPU once, with a bar
        total = sum(os.path.getsize(p) for p in (path, engine.get("draft")) if p is not None)
        bar.start("upload to GPU", total)
        m = Model(
            path, backend=backend, n_ctx=ctx_size, progress=bar.advance,
            draft_progress=bar.advance, **engine,
        )  # fmt: skip
        bar.done()
    start_up_done()
    return m


def sampling(
    max_tokens, temp, top_k, top_p, min_p, repeat_penalty, presence, frequency, seed, stop,
    ignore_eos=False,
):  # fmt: skip
    return dict(
        max_tokens=max_tokens, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence, frequency_penalty=frequency,
        seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos,
    )  # fmt: skip


@app.command()
def run(
    model: Annotated[str, typer.Argument(help="GGUF path or registry name.")],
    prompt: Annotated[str, typer.Argument(help="The prompt; '-' reads it from stdin.")],
    max_tokens: MaxTokens = 256,
    temp: Temperature = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: RepeatPenalty = 1.0,
    presence_penalty: PresencePenalty = 0.0,
    frequency_penalty: FrequencyPenalty = 0.0,
    seed: Seed = None,
    stop: Stop = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt in the chat template.")
    ] = False,
    system: System = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object at the end.")
    ] = False,
    ctx_size: CtxSize = None,
    keep: Keep = 4,
    no_context_shift: NoShift = False,
    ignore_eos: IgnoreEos = False,
    batch_size: BatchSize = 512,
    threads: Threads = None,
    backend: BackendOpt = "auto",
    draft: Draft = None,
    lookup: Lookup = False,
    draft_max: DraftMax = SPEC.draft_max,
    draft_min: DraftMin = SPEC.draft_min,
    draft_p_min: DraftPMin = SPEC.draft_p_min,
) -> None:
    """Generate a continuation of PROMPT; the text alone goes to stdout."""
    if prompt == "-":
        prompt = sys.stdin.read()
    shift = not no_context_shift
    engine = dict(parallel=1, batch_size=batch_size, n_keep=keep, context_shift=shift)
    engine |= speculative(draft, lookup, draft_max, draft_min, draft_p_min)
    m = load_model(model, backend, ctx_size, threads, **engine)
    settings = sampling(max_tokens, temp, top_k, top_p, min_p, repeat_penalty, presence_penalty,
                        frequency_penalty, seed, stop, ignore_eos)  # fmt: skip
    if chat or system:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        pieces = m.chat(messages, **settings)
    else:
        pieces = m.generate(prompt, **settings)
    for piece in pieces:
        if not as_json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    done = pieces.completion
    if as_json:
        result = {
            "text": done.text,
            "tokens": done.tokens,
            "prompt_tokens": done.prompt_tokens,
            "finish_reason": done.finish_reason,
            "context_shifts": done.context_shifts,
            "timings": timings(done),
        }
        sys.stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
    elif done.text and not done.text.endswith("\n"):
        sys.stdout.write("\n")


def timings(done) -> dict:
    """A Completion's speeds for --json; with speculative decoding, how its drafts fared."""
    result = {
        "prefill_tokens_per_second": round(done.prefill_tps, 2),
        "decode_tokens_per_second": round(done.decode_tps, 2),
        "prefill_seconds": round(done.prefill_seconds, 4),
        "decode_seconds": round(done.decode_seconds, 4),
    }
    if done.draft_rounds:
        result |= {
            "draft_rounds": done.draft_rounds,
            "drafted_tokens": done.drafted_tokens,
            "accepted_tokens": done.accepted_tokens,
            "acceptance_rate": round(done.acceptance_rate, 4),
            "mean_accepted_length": round(done.mean_accepted_length, 3),
        }
    return result


CHAT_HELP = "/reset clears the conversation, /system TEXT sets the system message, /stats, /exit"


@app.command("chat")
def chat_command(
    model: Annotated[str, typer.Argument(help="GGUF path or registry name.")],
    system: System = None,
    max_tokens: MaxTokens = 1024,
    temp: Temperature = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: RepeatPenalty = 1.0,
    presence_penalty: PresencePenalty = 0.0,
    frequency_penalty: FrequencyPenalty = 0.0,
    seed: Seed = None,
    stop: Stop = None,
    ctx_size: CtxSize = None,
    keep: Keep = 4,
    no_context_shift: NoShift = False,
    threads: Threads = None,
    backend: BackendOpt = "auto",
    draft: Draft = None,
    lookup: Lookup = False,
    draft_max: DraftMax = SPEC.draft_max,
    draft_min: DraftMin = SPEC.draft_min,
    draft_p_min: DraftPMin = SPEC.draft_p_min,
) -> None:
    """Chat in the terminal with the model's own template. Ctrl-C stops a reply, Ctrl-D exits."""
    from rich.console import Console

    console = Console(highlight=False)
    engine = dict(parallel=1, n_keep=keep, context_shift=not no_context_shift)
    engine |= speculative(draft, lookup, draft_max, draft_min, draft_p_min)
    m = load_model(model, backend, ctx_size, threads, **engine)
    settings = sampling(max_tokens, temp, top_k, top_p, min_p, repeat_penalty, presence_penalty,
                        frequency_penalty, seed, stop)  # fmt: skip
    messages = [{"role": "system", "content": system}] if system else []
    console.print(f"[bold]fastrun chat[/bold] · {model} · [dim]{CHAT_HELP}; Ctrl-D exits[/dim]")
    while True:
        try:
            line = console.input("[bold green]>>> [/bold green]")
        except EOFError:
            console.print()
            return
        except KeyboardInterrupt:
            console.print("\n[dim](Ctrl-D or /exit quits)[/dim]")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, arg = text.partition(" ")
            if command in ("/exit", "/quit", "/bye"):
                return
            if command == "/reset":
                messages = [m_ for m_ in messages if m_["role"] == "system"]
                console.print("[dim]conversation cleared[/dim]")
            elif command == "/system":
                messages = [{"role": "system", "content": arg}] + [
                    m_ for m_ in messages if m_["role"] != "system"
                ]
                console.print("[dim]system message set[/dim]")
            elif command == "/stats":
                _print_stats(console, m)
            else:
                console.print(f"[dim]unknown command {command}; {CHAT_HELP}[/dim]")
            continue
        messages.append({"role": "user", "content": line})
        try:
            for piece in m.chat(messages, **settings):
                console.file.write(piece)  # raw text: rich's markup parsing per token is slow
                console.file.flush()
        except KeyboardInterrupt:
            console.print("\n[dim]\\[stopped][/dim]", end="")
        except FastrunError as e:
            messages.pop()
            console.print(f"[red]fastrun: error: {e}[/red]")
            continue
        console.print()
        messages.append({"role": "assistant", "content": m.last.text})


def _print_stats(console, m) -> None:
    done = m.last
    console.print(
        f"[dim]prompt {done.prompt_tokens} tokens ({done.prefilled_tokens} run, the rest cached) "
        f"at {done.prefill_tps:.1f} tok/s · reply {len(done.tokens)} tokens at "
        f"{done.decode_tps:.1f} tok/s · context {done.prompt_tokens + len(done.tokens)}"
        f"/{m.n_ctx}{_draft_summary(done)}[/dim]"
    )


def _draft_summary(done) -> str:
    if not done.draft_rounds:
        return ""
    return (
        f" · drafts {done.accepted_tokens}/{done.drafted_tokens} accepted "
        f"({done.acceptance_rate:.0%}, {done.mean_accepted_length:.2f} per check)"
    )


@app.command()
def bench(
    model: Annotated[str, typer.Argument(help="GGUF path or registry name.")],
    n_prompt: Annotated[
        int, typer.Option("-p", "--n-prompt", min=0, help="Prompt tokens (pp).")
    ] = 256,
    n_gen: Annotated[int, typer.Option("-n", "--n-gen", min=0, help="Generated tokens (tg).")] = 64,
    reps: Annotated[int, typer.Option("-r", "--repetitions", min=1)] = 3,
    depth: Annotated[
        int,
        typer.Option(
            "-d", "--depth", min=0, help="Tokens in the cache before each test, as llama-bench -d."
        ),
    ] = 0,
    parallel: Annotated[
        str | None,
        typer.Option(
            "--parallel",
            help="Numbers of parallel sequences, e.g. 1,2,4,8,16: aggregate speed through the "
            "batcher, as llama-batched-bench (-p and -n per sequence).",
        ),
    ] = None,
    threads: Threads = None,
    backend: BackendOpt = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure prompt processing and generation speed, as llama-bench does (mean ± sd), or with
    --parallel the aggregate speed of parallel sequences, as llama-batched-bench."""
    from fastrun.runner.bench import run_bench, run_parallel_bench

    counts = _counts(parallel) if parallel else []
    if counts and depth:
        raise FastrunError("--depth is for one sequence's pp and tg; not with --parallel")
    n_ctx = depth + n_prompt + n_gen + 2
    m = load_model(model, backend, n_ctx, threads, parallel=max(counts, default=1))
    if counts:
        _print_parallel(m, model, run_parallel_bench(m, counts, n_prompt, n_gen, reps), as_json)
        return
    rows = run_bench(m, n_prompt, n_gen, reps, depth=depth)
    info = {
        "model": m.file.get("general.name") or model,
        "size_mb": round(m.file.size / 1e6, 1),
        "params_m": round(sum(t.n_elements for t in m.file.tensors.values()) / 1e6, 1),
        "backend": m.backend.name,
        "threads": m.backend.thread_policy.describe() if m.backend.name == "cpu" else None,
    }
    if as_json:
        sys.stdout.write(json.dumps({**info, "results": rows}) + "\n")
        return
    from rich.table import Table

    table = Table("model", "size", "params", "backend", "threads", "test", "t/s")
    for row in rows:
        table.add_row(
            str(info["model"]), f"{info['size_mb']} MB", f"{info['params_m']} M", info["backend"],
            str(info["threads"]), row["test"], f"{row['mean']:.2f} ± {row['sd']:.2f}",
        )  # fmt: skip
    typer.echo(render(table))


def _counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise FastrunError(f"--parallel takes counts like 1,2,4,8: got {text!r}")
    return counts


def _print_parallel(m, model: str, rows: list[dict], as_json: bool) -> None:
    info = {"model": m.file.get("general.name") or model, "backend": m.backend.name}
    if as_json:
        sys.stdout.write(json.dumps({**info, "results": rows}) + "\n")
        return
    from rich.table import Table

    table = Table("model", "backend", "PP", "TG", "B", "T_PP s", "S_PP t/s", "T_TG s",
                  "S_TG t/s", "S t/s")  # fmt: skip
    for r in rows:
        table.add_row(
            str(info["model"]), info["backend"], str(r["npp"]), str(r["ntg"]), str(r["npl"]),
            f"{r['t_pp']:.3f}", f"{r['s_pp']:.2f}", f"{r['t_tg']:.3f}", f"{r['s_tg']:.2f}",
            f"{r['s']:.2f}",
        )  # fmt: skip
    typer.echo(render(table))
