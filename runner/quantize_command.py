"""`fastrun quantize IN OUT --type T`: convert a GGUF file as llama-quantize does, or a Hugging
Face folder as convert_hf_to_gguf.py (then llama-quantize) does."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from fastrun.formats.errors import FastrunError
from fastrun.runner.app import EXIT_INTERRUPTED, app
from fastrun.runner.progress import WorkProgress, stderr_console

_MIB = 1024 * 1024


@app.command()
def quantize(
    source: Annotated[
        str,
        typer.Argument(
            help="Input: a GGUF file (F32, F16, BF16 or quantized) or a Hugging Face folder "
            "(config.json, *.safetensors, tokenizer.json)."
        ),
    ],
    output: Annotated[str, typer.Argument(help="Output GGUF file.")],
    type_name: Annotated[
        str,
        typer.Option(
            "--type",
            "-q",
            help="F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K(_S/_M), Q5_K(_S/_M), Q6_K.",
        ),
    ],
    allow_requantize: Annotated[
        bool, typer.Option("--allow-requantize", help="Accept an already quantized input.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output.")] = False,
    threads: Annotated[
        int | None, typer.Option("-t", "--threads", min=1, help="CPU threads (default: all).")
    ] = None,
) -> None:
    """Quantize a GGUF model or convert a Hugging Face folder; which tensor gets which type
    follows llama-quantize (and convert_hf_to_gguf.py for F32, F16, BF16 and Q8_0)."""
    from fastrun.quant.recipes import file_type

    ftype = file_type(type_name)  # an unknown type fails before any file is touched
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise FastrunError(f"{source} is a folder without config.json, not a model folder")
    elif not os.path.isfile(source):
        raise FastrunError(f"no such file: {source}")
    if os.path.exists(output) and not force:
        raise FastrunError(f"{output} exists; pass --force to overwrite it")
    from fastrun.quant.pipeline import quantize_model

    try:
        with WorkProgress() as bar:
            result = quantize_model(
                source, output, ftype.name, allow_requantize, progress=bar, threads=threads
            )
    except KeyboardInterrupt:
        stderr_console.print(f"fastrun: interrupted; {output} was not written")
        raise typer.Exit(EXIT_INTERRUPTED) from None

    in_bpw = 8 * result.in_bytes / max(1, result.n_weights)
    types = ", ".join(f"{t}: {n}" for t, n in result.types.most_common())
    typer.echo(f"{output}: {ftype.name}")
    typer.echo(
        f"  size    {result.in_bytes / _MIB:.1f} MiB -> {result.out_bytes / _MIB:.1f} MiB "
        f"({in_bpw:.2f} -> {result.bits_per_weight:.2f} bits per weight)"
    )
    typer.echo(f"  tensors {types}")
    typer.echo(f"  time    {result.seconds:.2f} s")
