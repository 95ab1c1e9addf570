"""A PyTorch Lightning script that is one Decoupled DiLoCo learner.

Start a syncer, then one of these per learner (each on its own machine, or all on one):

    export DDILOCO_TOKEN=secret
    ddiloco syncer --port 50051 &
    python examples/lightning_trainer.py --syncer 127.0.0.1:50051 --learner 0 &
    python examples/lightning_trainer.py --syncer 127.0.0.1:50051 --learner 1

The model is ddiloco's small built-in GPT and the data are counting sequences made here,
so nothing is downloaded; swap in your own LightningModule and DataModule. The lines that
add Decoupled DiLoCo are marked.
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch

from ddiloco.integrations.lightning import DecoupledDiLoCo  # Decoupled DiLoCo
from ddiloco.models import build_model

VOCAB, SEQ = 64, 32


class GPTModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every learner starts from the same model
        self.model = build_model("gpt_tiny", vocab_size=VOCAB, block_size=SEQ)

    def training_step(self, batch, batch_idx):
        _, loss = self.model(*batch)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def counting_data(n: int, seed: int) -> torch.utils.data.DataLoader:
    """Sequences x_{i+1} = x_i + k (mod VOCAB) as (x, y); each learner gets its own seed."""
    g = torch.Generator().manual_seed(seed)
    ids = (
        torch.randint(0, VOCAB, (n, 1), generator=g)
        + torch.randint(1, 4, (n, 1), generator=g) * torch.arange(SEQ + 1)
    ) % VOCAB
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]),
        batch_size=16,
        shuffle=True,
        generator=g,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncer", required=True, help="HOST:PORT of the syncer")
    ap.add_argument("--learner", type=int, required=True, help="this learner's index m")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()

    module = GPTModule()
    sync = DecoupledDiLoCo(syncer=args.syncer, learner=args.learner, H=8, tau=2)  # DDiLoCo
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[sync],
    )  # Decoupled DiLoCo
    data = counting_data(4096, seed=args.learner)
    x, y = data.dataset[:256]  # one fixed batch, scored before and after training

    def probe_loss() -> float:
        module.eval()
        with torch.no_grad():
            return float(module.model(x, y)[1])

    loss_before = probe_loss()
    trainer.fit(module, data)
    print(
        json.dumps(
            {
                "learner": args.learner,
                "steps": sync.learner.sync.step,
                "installed": sync.installed,
                "loss_before": loss_before,
                "loss_after": probe_loss(),
                **{k: sync.learner.stats[k] for k in ("pushes", "pushes_accepted", "installs")},
            }
        )
    )


if __name__ == "__main__":
    main()
