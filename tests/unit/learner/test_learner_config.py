"""LearnerConfig resolution and validation, the CLI's flags, and the trainer's weight files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from boltstream.config import load
from boltstream.errors import ConfigError
from boltstream.learner.cli import parser
from boltstream.learner.config import LearnerConfig, load_config
from boltstream.learner.model_setup import cast_state_dict, load_weights, save_weights
from boltstream.learner.tiny import random_samples
from boltstream.learner.trainer import TorchTrainer


def test_precedence_explicit_over_env_over_default_and_none_disables_staleness(tmp_path: Path) -> None:
    env = {"BOLTSTREAM_LEARN_GROUPS_PER_STEP": "3", "BOLTSTREAM_LEARN_MAX_STALENESS": "none",
           "BOLTSTREAM_LEARN_LORA_TARGETS": "q_proj,v_proj", "BOLTSTREAM_NAMESPACE": "exp.",
           "BOLTSTREAM_STATE_FILE": str(tmp_path / "none.json")}
    cfg = load_config({"checkpoint_every": "7", "groups_per_step": None}, env=env)
    assert (cfg.groups_per_step, cfg.checkpoint_every, cfg.max_staleness) == (3, 7, None)
    assert cfg.lora_targets == ("q_proj", "v_proj") and cfg.settings.namespace == "exp."
    assert cfg.run_name == "exp/smollm2" and cfg.name == "smollm2" and cfg.kind == "full"
    assert LearnerConfig(model="/models/my-model", run="/x/y/").run_name == "x/y"
    assert LearnerConfig(model="/models/my-model").name == "my-model"


@pytest.mark.parametrize(("field", "value"), [("groups_per_step", 0), ("zero_stage", 3), ("loss_agg", "sum"),
                                              ("max_staleness", -1), ("lr", 0.0), ("metrics_port", 70000),
                                              ("lr_warmup_steps", -1), ("publish_dtype", "fp8"),
                                              ("checkpoint_retry_s", -1.0), ("checkpoint_retry_s", float("nan"))])
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        load(LearnerConfig, {field: value}, env={})


def test_offline_settings_are_checked_at_start() -> None:
    cfg = load(LearnerConfig, {"offline": "topic:r.batches", "epochs": "3", "then_online": "true",
                               "offline_from": "0:5,1:2"}, env={})
    assert (cfg.offline, cfg.epochs, cfg.then_online, cfg.offline_to) == ("topic:r.batches", 3, True, "now")
    for given, needle in (({"offline": "x", "epochs": 0}, "epochs"), ({"then_online": True}, "then_online"),
                          ({"offline": "x", "offline_from": "now"}, "offline_from='now': a range starting"),
                          ({"offline": "x", "offline_to": "yesterday"}, "offline_to='yesterday': expected"),
                          ({"offline": "topic:"}, "offline='topic:'")):
        with pytest.raises(ConfigError, match=needle):
            load(LearnerConfig, given, env={})


def test_learner_state_keeps_the_offline_position() -> None:
    from boltstream.learner.checkpointing import LearnerState

    state = LearnerState(step=3, version=3, offsets={0: 4}, offline={"source": "a.parquet", "epoch": 1,
                                                                     "offsets": {"0": 2}})
    back = LearnerState.from_json(state.to_json())
    assert back.offsets == {0: 4} and back.offline == {"source": "a.parquet", "epoch": 1, "offsets": {"0": 2}}
    old = json.loads(state.to_json())
    del old["offline"]  # a checkpoint written before --offline existed
    assert LearnerState.from_json(json.dumps(old)).offline is None


def test_every_field_is_a_flag_and_flags_reach_the_config(tmp_path: Path) -> None:
    args = vars(parser().parse_args(["--lora", "--lora-r", "8", "--max-staleness", "none", "--no-resume",
                                     "--namespace", "cli.", "--lr", "3e-4"]))
    args.pop("plot")
    cfg = load_config(args, env={"BOLTSTREAM_STATE_FILE": str(tmp_path / "none.json")})
    assert (cfg.lora, cfg.lora_r, cfg.max_staleness, cfg.resume, cfg.lr) == (True, 8, None, False, 3e-4)
    assert cfg.settings.namespace == "cli." and cfg.kind == "lora"
    with pytest.raises(ConfigError, match="lora_r"):
        load_config({"lora_r": "eight"}, env={})


def test_step_with_an_lr_sets_it_and_a_step_without_keeps_it() -> None:
    trainer = TorchTrainer(LearnerConfig(model="tiny", lora=True, lr=1e-2))
    trainer.step(random_samples(4, 200, seed=1), lr=2.5e-3)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [2.5e-3]
    trainer.step(random_samples(4, 200, seed=2))
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [2.5e-3]


@pytest.mark.parametrize("lora", [False, True])
def test_saved_weights_load_back_in_place_and_training_continues(lora: bool, tmp_path: Path) -> None:
    cfg = LearnerConfig(model="tiny", lora=lora, lr=1e-2)
    trainer = TorchTrainer(cfg)
    trainer.step(random_samples(4, 200, seed=1))
    save_weights(trainer.model, trainer.tokenizer, tmp_path / "w")
    files = {p.name for p in (tmp_path / "w").iterdir()}
    assert ({"adapter_model.safetensors", "adapter_config.json"} if lora else {"model.safetensors"}) <= files
    trainer.save_state(tmp_path / "s")
    other = TorchTrainer(cfg, tmp_path / "w", tmp_path / "s")
    for a, b in zip(trainer.model.parameters(), other.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    samples = random_samples(4, 200, seed=2)
    assert trainer.step(samples).loss == pytest.approx(other.step(samples).loss, abs=1e-6)
    if not lora:
        with pytest.raises(RuntimeError, match="does not fit"):
            (tmp_path / "w" / "model.safetensors").rename(tmp_path / "w" / "gone")
            load_weights(other.model, tmp_path / "w")


def test_publish_dtype_is_for_full_checkpoints() -> None:
    assert LearnerConfig(publish_dtype="bfloat16").publish_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="publish_dtype.*LoRA"):
        LearnerConfig(lora=True, publish_dtype="bfloat16")


def test_a_bfloat16_lora_learner_trains_its_adapter_in_float32() -> None:
    # the frozen base computes in bf16; the adapter, its gradients and AdamW's moments stay float32,
    # so small updates are not rounded away (what a run's bf16 serving path relies on)
    trainer = TorchTrainer(LearnerConfig(model="tiny", lora=True, dtype="bfloat16", lr=1e-2))
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    assert trainable and {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    metrics = trainer.step(random_samples(4, 200, seed=1))
    assert metrics.loss == metrics.loss and not metrics.skipped  # finite, applied
    assert any(not torch.equal(before[n], p) for n, p in trainable.items())
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}


def test_cast_keeps_tied_tensors_shared_and_leaves_integers_alone() -> None:
    emb = torch.tensor([[1.0, 2.0 + 2**-10]])
    out = cast_state_dict({"embed": emb, "head": emb, "steps": torch.tensor([3]), "other": emb.clone()},
                          torch.bfloat16)
    assert out["embed"].dtype == torch.bfloat16 and out["embed"].tolist() == [[1.0, 2.0]]  # rounded
    assert out["embed"] is out["head"] and out["other"] is not out["embed"]
    assert out["steps"].dtype == torch.int64
    with pytest.raises(ValueError, match="big does not fit torch.float16"):
        cast_state_dict({"big": torch.tensor([1.0, 7e4])}, torch.float16)


def test_weights_saved_cast_are_half_the_bytes_and_load_as_the_rounded_model(tmp_path: Path) -> None:
    trainer = TorchTrainer(LearnerConfig(model="tiny", lr=1e-2))
    trainer.step(random_samples(4, 200, seed=1))
    save_weights(trainer.model, trainer.tokenizer, tmp_path / "fp32")
    save_weights(trainer.model, trainer.tokenizer, tmp_path / "bf16", dtype="bfloat16")
    size = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("fp32", "bf16")}
    assert size["bf16"] < 0.55 * size["fp32"]
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    other = TorchTrainer(LearnerConfig(model="tiny", seed=1))
    load_weights(other.model, tmp_path / "bf16")  # every weight present: the tied head was written once
    for a, b in zip(trainer.model.parameters(), other.model.parameters(), strict=True):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a.detach().to(torch.bfloat16).float(), rtol=0, atol=0)


def test_a_tied_model_saved_cast_writes_the_shared_weight_once(tmp_path: Path) -> None:
    from safetensors import safe_open

    from boltstream.weights.models import byte_tokenizer, tiny_llama

    model = tiny_llama(vocab_size=259, tie_word_embeddings=True)  # SmolLM2 ties its head to the embedding
    save_weights(model, byte_tokenizer(), tmp_path / "w", dtype="bfloat16")
    with safe_open(tmp_path / "w" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    other = tiny_llama(vocab_size=259, seed=1, tie_word_embeddings=True)
    load_weights(other, tmp_path / "w")
    assert other.lm_head.weight is other.model.embed_tokens.weight
    torch.testing.assert_close(other.lm_head.weight, model.lm_head.weight.to(torch.bfloat16).float(), rtol=0, atol=0)
