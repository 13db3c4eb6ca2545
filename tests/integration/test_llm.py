"""``specdec.LLM``: one call from prompts to text, in vLLM's terms, on a small synthetic model written here.

Greedy speculative output must equal plain output token for token, stop strings
and stop tokens must end outputs the way vLLM's do, a stopped request must give
its KV back, and every ``speculative_config`` mistake must be named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_gguf import FakeModel, write_fake_gguf

from specdec import LLM, SamplingParams
from specdec.llm import SpeculativeConfig

PROMPTS = ["the naive cafe", "hello world, hello", "abc abc abc"]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> FakeModel:
    return write_fake_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    return tmp_path


def test_speculative_greedy_output_equals_plain_output(gguf: FakeModel, home: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(gguf.path)).generate(PROMPTS, params)
    for config in (
        {"method": "dflash", "num_speculative_tokens": 3},
        {"method": "draft_model", "num_speculative_tokens": 2, "fused": True},
        {"method": "ngram", "num_speculative_tokens": 4, "max_ngram": 2},
    ):
        out = LLM(str(gguf.path), speculative_config=config).generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain], config
        assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in plain], config
        assert all(len(o.outputs[0].token_ids) == 12 and o.outputs[0].finish_reason == "length" for o in out)
        assert sum(o.metrics.drafted for o in out) > 0, config
        assert all(o.metrics.verify_steps > 0 and len(o.metrics.acceptance_rate_by_position) >= 1 for o in out)
    assert [o.prompt for o in plain] == PROMPTS and plain[0].request_id != plain[1].request_id


def test_stop_strings_end_the_text_before_them_and_free_the_request(gguf: FakeModel, home: Path) -> None:
    llm = LLM(str(gguf.path), speculative_config={"method": "dflash", "num_speculative_tokens": 3})
    [full] = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    text = full.outputs[0].text
    stop = text[5:7]  # two characters the model is known to produce
    assert stop and stop not in text[:5]
    [cut] = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    completion = cut.outputs[0]
    assert completion.text == text[: text.index(stop)] and stop not in completion.text
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert (
        len(completion.token_ids) < 24
        and full.outputs[0].token_ids[: len(completion.token_ids)] == completion.token_ids
    )


def test_a_stop_token_ends_the_output_and_is_named(gguf: FakeModel, home: Path) -> None:
    llm = LLM(str(gguf.path))
    [free] = llm.generate([[5, 9, 2, 7]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    third = free.outputs[0].token_ids[2]
    [stopped] = llm.generate(
        [[5, 9, 2, 7]], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[third], ignore_eos=True)
    )
    completion = stopped.outputs[0]
    assert completion.token_ids == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(third) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", third)


def test_a_seeded_sample_is_reproducible(gguf: FakeModel, home: Path) -> None:
    llm = LLM(str(gguf.path), speculative_config={"method": "dflash", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(["xyz", "abc"], params)]
    assert first == [o.outputs[0].token_ids for o in llm.generate(["xyz", "abc"], params)]
    alone = llm.generate("abc", params)[0].outputs[0].token_ids
    assert alone == llm.generate("abc", params)[0].outputs[0].token_ids
    other = llm.generate("abc", SamplingParams(temperature=1.0, max_tokens=10, seed=8, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone  # the seed is used (10 tokens over a 300-token vocabulary)


def test_chat_applies_the_models_template(gguf: FakeModel, home: Path) -> None:
    llm = LLM(str(gguf.path))
    [out] = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=4))
    assert out.prompt is not None and out.prompt.startswith("<|im_start|>system") and out.prompt.endswith("assistant\n")
    assert out.prompt_token_ids == llm.get_tokenizer().encode_chat([{"role": "user", "content": "Hi"}])


def test_speculative_config_mistakes_are_named(gguf: FakeModel) -> None:
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) capacty for 'dspark'; valid: method, num_speculative_tokens"
    ):
        SpeculativeConfig.parse({"method": "dspark", "capacty": "threshold"})
    with pytest.raises(ValueError, match=r"method 'hydra': unknown backend 'hydra'"):
        SpeculativeConfig.parse({"method": "hydra"})
    with pytest.raises(ValueError, match="needs a 'method'"):
        SpeculativeConfig.parse({"num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 0})
    parsed = SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2, "fused": True})
    assert (parsed.backend, parsed.num_speculative_tokens, parsed.options) == ("draft-model", 2, {"fused": True})


def test_sampling_params_take_vllms_spellings() -> None:
    params = SamplingParams(top_k=-1, stop="\n", stop_token_ids=[3, 4], max_tokens=5)
    assert params.top_k is None and params.stop == ("\n",) and params.stop_token_ids == (3, 4)
    with pytest.raises(ValueError, match="empty stop string"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
