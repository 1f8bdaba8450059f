"""What runs on each rank for tests/test_integrations.py: the recipes of Hugging Face's Trainer,
accelerate and Lightning, each trained on an unsharded model (DistributedDataParallel, as the
library wraps it) and on the same model sharded by autoshard, at 2 ranks of a torchrun
environment (the libraries create the process group)."""

import os

import torch

STEPS = 4  # optimizer steps of every recipe, each over 2 micro-batches
MAX_NORM = 0.5  # the gradients' norm is about 0.8 at first: clipping acts


def tiny_llama():
    """A 2-layer Hugging Face Llama, the same values on every rank and every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


class Tokens(torch.utils.data.Dataset):
    """64 sequences of 16 random tokens, labelled with themselves."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _full(model, sharded: bool) -> dict:
    state = model.full_state_dict() if sharded else model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def _hf_run(trainer_cls, shard, out: str, resume=None) -> dict:
    """The Trainer's standard recipe: default arguments but the CPU, the step count, the
    learning rate (to move the weights well past the tolerances in 4 steps), the
    batch, 2 accumulated micro-batches, clipping at ``MAX_NORM`` and a checkpoint every 2
    steps; ``resume``: from that checkpoint."""
    from transformers import TrainingArguments

    model = tiny_llama()
    if shard:
        from autoshard import autoshard

        model = autoshard(model)
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, use_cpu=True, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_grad_norm=MAX_NORM, logging_steps=1, save_steps=2,
        learning_rate=1e-3, report_to="none", seed=0, disable_tqdm=True)
    trainer = trainer_cls(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"steps": [h["step"] for h in logs], "losses": [h["loss"] for h in logs],
            "norms": [h["grad_norm"] for h in logs], "params": _full(model, shard),
            "global_step": trainer.state.global_step}


def trainer_worker(rank, world, tmp):
    """The Trainer on the unsharded model (accelerate wraps it in DDP); the Trainer of
    ``autoshard.front.integrations`` on the sharded one; and the sharded one again, resumed from
    the first run's checkpoint at step 2; the weights each checkpoint's
    ``model.safetensors`` holds at step 2, as ``from_pretrained`` reads them; and then
    accelerate's recipe (``accelerate_worker``)."""
    import transformers
    from transformers import LlamaForCausalLM

    from autoshard.front.integrations import Trainer

    out = {"eager": _hf_run(transformers.Trainer, False, f"{tmp}/eager"),
           "sharded": _hf_run(Trainer, True, f"{tmp}/sharded")}
    out["resumed"] = _hf_run(Trainer, True, f"{tmp}/resumed",
                             resume=f"{tmp}/sharded/checkpoint-2")
    out["saved"] = {m: _full(LlamaForCausalLM.from_pretrained(f"{tmp}/{m}/checkpoint-2"), False)
                    for m in ("eager", "sharded")}
    out["files"] = sorted(os.listdir(f"{tmp}/sharded/checkpoint-2"))
    out["accelerate"] = accelerate_worker(rank, world, tmp)
    return out


def _accelerate_run(shard: bool) -> dict:
    """accelerate's standard recipe: ``prepare(model, optimizer, dataloader, scheduler)``,
    ``accumulate``, ``backward``, ``clip_grad_norm_`` when the gradients are synced."""
    from accelerate import Accelerator

    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = tiny_llama()
    if shard:
        from autoshard import autoshard

        model = autoshard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / (2 * STEPS))
    data = torch.utils.data.DataLoader(Tokens(), batch_size=2)
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    losses, norms = [], []
    for i, batch in zip(range(2 * STEPS), data):
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(acc.gather(loss.detach()).mean().item())
    return {"losses": losses, "norms": norms, "wrapped": type(model).__name__,
            "params": _full(acc.unwrap_model(model), shard)}


def accelerate_worker(rank, world, tmp):
    """accelerate's recipe, unsharded and sharded; in the ranks the Trainer's recipes ran in
    (one spawn of the libraries for both), so from a fresh accelerate state each time."""
    from accelerate.state import AcceleratorState

    out = {}
    for mode, shard in (("eager", False), ("sharded", True)):
        AcceleratorState._reset_state(True)
        out[mode] = _accelerate_run(shard)
    return out


def _lightning_run(shard: bool) -> dict:
    """Lightning's recipe for FSDP2: ``ModelParallelStrategy``, the model sharded in
    ``configure_model`` over the strategy's data-parallel mesh; eager: the "ddp" strategy.
    2 accumulated batches, gradients clipped by norm."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                           torch.nn.Linear(16, 4))
            self.losses = []

        def configure_model(self):
            if shard:
                from autoshard import autoshard

                self.net = autoshard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, i):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                          torch.randn(64, 4, generator=g))
    strategy = (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if shard
                else "ddp")
    module = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=MAX_NORM,
                        accumulate_grad_batches=2)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return {"losses": module.losses, "params": _full(module.net, shard)}


def _fabric_run(shard: bool) -> dict:
    """Fabric's recipe: ``ModelParallelStrategy(parallelize_fn)``, where the model is
    sharded over the data-parallel mesh; eager: the "ddp" strategy. 2 micro-batches per step,
    the first under ``no_backward_sync``, gradients clipped by norm."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    def parallelize(model, mesh):
        from autoshard import autoshard

        return autoshard(model, mesh=mesh["data_parallel"])

    strategy = (ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
                if shard else "ddp")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1 + fabric.global_rank)
    losses = []
    for _ in range(STEPS):
        for micro in range(2):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
            losses.append(loss.item())
        fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": _full(getattr(model, "module", model), shard)}


def lightning_worker(rank, world, tmp):
    # Lightning reads a torchrun launch from these (and would start processes itself
    # without them)
    os.environ.update(GROUP_RANK="0", LOCAL_WORLD_SIZE=str(world))
    return {"eager": _lightning_run(False), "sharded": _lightning_run(True),
            "fabric_eager": _fabric_run(False), "fabric_sharded": _fabric_run(True)}

