"""Sliding-window layers' rings on the GPU (runner/kv_cache.py): a Gemma-3-shaped synthetic
model (five local layers of a 32-position window to one global, 64-wide heads) whose rings
wrap many times, prefilled in passes of 150 tokens (the tiled attention, a wrap inside a
pass) and decoded through captured graphs, also after a context shift has moved the ring
offsets that the graphs read from the device. Against the CPU on full storage, teacher-forced
with the same random tokens. Skips without CuPy or a GPU."""

import numpy as np
import pytest
from helpers import write_tiny_model
from test_cuda import log_softmax, mean_kl

from fastrun.backends.cuda import cuda_available
from fastrun.formats.gguf import GGUFFile
from fastrun.runner.batch import Batch
from fastrun.runner.models import model_class

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no CUDA GPU")]

WINDOW, PASS, N_CTX = 32, 150, 1024
RING = WINDOW + PASS


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma-gpu")
    return write_tiny_model(
        folder / "gemma3-shaped.gguf", arch="gemma3", qtype="Q8_0", n_embd=256, n_ff=512,
        n_layer=6, n_head=4, n_head_kv=2, n_vocab=300, window=WINDOW,
    )  # fmt: skip


def _model(path, backend: str):
    from fastrun.backends import get_backend

    f = GGUFFile(str(path))
    return model_class(f.architecture)(f, get_backend(backend))


def _teacher_forced(model, ring: bool, tokens: list[int]) -> np.ndarray:
    """Last-token logits after each pass: 300 prompt tokens in passes of 150, 150 decode
    steps, a context shift (4 kept, 200 dropped), 100 more decode steps."""
    cache = model.new_cache(N_CTX, PASS if ring else N_CTX)  # max_pass N_CTX: no ring
    assert cache.cells.ring == (RING if ring else 0)
    out = [model.forward(tokens[0:150], cache)[-1], model.forward(tokens[150:300], cache)[-1]]
    for t in tokens[300:450]:
        out.append(model.forward([t], cache)[-1])
    cache.shift(4, 200, model.layer_ropes(cache.cells))
    if ring:
        assert cache.ring_offset == 200 % RING
    for t in tokens[450:550]:
        out.append(model.forward([t], cache)[-1])
    return np.stack(out)


def test_rings_on_the_gpu_match_the_cpu_on_full_storage(gemma_path):
    tokens = np.random.default_rng(8).integers(0, 300, 550).tolist()
    cpu = _teacher_forced(_model(gemma_path, "cpu"), False, tokens)
    cuda = _model(gemma_path, "cuda")
    ring, full = _teacher_forced(cuda, True, tokens), _teacher_forced(cuda, False, tokens)
    kl_cpu, kl_full = mean_kl(cpu, ring), mean_kl(full, ring)
    print(f"mean KL(cpu full || cuda ring) {kl_cpu:.2e}, (cuda full || cuda ring) {kl_full:.2e}")
    assert kl_cpu <= 1e-3 and kl_full <= 1e-4
    for step in range(len(cpu)):  # the same picks up to a near tie
        if int(np.argmax(ring[step])) != int(np.argmax(cpu[step])):
            top2 = np.sort(log_softmax(cpu[step]))[-2:]
            assert top2[1] - top2[0] < 0.1, f"step {step}: another token on the GPU's rings"


def test_ring_graphs_replay_the_offsets_of_their_step(gemma_path):
    """Decode steps of three sequences at other ring offsets through the captured graphs equal
    eager passes, before and after shifts that change the offsets (the graphs were captured
    while they were 0)."""
    model = _model(gemma_path, "cuda")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 300, n).tolist() for n in (300, 200, 40)]
    graphed, eager = model.new_cells(3, 512, PASS), model.new_cells(3, 512, PASS)
    for cells in (graphed, eager):
        for s, p in zip(cells.sequences, prompts, strict=True):
            for at in range(0, len(p), PASS):
                model.forward(p[at : at + PASS], s)
    for step in range(60):
        if step in (20, 40):
            for cells in (graphed, eager):
                cells.sequences[step // 20 - 1].shift(4, 90 + step, model.layer_ropes(cells))
        token = int(rng.integers(0, 300))
        out = []
        for cells, capture in ((graphed, True), (eager, False)):
            batch = Batch()
            for s in cells.sequences:
                batch.add(s, [token])
            out.append(model.run(batch, cells, capture=capture))
        np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-5)
    offsets = [s.ring_offset for s in graphed.sequences]
    assert offsets[0] and offsets[1] and offsets == [s.ring_offset for s in eager.sequences]
    assert any(key[0] == id(graphed) for key in model.backend._graphs)
