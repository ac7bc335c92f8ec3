"""qlbench.hf: `generate(..., instruction=e)` on a tiny GPT-2, and encoder-decoder models refused (issue 43)."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qlbench.hf import InstructQueryableLoraConfig  # noqa: E402

from helpers import peft_decoder as wrapped  # noqa: E402

IDS = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))
GEN = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)


def scores(out) -> torch.Tensor:
    return torch.stack(out.scores)


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_generate_routes_on_the_instruction_keyword(task_type):
    model = wrapped(task_type=task_type)
    e, other = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))
    given = model.generate(input_ids=IDS, instruction=e, **GEN)
    model.base_model.set_instruction(e)
    bound = model.generate(input_ids=IDS, **GEN)
    model.base_model.set_instruction(None)
    torch.testing.assert_close(scores(given), scores(bound))
    assert not torch.allclose(scores(given), scores(model.generate(input_ids=IDS, instruction=other, **GEN)))
    assert "generate" not in model.base_model.model.__dict__  # the call's wrapper is gone
    with pytest.raises(ValueError, match="pass instruction=e"):
        model.generate(input_ids=IDS, **GEN)  # nothing bound, nothing given: the tuner's own error


def test_generate_repeats_a_per_row_instruction_for_beams():
    model = wrapped(task_type=None)
    E = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))
    beams = dict(max_new_tokens=3, do_sample=False, num_beams=2, pad_token_id=0)
    both = model.generate(input_ids=IDS, instruction=E, **beams)
    for i in range(2):
        one = model.generate(input_ids=IDS[i : i + 1], instruction=E[i], **beams)
        assert torch.equal(both[i], one[0])


def test_encoder_decoder_models_are_refused_at_injection():
    c = transformers.T5Config(
        d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16, vocab_size=100
    )
    config = InstructQueryableLoraConfig(target_modules=["q", "v"], r=4, n_atoms=4, top_k=2, n_blocks=2)
    with pytest.raises(ValueError, match="does not support encoder-decoder models"):
        peft.get_peft_model(transformers.T5ForConditionalGeneration(c), config)


def test_verify_peft_on_a_non_bert_adapter_says_what_it_supports(tmp_path, capsys):
    from qlbench import cli
    from qlbench.hf import QueryableLoraConfig

    base = tmp_path / "gpt2"
    c = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(c).save_pretrained(base)
    config = QueryableLoraConfig(
        target_modules=["c_attn"], r=4, n_atoms=4, top_k=2, n_blocks=2, base_model_name_or_path=str(base)
    )
    model = peft.get_peft_model(transformers.GPT2LMHeadModel.from_pretrained(base), config)
    model.save_pretrained(tmp_path / "adapter")
    capsys.readouterr()  # the saving's progress bars
    assert cli.main(["verify", "--peft", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err
    assert "supports adapters on a BERT-style encoder" in err and len(err.strip().splitlines()) == 1
