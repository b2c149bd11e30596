"""LoRA merged in place (inference/lora_merge.py): PEFT's merge bit for bit, into fresh and recycled copies."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from boltstream.errors import CheckpointError
from boltstream.inference import llama_step, lora_merge
from boltstream.weights.models import tiny_model_and_tokenizer


def _adapter(out: Path, seed: int, targets: tuple[str, ...] = ("q_proj", "v_proj"), **config: Any) -> Path:
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_model_and_tokenizer(0)
    torch.manual_seed(seed)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=32, target_modules=list(targets), init_lora_weights=False,
                                     **config)).save_pretrained(out)
    return out


def _peft_merged(base: Any, path: Path) -> Any:
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), path, is_trainable=False).merge_and_unload()


def _same_weights(a: Any, b: Any) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rslora", [False, True])
def test_merge_equals_peft_bit_for_bit(tmp_path: Path, dtype: torch.dtype, rslora: bool) -> None:
    base = tiny_model_and_tokenizer(0)[0].to(dtype)
    path = _adapter(tmp_path / "a", 1, ("q_proj", "v_proj", "gate_proj", "down_proj"), use_rslora=rslora)
    adapter, why_not = lora_merge.read_adapter(path)
    assert why_not is None and adapter is not None
    assert adapter.scaling == pytest.approx(32 / 2 if rslora else 32 / 4)  # alpha / sqrt(r) or alpha / r
    target = copy.deepcopy(base)
    merged = lora_merge.merge_into(target, base, adapter)
    assert merged == {f"model.layers.{i}.{m}" for i in range(2)
                      for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.down_proj")}
    assert _same_weights(target, _peft_merged(base, path))
    assert not _same_weights(target, base)


def test_a_recycled_copy_equals_a_fresh_merge_and_gets_back_what_the_next_adapter_leaves_out(tmp_path: Path) -> None:
    base = tiny_model_and_tokenizer(0)[0]
    pristine = copy.deepcopy(base)
    first = lora_merge.read_adapter(_adapter(tmp_path / "a1", 1, ("q_proj", "o_proj", "up_proj")))[0]
    second_path = _adapter(tmp_path / "a2", 2, ("q_proj", "v_proj"))
    second = lora_merge.read_adapter(second_path)[0]
    target = copy.deepcopy(base)
    done = lora_merge.merge_into(target, base, first)
    lora_merge.merge_into(target, base, second, previously=done)
    assert _same_weights(target, _peft_merged(base, second_path))  # o_proj and up_proj are the base's again
    assert _same_weights(base, pristine)  # the base is only read


def test_adapters_that_are_more_than_plain_lora_are_left_to_peft(tmp_path: Path) -> None:
    assert lora_merge.read_adapter(_adapter(tmp_path / "dora", 1, use_dora=True)) == (None, "use_dora=True")
    rank = lora_merge.read_adapter(_adapter(tmp_path / "rank", 1, rank_pattern={"q_proj": 2}))
    assert rank[0] is None and rank[1].startswith("rank_pattern=")
    path = _adapter(tmp_path / "new", 1)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "use_something_new": True}))
    assert lora_merge.read_adapter(path) == (None, f"use_something_new (unknown to peft {_peft_version()})")


def _peft_version() -> str:
    import peft

    return str(peft.__version__)


def test_an_adapter_of_another_model_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    other, _ = tiny_model_and_tokenizer(0, hidden_size=32)
    get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(
        tmp_path / "other")
    base = tiny_model_and_tokenizer(0)[0]
    target = copy.deepcopy(base)
    adapter = lora_merge.read_adapter(tmp_path / "other")[0]
    with pytest.raises(CheckpointError, match="does not fit the model: factors of model.layers.0.self_attn.q_proj"):
        lora_merge.merge_into(target, base, adapter)
    assert _same_weights(target, base)
    (tmp_path / "other" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="no readable adapter_model.safetensors"):
        lora_merge.read_adapter(tmp_path / "other")


def test_a_refreshed_decode_step_equals_one_built_on_the_merged_weights(tmp_path: Path) -> None:
    """The step of a recycled model object takes the new weights (fused and packed copies) in place."""
    base = tiny_model_and_tokenizer(0)[0].eval()
    recycled, fresh = copy.deepcopy(base), copy.deepcopy(base)
    adapter = lora_merge.read_adapter(_adapter(tmp_path / "a", 1, ("q_proj", "k_proj", "up_proj", "down_proj")))[0]
    old_step = llama_step.step_for(recycled)
    assert old_step is not None
    lora_merge.merge_into(recycled, base, adapter)
    lora_merge.merge_into(fresh, base, adapter)
    llama_step.refresh(recycled)
    assert llama_step.step_for(recycled) is old_step  # no new probe, no new step

    def logits(model: Any) -> torch.Tensor:
        with torch.inference_mode():
            ids = torch.tensor([[3, 4, 5, 6]] * 16)
            out = model(input_ids=ids, use_cache=True)
            from boltstream.inference import transformers_internals

            kv = llama_step.KVBuffer.from_layers(transformers_internals.layers_of(out.past_key_values))
            step = llama_step.step_for(model)
            return step(torch.full((16,), 7), torch.full((16, 1), 4), torch.ones(16, 5, dtype=torch.long), kv)

    assert torch.equal(logits(recycled), logits(fresh))
