"""What the framework callbacks share: a protocol entered around the framework's model and optimizer for
one run (`with Protocol(model, optimizer, transport)` when the framework's loop is not ours to write)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import torch

from decentral.checkpoint import load_checkpoint, save_checkpoint
from decentral.config import check_protocol_settings
from decentral.sync import PROTOCOLS, SyncProtocol, SyncReport
from decentral.transport import Transport

ProtocolFactory = Callable[..., SyncProtocol]  # (model, optimizer, transport, **kwargs) -> protocol: a class will do


class Adoption:
    """`protocol`: a name of decentral.sync.PROTOCOLS ("diloco", "noloco", "co2", "streaming", "ddp", "local")
    or a factory called as `protocol(model, optimizer, transport, **kwargs)`. `peers`: how many peers (us
    included) must take part in our first round before the first step (at most `wait_peers_s` seconds).
    The transport stays the caller's to close. Arguments the protocol would not take or values it refuses, and
    peers or a transport that cannot be, are refused here (TypeError, ValueError) rather than when training begins."""

    def __init__(self, protocol: str | ProtocolFactory, transport: Transport, *, peers: int = 1,
                 wait_peers_s: float = 300.0, **kwargs):
        if isinstance(protocol, str):
            if protocol not in PROTOCOLS:
                raise ValueError(f"unknown protocol {protocol!r}; one of {', '.join(sorted(PROTOCOLS))}")
            protocol = PROTOCOLS[protocol]
        if not callable(protocol):
            raise TypeError(f"protocol: a protocol's name ({', '.join(sorted(PROTOCOLS))}) or a SyncProtocol class "
                            f"(a factory of (model, optimizer, transport, **kwargs)), got {protocol!r}")
        try:
            inspect.signature(protocol).bind(None, None, transport, **kwargs)  # (model, optimizer, transport)
        except TypeError as e:
            raise TypeError(f"{getattr(protocol, '__name__', protocol)} does not take (model, optimizer, transport"
                            f"{', **kwargs' if kwargs else ''}): {e}") from None
        except ValueError:  # a callable without a signature to read: its call will tell
            pass
        name = next((name for name, cls in PROTOCOLS.items() if cls is protocol), None)
        if name is not None:  # the values too (every=0, mix=2), on a small model, as a recipe's are
            check_protocol_settings(name, kwargs, "the callback's arguments")
        if not all(hasattr(transport, name) for name in ("peer_id", "average", "join_rounds")):
            raise TypeError(f"transport: a decentral Transport (SwarmTransport, IslandTransport, SoloTransport, ...), "
                            f"got {type(transport).__name__}")
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
            raise ValueError(f"peers: the number of peers to wait for, us included (an integer, at least 1), got "
                             f"{peers!r}")
        if not wait_peers_s > 0:
            raise ValueError(f"wait_peers_s: seconds to wait for them (more than 0), got {wait_peers_s!r}")
        self.factory, self.transport, self.kwargs = protocol, transport, kwargs
        self.peers, self.wait_peers_s = peers, wait_peers_s
        self.sync: SyncProtocol | None = None  # the protocol of the run under way
        self.reports: list[SyncReport] = []  # every synchronisation of the run, in order
        self._ended_state: dict | None = None  # the state_dict of the last run's protocol, as it ended

    def enter(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, hook_before_step: bool = True,
              state: dict | None = None) -> SyncProtocol:
        """Wrap `model` and the torch optimizer under `optimizer`'s wrappers in the protocol and join the
        swarm (its state, round and step; see SyncProtocol.start). `state`: the protocol's `state_dict` of
        the checkpoint the framework resumes from (model and optimizer already restored). A run left
        without `exit` (the framework raised and told no callback) is left first."""
        if self.sync is not None:
            self.exit(RuntimeError("the previous run ended without finishing"))
        sync = self.factory(model, real_optimizer(optimizer), self.transport, **self.kwargs)
        sync.hook_before_step = hook_before_step
        if state is not None:
            sync.load_state_dict(state)
        sync.__enter__()
        self.sync, self.reports = sync, []
        if self.peers > 1:
            try:
                self.transport.wait_for_peers(self.peers, self.wait_peers_s, sync.first_round)
            except BaseException as e:
                self.exit(e)
                raise
        return sync

    def collect(self) -> SyncReport | None:
        """After an optimizer step: the report of the synchronisation it made, if any (also kept in `reports`)."""
        report = self.sync.pop_report() if self.sync is not None else None
        if report is not None:
            self.reports.append(report)
        return report

    def reached(self, max_steps: int) -> bool:
        """Whether the run's step (the swarm's: a peer that joined late took it from the others) is at
        `max_steps` (when it is more than 0): there a framework's loop stops, where the peers that started at
        step 0 stop, at the same outer step, rather than `max_steps` of its own steps later, alone."""
        return self.sync is not None and 0 < max_steps <= self.sync.step

    def exit(self, error: BaseException | None = None, *, keep_weights: bool = False) -> None:
        """Unhook the optimizer; without `error`, first complete what is in flight (CO2 and Streaming DiLoCo
        apply the average they launched last), so the model holds everything trained. `keep_weights`: the
        protocol completes its round with its peers all the same, but the model's weights stay as they are
        (the framework loaded others after the last step, e.g. its best checkpoint)."""
        sync, self.sync = self.sync, None
        if sync is not None:
            kept = [p.detach().clone() for p in sync.params] if keep_weights else []
            sync.__exit__(None if error is None else type(error), error, None if error is None else error.__traceback__)
            self._ended_state = sync.state_dict()
            with torch.no_grad():
                for p, weights in zip(sync.params, kept):
                    p.copy_(weights)

    def state_dict(self) -> dict | None:
        """The protocol's `state_dict` for a checkpoint: the run's under way, or once it ended the last run's as
        it ended (a checkpoint saved after training resumes it too); None before any run."""
        return self.sync.state_dict() if self.sync is not None else self._ended_state

    def metrics(self) -> dict[str, float]:
        """Numbers for a framework's logs: the outer round, syncs so far, seconds waited, bytes each way, and
        the latest sync's group size and whether it was complete."""
        if self.sync is None:
            return {}
        out = {"sync/round": float(self.sync.round), "sync/syncs": float(len(self.reports)),
               "sync/wait_s": self.sync.wait_s, "sync/bytes_sent": float(self.transport.bytes_sent),
               "sync/bytes_received": float(self.transport.bytes_received)}
        if self.reports:
            out["sync/group"] = float(len(self.reports[-1].group))
            out["sync/complete"] = float(self.reports[-1].complete)
        return out


def save_protocol_state(sync: SyncProtocol, folder: Path) -> None:
    """The protocol's `state_dict` (its step, round and outer tensors) as a checkpoint folder (decentral.checkpoint)
    beside a framework's own checkpoint."""
    state = sync.state_dict()
    save_checkpoint(folder, state["tensors"], {"sync": state["meta"]})


def read_protocol_state(folder: Path) -> dict:
    """What `save_protocol_state` wrote, checked (CheckpointError when damaged), for `Adoption.enter`'s `state`."""
    tensors, meta = load_checkpoint(folder)
    return {"meta": meta["sync"], "tensors": tensors}


def real_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer whose `step` really runs under a framework's wrappers (accelerate's
    AcceleratedOptimizer keeps it in `.optimizer`): the one a protocol must hook."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"a protocol hooks a torch.optim.Optimizer's step; got {type(optimizer).__name__}")
    return optimizer
