"""Messages that peers pushed to us, waiting to be collected by tag.

A sender never waits for the receiver to be ready: its message is kept here until the receiver asks
for that tag, so two peers that reach a round at different times still meet. Each sender has at most
`per_sender` tags waiting; beyond that its own oldest is dropped, so a flood from one peer never
erases another's messages. Lives on the swarm's event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Message:
    sender: str
    tensor: torch.Tensor
    view: str = ""  # fingerprint of the member list the sender averages over
    meta: dict = field(default_factory=dict)  # what else the header said (an owner's norms, digests)
    payload: bytes | None = None  # the tensor's encoding as it arrived, where the receiver keeps it
    arrived: float = 0.0  # the loop time it was put in the mailbox


class Mailbox:
    def __init__(self, per_sender: int = 16):
        self._messages: dict[str, dict[str, Message]] = defaultdict(dict)
        self._by_sender: dict[str, list[str]] = defaultdict(list)  # the tags each sender has waiting, oldest first
        self._arrived = asyncio.Condition()
        self._per_sender = per_sender

    async def put(self, tag: str, message: Message) -> None:
        message.arrived = asyncio.get_running_loop().time()
        async with self._arrived:
            tags = self._by_sender[message.sender]
            if tag not in self._messages or message.sender not in self._messages[tag]:
                tags.append(tag)
            self._messages[tag][message.sender] = message
            while len(tags) > self._per_sender:  # this sender's oldest: a round nobody collected
                self._discard(tags.pop(0), message.sender)
            self._arrived.notify_all()

    def _discard(self, tag: str, sender: str) -> None:
        box = self._messages.get(tag)
        if box is not None:
            box.pop(sender, None)
            if not box:
                del self._messages[tag]

    def senders(self, tag: str) -> set[str]:
        """Who has a message waiting under `tag` (nothing is removed)."""
        return set(self._messages.get(tag, {}))

    def peek(self, tag: str) -> dict[str, Message]:
        """The messages waiting under `tag`, by sender (nothing is removed)."""
        return dict(self._messages.get(tag, {}))

    async def collect(self, tag: str, senders: set[str], deadline: float, *, unless: str | None = None,
                      stop: Callable[[], bool] | None = None) -> dict[str, Message]:
        """Wait until every sender in `senders` has a message under `tag` (or, when given, under `unless`:
        a sender that says it will not send), or the loop time `deadline`, or (checked as messages arrive)
        until `stop()` is true.

        Returns (and removes) the messages under `tag` that did arrive, keyed by sender.
        """
        loop = asyncio.get_running_loop()
        async with self._arrived:
            while not senders <= self.senders(tag) | (self.senders(unless) if unless else set()):
                if stop is not None and stop():
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            box = self._messages.pop(tag, {})
            for sender in box:
                waiting = self._by_sender[sender]
                waiting.remove(tag)
                if not waiting:
                    del self._by_sender[sender]
            return {s: m for s, m in box.items() if s in senders}
