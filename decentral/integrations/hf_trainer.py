"""A `transformers.Trainer` callback that trains under a decentral protocol (extra: pip install 'decentral[hf]').

    transport = SwarmTransport("my-run", initial_peers=[...])
    trainer = Trainer(model, args, train_dataset=data)
    DecentralCallback("diloco", transport, every=50).add_to(trainer)  # first: TensorBoard and W&B get sync/* too
    trainer.train()

At train begin (the Trainer has made and prepared its optimizer by then) the protocol wraps the model and
the torch optimizer under accelerate's wrapper, and joins the swarm; at train end it finishes what is in
flight (the model keeps the best checkpoint when the Trainer loaded it: `load_best_model_at_end`). Everything
else (schedule, clipping, accumulation) stays the Trainer's: one protocol step per optimizer step. `max_steps`
counts the swarm's steps, as `decentral train --steps` does: a peer that joins late stops where the others do.
Each checkpoint the Trainer saves gets the protocol's state (its step, round and outer tensors: DiLoCo's φ and
momentum, ...) in `checkpoint-N/decentral-protocol/`, and
`trainer.train(resume_from_checkpoint=...)` takes it back from `checkpoint-N` of `args.output_dir`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from decentral.integrations.adoption import Adoption, ProtocolFactory, read_protocol_state, save_protocol_state
from decentral.transport import Transport

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError("decentral.integrations.hf_trainer needs transformers: pip install 'decentral[hf]'") from e

PROTOCOL_FOLDER = "decentral-protocol"  # in the Trainer's checkpoint-N folder
log = logging.getLogger(__name__)


class DecentralCallback(TrainerCallback):
    """Train under `protocol` over `transport` (arguments as `Adoption`'s; `kwargs` go to the protocol,
    e.g. `every=50`). `adoption.sync` is the protocol while training runs, `adoption.reports` its syncs.
    The Trainer's logs get `Adoption.metrics` (`sync/...`), in `state.log_history` too. When `train()`
    raises, Trainer tells no callback: the protocol is left unfinished, unhooked at the next train begin."""

    def __init__(self, protocol: str | ProtocolFactory, transport: Transport, *, peers: int = 1,
                 wait_peers_s: float = 300.0, **kwargs):
        self.adoption = Adoption(protocol, transport, peers=peers, wait_peers_s=wait_peers_s, **kwargs)

    def add_to(self, trainer) -> DecentralCallback:
        """Make this callback `trainer`'s first (taking it out of where it was, if it was there); itself. The
        Trainer calls its `report_to` integrations (TensorBoard, W&B) before the callbacks passed to it, so only
        a callback added this way gets its `sync/*` metrics to them."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        saved = None
        if state.global_step > 0:  # resumed from a checkpoint: model and optimizer are restored by now
            folder = _protocol_folder(args, state)
            if folder.is_dir():
                saved = read_protocol_state(folder)
            else:
                log.warning("resuming at step %d without the protocol's state (no %s): it starts afresh",
                            state.global_step, folder)
        self.adoption.enter(model, optimizer, state=saved)

    def on_save(self, args, state, control, **kwargs):
        if self.adoption.sync is not None and state.is_world_process_zero:
            save_protocol_state(self.adoption.sync, _protocol_folder(args, state))

    def on_step_end(self, args, state, control, **kwargs):
        self.adoption.collect()
        if self.adoption.reached(args.max_steps):  # a late joiner: its Trainer counts from its own start
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = self.adoption.metrics()  # {} outside training (an evaluate() of its own)
        logs.update(metrics)
        state.log_history[-1].update(metrics)  # the record Trainer.log appended just before calling us

    def on_train_end(self, args, state, control, **kwargs):
        """Finish the protocol; a best checkpoint the Trainer loaded just before (`load_best_model_at_end`) stays
        the model's weights."""
        self.adoption.exit(keep_weights=args.load_best_model_at_end and state.best_model_checkpoint is not None)


def _protocol_folder(args, state) -> Path:
    """Where the protocol's state of the Trainer's checkpoint at `state.global_step` lives (Trainer names its
    checkpoints `checkpoint-STEP` in `args.output_dir`)."""
    return Path(args.output_dir) / f"checkpoint-{state.global_step}" / PROTOCOL_FOLDER
