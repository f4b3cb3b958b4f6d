"""`fastrun perplexity MODEL FILE`: llama-perplexity's measure, and KL divergence to a base."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from fastrun.formats.errors import FastrunError
from fastrun.runner.app import EXIT_INTERRUPTED, app, resolve
from fastrun.runner.progress import WorkProgress, stderr_console


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError as e:
        raise FastrunError(f"cannot read {path}: {e.strerror}") from None


@app.command()
def perplexity(
    model: Annotated[str, typer.Argument(help="GGUF path or registry name.")],
    text_file: Annotated[str, typer.Argument(help="UTF-8 text to score.")],
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", min=8, help="Chunk length.")] = 512,
    chunks: Annotated[
        int | None, typer.Option("--chunks", min=1, help="Score at most this many chunks.")
    ] = None,
    kl_base: Annotated[
        str | None,
        typer.Option("--kl-divergence-base", help="Save this model's log-probabilities here."),
    ] = None,
    kl_compare: Annotated[
        str | None,
        typer.Option("--kl-divergence", help="Compare against log-probabilities saved before."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing base.")] = False,
    threads: Annotated[
        int | None, typer.Option("-t", "--threads", min=1, help="CPU threads (default: all).")
    ] = None,
    backend: Annotated[str, typer.Option("--backend", help="cpu, cuda or auto.")] = "auto",
) -> None:
    """Perplexity of a model on a text, chunk by chunk as llama-perplexity computes it."""
    from fastrun.runner.api import Model
    from fastrun.runner.logprob_file import LogprobFile
    from fastrun.runner.perplexity import evaluate

    if kl_base and kl_compare:
        raise FastrunError("--kl-divergence-base and --kl-divergence exclude each other")
    if kl_base and os.path.exists(kl_base) and not force:
        raise FastrunError(f"{kl_base} exists; pass --force to overwrite it")
    text = _read_text(text_file)
    base = LogprobFile(kl_compare) if kl_compare else None
    path = resolve(model)
    m = Model(path, backend=backend, n_ctx=ctx_size, threads=threads)
    tokens = m.tokenize(text)
    try:
        with WorkProgress() as bar:
            result = evaluate(m, tokens, ctx_size, chunks, base, kl_base, progress=bar)
    except KeyboardInterrupt:
        stderr_console.print("fastrun: interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    finally:
        m.close()

    ppl, err = result.scores.ppl()
    typer.echo(
        f"{os.path.basename(path)}: {len(tokens)} tokens, {result.n_chunks} chunks of {ctx_size}"
    )
    typer.echo(f"PPL = {ppl:.4f} +/- {err:.5f}")
    typer.echo(
        f"{result.tokens_per_second:.1f} tokens/s ({result.seconds:.1f} s for "
        f"{result.n_chunks * ctx_size} tokens)"
    )
    if kl_base:
        typer.echo(f"log-probabilities saved to {kl_base}")
    kl = result.kl_summary()
    if kl:
        typer.echo(f"PPL(base) = {kl['ppl_base']:.4f}")
        typer.echo(f"Mean KLD: {kl['mean_kld']:.6f} +/- {kl['mean_kld_err']:.6f}")
        typer.echo(
            f"Maximum KLD: {kl['max_kld']:.6f}  99.0% KLD: {kl['kld_99']:.6f}  "
            f"Median KLD: {kl['median_kld']:.6f}"
        )
        typer.echo(f"Same top p: {100 * kl['same_top']:.3f} +/- {100 * kl['same_top_err']:.3f} %")
