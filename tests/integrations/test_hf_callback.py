"""The transformers ``TrainerCallback`` against a real ``ddiloco syncer`` process: a tiny
GPT-2 built from a local configuration (no download) trains on data the test makes."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
from runtime_helpers import read_jsonl  # noqa: E402

from ddiloco.integrations.hf import DecoupledDiLoCoCallback  # noqa: E402

VOCAB, SEQ = 32, 16


class CountingData(torch.utils.data.Dataset):
    """Sequences x_{i+1} = x_i + k (mod VOCAB): the next token is learnable from the last two."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        k = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + k * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def trainer_for(model, out, callback, steps: int):
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=5,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return transformers.Trainer(
        model=model, args=args, train_dataset=CountingData(512, 1), callbacks=[callback]
    )


@pytest.mark.timeout(120)
def test_trainer_callback_syncs_with_a_real_syncer(tmp_path, syncer_factory):
    syncer = syncer_factory("--quorum", "1")
    cb = DecoupledDiLoCoCallback(
        syncer=syncer.address,
        learner=0,
        token=syncer.token,
        P=2,
        H=4,
        tau=1,
        codec="fp32",
        connect_timeout=timedelta(seconds=30),
    )
    model = tiny_gpt2()
    trainer = trainer_for(model, tmp_path / "hf", cb, steps=40)
    trainer.train()
    dl = cb.learner
    assert dl is not None and dl.sync.step == 40 and cb.tokens == 40 * 8  # samples
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses
    assert dl.stats["pushes_accepted"] >= 10 and cb.installed >= 10, (dl.stats, cb.installed)
    merges = [r for r in read_jsonl(tmp_path / "syncer.jsonl") if r["kind"] == "merge"]
    assert len(merges) >= 10 and all(r["learners"] == [0] for r in merges)
    assert {r["fragment"] for r in merges} == {0, 1}  # every fragment took part


@pytest.mark.timeout(60)
def test_callback_rejects_unknown_options():
    with pytest.raises(TypeError, match="unknown DecoupledLearner option.*Hh"):
        DecoupledDiLoCoCallback(syncer="127.0.0.1:1", learner=0, Hh=4)
