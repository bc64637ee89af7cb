"""A pipeline node: one stage behind a gRPC server, computing its microbatches one task at a time.

A microbatch with route (head, a, b) runs: `start` on the head (embedding and its blocks), `forward`
on a then b, `loss` on the head (final norm, LM head, cross-entropy and its backward), `backward` on
b then a, and `finish` on the head (the backward of its blocks). Every step after the first is
triggered by a TensorFrame (Send RPC). Like the simulator (decentral.pipeline.simulator), a node
runs one task at a time, a backward or loss before a forward, then the earliest ready, then the
lowest microbatch; a microbatch is resident from the start of its forward here to the end of its
backward here, and a forward starts only while fewer than `memory` are resident.

Gradients are kept per microbatch until the iteration's `step` says which microbatches finished:
their mean is the gradient (each stage averages over the microbatches that visited it; a skipped
stage gets nothing from a microbatch), clipped, and the inner AdamW steps once per iteration. So a
microbatch aborted after a node died contributes nowhere, and its second attempt counts once.
`step` replies with the mean time of this iteration's forwards, losses and backwards here (what the
simulator calls compute_ms, and its factors), so a plan's costs can be checked against the nodes'.

With a swarm key, every call must be signed with it (decentral.pipeline.auth), else UNAUTHENTICATED.

Every lead has a term (0 for the first, one more for each head that took over after a lead died).
The lead's commands carry it: a node refuses those of a term older than the newest it has seen (so a
lead that was only slow cannot step anyone after it was replaced) and, on seeing a newer one, drops
the unfinished work of older terms (the microbatches of a term are numbered from
`first_attempt(term)`, so none is mistaken for another). A node steps each iteration at most once.

Control commands (Control RPC; JSON bodies; * carry the lead's `term`):
  begin*    {iteration, coordinator, directory: {name: address}, launches: [[microbatch, attempt, route]]}
  launch*   {iteration, launches}                 start more microbatches (heads; after a re-plan)
  abort*    {iteration, keys: [[microbatch, attempt]]}  forget them: queued work, activations, gradients
  step*     {iteration, finished: {microbatch: attempt}, loss, save, last}  step once on the finished
            microbatches (`last`: the run's last iteration)
  takeover* {}   follow the new term; replies with {done: iterations stepped, open: the iteration begun
            and not stepped (or null), last_step: the last step command (or null)}
  stop*, ping (replies with name, stage, iteration, term), weights (this stage's weights as safetensors)
  report    {kind: done | failed, ...}            for the coordinator, which runs inside the lead node
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from decentral.checkpoint import load_checkpoint, load_training_state, save_checkpoint, training_state
from decentral.pipeline.auth import CallKey
from decentral.pipeline.coordinator import first_attempt
from decentral.pipeline.frames import (ACTIVATIONS, GRADIENTS, FrameError, command_of, decode_command, decode_frame,
                                       decode_reply, frame_of, frame_tensor, reply_of)
from decentral.pipeline.links import CONTROL, SEND, SERVICE, Links, channel_options, is_gone
from decentral.pipeline.network import PipelineError
from decentral.pipeline.recipe import PipelineRecipe
from decentral.pipeline.stages import Stage
from decentral.vml import resolve_kernels
from decentral.worker import inner_lr

log = logging.getLogger(__name__)

START, FORWARD, LOSS, BACKWARD, FINISH, STEP = "start", "forward", "loss", "backward", "finish", "step"
_RANK = {STEP: -1, LOSS: 0, BACKWARD: 0, FINISH: 0, START: 1, FORWARD: 1}  # lower runs first
HEADER_ROOM = 64 * 1024  # bytes a message may carry besides its tensor


Key = tuple[int, int, int]  # (iteration, microbatch, attempt)


@dataclass
class _Task:
    kind: str
    key: Key
    route: tuple[str, ...]
    hop: int
    ready: float
    seq: int
    tensor: torch.Tensor | None = None
    body: dict | None = None  # a step's command
    finished: threading.Event | None = None  # set when a step is done
    result: dict | None = None

    def order(self) -> tuple:
        return _RANK[self.kind], self.ready, self.key[1], self.seq


@dataclass
class _Flight:
    """A resident microbatch: what its backward here needs."""

    inputs: torch.Tensor | None  # the received activations (a leaf), None on the head
    outputs: torch.Tensor  # what we sent on, with its graph
    targets: torch.Tensor | None = None  # on the head


def microbatch(tokens: np.ndarray, iteration: int, index: int, batch_size: int, context: int,
               seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch `index` of `iteration`: random windows of `tokens` that depend only on these numbers,
    so whichever head runs it (again, after a re-plan) trains on the same text."""
    rng = np.random.default_rng([seed, iteration, index])
    starts = rng.integers(0, len(tokens) - context, size=batch_size)
    rows = torch.from_numpy(tokens[starts[:, None] + np.arange(context + 1)].astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class StageNode:
    """Serve `stage` as node `name` (see the module docstring). `tokens`: training text, for heads.
    `memory`: microbatches resident at once. `shared_uplink`: send one message at a time whatever its
    destination (decentral.pipeline.links), as the network says of nodes with an uplink.
    `make_protocol(stage, optimizer)`, when given, wraps the inner optimizer in a sync protocol that
    keeps this stage's replicas together (its hooks run at the step; `close` closes its transport).
    `key`: sign our calls and refuse calls not signed with it (decentral.pipeline.auth).
    `out`: where `step` with `save` writes the stage's checkpoint."""

    def __init__(self, name: str, stage: Stage, recipe: PipelineRecipe, *, memory: int, host: str = "127.0.0.1",
                 port: int = 0, tokens: np.ndarray | None = None, shared_uplink: bool = False,
                 key: CallKey | None = None,
                 make_protocol: Callable[[Stage, torch.optim.Optimizer], object] | None = None,
                 out: Path | None = None):
        if stage.index == 0 and tokens is None:
            raise PipelineError(f"{name}: a stage-0 node needs training text")
        self.name, self.stage, self.recipe, self.memory, self.out = name, stage, recipe, memory, out
        train = recipe.recipe.train
        self.tokens = tokens
        self.optimizer = torch.optim.AdamW(stage.parameters(), lr=train.lr, weight_decay=train.weight_decay,
                                           betas=(0.9, 0.95))
        self.params = list(stage.parameters())
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self.protocol = make_protocol(stage, self.optimizer) if make_protocol else None
        self.width = recipe.hidden_width()
        self.max_frame = 4 * train.batch_size * train.context * self.width
        # gRPC refuses longer messages unread: a frame, or our stage's weights (what a joining replica asks for)
        max_message = max(self.max_frame, 4 * sum(p.numel() for p in self.params)) + HEADER_ROOM
        self.key = key
        self.links = Links(max_message, recipe.pipeline.link_timeout, shared_uplink=shared_uplink,
                           key=key)
        self.coordinator = None  # the lead node's Coordinator, which takes the reports
        resolve_kernels()  # the server's threads compute several microbatches at once: decentral.vml
        self.server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{name}-rpc"),
                                  options=channel_options(max_message))
        handlers = {"Send": grpc.unary_unary_rpc_method_handler(self._on_send),
                    "Control": grpc.unary_unary_rpc_method_handler(self._on_control)}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            bound = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpcio >= 1.60 raises where older ones returned 0
            bound = 0
        if not bound:
            raise PipelineError(f"{name}: cannot listen on {host}:{port}: the port is in use or the address is not "
                                "this machine's (choose another --port, or 0 for any free one)")
        self.address = f"{host}:{bound}"
        self.stopped = threading.Event()
        self.last_command = time.monotonic()
        self.iterations_done = 0
        self.term = 0  # the newest lead's term seen (module docstring)
        self._last_step: dict | None = None  # the last step command applied: what a new lead needs
        self.ended = False  # it stepped the run's last iteration: a lead gone now has ended the run
        self._cond = threading.Condition()
        self._updating = False  # a step's update is going into the weights (after its commit point): `_weights` waits
        self._iteration = -1  # the iteration begun; work of later ones waits for its begin
        self._open = False  # whether it has not stepped yet (work of a stepped iteration is dropped)
        self._coordinator = ""  # the lead we follow: `lead_address`
        self._directory: dict[str, str] = {}
        self._begun = 0.0  # when this iteration's begin arrived (time.monotonic)
        self._ready: list[_Task] = []
        self._resident: dict[Key, _Flight | None] = {}  # None: its forward is running
        self._aborted: set[Key] = set()
        self._pending: dict[Key, list[torch.Tensor | None]] = {}  # per microbatch, a gradient per parameter
        self._losses: dict[Key, float] = {}
        self._compute: dict[str, list[float]] = {}  # this iteration's task durations (ms) by kind
        self._seq = 0
        self._worker = threading.Thread(target=self._work, name=f"{name}-compute", daemon=True)

    # ----- life -----
    def start(self) -> None:
        if self.protocol is not None:
            self.protocol.__enter__()  # joins the stage's replicas (a newcomer takes their state here)
        self._worker.start()
        self.server.start()

    def close(self) -> None:
        self.stopped.set()
        with self._cond:
            self._cond.notify_all()
        self.server.stop(grace=0.2).wait()
        self.links.close()
        if self.protocol is not None:
            self.protocol.__exit__(None, None, None)
            self.protocol.transport.close()

    # ----- RPC handlers -----
    def _admit(self, method: str, request: bytes, context: grpc.ServicerContext) -> None:
        """Abort a call not signed with our key (when we have one)."""
        refusal = self.key.refusal(method, request, context.invocation_metadata()) if self.key else None
        if refusal:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self.name}: {refusal}")

    def _on_send(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._admit(SEND, request, context)
        train = self.recipe.recipe.train
        try:
            frame = decode_frame(request)
            tensor = frame_tensor(frame, self.max_frame, width=self.width, max_rows=train.batch_size,
                                  max_tokens=train.context)
        except FrameError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: {e}")
        if frame.route[frame.hop] != self.name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a frame for {frame.route[frame.hop]} reached {self.name}")
        if frame.hop == 0 and self.stage.index != 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name} holds stage {self.stage.index}, not a head")
        if frame.kind == ACTIVATIONS:
            kind = FORWARD if frame.hop else LOSS
        else:
            kind = BACKWARD if frame.hop else FINISH
        self._queue(_Task(kind, frame.key, tuple(frame.route), frame.hop, time.monotonic(), 0, tensor))
        return reply_of()

    def _on_control(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._admit(CONTROL, request, context)
        try:
            kind, body = decode_command(request)
        except FrameError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: {e}")
        handler = {"begin": self._begin, "launch": self._launch, "abort": self._abort, "step": self._step_command,
                   "takeover": self._takeover, "stop": self._stop, "ping": self._ping, "weights": self._weights,
                   "report": self._report_in}.get(kind)
        if handler is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: unknown command {kind!r}")
        self.last_command = time.monotonic()
        try:
            return handler(body)
        except (KeyError, TypeError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: bad {kind} command: {e!r}")

    def _follow(self, body: dict) -> str | None:
        """Under `_cond`: take the command's term when newer (dropping older terms' unfinished work);
        why it is refused when older."""
        term = int(body.get("term", 0))
        if term < self.term:
            return f"{self.name} follows the lead of term {self.term}, not of term {term}"
        if term > self.term:
            self.term = term
            self._ready = [task for task in self._ready if not self._stale(task.key)]
            for key in [key for key, flight in self._resident.items() if flight is not None and self._stale(key)]:
                del self._resident[key]  # a running forward frees its own slot (`_keep`)
            self._cond.notify_all()
        return None

    def _stale(self, key: Key) -> bool:
        """Work of an older term's microbatch (never a step's)."""
        return 0 <= key[2] < first_attempt(self.term)

    def _refused(self, why: str) -> bytes:
        return reply_of(False, why, body={"term": self.term})

    def _takeover(self, body: dict) -> bytes:
        with self._cond:
            refusal = self._follow(body)
            if refusal:
                return self._refused(refusal)
            if "coordinator" in body:  # the new lead: the one we follow (and probe) from now on, before its begin
                self._coordinator = str(body["coordinator"])
            return reply_of(body={"done": self.iterations_done, "open": self._iteration if self._open else None,
                                  "last_step": self._last_step})

    def _begin(self, body: dict) -> bytes:
        iteration = int(body["iteration"])
        with self._cond:
            refusal = self._follow(body)
            if refusal:
                return self._refused(refusal)
            if iteration < self._iteration:
                return reply_of(False, f"{self.name} is at iteration {self._iteration} already")
            self._iteration, self._begun, self._open = iteration, time.monotonic(), True
            self._coordinator, self._directory = str(body["coordinator"]), dict(body["directory"])
            self._aborted.clear()
            self._ready = self._dropped_before(iteration, f"iteration {iteration} has begun")
            self._queue_launches(iteration, body.get("launches", []))
            self._cond.notify_all()
        return reply_of()

    def _launch(self, body: dict) -> bytes:
        with self._cond:
            refusal = self._follow(body)
            if refusal:
                return self._refused(refusal)
            self._queue_launches(int(body["iteration"]), body["launches"])
            self._cond.notify_all()
        return reply_of()

    def _queue_launches(self, iteration: int, launches: list) -> None:
        if launches and self.stage.index != 0:
            raise ValueError(f"{self.name} holds stage {self.stage.index} and cannot launch microbatches")
        for m, attempt, route in launches:
            if route[0] != self.name:
                raise ValueError(f"microbatch {m}'s route {route} does not start at {self.name}")
            self._seq += 1
            self._ready.append(_Task(START, (iteration, int(m), int(attempt)), tuple(route), 0, time.monotonic(),
                                     self._seq))

    def _abort(self, body: dict) -> bytes:
        iteration = int(body["iteration"])
        keys = {(iteration, int(m), int(a)) for m, a in body["keys"]}
        with self._cond:
            refusal = self._follow(body)
            if refusal:
                return self._refused(refusal)
            self._aborted |= keys
            self._ready = [task for task in self._ready if task.key not in keys]
            for key in keys:
                if self._resident.get(key, False) is not None:  # a running forward frees its own slot
                    self._resident.pop(key, None)
                self._pending.pop(key, None)
                self._losses.pop(key, None)
            self._cond.notify_all()
        return reply_of()

    def _dropped_before(self, iteration: int, why: str) -> list[_Task]:
        """The ready tasks of `iteration` and later; a step command among those dropped is answered (refused:
        `why`), else its caller waited for good. Called holding `_cond`."""
        for task in self._ready:
            if task.key[0] < iteration and task.finished is not None:
                task.result = {"refused": f"{self.name}: {why}"}
                task.finished.set()
        return [task for task in self._ready if task.key[0] >= iteration]

    def _step_command(self, body: dict) -> bytes:
        task = _Task(STEP, (int(body["iteration"]), -1, -1), (), 0, time.monotonic(), 0, body=body,
                     finished=threading.Event())
        self._queue(task)
        while not task.finished.wait(1.0):  # (answered when stepped, or dropped: `_dropped_before`)
            if self.stopped.is_set():
                return reply_of(False, f"{self.name} is stopping")
        if task.result is None:
            return reply_of(False, f"{self.name}: the step failed (see its log)")
        if "refused" in task.result:
            return self._refused(task.result["refused"])
        return reply_of(body=task.result)

    def lead_address(self) -> str:
        """The lead we follow: where the last `begin`, or a newer lead's takeover, came from ('' before any)."""
        with self._cond:
            return self._coordinator

    def _stop(self, body: dict) -> bytes:
        with self._cond:
            refusal = self._follow(body)
        if refusal:
            return self._refused(refusal)
        self.stopped.set()
        return reply_of()

    def _ping(self, body: dict) -> bytes:
        return reply_of(body={"name": self.name, "stage": self.stage.index, "iteration": self._iteration,
                              "term": self.term})

    def _weights(self, body: dict) -> bytes:
        with self._cond:  # not in the middle of a step, nor of its update (a replica's outer sync: seconds)
            self._cond.wait_for(lambda: not self._updating)
            tensors = {k: v.detach().clone() for k, v in self.stage.global_state_dict().items()}
        return reply_of(body={"iteration": self.iterations_done}, data=save_tensors(tensors))

    def _report_in(self, body: dict) -> bytes:
        if self.coordinator is None:
            return reply_of(False, f"{self.name} does not coordinate")
        self.coordinator.on_report(body)
        return reply_of()

    # ----- compute -----
    def _queue(self, task: _Task) -> None:
        with self._cond:
            if task.key in self._aborted or self._stale(task.key) or (task.kind != STEP and
                                                                      not self._current_or_later(task.key[0])):
                return  # a microbatch aborted after a re-plan or by a new lead, or of an iteration that is over
            self._seq += 1
            task.seq = self._seq
            self._ready.append(task)
            self._cond.notify_all()

    def _current_or_later(self, iteration: int) -> bool:
        return iteration > self._iteration or (iteration == self._iteration and self._open)

    def _take(self) -> _Task | None:
        best = None
        for task in self._ready:
            if task.kind != STEP and (task.key[0] != self._iteration or not self._open):
                continue
            if task.kind in (START, FORWARD) and len(self._resident) >= self.memory:
                continue
            if best is None or task.order() < best.order():
                best = task
        if best is not None:
            self._ready.remove(best)
            if best.kind in (START, FORWARD):
                self._resident[best.key] = None  # resident from the start of its forward
        return best

    def _work(self) -> None:
        torch.set_grad_enabled(True)
        while True:
            with self._cond:
                task = self._take()
                while task is None and not self.stopped.is_set():
                    self._cond.wait()
                    task = self._take()
                if task is None:
                    return
            started = time.perf_counter()
            try:
                {START: self._start, FORWARD: self._forward, LOSS: self._loss, BACKWARD: self._backward,
                 FINISH: self._finish, STEP: self._step}[task.kind](task)
                if task.kind != STEP:
                    self._compute.setdefault(task.kind, []).append(1e3 * (time.perf_counter() - started))
            except Exception as e:
                if self.stopped.is_set():
                    return  # the node is stopping: its links closed under the task in flight, which no one awaits
                log.exception("%s: %s of microbatch %s failed", self.name, task.kind, task.key[1:])
                with self._cond:
                    self._resident.pop(task.key, None)
                    self._cond.notify_all()
                if task.kind == STEP:
                    task.finished.set()
                else:
                    self._report({"kind": "failed", "iteration": task.key[0], "microbatch": task.key[1],
                                  "attempt": task.key[2], "node": self.name, "gone": False, "error": repr(e)})

    def _keep(self, task: _Task, flight: _Flight) -> bool:
        """Make `flight` resident, unless its microbatch was aborted while it ran (then free its slot)."""
        with self._cond:
            if task.key in self._aborted or self._stale(task.key) or task.key[0] != self._iteration or not self._open:
                self._resident.pop(task.key, None)
                self._cond.notify_all()
                return False
            self._resident[task.key] = flight
            return True

    def _release(self, key: Key) -> _Flight | None:
        with self._cond:
            flight = self._resident.pop(key, None)
            self._cond.notify_all()
            return flight

    def _start(self, task: _Task) -> None:
        train = self.recipe.recipe.train
        tokens, targets = microbatch(self.tokens, task.key[0], task.key[1], train.batch_size, train.context, train.seed)
        outputs = self.stage.begin(tokens)
        if self._keep(task, _Flight(None, outputs, targets)):
            self._send(task, 1, ACTIVATIONS, outputs)

    def _forward(self, task: _Task) -> None:
        inputs = task.tensor.requires_grad_()
        outputs = self.stage(inputs)
        if self._keep(task, _Flight(inputs, outputs)):
            self._send(task, (task.hop + 1) % len(task.route), ACTIVATIONS, outputs)

    def _loss(self, task: _Task) -> None:
        flight = self._resident.get(task.key)
        if flight is None:
            return  # aborted
        inputs = task.tensor.requires_grad_()
        loss = self.stage.loss(inputs, flight.targets)
        grads = torch.autograd.grad(loss, [inputs, *self.stage.loss_parameters()])
        self._accumulate(task.key, self.stage.loss_parameters(), grads[1:])
        self._losses[task.key] = loss.item()
        self._send(task, len(task.route) - 1, GRADIENTS, grads[0])

    def _backward(self, task: _Task) -> None:
        flight = self._release(task.key)
        if flight is None:
            return  # aborted
        params = self.stage.forward_parameters()
        grads = torch.autograd.grad(flight.outputs, [flight.inputs, *params], grad_outputs=task.tensor)
        self._accumulate(task.key, params, grads[1:])
        self._send(task, task.hop - 1, GRADIENTS, grads[0])

    def _finish(self, task: _Task) -> None:
        flight = self._release(task.key)
        if flight is None:
            return  # aborted
        params = self.stage.forward_parameters()
        self._accumulate(task.key, params, torch.autograd.grad(flight.outputs, params, grad_outputs=task.tensor))
        iteration, m, attempt = task.key
        self._report({"kind": "done", "iteration": iteration, "microbatch": m, "attempt": attempt,
                      "loss": self._losses.pop(task.key, float("nan")), "node": self.name, "begun": self._begun,
                      "end": time.monotonic()})

    def _accumulate(self, key: Key, params: list[torch.nn.Parameter], grads) -> None:
        with self._cond:
            if key in self._aborted:
                return
            slots = self._pending.setdefault(key, [None] * len(self.params))
            for param, grad in zip(params, grads):
                i = self._position[id(param)]
                slots[i] = grad if slots[i] is None else slots[i] + grad

    def _step(self, task: _Task) -> None:
        body = task.body
        iteration = int(body["iteration"])
        finished = {int(m): int(a) for m, a in body["finished"].items()}
        train = self.recipe.recipe.train
        with self._cond:
            refusal = self._follow(body)
            if refusal is None and iteration < self.iterations_done:
                refusal = f"{self.name} has stepped iteration {iteration} already"
            if refusal:
                task.result = {"refused": refusal}
                task.finished.set()
                return
            # the commit point: a new lead asking after this (takeover) learns this step was taken
            self.iterations_done = iteration + 1
            self._last_step = {"iteration": iteration, "finished": body["finished"], "loss": body.get("loss"),
                               "steps": body.get("steps"), "save": bool(body.get("save")),
                               "last": bool(body.get("last"))}
            self.ended = bool(body.get("last", False))
            keys = [k for k in self._pending if k[0] == iteration and finished.get(k[1]) == k[2]]
            for i, param in enumerate(self.params):
                parts = [self._pending[k][i] for k in keys if self._pending[k][i] is not None]
                param.grad = torch.stack(parts).sum(0).div_(len(keys)) if parts else None
            self._pending.clear()
            self._losses.clear()
            self._resident.clear()
            self._ready = self._dropped_before(iteration + 1, f"iteration {iteration} was stepped")
            self._open = False
            self._updating = True  # (a newcomer copying our weights got some before this update and some after)
        try:
            with_grad = [p for p in self.params if p.grad is not None]
            if with_grad:
                torch.nn.utils.clip_grad_norm_(with_grad, train.grad_clip)
            for group in self.optimizer.param_groups:
                group["lr"] = inner_lr(iteration, self.recipe.recipe, body.get("steps"))  # the lead's run length
            self.optimizer.step()  # once per iteration; a replica protocol's hooks run here
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()
        spent = self._compute
        times = {FORWARD: spent.get(START, []) + spent.get(FORWARD, []), LOSS: spent.get(LOSS, []),
                 BACKWARD: spent.get(BACKWARD, []) + spent.get(FINISH, [])}
        self._compute = {}
        result = {"node": self.name, "microbatches": len(keys),
                  "compute_ms": {kind: sum(t) / len(t) for kind, t in times.items() if t}}
        report = self.protocol.pop_report() if self.protocol is not None else None
        if report is not None:
            result["sync"] = {"round": report.round, "group": len(report.group), "complete": report.complete,
                              "wait_s": round(report.wait_s, 3)}
        if body.get("save") and self.out is not None:
            self.save()
        task.result = result
        task.finished.set()

    def copy_replica(self, servers) -> str | None:
        """Take the weights of the first of `servers` (discovery.Server) that serves our stage and answers:
        a node joining a running pipeline starts where its stage is. Returns whose weights, or None."""
        for server in servers:
            if server.stage != self.stage.index or server.name == self.name:
                continue
            try:
                ok, _, _, data = decode_reply(self.links.call(server.address, CONTROL, command_of("weights")))
            except grpc.RpcError as e:
                log.warning("%s: could not copy stage %d from %s: %s", self.name, self.stage.index, server.name,
                            _describe(e))
                continue
            if ok:
                self.stage.load_global_state_dict(load_tensors(data))
                return server.name
        return None

    def save(self) -> Path:
        """This stage's weights and where they belong, with what resuming needs: the inner AdamW's state
        and the replica protocol's (OUT/stage, a decentral checkpoint)."""
        sync = self.protocol.state_dict() if self.protocol is not None else None
        tensors, meta = training_state(self.stage.global_state_dict(), self.optimizer, sync)
        meta.update(name=self.name, stage=self.stage.index, stages=self.recipe.pipeline.stages,
                    iteration=self.iterations_done, recipe=self.recipe.to_dict())
        return save_checkpoint(self.out / "stage", tensors, meta)

    def restore(self) -> int:
        """Before `start`: load OUT/stage (see `save`); returns the iterations it had done. PipelineError
        when it holds another stage or another pipeline's; CheckpointError when it is missing or corrupt."""
        tensors, meta = load_checkpoint(self.out / "stage")
        if (meta.get("stage"), meta.get("stages")) != (self.stage.index, self.recipe.pipeline.stages):
            raise PipelineError(f"{self.out / 'stage'} holds stage {meta.get('stage')} of {meta.get('stages')}, "
                                f"this node serves stage {self.stage.index} of {self.recipe.pipeline.stages}: give "
                                "the recipe the run was started with (--recipe)")
        model, sync = load_training_state(tensors, meta, self.optimizer)
        self.stage.load_global_state_dict(model)
        if self.protocol is not None and sync is not None:
            self.protocol.load_state_dict(sync)
        self.iterations_done = int(meta["iteration"])
        return self.iterations_done

    # ----- sending -----
    def _send(self, task: _Task, hop: int, kind: str, tensor: torch.Tensor) -> None:
        target = task.route[hop]
        address = self._directory.get(target)
        if address is None:
            self._report({"kind": "failed", "iteration": task.key[0], "microbatch": task.key[1],
                          "attempt": task.key[2], "node": target, "gone": True, "error": "not in the directory"})
            return
        payload = frame_of(kind, *task.key, task.route, hop, tensor, self.recipe.pipeline.wire_dtype)

        def done(reply, error):
            if error is not None:
                self._report({"kind": "failed", "iteration": task.key[0], "microbatch": task.key[1],
                              "attempt": task.key[2], "node": target, "gone": is_gone(error),
                              "error": _describe(error)})

        self.links.post(address, SEND, payload, done)

    def _report(self, body: dict) -> None:
        """Tell the lead we follow (`lead_address`) (in this process when it is ours: not when ours took over
        too and has not learnt yet that another's term is newer); not once we are closing (the sends that fail
        then are ours, cut short)."""
        if self.stopped.is_set():
            return
        if self.coordinator is not None and self.coordinator.address == self._coordinator:
            self.coordinator.on_report(body)
        elif self._coordinator:
            self.links.post(self._coordinator, CONTROL, command_of("report", body))


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return repr(error)
