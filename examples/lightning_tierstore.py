"""Train with PyTorch Lightning on 2 CPU ranks, checkpointing to tiers, then resume from them.

``python examples/lightning_tierstore.py [--workdir DIR] [--cold URL]`` fits a tiny model with
``ModelParallelStrategy`` (FSDP2 shards on a gloo group; Lightning starts the second rank by
running this script again) for ``--epochs`` epochs, checkpointing every epoch through
``TierstoreCheckpoint`` into a hot tier (``DIR/hot``) that migrates to a cold tier
(``DIR/cold``, or ``--cold s3://...``). A second ``fit`` with ``ckpt_path="last"`` then resumes
from the newest checkpoint in the store and trains ``--more`` epochs. Rank 0 prints what each
tier holds: the two checkpoints with the lowest ``train_loss`` (``save_top_k=2``).

The one line that differs from a plain Lightning script is the callback: ``TierstoreCheckpoint``
where ``ModelCheckpoint`` was (see docs/integrations.md).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from tierstore import Store, list_checkpoints
from tierstore.integrations.lightning import TierstoreCheckpoint


class TinyRegressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def configure_model(self) -> None:  # shard each layer across the data-parallel ranks
        assert self.device_mesh is not None  # ModelParallelStrategy sets it before this hook
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def fit(args: argparse.Namespace, epochs: int) -> L.Trainer:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    checkpoint = TierstoreCheckpoint(
        str(args.workdir / "hot"),
        args.cold or str(args.workdir / "cold"),
        monitor="train_loss",
        save_top_k=2,
        every_n_epochs=1,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        callbacks=[checkpoint],
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        default_root_dir=str(args.workdir),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyRegressor(), torch.utils.data.DataLoader(data, batch_size=8), ckpt_path="last")
    return trainer


def report(trainer: L.Trainer, args: argparse.Namespace, what: str) -> None:
    if trainer.global_rank != 0:
        return
    print(f"{what}: trained to step {trainer.global_step}")
    hot, cold = str(args.workdir / "hot"), args.cold or str(args.workdir / "cold")
    for tier, found in (("hot", list_checkpoints(hot)), ("cold", list_checkpoints(Store(cold=cold)))):
        kept = ", ".join(f"step {c.step} (train_loss {c.metrics['train_loss']:.4f})" for c in found)
        print(f"  {tier}: {kept}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("lightning-run"))
    parser.add_argument("--cold", default=None, help="cold tier URL (default: WORKDIR/cold)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--more", type=int, default=2, help="epochs the resumed fit adds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    report(fit(args, args.epochs), args, "first fit")
    report(fit(args, args.epochs + args.more), args, "resumed fit (ckpt_path='last')")


if __name__ == "__main__":
    main()
