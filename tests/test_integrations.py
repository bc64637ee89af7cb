"""The framework callbacks (decentral.integrations): a protocol adopted by `transformers.Trainer` and by
Lightning, two trainers in two threads over a loopback hub, checked against what the protocol must do
(replicas averaged every H real optimizer steps, to the mean of what each trained); the examples run as
scripts over the real swarm; importing decentral pulls in neither framework."""

import itertools
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning
import pytest
import torch
from torch.nn.utils import parameters_to_vector
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from decentral.data import join_documents, load_documents, train_batches
from decentral.integrations import hf_trainer, lightning as lightning_integration
from decentral.integrations.adoption import real_optimizer
from decentral.loopback import LoopbackHub
from decentral.models import GPT, GPTConfig
from decentral.transport import SoloTransport

ROOT = Path(__file__).resolve().parent.parent
H, STEPS, ACCUMULATE, CONTEXT = 3, 6, 2, 32
AVERAGING = dict(every=H, outer_lr=1.0, outer_momentum=0.0, nesterov=False)  # DiLoCo whose φ is the plain mean


@pytest.fixture(scope="module")
def tokens(small_corpus):
    return join_documents(load_documents([small_corpus], max_bytes=400_000)[0])


class Recorder:
    """Counts the real optimizer's steps and keeps the weights θ the last one trained, as the step left them:
    its hook is registered before the protocol's, which averages them. The first step waits at `barrier`
    until every peer has joined its protocol (so no peer trains a round alone)."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier, self.steps, self.trained = barrier, 0, None

    def attach(self, optimizer, params) -> None:
        def after_step(*_):
            self.steps += 1
            self.trained = parameters_to_vector(params).detach().clone()
        real_optimizer(optimizer).register_step_post_hook(after_step)


class HFRecorder(TrainerCallback):
    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.recorder.attach(optimizer, list(model.parameters()))

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.recorder.barrier.wait(timeout=120)


class LightningRecorder(lightning.Callback):
    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def on_fit_start(self, trainer, pl_module):
        self.recorder.attach(trainer.optimizers[0], list(pl_module.parameters()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.recorder.barrier.wait(timeout=120)


def run_peers(train, count: int = 2) -> tuple[list, list[Recorder]]:
    """`train(index, transport, recorder)` for `count` peers of one loopback hub, each in its own thread:
    (their results, their recorders). A peer that raises lets the others go at once (the start barrier broken,
    its averages rolled back), and the first error raised is the one raised, not what it made of the others'."""
    hub, barrier = LoopbackHub(timeout_s=60.0), threading.Barrier(count)
    transports = [hub.transport() for _ in range(count)]
    recorders = [Recorder(barrier) for _ in range(count)]

    failed = []  # in the order the peers raised

    def peer(index, transport, recorder):
        try:
            return train(index, transport, recorder)
        except BaseException as e:
            failed.append(e)
            barrier.abort()
            transport.close()
            raise

    try:
        with ThreadPoolExecutor(count) as pool:
            futures = [pool.submit(peer, *args) for args in zip(range(count), transports, recorders)]
        if failed:
            raise failed[0]
        return [f.result() for f in futures], recorders
    finally:
        for t in transports:
            t.close()


def flat(model) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach()


def assert_averaged(models, recorders, reports_of_peers) -> None:
    """Every peer stepped STEPS times and synced with both peers every H of them, and each ends holding
    the mean of what the two trained in the last round."""
    for recorder, reports in zip(recorders, reports_of_peers):
        assert recorder.steps == STEPS  # the hook fired once per real optimizer step, not once per batch
        assert [len(r.group) for r in reports] == [2] * (STEPS // H) and all(r.complete for r in reports)
    mean = torch.stack([r.trained for r in recorders]).mean(0)
    assert torch.equal(flat(models[0]), flat(models[1]))  # identical replicas
    torch.testing.assert_close(flat(models[0]), mean, rtol=0, atol=1e-6)
    assert all(not torch.allclose(r.trained, mean, atol=1e-4) for r in recorders)  # each had trained apart


# ----- transformers.Trainer -----
class ByteWindows(torch.utils.data.IterableDataset):
    def __init__(self, tokens, seed: int):
        self.tokens, self.seed = tokens, seed

    def __iter__(self):
        for x, _ in train_batches(self.tokens, batch_size=1, context=CONTEXT, seed=self.seed):
            yield {"input_ids": x[0], "labels": x[0]}


def llama_loss(model, tokens) -> float:
    x = next(train_batches(tokens, batch_size=16, context=CONTEXT, seed=99))[0]
    with torch.no_grad():
        return model(input_ids=x, labels=x).loss.item()


@pytest.fixture
def accelerate_state_per_thread(monkeypatch):
    """accelerate keeps its state once per process (PartialState, AcceleratorState, GradientState share one dict
    each), and two Trainers in two threads share it: one's TrainingArguments wipe the other's AcceleratorState
    (AttributeError before the start barrier), and one's first micro-batch sets `sync_gradients` False while the
    other steps, so the other's AcceleratedOptimizer skips that real step (the peers' rounds no longer meet).
    Each thread gets its own, as each peer in its own process has: accelerate's thread-local state for XLA."""
    from accelerate.state import AcceleratorState, GradientState, PartialState, ThreadLocalSharedDict
    for state in (PartialState, AcceleratorState, GradientState):
        monkeypatch.setattr(state, "_shared_state", ThreadLocalSharedDict())


def test_a_trainer_callback_averages_the_replicas_every_h_optimizer_steps_and_the_loss_falls(
        tokens, tmp_path, accelerate_state_per_thread):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=CONTEXT)
    models = [LlamaForCausalLM(config) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    before = llama_loss(models[0], tokens)

    def train(index, transport, recorder):
        sync = hf_trainer.DecentralCallback("diloco", transport, **AVERAGING)
        args = TrainingArguments(output_dir=str(tmp_path / str(index)), max_steps=STEPS, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=ACCUMULATE, learning_rate=1e-2, logging_steps=H,
                                 save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True)
        trainer = Trainer(model=models[index], args=args, train_dataset=ByteWindows(tokens, index),
                          callbacks=[HFRecorder(recorder), sync])
        trainer.train()
        assert trainer.state.global_step == STEPS and sync.adoption.sync is None  # left at train end
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert [entry["sync/syncs"] for entry in logged] == [1.0, 2.0] and logged[-1]["sync/group"] == 2.0
        return sync.adoption.reports

    reports, recorders = run_peers(train)
    assert_averaged(models, recorders, reports)
    assert llama_loss(models[0], tokens) < before - 0.5


class LateJoin:
    """Peer 0 stops at the start of its optimizer step `at` (the swarm's step: it began at 0) until peer 1 has
    joined, which starts once peer 0 is there: peer 1 joins the swarm at step `at`."""

    def __init__(self, at: int):
        self.at, self.reached, self.joined = at, threading.Event(), threading.Event()

    def before_step(self, index: int, step: int) -> None:
        if index == 0 and step == self.at:
            self.reached.set()
            assert self.joined.wait(timeout=120)

    def began(self, index: int) -> None:
        """A peer's protocol has joined the swarm."""
        if index == 1:
            self.joined.set()

    def run(self, train) -> list:
        """`train(index, transport)` for peers 0 and 1 of one loopback hub in two threads; their results."""
        hub = LoopbackHub(timeout_s=60.0)
        transports = [hub.transport() for _ in range(2)]

        def peer(index):
            if index == 1:
                assert self.reached.wait(timeout=120)  # peer 0 has averaged round 0 and offered its state
            return train(index, transports[index])

        try:
            with ThreadPoolExecutor(2) as pool:
                return list(pool.map(peer, (0, 1)))
        finally:
            self.joined.set()
            for t in transports:
                t.close()


class HFLateJoin(TrainerCallback):
    def __init__(self, late: LateJoin, index: int):
        self.late, self.index = late, index

    def on_train_begin(self, args, state, control, **kwargs):  # listed after the protocol's callback
        self.late.began(self.index)

    def on_step_begin(self, args, state, control, **kwargs):
        self.late.before_step(self.index, state.global_step)


def test_a_trainer_that_joins_late_stops_at_the_swarms_max_steps_with_the_others(tokens, tmp_path,
                                                                                accelerate_state_per_thread):
    """Peer 1 joins at the swarm's step H (a round in): its Trainer counts from 0, the protocol from H. It stops
    where peer 0 stops, at the swarm's step 3H, after 2H steps of its own, and both end on the last average;
    trained to 3H of its own count, it went on alone past the others' last average and ended elsewhere."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=CONTEXT)
    models, late = [LlamaForCausalLM(config) for _ in range(2)], LateJoin(at=H)

    def train(index, transport):
        sync = hf_trainer.DecentralCallback("diloco", transport, **AVERAGING)
        args = TrainingArguments(output_dir=str(tmp_path / str(index)), max_steps=3 * H, per_device_train_batch_size=4,
                                 learning_rate=1e-2, save_strategy="no", report_to="none", disable_tqdm=True,
                                 use_cpu=True)
        trainer = Trainer(model=models[index], args=args, train_dataset=ByteWindows(tokens, index),
                          callbacks=[sync, HFLateJoin(late, index)])
        trainer.train()
        return trainer.state.global_step, [len(r.group) for r in sync.adoption.reports]

    assert late.run(train) == [(3 * H, [1, 2, 2]), (2 * H, [2, 2])]
    assert torch.equal(flat(models[0]), flat(models[1]))


class Boom(TrainerCallback):
    armed = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.armed and state.global_step == 2:
            raise RuntimeError("boom")


def test_a_trainer_run_that_raised_is_unhooked_when_the_next_one_begins(tokens, tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=CONTEXT))
    sync, boom = hf_trainer.DecentralCallback("diloco", SoloTransport(), every=2), Boom()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, save_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(tokens, 0), callbacks=[sync, boom])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()  # Trainer tells no callback
    stale = sync.adoption.sync
    boom.armed = False
    trainer.train()  # the same optimizer again
    assert stale.step == 2 and len(sync.adoption.reports) == 2  # the first run's protocol stepped no more


class Captures(TrainerCallback):
    """The protocol's state as a callback listed after DecentralCallback finds it when training begins."""

    def __init__(self, sync):
        self.sync, self.state = sync, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = self.sync.adoption.sync.state_dict()


def assert_resumed(state: dict, saved: dict, step: int) -> None:
    assert state["meta"] == saved["meta"] and state["meta"]["step"] == step and state["meta"]["round"] == 1
    assert state["tensors"].keys() == saved["tensors"].keys() == {"slow", "momentum"}
    assert all(torch.equal(state["tensors"][k], saved["tensors"][k]) for k in saved["tensors"])
    assert state["tensors"]["momentum"].abs().sum() > 0  # a round's outer step was in it


def test_a_trainer_resumed_from_its_checkpoint_resumes_the_protocols_state_too(tokens, tmp_path):
    """DiLoCo's φ, outer momentum, step and round are saved with each Trainer checkpoint and taken back
    (before: the resumed run's protocol began at step 0 with φ the checkpoint's weights and no momentum)."""
    from decentral.integrations.adoption import read_protocol_state

    def trainer_of(sync, max_steps):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2,
                                             max_position_embeddings=CONTEXT))
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2,
                                 save_strategy="steps", save_steps=3, report_to="none", disable_tqdm=True,
                                 use_cpu=True)
        captures = Captures(sync)
        trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(tokens, 0), callbacks=[sync, captures])
        return trainer, captures

    trainer_of(hf_trainer.DecentralCallback("diloco", SoloTransport(), every=2), 3)[0].train()
    saved = read_protocol_state(tmp_path / "checkpoint-3" / hf_trainer.PROTOCOL_FOLDER)
    sync = hf_trainer.DecentralCallback("diloco", SoloTransport(), every=2)
    again, captures = trainer_of(sync, 4)
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert_resumed(captures.state, saved, step=3)
    assert again.state.global_step == 4


def test_the_best_checkpoint_a_trainer_loads_at_the_end_stays_the_models_weights(tokens, tmp_path):
    """`load_best_model_at_end`: the Trainer loads the best checkpoint just before train end, where CO2 applies
    the average still in flight (before: θ ← φ, and the model ended on the last round's weights, not the best)."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=CONTEXT))
    evaluation = [{"input_ids": x[0], "labels": x[0]}
                  for x, _ in itertools.islice(train_batches(tokens, batch_size=1, context=CONTEXT, seed=7), 4)]
    sync = hf_trainer.DecentralCallback("co2", SoloTransport(), every=2)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2, learning_rate=1e-2,
                             eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                             load_best_model_at_end=True, metric_for_best_model="eval_loss", report_to="none",
                             disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(tokens, 0), eval_dataset=evaluation,
                      callbacks=[sync])
    trainer.train()
    best = load_file(Path(trainer.state.best_model_checkpoint) / "model.safetensors")
    weights = model.state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in best.items())
    assert sync.adoption.state_dict()["meta"]["round"] == 4  # the average in flight at the end was applied all the same


def test_a_callback_added_first_gets_its_sync_metrics_to_the_trainers_tensorboard(tokens, tmp_path):
    """The Trainer calls its `report_to` integrations before the callbacks passed to it, so TensorBoard logged
    each record before the callback's on_log added `sync/*` to it; `add_to(trainer)` puts the callback first."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=CONTEXT))
    sync = hf_trainer.DecentralCallback("diloco", SoloTransport(), every=2)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=2,
                             save_strategy="no", report_to="tensorboard", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(tokens, 0), callbacks=[sync])
    assert sync.add_to(trainer) is sync and trainer.callback_handler.callbacks.count(sync) == 1
    trainer.train()
    board = next(tmp_path.rglob("events.out.tfevents*")).parent
    events = EventAccumulator(str(board))
    events.Reload()
    syncs = [tag for tag in events.Tags()["scalars"] if tag.endswith("sync/syncs")]
    assert len(syncs) == 1, events.Tags()["scalars"]
    assert dict((e.step, e.value) for e in events.Scalars(syncs[0])) == {2: 1.0, 4: 2.0}  # (4: the run's summary too)


# ----- Lightning -----
class LitGPT(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, context=CONTEXT))

    def training_step(self, batch, batch_idx):
        return self.model(*batch)[1]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ByteBatches(torch.utils.data.IterableDataset):
    def __init__(self, tokens, seed: int):
        self.tokens, self.seed = tokens, seed

    def __iter__(self):
        return train_batches(self.tokens, batch_size=4, context=CONTEXT, seed=self.seed)


def gpt_loss(module, tokens) -> float:
    with torch.no_grad():
        return module.model(*next(train_batches(tokens, batch_size=16, context=CONTEXT, seed=99)))[1].item()


def fit(module, callbacks, tokens, seed: int) -> lightning.Trainer:
    trainer = lightning.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, callbacks=callbacks,
                                accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(ByteBatches(tokens, seed), batch_size=None))
    assert trainer.global_step == STEPS
    return trainer


def test_a_lightning_callback_averages_the_replicas_every_h_optimizer_steps_and_the_loss_falls(tokens):
    modules = [LitGPT(), LitGPT()]
    before = gpt_loss(modules[0], tokens)

    def train(index, transport, recorder):
        sync = lightning_integration.DecentralCallback("diloco", transport, **AVERAGING)
        trainer = fit(modules[index], [LightningRecorder(recorder), sync], tokens, seed=index)
        assert trainer.callback_metrics["sync/syncs"] == STEPS // H and sync.adoption.sync is None
        return sync.adoption.reports

    reports, recorders = run_peers(train)
    assert_averaged([m.model for m in modules], recorders, reports)
    assert gpt_loss(modules[0], tokens) < before - 0.5


class LightningLateJoin(lightning.Callback):
    def __init__(self, late: LateJoin, index: int):
        self.late, self.index = late, index

    def on_fit_start(self, trainer, pl_module):  # listed after the protocol's callback
        self.late.began(self.index)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.late.before_step(self.index, trainer.global_step)


def test_a_lightning_trainer_that_joins_late_stops_at_the_swarms_max_steps_with_the_others(tokens):
    """As test_a_trainer_that_joins_late_stops_at_the_swarms_max_steps_with_the_others, under Lightning."""
    modules, late = [LitGPT(), LitGPT()], LateJoin(at=H)

    def train(index, transport):
        sync = lightning_integration.DecentralCallback("diloco", transport, **AVERAGING)
        trainer = lightning.Trainer(max_steps=3 * H, callbacks=[sync, LightningLateJoin(late, index)],
                                    accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(modules[index], torch.utils.data.DataLoader(ByteBatches(tokens, index), batch_size=None))
        return trainer.global_step, [len(r.group) for r in sync.adoption.reports]

    assert late.run(train) == [(3 * H, [1, 2, 2]), (2 * H, [2, 2])]
    assert torch.equal(flat(modules[0].model), flat(modules[1].model))


def test_ddp_under_lightning_averages_the_gradients_of_the_backward_that_runs_inside_the_step(tokens):
    """Lightning's optimizer step runs the backward in its closure, after the step's pre-hooks: averaging
    there would average stale gradients and let replicas with different data drift apart."""
    modules = [LitGPT(), LitGPT()]

    def train(index, transport, recorder):
        sync = lightning_integration.DecentralCallback("ddp", transport)
        fit(modules[index], [LightningRecorder(recorder), sync], tokens, seed=index)
        return transport.bytes_sent

    sent, recorders = run_peers(train)
    assert [r.steps for r in recorders] == [STEPS, STEPS]
    n_params = sum(p.numel() for p in modules[0].parameters())
    assert sent == [STEPS * 4 * n_params] * 2  # one average of the float32 gradients per step
    assert torch.equal(flat(modules[0].model), flat(modules[1].model))
    assert not torch.equal(flat(modules[0].model), flat(LitGPT().model))  # they trained


class LightningCaptures(lightning.Callback):
    def __init__(self, sync):
        self.sync, self.state = sync, None

    def on_fit_start(self, trainer, pl_module):
        self.state = self.sync.adoption.sync.state_dict()


def fit_to(max_steps, tokens, folder=None, ckpt_path=None) -> tuple[lightning.Trainer, LightningCaptures]:
    """LitGPT fitted to `max_steps` under DiLoCo (H=2) on its own, from `ckpt_path` if given; with `folder`,
    Lightning checkpoints it every 3 steps there. (The trainer, what the protocol held when fitting began.)"""
    from lightning.pytorch.callbacks import ModelCheckpoint

    sync = lightning_integration.DecentralCallback("diloco", SoloTransport(), every=2)
    captures = LightningCaptures(sync)
    saves = [] if folder is None else [ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1,
                                                       filename="{step}")]
    trainer = lightning.Trainer(max_steps=max_steps, callbacks=[sync, captures, *saves], accelerator="cpu",
                                devices=1, logger=False, enable_checkpointing=folder is not None,
                                enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(ByteBatches(tokens, 0), batch_size=None), ckpt_path=ckpt_path)
    return trainer, captures


def saved_protocol_state(checkpoint: Path) -> dict:
    callbacks = torch.load(checkpoint, weights_only=True)["callbacks"]
    (saved,) = [state["protocol"] for key, state in callbacks.items() if key.startswith("DecentralCallback")]
    return saved


def test_a_lightning_fit_resumed_from_its_checkpoint_resumes_the_protocols_state_too(tokens, tmp_path):
    fit_to(3, tokens, folder=tmp_path)
    checkpoint = tmp_path / "step=3.ckpt"
    saved = saved_protocol_state(checkpoint)
    _, captures = fit_to(4, tokens, ckpt_path=str(checkpoint))
    assert_resumed(captures.state, saved, step=3)


def test_a_lightning_checkpoint_saved_after_fit_holds_the_protocols_state_as_the_run_ended(tokens, tmp_path):
    """`trainer.save_checkpoint` once `fit` returned (before: the protocol was gone by then, the checkpoint held
    none of its state, and a fit resumed from it began the protocol afresh at step 0 with no momentum)."""
    trainer, _ = fit_to(3, tokens)
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    saved = saved_protocol_state(tmp_path / "final.ckpt")
    _, captures = fit_to(4, tokens, ckpt_path=str(tmp_path / "final.ckpt"))
    assert_resumed(captures.state, saved, step=3)


# ----- the package itself -----
def test_importing_decentral_pulls_in_no_framework_and_a_missing_extra_says_what_to_install():
    code = """
import sys
import decentral, decentral.cli, decentral.integrations, decentral.integrations.adoption
assert not {"transformers", "lightning", "pytorch_lightning"} & set(sys.modules), sorted(sys.modules)
sys.modules["transformers"] = sys.modules["lightning"] = None  # as if the extras were not installed
for name in ("hf_trainer", "lightning"):
    try:
        __import__("decentral.integrations." + name)
    except ImportError as e:
        print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "decentral.integrations.hf_trainer needs transformers: pip install 'decentral[hf]'",
        "decentral.integrations.lightning needs lightning: pip install 'decentral[lightning]'",
    ]


def test_an_unknown_protocol_name_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown protocol 'dilcoo'; one of co2, ddp, diloco"):
        hf_trainer.DecentralCallback("dilcoo", SoloTransport())


@pytest.mark.parametrize("protocol, arguments, error, message", [
    ("diloco", {"evry": 2}, TypeError, "DiLoCo does not take .*: got an unexpected keyword argument 'evry'"),
    ("ddp", {"every": 50}, TypeError, "DDP does not take .*: got an unexpected keyword argument 'every'"),
    (object, {}, TypeError, r"object does not take \(model, optimizer, transport\): too many positional"),
    (3, {}, TypeError, r"protocol: a protocol's name \(co2, ddp, .*\) or a SyncProtocol class .*, got 3"),
    ("diloco", {"peers": 0}, ValueError, "peers: the number of peers"),
    ("diloco", {"peers": "2"}, ValueError, "peers: the number of peers"),
    ("diloco", {"wait_peers_s": 0}, ValueError, "wait_peers_s"),
    ("diloco", {"transport": None}, TypeError, "transport: a decentral Transport"),
    ("diloco", {"every": 0}, ValueError, r"protocol 'diloco': every \(H, inner steps per outer step\) must be an "),
    ("streaming", {"mix": 2.0}, ValueError, "protocol 'streaming': mix"),
])
def test_arguments_the_protocol_would_refuse_are_refused_when_the_callback_is_made(protocol, arguments, error,
                                                                                   message):
    """Not when training begins, minutes later, from deep inside the trainer."""
    transport = arguments.pop("transport", SoloTransport())
    with pytest.raises(error, match=message):
        lightning_integration.DecentralCallback(protocol, transport, **arguments)


def test_the_examples_train_two_peers_over_the_real_swarm(tmp_path):
    runs = {}
    for script in ("hf_trainer.py", "lightning_loop.py"):  # side by side: most of each is start-up
        out = (tmp_path / f"{script}.out").open("w+")
        runs[script] = out, subprocess.Popen([sys.executable, str(ROOT / "examples" / script), "--peers", "2",
                                              "--steps", "10", "--every", "5"], stdout=out, stderr=subprocess.STDOUT,
                                             text=True, cwd=ROOT)
    try:
        for script, (out, run) in runs.items():
            run.wait(timeout=120)
            out.seek(0)
            output = out.read()
            assert run.returncode == 0, f"{script}: {output[-3000:]}"
            assert output.count("2 DiLoCo rounds") == 2, f"{script}: {output[-3000:]}"
            assert "the peers' models are identical after the last round: True" in output, f"{script}: {output[-3000:]}"
    finally:
        for out, run in runs.values():
            if run.poll() is None:
                run.kill()
            out.close()
