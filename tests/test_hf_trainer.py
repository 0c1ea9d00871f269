"""transformers' Trainer drives a tiered model and optimizer unchanged (issue 18): accumulation 2,
max_grad_norm 1.0, states on disk; its logged losses equal plain Trainer's bit for bit, and its
checkpoint resumes into the same losses."""

import pytest
import torch

import tiertrain
from tiertrain.memory import Budgets, Tier
from tiertrain.models import build
from tiertrain.plan import BlockPlan, Plan

transformers = pytest.importorskip("transformers")

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 128,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
STEPS, ACCUM = 10, 2


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.rows = torch.randint(1, 128, (64, 16), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _args(out, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=ACCUM,
        max_grad_norm=1.0, learning_rate=2e-3, lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.0,
        logging_steps=1, save_steps=5, save_strategy="steps", report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, **kw)


def _model_and_opt():
    torch.manual_seed(0)
    model = build(GPT2)
    return model, torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.999), fused=True)


def _tiered(tmp_path, name: str):
    model, opt = _model_and_opt()
    disk = Plan(tuple(BlockPlan(home=Tier.DISK, stream=True) for _ in range(2)), BlockPlan(home=Tier.DISK),
                name="disk-home")
    budgets = Budgets(64 << 20, 64 << 20, 64 << 20, str(tmp_path / f"disk-{name}"))
    return tiertrain.setup(model, opt, budgets, plan=disk, grad_accum=ACCUM, max_grad_norm=1.0, page_size=64 << 10)


def _train(model, opt, out, resume=None) -> list[float]:
    sched = transformers.get_scheduler("cosine", optimizer=opt, num_warmup_steps=2, num_training_steps=STEPS)
    trainer = transformers.Trainer(model=model, args=_args(out), train_dataset=Tokens(), optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    return [(row["step"], row["loss"], row["grad_norm"]) for row in trainer.state.log_history if "loss" in row]


def test_trainer_trains_a_tiered_model_bitwise_and_its_checkpoint_resumes(tmp_path):
    plain = _train(*_model_and_opt(), tmp_path / "plain")
    tm, topt = _tiered(tmp_path, "a")
    try:
        tiered = _train(tm, topt, tmp_path / "tiered")
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert len(plain) == STEPS and tiered == plain
    tm, topt = _tiered(tmp_path, "b")
    try:
        resumed = _train(tm, topt, tmp_path / "tiered", resume=str(tmp_path / "tiered" / "checkpoint-5"))
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()
    assert [row for row in resumed if row[0] > 5] == plain[5:]  # steps 6-10 run again from the checkpoint
