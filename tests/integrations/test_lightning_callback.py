"""The Lightning ``Callback`` against a real ``ddiloco syncer`` process, with gradient
accumulation: only real optimizer steps are learner steps."""

from __future__ import annotations

from datetime import timedelta

import pytest

pl = pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")

import torch  # noqa: E402
from runtime_helpers import read_jsonl, tiny_model  # noqa: E402

from ddiloco.integrations.lightning import DecoupledDiLoCo  # noqa: E402


class GPTModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_model()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def counting_loader(n: int = 512, seq: int = 16, vocab: int = 64) -> torch.utils.data.DataLoader:
    """Sequences x_{i+1} = x_i + k (mod vocab), as (x, y) pairs."""
    g = torch.Generator().manual_seed(1)
    ids = (
        torch.randint(0, vocab, (n, 1), generator=g)
        + torch.randint(1, 4, (n, 1), generator=g) * torch.arange(seq + 1)
    ) % vocab
    ds = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, generator=g)


@pytest.mark.timeout(120)
def test_lightning_callback_syncs_with_a_real_syncer(tmp_path, syncer_factory):
    syncer = syncer_factory("--quorum", "1")
    cb = DecoupledDiLoCo(
        syncer=syncer.address,
        learner=0,
        token=syncer.token,
        P=2,
        H=4,
        tau=1,
        codec="fp32",
        connect_timeout=timedelta(seconds=30),
    )
    module = GPTModule()
    trainer = pl.Trainer(
        max_steps=30,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path / "pl"),
    )
    trainer.callbacks.append(cb)
    trainer.fit(module, counting_loader())
    dl = cb.learner
    assert dl is not None and dl.sync.step == 30 == trainer.global_step  # optimizer steps
    assert len(module.losses) == 60  # two batches per step
    assert dl.sync.ledger.merged > 0
    first, last = sum(module.losses[:10]) / 10, sum(module.losses[-10:]) / 10
    assert last < first - 0.5, (first, last)
    assert dl.stats["pushes_accepted"] >= 8 and cb.installed >= 8, (dl.stats, cb.installed)
    merges = [r for r in read_jsonl(tmp_path / "syncer.jsonl") if r["kind"] == "merge"]
    assert len(merges) >= 8 and {r["fragment"] for r in merges} == {0, 1}
    assert cb.tokens == 30 * 16  # two batches of 8 samples per optimizer step
    assert cb._hook is None  # removed at the end of training
