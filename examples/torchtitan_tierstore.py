"""torchtitan's checkpointer on a tiered store: train, get SIGKILLed, resume, match.

``python examples/torchtitan_tierstore.py --workdir ./titan-run`` trains a small model for
``--steps`` steps with torchtitan's optimizer and LR-scheduler containers and its DCP
``CheckpointManager``, swapped for ``TieredCheckpointManager`` (the one-line change, see
docs/integrations.md): checkpoints every ``--interval`` steps into ``<workdir>/hot``, migrated
to ``<workdir>/cold``. With ``--kill-at K`` the process SIGKILLs itself in step K; run it again
and it resumes from the newest committed checkpoint. With ``--sigterm-at K`` it gets SIGTERM
in step K, as a preempted job does: the save of that step goes to both tiers, the loop stops
(``checkpointer.preempted``) and the process exits 0. It prints the final parameters' digest
and every loss, so two runs can be compared.

On a CPU-only torch, torchtitan's own models cannot be built (they import triton), so the model
here is a small MLP; the checkpointer, containers and save/load path are torchtitan's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from tierstore.integrations.torchtitan import TieredCheckpointManager


class TrainState:
    """The step counter, saved with the checkpoint as torchtitan's trainer saves itself."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)  # the data of a step depends on it alone
    x = torch.randn(16, 32, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="titan-run")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--sigterm-at", type=int, default=None)
    parser.add_argument("--async-mode", default="disabled", choices=["disabled", "async"])
    parser.add_argument(
        "--cold",
        default=None,
        help="cold tier URL (default <workdir>/cold); S3 credentials from the AWS chain",
    )
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=args.steps
    )
    state = TrainState()
    checkpointer = TieredCheckpointManager.Config(
        enable=True,
        folder=os.path.join(args.workdir, "hot"),
        cold=args.cold or os.path.join(args.workdir, "cold"),
        interval=args.interval,
        keep_latest_k=2,
        async_mode=args.async_mode,
        last_save_model_only=False,
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
    )

    if checkpointer.load():
        print(f"resumed from step {state.step}", flush=True)
    while state.step < args.steps:
        state.step += 1
        if state.step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if state.step == args.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption notice
        x, y = batch(state.step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        print(f"step {state.step} loss {loss.item():.9f}", flush=True)
        checkpointer.save(state.step, last_step=state.step == args.steps)
        if checkpointer.preempted:  # the one line: that step is saved, stop here
            print(f"preempted at step {state.step}", flush=True)
            break
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"final {digest.hexdigest()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
