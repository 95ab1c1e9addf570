"""A Hugging Face Trainer script that is one Decoupled DiLoCo learner.

Start a syncer, then one of these per learner (each on its own machine, or all on one):

    export DDILOCO_TOKEN=secret
    ddiloco syncer --port 50051 &
    python examples/hf_trainer.py --syncer 127.0.0.1:50051 --learner 0 &
    python examples/hf_trainer.py --syncer 127.0.0.1:50051 --learner 1

The model is a small GPT-2 built from a local configuration and the data are counting
sequences made here, so nothing is downloaded; swap in your own model and dataset. The
lines that add Decoupled DiLoCo are marked.
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

from ddiloco.integrations.hf import DecoupledDiLoCoCallback  # Decoupled DiLoCo

VOCAB, SEQ = 32, 16


class CountingData(torch.utils.data.Dataset):
    """Sequences x_{i+1} = x_i + k (mod VOCAB); each learner gets its own seed."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = (
            torch.randint(0, VOCAB, (n, 1), generator=g)
            + torch.randint(1, 4, (n, 1), generator=g) * torch.arange(SEQ)
        ) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--syncer", required=True, help="HOST:PORT of the syncer")
    ap.add_argument("--learner", type=int, required=True, help="this learner's index m")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="runs/hf_trainer")
    args = ap.parse_args()

    torch.manual_seed(0)  # every learner starts from the same model (the syncer keeps one)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2)
    )
    training_args = transformers.TrainingArguments(
        output_dir=f"{args.out}/learner_{args.learner}",
        max_steps=args.steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        logging_steps=10,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    sync = DecoupledDiLoCoCallback(
        syncer=args.syncer,
        learner=args.learner,  # Decoupled DiLoCo
        H=8,
        tau=2,
    )  # token from $DDILOCO_TOKEN
    data = CountingData(4096, seed=args.learner)
    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=data, callbacks=[sync]
    )  # Decoupled DiLoCo
    probe = data.ids[:256]  # one fixed batch, scored before and after training

    def probe_loss() -> float:
        model.eval()
        with torch.no_grad():
            return float(model(input_ids=probe, labels=probe).loss)

    loss_before = probe_loss()
    trainer.train()
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
