"""``--model PATH``: a Hugging Face directory (a tiny Llama and a word-level tokenizer saved
here) is loaded with its tokenizer, its layout read from its config, and reused exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fakes import DictMemory  # noqa: E402

from cmx.deploy.config import EngineOptions, ModelOptions  # noqa: E402
from cmx.deploy.engine import Engine  # noqa: E402
from cmx.deploy.messages import GenerateRequest  # noqa: E402
from cmx.deploy.model import load_model  # noqa: E402
from cmx.deploy.sampling import SamplingParams  # noqa: E402
from cmx.deploy.tokenizer import Message  # noqa: E402
from cmx.policies.breakeven import BreakEven  # noqa: E402

WORDS = "the cache tier block prefix replica node memory load store token model".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 4,
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                            eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, eos_token_id=1)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_a_local_model_directory_serves_with_exact_reuse(model_dir: Path) -> None:
    engine_opts = EngineOptions(block_tokens=16, chunk_tokens=32)
    loaded = load_model(ModelOptions(path=str(model_dir)), engine_opts)
    layout = loaded.spec.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (3, 2, 16)
    assert loaded.spec.model == model_dir.name and len(loaded.spec.weights) == 32
    ids = loaded.tokenizer.encode(" ".join(WORDS * 12))
    assert len(ids) == 144 and loaded.tokenizer.decode(ids[:2]) == "the cache"
    chat = loaded.tokenizer.chat([Message("user", "the cache")])  # no template: plain text
    assert "the cache" in loaded.tokenizer.decode(chat)

    memory = DictMemory(layout)
    eng = Engine(loaded, memory, 32, BreakEven(links={"dram": (1e-6, 1e12)}, margin=0.0))
    greedy = SamplingParams(temperature=0.0)
    eng.run(GenerateRequest("a", tuple(ids), 4, greedy, ignore_eos=True))
    eng.flush()
    prompt = tuple(ids + ids[:7])
    hit = eng.run(GenerateRequest("b", prompt, 6, greedy, ignore_eos=True))
    miss = eng.run(GenerateRequest("c", prompt, 6, greedy, ignore_eos=True, use_cache=False))
    assert hit.cached_tokens == 128 and hit.token_ids == miss.token_ids


def test_a_different_seed_is_a_different_namespace() -> None:
    tiny = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=1, vocab_size=300, max_positions=512)
    engine = EngineOptions(block_tokens=16, chunk_tokens=32)
    a = load_model(ModelOptions(seed=1, **tiny), engine).spec  # type: ignore[arg-type]
    b = load_model(ModelOptions(seed=1, **tiny), engine).spec  # type: ignore[arg-type]
    c = load_model(ModelOptions(seed=2, **tiny), engine).spec  # type: ignore[arg-type]
    d = load_model(ModelOptions(seed=1, **tiny),  # type: ignore[arg-type]
                   EngineOptions(block_tokens=16, chunk_tokens=64)).spec
    assert a.digest == b.digest
    assert len({a.digest, c.digest, d.digest}) == 3  # weights, and the prefill grid, matter
