"""A Lightning callback that trains under a decentral protocol (extra: pip install 'decentral[lightning]').

    transport = SwarmTransport("my-run", initial_peers=[...])
    trainer = lightning.Trainer(max_steps=1000, callbacks=[DecentralCallback("diloco", transport, every=50)])
    trainer.fit(module, data)

At fit start (the strategy has made the optimizer) the protocol wraps the LightningModule and its one
torch optimizer and joins the swarm; at fit end it finishes what is in flight; on an exception it only
unhooks. `max_steps` counts the swarm's steps: a peer that joins late stops where the others do. Lightning
runs the backward inside the optimizer's step (a closure), so a gradient protocol's `before_step` (DDP) runs
at `on_before_optimizer_step`, after backward, rather than from the step's pre-hook.
The protocol's state (its step, round and outer tensors) is the callback's state in Lightning's checkpoints,
those saved after fit included (the state it ended with), so `trainer.fit(..., ckpt_path=...)` resumes it too.
"""

from __future__ import annotations

from decentral.integrations.adoption import Adoption, ProtocolFactory
from decentral.transport import Transport

try:
    from lightning.pytorch import Callback
except ImportError as e:
    raise ImportError("decentral.integrations.lightning needs lightning: pip install 'decentral[lightning]'") from e


class DecentralCallback(Callback):
    """Train under `protocol` over `transport` (arguments as `Adoption`'s; `kwargs` go to the protocol,
    e.g. `every=50`): one protocol step per optimizer step. `adoption.sync` is the protocol while fitting,
    `adoption.reports` its syncs; after each sync `Adoption.metrics` is logged (`sync/...`)."""

    def __init__(self, protocol: str | ProtocolFactory, transport: Transport, *, peers: int = 1,
                 wait_peers_s: float = 300.0, **kwargs):
        self.adoption = Adoption(protocol, transport, peers=peers, wait_peers_s=wait_peers_s, **kwargs)
        self._resumed: dict | None = None  # the protocol's state of the checkpoint being resumed

    def state_dict(self) -> dict:
        """The protocol's state while fitting, and after fit ends (`trainer.save_checkpoint` after `fit`)."""
        state = self.adoption.state_dict()
        return {} if state is None else {"protocol": state}

    def load_state_dict(self, state_dict: dict) -> None:  # before on_fit_start, once the module is restored
        self._resumed = state_dict.get("protocol")

    def on_fit_start(self, trainer, pl_module):
        if len(trainer.optimizers) != 1:
            raise ValueError(f"a protocol hooks one optimizer; the module configured {len(trainer.optimizers)}")
        resumed, self._resumed = self._resumed, None
        self.adoption.enter(pl_module, trainer.optimizers[0], hook_before_step=False, state=resumed)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.adoption.sync.before_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.adoption.collect() is not None:
            pl_module.log_dict(self.adoption.metrics(), on_step=True, on_epoch=False)
        if self.adoption.reached(trainer.max_steps):  # a late joiner: its Trainer counts from its own start
            trainer.should_stop = True

    def on_fit_end(self, trainer, pl_module):
        self.adoption.exit()

    def on_exception(self, trainer, pl_module, exception):
        self.adoption.exit(exception)
