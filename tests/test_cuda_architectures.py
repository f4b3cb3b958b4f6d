"""Every architecture on the GPU against the CPU: the fixtures of test_architectures (Q8_0, so
both backends take their integer kernels) and the real Gemma 3 270M past its 512-position
window (prefill through the tiled attention, decode steps through graphs). Skips without
CuPy or a GPU."""

import numpy as np
import pytest
from helpers import real_model
from test_architectures import FIXTURES, NAMES
from test_cuda import compare_with_cpu

from fastrun.backends.cuda import cuda_available
from fastrun.quant.pipeline import quantize_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no CUDA GPU")]


@pytest.mark.parametrize("name", NAMES)
def test_fixture_architectures_match_cpu(name, tmp_path):
    path = tmp_path / f"{name}.q8_0.gguf"
    quantize_model(FIXTURES / f"{name}.gguf", path, "Q8_0", threads=1)
    prompt = np.load(FIXTURES / f"{name}.npz")["ids"].tolist()
    kl = compare_with_cpu(path, prompt, 12)  # 36 positions: past the fixtures' windows of 8
    print(f"{name}: mean KL(cpu || cuda) = {kl:.2e}")
    assert kl <= 1e-3


@pytest.mark.parametrize("n_prompt", [40, 600])
def test_real_gemma3_matches_cpu(n_prompt):
    from fastrun.formats.gguf import GGUFFile
    from fastrun.runner.tokenizer import Tokenizer

    path = real_model("gemma3-270m")
    text = "The history of the printing press begins in the fifteenth century. " * 80
    prompt = Tokenizer.from_gguf(GGUFFile(str(path))).encode(text, add_bos=True)[:n_prompt]
    kl = compare_with_cpu(path, prompt, 16)
    print(f"Gemma 3, {n_prompt}-token prompt: mean KL(cpu || cuda) = {kl:.2e}")
    assert kl <= 5e-3
