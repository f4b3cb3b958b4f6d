"""The CUDA backend end to end: logits against the CPU backend, graphs against eager runs.

Each op is in the parity harness (test_parity.py); these check whole models. They skip where
CuPy or a GPU is absent (CI), and run on the GPU machine before a GPU change lands.
"""

import numpy as np
import pytest
from helpers import greedy_steps, write_tiny_model

from fastrun.backends.cuda import cuda_available
from fastrun.formats.gguf import GGUFFile
from fastrun.runner.batch import Batch
from fastrun.runner.models import model_class

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no CUDA GPU")]

# Real shapes: (name, arch, n_embd, n_ff, n_layer, n_head, n_head_kv, n_vocab). K-quants need
# rows of whole 256-blocks, so they take the 1.5B shape (SmolLM2's 576 is 2.25 blocks).
SHAPES = {
    "smollm2-135m": ("llama", 576, 1536, 30, 9, 3, 49152),
    "qwen2.5-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 151936),
}
CASES = [
    ("smollm2-135m", "Q4_0"),
    ("smollm2-135m", "Q5_0"),
    ("qwen2.5-1.5b", "Q4_K"),
    pytest.param(
        "qwen2.5-1.5b",
        "Q6_K",
        marks=pytest.mark.xfail(
            reason="measured mean KL 9.7e-3 (2026-11-29): Q6_K's two scales per group are "
            "summed in float per group here, in integer lanes per super-block on the CPU, and "
            "the random 28-layer stack amplifies the rare 8-bit rounding flips that follow",
            strict=False,
        ),
    ),
]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def run_model(path, backend: str, prompt: list[int], steps: int, forced=None):
    """Logits after the prompt and after each of `steps` decode steps (host arrays), and
    the tokens fed: the model's own greedy picks, or `forced` ones (teacher forcing, so two
    backends are compared on the same inputs even past a near tie)."""
    from fastrun.backends import get_backend

    f = GGUFFile(str(path))
    model = model_class(f.architecture)(f, get_backend(backend))
    cache = model.new_cache(len(prompt) + steps + 1)
    logits = [model.forward(prompt, cache)[-1]]
    tokens = []
    for step in range(steps):
        tokens.append(int(np.argmax(logits[-1])) if forced is None else forced[step])
        logits.append(model.forward([tokens[-1]], cache)[-1])
    return np.stack(logits), tokens


def compare_with_cpu(path, prompt: list[int], steps: int) -> float:
    """Mean KL(cpu || cuda) over the prompt's last position and `steps` decode steps fed
    the CPU's greedy tokens; asserts CUDA's greedy picks agree up to a near tie."""
    cpu, tokens = run_model(path, "cpu", prompt, steps)
    gpu, _ = run_model(path, "cuda", prompt, steps, forced=tokens)
    for step, token in enumerate(tokens):
        if int(np.argmax(gpu[step])) != token:
            top2 = np.sort(log_softmax(cpu[step]))[-2:]
            assert top2[1] - top2[0] < 0.1, f"step {step}: CUDA picks another token"
    return mean_kl(cpu, gpu)


def mean_kl(a: np.ndarray, b: np.ndarray) -> float:
    la, lb = log_softmax(a), log_softmax(b)
    return float((np.exp(la) * (la - lb)).sum(axis=-1).mean())


@pytest.mark.parametrize("shape, qtype", CASES)
def test_cuda_logits_match_cpu_on_real_shapes(tmp_path, shape, qtype):
    arch, d, ff, layers, heads, kv, vocab = SHAPES[shape]
    path = write_tiny_model(
        tmp_path / f"{shape}.gguf", arch, qtype, d, ff, layers, heads, kv, vocab, 4096, seed=3
    )
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 256, 40)]
    kl = compare_with_cpu(path, prompt, 12)
    print(f"{shape} {qtype}: mean KL(cpu || cuda) = {kl:.2e}")
    # 2e-3: the CPU rounds the softmax's probabilities to fp16 as llama.cpp's CPU graph does,
    # CUDA's one-pass softmax keeps them in float (measured 1.3e-3 and 1.5e-3 for SmolLM2's
    # shape, 2026-12-02; CUDA's own fidelity to llama.cpp is unchanged: KL 0.0029 / 0.0035)
    assert kl <= 2e-3


def test_graph_replay_matches_eager(tmp_path):
    """Decode steps through the captured graphs (one per step size, padded) give the logits of
    eager passes, for 1 to 5 sequences at once."""
    from fastrun.backends import get_backend

    path = write_tiny_model(tmp_path / "tiny.gguf", "qwen2", "Q4_K", 256, 512, 2, 4, 2, 300)
    f = GGUFFile(str(path))
    model = model_class(f.architecture)(f, get_backend("cuda"))
    graphed, eager = model.new_cells(5, 64), model.new_cells(5, 64)
    ids = [5, 17, 250, 3, 99, 140, 7, 8]
    for cells in (graphed, eager):
        for s in cells.sequences:
            model.forward(ids[: 3 + s.index], s)
    for n in (1, 2, 3, 5, 4):
        out = []
        for cells, capture in ((graphed, True), (eager, False)):
            batch = Batch()
            for s in cells.sequences[:n]:
                batch.add(s, [ids[n]])
            out.append(model.run(batch, cells, capture=capture))
        np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, qtype", [("llama", "Q4_0"), ("qwen2", "Q4_K")])
def test_a_chain_of_steps_on_the_device_is_those_steps_alone(tmp_path, arch, qtype):
    """Transformer.run_chain on the GPU (one step's graph replayed, each step's pick fed to
    the next on the device): the ids of single top-1 steps and the same cells, bit
    for bit, for 1, 3 and 17 sequences (17: a step padded to 32)."""
    from fastrun.backends import get_backend

    path = write_tiny_model(tmp_path / "t.gguf", arch, qtype, 256, 512, 2, 4, 2, 300)
    f = GGUFFile(str(path))
    model = model_class(f.architecture)(f, get_backend("cuda"))
    for n in (1, 3, 17):
        results = []
        for chained in (False, True):
            cells = model.new_cells(n, 64)
            for s in cells.sequences:
                model.forward([5, 17, 250, 3, 99][: 1 + s.index % 5], s)
            picks = greedy_steps(model, cells, [7 + i for i in range(n)], [6, 3], chained)
            k, v = (a[:, : n * 64].get() for a in (cells.k, cells.v))  # not the scratch rows
            results.append((picks, [s.tokens for s in cells.sequences], k, v))
            cells.free()
        (picks, held, k, v), (c_picks, c_held, c_k, c_v) = results
        assert c_picks == picks and c_held == held
        np.testing.assert_array_equal(c_k, k)
        np.testing.assert_array_equal(c_v, v)


@pytest.mark.parametrize("kernel", ["matmul_exact", "matvec_tile", "matmul_chains"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_few_token_products_equal_each_token_alone(qtype, kernel, monkeypatch):
    """Products of 2..16 tokens (matmul_exact's tensor cores; matvec_tile, where told to;
    matmul_chains' up to 8) give each token, bit for bit, what the one-token matvec gives it
    alone: speculation's checking passes and small batches compute the numbers plain
    decoding does."""
    from helpers import random_blocks

    import fastrun.backends.cuda.backend as cb
    from fastrun.backends import get_backend

    tokens = dict(matvec_tile=(16, 0, 0), matmul_exact=(0, 16, 0), matmul_chains=(0, 0, 8))
    tokens = tokens[kernel]
    monkeypatch.setattr(cb, "SMALL_BATCH", tokens[0])
    monkeypatch.setattr(cb, "EXACT_BATCH", tokens[1])
    monkeypatch.setattr(cb, "CHAINS", (2, tokens[2]))
    backend = get_backend("cuda")
    rng = np.random.default_rng(3)
    raw = random_blocks(qtype, 200, 3328, rng)  # rows: no multiple of a block's
    w = backend.load_weight(raw, qtype, 200, 3328)
    for n in (2, 3, 4, 5, 8, 9, 16) if kernel != "matmul_chains" else (2, 3, 4, 5, 7, 8):
        x = rng.standard_normal((n, 3328)).astype(np.float32)
        together = backend.to_host(
            backend.matmul(backend.load_vector(x.reshape(-1)).reshape(n, -1), w)
        )
        for i in range(n):
            alone = backend.to_host(backend.matmul(backend.load_vector(x[i]).reshape(1, -1), w))
            np.testing.assert_array_equal(together[i], alone[0], err_msg=f"n={n}, token {i}")


@pytest.mark.parametrize("dispatch", ["default", "exact", "long", "off"])
@pytest.mark.parametrize(
    "arch, qtype, width", [("llama", "Q4_0", 256), ("qwen2", "Q4_K", 256), ("llama", "Q4_0", 288)]
)
def test_checking_pass_logits_equal_one_token_steps(
    tmp_path, monkeypatch, arch, qtype, width, dispatch
):
    """A pass of one sequence's 2..16 tokens (speculation's checking pass, captured) gives
    each token the logits, bit for bit, of one-token steps (EXACT_PASS_TOKENS): matvec_tile,
    matmul_chains, matmul_exact, or for rows of no whole 8-group chunks (width 288) the dp4a
    matvec, and attn_split split as a step's. "exact": FASTRUN_EXACT_BATCH=16 beside it;
    "long": 600 cached tokens in 1024 cells (several splits); "off": FASTRUN_EXACT_PASSES=0,
    where only passes of up to SMALL_BATCH or CHAINS[1] tokens are a step's."""
    import fastrun.backends.cuda.backend as cb
    from fastrun.backends import get_backend

    if dispatch == "exact":
        monkeypatch.setattr(cb, "EXACT_BATCH", 16)
    if dispatch == "off":
        monkeypatch.setattr(cb, "EXACT_PASS_TOKENS", 0)
    largest = max(cb.SMALL_BATCH, cb.CHAINS[1]) if dispatch == "off" else 16
    path = write_tiny_model(tmp_path / "m.gguf", arch, qtype, width, 512, 2, 4, 2, 300)
    f = GGUFFile(str(path))
    model = model_class(f.architecture)(f, get_backend("cuda"))
    prefix = [5, 17, 250, 3, 99]
    drafts = [140, 7, 8, 61, 2, 33, 200, 9, 4, 77, 150, 12, 290, 41, 66, 5]
    cells_size = 64
    if dispatch == "long":
        prefix = np.random.default_rng(1).integers(0, 300, 600).tolist()
        cells_size = 1024
    for n in range(2, largest + 1):
        together, alone = model.new_cells(1, cells_size), model.new_cells(1, cells_size)
        for cells in (together, alone):
            model.forward(prefix, cells.sequences[0])
        batch = Batch()
        batch.add(together.sequences[0], drafts[:n], "all")
        passed = model.run(batch, together)
        for i in range(n):
            batch = Batch()
            batch.add(alone.sequences[0], [drafts[i]])
            step = model.run(batch, alone)
            np.testing.assert_array_equal(passed[i], step[0], err_msg=f"{n} tokens, token {i}")


def test_a_request_alone_gives_the_same_numbers_from_a_reused_prefix(tmp_path):
    """A greedy request alone gives the same tokens and log-probabilities, bit for bit,
    whether its prompt runs whole (150 tokens: cuBLAS's fp16 products) or from the prefix
    its previous run left: the prompt's last token always runs in a pass of its own, as a
    decode step (Backend.batch_invariant is False here)."""
    from fastrun.runner.api import Model

    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q4_0", 256, 512, 2, 4, 2, 300)
    rng = np.random.default_rng(11)
    prompt, other = (rng.integers(0, 300, 150).tolist() for _ in range(2))
    settings = dict(max_tokens=30, temperature=0, ignore_eos=True, logprobs=3)
    m = Model(path, backend="cuda", n_ctx=512, parallel=1)
    runs = []
    for p in (prompt, prompt, other, prompt):  # whole, reused, whole (other took the cells)
        stream = m.generate(p, **settings)
        pieces = [(t.id, t.top_logprobs) for t in stream]
        runs.append((pieces, stream.completion.prefilled_tokens))
    m.close()
    (whole, n0), (reused, n1), _, (again, n3) = runs
    assert n0 == n3 == 150 and n1 == 1
    assert whole == reused == again


def test_engine_sequences_equal_their_solo_runs(tmp_path):
    """Greedy tokens of sequences joining and leaving the CUDA engine's batches (graphs of
    several step sizes, prefill chunks beside decode steps) equal each one's solo run up to
    a near tie: unlike the CPU's, CUDA's logits are not bit-identical across batch sizes (the
    dp4a matvecs up to 16 tokens, the tensor-core kernel above, attention split by batch)."""
    from fastrun.runner.api import Model

    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q4_0", 512, 1024, 4, 8, 4, 2000)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 1900, rng.integers(2, 60)).tolist() for _ in range(12)]
    settings = dict(max_tokens=24, temperature=0, ignore_eos=True)
    solo = Model(path, backend="cuda", n_ctx=128, parallel=1)
    expect = [list(solo.generate(p, logprobs=2, **settings)) for p in prompts]
    solo.close()
    m = Model(path, backend="cuda", n_ctx=128, parallel=12, batch_size=32)
    streams = []
    for p in prompts:
        streams.append(m.generate(p, **settings))
        next(streams[rng.integers(0, len(streams))], None)
    for s in streams:
        for _ in s:
            pass
    agree = 0
    for pieces, stream in zip(expect, streams, strict=True):
        for piece, token in zip(pieces, stream.completion.tokens, strict=True):
            if piece.id != token:
                (_, best), (_, second) = piece.top_logprobs
                # 0.1, as compare_with_cpu: a departure at a margin of 0.054 was measured
                assert best - second < 0.1, f"not a near tie: {best - second:.3f}"
                break
            agree += 1
    print(f"{agree} of {sum(map(len, expect))} tokens equal their solo run's")
    assert agree >= 0.5 * sum(map(len, expect))


def test_context_shift_on_the_gpu(tmp_path):
    from fastrun.runner.api import Model

    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", "Q4_K", 256, 512, 2, 4, 2, 300)
    gpu = Model(path, backend="cuda", n_ctx=32, parallel=1)
    cpu = Model(path, backend="cpu", n_ctx=32, parallel=1)
    settings = dict(max_tokens=80, temperature=0, ignore_eos=True)
    a, b = gpu.complete([5, 6, 7], **settings), cpu.complete([5, 6, 7], **settings)
    assert a.context_shifts == b.context_shifts >= 2 and len(a.tokens) == 80
    # past the shifts the two backends' float sums may break a near tie differently
    assert a.tokens[:20] == b.tokens[:20]


# A 10-token prompt leaves 16 of the 17 compared positions to short-context decode steps,
# where the two backends' float sums (attention, per-group scales) differ most: measured mean
# KL 3.5e-3 there, 2.2e-4 after 200 tokens (2026-11-29); 5.2e-3 and 2.9e-4 since the CPU
# rounds the softmax's probabilities to fp16 as llama.cpp does (2026-12-02). Both backends
# sit as close to llama.cpp as each other (test_fidelity on CUDA: KL 0.0029 / 0.0035; CPU
# 0.0031 / 0.0033).
@pytest.mark.parametrize("n_prompt, bound", [(10, 7e-3), (200, 1e-3)])
def test_real_smollm2_matches_cpu(smollm2_path, n_prompt, bound):
    from fastrun.runner.tokenizer import Tokenizer

    text = "The history of the printing press begins in the fifteenth century. " * 40
    prompt = Tokenizer.from_gguf(GGUFFile(str(smollm2_path))).encode(text)[:n_prompt]
    kl = compare_with_cpu(smollm2_path, prompt, 16)
    print(f"SmolLM2, {n_prompt}-token prompt: mean KL(cpu || cuda) = {kl:.2e}")
    assert kl <= bound
